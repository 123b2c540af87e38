"""Weight sync: lossless full/delta encodings, verification, and the three transports.

Bit-exactness is checked on raw bytes (NaN payloads, -0.0, inf included). Processes and threads
only wait with bounds (queue gets, joins, the transports' own timeouts); nothing sleeps.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.core.weights import (
    InProcessTransport,
    SharedDirTransport,
    WeightChecksumError,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    WeightSyncTimeout,
    WeightUpdate,
    WeightVersionMismatch,
    apply_update,
    encode_delta,
    encode_full,
)
from factory.core.weights.transport import gc_versions, plan_chain

WAIT = 30.0  # bound for anything that must happen; a hang fails the test instead of blocking the suite

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000,
             torch.float64: 0x7FF0000000000000}


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert raw(got[k]) == raw(want[k]), f"tensor {k} differs in its bits"


def random_bits(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """n elements with uniformly random bit patterns (floats: NaN payloads, inf, -0.0, subnormals)."""
    it = _INT[torch.empty((), dtype=dtype).element_size()]
    if it == torch.uint8:
        return torch.randint(0, 256, (n,), dtype=it, generator=g).view(dtype)
    info = torch.iinfo(it)
    return torch.randint(info.min, info.max, (n,), dtype=it, generator=g).view(dtype)


def specials(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """NaN (with payloads, both signs), +-inf, +-0.0 for floats; extremes for ints."""
    if dtype.is_floating_point:
        it = _INT[torch.empty((), dtype=dtype).element_size()]
        nan_payload = (random_bits(n, it, g) | _EXP_MASK[dtype] | 1).view(dtype)
        fixed = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], dtype=dtype)
        pick = torch.randint(0, 2, (n,), generator=g).bool()
        return torch.where(pick, nan_payload, fixed[torch.randint(0, 5, (n,), generator=g)])
    info = torch.iinfo(dtype)
    fixed = torch.tensor([info.min, info.max, 0, -1 if info.min < 0 else 1], dtype=dtype)
    return fixed[torch.randint(0, 4, (n,), generator=g)]


def changed_copy(base: torch.Tensor, frac: float, g: torch.Generator) -> torch.Tensor:
    """base with a random `frac` of elements changed: lowest bit flipped (a 1-ulp step), random bits,
    or special values."""
    flat = base.clone().reshape(-1)
    n = flat.numel()
    mask = torch.rand(n, generator=g) < frac
    kind = torch.randint(0, 3, (n,), generator=g)
    it = _INT[flat.element_size()]
    bits = flat.view(it)
    ulp = bits ^ torch.ones((), dtype=it)
    candidates = torch.stack([ulp, random_bits(n, base.dtype, g).view(it), specials(n, base.dtype, g).view(it)])
    new_bits = torch.where(mask, candidates.gather(0, kind.unsqueeze(0)).squeeze(0), bits)
    return new_bits.view(base.dtype).reshape(base.shape)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64]
SHAPES = [(), (0,), (1,), (7,), (33, 5), (4, 3, 50), (1000,)]


@st.composite
def state_pairs(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    specs = draw(st.lists(st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES),
                                    st.sampled_from([0.0, 0.002, 0.05, 0.3, 0.6, 1.0])), min_size=1, max_size=5))
    old, new = {}, {}
    for i, (dtype, shape, frac) in enumerate(specs):
        n = torch.Size(shape).numel()
        base = random_bits(n, dtype, g)
        base = torch.where(torch.rand(n, generator=g) < 0.2, specials(n, dtype, g), base).reshape(shape)
        old[f"t{i}"] = base
        new[f"t{i}"] = changed_copy(base, frac, g)
    return old, new


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True)
@given(state_pairs())
def test_delta_round_trip_is_bit_exact(pair):
    old, new = pair
    before = {k: raw(v) for k, v in old.items()}
    update = WeightUpdate.from_bytes(encode_delta(old, new, version=5, base_version=4).to_bytes())
    assert update.encoding == "delta" and update.base_version == 4
    assert_bit_exact(apply_update(old, update, state_version=4), new)
    assert {k: raw(v) for k, v in old.items()} == before, "apply without inplace must not touch the base"
    work = {k: v.clone() for k, v in old.items()}
    out = apply_update(work, update, state_version=4, inplace=True)
    assert_bit_exact(out, new)
    assert all(out[k] is work[k] for k in new), "inplace apply reuses the caller's tensors"
    full = WeightUpdate.from_bytes(encode_full(new, version=5).to_bytes())
    assert_bit_exact(apply_update(None, full), new)


def test_delta_schemes_and_sizes():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 512, generator=g) * 0.02).bfloat16()
    # An Adam-sized step in fp32 master weights, cast to bf16: most bf16 values do not move.
    moved = (w.float() + 1e-6 * torch.randn(256, 512, generator=g).sign()).bfloat16()
    old = {"w": w, "norm": torch.ones(512), "dense": torch.randn(1000, generator=g), "gone": torch.zeros(3)}
    new = {"w": moved, "norm": torch.ones(512), "dense": torch.randn(1000, generator=g), "grown": torch.zeros(4),
           "gone": torch.zeros(2, 2)}
    update = encode_delta(old, new, 2, 1)
    schemes = {t.name: t.scheme for t in update.tensors}
    assert schemes == {"w": "sparse", "norm": "same", "dense": "dense", "grown": "raw", "gone": "raw"}
    w_payload = next(t for t in update.tensors if t.name == "w")
    assert len(w_payload.data) * 20 < w.numel() * 2
    assert_bit_exact(apply_update(old, update, 1), new)


def test_tied_weights_travel_once_and_stay_tied():
    g = torch.Generator().manual_seed(3)
    emb = (torch.randn(50, 16, generator=g) * 0.02).bfloat16()
    old = {"embed": emb, "mid": torch.randn(8, generator=g), "lm_head": emb}
    emb2 = changed_copy(emb, 0.1, g)
    new = {"embed": emb2, "mid": old["mid"] + 1, "lm_head": emb2}
    for update in (encode_full(new, 2), encode_delta(old, new, 2, 1)):
        assert [t.scheme for t in update.tensors][2] == "alias"
        assert update.tensors[2].data == b""
    delta = encode_delta(old, new, 2, 1)
    out = apply_update(old, delta, 1)
    assert_bit_exact(out, new)
    assert out["lm_head"] is out["embed"]
    # In place into a tied state, even from an update that sends both (an untied publisher): applied once.
    untied_new = {"embed": emb2, "mid": new["mid"], "lm_head": emb2.clone()}
    tied = {"embed": emb.clone(), "mid": old["mid"].clone()}
    tied["lm_head"] = tied["embed"]
    out = apply_update(tied, encode_delta(old, untied_new, 2, 1), 1, inplace=True)
    assert_bit_exact(out, new)
    assert out["lm_head"] is tied["embed"] is out["embed"]
    # In place into an untied state from a tied update: both of its tensors get the bits.
    untied = {"embed": emb.clone(), "mid": old["mid"].clone(), "lm_head": emb.clone()}
    out = apply_update(untied, delta, 1, inplace=True)
    assert_bit_exact(out, new)
    assert out["lm_head"] is untied["lm_head"] and out["embed"] is untied["embed"]


def test_delta_against_wrong_base_is_rejected_naming_both_versions():
    g = torch.Generator().manual_seed(1)
    v1 = {"w": torch.randn(10, generator=g)}
    v2 = {"w": v1["w"] + 1}
    v3 = {"w": v2["w"] + 1}
    update = encode_delta(v2, v3, version=3, base_version=2)
    with pytest.raises(WeightVersionMismatch, match=r"delta v3 is against base v2, but the state given is v1"):
        apply_update(v1, update, state_version=1)
    with pytest.raises(WeightVersionMismatch, match=r"delta v3 needs the state of base v2, but no state"):
        apply_update(None, update)
    with pytest.raises(ValueError, match="greater than its base"):
        encode_delta(v2, v3, version=2, base_version=2)
    # Same version number, other contents (e.g. another run): the checksums catch it.
    with pytest.raises(WeightChecksumError, match=r"tensor 'w' of update v3 \(dense\).*base really"):
        apply_update(v1, update, state_version=2)


@pytest.mark.parametrize("encoding", ["full", "delta"])
def test_corrupt_payload_is_detected(encoding):
    g = torch.Generator().manual_seed(2)
    old = {"w": (torch.randn(64, 64, generator=g) * 0.02).bfloat16()}
    new = {"w": changed_copy(old["w"], 0.05, g)}
    update = encode_full(new, 2) if encoding == "full" else encode_delta(old, new, 2, 1)
    blob = update.to_bytes()
    blob[-5] ^= 0x40  # one bit, inside the last tensor's payload
    with pytest.raises(WeightChecksumError, match="tensor 'w' of update v2"):
        apply_update(old, WeightUpdate.from_bytes(blob), 1)


def test_chain_planning_and_garbage_collection():
    # version -> base (None: full). Versions need not be consecutive.
    avail = {10: None, 20: 10, 30: 20, 40: None, 50: 40}
    assert plan_chain(avail, 30) == [40, 50]  # a full one breaks the chain: start from it
    assert plan_chain(avail, 40) == [50]
    assert plan_chain(avail, None) == [40, 50]
    assert plan_chain(avail, 50) == []
    assert plan_chain({30: 20, 40: 30}, 10) is None  # history needed is gone
    assert gc_versions(avail, keep=2) == [10, 20, 30]
    assert gc_versions({1: None, 2: 1, 3: 2, 4: 3, 5: 4}, keep=2) == []  # never before the newest full one


def make_states(n_versions: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Versions 0..n of a small model: bf16 matrices that move a little, an fp32 vector, an int buffer."""
    g = torch.Generator().manual_seed(seed)
    master = {"w1": torch.randn(64, 96, generator=g) * 0.02, "w2": torch.randn(96, 32, generator=g) * 0.02}
    states = []
    for v in range(n_versions + 1):
        if v:
            for t in master.values():
                t.add_(1e-4 * torch.randn(t.shape, generator=g))
        states.append({"w1": master["w1"].bfloat16(), "w2": master["w2"].bfloat16(),
                       "bias": master["w2"][0].clone(), "steps": torch.tensor([v, -v], dtype=torch.int64)})
    return states


