"""Bring your own model (factory/models/hf.py, build.policy_for, `model.path` in the spec): a local HF directory
loads with its own tokenizer, bad directories are refused naming the path, and it trains (SFT, GRPO)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from factory.cli import main
from factory.config import SFTSpec, apply_overrides, load_spec, parse_spec
from factory.core.sft import run_sft
from factory.envs.tasks import make_task_splits
from factory.models.bpe import IM_END, build_bpe_model_dir
from factory.models.build import policy_for
from factory.models.hf import ModelDirError, load_model_dir

QUICKSTART = "examples/quickstart.yaml"


def quickstart_with(path, **overrides):
    return apply_overrides(load_spec(QUICKSTART), {"model.path": str(path), **overrides})


def test_loads_the_model_and_its_own_tokenizer(bpe_model_dir):
    model, tok = load_model_dir(bpe_model_dir)
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert tok.eos_token == IM_END and tok.pad_token_id not in (None, tok.eos_token_id)
    assert tok.padding_side == "left"
    assert tok.convert_ids_to_tokens(tok("12+34=").input_ids[1:]) == list("12+34=")


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelDirError, match=f"no such directory: {tmp_path / 'nope'}"):
        load_model_dir(tmp_path / "nope")


def test_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelDirError, match=f"not a directory: {f}"):
        load_model_dir(f)


def test_no_config_json_is_named(tmp_path, bpe_model_dir):
    d = shutil.copytree(bpe_model_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelDirError, match=f"no config.json in {d}"):
        load_model_dir(d)


def test_no_tokenizer_files_is_named(tmp_path, bpe_model_dir):
    d = shutil.copytree(bpe_model_dir, tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()
    with pytest.raises(ModelDirError, match=f"no tokenizer files in {d}"):
        load_model_dir(d)


def test_a_config_declaring_quantized_weights_is_refused_before_loading(tmp_path, bpe_model_dir):
    """transformers would load it marked quantized and refuse to save it after training: refused up front (a
    GGUF-loaded model saved with its config untouched looks like this)."""
    d = shutil.copytree(bpe_model_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match=f"{d / 'config.json'} declares a quantized model .*quant_method gguf"):
        load_model_dir(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match=f"cannot read {d / 'config.json'} as JSON"):
        load_model_dir(d)


def _edit_tokenizer_config(d, **changes):
    # null, not absent: an absent token takes the tokenizer class's default (Qwen2's is <|endoftext|>)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | changes))


def test_a_tokenizer_without_eos_is_refused(tmp_path, bpe_model_dir):
    d = shutil.copytree(bpe_model_dir, tmp_path / "m")
    _edit_tokenizer_config(d, eos_token=None)
    with pytest.raises(ModelDirError, match=f"the tokenizer in {d} has no eos token"):
        load_model_dir(d)


def test_a_tokenizer_without_pad_pads_with_eos(tmp_path, bpe_model_dir):
    d = shutil.copytree(bpe_model_dir, tmp_path / "m")
    _edit_tokenizer_config(d, pad_token=None)
    _, tok = load_model_dir(d)
    assert tok.pad_token_id == tok.eos_token_id is not None


def test_max_positions_beyond_the_model_is_refused(bpe_model_dir):
    with pytest.raises(ModelDirError, match=f"must be <= 128, the max_position_embeddings of the model in "
                                            f"{bpe_model_dir}, got 256"):
        load_model_dir(bpe_model_dir, max_positions=256)


def test_set_model_path_on_the_quickstart_validates_with_a_note(bpe_model_dir, capsys):
    assert main(["validate", QUICKSTART, "--set", f"model.path={bpe_model_dir}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"note: model.preset 'tiny' is ignored: model.path {bpe_model_dir} is the model"
    assert main(["validate", QUICKSTART]) == 0
    assert "ignored" not in capsys.readouterr().out  # no path, no note
    # The preset left to its default is not "given": a path alone gets no note, through --set too.
    assert apply_overrides(parse_spec({}), {"model.path": str(bpe_model_dir)}).model.ignored_preset() is None


def test_preset_spec_dumps_as_before(bpe_model_dir):
    spec = load_spec(QUICKSTART)
    assert spec.model.model_dump() == {"preset": "tiny", "max_positions": None}  # fingerprints unchanged
    moved = quickstart_with(bpe_model_dir)
    assert moved.model.path == str(bpe_model_dir) and moved.fingerprint() != spec.fingerprint()
    assert moved.warm_start_fingerprint() != spec.warm_start_fingerprint()


def test_policy_for_switches_to_the_path_model(bpe_model_dir):
    model, tok = policy_for(quickstart_with(bpe_model_dir))
    assert len(tok) == 512 and model.config.vocab_size == 512
    preset_model, preset_tok = policy_for(load_spec(QUICKSTART))
    assert len(preset_tok) < 30 and preset_model.config.vocab_size == len(preset_tok)


def test_prompt_too_long_for_max_positions_names_it(bpe_model_dir):
    # The quickstart's longest prompt in ChatML is <|im_start|> user \n + 3 + 1 + 3 + 1 + <|im_end|> \n
    # <|im_start|> assistant \n = 16 BPE tokens; 16 + 8 new tokens > 20.
    spec = quickstart_with(bpe_model_dir, **{"model.max_positions": 20})
    with pytest.raises(ValueError, match=r"model.max_positions: .* is 16 tokens .* needs 24 positions, but the model "
                                         r"has 20 \(model.max_positions\)"):
        policy_for(spec)


def test_prompt_too_long_for_the_models_own_positions_names_it(tmp_path):
    d = build_bpe_model_dir(tmp_path / "short", seed=0, vocab_size=300, preset="micro", max_positions=16)
    with pytest.raises(ValueError, match=f"but the model has 16 \\(the max_position_embeddings of the model in {d}\\)"):
        policy_for(quickstart_with(d))


@pytest.mark.slow
def test_sft_with_the_bpe_model_lowers_the_loss(bpe_model_dir):
    spec = quickstart_with(bpe_model_dir)
    model, tok = policy_for(spec)
    splits = make_task_splits(spec.task, spec.seed)
    losses: list[float] = []
    run_sft(model, tok, splits.train, SFTSpec(steps=40, batch_size=16, lr=3e-3), seed=0,
            on_step=lambda step, m: losses.append(m["loss"]))
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_one_grpo_step_runs_with_the_bpe_model(bpe_model_dir):
    from factory.core.loop import train_rl

    spec = quickstart_with(bpe_model_dir, **{"rollout.prompts_per_step": 4, "algorithm.group_size": 2,
                                             "trainer.minibatches": 1, "schedule.steps": 2})
    model, tok = policy_for(spec)
    splits = make_task_splits(spec.task, spec.seed)
    records = train_rl(spec, model, tok, splits.train[:16])
    assert [(r.step, r.weight_version) for r in records] == [(1, 1), (2, 2)]
    # Sampler and trainer agree on the same BPE tokens (left padding, pad id, eos) to float precision.
    assert all(r.logprob_mismatch < 1e-4 and r.nonfinite == 0 for r in records)
    # An untrained model scores 0 everywhere (no advantage, so no update); what it sampled was BPE subwords,
    # decoded by the model's tokenizer: 8 tokens spell more than 8 characters.
    texts = [s["completion"] for r in records for s in r.samples]
    assert texts and max(len(t) for t in texts) > spec.rollout.max_new_tokens


@pytest.mark.slow
def test_factory_run_trains_the_path_model_end_to_end(bpe_model_dir, factory_home, capsys):
    from factory.models.checkpoint import load_checkpoint

    tiny = ["--set", "name=bpe", "--set", "task.n_train=200", "--set", "task.n_eval=24", "--set", "sft.steps=10",
            "--set", "sft.stop_at_accuracy=null", "--set", "rollout.prompts_per_step=4", "--set",
            "algorithm.group_size=2", "--set", "schedule.steps=2", "--set", "schedule.eval_pass_k=2"]
    assert main(["run", QUICKSTART, "--in-process", "--set", f"model.path={bpe_model_dir}", *tiny]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    (sft,) = [p for p in factory_home.checkpoints.glob("sft-*") if not p.name.startswith(".")]
    model, tok = load_checkpoint(sft)  # the warm start keeps the model's own tokenizer and chat template
    _, own = load_model_dir(bpe_model_dir)
    assert len(tok) == len(own) == model.config.vocab_size
    for text in ("321+654=", "Chen has 25 books."):
        assert tok(text).input_ids == own(text).input_ids
    assert tok.chat_template == own.chat_template


def test_code_shipped_in_the_directory_never_runs(tmp_path, bpe_model_dir):
    # A directory whose config asks for its own modeling code: with trust_remote_code off it is refused
    # (naming the path) and the code is never imported.
    d = shutil.copytree(bpe_model_dir, tmp_path / "m")
    marker = tmp_path / "ran"
    (d / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    cfg = json.loads((d / "config.json").read_text())
    cfg |= {"model_type": "evil", "auto_map": {"AutoConfig": "modeling_evil.EvilConfig",
                                               "AutoModelForCausalLM": "modeling_evil.EvilModel"}}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match=f"cannot load the (tokenizer|model) in {d}: it needs Python code .* "
                                            f"model.trust_remote_code is off"):
        load_model_dir(d)
    assert not marker.exists()


def test_warm_start_is_keyed_by_the_directory_contents(tmp_path):
    d = build_bpe_model_dir(tmp_path / "m", seed=0, vocab_size=300, preset="micro")
    spec = quickstart_with(d)
    before = spec.warm_start_fingerprint()
    assert quickstart_with(d).warm_start_fingerprint() == before  # same files, same key
    build_bpe_model_dir(d, seed=1, vocab_size=300, preset="micro")  # other weights saved under the same path
    assert quickstart_with(d).warm_start_fingerprint() != before
    build_bpe_model_dir(d, seed=0, vocab_size=300, preset="micro")  # the same bytes again: the same key again
    assert quickstart_with(d).warm_start_fingerprint() == before
