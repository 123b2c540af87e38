"""A full disk under a real `factory run`: the resume-point write of step 4 meets ENOSPC (injected at that write,
FACTORY_FAULT_ENOSPC: mounting a small filesystem needs root privileges CI does not have). The run stops with
"disk full: DIR", exit code 6, no restart spent and step 2's resume point intact; `factory resume` finishes it."""

from __future__ import annotations

import pytest
from test_rl_run import TINY, factory, only_run, rows

from factory.core.resume import verify
from factory.runs.exit_codes import EXIT_DISK_FULL

# resume_write is reached after each of a resume point's 4 files: the 5th time is step 4's first file.
STEP_4_WRITE = "resume_write:5"


@pytest.mark.slow
def test_a_full_disk_stops_the_run_cleanly_without_spending_restarts_and_resume_continues(tmp_path):
    home = tmp_path / "home"
    res = factory(home, "run", "examples/quickstart.yaml", *TINY, env={"FACTORY_FAULT_ENOSPC": STEP_4_WRITE},
                  timeout=900)
    run = only_run(home)
    resume = home / "checkpoints" / run["run_id"] / "resume"
    assert res.returncode == EXIT_DISK_FULL, res.stderr[-3000:] + res.stdout[-3000:]
    assert f"factory: error: run {run['run_id']} stopped: disk full: {resume} (free space" in res.stderr
    assert "Traceback" not in res.stderr and "restart 1 of" not in res.stdout
    assert (run["status"], run["attempts"], run["restarts"]) == ("interrupted", 1, 0)
    (cut,) = rows(home, "interruptions")
    assert cut["cause"] == "disk_full" and f"disk full: {resume}" in cut["detail"]
    assert sorted(p.name for p in resume.iterdir()) == ["step-000002"]  # the previous one, intact; no torn temp
    assert verify(resume / "step-000002") is None

    again = factory(home, "resume", run["run_id"], timeout=900)  # space freed (the fault is gone)
    assert again.returncode == 0, again.stderr[-3000:]
    run = only_run(home)
    assert (run["status"], run["attempts"]) == ("succeeded", 2)
    assert sorted(r["step"] for r in rows(home, "steps")) == list(range(1, 9))


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_in_process_is_one_line_and_exit_6_not_a_safetensors_traceback(tmp_path):
    home = tmp_path / "home"
    res = factory(home, "run", "examples/quickstart.yaml", *TINY, "--set", "schedule.checkpoint_every=4",
                  "--in-process", env={"FACTORY_FAULT_ENOSPC": "checkpoint_write:1"}, timeout=900)
    run = only_run(home)
    assert res.returncode == EXIT_DISK_FULL, res.stderr[-3000:]
    assert f"factory: error: disk full: {home / 'checkpoints' / run['run_id']} (free space" in res.stderr
    assert "Traceback" not in res.stderr
    (cut,) = rows(home, "interruptions")
    assert (run["status"], cut["cause"]) == ("interrupted", "disk_full")
    resume = home / "checkpoints" / run["run_id"] / "resume"
    assert verify(resume / "step-000002") is None  # written before the checkpoint of step 4 met the full disk

    again = factory(home, "resume", run["run_id"], timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(r["step"] for r in rows(home, "steps")) == list(range(1, 9))


@pytest.mark.slow
def test_a_full_disk_during_the_sft_warm_start_is_one_line_and_exit_6(tmp_path):
    """Before any attempt: the SFT checkpoint's save meets ENOSPC (safetensors would say it in a SafetensorError);
    `factory run` says which directory is full, exits 6, and prints no traceback."""
    home = tmp_path / "home"
    res = factory(home, "run", "examples/quickstart.yaml", *TINY, env={"FACTORY_FAULT_ENOSPC": "checkpoint_save:1"},
                  timeout=900)
    assert res.returncode == EXIT_DISK_FULL, res.stderr[-3000:] + res.stdout[-3000:]
    assert f"factory: error: disk full: {home / 'checkpoints'} (free space" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