def test_in_process_transport_chains_late_joiners_and_resync():
    states = make_states(8)
    channel = InProcessTransport(keep=2)
    pub = WeightPublisher(channel, full_every=3)
    follower = WeightSubscriber(channel, "follower")
    encodings = []
    for v in range(1, 6):
        encodings.append(pub.publish(states[v], v).encoding)
        assert follower.poll(timeout=WAIT) == v
        assert_bit_exact(follower.state, states[v])
    assert encodings == ["full", "delta", "delta", "full", "delta"]
    late = WeightSubscriber(channel, "late")
    assert late.poll(timeout=WAIT) == 5  # from the full v4, then the delta v5
    assert_bit_exact(late.state, states[5])

    got: dict = {}
    t = threading.Thread(target=lambda: got.update(v=follower.resync(timeout=WAIT)))
    t.start()
    # The resync request is registered before the subscriber waits; publish once it is there.
    assert _bounded(lambda: bool(channel._resync))
    assert pub.publish(states[6], 6).encoding == "full"  # a delta was due; the request forced a full one
    t.join(WAIT)
    assert got == {"v": 6}
    assert_bit_exact(follower.state, states[6])


def _bounded(cond, timeout: float = WAIT) -> bool:
    """Poll `cond` until true or `timeout` s pass (a bounded wait, not a sleep that hopes)."""
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        tick.wait(0.001)
    return True


