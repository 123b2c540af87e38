"""LoRA through peft: adapters attached to a causal LM in place, what a version of them publishes, and merging.

`attach(model, spec)` injects peft LoRA layers into `model` itself (`get_peft_model`): the model object the loop holds
keeps its identity, its forward now adds the adapters, every base weight is frozen, and only the adapters require
grad (so an optimizer over the trainable parameters holds only them). `detach(model)` merges the adapters into the
base weights and removes the LoRA layers, in place: a plain HF model again.

What the rollout side needs of a version is `adapter_state(model)`: per adapted module `P` (its HF name, e.g.
`model.layers.0.self_attn.q_proj`) the tensors `P.lora_A` [r, in], `P.lora_B` [out, r] and `P.lora_scaling` (a 0-d
float64 tensor: alpha / r, exactly the float peft multiplies by), plus `P.lora_transpose` (0-d uint8) for GPT-2-style
Conv1D modules whose weight is stored [in, out]. It is a plain `dict[str, Tensor]`, so it travels through
`factory.core.weights` like any state. `AdapterMerger` is the receiving end: it keeps a copy of the base weights of
the adapted modules and turns each version's adapters into merged weights `W = W0 + transpose?(B @ A) * scaling`
(peft's own merge arithmetic), always from the base, never on top of the previous version.

`merged_state(model)` and `merged_copy(model)` give the merged weights under plain HF names (checkpoints, engines
that hold their own copy); `base_state(model)` the frozen base weights alone.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from factory.config import LoraSpec, ModelSpec
from factory.model_source import source_files
from factory.presets import PRESETS

ADAPTER = "default"  # peft's adapter name: one adapter per model here
_PEFT = "_factory_peft"  # attribute on the HF model: the PeftModel that wraps it (set by `attach`)
SUFFIXES = (".lora_A", ".lora_B", ".lora_scaling", ".lora_transpose")


def attached(model: torch.nn.Module) -> bool:
    """Whether `attach` put LoRA adapters into `model`."""
    return getattr(model, _PEFT, None) is not None


def attach(model: PreTrainedModel, spec: Any) -> None:
    """Inject LoRA adapters (`spec`: a `LoraSpec`: r, alpha, dropout, target_modules) into `model`, in place.

    The base weights are frozen; the adapters are initialised as peft does (A random from torch's RNG, B zero, so the
    model's outputs are unchanged until the first step). Target modules that match nothing in the model are an error
    naming `trainer.lora.target_modules` and the model's linear modules."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 the `real` extra: needed only by LoRA runs

    if attached(model):
        raise ValueError("trainer.lora: the model already has LoRA adapters attached")
    targets = spec.target_modules
    if (problem := targets_problem(model, targets)) is not None:
        raise ValueError(problem)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                        target_modules=targets if isinstance(targets, str) else list(targets))
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"trainer.lora.target_modules: {targets!r} does not fit model {type(model).__name__} "
                         f"({e}); its linear modules are {_linear_names(model)}") from None
    object.__setattr__(model, _PEFT, peft_model)  # not a submodule: the wrapper holds the model, not the reverse


def _linear_names(model: torch.nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})


def targets_problem(model: torch.nn.Module, targets: str | list[str]) -> str | None:
    """The error naming `trainer.lora.target_modules` if a listed target matches no module of `model` (peft itself
    only objects when none matches), else None. A string other than 'all-linear' is a regex, as in peft."""
    if targets == "all-linear":
        return None
    names = [name for name, _ in model.named_modules() if name]
    if isinstance(targets, str):
        found = any(re.fullmatch(targets, n) for n in names)
        missing = [] if found else [targets]
    else:
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not missing:
        return None
    return (f"trainer.lora.target_modules: {missing} match no module of {type(model).__name__}; its linear modules "
            f"are {_linear_names(model)} (or use 'all-linear')")


