"""The `factory` command. Each subcommand is a `cmd_<name>(args) -> int` registered in `build_parser`.

Exit codes: 0 ok, 1 failure while doing the work, 2 bad input (bad SQL, unknown table, bad arguments),
with a one-line `factory: error: ...` on stderr. The home directory is --home, else $FACTORY_HOME.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from factory.home import FactoryPaths, factory_home
from factory.models.presets import PRESETS

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# The `runs` listing. "Final accuracy" is the mean over whole benchmarks (not their `bench/slice` rows)
# of metric 'accuracy' at the run's last step, the greatest step the run recorded in `steps` or
# `evals`; NULL when no accuracy eval ran at that step (a run still going, or one that failed
# before its final eval).
RUNS_SQL = """
WITH last_step AS (
    SELECT run_id, max(step) AS step
    FROM (SELECT run_id, step FROM steps UNION ALL SELECT run_id, step FROM evals)
    GROUP BY run_id
),
final_acc AS (
    SELECT e.run_id, avg(e.value) AS accuracy, string_agg(DISTINCT e.benchmark, ',') AS benchmarks
    FROM evals e JOIN last_step l ON e.run_id = l.run_id AND e.step = l.step
    WHERE e.metric = 'accuracy' AND e.benchmark NOT LIKE '%/%'  -- whole benchmarks, not their slices
    GROUP BY e.run_id
)
SELECT r.run_id, r.name, r.status, r.started_at, r.ended_at,
       l.step AS final_step, a.accuracy AS final_accuracy, a.benchmarks, r.sweep_id,
       r.attempts, r.restarts, round(r.goodput, 4) AS goodput
FROM runs r
LEFT JOIN last_step l ON r.run_id = l.run_id
LEFT JOIN final_acc a ON r.run_id = a.run_id
ORDER BY r.started_at DESC, r.run_id
"""


def error(msg: str) -> None:
    """One line on stderr, the way argparse reports usage errors."""
    print(f"factory: error: {msg}", file=sys.stderr)


def home_from(args: argparse.Namespace) -> FactoryPaths:
    return factory_home(getattr(args, "home", None))


def emit(text: str) -> None:
    """Print a rendered result; CSV already ends in a newline, and a blank last line would be read as a row."""
    print(text, end="" if text.endswith("\n") else "\n")


def _add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", "-f", choices=("table", "csv", "json"), default="table",
                   help="output format (default: table)")


def cmd_query(args: argparse.Namespace) -> int:
    """Run SQL over the lake tables and print the result."""
    from factory.lake import Lake, QueryError, format_table, query

    with Lake.open(home_from(args)) as lake:
        try:
            result = query(args.sql, lake)
        except QueryError as e:
            error(str(e))
            return EXIT_BAD_INPUT
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    """List runs, newest first, with their final accuracy (a run whose process died shows `interrupted`)."""
    from factory.lake import Lake, format_table, query
    from factory.ops.recovery import reconcile

    paths = home_from(args)
    with Lake.open(paths) as lake:
        reconcile(lake, paths.checkpoints)
        result = query(RUNS_SQL, lake)
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    """Rank runs by a metric at their final evaluated step."""
    from factory.lake import Lake, format_table
    from factory.lake.history import HistoryError, best_runs

    with Lake.open(home_from(args)) as lake:
        try:
            result = best_runs(lake, args.metric, benchmark=args.benchmark, sweep_id=args.sweep,
                               top=args.top, lowest=args.lowest)
        except HistoryError as e:
            error(str(e))
            return EXIT_BAD_INPUT
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    """Two runs side by side: spec differences, final evals, step aggregates."""
    from factory.lake import Lake
    from factory.lake.history import HistoryError, compare_runs, format_comparison

    with Lake.open(home_from(args)) as lake:
        try:
            comparison = compare_runs(lake, args.run_a, args.run_b)
        except HistoryError as e:
            error(str(e))
            return EXIT_BAD_INPUT
    emit(format_comparison(comparison, args.format))
    return EXIT_OK


def _load(args: argparse.Namespace):
    from factory.config import SpecError, apply_overrides, load_spec, parse_overrides

    try:
        return apply_overrides(load_spec(args.spec), parse_overrides(args.overrides)), None
    except SpecError as e:
        return None, e if e.source else SpecError(e.errors, args.spec)


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a spec; print the resolved spec (YAML) or one `path: problem` line per error."""
    spec, err = _load(args)
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
    """Train a spec end to end (dataset, SFT, GRPO, report): the same functions the Dagster assets call.

    The GRPO run's attempts run in child processes, restarted (resuming) when one dies or hangs; with
    --in-process it trains in this process and is not restarted."""
    if args.resume:
        if args.spec is not None:
            error("give a spec or --resume RUN_ID, not both (a run resumes with its own spec)")
            return EXIT_BAD_INPUT
        return _resume(home_from(args), args.resume)
    if args.spec is None:
        error("a spec is required (or --resume RUN_ID)")
        return EXIT_BAD_INPUT
    spec, err = _load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    if spec.trainer.world_size > 1:
        return _run_ranks(spec, args)
    return _run_spec(spec, args)


