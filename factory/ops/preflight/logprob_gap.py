"""The `logprob_gap` check: the step-0 log-prob gate (`core/gate.py`) as a preflight check. Quick and deep mode gate
the default setup (the `tiny` preset freshly built, the embedded engine in sync mode, the torch trainer, on the
device a default spec resolves to); `factory preflight --spec FILE` gates that experiment's own setup instead (its
model, engine, mode, precision and device, with the producer a run of it would build), so a mismatch is found before
the run is launched. Value: the mean |engine - trainer log-prob| per token; threshold: the gate's bound."""

from __future__ import annotations

from pathlib import Path

import torch

from factory.config import load_spec, parse_spec
from factory.core.gate import check_engine
from factory.core.loop import make_producer
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.envs.tasks import make_task_splits
from factory.home import FactoryPaths
from factory.infra.device import prepare, run_device
from factory.models.build import policy_for
from factory.ops.preflight.perf import torch_threads
from factory.ops.preflight.result import CheckResult

# The default setup: the quickstart's model size and sampling, a small task (only its first prompts are probed).
DEFAULT_SETUP = {"name": "preflight", "model": {"preset": "tiny"}, "task": {"n_train": 64, "n_eval": 8},
                 "rollout": {"max_new_tokens": 8}, "trainer": {"threads": 1}, "schedule": {"mode": "sync"}}


def logprob_gap_check(paths: FactoryPaths, spec_path: str | Path | None = None) -> CheckResult:
    """Build the setup (the default, or `spec_path`'s), run the gate on it, and say what it found."""
    spec = load_spec(spec_path) if spec_path is not None else parse_spec(DEFAULT_SETUP)
    setup = f"spec {spec_path}" if spec_path is not None else "the default tiny setup"
    # fork_rng: a check in a process that trains afterwards leaves its random stream as it was.
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))), \
            torch_threads(spec.trainer.threads or torch.get_num_threads()):
        model, tok = policy_for(spec, paths, log=lambda _: None)
        device = run_device(spec.resolved)
        prepare(device)
        model.to(device)
        t = spec.trainer
        trainer = TorchTrainer(model, lr=0.0, temperature=spec.rollout.temperature, precision=t.precision,
                               packing=t.packing, fused_head=t.fused_head, compile=t.compile)
        train = make_task_splits(spec.task, spec.seed).train
        producer = make_producer(spec, model, tok, train, start_version=0)
        try:
            res = check_engine(spec.rollout, trainer, producer, tok, [p.prompt for p in train],
                               spec.resolved.logprob_gap_bound(device.type))
        finally:
            producer.close()
    expected = f"<= {res.bound:g} mean |engine - trainer log-prob|; the trainer's prompt ids and eos"
    said = f"{setup}, {spec.rollout.engine} engine, {spec.schedule.mode}, {spec.trainer.precision} on {device}: " \
           + res.summary()
    if not res.passed:
        said += "; FAILED: " + "; ".join(f"{cause}: {detail}" for cause, detail in res.problems)
    return CheckResult("logprob_gap", res.passed, res.figures["gap_abs_mean"], res.bound, "nats/token", expected,
                       said)
