"""The GRPO run stage: one training run from a warm start, recorded in Iceberg and MLflow, and resumable.

A run is one run_id, one MLflow run, and one or more attempts. Calling `run_grpo` with the run_id of a
run that did not finish continues it: from its newest complete resume point (`core/resume.py`), into the
same MLflow run, as attempt N+1. The lake stays exact across attempts: rows the dead attempt wrote past
that resume point (steps, rollouts, evals, checkpoints) are deleted before the new attempt writes them
again, so `steps` holds one row per step with no hole, each tagged with the attempt that trained it; the
interruption is recorded (`ops/recovery.py`) with what it cost. A run that already succeeded is not
trained again: its recorded result is returned.

While an attempt lives it holds the run's lock and beats its heartbeat (`ops/attempt.py`); SIGTERM or
SIGINT make it save a resume point after the current step and stop as `interrupted`.
"""

from __future__ import annotations

import copy
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from threading import Lock

from pyiceberg.expressions import And, EqualTo, GreaterThan

from factory.config import ExperimentSpec
from factory.core.evaluate import evaluate
from factory.core.loop import NonFiniteLoss, RunInterrupted, StepRecord, train_grpo
from factory.core.resume import latest
from factory.core.rollout.embedded import EmbeddedEngine
from factory.data.feed import make_feed
from factory.data.from_spec import blend_version, held_out_sets
from factory.digest import dir_digest
from factory.envs.eval_suites import HELD_OUT
from factory.experiment import Log, Report, code_version, eval_rows, set_threads
from factory.home import FactoryPaths
from factory.infra.supervisor import CircuitOpen
from factory.lake.writer import Lake
from factory.models.checkpoint import CheckpointInfo, load_checkpoint, recorded_uri, save_checkpoint
from factory.ops import recovery
from factory.ops.attempt import AttemptLock, RunCheckpoints, beat, resume_dir
from factory.problem import Splits
from factory.progress import Progress, format_duration
from factory.tracking import Tracker

_now = recovery.now


@dataclass
class RunResult:
    run_id: str
    mlflow_run_id: str
    checkpoint: CheckpointInfo
    steps: int
    start_accuracy: float
    start_pass_at_k: float | None
    final_accuracy: float
    seconds: float  # wall time of the run over all its attempts
    records: list[StepRecord] = field(repr=False, default_factory=list)  # this attempt's steps
    attempt: int = 1
    goodput: float = 1.0


def new_run_id(spec: ExperimentSpec) -> str:
    return f"{spec.name}-{_now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


class StepLog:
    """Step and rollout rows not yet in the lake. Flushed every few steps by the trainer's thread and,
    before each resume point is written, by the writer's thread (with its own Lake: a Lake is per thread),
    so every step a resume point covers is in `steps` by the time the resume point exists."""

    def __init__(self, run_id: str, attempt: int):
        self.run_id, self.attempt = run_id, attempt
        self._lock = Lock()
        self._steps: list[dict] = []
        self._rollouts: list[dict] = []
        self._groups: list[dict] = []
        self._sources: list[dict] = []

    def add(self, r: StepRecord) -> int:
        at = _now()
        with self._lock:
            self._steps.append(dict(run_id=self.run_id, recorded_at=at, attempt=self.attempt, **r.to_dict()))
            self._rollouts.extend(dict(run_id=self.run_id, step=r.step, recorded_at=at, **s) for s in r.samples)
            self._groups.extend(dict(run_id=self.run_id, step=r.step, recorded_at=at, **g) for g in r.groups)
            self._sources.extend(dict(run_id=self.run_id, step=r.step, recorded_at=at, **s) for s in r.sources)
            return len(self._steps)

    def flush(self, lake: Lake) -> None:
        with self._lock:
            steps, rollouts, groups, sources = self._steps, self._rollouts, self._groups, self._sources
            self._steps, self._rollouts, self._groups, self._sources = [], [], [], []
        # Per-step detail first, the step last: a crash in between leaves a step to re-record, never orphan rows.
        for table, rows in (("rollouts", rollouts), ("prompt_attempts", groups), ("step_sources", sources),
                            ("steps", steps)):
            if rows:
                lake.upsert(table, rows)


