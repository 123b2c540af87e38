"""Models build from presets without downloads; checkpoints are HF-format, atomic and hashed, and a path saved
again holds a complete checkpoint at every instant, for readers and across a saver's SIGKILL."""

import errno
import multiprocessing as mp
import os
import random
import shutil
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from factory.digest import dir_digest
from factory.models import checkpoint
from factory.models.build import build_model
from factory.models.checkpoint import load_checkpoint, read_meta, save_checkpoint
from factory.models.tokenizer import build_tokenizer


def _listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_tokenizer_round_trip_and_specials():
    tok = build_tokenizer()
    ids = tok("12+34=").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "12+34="
    assert tok("5", add_special_tokens=False).input_ids == [tok.convert_tokens_to_ids("5")]


def test_build_model_unknown_preset_lists_valid():
    with pytest.raises(ValueError, match="valid presets: .*tiny"):
        build_model("giant", build_tokenizer())


@pytest.mark.parametrize("preset", ["micro", "tiny-llama"])
def test_checkpoint_loads_with_transformers_and_is_identical(tmp_path, preset):
    tok = build_tokenizer()
    model = build_model(preset, tok, seed=3)
    info = save_checkpoint(model, tok, tmp_path / "ckpt", meta={"step": 5})
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in info.path.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(info.path)
    tok2 = PreTrainedTokenizerFast.from_pretrained(info.path)
    x = torch.tensor([tok2("1+2=").input_ids])
    assert torch.equal(model(x).logits, loaded(x).logits)
    assert read_meta(info.path) == {"step": 5}
    assert dir_digest(info.path) == (info.sha256, info.bytes)


def test_save_replaces_atomically_and_leaves_no_temp(tmp_path):
    tok = build_tokenizer()
    first = save_checkpoint(build_model("micro", tok, seed=0), tok, tmp_path / "ckpt")
    second = save_checkpoint(build_model("micro", tok, seed=1), tok, tmp_path / "ckpt")
    assert first.sha256 != second.sha256
    assert _listing(tmp_path) == sorted(["ckpt", ".ckpt.lock", os.readlink(tmp_path / "ckpt")])
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert dir_digest(tmp_path / "ckpt")[0] == second.sha256 and model is not None


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    tok = build_tokenizer()
    good = save_checkpoint(build_model("micro", tok), tok, tmp_path / "ckpt")

    class Broken:
        def save_pretrained(self, *a, **k):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(Broken(), tok, tmp_path / "ckpt")
    assert dir_digest(tmp_path / "ckpt")[0] == good.sha256
    assert _listing(tmp_path) == sorted(["ckpt", ".ckpt.lock", os.readlink(tmp_path / "ckpt")])


def test_a_full_disk_at_a_save_names_the_directory_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """safetensors reports ENOSPC as a SafetensorError naming no file; the save says "disk full: DIR" instead."""
    from safetensors import SafetensorError

    from factory.infra.disk import DiskFull

    tok = build_tokenizer()
    good = save_checkpoint(build_model("micro", tok), tok, tmp_path / "ckpt")

    class Full:
        def save_pretrained(self, *a, **k):
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')

    with pytest.raises(DiskFull) as e:
        save_checkpoint(Full(), tok, tmp_path / "ckpt")
    assert str(e.value) == f"disk full: {tmp_path}"
    monkeypatch.setenv("FACTORY_FAULT_ENOSPC", "checkpoint_save:1")  # the injected fault the CLI tests use
    with pytest.raises(DiskFull, match="disk full: "):
        save_checkpoint(build_model("micro", tok, seed=1), tok, tmp_path / "ckpt")
    assert dir_digest(tmp_path / "ckpt")[0] == good.sha256
    assert _listing(tmp_path) == sorted(["ckpt", ".ckpt.lock", os.readlink(tmp_path / "ckpt")])


def test_load_checkpoint_rejects_non_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------- replacing a checkpoint, with readers and kills
# A checkpoint path that is saved again (`final`, `sft-<fingerprint>`) must hold a complete checkpoint at every
# instant, whoever reads it and wherever its saver dies.


def _models():
    tok = build_tokenizer()
    return tok, build_model("micro", tok, seed=0), build_model("micro", tok, seed=1)


def _which(model, a, b) -> str:
    """'a' or 'b': whose weights `model` holds (anything else fails the caller's assertion)."""
    w = model.get_input_embeddings().weight
    for name, ref in (("a", a), ("b", b)):
        if torch.equal(w, ref.get_input_embeddings().weight):
            return name
    return "neither"


