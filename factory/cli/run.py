"""`factory validate`, `run`, `resume`, `train-grpo` and the internal `attempt`: checking a spec and training it,
in this process, in restarted child processes (`runs/restarts.py`), as torchrun ranks, or under Dagster Pipes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from factory.cli.common import add_spec, error, home_from, load
from factory.config import ExperimentSpec
from factory.core.trainer.launch import free_port, torchrun_command
from factory.home import FactoryPaths
from factory.ops.preflight.gate import PreflightFailed, gate
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NEEDS_FIX, EXIT_OK, EXIT_STOPPED

RANK_TIMEOUT_S = 6 * 3600.0  # followers wait in a collective while rank 0 builds the dataset and trains SFT


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a spec; print the resolved spec (YAML) or one `path: problem` line per error."""
    spec, err = load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{args.spec}: ok (fingerprint {spec.fingerprint()})")
    if (note := spec.model.ignored_preset()) is not None:
        print(note)
    if args.show:
        print(spec.to_yaml(), end="")
    return EXIT_OK


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
    if spec.trainer.world_size > 1:
        return _run_ranks(spec, args)
    return _run_spec(spec, args)


def _run_spec(spec: ExperimentSpec, args: argparse.Namespace) -> int:
    from factory.core.loop import NonFiniteLoss, RunInterrupted  # heavy: torch
    from factory.ops.supervisor import CircuitOpen  # heavy: httpx
    from factory.runs.experiment import RunFailed, run_experiment  # heavy: torch

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
    print(summary["report"])
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a run that did not finish, from its newest complete resume point (same run_id, same MLflow run)."""
    return _resume(home_from(args), args.run_id)


def _resume(paths: FactoryPaths, run_id: str) -> int:
    from factory.lake import Lake  # heavy: pyiceberg, duckdb
    from factory.runs import recovery  # heavy: torch
    from factory.runs.restarts import supervise  # heavy: torch
    from factory.runs.stages import eval_summary, render_report  # heavy: torch

    with Lake.open(paths) as lake:
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
    rc = supervise(paths, run_id, recovery.spec_of_run(row))
    if rc != EXIT_OK:
        return rc
    with Lake.open(paths) as lake:
        print(render_report(eval_summary(lake, run_id)))
    return EXIT_OK


def _run_ranks(spec: ExperimentSpec, args: argparse.Namespace, body=None) -> int:
    """trainer.world_size > 1: started by the user, re-run this command as that many torchrun ranks on this node
    (rank 0's output shown); as a rank, rank 0 runs the command (`body`, default `_run_spec`) and leads, the
    others apply its trainer steps."""
    if "RANK" not in os.environ:
        if not args.in_process:
            error(f"trainer.world_size = {spec.trainer.world_size}: data-parallel runs need --in-process for now "
                  f"(automatic restarts of a group of ranks are not built)")
            return EXIT_BAD_INPUT
        cmd = torchrun_command(spec.trainer.world_size, "factory.cli", args.argv, free_port(), log_dir=None)
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.trainer.threads or 1)}
        return subprocess.run(cmd, env=env).returncode
    import torch.distributed as dist  # heavy: torch

    from factory.core.trainer.distributed import init_ranks  # heavy: torch
    from factory.core.trainer.ranks import follow, leading  # heavy: torch

    rank, world = init_ranks(threads=spec.trainer.threads, timeout_s=max(RANK_TIMEOUT_S,
                                                                           2 * spec.schedule.wait_timeout_s + 60))
    try:
        if world != spec.trainer.world_size:
            error(f"trainer.world_size is {spec.trainer.world_size} but {world} ranks were started")
            return EXIT_BAD_INPUT
        if rank != 0:
            from factory.models.build import policy_for  # heavy: torch

            follow(spec, policy_for(spec)[0])  # the architecture; the weights come from rank 0
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
    from factory.runs.pipes import RunInputs, run_under_pipes  # heavy: torch

    fallback = RunInputs(args.init, args.dataset, args.run_id) if args.init and args.dataset else None
    return run_under_pipes(spec, home_from(args), fallback)


def cmd_attempt(args: argparse.Namespace) -> int:
    """One attempt of a run in this process (what `factory run` and `factory resume` start as children)."""
    from factory.runs.rl_run import attempt_main, standby  # heavy: torch

    return (standby if args.standby else attempt_main)(home_from(args), args.run_id)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a spec; exit 2 naming each bad field")
    add_spec(p)
    p.add_argument("--show", action="store_true", help="print the resolved spec with defaults")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help="train a spec end to end (the same code the Dagster assets call)")
    add_spec(p, optional=True)
    p.add_argument("--control", action="store_true",
                   help="also spend the GRPO run's wall time on more SFT, for comparison")
    p.add_argument("--resume", metavar="RUN_ID", help="continue this run from its newest resume point instead")
    p.add_argument("--in-process", action="store_true",
                   help="train in this process, without automatic restarts (default: attempts run in child "
                        "processes, restarted and resumed when one dies or hangs, up to ops.max_restarts)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("train-grpo", help="(the grpo_run asset's trainer pods) the RL run, "
                       "inputs and result through Dagster Pipes")
    add_spec(p)
    p.add_argument("--init", help="SFT checkpoint to start from (outside Pipes; under Pipes the extras give it)")
    p.add_argument("--dataset", help="dataset directory (outside Pipes)")
    p.add_argument("--run-id", help="continue this factory run (outside Pipes)")
    p.set_defaults(func=cmd_train_rl)

    p = sub.add_parser("resume", help="continue a run that did not finish, from its newest resume point")
    p.add_argument("run_id", metavar="RUN_ID", help="run id (see `factory runs`)")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("attempt", help="(internal) one attempt of a run in this process; run/resume start these")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--standby", action="store_true", help="warm up, then wait for 'go ATTEMPT' on stdin")
    p.set_defaults(func=cmd_attempt)
