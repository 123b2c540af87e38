"""LoRA through peft on tiny random-initialised models: the published adapter tensors survive the weight codec and
merge on the rollout side into exactly peft's merged weights (Linear and GPT-2's Conv1D), each version from the base;
bad target modules or updates are errors naming them; a LoRA model is checkpointed merged as a plain HF directory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from factory.config import LoraSpec
from factory.core.weights import apply_update, encode_delta, encode_full
from factory.models import lora
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      bos_token_id=0, eos_token_id=1))


def randomise_adapters(model: torch.nn.Module, seed: int) -> None:
    """B starts at zero (the adapters change nothing yet): give every adapter weight values, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


IDS = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama-linear", "gpt2-conv1d"])
def test_published_adapters_merge_on_the_rollout_side_into_peft_merged_weights(make):
    trainer_model = make()
    lora.attach(trainer_model, LoraSpec(r=4, alpha=16))
    rollout = make()  # the rollout side: a plain copy of the base, and the merger's copy of its adapted weights
    merger = lora.AdapterMerger(rollout.state_dict())
    states = []
    for version, seed in ((1, 10), (2, 11)):
        randomise_adapters(trainer_model, seed)
        adapters = lora.adapter_state(trainer_model)
        assert lora.is_adapter_state(adapters)
        # through the real codec: a full update first, then a lossless delta against it
        update = encode_full(adapters, version) if version == 1 else encode_delta(states[-1], adapters, version, 1)
        received = apply_update(states[-1] if states else None, update, 1 if states else None)
        states.append(received)
        rollout.load_state_dict({**rollout.state_dict(), **merger.merge(received)})
        expected = lora.merged_copy(trainer_model)
        for k, v in expected.state_dict().items():
            assert torch.equal(rollout.state_dict()[k], v), (version, k)  # merged from base, not on top of v1
        assert torch.equal(logits(rollout, IDS), logits(expected, IDS))
        # and the trainer's own (unmerged) forward agrees to float tolerance
        torch.testing.assert_close(logits(trainer_model, IDS), logits(expected, IDS), rtol=1e-4, atol=1e-5)


def test_target_modules_matching_nothing_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"trainer\.lora\.target_modules: \['wq'\] .*q_proj"):
        lora.attach(tiny_llama(), LoraSpec(target_modules=["wq"]))
    model = tiny_llama()
    lora.attach(model, LoraSpec(target_modules=["q_proj", "v_proj"]))
    assert sorted({n.rsplit(".", 1)[1] for n in lora.lora_layers(model)}) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.attach(model, LoraSpec())


def test_a_bad_adapter_update_names_the_module():
    merger = lora.AdapterMerger(tiny_llama().state_dict())
    a, b, s = torch.zeros(4, 32), torch.zeros(32, 4), torch.tensor(2.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="'model.nope' has adapters but the base has no model.nope.weight"):
        merger.merge({"model.nope.lora_A": a, "model.nope.lora_B": b, "model.nope.lora_scaling": s})
    with pytest.raises(ValueError, match="lacks 'model.layers.0.mlp.up_proj.lora_scaling'"):
        merger.merge({"model.layers.0.mlp.up_proj.lora_A": a, "model.layers.0.mlp.up_proj.lora_B": b})
    with pytest.raises(ValueError, match=r"B @ A is \[32, 32\], the base weight \[64, 32\]"):
        merger.merge({"model.layers.0.mlp.up_proj.lora_A": a, "model.layers.0.mlp.up_proj.lora_B": b,
                      "model.layers.0.mlp.up_proj.lora_scaling": s})


def test_detach_leaves_a_plain_model_with_the_merged_weights():
    model = tiny_llama()
    keys = list(model.state_dict())
    lora.attach(model, LoraSpec(r=2))
    randomise_adapters(model, 5)
    expected = lora.merged_copy(model)
    lora.detach(model)
    assert not lora.attached(model) and not lora.lora_layers(model)
    assert list(model.state_dict()) == keys and all(p.requires_grad for p in model.parameters())
    for k, v in expected.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_a_lora_checkpoint_is_a_plain_hf_directory_with_the_merged_weights(tmp_path):
    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    lora.attach(model, LoraSpec(r=4))
    randomise_adapters(model, 7)
    info = save_checkpoint(model, tok, tmp_path / "ckpt")
    names = sorted(p.name for p in info.path.iterdir())
    assert "model.safetensors" in names and not any("adapter" in n for n in names)  # no peft files
    loaded = AutoModelForCausalLM.from_pretrained(info.path)
    ids = torch.randint(3, tok.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(loaded, ids), logits(lora.merged_copy(model), ids))
    assert lora.attached(model)  # saving left the training model as it was


@pytest.mark.slow
def test_smollm2_lora_adapts_every_projection_and_its_merged_checkpoint_loads_in_transformers(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    lora.attach(model, LoraSpec(r=8, alpha=16))
    assert len(lora.lora_layers(model)) == 30 * 7  # q k v o gate up down in each of its 30 layers
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2_442_240
    randomise_adapters(model, 9)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    info = save_checkpoint(model, tok, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32)
    ids = torch.tensor([tok("What is 17 + 25?").input_ids])
    expected = logits(model, ids)  # the adapted model's own forward (unmerged)
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=1e-4, atol=1e-4)
    rollout = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)  # the rollout side's base
    rollout.load_state_dict({**rollout.state_dict(), **lora.AdapterMerger(rollout.state_dict()).merge(
        lora.adapter_state(model))})
    assert torch.equal(logits(rollout, ids), logits(loaded, ids))
