"""A run's own evals: the start's held-out accuracy and pass@k (step 0, measured once per run) and the per-source
held-out evals of a blend (HumanEval sources with pass@k too), written to `evals` and MLflow."""

from __future__ import annotations

from pyiceberg.expressions import And, EqualTo

from factory.cockpit.tracking import Tracker
from factory.config import ExperimentSpec
from factory.core.evaluate import evaluate, sampled_pass_at_k
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.envs.eval_suites import HELD_OUT, SOURCE_BENCHMARK
from factory.lake.writer import Lake
from factory.problem import Splits
from factory.runs.recovery import now as _now
from factory.runs.stages import Log, eval_rows
from factory.runs.step_metrics import StepMetrics


def start_eval(spec: ExperimentSpec, lake: Lake, tracker: Tracker, run_id: str, mlflow_id: str, model, tok,
               splits: Splits, log: Log) -> tuple[float, float | None]:
    """Held-out accuracy and pass@k of the start (step 0), measured once per run (a resumed attempt reads it)."""
    rows = lake.read("evals", And(And(EqualTo("run_id", run_id), EqualTo("step", 0)),
                                  EqualTo("benchmark", HELD_OUT))).to_pylist()
    got = {r["metric"]: r["value"] for r in rows}
    k = f"pass@{spec.schedule.eval_pass_k}"
    if "accuracy" in got:
        return got["accuracy"], got.get(k)
    res = evaluate(EmbeddedEngine(model, tok), tok, splits.eval, spec.rollout.max_new_tokens,
                   k=spec.schedule.eval_pass_k, temperature=1.0, seed=spec.seed)
    lake.upsert("evals", eval_rows(run_id, 0, res, None))
    tracker.log_metrics(mlflow_id, 0, {"eval/accuracy": res.accuracy, f"eval/pass_at_{res.k}": res.pass_at_k})
    log(f"run {run_id}: start {HELD_OUT} accuracy {res.accuracy:.3f}, pass@{res.k} {res.pass_at_k:.3f}")
    return res.accuracy, res.pass_at_k




def source_evals(spec: ExperimentSpec, held: dict, model, tok, lake: Lake, tracker: Tracker, run_id: str,
                 mlflow_id: str, step: int, sha256: str | None,
                 deferred: StepMetrics | None = None) -> dict[str, float]:
    """Greedy held-out accuracy per blend source (`data.held_out` problems of each generated source), returned by
    source name; for a HumanEval source also the unbiased pass@1 and pass@k from k = schedule.eval_pass_k samples a
    problem."""
    rows, metrics, accuracy = [], {}, {}
    for name, problems in held.items():
        res = evaluate(EmbeddedEngine(model, tok), tok, problems, spec.rollout.max_new_tokens)
        rows.append(dict(run_id=run_id, step=step, benchmark=SOURCE_BENCHMARK + name, metric="accuracy",
                         value=res.accuracy, n=res.n, checkpoint_sha256=sha256, recorded_at=_now()))
        metrics[f"eval/source/{name}"] = accuracy[name] = res.accuracy
        if all(p.op == "humaneval" for p in problems):
            k = spec.schedule.eval_pass_k
            passes = sampled_pass_at_k(EmbeddedEngine(model, tok), tok, problems, spec.rollout.max_new_tokens, n=k,
                                       ks=sorted({1, k}), seed=spec.seed)
            for kk, value in passes.items():
                rows.append(dict(run_id=run_id, step=step, benchmark=SOURCE_BENCHMARK + name, metric=f"pass@{kk}",
                                 value=value, n=res.n, checkpoint_sha256=sha256, recorded_at=_now()))
                metrics[f"eval/source/{name}/pass_at_{kk}"] = value
    if rows:
        lake.upsert("evals", rows)
        if deferred is not None:
            deferred.add(step, metrics)
        else:
            tracker.log_metrics(mlflow_id, step, metrics)
    return accuracy