def _forget_after(lake: Lake, run_id: str, step: int) -> None:
    """Delete what a dead attempt recorded past `step` (its successor trains and records those again)."""
    this_run = EqualTo("run_id", run_id)
    for table in ("rollouts", "prompt_attempts", "step_sources", "steps", "checkpoints", "evals"):
        lake.delete(table, And(this_run, GreaterThan("step", step)))


def _finished(lake: Lake, row: dict) -> RunResult:
    """The recorded result of a run that already succeeded."""
    evals = {(r["step"], r["metric"]): r["value"] for r in
             lake.read("evals", And(EqualTo("run_id", row["run_id"]), EqualTo("benchmark", HELD_OUT))).to_pylist()}
    final = max(s for s, _ in evals)
    path = Path(row["final_checkpoint"])
    digest, size = dir_digest(path)
    k = next((m for s, m in evals if s == 0 and m.startswith("pass@")), None)
    return RunResult(row["run_id"], row["mlflow_run_id"], CheckpointInfo(path, digest, size), final,
                     evals.get((0, "accuracy"), 0.0), evals.get((0, k)) if k else None,
                     evals.get((final, "accuracy"), 0.0), row.get("wall_s") or 0.0,
                     attempt=int(row.get("attempts") or 1), goodput=row.get("goodput") or 1.0)


def run_grpo(spec: ExperimentSpec, paths: FactoryPaths, init_checkpoint: str | Path, splits: Splits,
             lake: Lake, tracker: Tracker, log: Log = print, run_id: str | None = None,
             sweep_id: str | None = None, flush_every: int = 10, mlflow_experiment: str | None = None,
             mlflow_parent_run_id: str | None = None, progress: Report | None = None) -> RunResult:
    """GRPO from `init_checkpoint`; records the run, every step, checkpoints and evals.

    With the `run_id` of a run that did not finish, continues it (see the module docstring). A sweep
    member passes its `sweep_id` and the sweep's MLflow parent run (nested under it, in the parent's
    experiment `mlflow_experiment`)."""
    set_threads(spec, log)
    run_id = run_id or new_run_id(spec)
    run_dir = paths.checkpoints / run_id
    with AttemptLock(run_dir):
        prev = recovery.run_row(lake, run_id)
        if prev is not None and prev["status"] == "succeeded":
            log(f"run {run_id} already succeeded; nothing to do")
            return _finished(lake, prev)
        if prev is not None and prev["spec_fingerprint"] != spec.fingerprint():
            raise ValueError(f"run {run_id} was started with spec {prev['spec_fingerprint']}, not this one "
                             f"({spec.fingerprint()}): resume it with its own spec (factory resume {run_id})")
        if prev is not None and prev["status"] in recovery.LIVE:  # we hold its lock: that attempt is dead
            recovery.mark_dead(lake, prev, run_dir)
            prev = recovery.run_row(lake, run_id)
        return _attempt(spec, paths, run_id, run_dir, prev, init_checkpoint, splits, lake, tracker, log, sweep_id,
                        flush_every, mlflow_experiment, mlflow_parent_run_id, progress)


