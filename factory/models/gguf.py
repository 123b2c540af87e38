"""GGUF files as model directories: a `.gguf` file converted once into a plain Hugging Face directory (fp32
safetensors, its tokenizer and chat template) under FACTORY_HOME, content-addressed by the file's SHA-256, and reused.

transformers reads GGUF (`from_pretrained(dir, gguf_file=...)`, with the `gguf` and `accelerate` packages) and
dequantizes it, but the model it returns is marked quantized and refuses `save_pretrained`; its state dict loads
into a fresh model of the same architecture, which saves normally. The result is what every other path (SFT, the
engines, the server, checkpoints, SGLang) loads. A conversion is written to a temporary directory and renamed into
place, so a crash leaves no half-written model and two processes converting the same file both end with one copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from factory.home import FactoryPaths
from factory.infra.liveness import covered

GGUF_MAGIC = b"GGUF"
MARKER = "factory-gguf.json"  # written last: a directory with it is complete


class GGUFError(ValueError):
    """A `.gguf` file that cannot be converted; the message names the file."""


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_gguf_file(path: str | Path) -> Path:
    """The file, if it exists and starts with the GGUF magic bytes."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise GGUFError(f"model.path: no such GGUF file: {p}")
    with p.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"model.path: {p} is not a GGUF file (it does not start with the bytes 'GGUF')")
    return p


def gguf_dir(home: FactoryPaths, sha256: str) -> Path:
    """Where the conversion of the file with this digest lives."""
    return home.root / "models" / "gguf" / sha256[:16]


def converted_dir(path: str | Path, home: FactoryPaths) -> Path | None:
    """The finished conversion of this file, or None when it has not been converted into this home."""
    out = gguf_dir(home, file_sha256(check_gguf_file(path)))
    return out if (out / MARKER).is_file() else None


def convert_gguf(path: str | Path, home: FactoryPaths, log=print) -> Path:
    """The HF directory converted from the GGUF file at `path` (converted now unless done before)."""
    src = check_gguf_file(path).resolve()
    digest = file_sha256(src)
    out = gguf_dir(home, digest)
    if (out / MARKER).is_file():
        return out
    try:  # optional: the `real` extra (gguf, accelerate) is only needed to read GGUF files
        import gguf  # noqa: F401, PLC0415 the `real` extra: only GGUF files need it
    except ImportError as e:
        raise GGUFError(f"model.path: reading {src} needs the packages gguf and accelerate "
                        f"(pip install 'factory[real]'): {e}") from e
    log(f"converting {src.name} into {out} (once; later runs reuse it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with covered():  # dequantizing and writing: long calls with no loop of ours inside (infra/liveness.py)
            model, tok = _dequantized(src)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(src), "sha256": digest,
                                              "architecture": type(model).__name__}, indent=2) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished the same conversion first
            if not (out / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dequantized(src: Path):
    """(fp32 model, tokenizer) read from the GGUF file `src`, as a plain model that saves normally."""
    import torch  # noqa: PLC0415 heavy: only a GGUF conversion computes here
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 heavy: as torch

    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many kinds (unsupported architecture, bad tensors)
        raise GGUFError(f"model.path: cannot read the GGUF file {src}: {e}") from e
    config = quantized.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    return model, tok
