"""The paged engine's weights in the serving dtype: which dtype, and how a model in another dtype gets there.

`serving_dtype`: bf16 for `precision="bf16"` on CUDA, the model's own dtype otherwise (so the CPU stays fp32, and a
model handed over in bf16 runs in bf16 anywhere). The weights are held in that dtype, not cast per forward under
autocast: a bf16 decode step reads 2 bytes a weight, and no fp32 copy is re-cast every step.

The engine never changes the dtype of a model it is given, because the caller may share it: `SyncProducer`'s engine
samples from the trainer's own fp32 model, which an in-place cast would turn into bf16 master weights. So when the
parameters are not in the serving dtype the engine runs `serving_copy(model)` (parameters cast, buffers as they
are: the rotary `inv_freq` stays fp32, as transformers keeps it in a bf16 model) and keeps the caller's model as
its source: setting `weight_version` (what a caller sharing the trainer's model does after a step) copies the
source's parameters into the copy in place (`copy_weights`). A caller that owns its model (a checkpoint loaded to
serve, the producer's `lora.merged_copy`) casts it first with `cast_parameters`, and no fp32 copy is kept.

Weight updates copy in place too (`load_state_dict` converts dtype in `copy_`): parameter tensors keep their
storage for the engine's life, which captured CUDA graphs rely on.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16")


def serving_dtype(device: torch.device, precision: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine holds its weights and K/V in: bf16 for `precision` bf16 on CUDA, else `model_dtype`."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    return torch.bfloat16 if precision == "bf16" and device.type == "cuda" else model_dtype


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (transformers' `model.dtype`)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def in_dtype(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether every floating-point parameter of `model` is `dtype`."""
    return all(p.dtype == dtype for p in model.parameters() if p.is_floating_point())


def serving_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` on its device whose floating-point parameters are `dtype` (fresh tensors, tied ones still
    tied, no gradients) and whose buffers are copies as they are; `model` is left untouched."""
    memo: dict[int, object] = {}
    for p in model.parameters():  # each shared (tied) parameter once
        data = p.detach().to(dtype, copy=True) if p.is_floating_point() else p.detach().clone()
        memo[id(p)] = nn.Parameter(data, requires_grad=False)
    return copy.deepcopy(model, memo)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast `model`'s floating-point parameters to `dtype` in place (the Parameter objects stay, buffers are left
    as they are), for a caller that owns the model it serves; returns `model`."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


@torch.no_grad()
def copy_weights(dst: nn.Module, src: nn.Module) -> None:
    """Copy `src`'s parameters into `dst`'s of the same names in place (converting dtype): `dst`'s tensors keep
    their identity and storage."""
    theirs = dict(src.named_parameters())
    mine = dict(dst.named_parameters())
    if mine.keys() != theirs.keys():
        raise ValueError(f"the serving copy's parameters differ from its source's: "
                         f"{sorted(mine.keys() ^ theirs.keys())[:5]}")
    for name, p in mine.items():
        p.copy_(theirs[name])
