"""The experiment's stages other than the RL run, as plain functions: the dataset, the SFT warm start (shared
by runs that ask for the same one), the more-SFT control, and the eval report.

`runs/experiment.py` calls them in order around the RL run (`runs/rl_run.py`); the Dagster assets call the same
functions one per asset. Each stage writes its outputs under FACTORY_HOME and its records to Iceberg and MLflow.
Each stage places the model it builds or loads on the run's device (`place`); checkpoints are written from it and
load on the CPU (transformers' default), to be placed again by whoever loads them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from pyiceberg.expressions import EqualTo

import factory
from factory.config import ExperimentSpec
from factory.core.evaluate import EvalResult, evaluate
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.sft import run_sft
from factory.core.trainer.torch_trainer import SPEEDUPS
from factory.data.from_spec import held_out_sets
from factory.digest import dir_digest
from factory.envs.eval_suites import HELD_OUT, SOURCE_BENCHMARK
from factory.envs.tasks import make_task_splits
from factory.home import FactoryPaths
from factory.infra.device import describe, prepare, run_device
from factory.infra.gpus import Gpus
from factory.infra.placement import check_placement, enter, placements
from factory.intervals import Accuracy, accuracy_text, share_text, verdict
from factory.lake.results import outcomes_from_evals
from factory.lake.writer import Lake
from factory.models.build import build_model, policy_for
from factory.models.checkpoint import CheckpointInfo, load_checkpoint, save_checkpoint
from factory.models.resolve import model_provenance, resolve_model_path
from factory.models.tokenizer import tokenizer_for
from factory.problem import Problem, Splits
from factory.progress import Log, Progress, narrates

ProgressCallback = Callable[[Progress], None]  # told each step's progress (stage, step, ETA)


def _now() -> datetime:
    return datetime.now(UTC)


def code_version() -> str:
    """Package version plus the git commit when run from a checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{factory.__version__}+{sha}" if sha else factory.__version__


def place(spec: ExperimentSpec, model: torch.nn.Module, log: Log | None = None,
          device: torch.device | None = None) -> torch.device:
    """Put `model` on the run's device (`device` if the caller resolved it already, else `infra/device.run_device`:
    the spec's `device`, or trainer.devices at world_size 1), made current with TF32 on a GPU, and say which
    (`log`); returns it. Every stage places its model here once: the trainers, engines, evals and the KL reference
    then follow the model."""
    device = device or run_device(spec.resolved)
    prepare(device)
    model.to(device)
    if log is not None:
        log(f"device: {describe(device)}")
    return device


def set_threads(spec: ExperimentSpec, log: Log = print) -> None:
    """Place the calling thread (the trainer's) per the spec (`infra/placement.py`); cores and GPUs the machine
    does not have are refused here (GPUs as torch counts them: the count the run will meet)."""
    gpus = Gpus(torch.cuda.device_count(), "torch.cuda.device_count()")
    for note in check_placement(spec, gpus=gpus):
        log(note)
    enter(placements(spec)["trainer"])


# ---------------------------------------------------------------- dataset


@dataclass(frozen=True)
class DatasetArtifact:
    path: Path
    fingerprint: str
    n_train: int
    n_eval: int


def build_dataset(spec: ExperimentSpec, paths: FactoryPaths) -> DatasetArtifact:
    """Generate the task's splits and store them as JSONL under datasets/<fingerprint>/ (atomic)."""
    splits = make_task_splits(spec.task, spec.seed)
    fp = splits.fingerprint()
    final = paths.datasets / f"{spec.task.name}-{fp}"
    if not (final / "eval.jsonl").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".arithmetic-", dir=paths.datasets))
        for name, rows in (("train", splits.train), ("eval", splits.eval)):
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(p.to_dict()) + "\n" for p in rows))
        try:
            os.replace(tmp, final)
        except OSError:  # another process wrote the same content first
            shutil.rmtree(tmp, ignore_errors=True)
    return DatasetArtifact(final, fp, len(splits.train), len(splits.eval))


def load_dataset(path: str | Path) -> Splits:
    path = Path(path)

    def read(name: str) -> list[Problem]:
        with (path / f"{name}.jsonl").open() as f:
            return [Problem(**json.loads(line)) for line in f]

    return Splits(train=read("train"), eval=read("eval"))


# ---------------------------------------------------------------- evaluation


def evaluate_checkpoint(spec: ExperimentSpec, path: str | Path, problems: list[Problem],
                        k: int | None = None) -> EvalResult:
    model, tok = load_checkpoint(path)
    place(spec, model)
    return evaluate(EmbeddedEngine(model, tok), tok, problems, spec.rollout.max_new_tokens,
                    k=spec.schedule.eval_pass_k if k is None else k, temperature=1.0, seed=spec.seed)


