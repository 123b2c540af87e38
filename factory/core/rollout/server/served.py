"""What the rollout server serves: an engine over a checkpoint, placed on a device, and the weights that updates
read (a checkpoint directory's safetensors; host copies of the served weights for the update decoders)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from factory.core.rollout.engines.engine_control import EngineControl
from factory.core.rollout.engines.paged.engine import make_engine
from factory.models.checkpoint import load_checkpoint


def load_weights_dir(path: str | Path) -> dict[str, Tensor]:
    """The safetensors weights of an HF checkpoint directory (one file or an index of shards)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model_path is not a directory: {path}")
    single = path / "model.safetensors"
    if single.is_file():
        return load_file(single)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, Tensor] = {}
        for shard in shards:
            out.update(load_file(path / shard))
        return out
    raise FileNotFoundError(f"no model.safetensors (or its index) in {path}")


def engine_from_checkpoint(path: str | Path, max_batch: int = 64, max_seq_len: int | None = None,
                           version: int = 0, device: torch.device | None = None,
                           precision: str = "fp32", kv_budget: int | None = None,
                           engine: str = "auto") -> EngineControl:
    """An engine over the checkpoint at `path` (`engine`: as `paged.engine.make_engine` takes it, the paged engine
    where it runs the model), its model placed on `device` (default: where the checkpoint loads, the CPU);
    `precision` "bf16" decodes in bf16 on a GPU; `kv_budget`: bytes of KV cache (default: from the machine, once
    the weights are loaded)."""
    model, tokenizer = load_checkpoint(path)
    if device is not None:
        model.to(device)
    return make_engine(model, tokenizer, engine, weight_version=version, max_batch=max_batch,
                       max_seq_len=max_seq_len, name=Path(path).name, precision=precision, kv_budget=kv_budget,
                       owns_model=True)
