"""Resume points: written atomically in the background, verified on load, torn or corrupt ones skipped, the last K
kept; a loop resumed from one continues exactly (sync: bit-identical weights and optimizer state)."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch

from factory.config import ExperimentSpec
from factory.core.loop import train_rl
from factory.core.resume import ResumeWriter, capture, latest, load, points, rng_state, verify, write
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem

# Answers are the empty string: a completion is right when its first token is <eos>, so rewards are mixed
# from the first step and the updates are real.
PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(40)]


def tiny_state(step: int = 3):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return capture(step, model, opt, rng_state(torch.Generator().manual_seed(5)), {"stream": {"next": 7}},
                   {"blender": {"pos": 11}})


def test_write_then_load_round_trips_every_part(tmp_path):
    state = tiny_state()
    path = write(state, tmp_path, keep=2)
    assert path.name == "step-000003" and verify(path) is None
    back = load(path)
    assert back.step == 3 and back.loop == {"stream": {"next": 7}} and back.extra == {"blender": {"pos": 11}}
    assert all(torch.equal(back.model[k], v) for k, v in state.model.items())
    assert torch.equal(back.optimizer["state"][0]["exp_avg"], state.optimizer["state"][0]["exp_avg"])
    assert torch.equal(back.rng["torch"], state.rng["torch"]) and back.rng["python"] == state.rng["python"]
    assert torch.equal(back.rng["shuffle"], state.rng["shuffle"])


def test_capture_copies_so_later_training_does_not_change_the_snapshot():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = capture(1, model, opt, rng_state(), {})
    before = state.model["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(state.model["weight"], before)


def test_torn_and_corrupt_points_are_skipped_for_the_previous_one(tmp_path):
    for step in (2, 4, 6):
        write(tiny_state(step), tmp_path, keep=5)
    (tmp_path / "step-000006" / "optimizer.pt").write_bytes(b"garbage")  # corrupted after the fact
    (tmp_path / "step-000004" / "MANIFEST.json").unlink()  # a write that never finished
    said: list[str] = []
    state, path = latest(tmp_path, log=said.append)
    assert state.step == 2 and path.name == "step-000002"
    assert "step-000006 skipped: optimizer.pt does not match its sha256" in said[0]
    assert "step-000004 skipped: no manifest" in said[1]


def test_a_resume_point_with_the_earlier_manifest_format_still_loads_and_is_still_checked(tmp_path):
    path = write(tiny_state(4), tmp_path, keep=2)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert manifest["format"] == 2 and manifest["step"] == 4
    assert [e["path"] for e in manifest["files"]] == ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"]
    old = {"format": 1, "step": 4, "files": {e["path"]: {"sha256": e["sha256"], "bytes": e["bytes"]}
                                             for e in manifest["files"]}}  # as resume points were written before
    (path / "MANIFEST.json").write_text(json.dumps(old, indent=1))
    assert verify(path) is None and latest(tmp_path, log=lambda _: None)[0].step == 4
    (path / "rng.pt").write_bytes(b"garbage")
    assert verify(path) == "rng.pt does not match its sha256 in the manifest (torn or corrupted)"


def test_keeps_the_newest_k_and_cleans_temp_dirs_of_dead_writers(tmp_path):
    (tmp_path / ".step-000001.tmp-999-1").mkdir(parents=True)  # what a killed writer leaves
    for step in range(1, 6):
        write(tiny_state(step), tmp_path, keep=2)
    assert [p.name for p in points(tmp_path)] == ["step-000004", "step-000005"]
    assert not list(tmp_path.glob(".*tmp*"))


def test_background_writer_stalls_only_for_the_copy_and_reports_write_errors(tmp_path):
    gate = threading.Event()
    writer = ResumeWriter(tmp_path / "r", keep=2, before_write=lambda step: gate.wait(10))
    writer.submit(lambda: tiny_state(1))
    assert len(writer.stall_ms) == 1 and not points(tmp_path / "r")  # returned while the write waits
    gate.set()
    writer.wait()
    assert [p.name for p in points(tmp_path / "r")] == ["step-000001"]
    bad = ResumeWriter(tmp_path / "r2", keep=1, before_write=lambda step: 1 / 0)
    bad.submit(lambda: tiny_state(2))
    with pytest.raises(Exception, match="writing a resume point .* failed: ZeroDivisionError"):
        bad.wait()


def test_rng_state_covers_python_numpy_and_torch():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    from factory.core.resume import set_rng_state

    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


class FakeCudaRng:
    """Two CUDA devices' generators as torch.cuda shows them to a process that has used CUDA: states read and set
    per device (kept on the CPU: there is no GPU here)."""

    def __init__(self, monkeypatch, devices: int = 2):
        self.states = [torch.Generator().manual_seed(100 + i).get_state() for i in range(devices)]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.set_all)

    def set_all(self, states) -> None:
        assert len(states) == len(self.states)
        self.states = [s.clone() for s in states]


def test_a_resume_point_round_trips_every_cuda_devices_rng_state(monkeypatch, tmp_path):
    """Where CUDA is in use, the resume point holds each device's RNG state (written, loaded, restored): sampling
    on the GPU after a resume continues the same random stream."""
    from factory.core.resume import set_rng_state

    cuda = FakeCudaRng(monkeypatch)
    saved = [s.clone() for s in cuda.states]
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = capture(1, model, opt, rng_state(), {})
    assert [torch.equal(a, b) for a, b in zip(state.rng["cuda"], saved, strict=True)] == [True, True]
    cuda.states = [torch.Generator().manual_seed(7).get_state() for _ in range(2)]  # the GPUs kept drawing
    set_rng_state(load(write(state, tmp_path / "resume", keep=1)).rng)
    assert all(torch.equal(a, b) for a, b in zip(cuda.states, saved, strict=True))


def test_an_old_resume_point_without_cuda_states_still_loads_where_cuda_is_in_use(monkeypatch, tmp_path):
    """Resume points written before CUDA states were kept (or on a CPU) have none: they load, and the CUDA
    generators are left as they are."""
    from factory.core.resume import set_rng_state

    old = load(write(tiny_state(), tmp_path / "resume", keep=1))  # taken where CUDA was not in use
    assert "cuda" not in old.rng
    cuda = FakeCudaRng(monkeypatch)
    before = [s.clone() for s in cuda.states]
    set_rng_state(old.rng)
    assert all(torch.equal(a, b) for a, b in zip(cuda.states, before, strict=True))


def test_cuda_rng_states_for_other_gpus_are_refused_and_ignored_without_a_gpu(monkeypatch):
    """A point taken with 2 GPUs visible cannot restore them where 1 is (refused, saying why); on a machine without
    CUDA its CPU state still loads (nothing draws from a CUDA generator there)."""
    from factory.core.resume import ResumeError, set_rng_state

    FakeCudaRng(monkeypatch, devices=2)
    state = rng_state()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ResumeError, match=r"RNG states of 2 CUDA device\(s\), but this process sees 1"):
        set_rng_state(state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("no CUDA to restore"))
    drawn = torch.rand(3)
    set_rng_state(state)
    assert "cuda" in state and torch.equal(torch.rand(3), drawn)


class Saver:
    """A Checkpoints policy that keeps resume points in memory, every `every` steps."""

    def __init__(self, every: int):
        self.every, self.states = every, {}

    def due(self, done: int) -> bool:
        return done % self.every == 0

    def stopping(self) -> bool:
        return False

    def save(self, make_state, wait: bool = False) -> None:
        s = make_state()
        self.states[s.step] = s


def _spec(mode: str, steps: int, lora: dict | None = None, **buffer) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "model": {"preset": "micro"}, "task": {"digits": [2], "n_train": 2000, "n_eval": 60},
        "algorithm": {"group_size": 4, "lr": 1e-3, "kl_coef": 0.05},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 4},
        "trainer": {"minibatches": 2, "lora": lora},
        "buffer": buffer or {"policy": "bound", "max_staleness": 1},
        "schedule": {"mode": mode, "steps": steps, "wait_timeout_s": 60, "log_rollouts": 4}})


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8, "dropout": 0.1}], ids=["full", "lora"])
def test_sync_resume_is_bit_identical_to_an_uninterrupted_run(lora):
    tok = build_tokenizer()
    spec = _spec("sync", 6, lora=lora)
    straight = build_model("micro", tok, seed=0)
    saver = Saver(every=3)
    full = train_rl(spec, straight, tok, PROBLEMS, checkpoints=saver)
    if lora is not None:  # the resume point holds the frozen base and the adapters; the optimizer only the adapters
        assert any(".lora_A." in k for k in saver.states[3].model)
        assert len(saver.states[3].optimizer["state"]) == 2 * 14  # A and B of 7 projections x 2 layers
    # A second process would start from the run's start checkpoint and load the resume point of step 3.
    resumed_model = build_model("micro", tok, seed=0)  # the run's start: the default KL reference
    rest = train_rl(spec, resumed_model, tok, PROBLEMS, resume=saver.states[3])
    assert [r.step for r in rest] == [4, 5, 6]
    assert [r.loss for r in rest] == [r.loss for r in full[3:]]
    assert [r.reward_mean for r in rest] == [r.reward_mean for r in full[3:]]
    for (k, a), b in zip(straight.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    if lora is not None:  # both left plain and merged; the adapters did move the projections
        start = build_model("micro", tok, seed=0).state_dict()
        assert not torch.equal(straight.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                               start["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.slow
def test_async_resume_trains_every_draw_once_including_those_buffered_or_in_flight():
    tok = build_tokenizer()
    spec = _spec("async", 6, policy="bound", max_staleness=2)
    saver = Saver(every=3)
    first = train_rl(spec, build_model("micro", tok, seed=0), tok, PROBLEMS, checkpoints=saver)
    state = saver.states[3]
    producer = state.loop["producer"]
    buffered = {g["meta"]["draw"] for g in producer["buffer"]["groups"]}
    pending = set(producer["stream"]["pending"])
    assert buffered <= pending  # every buffered group is a pending draw
    trained_before = {s["draw"] for r in first[:3] for s in r.samples}
    assert len(trained_before) == 3 * 4
    rest = train_rl(spec, build_model("micro", tok, seed=0), tok, PROBLEMS, resume=state)
    trained_after = [s["draw"] for r in rest for s in r.samples if s["sample"] == 0]
    assert len(trained_after) == len(set(trained_after)) == 3 * 4
    assert not trained_before & set(trained_after)
    # Every draw made before the resume point was trained before it or is pending (buffered or in flight),
    # and the pending ones are trained after it: none skipped, none twice.
    assert trained_before | pending == set(range(producer["stream"]["next"]))
    assert not trained_before & pending
    assert pending <= set(trained_after)


class Counter:
    """Something stateful the run drives (as a data blender will be)."""

    def __init__(self):
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


@pytest.mark.slow
def test_stateful_parts_are_saved_and_restored_by_name():
    tok = build_tokenizer()
    spec = _spec("sync", 4)
    counter, saver = Counter(), Saver(every=2)
    train_rl(spec, build_model("micro", tok, seed=0), tok, PROBLEMS, checkpoints=saver,
               on_step=lambda r: setattr(counter, "seen", counter.seen + 1), stateful={"counter": counter})
    assert saver.states[2].extra == {"counter": {"seen": 2}} and saver.states[4].extra == {"counter": {"seen": 4}}
    fresh = Counter()
    train_rl(spec, build_model("micro", tok, seed=0), tok, PROBLEMS, resume=saver.states[2],
               stateful={"counter": fresh}, on_step=lambda r: setattr(fresh, "seen", fresh.seen + 1))
    assert fresh.seen == 4
    with pytest.raises(ValueError, match="holds no state for 'blender'"):
        train_rl(spec, build_model("micro", tok, seed=0), tok, PROBLEMS, resume=saver.states[2],
                   stateful={"blender": Counter()})
