"""Packed rows for the trainer's forward (`trainer.packing`): real tokens only, so no FLOP goes to padding.

A `TrainBatch` is right-padded to its longest row. `plan_packing` lays its samples (each row's real tokens) end to
end into packed rows, with `position_ids` restarting at 0 per sample, and the forward gets a document mask: causal
inside a sample, nothing across (a position that is not its predecessor's + 1 starts a document, as transformers
5.24's `masking_utils.find_packed_sequence_indices` reads position ids). Rotary (and GPT-2's learned) position
embeddings see the positions each sample has alone, so every real token's log-prob is the padded path's, up to
float summation order. `PackPlan.unpack` brings the packed per-token values back to the
padded [B, T-1] layout: zeros at padding, and the packed positions that would predict across a sample boundary
(a sample's last token "predicting" the next sample's first) are never read. Loss functions and algorithms see
the tensors they always saw (every consumer masks with `loss_mask`, which only covers real targets).

Which models take it (`packing_problem`). The mask builders of every architecture in `PACKABLE` (the causal LMs of
logprobs.py's PLAIN_HEADS) pass `position_ids` to `create_causal_mask` / `create_sliding_window_causal_mask`
(transformers 5.24's modeling code), which detect the packing when the 2-D mask is None and there is no cache;
tests/core/test_packing.py runs each of them on the CPU under sdpa and eager (Gemma2: eager, it has no sdpa), with
sliding windows where the architecture has them. Attention implementations: `sdpa` and `eager` get the document mask
as a dense [R, 1, L, L] mask. On full attention it is prebuilt from the plan (`takes_prebuilt_mask`): the plan
carries each position's document id ([R, L], made on the host with the plan, moved with the batch through pinned
memory without blocking: L x fewer bytes than the mask) and the mask is
built from them on the device by index ops (bool for sdpa, eager's additive 0 / dtype-min), handed to the decoder as
`attention_mask`, which the 5.24 mask builders return as is when it is 4-D (`_preprocess_mask_arguments`), so the
forward reads nothing on the host (transformers' `find_packed_sequence_indices` reads one value per forward: on CUDA a
device sync). With a sliding window (a per-layer-type mask) transformers still builds the mask from `position_ids`
(sliding windows applied on the per-sample positions), with that one read; `flex_attention` as a BlockMask
(fully masked blocks skipped); the flash-attention ones (`flash_attention_2/3/4`) take no mask but read the sample
boundaries from `position_ids` (varlen, `cu_seqlens`), and only for one packed row (`_is_packed_sequence` needs
batch size 1; it reads a bool on the host in every layer, and the varlen call's max length is a device value);
flex builds its BlockMask after `find_packed_sequence_indices`' one read (both read from the 5.24 source, not run
here). Anything else (another architecture, bidirectional attention, a custom attention function) keeps the padded
path, said once in the log. A DDP wrapper is unwrapped to find the architecture (its forward passes
`position_ids` through), and FSDP2's `FSDP<Class>` is a subclass of the class it shards.

Row layout. A dense mask (sdpa, eager) makes the kernel compute every (query, key) pair of a row, so one row holding
a whole micro-batch can cost more attention than the padding it saves: `plan_for` weighs, per candidate row cap (1,
2, 4, 8 times the padded width, or one row), the tokens through the matmuls against the attention pairs at the
model's `pair_cost`, and packs first-fit-decreasing under the cheapest. Kernels that skip what the mask removes
(flex, flash varlen) get everything in one row. `bucket` > 1 pads each row at its end to a multiple of `bucket` tokens
(the pad is its own document, position ids from 0, never read) so a compiled model meets few shapes.

The plan is built on the host from the attention mask (a copy to the CPU when the batch is on a GPU: build it from
the CPU batch, `plan_for`, to keep the step free of host syncs); packing and unpacking are index ops on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from factory.core.batch import TrainBatch
from factory.core.trainer.logprobs import token_logprobs

log = logging.getLogger(__name__)

# Causal LMs whose decoder passes `position_ids` to transformers' mask builders (5.24 modeling code), so a packed row
# gets a document mask; the architectures of logprobs.py's PLAIN_HEADS.
PACKABLE = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel",
    "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM", "Starcoder2ForCausalLM",
})
DENSE_MASK = frozenset({"sdpa", "eager"})  # the document mask materialized: rows laid out by `choose_row_cap`
ONE_ROW = frozenset({"flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"})
# Architectures whose mask builder reads `config.sliding_window`, whatever `layer_types` says (5.24 modeling code).
CONFIG_WINDOW = frozenset({"MistralForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM"})
# Row-length multiple on CUDA: few shapes for compiled layers, matmul-friendly sizes; at most 127 pad tokens a row.
CUDA_BUCKET = 128


@dataclass(frozen=True)
class PackPlan:
    """Where each real token of a padded [B, T] batch goes in the packed [rows, length] batch, and back."""

    rows: int
    length: int
    width: int  # T of the padded batch
    token_src: Tensor  # [N] flat index of each real token in the padded [B * T]
    token_dst: Tensor  # [N] its flat index in the packed [rows * length]
    position_ids: Tensor  # [rows, length]: restarting at 0 per sample and for each row's end pad
    out_index: Tensor  # [B, T-1] flat index into the packed targets [rows * (length-1)] (0 where not valid)
    out_valid: Tensor  # [B, T-1] bool: a real target (the padded batch's attention_mask[:, 1:])
    target_valid: Tensor  # [rows, length-1] bool: packed positions whose target is the same sample's next token
    # [rows, length]: each position's document (`document_ids`), where the forward takes a prebuilt mask, else None
    documents: Tensor | None = None

    @property
    def document_mask(self) -> Tensor | None:
        """The block-diagonal causal mask [rows, 1, length, length] (bool, True = attend) on the plan's device,
        built there from `documents` (index ops, no host read): [rows, length] ids cross to the device, not the
        [rows, length, length] mask."""
        if self.documents is None:
            return None
        causal = torch.ones(self.length, self.length, dtype=torch.bool, device=self.documents.device).tril()
        return ((self.documents[:, :, None] == self.documents[:, None, :]) & causal)[:, None]

    def forward_mask(self, dtype: torch.dtype) -> Tensor | None:
        """The prebuilt 4-D mask the decoder takes in place of building one from `position_ids` (None: it builds
        its own): `document_mask` as is for sdpa (`dtype` bool), as eager's additive mask (0 or `dtype`'s min)."""
        mask = self.document_mask
        if mask is None or dtype == torch.bool:
            return mask
        return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)

    @property
    def real_tokens(self) -> int:
        return int(self.token_src.numel())

    @property
    def packed_tokens(self) -> int:
        return self.rows * self.length

    def to(self, device: torch.device) -> PackPlan:
        """The plan with its index tensors on `device`."""
        if self.token_src.device == device:
            return self
        def to(t: Tensor | None) -> Tensor | None:  # as batch_to: through pinned memory to CUDA, not blocking
            if t is None:
                return None
            if device.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        move = {k: to(getattr(self, k)) for k in
                ("token_src", "token_dst", "position_ids", "out_index", "out_valid", "target_valid", "documents")}
        return PackPlan(self.rows, self.length, self.width, **move)

    def pack(self, input_ids: Tensor) -> Tensor:
        """The packed token ids [rows, length] of a padded `input_ids` [B, T] (0 at the end pads: never read)."""
        if input_ids.shape[-1] != self.width:
            raise ValueError(f"input_ids: expected width {self.width} (the plan's), got {tuple(input_ids.shape)}")
        flat = input_ids.new_zeros(self.rows * self.length)
        flat[self.token_dst] = input_ids.reshape(-1)[self.token_src]
        return flat.view(self.rows, self.length)

    def batch(self, input_ids: Tensor) -> TrainBatch:
        """The packed `TrainBatch` a log-prob forward takes (with `position_ids`; its attention mask is not used)."""
        ids = self.pack(input_ids)
        return TrainBatch(ids, torch.ones_like(ids), self.target_valid)

    def unpack(self, values: Tensor) -> Tensor:
        """Packed per-target values [rows, length-1] -> the padded layout [B, T-1] (0 where no real target),
        differentiable (a gather)."""
        if values.shape != (self.rows, self.length - 1):
            raise ValueError(f"values: expected the packed targets' shape {(self.rows, self.length - 1)}, got "
                             f"{tuple(values.shape)}")
        out = values.reshape(-1).index_select(0, self.out_index.reshape(-1)).view(self.out_index.shape)
        return torch.where(self.out_valid, out, torch.zeros_like(out))


def round_up(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


def sample_lengths(attention_mask: Tensor) -> list[int]:
    """Each row's real length in a right-padded [B, T] attention mask (read on the host); a ValueError naming
    attention_mask if a row is not ones then zeros."""
    mask = attention_mask.detach().to("cpu", torch.bool)
    lengths = mask.sum(-1)
    if not torch.equal(mask, torch.arange(mask.shape[-1]) < lengths[:, None]):
        raise ValueError("attention_mask: packing needs right-padded rows (ones, then zeros), as batch.pack lays "
                         "them out")
    return lengths.tolist()


def _rows(lengths: Sequence[int], max_row_tokens: int | None) -> tuple[list[int], list[int], list[int]]:
    """(row of each sample, its offset there, each row's fill): all in one row in order, or first-fit-decreasing
    into rows of at most `max_row_tokens` (at least the longest sample)."""
    b = len(lengths)
    row_of, offset, fills = [0] * b, [0] * b, [0]
    if max_row_tokens is None:
        for i, n in enumerate(lengths):
            offset[i], fills[0] = fills[0], fills[0] + n
        return row_of, offset, fills
    cap = max(max_row_tokens, max(lengths, default=0))
    fills = []
    for i in sorted(range(b), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        r = next((r for r, f in enumerate(fills) if f + lengths[i] <= cap), len(fills))
        if r == len(fills):
            fills.append(0)
        row_of[i], offset[i] = r, fills[r]
        fills[r] += lengths[i]
    return row_of, offset, fills or [0]


def choose_row_cap(lengths: Sequence[int], width: int, bucket: int, pair_cost: float) -> int | None:
    """The row cap (None: one row) of least work under a dense mask: per packed row of length L, L tokens through
    the matmuls plus L^2 (query, key) pairs at `pair_cost` tokens' worth each. Candidates: 1, 2, 4, 8 times the
    padded width (bucketed), or one row; a tie goes to the shorter rows."""
    def work(cap: int | None) -> float:
        fills = _rows(lengths, cap)[2]
        length = round_up(max(fills), bucket)
        return len(fills) * (length + pair_cost * length * length)

    base = round_up(max(width, 1), bucket)
    return min([base * k for k in (1, 2, 4, 8)] + [None], key=work)


def document_ids(position_ids: Tensor) -> Tensor:
    """Each position's document [rows, L] in packed `position_ids` [rows, L]: a position that is not its
    predecessor's + 1 starts one, as transformers 5.24's `find_packed_sequence_indices` reads them."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(-1)


def plan_packing(lengths: Sequence[int], width: int, bucket: int = 1,
                 max_row_tokens: int | None = None, with_mask: bool = False) -> PackPlan:
    """The plan for samples of `lengths` (right-padded to `width`): one packed row, or with `max_row_tokens` rows
    of at most that many tokens (a longer sample gets a row of its own length), filled first-fit-decreasing; each
    row padded at its end to a multiple of `bucket`. `with_mask`: with `documents` (its forward's mask)."""
    if bucket < 1:
        raise ValueError(f"bucket: expected >= 1, got {bucket}")
    if max_row_tokens is not None and max_row_tokens < 1:
        raise ValueError(f"max_row_tokens: expected >= 1 or None, got {max_row_tokens}")
    if any(n < 0 or n > width for n in lengths):
        raise ValueError(f"lengths: expected each in [0, {width}], got {list(lengths)}")
    b = len(lengths)
    row_of, offset, fills = _rows(lengths, max_row_tokens)
    rows, length = len(fills), max(round_up(max(fills), bucket), 2)
    n = torch.tensor(list(lengths), dtype=torch.long)
    start = torch.tensor(row_of, dtype=torch.long) * length + torch.tensor(offset, dtype=torch.long)
    cols = torch.arange(width)
    real = cols[None, :] < n[:, None]  # [B, T]
    token_src = real.reshape(-1).nonzero().squeeze(-1)
    token_dst = (start[:, None] + cols[None, :])[real]
    # End pads count from 0 again (their own document); real tokens get their column in the padded row.
    fill = torch.tensor(fills, dtype=torch.long)
    pos = torch.arange(length)[None, :].expand(rows, length)
    position_ids = torch.where(pos >= fill[:, None], pos - fill[:, None], torch.zeros_like(pos)).reshape(-1)
    position_ids[token_dst] = cols[None, :].expand(b, width)[real]
    # Target column t of sample i (predicting its token t + 1) sits at packed target start_i + t, row by row.
    tcols = cols[:-1] if width > 0 else cols
    out_valid = tcols[None, :] < (n - 1)[:, None]
    start_t = torch.tensor(row_of, dtype=torch.long) * (length - 1) + torch.tensor(offset, dtype=torch.long)
    out_index = torch.where(out_valid, start_t[:, None] + tcols[None, :], torch.zeros_like(out_valid, dtype=torch.long))
    target_valid = torch.zeros(rows * (length - 1), dtype=torch.bool)
    target_valid[out_index[out_valid]] = True
    position_ids = position_ids.view(rows, length)
    return PackPlan(rows, length, width, token_src, token_dst, position_ids, out_index, out_valid,
                    target_valid.view(rows, length - 1), document_ids(position_ids) if with_mask else None)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The model a DDP wrapper holds (its forward passes keyword arguments through), else `model`."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why `model` cannot take packed rows (one phrase), or None when it can."""
    inner = _inner(model)
    names = [k.__name__ for k in type(inner).__mro__]  # FSDP2's FSDP<Class> subclasses the class it shards
    if not PACKABLE.intersection(names):
        return f"{type(inner).__name__} is not an architecture whose mask honours packed position ids"
    config = getattr(inner, "config", None)
    if config is None or not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention",
                                                                            False):
        return f"{type(inner).__name__} does not attend causally"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in DENSE_MASK | ONE_ROW:
        return f"attention implementation {impl!r} does not take a document mask from position ids"
    return None