def eval_rows(run_id: str, step: int, result: EvalResult, sha256: str | None) -> list[dict]:
    at = _now()
    rows = [dict(run_id=run_id, step=step, benchmark=HELD_OUT, metric="accuracy", value=result.accuracy,
                 n=result.n, checkpoint_sha256=sha256, recorded_at=at)]
    if result.pass_at_k is not None:
        rows.append(dict(run_id=run_id, step=step, benchmark=HELD_OUT, metric=f"pass@{result.k}",
                         value=result.pass_at_k, n=result.n, checkpoint_sha256=sha256, recorded_at=at))
    for level, acc in result.by_level.items():
        rows.append(dict(run_id=run_id, step=step, benchmark=f"{HELD_OUT}/{level}", metric="accuracy",
                         value=acc, n=result.level_n.get(level, result.n), checkpoint_sha256=sha256, recorded_at=at))
    return rows


# ---------------------------------------------------------------- SFT warm start


@dataclass(frozen=True)
class SFTResult:
    checkpoint: CheckpointInfo
    accuracy: float
    pass_at_k: float | None
    seconds: float
    steps: int  # steps actually run (the stop rule may end SFT early)


def train_sft_checkpoint(spec: ExperimentSpec, paths: FactoryPaths, splits: Splits, log: Log = print,
                         model=None, tokenizer=None, steps: int | None = None, name: str | None = None,
                         progress: ProgressCallback | None = None) -> SFTResult:
    """SFT from scratch (or continue `model`), save an atomic checkpoint, evaluate it held-out."""
    set_threads(spec, log)
    if model is None and tokenizer is None:
        model, tok = policy_for(spec, paths, log=log)  # model.path's model and tokenizer, or the preset's
    else:
        tok = tokenizer or tokenizer_for(spec.task.name)
        model = model if model is not None else build_model(spec.model.preset, tok, seed=spec.seed,
                                                            max_positions=spec.model.max_positions)
    place(spec, model, log)  # SFT (and the control) train on the run's device
    # An explicit step count (the control) means exactly that many steps: no early stop.
    sft = spec.sft if steps is None else spec.sft.model_copy(update={"steps": steps, "stop_at_accuracy": None})
    t0 = time.perf_counter()

    def on_step(step: int, m: dict[str, float]) -> None:
        if progress is not None:
            progress(Progress("sft", step + 1, sft.steps, time.perf_counter() - t0,
                              stops_at_accuracy=sft.stop_at_accuracy))
        if narrates(step + 1, sft.steps):
            log(f"sft step {step + 1}/{sft.steps} loss={m['loss']:.4f}")

    labeled = splits.train[:sft.examples] if sft.examples else splits.train  # the demonstrations SFT may see
    metrics = run_sft(model, tok, labeled, sft, spec.seed, on_step=on_step,
                      max_new_tokens=spec.rollout.max_new_tokens,
                      speedups={name: getattr(spec.trainer, name) for name in SPEEDUPS})
    seconds = time.perf_counter() - t0
    steps_run = int(metrics["steps"])
    name = name or f"sft-{spec.fingerprint()}"
    meta = {"kind": "sft", "spec": json.loads(spec.to_json()), "steps": steps_run, "labeled_examples": len(labeled)}
    if spec.model.path is not None:  # where the weights came from: the path as given and the directory it named
        meta["model_source"] = model_provenance(spec.model.path, resolve_model_path(spec.model.path, paths, log=log))
    info = save_checkpoint(model, tok, paths.checkpoints / name, meta=meta)
    result = evaluate_checkpoint(spec, info.path, splits.eval)
    log(f"sft checkpoint {info.path.name} after {steps_run} steps: held-out accuracy {result.accuracy:.3f}, "
        f"pass@{result.k} {result.pass_at_k:.3f} ({seconds:.0f}s)")
    return SFTResult(info, result.accuracy, result.pass_at_k, seconds, steps_run)


# ---------------------------------------------------------------- the control


@dataclass(frozen=True)
class ControlResult:
    checkpoint: CheckpointInfo
    steps: int
    accuracy: float


