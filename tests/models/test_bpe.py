"""The BPE model directory builder (factory/models/bpe.py): a real byte-level BPE tokenizer with digits split one
per token, a ChatML chat template, and a directory that plain transformers loads."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from factory.models.bpe import BOS, CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, build_bpe_tokenizer


@pytest.fixture(scope="module")
def tok(bpe_model_dir):
    return AutoTokenizer.from_pretrained(bpe_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("text", ["321+654=", "999*999=", "7-3=", "000+1=", "123456+654321="])
def test_arithmetic_round_trips_with_one_token_per_digit(tok, text):
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    pieces = tok.convert_ids_to_tokens(ids[1:])
    assert pieces == list(text)  # every digit and operator its own token
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_words_merge_into_subwords_and_numbers_still_split(tok):
    text = "Chen has 25 books and gets 24 more. How many books does Chen have now?"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) < len(text) / 2  # real merges: far fewer tokens than characters
    pieces = tok.convert_ids_to_tokens(ids)
    assert "2" in pieces and "5" in pieces and not any(len(p.strip("Ġ")) > 1 and p.strip("Ġ").isdigit()
                                                         for p in pieces)
    assert tok.decode(ids) == text


def test_special_tokens_and_vocab(tok, bpe_model_dir):
    # eos ends a reply (ChatML's end of turn, as Qwen's instruct tokenizers have it)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, IM_END)
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    for t in (IM_START, IM_END, EOS):  # special: one token each, never split
        assert len(tok(t, add_special_tokens=False).input_ids) == 1
    assert len(tok) == 512
    config = json.loads((bpe_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == len(tok)
    assert config["eos_token_id"] == tok.eos_token_id


def test_chat_template_renders_a_conversation(tok):
    assert tok.chat_template == CHAT_TEMPLATE
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+34="},
            {"role": "assistant", "content": "46"}, {"role": "user", "content": "5+5="}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n"
                    "<|im_start|>assistant\n46<|im_end|>\n<|im_start|>user\n5+5=<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 5
    assert ids.count(tok.convert_tokens_to_ids(IM_END)) == 4


def test_plain_transformers_loads_the_directory(bpe_model_dir, tok):
    import torch

    model = AutoModelForCausalLM.from_pretrained(bpe_model_dir)  # no trust_remote_code
    assert model.config.model_type == "qwen2"
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    ids = torch.tensor([tok("12+34=").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_same_seed_same_directory_bytes(tmp_path, bpe_model_dir):
    from factory.models.bpe import build_bpe_model_dir

    again = build_bpe_model_dir(tmp_path / "again", seed=0)
    for name in ("tokenizer.json", "config.json", "model.safetensors", "chat_template.jinja"):
        assert (again / name).read_bytes() == (bpe_model_dir / name).read_bytes(), name


def test_another_seed_trains_on_other_arithmetic_lines():
    a, c = build_bpe_tokenizer(seed=0, vocab_size=300), build_bpe_tokenizer(seed=1, vocab_size=300)
    assert a.backend_tokenizer.to_str() != c.backend_tokenizer.to_str()
    text = "Chen has 25 books and gets 24 more."
    assert c("321+654=").input_ids == a("321+654=").input_ids  # digits are single bytes whatever the corpus
    assert c.decode(c(text).input_ids, skip_special_tokens=True) == text


def test_cli_writes_the_directory_and_will_not_overwrite_one(tmp_path, capsys):
    from factory.cli import main

    out = tmp_path / "m"
    assert main(["bpe-model", str(out), "--preset", "micro", "--vocab-size", "300"]) == 0
    assert f"--set model.path={out}" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 300
    assert main(["bpe-model", str(out)]) == 2
    assert "exists and is not empty (--force writes over it)" in capsys.readouterr().err
