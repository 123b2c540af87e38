"""The rollout buffer: backpressure, staleness policies, the depth bound, IS weights, restarts.

Threads only ever wait with a bound (joins and events with timeouts); nothing sleeps.
"""

import json
import math
import threading

import pytest
import torch
from hypothesis import given, settings, target
from hypothesis import strategies as st

from factory.config import AlgorithmSpec, BufferSpec
from factory.core.algorithms import make_loss
from factory.core.batch import pack
from factory.core.buffer import (
    BufferClosed,
    BufferTimeout,
    Group,
    RolloutBuffer,
    Sample,
    apply_importance_correction,
    importance_weights,
    stale_rows,
)
from factory.core.rollout.base import Completion

WAIT = 5.0  # generous bound for anything that must happen; a hang fails instead of blocking the suite


def group(version: int, n: int = 2, uid: str | None = None, versions: list[int] | None = None) -> Group:
    samples = [Sample([1, 2], [3 + i, 4], [-0.5, -0.25], float(i % 2), versions or [version]) for i in range(n)]
    return Group(samples, uid=uid) if uid else Group(samples)


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_fifo_staleness_and_metrics():
    buf = RolloutBuffer("reject", max_staleness=2, groups_per_step=2, depth=4)
    a, b, c = group(0), group(1), group(1)
    for g in (a, b, c):
        buf.put(g, timeout=WAIT)
    taken = buf.get_batch(2, current_version=1, timeout=WAIT)
    assert [g.uid for g in taken] == [a.uid, b.uid]
    assert [g.staleness for g in taken] == [1, 0]
    m = buf.metrics()
    assert m["depth"] == 1 and m["capacity"] == 4 and m["consumed"] == 2
    assert m["staleness_mean"] == 0.5 and m["staleness_max"] == 1 and m["rejected"] == 0
    assert buf.staleness_histogram() == {0: 1, 1: 1}


def test_put_blocks_when_full_then_proceeds_when_the_trainer_takes():
    buf = RolloutBuffer("reject", max_staleness=1, groups_per_step=1, depth=2)
    buf.put(group(0), timeout=WAIT)
    buf.put(group(0), timeout=WAIT)
    with pytest.raises(BufferTimeout, match=r"rollout buffer full .*depth 2 groups, 2 buffered \+ 0 reserved"):
        buf.put(group(0), timeout=0.01)
    late = group(0)
    t, out = in_thread(lambda: buf.put(late, timeout=WAIT))
    t.join(0.05)
    assert t.is_alive() and len(buf) == 2  # the producer is waiting, and nothing was dropped
    buf.get_batch(1, current_version=0, timeout=WAIT)
    t.join(WAIT)
    assert not t.is_alive() and "error" not in out
    assert [g.uid for g in buf.get_batch(2, 0, timeout=WAIT)][-1] == late.uid
    assert buf.metrics()["put_wait_s"] > 0


def test_reservations_count_toward_depth_and_can_be_cancelled():
    buf = RolloutBuffer("bound", max_staleness=1, groups_per_step=2)
    assert buf.capacity == 2
    r1, r2 = buf.reserve(timeout=WAIT), buf.reserve(timeout=WAIT)
    with pytest.raises(BufferTimeout, match="reserve"):
        buf.reserve(timeout=0.01)
    r2.cancel()
    r3 = buf.reserve(timeout=WAIT)
    buf.put(group(0), reservation=r1)
    with pytest.raises(ValueError, match="not active"):
        buf.put(group(0), reservation=r1)
    buf.put(group(0), reservation=r3)
    assert buf.metrics()["reserved"] == 0 and len(buf) == 2


def test_get_batch_waits_for_a_producer_thread():
    buf = RolloutBuffer("reject", max_staleness=1, groups_per_step=2)
    t, out = in_thread(lambda: buf.get_batch(2, current_version=0, timeout=WAIT))
    buf.put(group(0), timeout=WAIT)
    buf.put(group(0), timeout=WAIT)
    t.join(WAIT)
    assert len(out["value"]) == 2


