"""Driving data-parallel trainer ranks from the one-process loop: rank 0 leads, the other ranks follow.

The loop runs unchanged on rank 0 (generation, rewards, the buffer, publication, logging): `make_trainer` gives it a
`LeaderTrainer`, whose `step` / `logprobs` first broadcast the call (the batch, the minibatch count, the shuffle
generator's state) to the followers and then run the same `DistributedTrainer` collective on rank 0's shard. The
other ranks run `follow(spec, model)`: they receive each call and apply it with the loss function rebuilt from the
spec (`algorithms.make_loss(spec.algorithm)`, the loop's own), until the
leader's `leading()` block ends and sends `stop`.

Weights: every rank starts from rank 0's (broadcast when the trainer is built), so a follower's model only needs the
architecture (`policy_for(spec)`). The loop's model on rank 0 stays a full replica, so publication, evals, resume
points and the final checkpoint work as in one process: under `ddp` it is the replica DDP trains; under `fsdp` the
ranks train sharded copies and after every step the leader gathers the full weights into it (the followers join
that all-gather). A resume point's optimizer state is `optimizer.state_dict()` under ddp and the full, gathered
state keyed by parameter name under fsdp (a collective too), loaded back on every rank.

`make_trainer` builds the loop's trainer through `factory.protocols.TRAINERS`; `torch_backend`, the `torch` entry,
is the choice above (one process, or rank 0 leading ranks).

Entry point: `python -m torch.distributed.run --nproc-per-node N -m factory.core.trainer.ranks --spec S.yaml
--leader module:function` (or `launch.run_ranks`): rank 0 calls `function(spec)` inside `leading()`, the others
follow.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from factory.config import ExperimentSpec, load_spec
from factory.core.algorithms import make_loss
from factory.core.batch import TrainBatch
from factory.core.trainer.distributed import DistributedTrainer, init_ranks, load_full_state, rank_device
from factory.core.trainer.logprobs import enable_activation_checkpointing
from factory.core.trainer.torch_trainer import LossFn, TorchTrainer
from factory.infra.faults import fault_point
from factory.models.build import policy_for
from factory.protocols.trainer import TRAINERS, Trainer, trainer_problems


class LeaderFailed(RuntimeError):
    """The leader's work raised; a follower stops with its message."""


def _send(op: str, payload: Any = None) -> None:
    dist.broadcast_object_list([(op, payload)], src=0)


def _receive() -> tuple[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def distributed_trainer(spec: ExperimentSpec, model: PreTrainedModel) -> DistributedTrainer:
    """The `DistributedTrainer` that `spec.trainer` describes: in a process group on this rank's device, alone on the
    device the run placed `model` on (it is not moved: the loop's engines and evals share it)."""
    t = spec.trainer
    device = rank_device(t.devices) if dist.is_initialized() and dist.get_world_size() > 1 else None
    if t.activation_checkpointing:
        enable_activation_checkpointing(model)
    return DistributedTrainer(model, lr=spec.algorithm.lr, grad_clip=t.grad_clip, weight_decay=t.weight_decay,
                              temperature=spec.rollout.temperature, aggregation=spec.algorithm.aggregation(),
                              strategy=t.strategy, grad_accum=t.grad_accum, precision=t.precision,
                              device=device, packing=t.packing, fused_head=t.fused_head,
                              fused_optimizer=t.fused_optimizer)


def make_trainer(spec: ExperimentSpec, model: PreTrainedModel) -> Trainer:
    """The loop's trainer: the backend `trainer.backend` names in `TRAINERS` (built-in torch or megatron, a plugin's
    entry point, one registered in this process, or an import path) builds it around `model`."""
    name = spec.trainer.backend
    trainer = TRAINERS.get(name)(spec, model)
    if problems := trainer_problems(trainer):
        raise TypeError(f"trainer.backend {name!r}: the builder returned a {type(trainer).__name__}, not a "
                        f"factory.protocols.Trainer: {'; '.join(problems)}")
    return trainer


def torch_backend(spec: ExperimentSpec, model: PreTrainedModel) -> Trainer:
    """The `torch` backend: the plain `TorchTrainer` at world_size 1 without accumulation (fp32, the default path,
    or bf16 autocast), on the device the run placed `model` on; a lone `DistributedTrainer` at world_size 1 with
    grad_accum (on that device too); on rank 0 of a torchrun group of world_size ranks, a `LeaderTrainer` (the
    others must run `follow`)."""
    t = spec.trainer
    if t.world_size == 1:
        if t.grad_accum == 1:
            if t.activation_checkpointing:
                enable_activation_checkpointing(model)
            return TorchTrainer(model, lr=spec.algorithm.lr, grad_clip=t.grad_clip, weight_decay=t.weight_decay,
                                temperature=spec.rollout.temperature, precision=t.precision, packing=t.packing,
                                fused_head=t.fused_head, compile=t.compile, fused_optimizer=t.fused_optimizer)
        return distributed_trainer(spec, model)
    group = dist.get_world_size() if dist.is_initialized() else None
    if group != t.world_size:
        raise RuntimeError(f"trainer.world_size: {t.world_size} ranks wanted, but this process is "
                           f"{'in no process group' if group is None else f'in a group of {group}'}: start the run "
                           f"with `factory run SPEC` (or `factory resume RUN_ID`), whose attempts are groups of "
                           f"torchrun ranks")
    if dist.get_rank() != 0:
        raise RuntimeError("make_trainer builds rank 0's trainer; the other ranks run follow(spec, model)")
    if t.strategy == "fsdp":  # the ranks train sharded copies; `model` stays the loop's full replica
        return LeaderTrainer(distributed_trainer(spec, copy.deepcopy(model)), replica=model)
    return LeaderTrainer(distributed_trainer(spec, model))


class _Optimizer:
    """Rank 0's optimizer: `state_dict` and `load_state_dict` (resume points) reach the followers too."""

    def __init__(self, trainer: DistributedTrainer):
        self._trainer = trainer

    def state_dict(self) -> dict:
        if self._trainer.strategy == "fsdp":
            _send("optimizer_state")
        return self._trainer.optimizer_state()

    def load_state_dict(self, state: dict) -> None:
        _send("load_optimizer", state)
        self._trainer.load_optimizer_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer.optimizer, name)


