"""A run's attempt as a group of trainer ranks on this machine (`trainer.world_size` > 1), so that a data-parallel
run is supervised, restarted and resumed like a one-process run.

The supervisor (`runs/restarts.py`) starts each attempt as `torchrun --standalone --nproc-per-node N -m factory.cli
attempt RUN_ID` in its own process session (`attempt_command`). In each rank `run_group_attempt` joins the group:
rank 0 runs the attempt itself (`rl_run.attempt_main`: the lock, the lake, the loop, the resume points) and leads,
the other ranks apply its trainer calls (`core/trainer/ranks.follow`). A rank that dies takes the group down with
it (torchrun stops the others, `--max-restarts 0`), the supervisor sees the attempt end and starts the next group,
which resumes from the newest resume point, as it would a one-process attempt. A hung group is killed as a whole
(its process session).

torchrun's own exit code says only that some rank failed, so rank 0 writes what its attempt returned to
`group_exit` in the run directory; the supervisor reads it (`group_code`) to tell a run that finished, or needs a
fix, from a group that crashed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from factory.config import ExperimentSpec, parse_spec
from factory.core.trainer.distributed import init_ranks
from factory.core.trainer.launch import torchrun_command
from factory.core.trainer.ranks import follow, leading
from factory.home import FactoryPaths
from factory.lake.writer import Lake
from factory.models.build import policy_for
from factory.runs import recovery
from factory.runs.attempt import read_launch
from factory.runs.exit_codes import EXIT_FAILED, EXIT_LOGPROB_GAP, EXIT_NEEDS_FIX, EXIT_OK
from factory.runs.rl_run import attempt_main

GROUP_EXIT = "group_exit"  # in the run directory: rank 0's exit code for its attempt (FACTORY_ATTEMPT)
GROUP_TIMEOUT_S = 3600.0  # longest a follower waits in a collective (rank 0 loads, evaluates step 0, ...)


def is_group(spec: ExperimentSpec) -> bool:
    """Whether the run's attempts are groups of ranks (data-parallel torch trainer)."""
    return spec.trainer.world_size > 1 and spec.trainer.backend == "torch"


def attempt_spec(paths: FactoryPaths, run_id: str) -> ExperimentSpec | None:
    """The spec an attempt of `run_id` trains: its `runs` row's, or before it has one its launch file's."""
    with Lake.open(paths) as lake:
        row = recovery.run_row(lake, run_id)
    if row is not None:
        return recovery.spec_of_run(row)
    launch = read_launch(paths.checkpoints / run_id)
    return parse_spec(launch["spec"], source=f"run {run_id}") if launch else None


def attempt_command(paths: FactoryPaths, run_id: str, spec: ExperimentSpec) -> list[str]:
    """The command line of one attempt: `factory attempt RUN_ID`, as `world_size` torchrun ranks when a group."""
    args = ["--home", str(paths.root), "attempt", run_id]
    if not is_group(spec):
        return [sys.executable, "-m", "factory.cli", *args]
    return torchrun_command(spec.trainer.world_size, "factory.cli", args, log_dir=None)


def group_code(run_dir: Path, attempt: int, torchrun_rc: int) -> int:
    """The exit code an attempt group stands for: 0 when torchrun says all ranks succeeded; else rank 0's own code
    when it finished the run (0) or stopped it for a fix (`EXIT_NEEDS_FIX`, `EXIT_LOGPROB_GAP`); else torchrun's (a
    crash: restart)."""
    if torchrun_rc == 0:
        return EXIT_OK
    try:
        said = (run_dir / GROUP_EXIT).read_text().split()
    except FileNotFoundError:
        return torchrun_rc
    if len(said) == 2 and said[0] == str(attempt) and said[1].lstrip("-").isdigit():
        code = int(said[1])
        if code in (EXIT_OK, EXIT_NEEDS_FIX, EXIT_LOGPROB_GAP):
            return code
    return torchrun_rc


def _write_group_exit(run_dir: Path, attempt: str, code: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{GROUP_EXIT}.tmp"
    tmp.write_text(f"{attempt} {code}\n")
    os.replace(tmp, run_dir / GROUP_EXIT)


def run_group_attempt(paths: FactoryPaths, run_id: str, spec: ExperimentSpec) -> int:
    """In a torchrun rank: rank 0 runs the attempt and leads, the others follow; returns this rank's exit code."""
    rank, world = init_ranks(threads=spec.trainer.threads,
                             timeout_s=max(GROUP_TIMEOUT_S, 2 * spec.schedule.wait_timeout_s + 60))
    try:
        if world != spec.trainer.world_size:
            print(f"factory: error: trainer.world_size is {spec.trainer.world_size} but {world} ranks were started",
                  file=sys.stderr)
            return EXIT_NEEDS_FIX
        if rank != 0:
            follow(spec, policy_for(spec, paths)[0])  # the architecture; the weights come from rank 0
            return EXIT_OK
        code = EXIT_FAILED
        try:
            with leading():
                code = attempt_main(paths, run_id)
        finally:
            _write_group_exit(paths.checkpoints / run_id, os.environ.get("FACTORY_ATTEMPT", "1"), code)
        return code
    finally:
        dist.destroy_process_group()
