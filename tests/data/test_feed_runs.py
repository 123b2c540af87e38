"""Exactly-once through a real kill: a `factory run` with a data blend and an online curriculum is SIGKILLed
mid-run, restarted by its supervisor, and trains exactly the prompts of an uninterrupted run."""

from __future__ import annotations

import json

from tests.test_grpo_run import TINY, factory, rows

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
