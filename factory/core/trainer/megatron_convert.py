"""HF ↔ Megatron-core weight conversion for Qwen2 / Llama causal LMs, on plain tensors (no megatron import).

Megatron names are those of `GPTModel` with the local layer spec (`get_gpt_layer_local_spec`): separate
`input_layernorm` / `pre_mlp_layernorm` RMSNorms, a fused `linear_qkv` laid out per query group as
[q heads of the group, k, v], a fused `linear_fc1` = [gate; up], `linear_proj` / `linear_fc2` row-parallel.

Tensor parallelism splits column-parallel weights along the output dim (QKV by whole query groups, fc1's gate and
up halves each), row-parallel weights along the input dim, embedding and output layer along the vocabulary;
norms are replicated. Pipeline parallelism gives each stage a contiguous, renumbered run of layers, the embedding
to the first stage and the final norm and output layer to the last.

Every conversion only moves, concatenates and slices tensors: HF → Megatron → HF is bit-exact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class Geometry:
    """The sizes the conversion needs, read from an HF config."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads = Megatron's num_query_groups
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


def rope_theta(hf_config: PretrainedConfig) -> float:
    """The rotary base, from `rope_parameters` (transformers 5) or `rope_theta` (older configs)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("rope_parameters.rope_theta: the config gives no rotary base")
    return float(theta)


def check_supported(hf_config: PretrainedConfig) -> None:
    """Raise a ValueError naming the config field when the architecture is not one Megatron's local GPT spec
    reproduces exactly (dense Qwen2 / Llama, SiLU gated MLP, plain RoPE, full causal attention)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type: the Megatron backend converts {', '.join(SUPPORTED_MODEL_TYPES)}, "
                         f"got {model_type!r}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: the Megatron backend needs 'silu' (SwiGLU), got {act!r}")
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (isinstance(legacy_scaling, dict) and
                                  legacy_scaling.get("rope_type", legacy_scaling.get("type")) not in (None, "default")):
        raise ValueError(f"rope_parameters.rope_type: the Megatron backend handles plain RoPE ('default'), got "
                         f"{rope_type if rope_type != 'default' else legacy_scaling!r}")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window: sliding-window attention is not converted (full causal attention only)")
    layer_types = getattr(hf_config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"layer_types: only 'full_attention' layers are converted, got {other}")
    for field in ("attention_bias", "mlp_bias"):
        if model_type == "llama" and getattr(hf_config, field, False):
            raise ValueError(f"{field}: Llama with biases is not converted (Megatron's add_bias_linear would put a "
                             "bias on every linear layer)")
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(hf_config, field, None):
            raise ValueError(f"{field}: mixture-of-experts models are not converted")
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads or hf_config.num_attention_heads
    if heads % groups:
        raise ValueError(f"num_key_value_heads: {groups} does not divide num_attention_heads {heads}")


def geometry(hf_config: PretrainedConfig) -> Geometry:
    check_supported(hf_config)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return Geometry(
        layers=hf_config.num_hidden_layers, hidden=hf_config.hidden_size, heads=heads,
        groups=hf_config.num_key_value_heads or heads, head_dim=head_dim, ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size, tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=hf_config.model_type == "qwen2")


