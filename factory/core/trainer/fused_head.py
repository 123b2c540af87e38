"""The vocabulary head fused with the target log-prob and the entropy: one autograd op from hidden states to
log-probs, chunk by chunk over tokens, that never keeps a float32 [tokens, vocabulary] tensor for backward.

`fused_logprobs(hidden [N, H], weight [V, H], bias, targets [N], ...)` returns the target log-probs [N] (float32,
with a graph) and the entropy [N] (float32, detached: a metric). Per chunk of tokens the forward takes the head's
matmul in the compute dtype (the model's, or autocast's: as `nn.Linear` under autocast would), then log-softmax in
float32. It keeps for backward the hidden states, the weight, the targets and the per-token logsumexp; with
`keep_logits` also each chunk's logits in the compute dtype, so backward need not run the head's matmul again.
Backward, per chunk: grad_logits = g / T * (onehot - softmax), then grad_hidden = grad_logits @ W and grad_weight +=
grad_logits^T @ hidden, summed over chunks in float32 (on CUDA with addmm's float32 `out_dtype`, no temporary).

Against `logprobs.chunked_logprobs` under `torch.utils.checkpoint` (forward, recompute, backward): the head's matmul
runs 3 times per step instead of 4 with `keep_logits`, and as often without; the float32 work per chunk is one buffer
(no log-softmax graph, no float32 gradient of the logits besides it); under autocast the weight is cast once per pass,
not once per chunk; and nothing reads a value on the host (no sync). liger-kernel's fused linear cross-entropy was
weighed against this (docs/hardware.md): no entropy, no temperature, a `.item()` per call, CUDA + Triton only.

Tied embeddings need nothing: the weight's gradient is returned for the tensor passed, which autograd adds to the
embedding's. A frozen head gets no gradient computed; without a graph (`torch.no_grad`, or nothing requiring grad)
the forward runs alone and keeps nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812

# Devices whose addmm can take low-precision operands into a float32 `out` (torch >= 2.8, CUDA only): the weight
# gradient is then accumulated in float32 without a [V, H] temporary per chunk.
_OUT_DTYPE_DEVICES = frozenset({"cuda"})


def fused_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float = 1.0,
                   chunk_rows: int = 1024, keep_logits: bool = False,
                   with_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` [N] under `softmax((hidden @ weight.T + bias) / temperature)` and the entropy there
    ([N] float32 each; zeros for the entropy when not asked). `chunk_rows` tokens per chunk; `keep_logits` keeps
    the chunks' logits (compute dtype) for backward instead of recomputing them."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_logprobs: expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"fused_logprobs: expected targets [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"fused_logprobs: chunk_rows: expected >= 1, got {chunk_rows}")
    dtype = compute_dtype(hidden, weight)
    graph = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not graph:
        with _no_autocast(hidden):
            logp, entropy, _, _ = _forward(hidden, weight, bias, targets, temperature, chunk_rows, False,
                                           with_entropy, dtype)
        return logp, entropy
    return _FusedHead.apply(hidden, weight, bias, targets, temperature, chunk_rows, keep_logits, with_entropy, dtype)


class _FusedHead(torch.autograd.Function):
    """The head, log-softmax, gather and entropy as one op (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # noqa: ANN001
                temperature: float, chunk_rows: int, keep_logits: bool, with_entropy: bool,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        with _no_autocast(hidden):
            logp, entropy, lse, kept = _forward(hidden, weight, bias, targets, temperature, chunk_rows, keep_logits,
                                                with_entropy, dtype)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, *kept)
        ctx.temperature, ctx.chunk_rows, ctx.dtype = temperature, chunk_rows, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor | None):  # noqa: ANN001, ANN205
        hidden, weight, bias, targets, lse, *kept = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        t, rows, dtype = ctx.temperature, ctx.chunk_rows, ctx.dtype
        w = weight.to(dtype)  # autocast's cast of the head weight, once for the whole backward
        b = None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        g = grad_logp.float()
        with _no_autocast(hidden):
            for i, s in enumerate(range(0, hidden.shape[0], rows)):
                e = min(s + rows, hidden.shape[0])
                h = hidden[s:e].to(dtype)
                logits = kept[i] if kept else F.linear(h, w, b)
                # softmax from the saved logsumexp, then -g * softmax + g at the target, then / T: one float32 buffer.
                grad = logits.to(torch.float32, copy=True).div_(t).sub_(lse[s:e, None]).exp_().mul_(-g[s:e, None])
                del logits  # before the next [rows, V] buffer: a recomputed chunk's logits are spent
                grad.scatter_add_(1, targets[s:e, None], g[s:e, None]).div_(t)
                grad = grad.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[s:e] = grad @ w
                if grad_weight is not None:
                    _accumulate_mm(grad_weight, grad.t(), h)
                if grad_bias is not None:
                    grad_bias += grad.float().sum(0)
        return (grad_hidden,
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                None, None, None, None, None, None)


def _forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
             chunk_rows: int, keep_logits: bool, with_entropy: bool,
             dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(logp [N], entropy [N], logsumexp [N], the chunks' logits if kept), all float32 but the logits."""
    n = hidden.shape[0]
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.zeros_like(logp)
    kept: list[Tensor] = []
    for s in range(0, n, chunk_rows):
        e = min(s + chunk_rows, n)
        logits = F.linear(hidden[s:e].to(dtype), w, b)
        if keep_logits:
            kept.append(logits)
        scaled = logits.to(torch.float32, copy=True).div_(temperature)  # a copy even in float32: kept logits stay
        del logits
        lse[s:e] = torch.logsumexp(scaled, dim=-1)
        logp[s:e] = scaled.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
        if with_entropy:
            logp_all = scaled.sub_(lse[s:e, None])
            entropy[s:e] = -logp_all.exp().mul_(logp_all).sum(-1)
    return logp, entropy, lse, kept


def _accumulate_mm(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out (float32) += a @ b, with a and b in the compute dtype."""
    if a.dtype == out.dtype:
        torch.addmm(out, a, b, out=out)
    elif out.device.type in _OUT_DTYPE_DEVICES:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out += (a @ b).float()


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype `nn.Linear(hidden)` would compute in here: autocast's where it is on, else the weight's."""
    device = hidden.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _no_autocast(hidden: Tensor) -> torch.autocast:
    """Autocast off for the op's own arithmetic: every cast in it is explicit (`compute_dtype`)."""
    device = hidden.device.type if hidden.device.type in ("cpu", "cuda") else "cpu"
    return torch.autocast(device, enabled=False)
