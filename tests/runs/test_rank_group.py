"""A data-parallel run (trainer.world_size = 2, gloo on CPU) supervised like a one-process run: `factory run` starts
each attempt as a torchrun group of ranks (runs/rank_group.py); a rank SIGKILLed mid-run takes the group down, and
the next group resumes from the newest resume point, automatically or through `factory resume`. Afterwards the lake
holds one `steps` row per step and the interruption of the killed attempt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.home import FactoryPaths
from factory.lake import Lake

DP = ["--set", "name=dp", "--set", "model.preset=micro", "--set", "task.digits=[1]", "--set", "task.n_train=40",
      "--set", "task.n_eval=8", "--set", "sft.steps=10", "--set", "sft.stop_at_accuracy=null",
      "--set", "rollout.prompts_per_step=4", "--set", "algorithm.group_size=2", "--set", "schedule.steps=4",
      "--set", "schedule.eval_pass_k=2", "--set", "ops.resume_every=1", "--set", "trainer.threads=1",
      "--set", "ops.preflight=off", "--set", "trainer.world_size=2", "--set", "trainer.strategy=ddp"]
# Rank 1 SIGKILLs itself as it is about to apply step 4 (the follower's fourth `step` call), in attempt 1 only. A
# resume point is taken after every step and a save waits for the previous write, so step 2's is complete on disk;
# step 3's may still be being written when the group goes down (torchrun stops rank 0 too).
KILL_RANK_1 = {"FACTORY_FAULT_KILL": "follower_step:4", "FACTORY_FAULT_ATTEMPT": "1"}


def factory(home: Path, *args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", "--home", str(home), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _rows(home: Path, table: str) -> list[dict]:
    with Lake.open(FactoryPaths(home)) as lake:
        return lake.read(table).to_pylist()


def _check_resumed(home: Path) -> dict:
    (run,) = _rows(home, "runs")
    assert (run["status"], run["attempts"]) == ("succeeded", 2)
    steps = sorted((r["step"], r["attempt"]) for r in _rows(home, "steps"))
    assert [s for s, _ in steps] == [1, 2, 3, 4]  # one row per step: no hole, no duplicate
    (cut,) = _rows(home, "interruptions")
    assert cut["attempt"] == 1 and cut["resumed_from_step"] in (2, 3)
    assert {a for s, a in steps if s > cut["resumed_from_step"]} == {2}  # the rest by the second group
    assert {a for s, a in steps if s <= cut["resumed_from_step"]} == {1}  # not trained again
    assert (home / "checkpoints" / run["run_id"] / "final" / "model.safetensors").is_file()
    return run


@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_from_its_resume_point(tmp_path):
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *DP, env=KILL_RANK_1)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "restart 1 of 3, resuming from its newest resume point" in res.stdout
    _check_resumed(tmp_path)


@pytest.mark.slow
def test_factory_resume_continues_a_data_parallel_run(tmp_path):
    res = factory(tmp_path, "run", "examples/quickstart.yaml", *DP, "--set", "ops.max_restarts=0", env=KILL_RANK_1)
    assert res.returncode != 0 and "restarts are used up; resume it by hand with: factory resume" in res.stdout
    (run,) = _rows(tmp_path, "runs")
    assert run["status"] == "failed"
    done = factory(tmp_path, "resume", run["run_id"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _check_resumed(tmp_path)


def test_a_groups_exit_code_is_rank_0s_only_when_it_finished_or_needs_a_fix(tmp_path):
    from factory.runs.exit_codes import EXIT_LOGPROB_GAP, EXIT_NEEDS_FIX, EXIT_STOPPED
    from factory.runs.rank_group import GROUP_EXIT, group_code

    assert group_code(tmp_path, 1, 0) == 0
    assert group_code(tmp_path, 1, 1) == 1  # nothing written: rank 0 died too
    for said, attempt, expected in [(f"1 {EXIT_NEEDS_FIX}", 1, EXIT_NEEDS_FIX), ("1 0", 1, 0),
                                    (f"1 {EXIT_LOGPROB_GAP}", 1, EXIT_LOGPROB_GAP),  # the gate: a setup to fix
                                    (f"1 {EXIT_STOPPED}", 1, 1),  # stopped because torchrun stopped it: a crash
                                    (f"2 {EXIT_NEEDS_FIX}", 1, 1), ("1 garbage", 1, 1)]:  # another attempt's
        (tmp_path / GROUP_EXIT).write_text(said)
        assert group_code(tmp_path, attempt, 1) == expected, said


def test_a_group_attempt_is_torchrun_on_this_machine(tmp_path):
    from factory.config import load_spec
    from factory.runs.rank_group import attempt_command

    one = load_spec("examples/quickstart.yaml")
    spec = one.model_copy(update={"trainer": one.trainer.model_copy(update={"world_size": 2})})
    cmd = attempt_command(FactoryPaths(tmp_path), "r1", spec)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"] and cmd[5] == "2"
    assert cmd[-6:] == ["-m", "factory.cli", "--home", str(tmp_path), "attempt", "r1"]
    assert attempt_command(FactoryPaths(tmp_path), "r1", one)[1:] == ["-m", "factory.cli", "--home", str(tmp_path),
                                                                      "attempt", "r1"]
