"""The optimizer step without host syncs: AdamW (fused or not), the non-finite rule (`guarded_step`, which every
trainer backend applies), and metrics read back to the host once per trainer step.

The rule: a minibatch whose loss or gradient norm is NaN/inf is not applied. Its gradients are dropped and the
optimizer is not stepped, so the parameters and the optimizer state stay exactly as they were (one bad batch would
otherwise poison AdamW's moments for good); the trainer reports the share skipped as `nonfinite` and the loop
decides when too many in a row stop a run. `guarded_step` is that rule, for the torch trainer, the data-parallel
one (on values all-reduced first, so every rank decides alike) and Megatron's.

A trainer step used to read the device several times per minibatch (`loss.item()`, `float(grad_norm)`, the
`bool(isfinite(...))` that decides whether to step): each read stalls the host until the device has caught up, so
the next minibatch's kernels are not queued while this one runs. With `trainer.fused_optimizer` on, the decision
stays on the device instead: the fused AdamW kernels take a `found_inf` tensor (the protocol `torch.amp.GradScaler`
uses, `optimizer.found_inf` set around `step()`), skip every parameter and moment when it is 1.0, and take the
step count back, so a skipped minibatch leaves the parameters and the AdamW state exactly as they were, as the
host-side skip does. The metrics and the applied flags stay 0-dim device tensors until `host_floats` reads them
all in one transfer per device, after the last optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

Metric = Tensor | float  # a loss function's metric: a Python number or a 0-dim (one-element) tensor


def make_adamw(params: Iterable[Tensor], lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """The trainers' AdamW (betas 0.9, 0.99); `fused` selects the fused kernels (CUDA and CPU), which take the
    on-device skip (`step_unless`). A resume point's optimizer state (`load_state_dict`) keeps this choice: torch
    would otherwise take `fused` / `foreach` from the saved param groups."""
    opt = torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99),
                            fused=True if fused else None)
    opt.register_load_state_dict_post_hook(_keep_kernels(fused))
    return opt


def _keep_kernels(fused: bool):
    def hook(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            group["fused"], group["foreach"] = (True, None) if fused else (None, group.get("foreach"))
            group["capturable"] = False
            for p in group["params"]:
                state = opt.state.get(p, {})
                step = state.get("step")
                if isinstance(step, Tensor):
                    # fused: a float32 count on the parameter's device; otherwise a CPU float32 count (exact either
                    # way: a step count is an integer far below 2**24)
                    state["step"] = step.to(dtype=torch.float32, device=p.device if fused else "cpu")
    return hook


def nonfinite(loss: Tensor, grad_norm: Tensor) -> Tensor:
    """1.0 where the loss or the gradient norm is NaN/inf, else 0.0: a float32 0-dim tensor on the loss's device
    (the dtype the fused kernels read `found_inf` in)."""
    bad = ~torch.isfinite(loss.detach()).all() | ~torch.isfinite(grad_norm.detach().to(loss.device))
    return bad.to(torch.float32)


def guarded_step(optimizer: torch.optim.Optimizer, loss: Tensor, grad_norm: Tensor, *,
                 on_device: bool) -> bool | Tensor:
    """Step `optimizer` unless `loss` or `grad_norm` is non-finite (the rule above); returns whether the update was
    applied: a bool, or with `on_device` a float32 0-dim device tensor (1.0 applied, 0.0 skipped).

    `on_device` (fused AdamW only): the decision stays on the device (`step_unless`), no host sync, and the
    gradients are dropped either way. Otherwise it is read on the host (one sync) and a skipped minibatch's
    gradients are dropped. Data-parallel ranks pass values all-reduced over the group, so they all decide alike."""
    bad = nonfinite(loss, grad_norm)
    if on_device:
        step_unless(optimizer, bad)
        optimizer.zero_grad(set_to_none=True)
        return 1.0 - bad
    if bool(bad):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    return True


def step_unless(optimizer: torch.optim.Optimizer, found_inf: Tensor) -> None:
    """`optimizer.step()`, which the device skips when `found_inf` is 1.0 (no host sync: GradScaler's protocol).
    Only fused Adam/AdamW read it (a deep copy of the optimizer drops `_step_supports_amp_scaling`, so the groups'
    `fused` flag is what is checked)."""
    if not all(group.get("fused") for group in optimizer.param_groups):
        raise ValueError(f"step_unless: {type(optimizer).__name__} without fused kernels cannot skip on the device")
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def float64(value: Metric, device: torch.device) -> Tensor:
    """A metric as a float64 0-dim tensor on `device`, exactly (no host read of a device tensor)."""
    if isinstance(value, Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def host_floats(values: Sequence[Metric | bool], names: Sequence[str] | None = None) -> list[float]:
    """`values` as Python floats, reading all the tensors of one device in a single transfer (the one host sync).

    A tensor's float is exactly its `.item()` (widened to float64 on the device, which is exact for every float and
    integer dtype). `names` label a value that is not a number (a tensor with several elements) in the error."""
    out: list[float] = [0.0] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, Tensor):
            if v.numel() != 1:
                name = names[i] if names is not None else str(i)
                raise ValueError(f"metric {name!r}: expected a number or a 0-dim tensor, got shape {tuple(v.shape)}")
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = float(v)
    for idx in by_device.values():
        read = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in idx]).tolist()
        for i, x in zip(idx, read, strict=True):
            out[i] = x
    return out
