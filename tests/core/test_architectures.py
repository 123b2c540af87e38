"""The architecture matrix: small random-initialised Llama, Qwen2/3, Mistral, Gemma 1-3, Phi/Phi3 and GPT-2 models
through the continuous engine (token-for-token against transformers `generate`), the sync, one_step_off and async
run modes, the rollout server over real HTTP, and evals; what the engines cannot run is refused by validate."""

from __future__ import annotations

import json
import warnings

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from factory.architectures import architecture_problem, attention_window
from factory.cli import main
from factory.config import parse_spec
from factory.core.evaluate import evaluate
from factory.core.loop import train_rl
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.rollout.server.app import launch_server
from factory.models.build import policy_positions
from factory.models.tokenizer import build_tokenizer
from factory.presets import PRESETS
from factory.problem import Problem

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt2"]
FAST_RUN_ARCHS = {"llama", "gpt2"}  # the run modes and the server for the rest are in the slow tier
PROMPTS = ["1+2=", "123+456=", "99*9=", "7", "5555+5555=", "1-1=", "2*3*4*5="]
PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(8)]
TOK = build_tokenizer()


def tiny_config(arch: str, **extra) -> PretrainedConfig:
    """A 2-layer, 32-wide config of `arch` over the character tokenizer's vocabulary."""
    ids = {"vocab_size": len(TOK), "pad_token_id": TOK.pad_token_id, "bos_token_id": TOK.bos_token_id,
           "eos_token_id": TOK.eos_token_id, "tie_word_embeddings": True}
    if arch == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=128, **ids, **extra)
    dims = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 128}
    if arch != "phi":  # Phi derives head_dim from hidden_size / heads
        dims["head_dim"] = 8
    return AutoConfig.for_model(arch, **dims, **ids, **extra)


def tiny_model(arch: str, seed: int = 0, **extra) -> PreTrainedModel:
    """A random model with large weights: greedy outputs depend on the context and often end in eos."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **extra), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3, generator=g)
    model.generation_config.pad_token_id = TOK.pad_token_id
    model.generation_config.eos_token_id = None  # `reference_greedy` says when generate stops at eos
    return model.eval()


def reference_greedy(model: PreTrainedModel, prompt: list[int], max_new: int, stop_at_eos: bool = True) -> list[int]:
    """transformers' greedy `generate`; without `stop_at_eos` it runs all `max_new` tokens."""
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=TOK.pad_token_id,
                              eos_token_id=TOK.eos_token_id if stop_at_eos else None)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    ref = out[0, ids.shape[1]:].tolist()
    return ref[: ref.index(TOK.eos_token_id) + 1] if stop_at_eos and TOK.eos_token_id in ref else ref


def staggered_greedy(eng: ContinuousEngine, prompts: list[list[int]], max_new: list[int],
                     ignore_eos: bool = False) -> list:
    """Submit one request per decode step while earlier ones run (rows join and leave); the completions."""
    futures = []
    for p, m in zip(prompts, max_new, strict=True):
        futures.append(eng.submit(p, SamplingParams(greedy=True, max_new_tokens=m, ignore_eos=ignore_eos)))
        eng.step()
    while not all(f.done() for f in futures):
        assert eng.step()
    return [f.result() for f in futures]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_equals_generate_and_warns_nothing(arch):
    model = tiny_model(arch)
    # 3 slots for 7 prompts of mixed lengths, and a KV buffer that starts 8 columns wide: rows are refilled,
    # new prompts shift the layout, finished rows are compacted away and the buffer grows.
    eng = ContinuousEngine(model, TOK, max_batch=3, kv_capacity=8)
    prompts = [TOK(p).input_ids for p in PROMPTS]
    max_new = [14, 5, 11, 16, 3, 12, 8]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # eos is ignored so that every row runs its full length whatever the random weights favour
        comps = staggered_greedy(eng, prompts, max_new, ignore_eos=True)
    deprecations = [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    assert deprecations == []  # the engine speaks transformers' current cache API (`cache=`)
    for p, m, c in zip(prompts, max_new, comps, strict=True):
        assert c.token_ids == reference_greedy(model, p, m, stop_at_eos=False), (arch, TOK.decode(p))
    assert eng.stats.max_running == 3 and eng.stats.prefills >= 3 and eng.running == 0  # rows joined running ones


def test_sliding_window_caps_the_engine_at_the_window():
    # Gemma 3 interleaves sliding-window layers; with sequences no longer than the window the sliding mask is
    # the full causal mask, so the engine is exact up to the window and refuses anything longer.
    model = tiny_model("gemma3_text", sliding_window=12)
    assert attention_window(model.config) == 12
    eng = ContinuousEngine(model, TOK, max_batch=2)
    assert eng.max_seq_len == 12
    prompts = [TOK(p).input_ids for p in PROMPTS[:4]]
    max_new = [12 - len(p) for p in prompts]  # each sequence fills the window exactly
    for p, m, c in zip(prompts, max_new, staggered_greedy(eng, prompts, max_new), strict=True):
        assert c.token_ids == reference_greedy(model, p, m)
    with pytest.raises(ValueError, match="maximum context length is 12"):
        eng.check(prompts[1], SamplingParams(max_new_tokens=13 - len(prompts[1])))


def test_the_run_context_stops_at_the_sliding_window():
    # the overlapped modes size prompts + completions by policy_positions, so a windowed model's run is refused
    # up front (build.check_prompt_fits) instead of failing requests mid-run
    assert policy_positions(run_spec("async").model, tiny_model("mistral", sliding_window=16)) == 16
    assert policy_positions(run_spec("async").model, tiny_model("llama")) == PRESETS["micro"].max_positions


def run_spec(mode: str, engine: str = "embedded"):
    return parse_spec({"seed": 0, "model": {"preset": "micro"},
                       "algorithm": {"group_size": 4, "lr": 0.01},
                       "rollout": {"prompts_per_step": 4, "max_new_tokens": 3, "engine": engine},
                       "trainer": {"threads": 1},
                       "schedule": {"steps": 2, "mode": mode, "wait_timeout_s": 120},
                       "buffer": {"policy": "bound", "max_staleness": 1}})


def _run_cases():
    for arch in ARCHS:
        for mode, engine in (("sync", "embedded"), ("one_step_off", "embedded"), ("async", "embedded"),
                             ("async", "server")):
            # the server case runs `factory serve` in its own process (~10 s to start): slow for every arch
            slow = arch not in FAST_RUN_ARCHS or mode == "one_step_off" or engine == "server"
            yield pytest.param(arch, mode, engine, id=f"{arch}-{mode}-{engine}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("arch,mode,engine", list(_run_cases()))
def test_a_two_step_run_in_each_mode(arch, mode, engine):
    model = tiny_model(arch)
    records = train_rl(run_spec(mode, engine), model, TOK, PROBLEMS)
    assert [r.step for r in records] == [1, 2]
    assert [r.weight_version for r in records] == [1, 2]
    assert all(not r.rejected for r in records)  # None in sync mode (no buffer)
    # the sampler's logprobs of what it sampled equal the trainer's on the same weights (measured per step)
    assert max(r.logprob_mismatch for r in records) < 1e-4


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in FAST_RUN_ARCHS else [pytest.mark.slow])
                                  for a in ARCHS])
