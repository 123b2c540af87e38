"""The curriculum's decisions on hand-made reward sequences, its determinism across a resume, and its errors."""

from __future__ import annotations

import json
import math
import random
import threading
from typing import Any

import pytest

from factory.config import CurriculumSpec, PromptFilterSpec
from factory.data.curriculum import Curriculum, make_curriculum
from factory.problem import Problem

SOURCES = ["add1", "add2", "add3", "other"]
SOLVED, UNSOLVED, MIXED = [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]


def prob(pid: str) -> Problem:
    return Problem(id=pid, prompt=f"{pid} = ?", answer="0", op="add", digits=2)


def make(kind: str = "none", *, seed: int = 7, prompt_filter: PromptFilterSpec | None = None,
         stats: dict | None = None, **spec: Any) -> Curriculum:
    return make_curriculum(CurriculumSpec(kind=kind, **spec), sources=SOURCES, seed=seed,
                           base_weights=dict.fromkeys(SOURCES, 1.0), prompt_filter=prompt_filter, stats=stats)


def roundtrip(cur: Curriculum, kind: str, **kw: Any) -> Curriculum:
    fresh = make(kind, **kw)
    fresh.load_state_dict(json.loads(json.dumps(cur.state_dict())))
    return fresh


# -- none ------------------------------------------------------------------------------------------------------


def test_none_admits_everything_and_leaves_the_weights() -> None:
    cur = make("none")
    p = prob("a")
    for d in range(20):
        cur.observe("add1", p, UNSOLVED)
        assert cur.admit(d, "add1", p)
    assert cur.weights() is None
    m = cur.metrics()
    assert m["curriculum/admitted"] == 20 and m["curriculum/skipped"] == 0 and m["curriculum/observed"] == 20


# -- online ----------------------------------------------------------------------------------------------------


def test_online_drops_after_attempts_judgements_all_solved_or_all_unsolved() -> None:
    cur = make("online", attempts=2, drop="both")
    a, b, c = prob("a"), prob("b"), prob("c")
    cur.observe("add1", a, SOLVED)
    assert cur.admit(0, "add1", a)  # one judgement of two
    cur.observe("add1", a, SOLVED)
    assert not cur.admit(1, "add1", a)
    cur.observe("add1", b, UNSOLVED)
    cur.observe("add1", b, UNSOLVED)
    assert not cur.admit(2, "add1", b)
    cur.observe("add1", c, SOLVED)
    cur.observe("add1", c, MIXED)  # the last two were not all solved
    assert cur.admit(3, "add1", c)
    cur.observe("add1", c, UNSOLVED)  # solved, mixed, unsolved: the last two differ
    assert cur.admit(4, "add1", c)
    assert cur.admit(5, "add2", a)  # another source's prompt with the same id is another prompt
    m = cur.metrics()
    assert (m["curriculum/dropped_solved"], m["curriculum/dropped_unsolved"], m["curriculum/skipped"]) == (1, 1, 2)
    assert m["curriculum/skipped/add1"] == 2 and m["curriculum/prompts_dropped"] == 2


@pytest.mark.parametrize("drop, kept", [("solved", UNSOLVED), ("unsolved", SOLVED)])
def test_online_drops_only_the_side_asked_for(drop: str, kept: list[float]) -> None:
    cur = make("online", attempts=3, drop=drop)
    dropped_rewards = SOLVED if drop == "solved" else UNSOLVED
    keep, gone = prob("keep"), prob("gone")
    for _ in range(5):
        cur.observe("add2", keep, kept)
    for _ in range(3):
        cur.observe("add2", gone, dropped_rewards)
    assert cur.admit(0, "add2", keep)
    assert not cur.admit(1, "add2", gone)


def test_online_a_single_right_sample_makes_a_group_mixed_not_unsolved() -> None:
    cur = make("online", attempts=1, drop="unsolved")
    p = prob("p")
    cur.observe("add1", p, [0.0, 0.0, 1.0, 0.5])  # reward 1 counts as solved; 0.5 does not
    assert cur.admit(0, "add1", p)
    cur.observe("add1", p, [0.0, 0.5, 0.99, -1.0])
    assert not cur.admit(1, "add1", p)


