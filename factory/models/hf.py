"""Bring your own model: load a local Hugging Face causal-LM directory (`model.path`) with its own tokenizer.

Nothing is downloaded (`local_files_only`) and no code from the directory runs (`trust_remote_code` stays
off unless the spec turns it on). Every refusal names the directory and what was expected in it.
A tokenizer without a pad token gets pad = eos: Factory pads batches (left) and masks the padding, so the
pad id only has to be a valid id; one without an eos token is refused, since completions end at eos.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported where a model loads, so `factory validate` checks a path without it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Any one of these is a tokenizer transformers can load without a download.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelDirError(ValueError):
    """A `model.path` that cannot be loaded; the message names the directory."""


def check_model_dir(path: str | Path) -> Path:
    """The directory, if it looks like an HF causal-LM directory (config.json and tokenizer files)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelDirError(f"model.path: no such directory: {p}")
    if not p.is_dir():
        raise ModelDirError(f"model.path: not a directory: {p} (expected a Hugging Face model directory)")
    if not (p / "config.json").is_file():
        raise ModelDirError(f"model.path: no config.json in {p} (expected a Hugging Face model directory)")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"model.path: no tokenizer files in {p} (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"model.path: cannot read {p / 'config.json'} as JSON: {e}") from None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant:  # transformers loads such a model marked quantized, and refuses to save it once it has trained
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelDirError(f"model.path: {p / 'config.json'} declares a quantized model (quantization_config, "
                            f"quant_method {method}); Factory trains and saves full-precision weights: give a .gguf "
                            f"file itself as model.path (it is converted), or remove quantization_config from a "
                            f"config whose weights are not quantized")
    return p


def load_tokenizer_dir(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The directory's tokenizer, with pad = eos when it has no pad token; refused without an eos token."""
    from transformers import AutoTokenizer  # noqa: PLC0415 heavy: `factory validate` checks a path without it

    p = check_model_dir(path)
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds; the user needs the path and the cause
        raise _load_error("tokenizer", p, e, trust_remote_code) from e
    if tok.eos_token_id is None:
        raise ModelDirError(f"model.path: the tokenizer in {p} has no eos token (completions end at eos; set "
                            f"eos_token in its tokenizer_config.json)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation pads prompts on the left
    return tok


def load_model_dir(path: str | Path, max_positions: int | None = None,
                   trust_remote_code: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) from a local HF directory, float32 for training. `max_positions` may only shrink the
    model's context (`max_position_embeddings`): positions past what it was built for have no trained meaning."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 heavy: imported where a model loads

    tok = load_tokenizer_dir(path, trust_remote_code)
    p = Path(path).expanduser()
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code,
                                                     dtype="float32")
    except Exception as e:
        raise _load_error("model", p, e, trust_remote_code) from e
    limit = model_positions(model)
    if max_positions is not None and limit is not None and max_positions > limit:
        raise ModelDirError(f"model.max_positions: must be <= {limit}, the max_position_embeddings of the model in "
                            f"{p}, got {max_positions}")
    if model.config.vocab_size < len(tok):
        raise ModelDirError(f"model.path: the tokenizer in {p} has {len(tok)} tokens but the model's vocab_size is "
                            f"{model.config.vocab_size}")
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _load_error(what: str, path: Path, e: Exception, trust_remote_code: bool) -> ModelDirError:
    if not trust_remote_code and "trust_remote_code" in str(e):
        return ModelDirError(f"model.path: cannot load the {what} in {path}: it needs Python code shipped in the "
                             f"directory (config.json auto_map) and model.trust_remote_code is off; set it to true "
                             f"only for code you trust")
    return ModelDirError(f"model.path: cannot load the {what} in {path}: {e}")


def model_positions(model: PreTrainedModel) -> int | None:
    """The model's context length (`max_position_embeddings`), where its config has one."""
    return getattr(model.config, "max_position_embeddings", None)