def takes_prebuilt_mask(model: torch.nn.Module) -> bool:
    """Whether `model`'s packed forward gets the plan's `document_mask`: sdpa and eager, whose mask builder returns
    a 4-D mask as is (transformers 5.24 `_preprocess_mask_arguments`), on full attention in every layer. A sliding
    window (Mistral, Phi3, Starcoder2 by `sliding_window`; Qwen2/3, SmolLM3, Gemma2/3 by `layer_types`) keeps the
    position-ids path, which builds each layer type's mask itself."""
    config = getattr(_inner(model), "config", None)
    if getattr(config, "_attn_implementation", None) not in DENSE_MASK:
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types) and (
            getattr(config, "sliding_window", None) is None or type(_inner(model)).__name__ not in CONFIG_WINDOW)
    return getattr(config, "sliding_window", None) is None


def pair_cost(model: torch.nn.Module) -> float:
    """One (query, key) pair of attention in tokens' worth of matmul work: 4 x heads x head_dim FLOPs per layer
    (scores and values) against 2 x the matmul parameters per token (the input embedding is a lookup, unless tied
    to the head)."""
    inner = _inner(model)
    config = inner.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = sum(p.numel() for p in inner.parameters())
    embed = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    if embed is not None and not getattr(config, "tie_word_embeddings", False):
        params -= embed.weight.numel()
    return 4 * heads * head_dim * config.num_hidden_layers / (2 * max(params, 1))