def test_online_retry_after_counts_draws_from_the_first_refusal_then_needs_fresh_judgements() -> None:
    cur = make("online", attempts=2, drop="solved", retry_after=5)
    p = prob("p")
    cur.observe("add1", p, SOLVED)
    cur.observe("add1", p, SOLVED)
    assert not cur.admit(10, "add1", p)  # dropped at draw 10
    assert [cur.admit(d, "add1", p) for d in range(11, 15)] == [False] * 4
    assert cur.admit(15, "add1", p)  # 5 draws after the drop
    assert cur.metrics()["curriculum/retried"] == 1
    cur.observe("add1", p, SOLVED)
    assert cur.admit(16, "add1", p)  # one new judgement of the two needed
    cur.observe("add1", p, SOLVED)
    assert not cur.admit(17, "add1", p)  # dropped again, now at draw 17
    assert not cur.admit(21, "add1", p)
    assert cur.admit(22, "add1", p)


def test_online_without_retry_a_drop_is_for_good_unless_a_late_group_breaks_the_run() -> None:
    cur = make("online", attempts=2, drop="both", retry_after=0)
    p = prob("p")
    cur.observe("add3", p, UNSOLVED)
    cur.observe("add3", p, UNSOLVED)
    assert not cur.admit(0, "add3", p)
    assert not cur.admit(10**9, "add3", p)
    cur.observe("add3", p, MIXED)  # a group in flight at the drop comes back mixed: its last two differ now
    assert cur.admit(10**9 + 1, "add3", p)


def test_online_state_is_compact_and_forgets_prompts_that_decide_like_unseen_ones() -> None:
    cur = make("online", attempts=2)
    for i in range(100):
        cur.observe("add1", prob(str(i)), MIXED)
    cur.observe("add1", prob("s"), SOLVED)
    assert cur.state_dict()["prompts"] == {"add1/s": [1, -1]}


# -- priority --------------------------------------------------------------------------------------------------


def test_priority_admits_unseen_prompts_and_always_those_at_half() -> None:
    cur = make("priority", floor=0.05)
    half = prob("half")
    assert all(cur.admit(d, "add1", prob(f"new{d}")) for d in range(200))
    cur.observe("add1", half, MIXED)  # p = 0.5: probability 1
    assert all(cur.admit(d, "add1", half) for d in range(200, 400))


@pytest.mark.parametrize("passes, samples, floor", [(0, 8, 0.05), (8, 8, 0.2), (1, 8, 0.05), (2, 8, 0.05),
                                                     (1, 16, 0.3)])
def test_priority_acceptance_frequency_tracks_its_probability(passes: int, samples: int, floor: float) -> None:
    cur = make("priority", floor=floor, seed=123)
    p = prob("p")
    cur.observe("add2", p, [1.0] * passes + [0.0] * (samples - passes))
    rate = passes / samples
    want = max(floor, 4 * rate * (1 - rate))
    n = 4000
    got = sum(cur.admit(d, "add2", p) for d in range(n))
    sigma = math.sqrt(n * want * (1 - want))
    assert abs(got - n * want) <= 4 * sigma, (got, n * want, sigma)
    assert cur.metrics()["curriculum/skipped_priority"] == n - got


