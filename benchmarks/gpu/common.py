"""Shared parts of the GPU benchmarks: the model shapes, SGLang server specs (real or the fake), devices.

The 0.5B model is Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 kv heads, MLP 4864, vocab 151936, tied
embeddings) built from a transformers `Qwen2Config` and randomly initialised: nothing is downloaded. `micro` is the
`micro` preset's shape with a 512-token vocab, for the CPU smoke modes.

`--smoke` runs SGLang paths against `tests/core/fake_sglang_server.py` (a real process speaking SGLang's
documented HTTP shapes, deterministic tokens, not a model), started through `rollout.sglang.python` pointing at a
wrapper script, as the tests do: the code path is exercised, the numbers mean nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from factory.config import SGLangSpec  # noqa: E402

SHAPES: dict[str, dict] = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=512, max_position_embeddings=256, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True),
}
H100_BF16_DENSE_TFLOPS = 989.0  # H100 SXM, bf16 dense tensor cores (NVIDIA's datasheet, without sparsity)


def qwen2_config(shape: str, **overrides) -> Qwen2Config:
    if shape not in SHAPES:
        raise ValueError(f"--model: expected one of {', '.join(SHAPES)}, got {shape!r}")
    cfg = Qwen2Config(**{**SHAPES[shape], **overrides})
    cfg._attn_implementation = "sdpa"
    return cfg


def random_model(shape: str, seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 of `shape` (float32, CPU)."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen2_config(shape, **overrides)).eval()


def n_params(model: torch.nn.Module) -> int:
    """Parameters counted once (a tied embedding is one tensor)."""
    return sum(p.numel() for p in model.parameters())


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def free_ports(n: int, *, smoke: bool) -> int:
    """A port p for servers on p .. p+n-1 (SGLang server i listens on base_port + i): reserved for the fake
    servers (which bind beside the reservation), found free now for real ones."""
    from tests.core.fake_sglang_server import release_ports, reserve_ports

    base = reserve_ports(n)
    if not smoke:
        release_ports(base)
    return base


def sglang_spec(*, smoke: bool, workdir: Path, servers: int = 1, weight_update: str = "tensor",
                python: str | None = None, mem_fraction: float | None = None, extra_args: list[str] | None = None,
                fake_vocab: int | None = None, startup_timeout_s: float = 900.0) -> SGLangSpec:
    """The `rollout.sglang` section: real servers from `python` (sglang's own venv), or (smoke) the fake server
    through a wrapper that stands in for that python."""
    extra = list(extra_args or [])
    if smoke:
        from tests.core.fake_sglang_server import python_wrapper

        python = python_wrapper(workdir)
        extra = ["--fake-vocab", str(fake_vocab)] if fake_vocab else []
        mem_fraction = None
        startup_timeout_s = 60.0
    return SGLangSpec(servers=servers, python=python, base_port=free_ports(servers, smoke=smoke),
                      weight_update=weight_update, mem_fraction_static=mem_fraction, extra_args=extra,
                      startup_timeout_s=startup_timeout_s)


def sglang_python(arg: str | None) -> str | None:
    """--sglang-python, else $SGLANG_PYTHON, else None (this interpreter must then import sglang)."""
    return arg or os.environ.get("SGLANG_PYTHON") or None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def smoke_note(smoke: bool) -> str | None:
    return ("SMOKE: CPU, tiny sizes, fake SGLang server (tests/core/fake_sglang_server.py): the code path ran, "
            "the numbers mean nothing") if smoke else None
