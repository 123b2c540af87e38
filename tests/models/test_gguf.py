"""factory.models.gguf: a GGUF file becomes a plain HF directory once, content-addressed, and is reused."""

from __future__ import annotations

import pytest

from factory.models.gguf import GGUFError, check_gguf_file, convert_gguf, converted_dir


def test_smollm2_converts_to_a_loadable_llama_dir(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(smollm2_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert cfg.model_type == "llama" and cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500e6  # fp32, not the 98 MB quantized file


def test_second_conversion_reuses_the_directory(smollm2_gguf, smollm2_dir, tmp_path):
    from factory.home import FactoryPaths

    home = FactoryPaths(smollm2_dir.parents[2])
    assert converted_dir(smollm2_gguf, home) == smollm2_dir
    messages = []
    assert convert_gguf(smollm2_gguf, home, log=messages.append) == smollm2_dir
    assert messages == []  # nothing converted again
    assert converted_dir(smollm2_gguf, FactoryPaths(tmp_path)) is None


def test_bad_files_are_refused_by_name(tmp_path):
    with pytest.raises(GGUFError, match="no such GGUF file"):
        check_gguf_file(tmp_path / "missing.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(GGUFError, match="fake.gguf is not a GGUF file"):
        check_gguf_file(fake)