def test_get_batch_timeout_names_what_it_waited_for():
    buf = RolloutBuffer("reject", max_staleness=0, groups_per_step=2)
    buf.put(group(0), timeout=WAIT)
    with pytest.raises(BufferTimeout, match=r"get_batch waited .* for 2 groups at version 0: 1 buffered"):
        buf.get_batch(2, current_version=0, timeout=0.01)
    assert len(buf) == 1  # a failed get takes nothing


def test_reject_policy_drops_and_counts_stale_groups():
    buf = RolloutBuffer("reject", max_staleness=1, groups_per_step=2, depth=8)
    groups = [group(v) for v in (0, 1, 2, 3)]
    for g in groups:
        buf.put(g, timeout=WAIT)
    # At version 3 staleness is 3, 2, 1, 0: the first two exceed 1.
    taken = buf.get_batch(2, current_version=3, timeout=WAIT)
    assert [g.uid for g in taken] == [groups[2].uid, groups[3].uid]
    m = buf.metrics()
    assert m["rejected"] == 2 and m["bound_violations"] == 0 and m["depth"] == 0
    # In-flight weight update: the oldest version decides (generated across 1 -> 3).
    buf.put(group(3, versions=[1, 3]), timeout=WAIT)
    with pytest.raises(BufferTimeout):
        buf.get_batch(1, current_version=3, timeout=0.01)
    assert buf.metrics()["rejected"] == 3


def test_importance_policy_keeps_and_flags_stale_groups():
    buf = RolloutBuffer("importance", max_staleness=1, groups_per_step=3, depth=8)
    for v in (0, 2, 3):
        buf.put(group(v), timeout=WAIT)
    taken = buf.get_batch(3, current_version=3, timeout=WAIT)
    assert [g.staleness for g in taken] == [3, 1, 0]  # even beyond max_staleness: kept
    assert [g.needs_correction for g in taken] == [True, True, False]
    assert buf.metrics()["corrected"] == 2 and buf.metrics()["rejected"] == 0
    assert stale_rows(taken).tolist() == [True, True, True, True, False, False]


def test_versions_out_of_order_fail_loudly():
    buf = RolloutBuffer("reject", max_staleness=1, groups_per_step=1)
    buf.put(group(5), timeout=WAIT)
    with pytest.raises(ValueError, match="generated by version 5 but the trainer is at 3"):
        buf.get_batch(1, current_version=3, timeout=WAIT)


def test_bound_policy_depth_rules():
    assert RolloutBuffer("bound", max_staleness=2, groups_per_step=3).capacity == 6
    with pytest.raises(ValueError, match="buffer.depth: policy 'bound' .* at most 6 groups, got 7"):
        RolloutBuffer("bound", max_staleness=2, groups_per_step=3, depth=7)
    with pytest.raises(ValueError, match="buffer.max_staleness"):
        RolloutBuffer("bound", max_staleness=0, groups_per_step=3)
    assert RolloutBuffer.from_spec(BufferSpec(policy="reject", max_staleness=0), 4).capacity == 4


def simulate(buf: RolloutBuffer, b: int, actions: list[int]) -> list[int]:
    """Producers and one trainer interleaved by `actions`, under the bound's assumptions.

    The trainer alternates: take B groups at version V (when B are buffered), then publish V + 1.
    Producers reserve a slot at the engine's version and put the group later, but (A3) always before
    the version changes. Returns the staleness of every group the trainer took.
    """
    version, training, pending, seen = 0, False, [], []
    for a in actions:
        if a == 0:  # a producer starts a group, if there is room
            try:
                pending.append((buf.reserve(timeout=0), version))
            except BufferTimeout:
                pass
        elif a == 1 and pending:  # the oldest in-flight generation finishes
            r, v = pending.pop(0)
            buf.put(group(v), reservation=r)
        elif a == 2 and pending:  # the newest finishes first (out of order)
            r, v = pending.pop()
            buf.put(group(v), reservation=r)
        elif a == 3 and not training and len(buf) >= b:
            seen += [g.staleness for g in buf.get_batch(b, version, timeout=0)]
            training = True
        elif a == 4 and training:
            for r, v in pending:  # A3: generations end before the new weights land
                buf.put(group(v), reservation=r)
            pending = []
            version, training = version + 1, False
    return seen


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(eta=st.integers(1, 3), b=st.integers(1, 3), actions=st.lists(st.integers(0, 4), max_size=200))
def test_bound_capacity_eta_times_b_guarantees_staleness(eta, b, actions):
    buf = RolloutBuffer("bound", max_staleness=eta, groups_per_step=b)
    seen = simulate(buf, b, actions)
    target(float(max(seen, default=0)))  # steer the search toward the stalest schedules
    assert all(s <= eta for s in seen)
    assert buf.metrics()["bound_violations"] == 0