def plan_for(model: torch.nn.Module, batch: TrainBatch, bucket: int = 1) -> PackPlan:
    """The packing plan of `batch` for `model`, on the host: one row where the attention kernel skips what the
    document mask removes (flash varlen, flex), else rows capped by `choose_row_cap` (a dense mask computes every
    pair of a row)."""
    width = batch.input_ids.shape[-1]
    lengths = sample_lengths(batch.attention_mask)
    impl = getattr(getattr(_inner(model), "config", None), "_attn_implementation", None)
    cap = choose_row_cap(lengths, width, bucket, pair_cost(model)) if impl in DENSE_MASK else None
    return plan_packing(lengths, width, bucket, cap, with_mask=takes_prebuilt_mask(model))


def _mask_dtype(model: torch.nn.Module) -> torch.dtype:
    """bool for sdpa; for eager the dtype transformers builds its additive mask in (the input embeddings')."""
    inner = _inner(model)
    if inner.config._attn_implementation != "eager":
        return torch.bool
    return inner.get_input_embeddings().weight.dtype


def packed_token_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0,
                          with_entropy: bool = False, bucket: int = 1, plan: PackPlan | None = None,
                          fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of a padded `batch` computed on packed rows: log-probs (and the detached entropy) [B, T-1],
    0 where the padded batch has no real target. `plan` (from `plan_for` on the CPU batch) saves the host read of
    the attention mask."""
    plan = (plan_for(model, batch, bucket) if plan is None else plan).to(batch.input_ids.device)
    mask = None if plan.documents is None else plan.forward_mask(_mask_dtype(model))
    logp, entropy = token_logprobs(model, plan.batch(batch.input_ids), temperature, with_entropy,
                                   position_ids=plan.position_ids, fused=fused, attention_mask=mask)
    return plan.unpack(logp), (None if entropy is None else plan.unpack(entropy))


class Packer:
    """A trainer's packing: whether a model takes packed rows (decided once per model, one log line when it does
    not) and the bucket its rows are padded to (`CUDA_BUCKET` on CUDA, none on the CPU, unless given)."""

    def __init__(self, bucket: int | None = None):
        self.bucket = bucket
        self._verdicts: dict[int, bool] = {}

    def accepts(self, model: torch.nn.Module) -> bool:
        key = id(_inner(model))
        if key not in self._verdicts:
            problem = packing_problem(model)
            if problem is not None:
                log.warning("trainer.packing: %s; the padded path is used", problem)
            self._verdicts[key] = problem is None
        return self._verdicts[key]

    def bucket_for(self, device: torch.device) -> int:
        return self.bucket if self.bucket is not None else (CUDA_BUCKET if device.type == "cuda" else 1)

    def plan(self, model: torch.nn.Module, batch: TrainBatch, device: torch.device) -> PackPlan | None:
        """The plan for `batch` on its way to `device` (None where `model` takes no packed rows): built from the
        batch while it is on the CPU, no host sync."""
        return plan_for(model, batch, self.bucket_for(device)) if self.accepts(model) else None

    def token_logprobs(self, model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0,
                       with_entropy: bool = False, plan: PackPlan | None = None,
                       fused: bool = False) -> tuple[Tensor, Tensor | None]:
        """Packed when `model` accepts it, else the padded `token_logprobs`: the same [B, T-1] tensors either way.
        `fused`: the head as one fused op (trainer.fused_head)."""
        if not self.accepts(model):
            return token_logprobs(model, batch, temperature, with_entropy, fused=fused)
        return packed_token_logprobs(model, batch, temperature, with_entropy,
                                     self.bucket_for(batch.input_ids.device), plan, fused=fused)