def test_subscriber_times_out_loudly():
    channel = InProcessTransport()
    sub = WeightSubscriber(channel, "rollout-0")
    with pytest.raises(WeightSyncTimeout, match=r"subscriber 'rollout-0' waited 0.2s for a version newer than None "
                                                 r"from the publisher over in-process channel; latest seen: None"):
        sub.poll(timeout=0.2)


def test_shared_dir_keeps_history_and_times_out(tmp_path):
    states = make_states(7)
    pub = WeightPublisher(SharedDirTransport(tmp_path, keep=2), full_every=3)
    for v in range(1, 8):
        pub.publish(states[v], v)
    names = sorted(p.name for p in tmp_path.glob("*.fwu"))
    # fulls at 1, 4, 7; the newest full one and the last 2 versions stay.
    assert names == ["v000000000006-delta-000000000005.fwu", "v000000000007-full.fwu"]
    sub = WeightSubscriber(SharedDirTransport(tmp_path), "late")
    assert sub.poll(timeout=WAIT) == 7
    assert_bit_exact(sub.state, states[7])
    with pytest.raises(WeightSyncTimeout, match=rf"subscriber 'late' waited 0.2s for a version newer than 7 from "
                                                 rf"the publisher over shared dir {tmp_path}; latest seen: 7"):
        sub.poll(timeout=0.2)
    with pytest.raises(Exception, match="not newer"):
        WeightPublisher(SharedDirTransport(tmp_path)).publish(states[3], 3)


