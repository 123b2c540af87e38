"""Host snapshots for the codec (`factory/core/weights/staging.py`): buffers kept between versions (two sets that
alternate, the kept one never written), tied tensors copied once and still tied, floating tensors in the
receiver's dtype, and bit-exact round trips through the codec from those snapshots."""

from __future__ import annotations

import pytest
import torch

from factory.core.weights import InProcessTransport, WeightPublisher, WeightSubscriber, apply_update, encode_delta
from factory.core.weights.staging import HostStaging

WAIT = 30.0


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 16, generator=g)
    return {"emb": emb, "head": emb, "mlp": torch.randn(16, 48, generator=g).t(),  # a non-contiguous view
            "norm": torch.ones(16), "steps": torch.tensor([seed])}


def ptrs(snap: dict) -> set[int]:
    return {t.data_ptr() for t in snap.values()}


def test_snapshots_reuse_two_sets_of_buffers_and_keep_ties():
    staging = HostStaging()
    live = state(0)
    a = staging.snapshot(live)
    assert a["emb"] is a["head"] and staging.allocations == 4  # tied: one buffer, one copy
    assert all(torch.equal(a[k], v) for k, v in live.items()) and a["mlp"].is_contiguous()
    assert not ptrs(a) & {v.data_ptr() for v in live.values()}  # copies, not the live tensors
    b = staging.snapshot(state(1), keep=a)
    assert not ptrs(a) & ptrs(b) and staging.allocations == 8
    assert all(torch.equal(a[k], v) for k, v in live.items())  # the kept one untouched
    for seed in range(2, 6):  # later versions: no new buffer, and the kept set is never the one written
        keep = b
        b = staging.snapshot(state(seed), keep=keep)
        assert staging.allocations == 8 and not ptrs(keep) & ptrs(b)
        assert all(torch.equal(b[k], v) for k, v in state(seed).items())
    c = staging.snapshot(state(7), keep=b)
    d = staging.snapshot(state(8), keep=b)  # the caller still holds b: c's set is written again
    assert ptrs(c) == ptrs(d) and not ptrs(b) & ptrs(d)


def test_a_changed_layout_gets_new_buffers_and_drops_the_old():
    staging = HostStaging()
    staging.snapshot(state(0))
    grown = {**state(1), "emb": torch.zeros(65, 16), "extra": torch.zeros(3)}
    grown["head"] = grown["emb"]
    snap = staging.snapshot(grown)
    assert snap["emb"].shape == (65, 16) and snap["head"] is snap["emb"] and "extra" in snap
    smaller = staging.snapshot({"emb": torch.ones(2)})
    assert set(smaller) == {"emb"} and torch.equal(smaller["emb"], torch.ones(2))


def test_bf16_snapshots_cast_floats_only_and_round_trip_bit_exactly():
    staging = HostStaging(torch.bfloat16)
    prev, new = staging.snapshot(state(0)), None
    assert prev["emb"].dtype == torch.bfloat16 and prev["steps"].dtype == torch.int64
    new = staging.snapshot(state(1), keep=prev)
    assert torch.equal(new["mlp"], state(1)["mlp"].to(torch.bfloat16))
    engine = {k: v.clone() for k, v in prev.items()}
    engine["head"] = engine["emb"]  # a bf16 server's tied weights
    update = encode_delta(prev, new, version=2, base_version=1)
    assert next(t for t in update.tensors if t.name == "head").scheme == "alias"  # the tie sent once
    got = apply_update(engine, update, 1, inplace=True)
    for k, v in new.items():
        assert torch.equal(got[k].view(torch.int16) if v.is_floating_point() else got[k],
                           v.view(torch.int16) if v.is_floating_point() else v), k
    assert got["emb"].data_ptr() == got["head"].data_ptr() == engine["emb"].data_ptr()


def test_the_publisher_snapshots_into_two_sets_across_versions():
    channel = InProcessTransport()
    pub = WeightPublisher(channel, full_every=3, dtype=torch.bfloat16)
    sub = WeightSubscriber(channel, "server")
    for version in range(1, 8):
        live = state(version)
        pub.publish(live, version)
        assert sub.poll(timeout=WAIT) == version
        want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in live.items()}
        assert all(torch.equal(sub.state[k], v) for k, v in want.items())
    assert pub._staging.allocations == 8  # 4 storages x 2 sets, whatever the number of versions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device check runs this path)")
def test_gpu_tensors_land_in_pinned_buffers_after_one_sync(monkeypatch):
    live = {k: v.cuda() for k, v in state(0).items()}
    live["head"] = live["emb"]
    syncs = []
    real = torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda s: (syncs.append(s), real(s))[1])
    snap = HostStaging(torch.bfloat16).snapshot(live)
    assert len(syncs) == 1 and all(t.is_pinned() for t in snap.values())
    assert all(torch.equal(snap[k], v.to(torch.bfloat16).cpu() if v.is_floating_point() else v.cpu())
               for k, v in live.items())
