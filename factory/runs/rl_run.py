"""The RL run stage: one training run from a warm start with the spec's algorithm, recorded in Iceberg and MLflow,
and resumable.

A run is one run_id, one MLflow run, and one or more attempts (`Run`: one attempt from begin to finish or fail).
Calling `run_rl` with the run_id of a run that did not finish continues it: from its newest complete resume point
(`core/resume.py`), into the same MLflow run, as attempt N+1. The lake stays exact across attempts: rows the dead
attempt wrote past that resume point (steps, rollouts, evals, checkpoints) are deleted before the new attempt
writes them again, so `steps` holds one row per step with no hole, each tagged with the attempt that trained it;
the interruption is recorded (`runs/recovery.py`) with what it cost. A run that already succeeded is not trained
again: its recorded result is returned.

While an attempt lives it holds the run's lock and beats its heartbeat (`runs/attempt.py`): after every step, and from
inside every long phase (evals, checkpoint writes, loading a model: `infra/liveness.py`); SIGTERM or
SIGINT make it save a resume point after the current step and stop as `interrupted`; so does a supervised attempt
whose supervisor died (cause `supervisor_lost`). `attempt_main` is one attempt in a child process of the restarts
supervisor (`runs/restarts.py`).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pyiceberg.expressions import And, EqualTo

from factory.cockpit.tracking import Tracker
from factory.config import ExperimentSpec, OpsSpec, parse_spec
from factory.core.evaluate import evaluate
from factory.core.gate import LogprobGapError
from factory.core.loop import FINISHED, STOPPED, LoopEnd, NonFiniteLoss, RunInterrupted, StepRecord, run_loop
from factory.core.resume import TrainState, latest
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.data.feed import make_feed
from factory.data.from_spec import blend_version, held_out_sets
from factory.data.stats import read_prompt_stats
from factory.envs.eval_suites import HELD_OUT, SOURCE_BENCHMARK
from factory.home import FactoryPaths
from factory.infra import liveness
from factory.infra.device import describe, run_device
from factory.infra.disk import is_disk_full
from factory.infra.faults import fault_point
from factory.infra.supervisor import CircuitOpen
from factory.lake.spool import SPOOL, LakeDown, Spool, SpooledLake
from factory.lake.writer import Lake
from factory.models import lora
from factory.models.checkpoint import load_checkpoint
from factory.models.checkpoint_store import checkpoint_store_uri
from factory.models.uploads import BackgroundUploads
from factory.problem import Splits
from factory.progress import Progress, format_duration, narrates
from factory.runs import recovery
from factory.runs.attempt import (
    LAUNCH,
    SUPERVISOR_ENV,
    AttemptLock,
    OrphanGuard,
    StopRequest,
    announce_finished,
    beat,
    print_stacks_on_signal,
    read_launch,
    record_work_start,
    resume_dir,
    supervisor_lost,
    work_start,
)
from factory.runs.degraded import stop_code, tolerating, unless_down, watch_lake, when_lake_up
from factory.runs.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_LOGPROB_GAP,
    EXIT_NEEDS_FIX,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_SUPERVISOR_LOST,
)
from factory.runs.resume_points import RunCheckpoints
from factory.runs.run_checkpoints import record_checkpoint
from factory.runs.run_evals import source_evals, start_eval
from factory.runs.run_result import RunResult, headline, headline_source, recorded_result, tell_mlflow
from factory.runs.stages import (
    Log,
    ProgressCallback,
    build_dataset,
    code_version,
    eval_rows,
    load_dataset,
    place,
    set_threads,
)
from factory.runs.step_metrics import StepMetrics, source_metrics
from factory.runs.step_rows import StepLog, forget_after
from factory.source_spec import SourceError

_now = recovery.now
# (step, headline accuracy, its n) -> why to prune the run, or None
EvalHook = Callable[[int, float, int], str | None]


def new_run_id(spec: ExperimentSpec) -> str:
    return f"{spec.name}-{_now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def run_rl(spec: ExperimentSpec, paths: FactoryPaths, init_checkpoint: str | Path, splits: Splits,
           lake: Lake, tracker: Tracker, log: Log = print, run_id: str | None = None,
           sweep_id: str | None = None, flush_every: int = 10, mlflow_experiment: str | None = None,
           mlflow_parent_run_id: str | None = None, progress: ProgressCallback | None = None,
           on_eval: EvalHook | None = None) -> RunResult:
    """RL (the spec's algorithm) from `init_checkpoint`; records the run, every step, checkpoints and evals.

    With the `run_id` of a run that did not finish, continues it (see the module docstring). A sweep
    member passes its `sweep_id` and the sweep's MLflow parent run (nested under it, in the parent's
    experiment `mlflow_experiment`). `on_eval(step, accuracy, n)` is called after each periodic held-out eval;
    a reason returned stops the run at a resume point as pruned (a tpe sweep's trial, factory/cockpit/sweep_search.py):
    `RunInterrupted` is raised and the interruption's cause is `pruned`."""
    set_threads(spec, log)
    run_id = run_id or new_run_id(spec)
    run_dir = paths.checkpoints / run_id
    # The long phases (evals, checkpoint writes, loading the model) beat from inside their work (infra/liveness.py).
    with AttemptLock(run_dir), liveness.beating(lambda: beat(run_dir)):
        # What an earlier attempt spooled during a lake outage goes in first: the run's row and steps it recorded.
        Spool(run_dir / SPOOL).flush(lake)
        prev = recovery.run_row(lake, run_id)
        if prev is not None and prev["status"] == "succeeded":
            log(f"run {run_id} already succeeded; nothing to do")
            return recorded_result(lake, prev)
        if prev is not None and prev["spec_fingerprint"] != spec.fingerprint():
            raise ValueError(f"run {run_id} was started with spec {prev['spec_fingerprint']}, not this one "
                             f"({spec.fingerprint()}): resume it with its own spec (factory resume {run_id})")
        if prev is not None and prev["status"] in recovery.LIVE:  # we hold its lock: that attempt is dead
            recovery.mark_dead(lake, prev, run_dir)
            prev = recovery.run_row(lake, run_id)
        run = Run(spec, paths, splits, lake, tracker, run_id, prev, init_checkpoint,
                  RunOptions(sweep_id, mlflow_experiment, mlflow_parent_run_id, flush_every, log, progress, on_eval))
        return run.execute()


@dataclass(frozen=True)
class RunOptions:
    """How a run is filed and reported, beyond what it trains."""
    sweep_id: str | None = None  # a sweep member's sweep
    mlflow_experiment: str | None = None  # default: the spec's name
    mlflow_parent_run_id: str | None = None  # a sweep member's MLflow run nests under the sweep's
    flush_every: int = 10  # steps between writes of step rows (and the `runs` row) to the lake
    log: Log = print
    progress: ProgressCallback | None = None
    on_eval: EvalHook | None = None  # after each periodic eval: a reason stops the run as pruned


class Run:
    """One attempt of a run, from `begin` to `finish` or `fail`, called with the run's lock held.

    `begin` records the attempt (the `runs` row, the MLflow run: new, or the same one continued), loads the
    start and the newest resume point, and forgets what a dead attempt recorded past it; `train` runs the loop,
    which calls `step` after every step (heartbeat, step rows, MLflow, progress, periodic evals and
    checkpoints); `finish` saves, evaluates and records the final checkpoint; `fail` records why the attempt
    stopped. `execute` does all of that in order."""

    def __init__(self, spec: ExperimentSpec, paths: FactoryPaths, splits: Splits, lake: Lake, tracker: Tracker,
                 run_id: str, prev: dict | None, init_checkpoint: str | Path, options: RunOptions = RunOptions()):
        # Writes go through a spool that rides out a lake outage (lake/spool.py), up to ops.lake_outage_s.
        self.spool = Spool(paths.checkpoints / run_id / SPOOL)
        self.lake = SpooledLake(lambda: lake, self.spool)
        self.lake_down: str | None = None  # why this attempt stops: the lake stayed down past its budget
        self.spec, self.paths, self.splits, self.tracker = spec, paths, splits, tracker
        self.run_id, self.prev, self.init_checkpoint, self.options = run_id, prev, init_checkpoint, options
        self.log = options.log
        self.run_dir = paths.checkpoints / run_id
        self.attempt = 1 if prev is None else int(prev.get("attempts") or 1) + 1
        self.live_status = "running" if self.attempt == 1 else "resumed"
        self.base_row: dict = {}
        self.mlflow_id = ""
        self.lost_s = 0.0  # time lost to interruptions: changes only when one is closed, not at every flush
        self.model = self.tok = self.reference = None
        self.device: torch.device | None = None  # this attempt's (`_open_records` resolves it)
        self.state: TrainState | None = None  # the resume point this attempt starts from
        self.resumed_from = 0
        self.first_step_at: float | None = None  # when this attempt's first step began (time.time())
        self.steplog = StepLog(run_id, self.attempt)
        self.ckpts: RunCheckpoints | None = None
        self.held: dict = {}  # held-out problems per blend source
        self.feed = None
        self.start: tuple[float, float | None] = (0.0, None)  # held-out accuracy and pass@k at step 0
        self.records: list[StepRecord] = []  # this attempt's steps, once it trained them all
        self.stop = StopRequest()  # asked by a signal, the lake watch, a lost supervisor or the pruner
        self._writer_lake: SpooledLake | None = None  # the resume writer's thread's own Lake
        # With $FACTORY_CHECKPOINT_URI: checkpoint uploads beside the loop (`begin` starts them).
        self.uploads: BackgroundUploads | None = None
        self._t0 = self._t_loop = 0.0

    def execute(self) -> RunResult:
        """The attempt from begin to finish. An attempt whose loop ended otherwise (`LoopEnd`: stopped, non-finite
        updates, the sampler/trainer gap) is recorded by `fail` from what the loop returned, and raised as what it
        stands for (`RunInterrupted` with its cause, `LakeDown`, `NonFiniteLoss`, `LogprobGapError`); a failure
        after `begin` is recorded by `fail` and raised again."""
        self.begin()
        try:
            self.evaluate_start()
            end = self.train()
            if end.finished:
                return self.finish()
        except BaseException as e:
            failure = e
            tolerating(lambda: self.fail(failure, *_classify(failure, self.stop.cause)), self.log,
                       f"why attempt {self.attempt} of {self.run_id} stopped")
            raise
        error, status, cause = _ended(end, self.lake_down)
        tolerating(lambda: self.fail(error, status, cause), self.log,
                   f"why attempt {self.attempt} of {self.run_id} stopped")
        raise error

    # ------------------------------------------------------------ begin

    def begin(self) -> None:
        """Record the attempt, load the model and the resume point, forget what the last attempt did past it."""
        self._open_records()
        self._record_run(self.live_status)
        beat(self.run_dir)
        self.model, self.tok = load_checkpoint(self.init_checkpoint)
        place(self.spec, self.model, device=self.device)  # before the KL reference is copied from it: both there
        if self.spec.algorithm.kl_coef > 0:  # the KL reference is the run's start, whatever attempt this is
            self.reference = copy.deepcopy(self.model).eval()
        found = latest(resume_dir(self.run_dir), log=self.log) if self.prev is not None else None
        self.state = found[0] if found else None
        self.resumed_from = self.state.step if self.state else 0
        if self.prev is not None:
            forget_after(self.lake, self.run_id, self.resumed_from)
            self.log(f"run {self.run_id}: attempt {self.attempt} resumes from "
                     + (f"resume point {found[1].name} (step {self.resumed_from})" if found
                        else "its start (no resume point)"))
        self._t0 = time.perf_counter()
        # A step's MLflow points wait for a resume point covering them: one point per step across attempts.
        self.step_metrics = StepMetrics(self.tracker, self.mlflow_id,
                                        self.resumed_from if self.prev is not None else None)
        self.ckpts = RunCheckpoints(self.spec, self.run_dir, before_write=self._flush_from_writer,
                                    before_save=self.step_metrics.flush, stop=self.stop)
        if checkpoint_store_uri() is not None:
            self.uploads = BackgroundUploads(log=self.log)

    def _open_records(self) -> None:
        """The `runs` row's fixed part and the MLflow run: new for a first attempt, continued for a later one."""
        spec, run_id, opts = self.spec, self.run_id, self.options
        # This attempt's device (a resumed attempt may run elsewhere), resolved once, before anything is recorded: a
        # device the machine does not have is refused here. Logged, and recorded in the `runs` row and as an MLflow
        # tag; `begin` places the model on it.
        self.device = run_device(spec.resolved)
        if self.prev is None:
            self.base_row = dict(run_id=run_id, sweep_id=opts.sweep_id, name=spec.name, spec=spec.to_json(),
                                 spec_fingerprint=spec.fingerprint(), code_version=code_version(), seed=spec.seed,
                                 init_checkpoint=str(self.init_checkpoint), started_at=_now(), interruptions=0)
            tags = {"factory.run_id": run_id, "factory.init_checkpoint": str(self.init_checkpoint),
                    "factory.code_version": self.base_row["code_version"]}
            if opts.sweep_id:
                tags["factory.sweep_id"] = opts.sweep_id
            if opts.mlflow_parent_run_id:
                tags["mlflow.parentRunId"] = opts.mlflow_parent_run_id  # MLflow's nesting convention
            self.base_row["mlflow_run_id"] = self.tracker.start_run(
                experiment=opts.mlflow_experiment or spec.name, run_name=run_id, params=json.loads(spec.to_json()),
                tags=tags)
        else:
            self.base_row = {k: v for k, v in self.prev.items() if k not in ("ended_at", "error")}
            self.tracker.client.update_run(self.prev["mlflow_run_id"], status="RUNNING")  # the same run continues
            self.lost_s = recovery.lost_seconds(self.lake, run_id)
        self.mlflow_id = self.base_row["mlflow_run_id"]
        device = describe(self.device)
        self.log(f"run {run_id}: device {device}")
        self.tracker.set_tags(self.mlflow_id, {"factory.device": device, "factory.status": self.live_status})
        self.base_row.update(attempts=self.attempt, restarts=self.attempt - 1, host=recovery.host(), pid=os.getpid(),
                             device=device)

    def _wall(self) -> float:
        return (_now() - self.base_row["started_at"]).total_seconds()

    def _record_run(self, status: str, **extra) -> None:
        """The run's `runs` row as of now, with `status`."""
        w = self._wall()
        self.lake.upsert("runs", [dict(self.base_row, status=status, heartbeat_at=_now(), wall_s=w,
                                       lost_s=self.lost_s, goodput=recovery.goodput(w, self.lost_s), **extra)])

    def _flush_from_writer(self, step: int) -> None:
        """Before a resume point is written (in the writer's thread): its steps into the lake first."""
        if self._writer_lake is None:
            self._writer_lake = SpooledLake(lambda: Lake.open(self.paths), self.spool)
        self.steplog.flush(self._writer_lake)

    def evaluate_start(self) -> None:
        """Step 0's evals (once per run), and the data feed."""
        spec, lake, run_id = self.spec, self.lake, self.run_id
        self.start = start_eval(spec, lake, self.tracker, run_id, self.mlflow_id, self.model, self.tok,
                                 self.splits, self.log)
        self.held = held_out_sets(spec.data)
        if self.held and lake.read("evals", And(And(EqualTo("run_id", run_id), EqualTo("step", 0)), EqualTo(
                "benchmark", SOURCE_BENCHMARK + next(iter(self.held))))).num_rows == 0:
            self._evaluate_sources(0, None)
            start = headline(lake, run_id).outcome
            if start.primary is not None and start.primary.benchmark != HELD_OUT:  # a source's: say its baseline
                self.log(f"run {run_id}: start {start.primary.benchmark} accuracy {start.primary.text()} "
                         f"(the run's headline: its own task's held-out set)")
        self.feed = make_feed(spec.resolved.blend, self.splits.train,
                              stats=_offline_stats(spec, lake, self.tracker, self.mlflow_id, self.log))
        self.tracker.set_tags(self.mlflow_id, {"factory.blend_version": blend_version(spec.resolved.blend,
                                                                                     self.feed.blender.sources)})
        beat(self.run_dir)

    # ------------------------------------------------------------ train, step

    def train(self) -> LoopEnd:
        """The training loop from the resume point (if any) to the last step, `step` called after each; returns how
        it ended."""
        self._t_loop = time.perf_counter()
        try:
            with self.ckpts.signals():
                if self.state is not None and self.state.step >= self.spec.schedule.steps:
                    load_trained(self.spec, self.model, self.state.model)  # trained to the end before: the last stages
                    self._started_work(time.time())  # no step to train: the recovery ends here
                    end = LoopEnd(FINISHED, self.state.step, [])
                else:
                    end = run_loop(self.spec, self.model, self.tok, self.splits.train, on_step=self.step,
                                   checkpoints=self.ckpts, resume=self.state, reference_model=self.reference,
                                   feed=self.feed)
        except BaseException:
            self.step_metrics.drop()  # past the last resume point: the next attempt trains and logs them again
            raise
        else:
            if end.finished:
                self.records = end.records
                self.step_metrics.flush()
            else:
                self.step_metrics.drop()
        finally:
            try:
                self.ckpts.writer.wait()
            finally:
                self.steplog.flush(self.lake)
                if self._writer_lake is not None:
                    self._writer_lake.close()
        beat(self.run_dir)
        return end

    def step(self, r: StepRecord) -> None:
        """After each training step (the loop's `on_step`)."""
        if self.first_step_at is None:
            self._started_work(time.time() - r.wall_s)
        beat(self.run_dir, r.step)
        self._check_supervisor()
        n = self.steplog.add(r)
        self.step_metrics.add(r.step, {**{k: v for k, v in r.to_dict().items() if k != "step"}, **r.data,
                                       **source_metrics(r.sources)})
        self._report_progress(r)
        if n >= self.options.flush_every:
            self.steplog.flush(self.lake)
            self._record_run(self.live_status)
        self._watch_lake(r.step)
        sched = self.spec.schedule
        saved = None  # the checkpoint first: an eval at the same step is then its result (checkpoint_eval reuses it)
        if sched.checkpoint_every and r.step % sched.checkpoint_every == 0 and r.step < sched.steps:
            saved = record_checkpoint(self.model, self.tok, self.paths, self.lake, self.run_id, r.step,
                                      uploads=self.uploads).sha256
        if sched.eval_every and r.step % sched.eval_every == 0 and r.step < sched.steps:
            self._periodic_eval(r.step, saved)

    def _watch_lake(self, step: int) -> None:
        """During a lake outage: try it again now and then; past ops.lake_outage_s ask the loop to stop at a
        resume point (written without the lake: its rows are spooled), as a signal would."""
        cause = watch_lake(self.lake, self.spec.ops.lake_outage_s)
        if cause is not None and self.lake_down is None:
            self.lake_down = cause
            self.log(f"run {self.run_id}: {cause}; stopping at a resume point after step {step}")
            self.stop.ask(StopRequest.LAKE_DOWN)

    def _started_work(self, at: float) -> None:
        """This attempt starts training at `at` (its first step began, or it had no step left): close the costs of
        every earlier interruption still open, then record when this attempt's own work began (what its redo
        counts from, should it die)."""
        self.first_step_at = at
        if self.prev is not None:
            started = self.base_row["started_at"]
            saved = self.state.loop.get("saved_at") if self.state else None
            recovery.close_open_interruptions(self.lake, self.run_id, self.attempt, self.resumed_from,
                                              saved if saved is not None else recovery.stamp(started), at,
                                              work_start(self.run_dir))
            # The lake down: keep the old figure, the next attempt reads it right.
            self.lost_s = unless_down(lambda: recovery.lost_seconds(self.lake, self.run_id), self.lost_s)
        record_work_start(self.run_dir, self.attempt, at)

    def _check_supervisor(self) -> None:
        """A supervised attempt whose supervisor died: save a resume point after this step and stop (the loop does,
        as on SIGTERM), since nothing would restart it after a crash or kill it when it hangs."""
        if self.stop or not supervisor_lost():
            return
        self.log(f"run {self.run_id}: attempt {self.attempt} lost its supervisor (pid "
                 f"{os.environ.get(SUPERVISOR_ENV)} is gone): stopping at a resume point; continue with: "
                 f"factory resume {self.run_id}")
        self.stop.ask(StopRequest.SUPERVISOR_LOST)

    def _report_progress(self, r: StepRecord) -> None:
        steps = self.spec.schedule.steps
        done_here = r.step - self.resumed_from
        p = Progress("grpo", r.step, steps, (time.perf_counter() - self._t_loop) * r.step / max(done_here, 1),
                     r.reward_mean, r.accuracy, r.hacks_any)
        if self.options.progress is not None:
            self.options.progress(p)
        if not narrates(r.step, steps):
            return
        hacks = f" hacks={r.hacks_any:g}" if r.hacks_any else ""  # completions that tripped a hack detector
        self.log(f"step {r.step}/{steps} reward={r.reward_mean:.3f} acc={r.accuracy:.3f} "
                 f"entropy={r.entropy:.3f} tok/s={r.tokens_per_s:.0f}{hacks} eta={format_duration(p.eta_s)}")

    def _periodic_eval(self, step: int, sha256: str | None) -> None:
        """Held-out accuracy at `step`; its rows name the checkpoint of the same weights (`sha256`) if one was saved."""
        res = evaluate(EmbeddedEngine(self.model, self.tok), self.tok, self.splits.eval,
                       self.spec.rollout.max_new_tokens)
        self.lake.upsert("evals", eval_rows(self.run_id, step, res, sha256))
        self.step_metrics.add(step, {"eval/accuracy": res.accuracy})  # with the step's: once a resume point has it
        by_source = self._evaluate_sources(step, sha256, deferred=True)
        beat(self.run_dir)
        if self.options.on_eval is not None:  # told the run's headline: its own task's held-out set, and its n
            own = headline_source(list(by_source))
            told = (res.accuracy, res.n) if own is None else (by_source[own], len(self.held[own]))
            self._prune_if_told(step, *told)

    def _prune_if_told(self, step: int, accuracy: float, n: int) -> None:
        """Ask `on_eval` whether to go on; a reason makes the loop save a resume point after this step and stop."""
        reason = self.options.on_eval(step, accuracy, n)
        if reason and not self.stop:
            self.log(f"run {self.run_id}: pruned ({reason}); stopping at a resume point after step {step}")
            self.stop.ask(StopRequest.PRUNED)

    def _evaluate_sources(self, step: int, sha256: str | None, deferred: bool = False) -> dict[str, float]:
        """Source -> held-out accuracy; `deferred`: a periodic eval's MLflow points wait with the step's
        (`step_metrics`)."""
        return source_evals(self.spec, self.held, self.model, self.tok, self.lake, self.tracker, self.run_id,
                      self.mlflow_id, step, sha256, self.step_metrics if deferred else None)

    # ------------------------------------------------------------ finish, fail

    def finish(self) -> RunResult:
        """The final checkpoint, its evals, and the run recorded as succeeded."""
        fault_point("finish")  # chaos tests: a kill after the last resume point, before the result is recorded
        spec, lake, tracker, mlflow_id = self.spec, self.lake, self.tracker, self.mlflow_id
        final_step = spec.schedule.steps
        info = record_checkpoint(self.model, self.tok, self.paths, lake, self.run_id, final_step, final=True,
                                 uploads=self.uploads)
        beat(self.run_dir)  # the work after the last step beats too, between its parts
        final_eval = evaluate(EmbeddedEngine(self.model, self.tok), self.tok, self.splits.eval,
                              spec.rollout.max_new_tokens, k=spec.schedule.eval_pass_k, temperature=1.0,
                              seed=spec.seed)
        lake.upsert("evals", eval_rows(self.run_id, final_step, final_eval, info.sha256))
        beat(self.run_dir)
        self._evaluate_sources(final_step, info.sha256)
        beat(self.run_dir)
        tracker.log_metrics(mlflow_id, final_step, {"eval/accuracy": final_eval.accuracy,
                                                    f"eval/pass_at_{final_eval.k}": final_eval.pass_at_k})
        tracker.set_tags(mlflow_id, {"factory.checkpoint": str(info.path), "factory.status": "succeeded"})
        if self.uploads is not None:  # the end of the run waits for its uploads (the final eval ran meanwhile)
            self.uploads.close()
        self._record_run("succeeded", final_checkpoint=str(info.path), ended_at=_now())
        # The result is read back: wait out an outage within its budget, beating (the hang watchdog is shorter).
        self.lake.drain(spec.ops.lake_outage_s, sleep=lambda s: (time.sleep(s), beat(self.run_dir)))
        announce_finished(self.run_dir)  # the result is recorded: a supervisor's hang watchdog stands down
        done = recovery.run_row(lake, self.run_id)
        h = headline(lake, self.run_id)  # the run's own task's held-out set, with its baseline (lake/results.py)
        tell_mlflow(tracker, mlflow_id, h)
        tracker.log_metrics(mlflow_id, final_step, {"goodput": done["goodput"]})
        tracker.end_run(mlflow_id, "FINISHED")
        self.log(f"run {self.run_id}: result {h.outcome.text()} ({time.perf_counter() - self._t0:.0f}s"
                 + (f", attempt {self.attempt}, goodput {done['goodput']:.3f}" if self.attempt > 1 else "") + ")")
        o = h.outcome
        return RunResult(self.run_id, mlflow_id, info, final_step, o.start.value if o.start else self.start[0],
                         h.start_pass_at_k, o.accuracy if o.primary else final_eval.accuracy, done["wall_s"],
                         self.records, attempt=self.attempt, goodput=done["goodput"], benchmark=h.benchmark or HELD_OUT)

    def fail(self, e: BaseException, status: str, cause: str) -> None:
        """Record why this attempt stopped (`e`, the run's `status`, the interruption's `cause`): an interruption row,
        the run's status, the MLflow run's end."""
        detail = f"{type(e).__name__}: {e}"
        if self.uploads is not None:  # what was handed over still goes up; failures are logged, not raised over e
            self.uploads.close(raise_errors=False)
        last = unless_down(lambda: recovery.last_step(self.lake, self.run_id),
                           self.records[-1].step if self.records else None)  # the lake down: what this attempt did
        recovery.record_interruption(self.lake, self.run_id, self.attempt, cause, detail, last)
        self._record_run(status, ended_at=_now(), error=f"attempt {self.attempt}: {cause}: {detail}"[:4000],
                         interruptions=int(self.base_row.get("interruptions") or 0) + 1)
        # MLflow has no word for pruned: the run ended as meant (FINISHED), and `factory.status` says how
        self.tracker.set_tags(self.mlflow_id, {"factory.status": status})
        self.tracker.end_run(self.mlflow_id, {"failed": "FAILED", "pruned": "FINISHED"}.get(status, "KILLED"))
        self.log(f"run {self.run_id}: attempt {self.attempt} stopped ({cause}); "
                 + (f"resume it with: factory resume {self.run_id}" if status in ("interrupted", "pruned")
                    else f"failed: {detail}"))


def _ended(end: LoopEnd, lake_down: str | None) -> tuple[Exception, str, str]:
    """(what to raise, run status, interruption cause) for an attempt whose loop returned `end` short of the last
    step; `lake_down`: why the lake watch stopped it, which outranks the cause a later signal gave."""
    if end.kind == STOPPED:
        if lake_down:
            return LakeDown(lake_down), "interrupted", StopRequest.LAKE_DOWN
        stopped = RunInterrupted(f"stopped on request after step {end.steps_done}; resume point written", end.cause)
        if end.cause == StopRequest.PRUNED:  # an outcome, not a fault: the run's status says it
            return stopped, "pruned", StopRequest.PRUNED
        cause = end.cause if end.cause == StopRequest.SUPERVISOR_LOST else StopRequest.SIGNAL
        return stopped, "interrupted", cause
    assert end.error is not None, end
    return end.error, *_classify(end.error, end.cause)


def _classify(e: BaseException, asked: str | None) -> tuple[str, str]:
    """(run status, interruption cause) for an attempt that raised `e`, after a stop was `asked` (its cause) or not."""
    if isinstance(e, LakeDown):
        return "interrupted", "lake_down"
    if is_disk_full(e):
        return "interrupted", "disk_full"
    if asked == StopRequest.SUPERVISOR_LOST:
        return "interrupted", "supervisor_lost"
    if asked == StopRequest.PRUNED:  # an outcome, not a fault: the run's status says it
        return "pruned", "pruned"
    if isinstance(e, RunInterrupted | KeyboardInterrupt) or asked is not None:
        return "interrupted", "signal"
    if isinstance(e, NonFiniteLoss):
        return "failed", "non_finite_loss"
    if isinstance(e, LogprobGapError):
        return "failed", "logprob_gap"
    if isinstance(e, CircuitOpen):
        return "interrupted", "crash_loop"
    return "interrupted", "crash"  # resumable: a restart (the supervisor, a Dagster retry) continues it


PROMPT_STATS_TAG = "factory.prompt_stats_snapshot"


def _offline_stats(spec: ExperimentSpec, lake: Lake, tracker: Tracker, mlflow_id: str, log: Log) -> dict | None:
    """Per-prompt (samples, passes) over earlier runs, when the spec filters prompts by them (data.filter). The
    snapshot read is tagged on the run, and a resumed attempt reads the same one (runs that finished meanwhile
    must not change what the filter decides)."""
    if spec.data is None or spec.data.filter is None:
        return None
    pinned = tracker.client.get_run(mlflow_id).data.tags.get(PROMPT_STATS_TAG)
    stats, snapshot = read_prompt_stats(lake, spec.data.names(), int(pinned) if pinned else None)
    if pinned and str(snapshot) != pinned:
        log(f"data.filter: prompt_stats snapshot {pinned} no longer exists (expired); read {snapshot} instead")
    tracker.set_tags(mlflow_id, {PROMPT_STATS_TAG: str(snapshot)})
    log(f"data.filter: pass rates of {len(stats)} prompts from prompt_stats (snapshot {snapshot})")
    return stats


def load_trained(spec: ExperimentSpec, model, weights: dict) -> None:
    """Load a resume point's weights into the run's start `model`: a LoRA run's hold the base and the adapters, which
    are attached, loaded and merged (the loop leaves a LoRA run's model merged too)."""
    if spec.trainer.lora is not None:
        lora.attach(model, spec.trainer.lora)
    model.load_state_dict(weights)
    lora.detach(model)


# ---------------------------------------------------------------- an attempt in a child process


def attempt_main(paths: FactoryPaths, run_id: str) -> int:
    """One attempt of `run_id` in this process (the child side of `runs/restarts.py`): train until done, stopped
    or dead; returns the exit code the supervisor reads. A lake that stayed down and a full disk end it with one
    line on stderr and their own exit codes (`EXIT_DEPENDENCY_DOWN`, `EXIT_DISK_FULL`), which spend no restart."""
    print_stacks_on_signal()  # a hang kill's log says where the attempt was
    try:
        return _attempt(paths, run_id)
    except Exception as e:
        code = stop_code(e, paths.root, run_id)
        if code is None:
            raise
        return code


def _lake_and_row(paths: FactoryPaths, run_id: str) -> tuple[Lake, dict | None]:
    lake = Lake.open(paths)
    try:
        return lake, recovery.run_row(lake, run_id)
    except BaseException:
        lake.close()
        raise


def _attempt(paths: FactoryPaths, run_id: str) -> int:
    run_dir = paths.checkpoints / run_id
    launch = read_launch(run_dir)
    budget = parse_spec(launch["spec"], source=f"run {run_id}").ops.lake_outage_s if launch else OpsSpec().lake_outage_s
    lake, row = when_lake_up(lambda: _lake_and_row(paths, run_id), budget, beat=lambda: beat(run_dir),
                             log=lambda m: print(f"factory: run {run_id}: {m}", file=sys.stderr, flush=True))
    with lake:
        if row is None and not launch:
            print(f"factory: error: no run {run_id!r} in the lake and no {run_dir / LAUNCH}", file=sys.stderr)
            return EXIT_NEEDS_FIX
        spec = recovery.spec_of_run(row) if row else parse_spec(launch["spec"], source=f"run {run_id}")
        init = row["init_checkpoint"] if row else launch["init_checkpoint"]
        splits = load_dataset(build_dataset(spec, paths).path)
        try:
            with OrphanGuard(run_dir, spec.ops.hang_timeout_s):  # watches for hangs if the supervisor dies
                run_rl(spec, paths, init, splits, lake, Tracker(paths), run_id=run_id,
                       sweep_id=row["sweep_id"] if row else launch.get("sweep_id"),
                       mlflow_experiment=launch.get("mlflow_experiment"),
                       mlflow_parent_run_id=launch.get("mlflow_parent_run_id"))
            fault_point("attempt_exit")  # chaos tests: the work between the recorded result and the exit
        except (RunInterrupted, KeyboardInterrupt):
            return EXIT_SUPERVISOR_LOST if supervisor_lost() else EXIT_STOPPED
        except (NonFiniteLoss, CircuitOpen, SourceError) as e:  # restarting cannot help
            print(f"factory: error: run {run_id} stopped: {' '.join(str(e).split())}", file=sys.stderr)
            return EXIT_BAD_INPUT if isinstance(e, SourceError) else EXIT_NEEDS_FIX  # a data file gone bad: input
        except LogprobGapError as e:  # a setup to fix: its lines (figures, bound, cause) as they are
            print(f"factory: error: run {run_id} stopped: {e}", file=sys.stderr)
            return EXIT_LOGPROB_GAP
    return EXIT_OK