def test_shared_dir_resync_request_forces_a_full_update(tmp_path):
    states = make_states(3)
    pub = WeightPublisher(SharedDirTransport(tmp_path), full_every=0)
    pub.publish(states[1], 1)
    sub = WeightSubscriber(SharedDirTransport(tmp_path), "rollout-7")
    sub.poll(timeout=WAIT)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(v=sub.resync(timeout=WAIT)))
    t.start()
    assert _bounded(lambda: (tmp_path / "resync-rollout-7.req").exists())
    assert pub.publish(states[2], 2).encoding == "full"
    t.join(WAIT)
    assert got == {"v": 2} and not list(tmp_path.glob("*.req"))
    assert_bit_exact(sub.state, states[2])
    assert pub.publish(states[3], 3).encoding == "delta"  # the request was served once


def test_shared_dir_detects_a_corrupt_file(tmp_path):
    states = make_states(2)
    pub = WeightPublisher(SharedDirTransport(tmp_path), full_every=0)
    pub.publish(states[1], 1)
    sub = WeightSubscriber(SharedDirTransport(tmp_path), "s")
    sub.poll(timeout=WAIT)
    pub.publish(states[2], 2)
    (f,) = tmp_path.glob("v000000000002-*.fwu")
    blob = bytearray(f.read_bytes())
    blob[-3] ^= 1
    f.write_bytes(blob)
    with pytest.raises(WeightChecksumError):
        sub.poll(timeout=WAIT)
    assert sub.version is None  # the state may be half-written: only a full update is accepted now


# ---------------------------------------------------------------------------------------------
# real processes (spawn): shared dir and torch.distributed


def _dir_subscriber(path: str, n_lockstep: int, final: int, acks) -> None:
    try:
        torch.set_num_threads(1)
        states = make_states(final)
        sub = WeightSubscriber(SharedDirTransport(path), "proc-1")
        for _ in range(n_lockstep):
            v = sub.poll(timeout=WAIT)
            acks.put(("ok", v, raw_all(sub.state) == raw_all(states[v])))
        while sub.version != final:  # a burst: catch up through whatever the directory still holds
            sub.poll(timeout=WAIT)
        acks.put(("ok", sub.version, raw_all(sub.state) == raw_all(states[final])))
    except BaseException:
        acks.put(("error", traceback.format_exc(), False))


def raw_all(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: raw(v) for k, v in state.items()}