def _run_spec(spec, args: argparse.Namespace) -> int:
    from factory.core.loop import NonFiniteLoss, RunInterrupted
    from factory.experiment import RunFailed, run_experiment
    from factory.ops.preflight.gate import PreflightFailed, gate
    from factory.ops.restarts import EXIT_NEEDS_FIX, EXIT_STOPPED
    from factory.ops.supervisor import CircuitOpen

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
    from factory.experiment import eval_summary, render_report
    from factory.lake import Lake
    from factory.ops import recovery
    from factory.ops.preflight.gate import PreflightFailed, gate
    from factory.ops.restarts import spec_of_run, supervise

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
            gate(spec_of_run(row).ops, paths, lake, log=print)
        except PreflightFailed as e:  # the attempt that would have resumed it was refused: say so in its record
            recovery.record_interruption(lake, run_id, int(row.get("attempts") or 1) + 1, "failed_preflight",
                                         str(e), recovery.last_step(lake, run_id))
            error(str(e))
            return EXIT_FAILED
    rc = supervise(paths, run_id, spec_of_run(row))
    if rc != EXIT_OK:
        return rc
    with Lake.open(paths) as lake:
        print(render_report(eval_summary(lake, run_id)))
    return EXIT_OK


RANK_TIMEOUT_S = 6 * 3600.0  # followers wait in a collective while rank 0 builds the dataset and trains SFT


def _run_ranks(spec, args: argparse.Namespace, body=None) -> int:
    """trainer.world_size > 1: started by the user, re-run this command as that many torchrun ranks on this node
    (rank 0's output shown); as a rank, rank 0 runs the command (`body`, default `_run_spec`) and leads, the
    others apply its trainer steps."""
    import os
    import subprocess

    if "RANK" not in os.environ:
        if not args.in_process:
            error(f"trainer.world_size = {spec.trainer.world_size}: data-parallel runs need --in-process for now "
                  f"(automatic restarts of a group of ranks are not built)")
            return EXIT_BAD_INPUT
        from factory.core.trainer.launch import torchrun_command

        cmd = torchrun_command(spec.trainer.world_size, "factory.cli", args.argv, log_dir=None)
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.trainer.threads or 1)}
        return subprocess.run(cmd, env=env).returncode
    import torch.distributed as dist

    from factory.core.trainer.distributed import init_ranks
    from factory.core.trainer.ranks import follow, leading

    rank, world = init_ranks(threads=spec.trainer.threads, timeout_s=max(RANK_TIMEOUT_S,
                                                                           2 * spec.schedule.wait_timeout_s + 60))
    try:
        if world != spec.trainer.world_size:
            error(f"trainer.world_size is {spec.trainer.world_size} but {world} ranks were started")
            return EXIT_BAD_INPUT
        if rank != 0:
            from factory.models.build import policy_for

            follow(spec, policy_for(spec)[0])  # the architecture; the weights come from rank 0
            return EXIT_OK
        print(f"trainer: rank 0 of {world} ({spec.trainer.strategy} on {dist.get_backend()}); ranks 1-{world - 1} "
              f"apply its steps to their share of each batch", flush=True)
        with leading():
            return (body or _run_spec)(spec, args)
    finally:
        dist.destroy_process_group()


