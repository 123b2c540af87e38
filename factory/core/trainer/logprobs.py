"""Target-token log-probs and the policy entropy over a real vocabulary, without [tokens, vocab] float32 tensors
kept alive through backward.

The plain computation (full logits, their float32 log-softmax over the vocabulary, its exp for the entropy) keeps
several [B, T, V] float32 tensors until backward: 2.5 GB each for a 151,936-token vocabulary at 4 x 1024 tokens.
Here the target positions are cut into chunks of at most `chunk_elements` logits (rows x vocabulary) and each chunk
runs under `torch.utils.checkpoint` (non-reentrant): its forward keeps only its input rows and its [rows]
log-probs, and backward recomputes the chunk's logits and softmax one chunk at a time (a batch that fits in one
chunk is computed directly: its logits are within the budget anyway). The arithmetic of every row
is the old one (logits in the model's dtype, `.float() / temperature`, `log_softmax`, gather). A batch that fits in
one chunk (every preset's: the quickstart) is the old computation op for op, so its numbers are bit-identical on
the CPU; split into chunks, the head's matmul and its weight gradient reassociate float sums.

Where the architecture's head is known (`PLAIN_HEADS`: the causal-LM forward is `lm_head(decoder(...))`, with
Gemma 2/3's final logit softcapping), the chunks start from the decoder's hidden states and apply the head per
chunk, so the full [B, T, V] logits never exist either. Tied embeddings and peft LoRA layers need nothing special:
the head is called as the module it is. Any other model (another architecture, a DDP or FSDP wrapper, whose forward
must go through the wrapper) is run whole and its logits are chunked.

`fused=True` (`trainer.fused_head`; on where the trainer computes on CUDA) takes a plain head (an `nn.Linear`, no
softcapping) as one fused op from the hidden states (`fused_head.py`): the same chunks, no checkpoint, no float32
[rows, vocab] tensor kept, and the chunks' logits kept in the model's dtype for backward where they fit
`keep_budget` (then the head's matmul runs 3 times a step, not 4). Anything else (LoRA on the head, softcapping,
a wrapper) takes the chunked path. On the CPU it is off at "auto", so the numbers there do not move.

The entropy is a metric: no algorithm takes its gradient (core/algorithms.py), so it is computed without a graph
and returned detached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from factory.core.batch import TrainBatch
from factory.core.trainer.fused_head import compute_dtype, fused_logprobs

# Causal-LM classes whose forward is `logits = lm_head(base_model(...).last_hidden_state)`, then Gemma's optional
# final softcapping (`config.final_logit_softcapping`), and nothing else (no logit scale, as Cohere or Granite have).
# Checked against transformers 5.x modeling code; FSDP2's `FSDP<Class>` and DDP's wrapper are not in it on purpose.
PLAIN_HEADS = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel",
    "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM", "Starcoder2ForCausalLM",
})
# Logits per chunk (rows x vocabulary): 64 Mi float32 values, 256 MB; 441 token rows at a 151,936 vocabulary.
CHUNK_ELEMENTS = 1 << 26
# The fused head keeps its logits for backward up to 1 / KEEP_FRACTION of a GPU's memory (`keep_budget`).
KEEP_FRACTION = 16


def token_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0, with_entropy: bool = False,
                   chunk_elements: int = CHUNK_ELEMENTS, position_ids: Tensor | None = None,
                   fused: bool = False, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target token [B, T-1] (and the policy entropy there, detached) under `model`.

    `position_ids` [B, T]: packed rows (trainer/packing.py): the forward gets them with `attention_mask`, the plan's
    prebuilt 4-D document mask (transformers passes it through unread), or None (transformers builds the document
    mask from the position ids); `batch.attention_mask` is then not used. `fused`
    (trainer.fused_head): a plain head (an `nn.Linear`, no softcapping) runs as one fused op (`fused_head.py`)."""
    targets = batch.input_ids[:, 1:]
    inputs = ({"attention_mask": batch.attention_mask} if position_ids is None
              else {"attention_mask": attention_mask, "position_ids": position_ids})
    head = _plain_head(model)
    if head is None:
        logits = model(input_ids=batch.input_ids, **inputs, use_cache=False).logits
        return chunked_logprobs(logits, targets, _identity, temperature, with_entropy, chunk_elements,
                                vocab=logits.shape[-1], drop_last=True)
    decoder, lm_head, softcap = head
    hidden = decoder(input_ids=batch.input_ids, **inputs, use_cache=False)
    if fused and softcap is None and type(lm_head) is torch.nn.Linear:
        return fused_head_logprobs(hidden.last_hidden_state, lm_head, targets, temperature, with_entropy,
                                   chunk_elements)
    to_logits = functools.partial(_head_logits, lm_head, softcap)
    return chunked_logprobs(hidden.last_hidden_state, targets, to_logits, temperature, with_entropy, chunk_elements,
                            vocab=_vocab_size(lm_head, model), drop_last=True)