def simulate_stragglers(buf: RolloutBuffer, b: int, actions: list[int]) -> list[int]:
    """As `simulate`, without A3: an episode may stay out across any number of weight updates (a slow
    environment), and the trainer only takes a batch when `get_batch` lets it (never forced)."""
    version, training, pending, seen = 0, False, [], []
    for a in actions:
        if a == 0:
            try:
                pending.append((buf.reserve(timeout=0, version=version), version))
            except BufferTimeout:
                pass
        elif a == 1 and pending:
            r, v = pending.pop(0)
            buf.put(group(v), reservation=r)
        elif a == 2 and pending:
            r, v = pending.pop()
            buf.put(group(v), reservation=r)
        elif a == 3 and not training:
            try:
                seen += [g.staleness for g in buf.get_batch(b, version, timeout=0)]
                training = True
            except BufferTimeout:  # waiting on a straggler at its limit, or too few groups
                pass
        elif a == 4 and training:
            version, training = version + 1, False
    return seen


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(eta=st.integers(1, 3), b=st.integers(1, 3), actions=st.lists(st.integers(0, 4), max_size=300))
def test_bound_waits_for_stragglers_and_never_drops_or_exceeds_eta(eta, b, actions):
    buf = RolloutBuffer("bound", max_staleness=eta, groups_per_step=b)
    seen = simulate_stragglers(buf, b, actions)
    target(float(max(seen, default=0)))
    assert all(s <= eta for s in seen)
    assert buf.metrics()["rejected"] == 0  # nothing dropped either


def test_bound_get_batch_waits_for_a_straggler_at_its_limit_and_takes_it_first():
    buf = RolloutBuffer("bound", max_staleness=2, groups_per_step=2)
    slow = buf.reserve(timeout=WAIT, version=0)  # an episode still in the environment
    fresh = [group(1), group(1)]
    buf.put(fresh[0], timeout=WAIT)
    assert [g.uid for g in buf.get_batch(1, current_version=1, timeout=WAIT)] == [fresh[0].uid]  # not due yet
    buf.put(fresh[1], timeout=WAIT)
    with pytest.raises(BufferTimeout, match=r"1 reserved \(1 of them at their staleness limit\)"):
        buf.get_batch(1, current_version=2, timeout=0.01)  # at version 2 the straggler must come now
    late = group(0)
    buf.put(late, reservation=slow)
    taken = buf.get_batch(1, current_version=2, timeout=WAIT)
    assert [g.uid for g in taken] == [late.uid] and taken[0].staleness == 2  # the oldest first, within eta
    m = buf.metrics()
    assert m["rejected"] == 0 and m["straggler_waits"] == 1


def test_groups_from_the_oldest_weights_are_taken_first():
    buf = RolloutBuffer("importance", max_staleness=9, groups_per_step=4, depth=8)
    gs = [group(v) for v in (2, 0, 1, 0)]
    for g in gs:
        buf.put(g, timeout=WAIT)
    assert [g.uid for g in buf.get_batch(4, current_version=2, timeout=WAIT)] == [gs[1].uid, gs[3].uid, gs[2].uid,
                                                                                  gs[0].uid]


