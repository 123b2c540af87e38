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
from factory.core.rollout.embedded import EmbeddedEngine
from factory.core.sft import run_sft
from factory.digest import dir_digest
from factory.envs.eval_suites import HELD_OUT
from factory.envs.tasks import make_task_splits
from factory.home import FactoryPaths
from factory.infra.device import describe, prepare, run_device
from factory.infra.gpus import Gpus
from factory.infra.placement import check_placement, enter, placements
from factory.lake.writer import Lake
from factory.models.build import build_model, policy_for
from factory.models.checkpoint import CheckpointInfo, load_checkpoint, save_checkpoint
from factory.models.resolve import model_provenance, resolve_model_path
from factory.models.tokenizer import tokenizer_for
from factory.problem import Problem, Splits
from factory.progress import Log, Progress

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
    device = device or run_device(spec)
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
    every = max(1, sft.steps // 10)

    def on_step(step: int, m: dict[str, float]) -> None:
        if progress is not None:
            progress(Progress("sft", step + 1, sft.steps, time.perf_counter() - t0,
                              stops_at_accuracy=sft.stop_at_accuracy))
        if (step + 1) % every == 0 or step + 1 == sft.steps:
            log(f"sft step {step + 1}/{sft.steps} loss={m['loss']:.4f}")

    labeled = splits.train[:sft.examples] if sft.examples else splits.train  # the demonstrations SFT may see
    metrics = run_sft(model, tok, labeled, sft, spec.seed, on_step=on_step,
                      max_new_tokens=spec.rollout.max_new_tokens)
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
    """Spend `seconds` (the GRPO run's wall time) on more SFT instead; record its held-out accuracy.

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
    lake.upsert("evals", rows)
    return ControlResult(res.checkpoint, extra, res.accuracy)


# ---------------------------------------------------------------- the report


def eval_summary(lake: Lake, run_id: str) -> dict:
    """What a run's evals say: start (SFT) vs final (GRPO) accuracy, pass@k, the control, by level."""
    rows = lake.read("evals", EqualTo("run_id", run_id)).to_pylist()
    if not rows:
        raise LookupError(f"no evals recorded for run {run_id!r}")
    final = max(r["step"] for r in rows)
    get = {(r["step"], r["benchmark"], r["metric"]): r["value"] for r in rows}
    out = {"run_id": run_id, "final_step": final, "n": rows[0]["n"],
           "sft_accuracy": get.get((0, HELD_OUT, "accuracy")),
           "grpo_accuracy": get.get((final, HELD_OUT, "accuracy")),
           "control_accuracy": get.get((final, HELD_OUT, "sft_control_accuracy")), "levels": {}}
    for (step, bench, metric), value in get.items():
        if step not in (0, final):  # periodic evals between them (schedule.eval_every) are not the final word
            continue
        if bench == HELD_OUT and metric.startswith("pass@"):
            out[("sft_" if step == 0 else "grpo_") + metric.replace("@", "_at_")] = value
        if bench == HELD_OUT and metric.startswith("sft_control_pass@"):
            out["control_" + metric.removeprefix("sft_control_").replace("@", "_at_")] = value
        if bench.startswith(HELD_OUT + "/") and metric == "accuracy":
            out["levels"].setdefault(bench.split("/", 1)[1], {})["sft" if step == 0 else "grpo"] = value
    if out["sft_accuracy"] is not None and out["grpo_accuracy"] is not None:
        out["gain"] = out["grpo_accuracy"] - out["sft_accuracy"]
    if out["control_accuracy"] is not None and out["grpo_accuracy"] is not None:
        out["winner"] = "grpo" if out["grpo_accuracy"] > out["control_accuracy"] else "more sft"
    return out


def render_report(s: dict) -> str:
    """Markdown table of an `eval_summary`."""
    pct = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = [f"### Run `{s['run_id']}` — held-out accuracy (n={s['n']})", "",
             "| checkpoint | greedy accuracy | pass@8 (T=1) |", "|---|---|---|",
             f"| SFT warm start (step 0) | {pct(s['sft_accuracy'])} | {pct(s.get('sft_pass_at_8'))} |",
             f"| GRPO (step {s['final_step']}) | {pct(s['grpo_accuracy'])} | {pct(s.get('grpo_pass_at_8'))} |"]
    if s.get("control_accuracy") is not None:
        lines.append(f"| control: same wall time of more SFT | {pct(s['control_accuracy'])} | "
                     f"{pct(s.get('control_pass_at_8'))} |")
    if s["levels"]:
        lines += ["", "| level | SFT | GRPO |", "|---|---|---|"]
        lines += [f"| {lvl} | {pct(v.get('sft'))} | {pct(v.get('grpo'))} |" for lvl, v in s["levels"].items()]
    if "gain" in s:
        lines += ["", f"GRPO gain over SFT: {100 * s['gain']:+.1f} points."]
    if "winner" in s:
        lines.append(f"Control (same extra wall time): {s['winner']} wins.")
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