def cmd_train_grpo(args: argparse.Namespace) -> int:
    """The `grpo_run` asset's GRPO run in this process, its inputs and result passed through Dagster Pipes (what the
    trainer pods run on Kubernetes); outside Pipes, --init and --dataset give the inputs."""
    spec, err = _load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    args.in_process = True  # the ranks re-run this command; the launcher (Dagster) does the retrying
    return _run_ranks(spec, args, _train_grpo) if spec.trainer.world_size > 1 else _train_grpo(spec, args)


def _train_grpo(spec, args: argparse.Namespace) -> int:
    from factory.grpo_pipes import GrpoInputs, run_under_pipes

    fallback = GrpoInputs(args.init, args.dataset, args.run_id) if args.init and args.dataset else None
    return run_under_pipes(spec, home_from(args), fallback)


def cmd_attempt(args: argparse.Namespace) -> int:
    """One attempt of a run in this process (what `factory run` and `factory resume` start as children)."""
    from factory.ops.restarts import attempt_main, standby

    return (standby if args.standby else attempt_main)(home_from(args), args.run_id)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint (or a freshly built preset model) over the OpenAI API until interrupted."""
    import torch

    from factory.core.rollout.continuous import ContinuousEngine
    from factory.core.rollout.server import engine_from_checkpoint, serve

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.checkpoint:
            engine = engine_from_checkpoint(args.checkpoint, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                            version=args.weight_version)
        else:
            from factory.models.build import build_model
            from factory.models.tokenizer import build_tokenizer

            tok = build_tokenizer()
            engine = ContinuousEngine(build_model(args.preset, tok, seed=args.seed), tok, args.weight_version,
                                      max_batch=args.max_batch, max_seq_len=args.max_seq_len, name=args.preset)
    except (FileNotFoundError, ValueError, OSError) as e:
        error(str(e))
        return EXIT_BAD_INPUT
    print(f"factory: serving {engine.name} (weight version {engine.weight_version}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    serve(engine, host=args.host, port=args.port, model_path=args.checkpoint, max_body_bytes=args.max_body_mb,
          max_update_bytes=args.max_update_mb)
    return EXIT_OK


def cmd_env_serve(args: argparse.Namespace) -> int:
    """Serve environment workers (episode scoring) over HTTP until interrupted."""
    from factory.envs.service import serve

    if args.latency_unit < 0:
        error(f"--latency-unit: must be >= 0, got {args.latency_unit}")
        return EXIT_BAD_INPUT
    print(f"factory: environment workers on http://{args.host}:{args.port}", file=sys.stderr)
    serve(host=args.host, port=args.port, latency_unit_s=args.latency_unit, max_body_bytes=args.max_body_mb)
    return EXIT_OK


def cmd_sandbox_serve(args: argparse.Namespace) -> int:
    """Serve a sandbox pool (generated code execution) over HTTP until interrupted."""
    from factory.envs.sandbox import IsolationUnavailable
    from factory.envs.sandbox_service import serve

    if args.size < 1:
        error(f"--size: must be >= 1, got {args.size}")
        return EXIT_BAD_INPUT
    print(f"factory: sandbox pool ({args.size} workers, isolation {args.isolation}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    try:
        serve(host=args.host, port=args.port, size=args.size, isolation=args.isolation,
              max_body_bytes=args.max_body_mb)
    except IsolationUnavailable as e:
        error(str(e))
        return EXIT_FAILED
    return EXIT_OK


def _add_max_body(p: argparse.ArgumentParser, flag: str = "--max-body-mb", default: float = 8.0,
                  what: str = "a JSON request body") -> None:
    def megabytes(text: str) -> int:
        try:
            mb = float(text)
        except ValueError:
            mb = float("nan")
        if not 0 < mb < float("inf"):
            raise argparse.ArgumentTypeError(f"want a number of MiB > 0, got {text!r}")
        return max(1, int(mb * (1 << 20)))

    p.add_argument(flag, type=megabytes, default=int(default * (1 << 20)), metavar="MIB",
                   help=f"{what} over this many MiB gets a 413 (default: {default:g})")


def _add_spec(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("spec", nargs="?" if optional else None, help="path to an experiment spec (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a spec field, e.g. --set algorithm.lr=1e-4 (repeatable; values are YAML)")


def cmd_preflight(args: argparse.Namespace) -> int:
    """Run this node's preflight checks, print them, record them in `node_health`; exit 1 naming each failed check.
    With --mark-node, then label/taint/annotate the Kubernetes node $NODE_NAME with the outcome
    (factory/ops/preflight/mark.py)."""
    import json
    import os

    from factory.ops.preflight import format_checks, run_preflight

    node = os.environ.get("NODE_NAME", "").strip()
    if args.mark_node and not node:  # checked first: no point measuring a node that cannot then be marked
        error("--mark-node: $NODE_NAME is not set (the preflight Job sets it from spec.nodeName)")
        return EXIT_BAD_INPUT
    log = (lambda m: print(m, file=sys.stderr)) if args.verbose else (lambda _: None)
    try:
        report = run_preflight(home_from(args), mode="deep" if args.deep else "quick", only=args.checks or None,
                               kind=args.kind, record=not args.no_record, log=log)
    except ValueError as e:
        error(str(e))
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"preflight {report.preflight_id} on {report.node} ({report.kind}, {report.mode}) at "
              f"{report.started_at:%Y-%m-%d %H:%M:%S} UTC, {report.seconds:.1f} s: "
              f"{'passed' if report.passed else 'FAILED'}")
        print(format_checks(report.results))
    if report.record_error:
        error(f"preflight results not recorded in the lake: {report.record_error}")
    for r in report.failed:
        error(f"preflight check failed: {r.line()}")
    if args.mark_node:
        from factory.ops.preflight.mark import LABEL, MarkError, mark_node

        try:
            marked = mark_node(node, report, partial=bool(args.checks), kubeconfig=args.kubeconfig)
        except MarkError as e:
            error(str(e))
            return EXIT_FAILED
        print(f"node {node} marked {LABEL}={marked['metadata']['labels'][LABEL]}", file=sys.stderr)
    return EXIT_OK if report.passed else EXIT_FAILED


def cmd_deploy_render(args: argparse.Namespace) -> int:
    """Write every Kubernetes manifest Factory would create for a spec into --out (nothing is applied)."""
    from factory.deploy.render import render

    spec, err = _load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    return _write_rendered(args, lambda profile: render(spec, profile))


def _write_rendered(args: argparse.Namespace, build) -> int:
    """`build(profile)`'s manifests written to --out, the profile from --profile; bad input named, exit 2."""
    from factory.deploy.profile import ProfileError, load_profile
    from factory.deploy.render import RenderError, write_manifests

    try:
        written = write_manifests(build(load_profile(args.profile)), args.out, force=args.force)
    except ProfileError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    except RenderError as e:
        error(str(e))
        return EXIT_BAD_INPUT
    print(f"{len(written)} manifests written to {args.out}")
    return EXIT_OK