class LeaderTrainer:
    """Rank 0's trainer (a `factory.protocols.Trainer`); each call is sent to the followers before it runs."""

    def __init__(self, inner: DistributedTrainer, replica: PreTrainedModel | None = None):
        self.inner = inner
        self.model = replica if replica is not None else inner.model  # the loop's full model on rank 0
        self._replica = replica
        self.optimizer = _Optimizer(inner)

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        _send("logprobs", batch)
        return self.inner.logprobs(batch)

    def step(self, batch: TrainBatch, loss_fn: LossFn, minibatches: int = 1,
             generator: torch.Generator | None = None) -> dict[str, float]:
        """`loss_fn` runs here; the followers apply the spec's (`follow`), which is the loop's by construction."""
        _send("step", (batch, minibatches, None if generator is None else generator.get_state()))
        metrics = self.inner.step(batch, loss_fn, minibatches, generator)
        if self._replica is not None:  # fsdp: the loop's model gets the new full weights
            _send("gather")
            load_full_state(self._replica, self.inner.full_state_dict())
        return metrics

    def gathered_model(self) -> PreTrainedModel:
        _send("gather")
        model = self.inner.gathered_model()
        assert model is not None  # rank 0
        return model



def follow(spec: ExperimentSpec, model: PreTrainedModel) -> int:
    """A follower rank's loop: apply the leader's calls until it says stop; returns the steps applied."""
    trainer = distributed_trainer(spec, model)
    # the leader's loss (core/loop.py): the same off-policy default, or the dual clip would bind on one rank only
    loss_fn = make_loss(spec.algorithm, off_policy=spec.resolved.off_policy(rank_device(spec.trainer.devices).type))
    steps = 0
    while True:
        op, payload = _receive()
        if op == "step":
            fault_point("follower_step")  # a chaos test's rank kill (infra/faults.py)
            batch, minibatches, state = payload
            generator = None
            if state is not None:
                generator = torch.Generator()
                generator.set_state(state)
            trainer.step(batch, loss_fn, minibatches, generator)
            steps += 1
        elif op == "logprobs":
            trainer.logprobs(payload)
        elif op == "gather":
            trainer.gathered_model()
        elif op == "optimizer_state":
            trainer.optimizer_state()
        elif op == "load_optimizer":
            trainer.load_optimizer_state(payload)
        elif op == "stop":
            return steps
        elif op == "abort":
            raise LeaderFailed(f"rank 0 failed: {payload}")
        else:
            raise RuntimeError(f"follower got an unknown call {op!r} from rank 0")


@contextlib.contextmanager
def leading() -> Iterator[None]:
    """Rank 0's work goes inside: at the end the followers are told to stop, or (on an error) to abort. An error
    raised inside a collective leaves the followers in it; the process group's timeout, or torchrun tearing the
    ranks down when rank 0 exits non-zero, ends them."""
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):
            _send("abort", f"{type(e).__name__}: {e}")
        raise
    else:
        _send("stop")


def main(argv: list[str] | None = None) -> int:
    """Rank entry point: rank 0 runs `--leader module:function` with the spec inside `leading()`; others follow."""
    ap = argparse.ArgumentParser(prog="python -m factory.core.trainer.ranks")
    ap.add_argument("--spec", required=True, help="experiment spec (YAML) with trainer.world_size = the rank count")
    ap.add_argument("--leader", required=True, help="module:function run on rank 0 with the spec")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="longest any collective waits, the follower's wait for the next call included "
                         "(default: 2 x schedule.wait_timeout_s + 60)")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec)
    module, _, name = args.leader.partition(":")
    if not name:
        raise SystemExit(f"--leader: expected module:function, got {args.leader!r}")
    timeout = args.timeout_s or 2 * spec.schedule.wait_timeout_s + 60
    rank, world = init_ranks(threads=spec.trainer.threads, timeout_s=timeout)
    if world != spec.trainer.world_size:
        raise SystemExit(f"trainer.world_size is {spec.trainer.world_size} but {world} ranks were started")
    try:
        if rank == 0:
            fn = getattr(importlib.import_module(module), name)
            with leading():
                fn(spec)
        else:
            follow(spec, policy_for(spec)[0])
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
