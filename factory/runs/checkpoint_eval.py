"""Evaluating recorded checkpoints on named benchmarks, and the regression rule between checkpoints of a run.

A checkpoint is named by its run and step (`checkpoint_key`), as recorded in the `checkpoints` table, and its eval
on a benchmark by `eval_key` (the `checkpoint_eval` asset's partition);
the run's spec (from `runs`) says how to prompt it and which held-out split is its own. Results land
in `evals` keyed (run_id, step, benchmark, metric), so evaluating the same checkpoint again
replaces its rows instead of adding to them. A training run already scores its final checkpoint on its
held-out split with the same settings; rows recorded against the same checkpoint digest are reused
instead of evaluated again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pyiceberg.expressions import And, EqualTo

from factory.config import parse_spec
from factory.digest import dir_digest
from factory.envs.eval_suites import BENCHMARKS, HELD_OUT, benchmark_problems
from factory.home import FactoryPaths
from factory.models.checkpoint_store import fetch_checkpoint
from factory.objstore import is_remote

if TYPE_CHECKING:
    from factory.cockpit.tracking import Tracker
    from factory.lake.writer import Lake

_SEP = "@"


def checkpoint_key(run_id: str, step: int) -> str:
    """Partition key of a checkpoint: `<run_id>@<step>`."""
    return f"{run_id}{_SEP}{step}"


def parse_checkpoint_key(key: str) -> tuple[str, int]:
    run_id, sep, step = key.rpartition(_SEP)
    if not sep or not run_id or not step.isdigit():
        raise ValueError(f"not a checkpoint key: {key!r} (expected <run_id>@<step>)")
    return run_id, int(step)


_BENCH_SEP = "|"


def eval_key(checkpoint: str, benchmark: str) -> str:
    """Partition key of one checkpoint's eval on one benchmark: `<benchmark>|<run_id>@<step>` (the string form of the
    checkpoint x benchmark multi-partition key it replaced, so what was materialized under that one still counts)."""
    return f"{benchmark}{_BENCH_SEP}{checkpoint}"


def parse_eval_key(key: str) -> tuple[str, str]:
    """(checkpoint key, benchmark) of an `eval_key`; ValueError naming the key for anything else."""
    benchmark, sep, checkpoint = key.partition(_BENCH_SEP)
    if not sep or benchmark not in BENCHMARKS:
        raise ValueError(f"not an eval key: {key!r} (expected <benchmark>|<run_id>@<step>, benchmark one of "
                         f"{', '.join(BENCHMARKS)})")
    parse_checkpoint_key(checkpoint)
    return checkpoint, benchmark


def recorded_name(benchmark: str) -> str:
    """The `evals.benchmark` value of a benchmark (the held-out split keeps the name runs record it by)."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)}")
    return HELD_OUT if benchmark == "heldout" else benchmark


@dataclass(frozen=True)
class CheckpointEval:
    run_id: str
    step: int
    benchmark: str  # as recorded in `evals`
    accuracy: float
    pass_at_k: float | None
    n: int
    sha256: str
    reused: bool = False  # read back from rows the training run recorded for this checkpoint
    k: int | None = None  # the k of pass_at_k


def evaluate_recorded_checkpoint(paths: FactoryPaths, lake: Lake, run_id: str, step: int,
                                 benchmark: str) -> CheckpointEval:
    """Evaluate the checkpoint `run_id`@`step` on `benchmark`, after checking its files against the digest
    recorded with it; write the results to `evals` and return them."""
    from factory.runs.stages import (  # noqa: PLC0415 heavy: torch; sensors import this module for its keys
        build_dataset,
        eval_rows,
        evaluate_checkpoint,
        load_dataset,
    )

    name = recorded_name(benchmark)
    rows = lake.read("checkpoints", And(EqualTo("run_id", run_id), EqualTo("step", step))).to_pylist()
    if not rows:
        raise LookupError(f"no checkpoint {checkpoint_key(run_id, step)} in the `checkpoints` table")
    ckpt = rows[0]
    local = _path(ckpt["uri"], paths)
    digest, _ = dir_digest(local)
    if digest != ckpt["sha256"]:
        raise ValueError(f"checkpoint {checkpoint_key(run_id, step)} at {ckpt['uri']}: files do not match the "
                         f"recorded sha256 {ckpt['sha256'][:12]}... (got {digest[:12]}...); not evaluating it")
    recorded = _recorded(lake, run_id, step, name, ckpt["sha256"])
    if recorded is not None:
        return recorded
    runs = lake.read("runs", EqualTo("run_id", run_id)).to_pylist()
    if not runs:
        raise LookupError(f"no run {run_id!r} in the `runs` table (the checkpoint's spec is unknown)")
    spec = parse_spec(json.loads(runs[0]["spec"]), f"runs.spec of {run_id}")
    if benchmark == "humaneval":  # depends on the spec's sources, not the task's splits
        # the sources package loads duckdb, pandas, sqlalchemy (seconds); the code location imports this module
        from factory.data.from_spec import humaneval_benchmark  # noqa: PLC0415 heavy: duckdb; humaneval only

        problems = humaneval_benchmark(spec.data)
    else:
        problems = benchmark_problems(benchmark, spec.task, load_dataset(build_dataset(spec, paths).path))
    result = evaluate_checkpoint(spec, local, problems)
    out = eval_rows(run_id, step, result, ckpt["sha256"])
    for r in out:  # eval_rows names the held-out split; re-label for other benchmarks
        r["benchmark"] = r["benchmark"].replace(HELD_OUT, name, 1)
    lake.upsert("evals", out)
    return CheckpointEval(run_id, step, name, result.accuracy, result.pass_at_k, result.n, ckpt["sha256"],
                          k=result.k or None)