def cmd_deploy_preflight(args: argparse.Namespace) -> int:
    """Write the RBAC and one preflight Job per node into --out (deploy/preflight.py; nothing is applied)."""
    from factory.deploy.preflight import parse_nodes, render_preflight

    spec = None
    if args.spec:
        spec, err = _load(args)
        if err is not None:
            print(str(err), file=sys.stderr)
            return EXIT_BAD_INPUT
    return _write_rendered(args, lambda profile: render_preflight(parse_nodes(args.nodes), profile, spec,
                                                                  deep=args.deep, gpus=args.gpus_per_node))


def cmd_bpe_model(args: argparse.Namespace) -> int:
    from factory.models.bpe import build_bpe_model_dir

    out = Path(args.dir)
    if out.exists() and any(out.iterdir()) and not args.force:
        error(f"{out}: exists and is not empty (--force writes over it)")
        return EXIT_BAD_INPUT
    try:
        path = build_bpe_model_dir(out, seed=args.seed, vocab_size=args.vocab_size, preset=args.preset,
                                   max_positions=args.max_positions)
    except (KeyError, ValueError) as e:
        error(f"bpe-model: {e}")
        return EXIT_BAD_INPUT
    print(f"wrote a Qwen2 model ({args.preset}, random init, seed {args.seed}) with a byte-level BPE tokenizer of "
          f"{args.vocab_size} tokens and a ChatML template to {path}; use it with --set model.path={path}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="factory", description="RL post-training experiment factory")
    parser.add_argument("--home", help="state directory (default: $FACTORY_HOME, else ./.factory)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check a spec; exit 2 naming each bad field")
    _add_spec(p)
    p.add_argument("--show", action="store_true", help="print the resolved spec with defaults")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help="train a spec end to end (the same code the Dagster assets call)")
    _add_spec(p, optional=True)
    p.add_argument("--control", action="store_true",
                   help="also spend the GRPO run's wall time on more SFT, for comparison")
    p.add_argument("--resume", metavar="RUN_ID", help="continue this run from its newest resume point instead")
    p.add_argument("--in-process", action="store_true",
                   help="train in this process, without automatic restarts (default: attempts run in child "
                        "processes, restarted and resumed when one dies or hangs, up to ops.max_restarts)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("train-grpo", help="(the grpo_run asset's trainer pods) the GRPO run, inputs and result "
                       "through Dagster Pipes")
    _add_spec(p)
    p.add_argument("--init", help="SFT checkpoint to start from (outside Pipes; under Pipes the extras give it)")
    p.add_argument("--dataset", help="dataset directory (outside Pipes)")
    p.add_argument("--run-id", help="continue this factory run (outside Pipes)")
    p.set_defaults(func=cmd_train_grpo)

    p = sub.add_parser("resume", help="continue a run that did not finish, from its newest resume point")
    p.add_argument("run_id", metavar="RUN_ID", help="run id (see `factory runs`)")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("attempt", help="(internal) one attempt of a run in this process; run/resume start these")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--standby", action="store_true", help="warm up, then wait for 'go ATTEMPT' on stdin")
    p.set_defaults(func=cmd_attempt)

    p = sub.add_parser("query", help="run SQL (DuckDB) over the lake tables",
                       description="Tables: runs, steps, checkpoints, evals, rollouts, node_health, sweeps.")
    p.add_argument("sql", help="e.g. \"SELECT step, loss FROM steps WHERE run_id = '...' ORDER BY step\"")
    _add_format(p)
    p.set_defaults(func=cmd_query)

    p = sub.add_parser("runs", help="list runs with status and final accuracy")
    _add_format(p)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("best", help="rank runs by an eval metric at their final evaluated step",
                       description="Ranks runs by METRIC (table `evals`) at each run's greatest step that "
                                   "recorded it on the benchmark, best first.")
    p.add_argument("--metric", required=True, help="eval metric, e.g. accuracy or pass@8")
    p.add_argument("--benchmark", help="benchmark (default: the one whole benchmark, i.e. without '/', "
                                       "that has the metric; required when there are several)")
    p.add_argument("--sweep", metavar="SWEEP_ID", help="only runs of this sweep")
    p.add_argument("--top", type=int, default=10, metavar="N", help="how many runs (default: 10)")
    p.add_argument("--lowest", action="store_true", help="lowest value first (for losses, error rates)")
    _add_format(p)
    p.set_defaults(func=cmd_best)

    p = sub.add_parser("compare", help="compare two runs: spec differences, final evals, step aggregates")
    p.add_argument("run_a", metavar="RUN_A", help="run id (see `factory runs`)")
    p.add_argument("run_b", metavar="RUN_B", help="run id")
    # No csv: its three sections have different columns; json is one object for scripts.
    p.add_argument("--format", "-f", choices=("table", "json"), default="table",
                   help="output format (default: table)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("serve", help="serve a policy over the OpenAI API (rollout server mode)",
                       description="OpenAI-compatible rollout server with SGLang-style control endpoints.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="HF-format checkpoint directory to serve")
    src.add_argument("--preset", help="serve a freshly initialised model of this preset (for trying the API)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--max-batch", type=int, default=64, help="sequences decoded together (default: 64)")
    p.add_argument("--max-seq-len", type=int, help="prompt + completion limit (default: the model's context)")
    p.add_argument("--weight-version", type=int, default=0, help="version tag of the served weights (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; on cores shared with "
                                               "other jobs 1 can be much faster)")
    _add_max_body(p)
    _add_max_body(p, "--max-update-mb", 16384, "a weight update (POST /update_weights_from_delta)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("env-serve", help="serve environment workers (episode scoring) over HTTP",
                       description="Environment workers: POST /score runs episodes side by side and returns rewards.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    p.add_argument("--latency-unit", type=float, default=0.0,
                   help="simulated heavy-tailed episode latency unit in seconds (envs/latency.py); 0: none")
    _add_max_body(p)
    p.set_defaults(func=cmd_env_serve)

    p = sub.add_parser("sandbox-serve", help="serve a sandbox pool (runs generated code) over HTTP",
                       description="Sandbox pool: POST /run executes code in a warm, isolated worker and "
                                   "returns its result (factory/envs/sandbox_service.py).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8200, help="port (default: 8200)")
    p.add_argument("--size", type=int, default=4, help="warm workers (default: 4)")
    p.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap",
                   help="bwrap: namespaces via bubblewrap (default); none: NOT isolated, for trusted code only")
    _add_max_body(p)
    p.set_defaults(func=cmd_sandbox_serve)

    p = sub.add_parser("bpe-model", help="write a small HF model directory (Qwen2, byte-level BPE tokenizer, ChatML "
                       "template) built offline, to try model.path without a download")
    p.add_argument("dir", help="the directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="the model's size")
    p.add_argument("--max-positions", type=int, default=128)
    p.add_argument("--force", action="store_true", help="write over a directory that is not empty")
    p.set_defaults(func=cmd_bpe_model)

    p = sub.add_parser("preflight", help="test this node (hardware, software, disks, lake, sandbox); exit 1 naming "
                       "failed checks", description="Preflight node tests (factory/ops/preflight/): each check's "
                       "value against its floor, recorded in the lake table node_health; training refuses a node "
                       "whose latest preflight failed.")
    p.add_argument("--deep", action="store_true", help="measure longer; add all-reduce, the rollout server and the "
                   "whole sandbox red-team suite (about 1-3 min instead of about 15 s)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object instead of the table")
    p.add_argument("--check", dest="checks", action="append", default=[], metavar="NAME",
                   help="run only this check (repeatable), e.g. after fixing what it found")
    p.add_argument("--kind", help="node kind whose floors apply (default: $FACTORY_NODE_KIND, else detected)")
    p.add_argument("--no-record", action="store_true", help="do not write the results to the lake")
    p.add_argument("--verbose", "-v", action="store_true", help="log each check on stderr as it finishes")
    p.add_argument("--mark-node", action="store_true", help="then mark the Kubernetes node $NODE_NAME: label "
                   "factory.dev/preflight=passed|failed, taint factory.dev/preflight-failed on failure (removed on "
                   "a pass); what the `factory deploy preflight` Jobs run")
    p.add_argument("--kubeconfig", help="with --mark-node: kubeconfig file (default: $KUBECONFIG, else the pod's "
                   "service account)")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("deploy", help="Kubernetes: render the manifests a spec needs (factory/deploy/)")
    deploy = p.add_subparsers(dest="deploy_command", required=True)
    p = deploy.add_parser("render", help="write every manifest Factory would create for a spec to --out, for "
                          "review and GitOps (nothing is applied to a cluster)")
    _add_spec(p)
    p.add_argument("--out", required=True, help="directory to write (refused when not empty, unless --force)")
    p.add_argument("--profile", help="deploy profile YAML (image, namespace, node pools; default: built-in)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.set_defaults(func=cmd_deploy_render)
    p = deploy.add_parser("preflight", help="write RBAC and one Job per node that preflights it and marks it "
                          "(a failed node is tainted so training avoids it); nothing is applied")
    p.add_argument("--nodes", required=True, help="comma-separated node names, e.g. gpu-node-1,gpu-node-2")
    p.add_argument("--out", required=True, help="directory to write (refused when not empty, unless --force)")
    p.add_argument("--profile", help="deploy profile YAML (image, namespace, train pool; default: built-in)")
    p.add_argument("--spec", help="experiment spec: its ConfigMap is mounted and its GPUs per training pod requested "
                   "(default: the profile's gpus_per_train_pod)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a --spec field (repeatable)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs each Job requests (default: a training pod's); a node's "
                   "whole count tests every GPU")
    p.add_argument("--deep", action="store_true", help="the Jobs run the deep preflight")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.set_defaults(func=cmd_deploy_preflight)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start the same command as torchrun ranks
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