def test_bound_is_tight_one_more_slot_allows_eta_plus_one():
    # eta 1, B 1: capacity 2 (one slot too many), observed with `reject` and a large max_staleness
    # so nothing is dropped. Schedule: a group at v0 is taken at v0; while the trainer trains at v0,
    # two more groups are generated at v0; it publishes v1 and takes one (staleness 1), publishes v2
    # and takes the other: staleness 2 = eta + 1. With capacity 1 the second one never starts.
    buf = RolloutBuffer("reject", max_staleness=9, groups_per_step=1, depth=2)
    seen = simulate(buf, 1, [0, 1, 3, 0, 1, 0, 4, 3, 4, 3])
    assert max(seen) == 2
    buf_ok = RolloutBuffer("bound", max_staleness=1, groups_per_step=1)
    assert max(simulate(buf_ok, 1, [0, 1, 3, 0, 1, 0, 4, 3, 4, 3])) <= 1


def test_bound_policy_drops_and_counts_violations():
    # A generation that spans two weight updates breaks A3; the trainer still never sees it.
    buf = RolloutBuffer("bound", max_staleness=1, groups_per_step=1)
    buf.put(group(0), timeout=WAIT)
    with pytest.raises(BufferTimeout):
        buf.get_batch(1, current_version=2, timeout=0.01)
    m = buf.metrics()
    assert m["rejected"] == 1 and m["bound_violations"] == 1


def test_importance_weights_values_and_cap():
    cur = torch.log(torch.tensor([[1.5, 3.0, 0.5, 1.0]]))
    beh = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    w = importance_weights(cur, beh, mask, cap=2.0)
    # exp(log 1.5) = 1.5; exp(log 3) = 3 capped at 2; 0.5 kept (truncation is one-sided); padding 1
    assert w[0].tolist() == pytest.approx([1.5, 2.0, 0.5, 1.0])
    one = torch.ones(1, 1, dtype=torch.bool)
    huge = importance_weights(torch.tensor([[1000.0]]), torch.tensor([[-1000.0]]), one, 2.0)
    assert huge.item() == 2.0  # no overflow to inf before the cap


def test_apply_importance_correction_contract_and_loss_scaling():
    # Row 0 stale, row 1 fresh; behavior logprobs from the sampler, current from the trainer.
    batch = pack([[1], [1]], [[5, 6], [5, 6]], 0, {"old_logprobs": [[math.log(0.5), math.log(0.5)],
                                                                   [math.log(0.5), math.log(0.5)]]},
                 {"advantages": [1.0, 1.0]})
    mask = batch.loss_mask
    cur = torch.full_like(batch.per_token["old_logprobs"], float("nan"))  # padding: garbage
    cur[mask] = torch.log(torch.tensor([0.75, 2.0, 0.5, 0.5]))  # ratios 1.5 and 4 (row 0), 1, 1 (row 1)
    behavior = batch.per_token["old_logprobs"].clone()
    m = apply_importance_correction(batch, cur, torch.tensor([True, False]), cap=2.0)
    w = batch.per_token["is_weights"]
    assert w[mask].tolist() == pytest.approx([1.5, 2.0, 1.0, 1.0])
    assert m["is_weight_mean"] == pytest.approx(1.75) and m["is_truncated_frac"] == 0.5 and m["is_rows"] == 1
    # The stale row is re-anchored at the current (proximal) logprobs; the fresh row keeps the sampler's.
    old = batch.per_token["old_logprobs"]
    assert torch.equal(old[0][mask[0]], cur[0][mask[0]]) and torch.equal(old[1], behavior[1])
    # Training on the corrected batch at the current weights: ratio 1 everywhere, per-token loss -A * w.
    logp = torch.where(mask, cur, torch.zeros_like(cur))
    loss, lm = make_loss(AlgorithmSpec())(logp, batch)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx((-(1.5 + 2.0) / 2 - 1.0) / 2)


