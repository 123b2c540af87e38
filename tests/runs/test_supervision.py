"""Supervision without gaps, on a real supervised `factory run` (`runs/restarts.py`, `runs/attempt.py`): an attempt
whose supervisor is SIGKILLed stops at its next resume point and `factory resume` finishes the run; the hang watchdog
leaves an attempt alone once it announced it finished; several kills during resume writes leave every interruption
row complete and goodput above 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from factory.runs.attempt import AttemptLock
from tests.polling import wait_for
from tests.runs.test_rl_run import TINY, factory, only_run, rows

COSTS = ("resumed_from_step", "steps_lost", "redo_s", "recover_s", "detect_s")



def _beat_at_least(home: Path, step: int) -> Path | None:
    for b in (home / "checkpoints").glob("crash-*/heartbeat"):
        text = b.read_text().strip()
        if text.isdigit() and int(text) >= step:
            return b
    return None


@pytest.mark.slow
def test_an_attempt_whose_supervisor_is_killed_stops_at_a_resume_point_and_resume_finishes(tmp_path):
    home = tmp_path / "home"
    # Each weight publish holds 0.3 s (a fault point's window), so the supervisor dies mid-run.
    env = {**os.environ, "FACTORY_FAULT_DIR": str(tmp_path / "faults"), "FACTORY_FAULT_HOLD_S": "publish:0.3"}
    with open(tmp_path / "run.log", "w") as out:
        sup = subprocess.Popen([sys.executable, "-m", "factory.cli", "--home", str(home), "run",
                                "examples/quickstart.yaml", *TINY], stdout=out, stderr=subprocess.STDOUT, env=env)
        beat = wait_for("step 3", lambda: sup.poll() is None and _beat_at_least(home, 3))
        run_dir = beat.parent
        sup.send_signal(signal.SIGKILL)
        sup.wait()
        # The orphaned attempt notices at its next step, writes a resume point and exits (releasing its lock).
        wait_for("the orphaned attempt to stop", lambda: not AttemptLock.is_held(run_dir))
    log = (tmp_path / "run.log").read_text()
    run = only_run(home)
    assert run["status"] == "interrupted", log
    (cut,) = rows(home, "interruptions")
    assert cut["cause"] == "supervisor_lost", log
    stopped_at = max(r["step"] for r in rows(home, "steps"))
    assert 3 <= stopped_at < 8, log
    assert sorted(p.name for p in (run_dir / "resume").iterdir())[-1] == f"step-{stopped_at:06d}"
    res = factory(home, "resume", run["run_id"])
    assert res.returncode == 0, res.stderr + res.stdout
    after = only_run(home)
    assert (after["status"], after["attempts"]) == ("succeeded", 2)
    assert sorted(r["step"] for r in rows(home, "steps")) == list(range(1, 9))  # none missing, none twice
    (cut,) = rows(home, "interruptions")
    assert cut["resumed_from_step"] == stopped_at and cut["steps_lost"] == 0
    assert all(cut[c] is not None for c in COSTS)


@pytest.mark.slow
def test_the_hang_watchdog_leaves_a_finished_attempt_alone(tmp_path):
    # After recording its result the attempt takes 3x the hang timeout to exit (what closing the lake, MLflow and
    # the interpreter can take): it announced it finished, so it is not killed as hung and not restarted.
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *TINY, "--set", "ops.hang_timeout_s=6",
                  env={"FACTORY_FAULT_DIR": str(tmp_path / "faults"), "FACTORY_FAULT_HOLD_S": "attempt_exit:18"})
    assert res.returncode == 0, res.stderr + res.stdout
    assert "hung for" not in res.stdout and "restart 1" not in res.stdout, res.stdout
    run = only_run(tmp_path)
    assert (run["status"], run["attempts"], run["interruptions"]) == ("succeeded", 1, 0)
    assert rows(tmp_path, "interruptions") == []


@pytest.mark.slow
def test_a_kill_after_the_last_resume_point_leaves_a_complete_interruption(tmp_path):
    # Attempt 1 trains all 8 steps (the resume point of step 8 is on disk) and is SIGKILLed as it starts its final
    # stages; attempt 2 has no step left to train, and must still close attempt 1's record.
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *TINY,
                  env={"FACTORY_FAULT_KILL": "finish:1", "FACTORY_FAULT_ATTEMPT": "1"})
    assert res.returncode == 0, res.stderr + res.stdout
    run = only_run(tmp_path)
    assert (run["status"], run["attempts"]) == ("succeeded", 2)
    (cut,) = rows(tmp_path, "interruptions")
    assert all(cut[c] is not None for c in COSTS), cut
    assert (cut["last_step"], cut["resumed_from_step"], cut["steps_lost"]) == (8, 8, 0)
    assert abs(run["lost_s"] - (cut["redo_s"] + cut["detect_s"] + cut["recover_s"])) < 1e-6
    assert 0 < run["goodput"] < 1


@pytest.mark.slow
def test_kills_during_resume_writes_cost_each_attempt_only_its_own_time(tmp_path):
    # Every attempt SIGKILLs itself while writing its first resume point (step 2's; 4 fault points a write), so
    # each of the 3 attempts resumes from the run's start: attempt k's redo is its own 2 steps, not the time of
    # attempts 1..k-1 again. Then `factory resume` (no fault) finishes the run.
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *TINY, "--set", "ops.max_restarts=2",
                  env={"FACTORY_FAULT_KILL": "resume_write:2"})
    assert res.returncode == 1, res.stderr + res.stdout
    run_id = only_run(tmp_path)["run_id"]
    res = factory(tmp_path, "resume", run_id)
    assert res.returncode == 0, res.stderr + res.stdout
    run = only_run(tmp_path)
    assert (run["status"], run["attempts"]) == ("succeeded", 4), res.stdout
    assert sorted(r["step"] for r in rows(tmp_path, "steps")) == list(range(1, 9))
    cuts = sorted(rows(tmp_path, "interruptions"), key=lambda r: r["attempt"])
    assert [c["attempt"] for c in cuts] == [1, 2, 3]
    for c in cuts:
        assert all(c[k] is not None for k in COSTS), c
        assert (c["resumed_from_step"], c["steps_lost"]) == (0, c["last_step"])
    # Each redo is the dead attempt's own work: shorter than its life (from the previous failure to its own).
    for before, c in zip(cuts, cuts[1:], strict=False):
        assert c["redo_s"] <= (c["failed_at"] - before["failed_at"]).total_seconds(), cuts
    lost = sum(c["redo_s"] + c["detect_s"] + c["recover_s"] for c in cuts)
    assert abs(run["lost_s"] - lost) < 1e-6
    assert 0 < run["goodput"] < 1
    assert abs(run["goodput"] - (1 - lost / run["wall_s"])) < 1e-6