@pytest.mark.slow
def test_shared_dir_across_processes_delivers_every_version(tmp_path):
    n_lockstep, final = 5, 12
    states = make_states(final)
    ctx = mp.get_context("spawn")
    acks = ctx.Queue()
    proc = ctx.Process(target=_dir_subscriber, args=(str(tmp_path), n_lockstep, final, acks))
    proc.start()
    try:
        pub = WeightPublisher(SharedDirTransport(tmp_path, keep=2), full_every=4)
        for v in range(1, n_lockstep + 1):
            pub.publish(states[v], v)
            status, got, exact = acks.get(timeout=WAIT)
            assert status == "ok", got
            assert (got, exact) == (v, True)
        for v in range(n_lockstep + 1, final + 1):
            pub.publish(states[v], v)
        status, got, exact = acks.get(timeout=WAIT)
        assert status == "ok", got
        assert (got, exact) == (final, True)
    finally:
        proc.join(WAIT)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def _dist_worker(rank: int, port: int, scenario: str, results, done) -> None:
    import torch.distributed as dist

    from factory.core.weights import TorchDistTransport

    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=WAIT))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=WAIT))
        transport = TorchDistTransport(src=0, chunk_bytes=4096)  # small chunks: several payload broadcasts
        states = make_states(4)
        if scenario == "deliver":
            if rank == 0:
                pub = WeightPublisher(transport, full_every=0)
                encodings = [pub.publish(states[v], v, timeout=WAIT).encoding for v in (1, 2, 3, 4)]
                try:  # rank 1 restarts its transport (exchange #1) while this one is at #5: both must raise
                    pub.publish(states[4], 5, timeout=WAIT)
                except WeightSyncError as e:
                    encodings.append(str(e))
                results.put((rank, "ok", encodings))
            else:
                sub = WeightSubscriber(transport, "rank-1")
                exact = []
                for v in (1, 2, 3):
                    assert sub.poll(timeout=WAIT) == v
                    exact.append(raw_all(sub.state) == raw_all(states[v]))
                assert sub.resync(timeout=WAIT) == 4
                exact.append(raw_all(sub.state) == raw_all(states[4]))
                try:
                    WeightSubscriber(TorchDistTransport(src=0), "rank-1-restarted").poll(timeout=WAIT)
                except WeightSyncError as e:
                    exact.append(str(e))
                results.put((rank, "ok", exact))
        else:  # "silent publisher": rank 0 never publishes
            if rank == 1:
                sub = WeightSubscriber(transport, "rank-1")
                try:
                    sub.poll(timeout=2.0)
                    results.put((rank, "no timeout", None))
                except WeightSyncTimeout as e:
                    results.put((rank, "ok", str(e)))
            else:
                done.wait(WAIT)
        if scenario == "deliver":
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the queue's feeder thread before the hard exit below
        os._exit(0)  # a group with a timed-out collective in flight may not tear down cleanly


def _run_dist(scenario: str) -> dict[int, tuple[str, object]]:
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    # this process hosts the group's store, on a port the kernel picks at bind (one found free and bound later by a
    # rank was, under load, taken by other work in between)
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_dist_worker, args=(r, port, scenario, results, done)) for r in range(2)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    try:
        want = 2 if scenario == "deliver" else 1
        while len(out) < want:
            rank, status, value = results.get(timeout=WAIT)
            out[rank] = (status, value)
    except queue.Empty:
        pass
    finally:
        done.set()
        for p in procs:
            p.join(WAIT)
            if p.is_alive():
                p.kill()
    return out


@pytest.mark.slow
def test_torch_distributed_gloo_broadcast_delivers_deltas_bit_exactly():
    out = _run_dist("deliver")
    assert out.get(0, (None, None))[0] == "ok", out
    assert out.get(1, (None, None))[0] == "ok", out
    assert out[0][1][:4] == ["full", "delta", "delta", "full"]  # the 4th: the subscriber asked to resync
    assert out[1][1][:4] == [True, True, True, True]
    for rank in (0, 1):  # an exchange out of order fails on every rank instead of hanging or mixing payloads
        assert "rank 1 is at exchange #1, this rank at #5" in out[rank][1][4] or \
            "rank 0 is at exchange #5, this rank at #1" in out[rank][1][4], out[rank][1][4]


