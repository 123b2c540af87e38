"""`factory run`, `resume`, `train-grpo` and the internal `attempt`: training a spec in this process, in restarted
child processes (`runs/restarts.py`), as torchrun ranks, or under Dagster Pipes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch.distributed as dist

from factory.cli.common import check_model, error, home_from, load
from factory.cli.spec import machine_problem
from factory.config import ExperimentSpec
from factory.core.gate import LogprobGapError
from factory.core.loop import NonFiniteLoss, RunInterrupted
from factory.core.trainer.distributed import init_ranks
from factory.core.trainer.launch import torchrun_command
from factory.core.trainer.ranks import follow, leading
from factory.home import FactoryPaths
from factory.infra.disk import full_disk_dir
from factory.infra.supervisor import CircuitOpen
from factory.lake import Lake
from factory.lake.spool import SPOOL, LakeDown, Spool, is_catalog_error
from factory.models.build import policy_for
from factory.ops.preflight.gate import PreflightFailed, gate
from factory.runs import recovery, standby
from factory.runs.degraded import read_when_up
from factory.runs.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_DEPENDENCY_DOWN,
    EXIT_DISK_FULL,
    EXIT_FAILED,
    EXIT_LOGPROB_GAP,
    EXIT_NEEDS_FIX,
    EXIT_OK,
    EXIT_STOPPED,
)
from factory.runs.experiment import RunFailed, report_when_up, run_experiment
from factory.runs.pipes import RunInputs, run_under_pipes
from factory.runs.rank_group import attempt_spec, is_group, run_group_attempt
from factory.runs.restarts import supervise
from factory.runs.rl_run import attempt_main
from factory.source_spec import SourceError

RANK_TIMEOUT_S = 6 * 3600.0  # followers wait in a collective while rank 0 builds the dataset and trains SFT


def cmd_run(args: argparse.Namespace) -> int:
    """Train a spec end to end (dataset, SFT, RL run, report): the same functions the Dagster assets call.

    The RL run's attempts run in child processes, restarted (resuming) when one dies or hangs; with
    --in-process it trains in this process and is not restarted."""
    if args.resume:
        if args.spec is not None:
            error("give a spec or --resume RUN_ID, not both (a run resumes with its own spec)")
            return EXIT_BAD_INPUT
        return _resume(home_from(args), args.resume)
    if args.spec is None:
        error("a spec is required (or --resume RUN_ID)")
        return EXIT_BAD_INPUT
    spec, err = load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    if (problem := check_model(spec, args)[1] or machine_problem(spec)[0]) is not None:  # before any process starts
        error(problem)
        return EXIT_BAD_INPUT
    if spec.trainer.world_size > 1 and (args.in_process or "RANK" in os.environ):
        return _run_ranks(spec, args)
    # Supervised (world_size > 1 too): each attempt is a child process, or a torchrun group of ranks
    # (runs/rank_group.py), restarted from the newest resume point when it dies.
    return _run_spec(spec, args)


def _run_spec(spec: ExperimentSpec, args: argparse.Namespace) -> int:
    try:
        gate(spec.ops, home_from(args), log=print)  # no training on a node whose latest preflight failed
    except PreflightFailed as e:
        error(str(e))
        return EXIT_FAILED
    try:
        summary = run_experiment(spec, home_from(args), control=args.control, supervised=not args.in_process)
    except RunFailed as e:
        error(str(e))
        return e.code
    except RunInterrupted as e:  # --in-process, stopped by a signal: the resume point is on disk
        error(str(e))
        return EXIT_STOPPED
    except (NonFiniteLoss, CircuitOpen) as e:
        error(str(e))
        return EXIT_NEEDS_FIX
    except LogprobGapError as e:  # --in-process: the engine and the trainer disagree (core/gate.py)
        error(str(e))
        return EXIT_LOGPROB_GAP
    except SourceError as e:  # --in-process: a data file that changed or vanished since the spec was checked
        error(" ".join(str(e).split()))
        return EXIT_BAD_INPUT
    except LakeDown as e:  # --in-process: stopped at a resume point, its rows spooled
        error(str(e))
        return EXIT_DEPENDENCY_DOWN
    except Exception as e:
        if (full := full_disk_dir(e, default=home_from(args).root)) is None:
            raise
        error(f"disk full: {full} (free space, then resume the run: factory resume RUN_ID, see `factory runs`)")
        return EXIT_DISK_FULL
    print(summary["report"])
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a run that did not finish, from its newest complete resume point (same run_id, same MLflow run)."""
    return _resume(home_from(args), args.run_id)