def spec_targets_problem(lora_spec: LoraSpec | None, m: ModelSpec) -> str | None:
    """`targets_problem` for a spec's `trainer.lora` before its run, on the skeleton of the model its `model`
    section `m` names (built on the meta device from the preset or `model.path`'s config.json: no weights are
    read). None without a LoRA section, or when the model's config cannot be read here (the run's start reports
    that)."""
    if lora_spec is None or lora_spec.target_modules == "all-linear":
        return None
    try:
        if m.path is None:
            p = PRESETS[m.preset]
            config = AutoConfig.for_model(p.arch, vocab_size=64, hidden_size=p.hidden_size, num_hidden_layers=1,
                                          num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                                          intermediate_size=p.intermediate_size)
        else:
            # The directory or cached hub snapshot `model.path` names (never a download); a GGUF file that is not
            # converted yet has no config.json to read, so it is checked when the run converts it.
            files = source_files(m.path)
            if files is None or not files.is_dir():
                return None
            config = AutoConfig.from_pretrained(files, trust_remote_code=m.trust_remote_code, local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None
    return targets_problem(skeleton, lora_spec.target_modules)


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """HF module name -> its peft LoRA layer, in module order."""
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415 the `real` extra: only LoRA runs have such layers

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapters of this version, detached CPU copies, keyed as the module docstring says."""
    out: dict[str, Tensor] = {}
    for name, layer in lora_layers(model).items():
        out[f"{name}.lora_A"] = layer.lora_A[ADAPTER].weight.detach().to("cpu", copy=True)
        out[f"{name}.lora_B"] = layer.lora_B[ADAPTER].weight.detach().to("cpu", copy=True)
        out[f"{name}.lora_scaling"] = torch.tensor(float(layer.scaling[ADAPTER]), dtype=torch.float64)
        if layer.fan_in_fan_out:
            out[f"{name}.lora_transpose"] = torch.tensor(1, dtype=torch.uint8)
    return out


def delta_weight(a: Tensor, b: Tensor, scaling: Tensor | float, transpose: bool) -> Tensor:
    """peft's `get_delta_weight` for an fp32 adapter: transpose?(B @ A) * scaling (same operations, same order, so a
    merge here is bit-identical to peft's)."""
    d = b @ a
    return (d.T if transpose else d) * float(scaling)


def base_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The frozen base weights under plain HF names (`...q_proj.base_layer.weight` -> `...q_proj.weight`); the
    tensors are the model's own (no copy)."""
    out: dict[str, Tensor] = {}
    for k, v in model.state_dict(keep_vars=False).items():
        if ".lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    return out


def merged_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The merged weights under plain HF names: fresh tensors for the adapted modules, the model's own otherwise."""
    return AdapterMerger(base_state(model), copy_base=False).merge(adapter_state(model), full=True)


def merged_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain HF model (no LoRA layers) with the merged weights: peft's `merge_and_unload` on a deep copy."""
    if not attached(model):
        return copy.deepcopy(model)
    clone = copy.deepcopy(getattr(model, _PEFT))
    plain = clone.merge_and_unload()
    plain.__dict__.pop(_PEFT, None)
    for p in plain.parameters():
        p.requires_grad_(True)
    return plain


def base_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain HF model (no LoRA layers) with the frozen base weights, without the adapters."""
    plain = merged_copy(model)
    if attached(model):
        plain.load_state_dict(base_state(model))
    return plain


def detach(model: PreTrainedModel) -> None:
    """Merge the adapters into the base weights and remove the LoRA layers, in place (peft's `merge_and_unload`):
    `model` is a plain HF model with the trained weights again, every parameter trainable."""
    peft_model = getattr(model, _PEFT, None)
    if peft_model is None:
        return
    peft_model.merge_and_unload()
    model.__dict__.pop(_PEFT, None)
    for p in model.parameters():
        p.requires_grad_(True)


def is_adapter_state(state: Mapping[str, Tensor]) -> bool:
    """Whether `state` is an `adapter_state` (every key ends in one of `SUFFIXES`)."""
    return bool(state) and all(k.endswith(SUFFIXES) for k in state)


class AdapterMerger:
    """The rollout side of LoRA: a copy of the base weights, and each version's adapters merged into them.

    `merge(adapters)` returns the merged weight of every adapted module (`P.weight`), computed from the base copy
    (each version replaces the last, it is never merged on top of it); with `full=True` the untouched base tensors
    too (a whole state dict). Adapters for a module the base has no weight for, or of the wrong shape, are an error
    naming the module."""

    def __init__(self, base: Mapping[str, Tensor], copy_base: bool = True):
        self.base = {k: (v.detach().to("cpu", copy=True) if copy_base else v) for k, v in base.items()}

    def merge(self, adapters: Mapping[str, Tensor], full: bool = False) -> dict[str, Tensor]:
        modules = sorted({k.rsplit(".", 1)[0] for k in adapters if k.endswith(".lora_A")})
        out: dict[str, Tensor] = dict(self.base) if full else {}
        for m in modules:
            try:
                a, b, s = adapters[f"{m}.lora_A"], adapters[f"{m}.lora_B"], adapters[f"{m}.lora_scaling"]
            except KeyError as e:
                raise ValueError(f"LoRA update: module {m!r} lacks {e.args[0]!r}") from None
            w0 = self.base.get(f"{m}.weight")
            if w0 is None:
                raise ValueError(f"LoRA update: module {m!r} has adapters but the base has no {m}.weight")
            transpose = bool(adapters.get(f"{m}.lora_transpose", torch.tensor(0)).item())
            d = delta_weight(a.to(w0.device), b.to(w0.device), s, transpose)
            if d.shape != w0.shape:
                raise ValueError(f"LoRA update: module {m!r}: B @ A is {list(d.shape)}, the base weight "
                                 f"{list(w0.shape)}")
            w = w0.clone()
            w += d.to(w0.dtype)  # peft's merge: base + delta, in the base's dtype
            out[f"{m}.weight"] = w
        return out
