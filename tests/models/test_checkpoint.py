"""Models build from presets without downloads; checkpoints are HF-format, atomic and hashed."""

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from factory.models.build import build_model
from factory.models.checkpoint import dir_digest, load_checkpoint, read_meta, save_checkpoint
from factory.models.tokenizer import build_tokenizer


def test_tokenizer_round_trip_and_specials():
    tok = build_tokenizer()
    ids = tok("12+34=").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "12+34="
    assert tok("5", add_special_tokens=False).input_ids == [tok.convert_tokens_to_ids("5")]


def test_build_model_unknown_preset_lists_valid():
    with pytest.raises(ValueError, match="valid presets: .*tiny"):
        build_model("giant", build_tokenizer())


@pytest.mark.parametrize("preset", ["micro", "tiny-llama"])
def test_checkpoint_loads_with_transformers_and_is_identical(tmp_path, preset):
    tok = build_tokenizer()
    model = build_model(preset, tok, seed=3)
    info = save_checkpoint(model, tok, tmp_path / "ckpt", meta={"step": 5})
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in info.path.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(info.path)
    tok2 = PreTrainedTokenizerFast.from_pretrained(info.path)
    x = torch.tensor([tok2("1+2=").input_ids])
    assert torch.equal(model(x).logits, loaded(x).logits)
    assert read_meta(info.path) == {"step": 5}
    assert dir_digest(info.path) == (info.sha256, info.bytes)


def test_save_replaces_atomically_and_leaves_no_temp(tmp_path):
    tok = build_tokenizer()
    first = save_checkpoint(build_model("micro", tok, seed=0), tok, tmp_path / "ckpt")
    second = save_checkpoint(build_model("micro", tok, seed=1), tok, tmp_path / "ckpt")
    assert first.sha256 != second.sha256
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert dir_digest(tmp_path / "ckpt")[0] == second.sha256 and model is not None


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    tok = build_tokenizer()
    good = save_checkpoint(build_model("micro", tok), tok, tmp_path / "ckpt")

    class Broken:
        def save_pretrained(self, *a, **k):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(Broken(), tok, tmp_path / "ckpt")
    assert dir_digest(tmp_path / "ckpt")[0] == good.sha256
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_load_checkpoint_rejects_non_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