def _resume(paths: FactoryPaths, run_id: str) -> int:
    try:
        return _resume_run(paths, run_id)
    except Exception as e:  # the lake down or the disk full before any attempt started: one line, its exit code
        if (full := full_disk_dir(e, default=paths.root)) is not None:
            error(f"disk full: {full} (free space, then: factory resume {run_id})")
            return EXIT_DISK_FULL
        if not is_catalog_error(e):
            raise
        error(f"lake unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
              f"try again once it is back: factory resume {run_id}")
        return EXIT_DEPENDENCY_DOWN


def _resume_run(paths: FactoryPaths, run_id: str) -> int:
    with Lake.open(paths) as lake:
        Spool(paths.checkpoints / run_id / SPOOL).flush(lake)  # what the run kept while the lake was down, first
        row = recovery.run_row(lake, run_id)
        if row is None:
            error(f"no run {run_id!r} in the lake (see `factory runs`)")
            return EXIT_BAD_INPUT
        if row["status"] == "succeeded":
            print(f"run {run_id} already succeeded")
            return EXIT_OK
        if recovery.is_dead(row, paths.checkpoints / run_id):
            recovery.mark_dead(lake, row, paths.checkpoints / run_id)
        elif row["status"] in recovery.LIVE:
            error(f"run {run_id} is running (an attempt holds its lock); stop it first")
            return EXIT_BAD_INPUT
        row = recovery.run_row(lake, run_id)
        try:
            gate(recovery.spec_of_run(row).ops, paths, lake, log=print)
        except PreflightFailed as e:  # the attempt that would have resumed it was refused: say so in its record
            recovery.record_interruption(lake, run_id, int(row.get("attempts") or 1) + 1, "failed_preflight",
                                         str(e), recovery.last_step(lake, run_id))
            error(str(e))
            return EXIT_FAILED
    spec = recovery.spec_of_run(row)
    rc = supervise(paths, run_id, spec)
    if rc != EXIT_OK:
        return rc
    with read_when_up(lambda: Lake.open(paths), spec.ops.lake_outage_s, print) as lake:
        print(report_when_up(lake, run_id, spec.ops.lake_outage_s)["report"])
    return EXIT_OK


def _run_ranks(spec: ExperimentSpec, args: argparse.Namespace, body=None) -> int:
    """trainer.world_size > 1: started by the user, re-run this command as that many torchrun ranks on this node
    (rank 0's output shown); as a rank, rank 0 runs the command (`body`, default `_run_spec`) and leads, the
    others apply its trainer steps."""
    if "RANK" not in os.environ:
        cmd = torchrun_command(spec.trainer.world_size, "factory.cli", args.argv, log_dir=None)
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.trainer.threads or 1)}
        return subprocess.run(cmd, env=env).returncode
    rank, world = init_ranks(threads=spec.trainer.threads, timeout_s=max(RANK_TIMEOUT_S,
                                                                           2 * spec.schedule.wait_timeout_s + 60))
    try:
        if world != spec.trainer.world_size:
            error(f"trainer.world_size is {spec.trainer.world_size} but {world} ranks were started")
            return EXIT_BAD_INPUT
        if rank != 0:
            follow(spec, policy_for(spec, home_from(args))[0])  # the architecture; the weights come from rank 0
            return EXIT_OK
        print(f"trainer: rank 0 of {world} ({spec.trainer.strategy} on {dist.get_backend()}); ranks 1-{world - 1} "
              f"apply its steps to their share of each batch", flush=True)
        with leading():
            return (body or _run_spec)(spec, args)
    finally:
        dist.destroy_process_group()


def cmd_train_rl(args: argparse.Namespace) -> int:
    """The `grpo_run` asset's RL run in this process, its inputs and result passed through Dagster Pipes (what the
    trainer pods run on Kubernetes); outside Pipes, --init and --dataset give the inputs."""
    spec, err = load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    args.in_process = True  # the ranks re-run this command; the launcher (Dagster) does the retrying
    return _run_ranks(spec, args, _train_under_pipes) if spec.trainer.world_size > 1 else _train_under_pipes(spec, args)


def _train_under_pipes(spec: ExperimentSpec, args: argparse.Namespace) -> int:
    fallback = RunInputs(args.init, args.dataset, args.run_id) if args.init and args.dataset else None
    return run_under_pipes(spec, home_from(args), fallback)


def cmd_attempt(args: argparse.Namespace) -> int:
    """One attempt of a run in this process (what `factory run` and `factory resume` start as children); in a
    torchrun rank, the rank's part of a data-parallel attempt (runs/rank_group.py)."""
    paths = home_from(args)
    if "RANK" in os.environ and not args.standby:
        spec = attempt_spec(paths, args.run_id)
        if spec is not None and is_group(spec):
            return run_group_attempt(paths, args.run_id, spec)
    if args.standby:
        return standby.serve(paths, args.run_id, attempt_main)
    return attempt_main(paths, args.run_id)