def run_sft_control(spec: ExperimentSpec, paths: FactoryPaths, splits: Splits, lake: Lake, run_id: str,
                    step: int, model, tokenizer, seconds: float, sft_seconds_per_step: float,
                    log: Log = print) -> ControlResult:
    """Spend `seconds` (the GRPO run's wall time) on more SFT instead; record its held-out accuracy, on the task's
    split and on each blend source's held-out set (whichever is the run's own: `lake/results.py`).

    The budget is converted to steps with the warm start's measured seconds per step, so the
    comparison does not depend on what else the machine is doing at that moment.
    """
    extra = max(1, round(seconds / max(sft_seconds_per_step, 1e-6)))
    log(f"control: {extra} more SFT steps (~{seconds:.0f}s, the GRPO run's wall time)")
    res = train_sft_checkpoint(spec, paths, splits, log=log, model=model, tokenizer=tokenizer, steps=extra,
                               name=f"{run_id}/sft-control")
    rows = [dict(r, metric=f"sft_control_{r['metric']}") for r in
            eval_rows(run_id, step, EvalResult(res.accuracy, res.pass_at_k, spec.schedule.eval_pass_k,
                                               len(splits.eval), {}), res.checkpoint.sha256)]
    for source, problems in held_out_sets(spec.data).items():
        got = evaluate_checkpoint(spec, res.checkpoint.path, problems, k=0)
        rows.append(dict(run_id=run_id, step=step, benchmark=SOURCE_BENCHMARK + source, metric="sft_control_accuracy",
                         value=got.accuracy, n=got.n, checkpoint_sha256=res.checkpoint.sha256, recorded_at=_now()))
    lake.upsert("evals", rows)
    return ControlResult(res.checkpoint, extra, res.accuracy)


# ---------------------------------------------------------------- the report


def eval_summary(lake: Lake, run_id: str) -> dict:
    """What a run's evals say: start (SFT, step 0) vs the run's result (`lake/results.py`: accuracy on its own task's
    held-out set, `benchmark`, at its final evaluated step), pass@k, the control, by level, each accuracy with its n;
    the other benchmarks at step 0 and at that step; and verdicts that name a winner only when the 95% interval of
    the difference excludes 0 (`factory/intervals.py`)."""
    rows = lake.read("evals", EqualTo("run_id", run_id)).to_pylist()
    if not rows:
        raise LookupError(f"no evals recorded for run {run_id!r}")
    outcome = outcomes_from_evals(rows).get(run_id)
    final = outcome.step if outcome and outcome.step is not None else max(r["step"] for r in rows)
    bench = outcome.primary.benchmark if outcome and outcome.primary else HELD_OUT
    get = {(r["step"], r["benchmark"], r["metric"]): r for r in rows}
    value = lambda key: get[key]["value"] if key in get else None  # noqa: E731
    n_of = lambda key: get[key]["n"] if key in get else None  # noqa: E731
    start, control = (0, bench, "accuracy"), (final, bench, "sft_control_accuracy")
    out = {"run_id": run_id, "final_step": final, "benchmark": bench, "n": outcome.n if outcome else None,
           "sft_accuracy": value(start), "sft_n": n_of(start),
           "grpo_accuracy": outcome.accuracy if outcome else None,
           "control_accuracy": value(control), "control_n": n_of(control),
           "others": {name: {"accuracy": sc.value, "n": sc.n, "start_accuracy": value((0, name, "accuracy")),
                             "start_n": n_of((0, name, "accuracy"))}
                      for name, sc in (outcome.others if outcome else {}).items()},
           "levels": {}}
    for (step, b, metric), r in get.items():
        if step not in (0, final):  # periodic evals between them (schedule.eval_every) are not the final word
            continue
        if b == bench and metric.startswith("pass@"):
            out[("sft_" if step == 0 else "grpo_") + metric.replace("@", "_at_")] = r["value"]
        if b == bench and metric.startswith("sft_control_pass@"):
            out["control_" + metric.removeprefix("sft_control_").replace("@", "_at_")] = r["value"]
        if b.startswith(bench + "/") and metric == "accuracy":
            level = out["levels"].setdefault(b.split("/", 1)[1], {})
            level["sft" if step == 0 else "grpo"] = r["value"]
            level["sft_n" if step == 0 else "grpo_n"] = r["n"]
    grpo = _accuracy(out["grpo_accuracy"], out["n"])
    # Step 0 and the final step score the same problems, so the independent-samples interval is conservative here.
    if out["sft_accuracy"] is not None and grpo is not None:
        out["gain"] = out["grpo_accuracy"] - out["sft_accuracy"]
        sft = _accuracy(out["sft_accuracy"], out["sft_n"])
        if sft is not None:
            out["gain_verdict"] = verdict("grpo", grpo, "sft", sft).text()
    ctl = _accuracy(out["control_accuracy"], out["control_n"])
    if ctl is not None and grpo is not None:
        v = verdict("grpo", grpo, "more sft", ctl)
        out["winner"], out["verdict"] = v.winner, v.text()
    return out


def _accuracy(value: float | None, n: int | None) -> Accuracy | None:
    """`value` of n problems as an `Accuracy`; None when n is unknown or `value` is not a count out of n."""
    if value is None or not n:
        return None
    try:
        acc = Accuracy(value, int(n))
        acc.interval()  # raises when value is not k of n
    except ValueError:
        return None
    return acc