@dataclass(frozen=True)
class DrawnEval:
    """A checkpoint's eval and what the `checkpoint_eval` asset shows with it: the run's evals-by-step picture of
    this benchmark (PNG; None when nothing can be drawn) and the MLflow URL of the all-benchmarks picture."""
    result: CheckpointEval
    picture: bytes | None
    evals_url: str | None
    regression: RegressionCheck | None = None  # when a tolerance was given


def evaluate_and_draw(paths: FactoryPaths, lake: Lake, tracker: Tracker | None, run_id: str, step: int,
                      benchmark: str, tolerance: float | None = None) -> DrawnEval:
    """`evaluate_recorded_checkpoint`, then the run's evals-by-step picture redrawn (and stored on its MLflow run)
    and, with a `tolerance`, the regression check: the asset's work on the lake, MLflow and the model, in one place
    for the eval server and the asset's in-process fallback."""
    from factory.cockpit.reports import (  # noqa: PLC0415 heavy: mlflow, matplotlib; sensors need neither
        EVALS,
        refresh_evals_picture,
        small,
    )

    res = evaluate_recorded_checkpoint(paths, lake, run_id, step, benchmark)
    picture = refresh_evals_picture(lake, tracker, run_id, res.benchmark)
    runs = lake.read("runs", EqualTo("run_id", run_id)).select(["mlflow_run_id"]).to_pylist()
    mlflow_run_id = runs[0]["mlflow_run_id"] if runs else None
    if tracker is not None and mlflow_run_id and not res.reused:  # a reused result is on the run's curves already
        tracker.log_metrics(mlflow_run_id, step, mlflow_metrics(res))
    url = tracker.artifact_url(mlflow_run_id, small(EVALS)) if tracker is not None and mlflow_run_id else None
    reg = None if tolerance is None else regression_check(lake, run_id, step, res.benchmark, res.accuracy, tolerance)
    return DrawnEval(res, picture, url, reg)


def mlflow_metrics(res: CheckpointEval) -> dict[str, float | None]:
    """A checkpoint's eval as points of its run's MLflow curves at its step, named as the run names its own: the
    held-out split `eval/accuracy` and `eval/pass_at_<k>`, another benchmark `eval/<benchmark>` and
    `eval/<benchmark>/pass_at_<k>` (as a blend source's `eval/source/<name>`)."""
    base = "eval" if res.benchmark == HELD_OUT else f"eval/{res.benchmark}"
    out: dict[str, float | None] = {"eval/accuracy" if res.benchmark == HELD_OUT else base: res.accuracy}
    if res.pass_at_k is not None and res.k:
        out[f"{base}/pass_at_{res.k}"] = res.pass_at_k
    return out


def _recorded(lake: Lake, run_id: str, step: int, name: str, sha256: str) -> CheckpointEval | None:
    """The result the training run recorded for this checkpoint (same digest) on `name`, if any."""
    rows = [r for r in lake.read("evals", And(EqualTo("run_id", run_id), EqualTo("step", step))).to_pylist()
            if r["benchmark"] == name and r["checkpoint_sha256"] == sha256]
    acc = next((r for r in rows if r["metric"] == "accuracy"), None)
    if acc is None:
        return None
    passes = [r for r in rows if r["metric"].startswith("pass@")]
    return CheckpointEval(run_id, step, name, acc["value"], passes[0]["value"] if passes else None, acc["n"], sha256,
                          reused=True, k=int(passes[0]["metric"].removeprefix("pass@")) if passes else None)


def _path(uri: str, paths: FactoryPaths) -> Path:
    """The local directory of a recorded checkpoint: its path, or for an object-store URI (FACTORY_CHECKPOINT_URI)
    the verified local cache copy (models/checkpoint_store.py)."""
    if is_remote(uri):
        return fetch_checkpoint(uri, paths.checkpoint_cache)
    return Path(uri.removeprefix("file://"))


@dataclass(frozen=True)
class RegressionCheck:
    passed: bool
    drop: float | None  # previous accuracy - this accuracy (positive: worse)
    previous_step: int | None
    previous_accuracy: float | None


def regression_check(lake: Lake, run_id: str, step: int, benchmark: str, accuracy: float,
                     tolerance: float) -> RegressionCheck:
    """Compare with the run's previous evaluated checkpoint on the same benchmark: fails when accuracy dropped
    by more than `tolerance` (absolute). The run's first checkpoint passes (nothing to compare with)."""
    ckpt_steps = {r["step"] for r in lake.read("checkpoints", EqualTo("run_id", run_id)).to_pylist()}
    evals = lake.read("evals", And(EqualTo("run_id", run_id), EqualTo("metric", "accuracy"))).to_pylist()
    earlier = sorted((r["step"], r["value"]) for r in evals
                     if r["benchmark"] == benchmark and r["step"] < step and r["step"] in ckpt_steps)
    if not earlier:
        return RegressionCheck(True, None, None, None)
    prev_step, prev_acc = earlier[-1]
    drop = prev_acc - accuracy
    return RegressionCheck(drop <= tolerance, drop, prev_step, prev_acc)