def _attempt(spec: ExperimentSpec, paths: FactoryPaths, run_id: str, run_dir: Path, prev: dict | None,
             init_checkpoint: str | Path, splits: Splits, lake: Lake, tracker: Tracker, log: Log,
             sweep_id: str | None, flush_every: int, mlflow_experiment: str | None,
             mlflow_parent_run_id: str | None, progress: Report | None) -> RunResult:
    attempt = 1 if prev is None else int(prev.get("attempts") or 1) + 1
    if prev is None:
        started = _now()
        base_row = dict(run_id=run_id, sweep_id=sweep_id, name=spec.name, spec=spec.to_json(),
                        spec_fingerprint=spec.fingerprint(), code_version=code_version(), seed=spec.seed,
                        init_checkpoint=str(init_checkpoint), started_at=started, interruptions=0)
        tags = {"factory.run_id": run_id, "factory.init_checkpoint": str(init_checkpoint),
                "factory.code_version": base_row["code_version"]}
        if sweep_id:
            tags["factory.sweep_id"] = sweep_id
        if mlflow_parent_run_id:
            tags["mlflow.parentRunId"] = mlflow_parent_run_id  # MLflow's nesting convention
        base_row["mlflow_run_id"] = tracker.start_run(experiment=mlflow_experiment or spec.name, run_name=run_id,
                                                      params=json.loads(spec.to_json()), tags=tags)
    else:
        base_row = {k: v for k, v in prev.items() if k not in ("ended_at", "error")}
        tracker.client.update_run(prev["mlflow_run_id"], status="RUNNING")  # the same MLflow run continues
    mlflow_id = base_row["mlflow_run_id"]
    base_row.update(attempts=attempt, restarts=attempt - 1, host=recovery.host(), pid=os.getpid())
    started_at = base_row["started_at"]

    def wall() -> float:
        return (_now() - started_at).total_seconds()

    # Time lost to interruptions changes only when one is closed (below), not at every flush: read it then.
    lost = [recovery.lost_seconds(lake, run_id) if prev is not None else 0.0]

    def runs_row(status: str, **extra) -> None:
        w = wall()
        lake.upsert("runs", [dict(base_row, status=status, heartbeat_at=_now(), wall_s=w, lost_s=lost[0],
                                  goodput=recovery.goodput(w, lost[0]), **extra)])

    runs_row("running" if attempt == 1 else "resumed")
    beat(run_dir)
    model, tok = load_checkpoint(init_checkpoint)
    reference = None
    if spec.algorithm.kl_coef > 0:  # the KL reference is the run's start, whatever attempt this is
        reference = copy.deepcopy(model).eval()
    found = latest(resume_dir(run_dir), log=log) if prev is not None else None
    state = found[0] if found else None
    resumed_from = state.step if state else 0
    open_interruption = recovery.open_interruption(lake, run_id, attempt - 1) if prev is not None else None
    if prev is not None:
        _forget_after(lake, run_id, resumed_from)
        log(f"run {run_id}: attempt {attempt} resumes from "
            + (f"resume point {found[1].name} (step {resumed_from})" if found else "its start (no resume point)"))
    t0 = time.perf_counter()
    steplog = StepLog(run_id, attempt)
    writer_lake: list[Lake] = []

    def before_write(step: int) -> None:  # in the writer thread
        if not writer_lake:
            writer_lake.append(Lake.open(paths))
        steplog.flush(writer_lake[0])

    ckpts = RunCheckpoints(spec, run_dir, before_write=before_write)
    try:
        start = _start_eval(spec, lake, tracker, run_id, mlflow_id, model, tok, splits, log)
        held = held_out_sets(spec)
        if held and lake.read("evals", And(And(EqualTo("run_id", run_id), EqualTo("step", 0)),
                                            EqualTo("benchmark", SOURCE_BENCHMARK + next(iter(held))))).num_rows == 0:
            _source_evals(spec, held, model, tok, lake, tracker, run_id, mlflow_id, 0, None)
        feed = make_feed(spec, splits.train, stats=_offline_stats(spec, lake, tracker, mlflow_id, log))
        tracker.set_tags(mlflow_id, {"factory.blend_version": blend_version(spec, feed.blender.sources)})
        beat(run_dir)
        t_loop = time.perf_counter()
        first_step: list[float] = []

        def on_step(r: StepRecord) -> None:
            if not first_step:
                first_step.append(time.time() - r.wall_s)  # when this attempt's first step began
                if open_interruption is not None:
                    failed = open_interruption["failed_at"].timestamp()
                    saved = state.loop.get("saved_at", failed) if state else started_at.timestamp()
                    detected = failed + (open_interruption.get("detect_s") or 0.0)
                    recovery.close_interruption(lake, open_interruption, resumed_from, failed - saved,
                                                first_step[0] - detected)
                    lost[0] = recovery.lost_seconds(lake, run_id)
            beat(run_dir, r.step)
            n = steplog.add(r)
            tracker.log_metrics(mlflow_id, r.step, {**{k: v for k, v in r.to_dict().items() if k != "step"}, **r.data})
            done_here = r.step - resumed_from
            p = Progress("grpo", r.step, spec.schedule.steps,
                         (time.perf_counter() - t_loop) * r.step / max(done_here, 1), r.reward_mean, r.accuracy)
            if progress is not None:
                progress(p)
            log(f"step {r.step}/{spec.schedule.steps} reward={r.reward_mean:.3f} acc={r.accuracy:.3f} "
                f"entropy={r.entropy:.3f} tok/s={r.tokens_per_s:.0f} eta={format_duration(p.eta_s)}")
            if n >= flush_every:
                steplog.flush(lake)
                runs_row("running" if attempt == 1 else "resumed")
            sched = spec.schedule
            if sched.eval_every and r.step % sched.eval_every == 0 and r.step < sched.steps:
                res = evaluate(EmbeddedEngine(model, tok), tok, splits.eval, spec.rollout.max_new_tokens)
                lake.upsert("evals", eval_rows(run_id, r.step, res, None))
                tracker.log_metrics(mlflow_id, r.step, {"eval/accuracy": res.accuracy})
                _source_evals(spec, held, model, tok, lake, tracker, run_id, mlflow_id, r.step, None)
                beat(run_dir)
            if sched.checkpoint_every and r.step % sched.checkpoint_every == 0 and r.step < sched.steps:
                record_checkpoint(model, tok, paths, lake, run_id, r.step)

        records: list[StepRecord] = []
        try:
            with ckpts.signals():
                if state is not None and state.step >= spec.schedule.steps:
                    model.load_state_dict(state.model)  # trained to the end before: only the last stages remain
                else:
                    records = train_grpo(spec, model, tok, splits.train, on_step=on_step, checkpoints=ckpts,
                                         resume=state, reference_model=reference, feed=feed)
        finally:
            try:
                ckpts.writer.wait()
            finally:
                steplog.flush(lake)
                for lk in writer_lake:
                    lk.close()
        beat(run_dir)
        final_step = spec.schedule.steps
        info = record_checkpoint(model, tok, paths, lake, run_id, final_step, final=True)
        final_eval = evaluate(EmbeddedEngine(model, tok), tok, splits.eval, spec.rollout.max_new_tokens,
                              k=spec.schedule.eval_pass_k, temperature=1.0, seed=spec.seed)
        lake.upsert("evals", eval_rows(run_id, final_step, final_eval, info.sha256))
        _source_evals(spec, held, model, tok, lake, tracker, run_id, mlflow_id, final_step, info.sha256)
        tracker.log_metrics(mlflow_id, final_step, {"eval/accuracy": final_eval.accuracy,
                                                    f"eval/pass_at_{final_eval.k}": final_eval.pass_at_k})
        tracker.set_tags(mlflow_id, {"factory.checkpoint": str(info.path)})
        runs_row("succeeded", final_checkpoint=str(info.path), ended_at=_now())
        done = recovery.run_row(lake, run_id)
        tracker.log_metrics(mlflow_id, final_step, {"goodput": done["goodput"]})
        tracker.end_run(mlflow_id, "FINISHED")
        log(f"run {run_id}: final held-out accuracy {final_eval.accuracy:.3f} ({time.perf_counter() - t0:.0f}s"
            + (f", attempt {attempt}, goodput {done['goodput']:.3f}" if attempt > 1 else "") + ")")
        return RunResult(run_id, mlflow_id, info, final_step, start[0], start[1], final_eval.accuracy,
                         done["wall_s"], records, attempt=attempt, goodput=done["goodput"])
    except BaseException as e:
        status, cause = _classify(e, ckpts)
        detail = f"{type(e).__name__}: {e}"
        recovery.record_interruption(lake, run_id, attempt, cause, detail, recovery.last_step(lake, run_id))
        runs_row(status, ended_at=_now(), error=f"attempt {attempt}: {cause}: {detail}"[:4000],
                 interruptions=int(base_row.get("interruptions") or 0) + 1)
        tracker.end_run(mlflow_id, "FAILED" if status == "failed" else "KILLED")
        log(f"run {run_id}: attempt {attempt} stopped ({cause}); "
            + (f"resume it with: factory resume {run_id}" if status == "interrupted" else f"failed: {detail}"))
        raise