def _take(state: dict[str, Tensor], key: str) -> Tensor:
    if key not in state:
        raise ValueError(f"HF state dict: missing {key!r}")
    return state.pop(key)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, g: Geometry) -> Tensor:
    """HF q/k/v (weights [out, hidden] or biases [out]) → Megatron's per-group [q heads, k, v] rows."""
    rest = q.shape[1:]
    parts = (q.reshape(g.groups, g.heads_per_group * g.head_dim, *rest), k.reshape(g.groups, g.head_dim, *rest),
             v.reshape(g.groups, g.head_dim, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unfuse_qkv(qkv: Tensor, g: Geometry) -> tuple[Tensor, Tensor, Tensor]:
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g.groups, -1, *rest).split([g.heads_per_group * g.head_dim, g.head_dim, g.head_dim], dim=1)
    return q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


def hf_to_megatron(hf_state: Mapping[str, Tensor], hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """The full (unsharded) Megatron GPTModel state of an HF Qwen2/Llama state dict. Every HF tensor must be used:
    an unknown key is an error, not silently dropped."""
    g = geometry(hf_config)
    hf = dict(hf_state)
    out: dict[str, Tensor] = {"embedding.word_embeddings.weight": _take(hf, "model.embed_tokens.weight")}
    for i in range(g.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = _take(hf, h + "input_layernorm.weight")
        qkv = [_take(hf, f"{h}self_attn.{p}_proj.weight") for p in "qkv"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv, g)
        if g.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *[_take(hf, f"{h}self_attn.{p}_proj.bias") for p in "qkv"], g)
        out[m + "self_attention.linear_proj.weight"] = _take(hf, h + "self_attn.o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = _take(hf, h + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(hf, h + "mlp.gate_proj.weight"), _take(hf, h + "mlp.up_proj.weight")], dim=0)
        out[m + "mlp.linear_fc2.weight"] = _take(hf, h + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = _take(hf, "model.norm.weight")
    head = hf.pop("lm_head.weight", None)
    if not g.tied:
        if head is None:
            raise ValueError("HF state dict: missing 'lm_head.weight' (tie_word_embeddings is false)")
        out["output_layer.weight"] = head
    elif head is not None and not torch.equal(head, out["embedding.word_embeddings.weight"]):
        raise ValueError("lm_head.weight: differs from model.embed_tokens.weight but tie_word_embeddings is true")
    if hf:
        raise ValueError(f"HF state dict: keys the converter does not know: {sorted(hf)[:8]}")
    return out


def megatron_to_hf(m_state: Mapping[str, Tensor], hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """The HF state dict of a full (unsharded) Megatron GPTModel state; `_extra_state` entries are ignored.
    With tied embeddings `lm_head.weight` is the embedding tensor itself, as in an HF model's `state_dict()`."""
    g = geometry(hf_config)
    ms = {k: v for k, v in m_state.items() if not k.endswith("._extra_state")}

    def take(key: str) -> Tensor:
        if key not in ms:
            raise ValueError(f"Megatron state dict: missing {key!r}")
        return ms.pop(key)

    out: dict[str, Tensor] = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")}
    for i in range(g.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = unfuse_qkv(take(m + "self_attention.linear_qkv.weight"), g)
        out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                    h + "self_attn.v_proj.weight": v})
        if g.qkv_bias:
            qb, kb, vb = unfuse_qkv(take(m + "self_attention.linear_qkv.bias"), g)
            out.update({h + "self_attn.q_proj.bias": qb, h + "self_attn.k_proj.bias": kb,
                        h + "self_attn.v_proj.bias": vb})
        out[h + "self_attn.o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
        gate, up = take(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
        out[h + "input_layernorm.weight"] = take(m + "input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = take(m + "pre_mlp_layernorm.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if g.tied:
        ms.pop("output_layer.weight", None)  # a pipeline's last stage keeps a copy of the embedding
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("output_layer.weight")
    if ms:
        raise ValueError(f"Megatron state dict: keys the converter does not know: {sorted(ms)[:8]}")
    return out


# --- tensor parallel -----------------------------------------------------------------------------------------------

_VOCAB = re.compile(r"^(embedding\.word_embeddings|output_layer)\.weight$")
_QKV = re.compile(r"\.linear_qkv\.(weight|bias)$")
_FC1 = re.compile(r"\.linear_fc1\.weight$")
_ROW = re.compile(r"\.(linear_proj|linear_fc2)\.weight$")
_REPLICATED = re.compile(r"(layernorm|final_layernorm)\.weight$")


def _check_tp(g: Geometry, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"trainer.tensor_parallel: must be >= 1, got {tp}")
    for name, size in (("num_key_value_heads", g.groups), ("intermediate_size", g.ffn), ("vocab_size", g.vocab)):
        if size % tp:
            raise ValueError(f"{name}: {size} is not divisible by trainer.tensor_parallel {tp}")


def split_tensor_parallel(m_state: Mapping[str, Tensor], hf_config: PretrainedConfig,
                          tp: int) -> list[dict[str, Tensor]]:
    """The `tp` rank shards of a full Megatron state, rank 0 first."""
    g = geometry(hf_config)
    _check_tp(g, tp)
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for key, t in m_state.items():
        if key.endswith("._extra_state"):
            continue
        if _VOCAB.search(key):
            parts = t.chunk(tp, dim=0)
        elif _QKV.search(key):
            rest = t.shape[1:]
            parts = tuple(p.reshape(-1, *rest) for p in t.reshape(g.groups, -1, *rest).chunk(tp, dim=0))
        elif _FC1.search(key):
            gate, up = t.chunk(2, dim=0)
            parts = tuple(torch.cat([a, b]) for a, b in zip(gate.chunk(tp), up.chunk(tp), strict=True))
        elif _ROW.search(key):
            parts = t.chunk(tp, dim=1)
        elif _REPLICATED.search(key):
            parts = (t,) * tp
        else:
            raise ValueError(f"Megatron state dict: no tensor-parallel rule for {key!r}")
        for shard, p in zip(shards, parts, strict=True):
            shard[key] = p.clone()
    return shards


def merge_tensor_parallel(shards: list[Mapping[str, Tensor]], hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """The full Megatron state of its tensor-parallel rank shards (rank 0 first); replicated tensors must agree."""
    g = geometry(hf_config)
    tp = len(shards)
    _check_tp(g, tp)
    out: dict[str, Tensor] = {}
    for key, first in shards[0].items():
        if key.endswith("._extra_state"):
            continue
        parts = [s[key] for s in shards]
        if _VOCAB.search(key):
            out[key] = torch.cat(parts, dim=0)
        elif _QKV.search(key):
            rest = first.shape[1:]
            out[key] = torch.cat([p.reshape(g.groups // tp, -1, *rest) for p in parts]).reshape(-1, *rest)
        elif _FC1.search(key):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif _ROW.search(key):
            out[key] = torch.cat(parts, dim=1)
        elif _REPLICATED.search(key):
            if not all(torch.equal(first, p) for p in parts[1:]):
                raise ValueError(f"{key}: replicated across tensor-parallel ranks but the ranks disagree")
            out[key] = first.clone()
        else:
            raise ValueError(f"Megatron state dict: no tensor-parallel rule for {key!r}")
    return out


# --- pipeline parallel ---------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _check_pp(g: Geometry, pp: int) -> int:
    if pp < 1 or g.layers % pp:
        raise ValueError(f"trainer.pipeline_parallel: must divide num_hidden_layers {g.layers}, got {pp}")
    return g.layers // pp


def pipeline_stage(m_state: Mapping[str, Tensor], hf_config: PretrainedConfig, rank: int, pp: int) -> dict[str, Tensor]:
    """Stage `rank`'s part of a Megatron state (full or one tensor-parallel shard), layers renumbered from 0 as
    Megatron numbers them locally. With tied embeddings the last stage holds a copy of the embedding as its output
    layer, as Megatron's last stage does."""
    g = geometry(hf_config)
    per = _check_pp(g, pp)
    lo, hi = rank * per, (rank + 1) * per
    out: dict[str, Tensor] = {}
    for key, t in m_state.items():
        layer = _LAYER.match(key)
        if layer:
            if lo <= int(layer.group(1)) < hi:
                out[f"decoder.layers.{int(layer.group(1)) - lo}.{layer.group(2)}"] = t
        elif key.startswith("embedding."):
            if rank == 0:
                out[key] = t
            if key == "embedding.word_embeddings.weight" and g.tied and pp > 1 and rank == pp - 1:
                out["output_layer.weight"] = t.clone()
        elif key.startswith(("decoder.final_layernorm.", "output_layer.")):
            if rank == pp - 1:
                out[key] = t
        elif not key.endswith("._extra_state"):
            raise ValueError(f"Megatron state dict: no pipeline rule for {key!r}")
    return out


def merge_pipeline(stages: list[Mapping[str, Tensor]], hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """The Megatron state of its pipeline stages (stage 0 first); layers numbered globally again."""
    g = geometry(hf_config)
    pp = len(stages)
    per = _check_pp(g, pp)
    out: dict[str, Tensor] = {}
    for rank, stage in enumerate(stages):
        for key, t in stage.items():
            layer = _LAYER.match(key)
            if layer:
                out[f"decoder.layers.{int(layer.group(1)) + rank * per}.{layer.group(2)}"] = t
            elif key == "output_layer.weight" and g.tied:
                continue  # the last stage's copy of the tied embedding
            elif not key.endswith("._extra_state"):
                out[key] = t
    return out
