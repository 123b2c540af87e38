"""`rollout.round_weights`: the in-process engine samples from the trainer's weights rounded to bf16 or fp16.

A GPU engine that serves in bf16 samples from a slightly different policy than the fp32 trainer that learns from
its tokens; this reproduces that gap on any machine. Each floating-point tensor's values are rounded to the named
dtype (round to nearest even, as a cast does) and kept in their own dtype, so the engine still computes in fp32:
the perturbation is the weights' rounding alone, not a lower-precision forward. The producers apply it to the
copy their engine samples from, at its start and at every publish (`core/producers/`); the trainer's weights
are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

ROUND_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def round_dtype(setting: str | None) -> torch.dtype | None:
    """The torch dtype of a `rollout.round_weights` setting (None: unset, no rounding)."""
    if setting is None:
        return None
    try:
        return ROUND_DTYPES[setting]
    except KeyError:
        raise ValueError(f"rollout.round_weights: expected one of {sorted(ROUND_DTYPES)}, got {setting!r}") from None


def rounded(state: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Fresh tensors: each floating-point entry of `state` rounded to `dtype`, in its own dtype and device (other
    entries as they are). The caller may change `state`'s tensors as soon as this returns."""
    with torch.no_grad():
        return {k: v.detach().to(dtype).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}


def round_model_(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Round the floating-point entries of `model`'s state dict (its parameters and persistent buffers: what a
    publish carries) to `dtype` in place, tied tensors once; returns the model."""
    with torch.no_grad():
        seen: set[int] = set()
        for t in model.state_dict(keep_vars=True).values():
            if t.is_floating_point() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                t.copy_(t.to(dtype))
    return model