def _classify(e: BaseException, ckpts: RunCheckpoints) -> tuple[str, str]:
    """(run status, interruption cause) for an attempt that ended with `e`."""
    if isinstance(e, RunInterrupted | KeyboardInterrupt) or ckpts.stopping():
        return "interrupted", "signal"
    if isinstance(e, NonFiniteLoss):
        return "failed", "non_finite_loss"
    if isinstance(e, CircuitOpen):
        return "interrupted", "crash_loop"
    return "interrupted", "crash"  # resumable: a restart (the supervisor, a Dagster retry) continues it


def _start_eval(spec: ExperimentSpec, lake: Lake, tracker: Tracker, run_id: str, mlflow_id: str, model, tok,
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
    log(f"run {run_id}: start held-out accuracy {res.accuracy:.3f}, pass@{res.k} {res.pass_at_k:.3f}")
    return res.accuracy, res.pass_at_k


SOURCE_BENCHMARK = "source:"  # evals.benchmark of a blend source's held-out set: "source:<name>"


def _source_evals(spec: ExperimentSpec, held: dict, model, tok, lake: Lake, tracker: Tracker, run_id: str,
                  mlflow_id: str, step: int, sha256: str | None) -> None:
    """Greedy held-out accuracy per blend source (`data.held_out` problems of each generated source)."""
    rows, metrics = [], {}
    for name, problems in held.items():
        res = evaluate(EmbeddedEngine(model, tok), tok, problems, spec.rollout.max_new_tokens)
        rows.append(dict(run_id=run_id, step=step, benchmark=SOURCE_BENCHMARK + name, metric="accuracy",
                         value=res.accuracy, n=res.n, checkpoint_sha256=sha256, recorded_at=_now()))
        metrics[f"eval/source/{name}"] = res.accuracy
    if rows:
        lake.upsert("evals", rows)
        tracker.log_metrics(mlflow_id, step, metrics)


PROMPT_STATS_TAG = "factory.prompt_stats_snapshot"


def _offline_stats(spec: ExperimentSpec, lake: Lake, tracker: Tracker, mlflow_id: str, log: Log) -> dict | None:
    """Per-prompt (samples, passes) over earlier runs, when the spec filters prompts by them (data.filter). The
    snapshot read is tagged on the run, and a resumed attempt reads the same one (runs that finished meanwhile
    must not change what the filter decides)."""
    if spec.data is None or spec.data.filter is None:
        return None
    from factory.data.stats import read_prompt_stats

    pinned = tracker.client.get_run(mlflow_id).data.tags.get(PROMPT_STATS_TAG)
    stats, snapshot = read_prompt_stats(lake, spec.data.names(), int(pinned) if pinned else None)
    if pinned and str(snapshot) != pinned:
        log(f"data.filter: prompt_stats snapshot {pinned} no longer exists (expired); read {snapshot} instead")
    tracker.set_tags(mlflow_id, {PROMPT_STATS_TAG: str(snapshot)})
    log(f"data.filter: pass rates of {len(stats)} prompts from prompt_stats (snapshot {snapshot})")
    return stats


def record_checkpoint(model, tok, paths: FactoryPaths, lake: Lake, run_id: str, step: int,
                      final: bool = False) -> CheckpointInfo:
    """Save an HF-format checkpoint of the run at `step` and record it (periodic evals pick it up). With
    $FACTORY_CHECKPOINT_URI set it is also published to that object store, and its URI there is what is recorded."""
    name = "final" if final else f"step-{step:06d}"
    info = save_checkpoint(model, tok, paths.checkpoints / run_id / name,
                           meta={"kind": "rl", "run_id": run_id, "step": step})
    uri = recorded_uri(info, f"{run_id}/{name}")
    lake.upsert("checkpoints", [dict(run_id=run_id, step=step, kind="rl", uri=uri,
                                     bytes=info.bytes, sha256=info.sha256, recorded_at=_now())])
    return info