@pytest.mark.slow
def test_torch_distributed_subscriber_times_out_naming_what_it_waited_for():
    out = _run_dist("silent publisher")
    assert out.get(1, (None, None))[0] == "ok", out
    msg = out[1][1]
    assert "rank 1 (subscriber, version None) waited 2.0s for the publisher (rank 0)" in msg
    assert "version exchange of weight-sync exchange #1 over torch.distributed gloo group of 2 ranks" in msg


def test_publishing_in_the_receivers_dtype_sends_bf16_and_its_deltas_compress_better():
    g = torch.Generator().manual_seed(7)
    emb = torch.randn(256, 64, generator=g)
    step1 = {"emb": emb, "head": emb, "mlp": torch.randn(64, 256, generator=g), "steps": torch.tensor([3])}
    # one small optimiser step (lr 1e-3 on unit-scale weights), the head still tied to the embedding
    emb2 = emb + 1e-3 * torch.randn(emb.shape, generator=g)
    step2 = {"emb": emb2, "head": emb2, "mlp": step1["mlp"] + 1e-3 * torch.randn(64, 256, generator=g),
             "steps": torch.tensor([4])}
    ratios = {}
    for dtype in (None, torch.bfloat16):
        channel = InProcessTransport()
        pub, sub = WeightPublisher(channel, full_every=0, dtype=dtype), WeightSubscriber(channel, "server")
        pub.publish(step1, 1)
        sub.poll(timeout=WAIT)
        delta = pub.publish(step2, 2)
        assert delta.encoding == "delta" and sub.poll(timeout=WAIT) == 2
        want = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in step2.items()}
        assert_bit_exact(sub.state, want)
        assert sub.state["emb"].data_ptr() == sub.state["head"].data_ptr()  # still tied: sent once
        raw_bytes = sum(v.numel() * v.element_size() for k, v in want.items() if k != "head")
        ratios[dtype] = raw_bytes / delta.nbytes
    assert step1["emb"].dtype == torch.float32  # the trainer's own tensors are left as they are
    assert ratios[torch.bfloat16] > ratios[None]
    print(f"delta compression: fp32 {ratios[None]:.2f}x, bf16 {ratios[torch.bfloat16]:.2f}x")


def test_hashing_and_zstd_run_on_several_threads_at_once(monkeypatch):
    """Each tensor's sha256 and zstd run on the codec's worker threads side by side: a barrier that two calls
    must reach together (bounded) would break if they ran one after the other."""
    import hashlib

    from factory.core.weights import codec

    monkeypatch.setattr(codec, "WORKERS", 4)  # a 1-core CI machine would otherwise map sequentially
    seen: dict[str, list[str]] = {"sha256": [], "compress": []}
    barriers = {kind: threading.Barrier(2, timeout=WAIT) for kind in seen}
    lock = threading.Lock()

    def together(kind: str, fn):
        def call(*a, **k):
            with lock:
                seen[kind].append(threading.current_thread().name)
                first_two = len(seen[kind]) <= 2
            if first_two:
                barriers[kind].wait()  # the kind's first two calls meet here: two threads at once, or a timeout
            return fn(*a, **k)
        return call

    real_compress = codec._compress
    monkeypatch.setattr(codec, "hashlib", type("H", (), {"sha256": staticmethod(together("sha256", hashlib.sha256))}))
    g = torch.Generator().manual_seed(0)
    old = {f"w{i}": torch.randn(256, generator=g) for i in range(4)}
    new = {k: v + 1 for k, v in old.items()}  # every element changed: dense, zstd per tensor
    full = encode_full(old, 1)
    monkeypatch.setattr(codec, "_compress", together("compress", real_compress))
    delta = encode_delta(old, new, 2, 1)
    for kind, names in seen.items():
        assert len(set(names[:2])) == 2 and all(n.startswith("weights") for n in names), (kind, names)
    got = apply_update(apply_update(None, full), delta, 1)
    assert_bit_exact(got, new)
