"""`Resolved`: the settings one section's default takes from other sections, worked out once when a spec validates.

A component below the run reads these from `spec.resolved` (or is handed the value) instead of reading the sections
again where it is used:
- `device` (and `device_field`, the field that named it): the run's device setting after `trainer.devices` placed a
  one-process trainer (cuda:N); the machine check (is there such a GPU) is `infra/device.resolve_device`'s, when the
  run starts, since a spec is validated on machines it does not run on (a Dagster webserver, a laptop).
- `cuda_asked`: the settings that name CUDA whatever the machine, as (field, value) (empty: the spec runs on a CPU
  machine too): `device` cuda[:N], `trainer.devices`, `trainer.backend` megatron (it refuses a CPU device),
  `rollout.devices`. SGLang servers are not among them: `rollout.sglang.python` starts them, which may be a CPU
  build or a stand-in; GPUs placed for them (`rollout.devices`) are.
- `precision`: what the trainer computes in and the in-process engine and the rollout server decode in (one setting,
  `trainer.precision`; the serving dtype follows it on a GPU).
- `numerics_differ`: whether the rollout engine computes the policy otherwise than the trainer wherever the run lands
  (bf16 autocast, weights rounded by `rollout.round_weights`, or a server / SGLang engine outside sync mode);
  `engine_differs(device)` adds the device (any GPU differs). It decides the recompute default
  (`algorithm.recomputes`) and the log-prob gap bound (`logprob_gap_bound`).
- `buffer`, `buffer_depth`, `concurrency`: the rollout buffer an overlapped run builds (`buffer` in async mode; in
  one_step_off a `bound` buffer one version deep), its depth in prompt groups (`depth`, else max(max_staleness, 1) x
  `rollout.prompts_per_step`) and the producer threads, i.e. groups in flight (`rollout.concurrency`, else the
  depth). Sync mode builds no buffer: the figures are what one_step_off would.
- `blend`: GRPO's prompt blend as the run draws it (`Blend`): the `data` section, or without one the task's
  training split alone (one source named after the task); its seed `data.seed`, else the spec's `seed`. What the
  blend's modules (factory/data/) are handed instead of the spec.

None of it is a field: the spec's dump and fingerprint are what they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from factory.config.buffer import BufferSpec

if TYPE_CHECKING:
    from factory.config.data import DataSpec
    from factory.config.experiment import ExperimentSpec
    from factory.config.task import TaskSpec


@dataclass(frozen=True)
class Blend:
    """GRPO's prompt blend: `data` (None: the task's training split alone, one source named `task.name`), drawn
    with `seed`."""

    data: DataSpec | None
    task: TaskSpec
    seed: int

    def schedule(self) -> dict[int, dict[str, float]]:
        """step -> {source: weight}; one source with weight 1 without a `data` section."""
        return {0: {self.task.name: 1.0}} if self.data is None else self.data.blend_weights()


@dataclass(frozen=True)
class Resolved:
    """The cross-section defaults of one spec (see the module docstring)."""

    device: str
    device_field: str
    cuda_asked: tuple[tuple[str, str], ...]
    precision: Literal["fp32", "bf16"]
    numerics_differ: bool
    gap_bound_same: float  # ops.max_logprob_gap, or its default where the engine computes as the trainer does
    gap_bound_other: float  # ... and where it does not
    buffer: BufferSpec
    buffer_depth: int
    concurrency: int
    blend: Blend
    overlapped: bool = False  # schedule.mode one_step_off or async: rows may be a version stale

    def engine_differs(self, device_type: str) -> bool:
        """Whether the engine computes otherwise than the trainer on a device of `device_type` ('cpu', 'cuda'):
        on a GPU always (bf16 serving weights, graph-captured paged kernels), on the CPU when `numerics_differ`."""
        return device_type != "cpu" or self.numerics_differ

    def off_policy(self, device_type: str) -> bool:
        """Whether staleness or a sampler/trainer gap can occur (the dual clip's default is on then): every rank's
        loss must agree on it, so it is worked out here, not at each call of `make_loss`."""
        return self.overlapped or self.engine_differs(device_type)

    def logprob_gap_bound(self, device_type: str) -> float:
        """The bound on the mean |engine - trainer log-prob| on a device of `device_type` (`ops.max_logprob_gap`)."""
        return self.gap_bound_other if self.engine_differs(device_type) else self.gap_bound_same


def resolve(spec: ExperimentSpec) -> Resolved:
    """`spec`'s cross-section defaults; a ValueError naming the field where two sections contradict each other."""
    device, field = spec.device, "device"
    placed = spec.trainer.devices
    if spec.trainer.world_size == 1 and placed:
        device, field = f"cuda:{placed[0]}", "trainer.devices"
        if spec.device not in ("auto", "cuda", device):
            raise ValueError(f"trainer.devices: {placed} places the one trainer process on {device}, but device is "
                             f"{spec.device!r}; drop one of them")
    r, t, precision = spec.rollout, spec.trainer, spec.trainer.precision
    cuda = [("device", spec.device)] if spec.device.startswith("cuda") else []
    cuda += [("trainer.devices", str(t.devices))] if t.devices else []
    cuda += [("trainer.backend", "megatron")] if t.backend == "megatron" else []
    cuda += [("rollout.devices", str(r.devices))] if r.devices else []
    # In-process on the CPU in fp32 the engine runs the trainer's own forward: their log-probs agree to float noise.
    # bf16 autocast rounds the engine's cached one-token decode and the trainer's full forward differently (3e-4
    # measured on the CPU); a server or SGLang is another process and engine.
    differ = (r.round_weights is not None or precision != "fp32"
              or (spec.schedule.mode != "sync" and r.engine in ("server", "sglang")))
    buffer = spec.buffer if spec.schedule.mode == "async" else BufferSpec(policy="bound", max_staleness=1)
    depth = buffer.depth if buffer.depth is not None else max(buffer.max_staleness, 1) * r.prompts_per_step
    return Resolved(device=device, device_field=field, cuda_asked=tuple(cuda), precision=precision,
                    numerics_differ=differ, gap_bound_same=spec.ops.logprob_gap_bound(False),
                    gap_bound_other=spec.ops.logprob_gap_bound(True), buffer=buffer, buffer_depth=depth,
                    concurrency=r.concurrency or depth, overlapped=spec.schedule.mode != "sync",
                    blend=Blend(spec.data, spec.task,
                                spec.seed if spec.data is None or spec.data.seed is None else spec.data.seed))