def logprobs_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                         chunk_elements: int = CHUNK_ELEMENTS) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` for logits a model already returned ([B, T, V], aligned with `targets` [B, T])."""
    return chunked_logprobs(logits, targets, _identity, temperature, with_entropy, chunk_elements,
                            vocab=logits.shape[-1])


def fused_head_logprobs(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, temperature: float,
                        with_entropy: bool, chunk_elements: int) -> tuple[Tensor, Tensor | None]:
    """`chunked_logprobs` of `head(hidden)` [B, T+1, H] (the last position predicts nothing) as the fused op: the
    same chunks of at most `chunk_elements` logits; the logits kept for backward where they fit `keep_budget`."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements: expected >= 1, got {chunk_elements}")
    b, t = targets.shape
    vocab = head.out_features
    rows = hidden[:, :-1].reshape(b * t, hidden.shape[-1])  # a copy of [N, H]: small beside any [N, V]
    itemsize = torch.finfo(compute_dtype(rows, head.weight)).bits // 8
    keep = b * t * vocab * itemsize <= keep_budget(hidden.device)
    logp, entropy = fused_logprobs(rows, head.weight, head.bias, targets.reshape(-1), temperature,
                                   max(1, chunk_elements // max(vocab, 1)), keep, with_entropy)
    return logp.view(b, t), (entropy.view(b, t) if with_entropy else None)


def keep_budget(device: torch.device) -> int:
    """Bytes of logits the fused head may keep for backward instead of recomputing them: a sixteenth of a GPU's
    memory (8.8 GB on an H200: a 16k-token step of a 151,936 vocabulary in bf16 keeps its 5 GB), one chunk's worth
    (256 MB) elsewhere, as `chunked_logprobs` keeps a batch that fits one chunk."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // KEEP_FRACTION
    return CHUNK_ELEMENTS * 4


def chunked_logprobs(rows: Tensor, targets: Tensor, to_logits: Callable[[Tensor], Tensor], temperature: float,
                     with_entropy: bool, chunk_elements: int, vocab: int,
                     drop_last: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `targets` [B, T] under `to_logits(rows[...])` (logits over `vocab`), chunk by chunk: whole
    sequences per chunk when they fit, else pieces of one sequence (views, never copies of `rows`). With a graph,
    each chunk is checkpointed so backward recomputes its logits instead of keeping them.

    `drop_last`: `rows` has one more position than `targets` (the last, which predicts nothing). Whole-sequence
    chunks then take the head over all positions and drop the last logits, as the causal-LM forward followed by
    `[:, :-1]` does: one chunk is then the previous computation op for op, bit for bit on the CPU."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements: expected >= 1, got {chunk_elements}")
    b, t = targets.shape
    per_chunk = max(1, chunk_elements // max(vocab, 1))  # token rows
    span = t + drop_last  # positions of `rows` per sequence
    whole = functools.partial(_chunk, to_logits, temperature, with_entropy, drop_last)
    piece = functools.partial(_chunk, to_logits, temperature, with_entropy, False)
    # One chunk for the whole batch (every preset's): its logits fit the budget, so they may as well stay for
    # backward; the recompute would only cost time.
    graph = torch.is_grad_enabled() and b * span > per_chunk

    def run(fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return checkpoint(fn, x, y, use_reentrant=False) if graph else fn(x, y)

    if b == 0:
        empty = rows.new_zeros(0, t, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    if per_chunk >= span:
        seqs = max(1, per_chunk // max(span, 1))
        parts = [run(whole, rows[i:i + seqs], targets[i:i + seqs]) for i in range(0, b, seqs)]
        logp, entropy = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        pieces = [[run(piece, rows[i, t0:min(t0 + per_chunk, t)], targets[i, t0:t0 + per_chunk])
                   for t0 in range(0, t, per_chunk)] for i in range(b)]
        logp = torch.stack([torch.cat([p[0] for p in row]) for row in pieces])
        entropy = torch.stack([torch.cat([p[1] for p in row]) for row in pieces])
    return logp, (entropy if with_entropy else None)


def _chunk(to_logits: Callable[[Tensor], Tensor], temperature: float, with_entropy: bool, drop_last: bool, x: Tensor,
           targets: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk: the target log-probs [..., n] (with a graph) and the entropy there (without; zeros when not
    asked, so the chunks' outputs always stack)."""
    logits = to_logits(x)
    if drop_last:
        logits = logits[..., :-1, :]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # After the gather, so a recompute in backward stops before it (checkpoint's early stop): all it needs is saved.
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else torch.zeros_like(logp)
    return logp, entropy


def _identity(x: Tensor) -> Tensor:
    return x


def _head_logits(lm_head: torch.nn.Module, softcap: float | None, hidden: Tensor) -> Tensor:
    """What the causal-LM forward does after the decoder (Gemma2ForCausalLM's softcapping, op for op)."""
    logits = lm_head(hidden)
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    return logits


def _plain_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, float | None] | None:
    """(decoder, head, softcap) of a model in `PLAIN_HEADS`, or None: then the model is run whole."""
    if type(model).__name__ not in PLAIN_HEADS:
        return None
    decoder = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or decoder is model or not isinstance(head, torch.nn.Module):
        return None
    return decoder, head, getattr(model.config, "final_logit_softcapping", None)


def _vocab_size(head: torch.nn.Module, model: torch.nn.Module) -> int:
    """The head's output width (peft's LoRA layer wraps the Linear as `base_layer`), for the chunk size."""
    for module in (head, getattr(head, "base_layer", None)):
        features = getattr(module, "out_features", None)
        if isinstance(features, int):
            return features
    return int(model.config.vocab_size)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them (non-reentrant
    `torch.utils.checkpoint`, so frozen inputs and LoRA need no special handling); a ValueError naming
    `trainer.activation_checkpointing` where the model cannot."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"trainer.activation_checkpointing: {type(model).__name__} does not support activation "
                         f"checkpointing (transformers' supports_gradient_checkpointing is False); set it to false")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