def _poll_reader(path, stop, out) -> None:
    # Mostly stats in a tight loop (what a poller of "is it there yet" does), and a full load now and then.
    misses = loads = 0
    while not stop.is_set():
        for _ in range(5000):
            if not (path / "config.json").is_file():
                misses += 1
        try:
            load_checkpoint(path)
            loads += 1
        except Exception as e:  # noqa: BLE001 - any failure of a reader is what this test looks for
            out.put(("error", misses, repr(e)))
            return
    out.put(("done", misses, loads))


@pytest.mark.slow
def test_reader_never_finds_the_checkpoint_missing_while_it_is_saved_again(tmp_path):
    tok, a, b = _models()
    path = tmp_path / "final"
    save_checkpoint(a, tok, path)
    ctx = mp.get_context("fork")  # the child has torch imported already
    stop, out = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_poll_reader, args=(path, stop, out))
    reader.start()
    try:
        for i in range(60):
            save_checkpoint(b if i % 2 == 0 else a, tok, path)
    finally:
        stop.set()
        result = out.get(timeout=120)
        reader.join(timeout=60)
    assert result[0] == "done" and result[1] == 0, result  # no instant without config.json, no failed load
    assert result[2] > 0
    # In this thread too, loads interleaved with saves always give one whole version, never a mix.
    seen = []
    for i in range(6):
        save_checkpoint(a if i % 2 == 0 else b, tok, path)
        model, _ = load_checkpoint(path)
        seen.append(_which(model, a, b))
    assert seen == ["a", "b"] * 3


# Filesystem calls a save makes; the kill hook counts them and dies just before the k-th.
_MUTATORS = [(os, "mkdir"), (os, "rename"), (os, "replace"), (os, "symlink"), (os, "unlink"), (os, "rmdir"),
             (shutil, "rmtree")]


def _save_killed_before_call(k, model, tok, path, send) -> None:
    n = [0]

    def hook(fn):
        def wrapped(*args, **kwargs):
            n[0] += 1
            if k is not None and n[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return wrapped

    for mod, name in _MUTATORS:
        setattr(mod, name, hook(getattr(mod, name)))
    if hasattr(checkpoint, "_exchange"):
        checkpoint._exchange = hook(checkpoint._exchange)
    save_checkpoint(model, tok, path)
    send.send(n[0])


def _legacy_dir(model, tok, path) -> None:
    """A checkpoint as older Factory versions left it: a real directory at `path`."""
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


@pytest.mark.slow
@pytest.mark.parametrize("before", ["absent", "saved", "legacy_dir"])
def test_saver_killed_at_every_step_leaves_the_old_or_the_new_checkpoint(tmp_path, before):
    tok, a, b = _models()
    ctx = mp.get_context("fork")
    digests = {}
    for name, m in (("a", a), ("b", b)):
        digests[dir_digest(save_checkpoint(m, tok, tmp_path / f"ref-{name}").path)[0]] = name

    def start_state(path):
        if before == "saved":
            save_checkpoint(a, tok, path)
        elif before == "legacy_dir":
            _legacy_dir(a, tok, path)
            digests[dir_digest(path)[0]] = "a"

    dry = tmp_path / "dry" / "ckpt"
    start_state(dry)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_save_killed_before_call, args=(None, b, tok, dry, send))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0 and recv.poll(0)
    n_calls = recv.recv()
    assert n_calls >= 2

    outcomes, leftovers = [], []
    for k in range(1, n_calls + 1):
        path = tmp_path / f"k{k}" / "ckpt"
        start_state(path)
        p = ctx.Process(target=_save_killed_before_call, args=(k, b, tok, path, send))
        p.start()
        p.join(timeout=120)
        assert p.exitcode == -signal.SIGKILL, (k, p.exitcode)
        if before == "absent" and not path.exists():
            outcomes.append("none")  # nothing was there to keep, and the new one was not finished
            continue
        try:
            model, _ = load_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - recorded, asserted below with every other kill point
            outcomes.append(f"k={k}: {e!r}")
            continue
        outcomes.append(digests.get(dir_digest(path)[0], "unknown"))
        assert outcomes[-1] == _which(model, a, b), (k, outcomes[-1])
        # The next save clears what the killed saver left and leaves only the checkpoint.
        info = save_checkpoint(a, tok, path)
        assert dir_digest(path)[0] == info.sha256
        left = sorted(q.name for q in path.parent.iterdir() if q.name not in ("ckpt", ".ckpt.lock"))
        if left != ([os.readlink(path)] if path.is_symlink() else []):
            leftovers.append((k, left))
    expected = {"absent": {"none", "b"}, "saved": {"a", "b"}, "legacy_dir": {"a", "b"}}[before]
    assert set(outcomes) <= expected, outcomes
    if before != "absent":
        assert len(set(outcomes)) == 2, outcomes  # the kill points span the swap: some before it, some after
    assert leftovers == []