def test_priority_decisions_depend_on_seed_and_draw_id_only() -> None:
    p = prob("p")

    def decisions(seed: int, draws: list[int]) -> list[bool]:
        cur = make("priority", seed=seed, floor=0.05)
        cur.observe("add1", p, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # p = 1/8: probability 0.4375
        return [cur.admit(d, "add1", p) for d in draws]

    draws = list(range(500))
    a = decisions(1, draws)
    assert a == decisions(1, draws)
    assert a != decisions(2, draws)
    assert 0 < sum(a) < len(a)
    assert decisions(1, draws[::-1]) == a[::-1]  # call order does not matter, the draw id does


def test_priority_decisions_from_threads_match_a_single_thread() -> None:
    p = prob("p")
    seq = make("priority", seed=5)
    seq.observe("add1", p, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    want = {d: seq.admit(d, "add1", p) for d in range(2000)}
    par = make("priority", seed=5)
    par.observe("add1", p, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    got: dict[int, bool] = {}

    def worker(k: int) -> None:
        for d in range(k, 2000, 4):
            got[d] = par.admit(d, "add1", p)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_priority_resume_mid_stream_decides_as_the_uninterrupted_run() -> None:
    rng = random.Random(3)
    pool = [prob(f"q{i}") for i in range(10)]
    skill = {q.id: rng.random() for q in pool}
    cur = make("priority", seed=11, floor=0.1)
    for d in range(300):
        q = rng.choice(pool)
        if cur.admit(d, "add1", q):
            cur.observe("add1", q, [float(rng.random() < skill[q.id]) for _ in range(4)])
    resumed = roundtrip(cur, "priority", seed=11, floor=0.1)
    a, b = [], []
    for d in range(300, 800):
        q = rng.choice(pool)
        rewards = [float(rng.random() < skill[q.id]) for _ in range(4)]
        for c, out in ((cur, a), (resumed, b)):
            out.append(c.admit(d, "add1", q))
            if out[-1]:
                c.observe("add1", q, rewards)
    assert a == b
    assert 0 < sum(a) < len(a)


# -- level -----------------------------------------------------------------------------------------------------


def group(acc_quarters: int) -> list[float]:
    return [1.0] * acc_quarters + [0.0] * (4 - acc_quarters)


def test_level_moves_at_the_threshold_only_with_a_full_window() -> None:
    cur = make("level", levels=["add1", "add2", "add3"], window=4, threshold=0.75, review=0.2)
    p = prob("p")
    assert cur.weights() == {"add1": 1.0, "add2": 0.0, "add3": 0.0, "other": 0.0}
    for _ in range(3):
        cur.observe("add1", p, SOLVED)  # accuracy 1.0, but the window holds 3 of 4 groups
    assert cur.metrics()["curriculum/level"] == 0
    cur.observe("add1", p, group(0))  # window [1, 1, 1, 0]: 0.75 >= 0.75
    assert cur.metrics()["curriculum/level"] == 1
    assert cur.weights() == {"add1": 0.2, "add2": 0.8, "add3": 0.0, "other": 0.0}
    for q in (3, 3, 3, 2):  # [0.75, 0.75, 0.75, 0.5]: 0.6875
        cur.observe("add2", p, group(q))
    assert cur.metrics()["curriculum/level"] == 1
    assert cur.metrics()["curriculum/acc/add2"] == 0.6875
    cur.observe("add2", p, group(3))  # [0.75, 0.75, 0.5, 0.75]: 0.6875
    assert cur.metrics()["curriculum/level"] == 1
    cur.observe("add2", p, group(4))  # [0.75, 0.5, 0.75, 1.0]: 0.75
    assert cur.metrics()["curriculum/level"] == 2
    w = cur.weights()
    assert w["add3"] == pytest.approx(0.8) and w["add1"] == w["add2"] == pytest.approx(0.1) and w["other"] == 0
    for _ in range(8):
        cur.observe("add3", p, SOLVED)
    assert cur.metrics()["curriculum/level"] == 2  # not past the last


def test_level_without_review_puts_all_weight_on_the_current_level() -> None:
    cur = make("level", levels=["add2", "add1"], window=1, threshold=0.5, review=0.0)
    cur.observe("add2", prob("p"), MIXED)
    assert cur.weights() == {"add1": 1.0, "add2": 0.0, "add3": 0.0, "other": 0.0}


def test_level_other_sources_fill_their_windows_and_a_mastered_next_level_is_passed_too() -> None:
    cur = make("level", levels=["add1", "add2", "add3"], window=2, threshold=0.9)
    p = prob("p")
    cur.observe("add2", p, SOLVED)
    cur.observe("add2", p, SOLVED)
    cur.observe("other", p, UNSOLVED)
    assert cur.metrics()["curriculum/level"] == 0
    assert cur.metrics()["curriculum/acc/add2"] == 1.0 and cur.metrics()["curriculum/acc/other"] == 0.0
    cur.observe("add1", p, SOLVED)
    cur.observe("add1", p, SOLVED)
    assert cur.metrics()["curriculum/level"] == 2


# -- offline filter --------------------------------------------------------------------------------------------


STATS = {("add1", "low"): (8, 0), ("add1", "high"): (8, 8), ("add1", "young"): (7, 0), ("add1", "mid"): (10, 5),
         ("add1", "edge_lo"): (10, 2), ("add1", "edge_hi"): (10, 8), ("add1", "above"): (10, 9),
         ("add1", "below"): (10, 1), ("gone", "low"): (100, 0)}


def test_offline_filter_skips_trusted_pass_rates_outside_the_window() -> None:
    f = PromptFilterSpec(min_pass_rate=0.2, max_pass_rate=0.8, min_attempts=8)
    cur = make("none", prompt_filter=f, stats=STATS)
    got = {pid: cur.admit(d, "add1", prob(pid)) for d, pid in enumerate(
        ["low", "high", "young", "mid", "edge_lo", "edge_hi", "above", "below", "unknown"])}
    assert got == {"low": False, "high": False, "young": True, "mid": True, "edge_lo": True, "edge_hi": True,
                   "above": False, "below": False, "unknown": True}
    assert cur.admit(99, "add2", prob("low"))  # the stats are per source
    m = cur.metrics()
    assert m["curriculum/filtered_offline"] == 4 and m["curriculum/filter_prompts"] == 4  # other runs' source ignored


def test_offline_filter_without_stats_filters_nothing() -> None:
    cur = make("none", prompt_filter=PromptFilterSpec(min_pass_rate=0.5, max_pass_rate=0.5, min_attempts=1))
    assert all(cur.admit(d, "add1", prob(pid)) for d, pid in enumerate(["low", "high", "mid"]))


def test_offline_filter_comes_before_the_kinds_decision() -> None:
    f = PromptFilterSpec(min_pass_rate=0.2, max_pass_rate=0.8, min_attempts=8)
    cur = make("online", attempts=1, drop="both", prompt_filter=f, stats=STATS)
    assert not cur.admit(0, "add1", prob("low"))
    mid = prob("mid")
    assert cur.admit(1, "add1", mid)
    cur.observe("add1", mid, SOLVED)
    assert not cur.admit(2, "add1", mid)
    m = cur.metrics()
    assert (m["curriculum/filtered_offline"], m["curriculum/dropped_solved"], m["curriculum/skipped"]) == (1, 1, 2)


# -- resume: every kind ----------------------------------------------------------------------------------------


KINDS = {
    "none": {},
    "online": {"attempts": 2, "drop": "both", "retry_after": 40},
    "priority": {"floor": 0.1},
    "level": {"levels": ["add1", "add2", "add3"], "window": 16, "threshold": 0.9, "review": 0.3},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_round_trip_continues_exactly(kind: str) -> None:
    f = PromptFilterSpec(min_pass_rate=0.3, max_pass_rate=0.7, min_attempts=4)
    pools = {s: [prob(f"{s}-{i}") for i in range(15)] for s in SOURCES}
    rng = random.Random(2024)
    skill = {(s, q.id): rng.choice([0.0, 0.3, 0.6, 1.0]) for s in SOURCES for q in pools[s]}
    stats = {(s, q.id): (8, round(8 * rng.random())) for s in SOURCES for q in pools[s][:5]}
    kw = {"prompt_filter": f, "stats": stats, **KINDS[kind]}

    def events(n: int):
        for d in range(n):
            s = rng.choice(SOURCES)
            q = rng.choice(pools[s])
            solve = min(1.0, skill[(s, q.id)] + d / 4000)  # the policy improves: levels pass late in the stream
            yield d, s, q, [float(rng.random() < solve) for _ in range(4)]

    stream = list(events(3000))
    cur = make(kind, **kw)
    trace_a: list[Any] = []
    for d, s, q, rewards in stream[:1500]:
        if cur.admit(d, s, q):
            cur.observe(s, q, rewards)
    state = cur.state_dict()
    mid = cur.metrics()
    resumed = roundtrip(cur, kind, **kw)
    assert json.loads(json.dumps(resumed.state_dict())) == json.loads(json.dumps(state))
    trace_b: list[Any] = []
    for d, s, q, rewards in stream[1500:]:
        for c, trace in ((cur, trace_a), (resumed, trace_b)):
            ok = c.admit(d, s, q)
            if ok:
                c.observe(s, q, rewards)
            trace.append((ok, c.weights()))
    assert trace_a == trace_b
    assert cur.metrics() == resumed.metrics()
    assert cur.state_dict() == resumed.state_dict()
    admitted = [ok for ok, _ in trace_a]
    assert 0 < sum(admitted) < len(admitted)  # the stream exercised skips (the offline filter at least)
    if kind == "level":  # the level moved after the resume, so the windows' state was exercised
        assert mid["curriculum/level"] < cur.metrics()["curriculum/level"]


def test_level_state_keeps_its_level_after_load() -> None:
    cur = make("level", levels=["add1", "add2"], window=1, threshold=0.5)
    cur.observe("add1", prob("p"), SOLVED)
    fresh = roundtrip(cur, "level", levels=["add1", "add2"], window=1, threshold=0.5)
    assert fresh.weights() == {"add1": 0.0, "add2": 1.0, "add3": 0.0, "other": 0.0}


def test_spec_numbers_may_change_across_a_resume() -> None:
    cur = make("level", levels=["add1", "add2"], window=2, threshold=1.0)
    cur.observe("add1", prob("p"), SOLVED)
    cur.observe("add1", prob("p"), MIXED)  # window [1.0, 0.5]: below 1.0, at 0.75
    assert cur.metrics()["curriculum/level"] == 0
    lowered = roundtrip(cur, "level", levels=["add1", "add2"], window=2, threshold=0.75)
    assert lowered.metrics()["curriculum/level"] == 1
    narrowed = roundtrip(cur, "level", levels=["add1", "add2"], window=1, threshold=0.5)  # keeps the last group
    assert narrowed.metrics()["curriculum/acc/add1"] == 0.5 and narrowed.metrics()["curriculum/level"] == 1
    online = make("online", attempts=3, drop="solved")
    online.observe("add1", prob("p"), SOLVED)
    online.observe("add1", prob("p"), SOLVED)
    assert online.admit(0, "add1", prob("p"))
    assert not roundtrip(online, "online", attempts=2, drop="solved").admit(1, "add1", prob("p"))


# -- errors ----------------------------------------------------------------------------------------------------


def test_observe_rejects_empty_and_non_finite_rewards() -> None:
    cur = make("online")
    with pytest.raises(ValueError, match="empty reward list for add1/p"):
        cur.observe("add1", prob("p"), [])
    with pytest.raises(ValueError, match="finite numbers, got nan"):
        cur.observe("add1", prob("p"), [1.0, float("nan")])
    with pytest.raises(ValueError, match="finite numbers, got '1'"):
        cur.observe("add1", prob("p"), ["1"])


def test_unknown_source_and_bad_draw_id_are_named() -> None:
    cur = make("priority")
    with pytest.raises(ValueError, match="unknown source 'add9'"):
        cur.admit(0, "add9", prob("p"))
    with pytest.raises(ValueError, match="unknown source 'add9'"):
        cur.observe("add9", prob("p"), SOLVED)
    with pytest.raises(ValueError, match="draw_id must be an int >= 0, got -1"):
        cur.admit(-1, "add1", prob("p"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_load_rejects_another_kinds_state(kind: str) -> None:
    other = "online" if kind != "online" else "priority"
    state = make(other, **KINDS[other]).state_dict()
    with pytest.raises(ValueError, match=f"saved by a '{other}' curriculum, this one is '{kind}'"):
        make(kind, **KINDS[kind]).load_state_dict(state)


def test_load_rejects_other_sources_levels_seed_and_malformed_states() -> None:
    state = make("online").state_dict()
    other = make_curriculum(CurriculumSpec(kind="online"), sources=["add1", "add2"], seed=7)
    with pytest.raises(ValueError, match="sources .* differ"):
        other.load_state_dict(state)
    lvl = make("level", levels=["add1", "add2"]).state_dict()
    with pytest.raises(ValueError, match="levels .* differ"):
        make("level", levels=["add2", "add1"]).load_state_dict(lvl)
    with pytest.raises(ValueError, match="seed 7 differs"):
        make("priority", seed=8).load_state_dict(make("priority", seed=7).state_dict())
    with pytest.raises(ValueError, match="format None"):
        make("none").load_state_dict({})
    broken = dict(state)
    del broken["counts"]
    with pytest.raises(ValueError, match="malformed .*counts"):
        make("online").load_state_dict(broken)
    with pytest.raises(ValueError, match="prompt 'add1/x': expected"):
        make("online").load_state_dict({**state, "prompts": {"add1/x": [1]}})
    with pytest.raises(ValueError, match="level 5 out of range"):
        make("level", levels=["add1", "add2"]).load_state_dict({**lvl, "level": 5})


def test_make_curriculum_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"curriculum.levels: unknown source\(s\) \['add7'\]"):
        make("level", levels=["add1", "add7"])
    with pytest.raises(ValueError, match="a level curriculum needs the source names"):
        make("level")
    with pytest.raises(ValueError, match="only used by kind 'level'"):
        make("online", levels=["add1"])
    with pytest.raises(ValueError, match="duplicate source name"):
        make_curriculum(CurriculumSpec(), sources=["a", "a"], seed=0)
    with pytest.raises(ValueError, match="spec must be a CurriculumSpec"):
        make_curriculum({"kind": "none"}, sources=["a"], seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"base_weights name unknown source\(s\) \['zz'\]"):
        make_curriculum(CurriculumSpec(), sources=["a"], seed=0, base_weights={"zz": 1.0})
    f = PromptFilterSpec()
    with pytest.raises(ValueError, match=r"stats \('add1', 'p'\): expected ints 0 <= passes <= attempts"):
        make("none", prompt_filter=f, stats={("add1", "p"): (3, 5)})
    with pytest.raises(ValueError, match="must be \\(source, prompt id\\)"):
        make("none", prompt_filter=f, stats={"add1/p": (3, 1)})
