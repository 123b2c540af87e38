"""A slow phase is not a hang: a supervised run whose evals each take longer than `ops.hang_timeout_s` beats from
inside them (`infra/liveness.py`) and ends in its first attempt, with no watchdog kill and no restart."""

from __future__ import annotations

import pytest

from tests.runs.test_rl_run import TINY, factory, only_run, rows


@pytest.mark.slow  # a real supervised `factory run` (~40 s on 2 cores; ~70 s when it fails, as before the fix)
def test_evals_slower_than_the_hang_timeout_survive_in_one_attempt(tmp_path):
    # Every greedy answer of every held-out eval takes 0.25 s to verify: each eval of the 16 problems is silent for
    # more than 4 s without beats of its own, past ops.hang_timeout_s = 3 (step 0, step 2's periodic eval, the final).
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *TINY, "--set", "schedule.steps=4",
                  "--set", "schedule.eval_every=2", "--set", "ops.hang_timeout_s=3",
                  env={"FACTORY_FAULT_DIR": str(tmp_path / "faults"), "FACTORY_FAULT_HOLD_S": "eval_verify:0.25"})
    assert res.returncode == 0, res.stderr + res.stdout
    assert "hung for" not in res.stdout and "restart 1" not in res.stdout, res.stdout
    run = only_run(tmp_path)
    assert (run["status"], run["attempts"], run["restarts"], run["interruptions"]) == ("succeeded", 1, 0, 0)
    assert rows(tmp_path, "interruptions") == []
    held = {r["step"] for r in rows(tmp_path, "evals") if r["benchmark"] == "arithmetic_heldout"}
    assert held == {0, 2, 4}  # the slow evals all ran: the start, the periodic one, the final one