def render_report(s: dict) -> str:
    """Markdown table of an `eval_summary`: accuracies and pass@k to 3 decimals with their 95% interval and n."""
    acc = lambda v, n: "—" if v is None else accuracy_text(v, n)  # noqa: E731
    dec = share_text  # pass@k of the same n problems, with its interval (factory/intervals.py)
    # pass@k as the spec's schedule.eval_pass_k measured it; no column when the benchmark has none (a blend source's)
    ks = [int(key.rpartition("_at_")[2]) for key in s if isinstance(key, str) and "_pass_at_" in key]
    k = min(ks, default=None)
    cell = (lambda who, n: "") if k is None else (lambda who, n: f" {dec(s.get(f'{who}_pass_at_{k}'), n)} |")  # noqa: E731
    lines = [f"### Run `{s['run_id']}` — held-out accuracy ({s['benchmark']}, 95% Wilson intervals)", "",
             "| checkpoint | greedy accuracy |" + ("" if k is None else f" pass@{k} (T=1) |"),
             "|---|---|" + ("" if k is None else "---|"),
             f"| SFT warm start (step 0) | {acc(s['sft_accuracy'], s['sft_n'])} |" + cell("sft", s["sft_n"]),
             f"| GRPO (step {s['final_step']}) | {acc(s['grpo_accuracy'], s['n'])} |" + cell("grpo", s["n"])]
    if s.get("control_accuracy") is not None:
        lines.append(f"| control: same wall time of more SFT | {acc(s['control_accuracy'], s['control_n'])} |"
                     + cell("control", s["control_n"]))
    if s.get("others"):
        lines += ["", f"Other benchmarks, step 0 → step {s['final_step']}: "
                  + "; ".join(f"{name} {acc(o.get('start_accuracy'), o.get('start_n'))} → {acc(o['accuracy'], o['n'])}"
                              for name, o in sorted(s["others"].items()))]
    if s["levels"]:
        lines += ["", "| level | SFT | GRPO |", "|---|---|---|"]
        lines += [f"| {lvl} | {acc(v.get('sft'), v.get('sft_n'))} | {acc(v.get('grpo'), v.get('grpo_n'))} |"
                  for lvl, v in s["levels"].items()]
    if "gain" in s:
        lines += ["", f"GRPO over SFT: {s['gain_verdict']}." if "gain_verdict" in s
                  else f"GRPO gain over SFT: {s['gain']:+.3f}."]
    if "verdict" in s:
        lines.append(f"Control (same extra wall time): {s['verdict']}.")
    return "\n".join(lines)


# ---------------------------------------------------------------- the shared SFT warm start


def sft_fingerprint(spec: ExperimentSpec) -> str:
    """What the SFT warm start depends on: members of a sweep over RL settings share one SFT checkpoint."""
    return spec.warm_start_fingerprint()


def warm_start_name(spec: ExperimentSpec) -> str:
    """The name of `spec`'s shared SFT warm start (its checkpoint directory under checkpoints/)."""
    return f"sft-{sft_fingerprint(spec)}"


def cached_sft_checkpoint(spec: ExperimentSpec, paths: FactoryPaths, splits: Splits, log: Log = print,
                          progress: ProgressCallback | None = None) -> SFTResult:
    """The SFT warm start for `spec`, trained once per `sft_fingerprint` and reused after that.

    Runs that ask for the same warm start at the same time (sweep members, a CLI run beside the UI) take
    turns on a lock file: one trains it, the others wait and then reuse it."""
    name = warm_start_name(spec)
    done = paths.checkpoints / f"{name}.result.json"  # beside the checkpoint: its digest covers only the model
    with _exclusive(paths.checkpoints / f"{name}.lock",
                    on_wait=lambda: log(f"sft checkpoint {name}: another run is training it; waiting for it")):
        if done.is_file():
            r = json.loads(done.read_text())
            digest, nbytes = dir_digest(paths.checkpoints / name)
            if digest == r["sha256"]:
                log(f"sft checkpoint {name}: reused (held-out accuracy {r['accuracy']:.3f})")
                return SFTResult(CheckpointInfo(paths.checkpoints / name, digest, nbytes), r["accuracy"],
                                 r["pass_at_k"], r["seconds"], r["steps"])
            log(f"sft checkpoint {name}: contents changed since it was recorded; training it again")
        res = train_sft_checkpoint(spec, paths, splits, log=log, name=name, progress=progress)
        # Written last: a crash before this leaves no record, and the next run trains it again.
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps({"sha256": res.checkpoint.sha256, "accuracy": res.accuracy,
                                   "pass_at_k": res.pass_at_k, "seconds": res.seconds, "steps": res.steps}))
        tmp.rename(done)
        return res


@contextlib.contextmanager
def _exclusive(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """An exclusive lock on `path` (flock: released by the kernel if the holder dies), calling `on_wait`
    once if another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