def _save_forever(model_a, model_b, tok, path, ready) -> None:
    ready.set()
    i = 0
    while True:
        save_checkpoint(model_a if i % 2 else model_b, tok, path)
        i += 1


@pytest.mark.slow
def test_saver_killed_at_random_moments_always_leaves_a_loadable_checkpoint(tmp_path):
    tok, a, b = _models()
    path = tmp_path / "ckpt"
    digests = {dir_digest(save_checkpoint(m, tok, tmp_path / f"ref-{n}").path)[0]: n for n, m in (("a", a), ("b", b))}
    save_checkpoint(a, tok, path)
    t0 = time.perf_counter()
    save_checkpoint(a, tok, path)
    one_save = time.perf_counter() - t0
    rng = random.Random(0)
    ctx = mp.get_context("fork")
    for _ in range(25):
        ready = ctx.Event()
        p = ctx.Process(target=_save_forever, args=(a, b, tok, path, ready))
        p.start()
        assert ready.wait(timeout=120)
        time.sleep(rng.uniform(0, 3 * one_save))  # fault injection: where in its save loop the kill lands
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=60)
        model, _ = load_checkpoint(path)
        assert digests.get(dir_digest(path)[0]) == _which(model, a, b) in ("a", "b")


def test_digest_follows_the_link_and_names_files_relative_to_the_checkpoint(tmp_path):
    tok, a, _ = _models()
    info = save_checkpoint(a, tok, tmp_path / "ckpt")
    assert (tmp_path / "ckpt").is_symlink()
    copy = shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")  # a plain directory with the same files
    assert dir_digest(tmp_path / "ckpt") == dir_digest(copy) == (info.sha256, info.bytes)


def test_legacy_directory_is_replaced_where_the_filesystem_cannot_exchange(tmp_path, monkeypatch):
    tok, a, b = _models()
    path = tmp_path / "ckpt"
    _legacy_dir(a, tok, path)

    def unsupported(x, y):
        raise OSError(errno.EINVAL, "RENAME_EXCHANGE unsupported")

    monkeypatch.setattr(checkpoint, "_exchange", unsupported)  # as on NFS
    info = save_checkpoint(b, tok, path)
    assert path.is_symlink() and dir_digest(path)[0] == info.sha256
    assert _which(load_checkpoint(path)[0], a, b) == "b"
    assert _listing(tmp_path) == sorted(["ckpt", ".ckpt.lock", os.readlink(path)])


def test_remove_checkpoint_deletes_the_link_its_version_and_leftovers(tmp_path):
    tok, a, _ = _models()
    keep = save_checkpoint(a, tok, tmp_path / "keep")
    save_checkpoint(a, tok, tmp_path / "ckpt")
    (tmp_path / ".ckpt.v-deadbeef").mkdir()  # a killed save's partial version
    checkpoint.remove_checkpoint(tmp_path / "ckpt")
    rest = ["keep", ".keep.lock", os.readlink(keep.path), ".ckpt.lock"]  # empty lock files stay
    assert _listing(tmp_path) == sorted(rest)
    _legacy_dir(a, tok, tmp_path / "plain")
    checkpoint.remove_checkpoint(tmp_path / "plain")
    checkpoint.remove_checkpoint(tmp_path / "never-saved")
    assert _listing(tmp_path) == sorted([*rest, ".plain.lock", ".never-saved.lock"])


def test_a_version_being_read_is_not_deleted_until_the_reader_is_done(tmp_path):
    tok, a, b = _models()
    path = tmp_path / "ckpt"
    save_checkpoint(a, tok, path)
    version = path.resolve()
    with checkpoint._reading(version) as pinned:  # what load_checkpoint holds while it reads
        assert pinned
        save_checkpoint(b, tok, path)
        assert version.is_dir() and path.resolve() != version
    save_checkpoint(a, tok, path)  # the next save sweeps it
    assert not version.exists()
    assert _listing(tmp_path) == sorted(["ckpt", ".ckpt.lock", os.readlink(path)])
