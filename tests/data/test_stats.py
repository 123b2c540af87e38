"""prompt_stats recomputed from prompt_attempts of succeeded runs, in a real lake (temp FACTORY_HOME)."""

from datetime import UTC, datetime, timedelta

import pytest

from factory.data.stats import read_prompt_stats, update_prompt_stats

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def run(lake, run_id, status, minutes=0):
    lake.upsert("runs", [dict(run_id=run_id, name="t", spec="{}", spec_fingerprint="f", code_version="c",
                              status=status, seed=0, started_at=T0 + timedelta(minutes=minutes))])


def attempt(run_id, draw, source, prompt, samples, passes):
    return dict(run_id=run_id, draw=draw, step=draw // 2, source=source, prompt_id=prompt, samples=samples,
                passes=passes, reward_mean=passes / samples, reward_std=0.0 if passes in (0, samples) else 0.5,
                recorded_at=T0)


def stats(lake):
    return {(r["source"], r["prompt_id"]): r for r in lake.read("prompt_stats").to_pylist()}


def test_stats_count_only_succeeded_runs_and_a_second_update_writes_nothing(lake):
    run(lake, "a", "succeeded", 0)
    run(lake, "b", "succeeded", 5)
    run(lake, "c", "failed", 9)
    lake.upsert("prompt_attempts", [
        attempt("a", 0, "add2", "p1", 8, 8), attempt("a", 1, "add2", "p2", 8, 2), attempt("a", 2, "add2", "p1", 8, 6),
        attempt("b", 0, "add2", "p1", 4, 0), attempt("b", 1, "add3", "p1", 8, 4),
        attempt("c", 0, "add2", "p2", 8, 8),  # a failed run: not counted
    ])
    assert update_prompt_stats(lake) == 3
    got = stats(lake)
    assert set(got) == {("add2", "p1"), ("add2", "p2"), ("add3", "p1")}
    p1 = got[("add2", "p1")]
    assert (p1["attempts"], p1["passes"], p1["groups"], p1["runs"], p1["last_run_id"]) == (20, 14, 3, 2, "b")
    assert p1["pass_rate"] == 14 / 20
    p2 = got[("add2", "p2")]
    assert (p2["attempts"], p2["passes"], p2["runs"], p2["last_run_id"]) == (8, 2, 1, "a")

    snap = lake.table("prompt_stats").current_snapshot().snapshot_id
    assert update_prompt_stats(lake) == 0  # idempotent: nothing written, no new snapshot, updated_at kept
    assert lake.table("prompt_stats").current_snapshot().snapshot_id == snap
    assert stats(lake) == got


@pytest.mark.slow
def test_a_run_that_succeeds_later_updates_only_its_prompts_and_a_lost_run_drops_its_rows(lake):
    run(lake, "a", "succeeded")
    run(lake, "c", "running", 3)
    lake.upsert("prompt_attempts", [attempt("a", 0, "s", "x", 8, 4), attempt("a", 1, "s", "y", 8, 8),
                                    attempt("c", 0, "s", "y", 8, 0), attempt("c", 1, "s", "z", 8, 0)])
    assert update_prompt_stats(lake) == 2
    before = stats(lake)
    run(lake, "c", "succeeded", 3)
    assert update_prompt_stats(lake) == 2  # y changed, z is new; x untouched
    after = stats(lake)
    assert after[("s", "x")] == before[("s", "x")]
    y = after[("s", "y")]
    assert (y["attempts"], y["passes"], y["last_run_id"]) == (16, 8, "c")
    assert after[("s", "z")]["pass_rate"] == 0.0
    run(lake, "c", "failed", 3)  # marked failed after all: its prompts lose its groups
    assert update_prompt_stats(lake) == 2
    assert set(stats(lake)) == {("s", "x"), ("s", "y")} and stats(lake)[("s", "y")]["attempts"] == 8


def test_read_prompt_stats_by_source_with_the_snapshot_read(lake):
    assert read_prompt_stats(lake) == ({}, None)  # never written
    run(lake, "a", "succeeded")
    lake.upsert("prompt_attempts", [attempt("a", 0, "add2", "p", 8, 3), attempt("a", 1, "add3", "q", 4, 4)])
    update_prompt_stats(lake)
    snap = lake.table("prompt_stats").current_snapshot().snapshot_id
    assert read_prompt_stats(lake) == ({("add2", "p"): (8, 3), ("add3", "q"): (4, 4)}, snap)
    assert read_prompt_stats(lake, ["add3"]) == ({("add3", "q"): (4, 4)}, snap)
    assert read_prompt_stats(lake, ["nope"]) == ({}, snap)
    assert read_prompt_stats(lake, []) == ({}, snap)


@pytest.mark.slow
def test_a_pinned_snapshot_reads_what_it_held_and_an_unknown_one_the_current(lake):
    run(lake, "a", "succeeded")
    lake.upsert("prompt_attempts", [attempt("a", 0, "add2", "p", 8, 3)])
    update_prompt_stats(lake)
    first = lake.table("prompt_stats").current_snapshot().snapshot_id
    run(lake, "b", "succeeded", minutes=1)
    lake.upsert("prompt_attempts", [attempt("b", 0, "add2", "p", 8, 8)])
    update_prompt_stats(lake)
    now = lake.table("prompt_stats").current_snapshot().snapshot_id
    assert read_prompt_stats(lake, ["add2"], first) == ({("add2", "p"): (8, 3)}, first)  # what a resumed run reads
    assert read_prompt_stats(lake, ["add2"]) == ({("add2", "p"): (16, 11)}, now)
    assert read_prompt_stats(lake, ["add2"], 12345) == ({("add2", "p"): (16, 11)}, now)  # expired: the current
