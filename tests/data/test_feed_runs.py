"""Exactly-once through a real kill: a `factory run` with a data blend and an online curriculum is SIGKILLed
mid-run, restarted by its supervisor, and trains exactly the prompts of an uninterrupted run."""

from __future__ import annotations

import json

import pytest

from tests.runs.test_rl_run import TINY, factory, rows

DATA = {"sources": [{"name": "add2", "kind": "arithmetic", "op": "add", "digits": 2, "n": 24, "block_rows": 8,
                     "reverse_operands": True},
                    {"name": "add3", "kind": "arithmetic", "op": "add", "digits": 3, "n": 200,
                     "reverse_operands": True}],
        "weights": {"add2": 1, "add3": 1}, "held_out": 8,
        "curriculum": {"kind": "online", "attempts": 1, "drop": "both"}}
ARGS = ["run", "examples/quickstart.yaml", *TINY, "--set", "schedule.steps=10", "--set", f"data={json.dumps(DATA)}"]


def trained(home) -> list[tuple]:
    return sorted((r["step"], r["draw"], r["source"], r["prompt_id"], r["passes"])
                  for r in rows(home, "prompt_attempts"))


@pytest.mark.slow
def test_a_killed_and_resumed_blend_run_trains_the_prompts_of_an_uninterrupted_one(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    ok = factory(straight, *ARGS, "--in-process")
    assert ok.returncode == 0, ok.stderr
    res = factory(crashed, *ARGS, env={"FACTORY_FAULT_KILL": "publish:7", "FACTORY_FAULT_ATTEMPT": "1"})
    assert res.returncode == 0, res.stderr + res.stdout
    assert "restart 1 of 3" in res.stdout
    want, got = trained(straight), trained(crashed)
    assert got == want  # same steps, draws, prompts and outcomes: none trained twice, none skipped
    draws = [d for _, d, *_ in got]
    assert len(draws) == len(set(draws)) == 10 * 4
    assert {s for _, _, s, *_ in got} == {"add2", "add3"}
    # the curriculum's state came back too: it skipped prompts of the small source's later epochs alike
    steps = {(r["step"], r["source"]): r["skipped"] for r in rows(crashed, "step_sources")}
    assert steps == {(r["step"], r["source"]): r["skipped"] for r in rows(straight, "step_sources")}
    (run,) = rows(crashed, "runs")
    assert run["attempts"] == 2 and run["status"] == "succeeded"


@pytest.mark.slow
def test_a_new_run_filters_its_sources_by_the_pass_rates_of_earlier_runs(tmp_path):
    """Offline curriculum: run 1 trains every prompt of a small source; prompt_stats records their pass rates
    (all 0 for this barely trained model); run 2 blends that source with a new one and a pass-rate window that
    excludes never-solved prompts: it skips all of the old source's prompts and trains only the new ones."""
    from factory.data.stats import read_prompt_stats, update_prompt_stats
    from tests.runs.test_rl_run import _lake

    home = tmp_path / "home"
    old = {"name": "seen", "kind": "arithmetic", "op": "add", "digits": 3, "n": 16, "reverse_operands": True}
    new = {"name": "fresh", "kind": "arithmetic", "op": "add", "digits": 3, "n": 400, "start": 1000,
           "reverse_operands": True}
    first = {"sources": [old], "held_out": 0}
    res = factory(home, "run", "examples/quickstart.yaml", *TINY, "--set", "schedule.steps=4",
                  "--set", f"data={json.dumps(first)}", "--in-process")
    assert res.returncode == 0, res.stderr
    with _lake(home) as lake:
        assert update_prompt_stats(lake) == 16
        stats, snapshot = read_prompt_stats(lake, ["seen"])
    assert len(stats) == 16 and snapshot is not None
    assert all(passes == 0 for _, passes in stats.values())  # 4 steps x 4 prompts x 2 samples: every prompt twice
    second = {"sources": [old, new], "held_out": 0,
              "filter": {"min_pass_rate": 0.05, "max_pass_rate": 1.0, "min_attempts": 2}}
    res = factory(home, "run", "examples/quickstart.yaml", *TINY, "--set", "schedule.steps=4",
                  "--set", f"data={json.dumps(second)}", "--in-process")
    assert res.returncode == 0, res.stderr
    assert "data.filter: pass rates of 16 prompts" in res.stdout
    runs = sorted(rows(home, "runs"), key=lambda r: r["started_at"])
    later = runs[-1]["run_id"]
    trained = [r for r in rows(home, "prompt_attempts") if r["run_id"] == later]
    assert len(trained) == 16 and {r["source"] for r in trained} == {"fresh"}
    skipped = sum(r["skipped"] for r in rows(home, "step_sources") if r["run_id"] == later and r["source"] == "seen")
    assert skipped >= 8  # half the blend by weight: every one of its draws was skipped