def test_state_round_trip_loses_and_duplicates_nothing():
    buf = RolloutBuffer("reject", max_staleness=2, groups_per_step=2, depth=6)
    groups = [group(0, uid=f"g{i}") for i in range(5)]
    for g in groups:
        buf.put(g, timeout=WAIT)
    buf.get_batch(2, current_version=0, timeout=WAIT)  # trained before the checkpoint
    pending = buf.reserve(timeout=WAIT)  # in flight: not data yet, not saved
    state = json.loads(json.dumps(buf.state_dict()))  # survives a trip through JSON
    restored = RolloutBuffer("reject", max_staleness=2, groups_per_step=2, depth=6)
    restored.load_state_dict(state)
    assert len(restored) == 3 and restored.metrics()["consumed"] == 2
    assert restored.staleness_histogram() == {0: 2}
    taken = restored.get_batch(3, current_version=1, timeout=WAIT)
    assert [g.uid for g in taken] == ["g2", "g3", "g4"]
    assert [s.token_ids for s in taken[0].samples] == [s.token_ids for s in groups[2].samples]
    with pytest.raises(BufferTimeout):
        restored.get_batch(1, current_version=1, timeout=0.01)  # nothing twice
    with pytest.raises(ValueError, match="needs an empty buffer"):
        buf.load_state_dict(state)
    pending.cancel()
    dup = {**state, "groups": state["groups"] + state["groups"][:1]}
    with pytest.raises(ValueError, match="same group twice"):
        RolloutBuffer("reject", max_staleness=2, groups_per_step=2).load_state_dict(dup)


def test_restored_overflow_is_kept_and_producers_wait():
    big = RolloutBuffer("reject", max_staleness=1, groups_per_step=4, depth=4)
    for _ in range(4):
        big.put(group(0), timeout=WAIT)
    small = RolloutBuffer("reject", max_staleness=1, groups_per_step=1, depth=1)
    small.load_state_dict(big.state_dict())
    assert len(small) == 4  # never dropped to fit
    with pytest.raises(BufferTimeout):
        small.put(group(0), timeout=0.01)


def test_duplicates_and_malformed_groups_are_refused():
    buf = RolloutBuffer("reject", max_staleness=1, groups_per_step=1, depth=4)
    g = group(0, uid="same")
    buf.put(g, timeout=WAIT)
    with pytest.raises(ValueError, match="already buffered"):
        buf.put(group(0, uid="same"), timeout=WAIT)
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        buf.put(Group([Sample([1], [2, 3], [-1.0], 0.0, [0])]), timeout=WAIT)
    with pytest.raises(ValueError, match="no samples"):
        buf.put(Group([]), timeout=WAIT)


def test_close_wakes_waiters():
    buf = RolloutBuffer("reject", max_staleness=1, groups_per_step=1, depth=1)
    t, out = in_thread(lambda: buf.get_batch(1, current_version=0, timeout=WAIT))
    buf.close()
    t.join(WAIT)
    assert isinstance(out.get("error"), BufferClosed)
    with pytest.raises(BufferClosed):
        buf.put(group(0), timeout=WAIT)


def test_sample_from_completion_uses_the_oldest_version():
    c = Completion([1, 2], [3, 4], [-0.1, -0.2], "x", "stop", weight_version=7, meta={"weight_versions": [7, 6]})
    s = Sample.from_completion(c, reward=1.0)
    assert s.versions == [6, 7] and s.oldest_version == 6 and s.reward == 1.0
    plain = Sample.from_completion(Completion([1], [2], [-0.3], "", "length", weight_version=4), reward=0.0)
    assert plain.versions == [4]


@pytest.mark.skipif(not hasattr(Completion([], [], [], "", "stop", 0), "token_versions"),
                    reason="Completion without per-token versions")
def test_sample_from_completion_reads_per_token_versions():
    c = Completion([1], [2, 3], [-0.1, -0.2], "", "stop", weight_version=4, token_versions=[4, 5])
    assert Sample.from_completion(c, reward=0.0).versions == [4, 5]


def test_a_reservation_redated_at_generation_is_waited_for_by_its_real_deadline():
    buf = RolloutBuffer("bound", max_staleness=1, groups_per_step=2)
    slot = buf.reserve(timeout=WAIT, version=0)  # queued for the engine while version 1 landed
    buf.put(group(1), timeout=WAIT)
    with pytest.raises(BufferTimeout, match="1 of them at their staleness limit"):
        buf.get_batch(1, current_version=1, timeout=0.01)
    slot.generated_at(1)
    slot.generated_at(0)  # a date only moves later
    assert len(buf.get_batch(1, current_version=1, timeout=WAIT)) == 1  # no longer due at version 1
    with pytest.raises(BufferTimeout, match="1 of them at their staleness limit"):
        buf.get_batch(1, current_version=2, timeout=0.01)
