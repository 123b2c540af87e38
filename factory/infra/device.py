"""The compute device of a run, chosen once from the spec's `device` setting, and the few device habits every
component shares (TF32 on GPUs, bf16 autocast over fp32 master weights, pinned host copies).

`device: auto` (the default) is the current CUDA device where torch sees one and the CPU otherwise, so a shipped
spec runs on a GPU when there is one and on the CPU as before. `cpu`, `cuda` and `cuda:N` pick explicitly; asking
for CUDA where there is none, or for an index the machine does not have, is a ValueError naming the field.

At `trainer.world_size` 1, `trainer.devices: [N]` places the one trainer process: it is the run's device
(cuda:N), and a `device` that says otherwise is refused when the spec validates (both are worked out once there,
`spec.resolved`, factory/config/resolved.py; what this machine has is checked here, when the run starts). Ranks of
a multi-process trainer are placed by `trainer.devices` / LOCAL_RANK in `core/trainer/distributed.py`.

Every component takes the resolved `torch.device` from its caller: nothing below the run decides for itself.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from factory.config.resolved import Resolved


def resolve_device(setting: str = "auto", field: str = "device") -> torch.device:
    """The torch device `setting` names (auto, cpu, cuda, cuda:N), checked against this machine."""
    if setting == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(setting)
    except RuntimeError as e:
        raise ValueError(f"{field}: expected auto, cpu, cuda or cuda:N, got {setting!r}") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{field}: expected auto, cpu, cuda or cuda:N, got {setting!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}: {setting!r} asks for CUDA, but torch sees no CUDA device here (torch "
                         f"{torch.__version__}, built for CUDA {torch.version.cuda}); use device: auto or cpu")
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{field}: {setting!r} names GPU {index}, but this machine shows {count} "
                         f"(cuda:0..cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
    return torch.device("cuda", index)


def run_device(resolved: Resolved) -> torch.device:
    """The device a run computes on, on this machine: `spec.resolved.device` (`device`, or cuda:N where a
    one-process trainer is placed by `trainer.devices: [N]`; config/resolved.py refused a contradiction)."""
    return resolve_device(resolved.device, field=resolved.device_field)


def prepare(device: torch.device) -> None:
    """Make `device` current and let float32 matmuls use TF32 tensor cores there (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: torch.device, precision: str = "fp32") -> contextlib.AbstractContextManager:
    """bf16 autocast over fp32 master weights when `precision` is bf16; otherwise nothing changes."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def describe(device: torch.device) -> str:
    """One line for logs and the run's record: the device and what it is (GPU name, or CPU threads)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: the device of its first parameter (the CPU for a model without any). The run placed
    it there; components follow it."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A private CPU copy of `tensor` the caller may keep while the original changes: a clone on the CPU, a fresh
    pinned buffer from a GPU (`to_host`)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else to_host(tensor)


def to_host(tensor: torch.Tensor, pinned: bool = True) -> torch.Tensor:
    """A CPU copy of `tensor`: through a pinned buffer when it lives on a GPU (faster, and the copy can overlap),
    the tensor itself when it is already on the CPU (callers that keep it must clone)."""
    if tensor.device.type == "cpu":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
    out.copy_(tensor, non_blocking=pinned)
    if pinned:
        torch.cuda.current_stream(tensor.device).synchronize()
    return out