def test_one_request_through_the_rollout_server(arch):
    model = tiny_model(arch)
    prompt = TOK(PROMPTS[1]).input_ids
    with launch_server(ContinuousEngine(model, TOK, max_batch=4, name=arch)) as handle:
        r = httpx.post(handle.url + "/v1/completions", timeout=60,
                       json={"model": arch, "prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["token_ids"] == reference_greedy(model, prompt, 10)


@pytest.mark.parametrize("arch", ARCHS)
def test_evals_agree_between_the_embedded_and_continuous_engines(arch):
    model = tiny_model(arch)
    problems = [Problem(id=f"e{i}", prompt=p, answer="", op="add", digits=1) for i, p in enumerate(PROMPTS)]
    base = evaluate(EmbeddedEngine(model, TOK), TOK, problems, max_new_tokens=6, k=2, seed=1)
    cont = evaluate(ContinuousEngine(model, TOK, max_batch=4), TOK, problems, max_new_tokens=6, k=2, seed=1)
    assert base.n == cont.n == len(problems) and base.pass_at_k is not None and cont.pass_at_k is not None
    assert cont.accuracy == base.accuracy  # greedy: the same completions, so the same verdicts


@pytest.mark.parametrize("arch", ARCHS)
def test_every_matrix_architecture_is_accepted(arch):
    config = tiny_config(arch).to_dict()
    config["architectures"] = [AutoModelForCausalLM.from_config(tiny_config(arch)).__class__.__name__]
    assert architecture_problem(config) is None


REFUSED = {
    "recurrent": ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}, "MambaForCausalLM (mamba)"),
    "hybrid": ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                "layer_types": ["linear_attention", "full_attention"]}, "Qwen3NextForCausalLM"),
    "chunked": ({"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"],
                 "layer_types": ["chunked_attention", "full_attention"]}, "['chunked_attention']"),
    "encoder-decoder": ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                         "is_encoder_decoder": True}, "encoder-decoder"),
    "multimodal": ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                    "text_config": {}}, "multimodal"),
    "not a causal LM": ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "not a causal LM"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_validate_refuses_what_the_engines_cannot_run(case, tmp_path, capsys):
    config, expected = REFUSED[case]
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer_config.json").write_text("{}")  # validate looks for tokenizer files; it loads none
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: micro}\n")
    assert main(["validate", str(spec), "--set", f"model.path={d}"]) != 0
    err = capsys.readouterr().err
    assert "model.path" in err and config["architectures"][0] in err and expected in err, err


def test_validate_accepts_a_sliding_window_model(tmp_path, capsys):
    d = tmp_path / "model"
    d.mkdir()
    config = tiny_config("gemma2").to_dict()
    config["architectures"] = ["Gemma2ForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer_config.json").write_text("{}")  # validate looks for tokenizer files; it loads none
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: micro}\n")
    assert main(["validate", str(spec), "--set", f"model.path={d}"]) == 0, capsys.readouterr().err
