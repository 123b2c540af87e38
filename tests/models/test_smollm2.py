"""SmolLM2-135M-Instruct (a real pretrained chat model: Llama, ChatML, eos `<|im_end|>`) as the model of the tests:
it loads through `model.path`, every path that feeds it a task prompt feeds it the ids of its own chat template
(the one rule of factory/models/prompting.py), and a 2-step GRPO run with it succeeds."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch

from factory.cli import main
from factory.config import SFTSpec, apply_overrides, load_spec
from factory.core.evaluate import evaluate
from factory.core.loop import make_producer
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.sft import run_sft
from factory.data.feed import feed_of
from factory.home import FactoryPaths
from factory.models.build import policy_for
from factory.models.checkpoint import META_FILE
from factory.problem import Problem

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
PROBLEM = Problem("p0", "What is 17+25?", "42", "add", 2, {})
# Plain arithmetic for a chat model: the quickstart's reversed digits are a format for its from-scratch model.
PLAIN = {"task.reverse_answer": False, "task.reverse_operands": False, "task.digits": [2], "task.n_train": 200,
         "task.n_eval": 8, "rollout.prompts_per_step": 1, "algorithm.group_size": 2, "rollout.max_new_tokens": 4,
         "trainer.minibatches": 1}


def smollm2_spec(path, **overrides):
    return apply_overrides(load_spec(QUICKSTART), {"model.path": str(path), **PLAIN, **overrides})


@pytest.fixture(scope="module")
def smol(smollm2_dir, tmp_path_factory):
    """(model, tokenizer) loaded the way a run loads them: `policy_for` on a spec whose model.path is SmolLM2."""
    torch.manual_seed(0)
    return policy_for(smollm2_spec(smollm2_dir), FactoryPaths(tmp_path_factory.mktemp("home")))


def chat_ids(tok, text: str) -> list[int]:
    """What the model's own template makes of one user message, with the assistant's turn opened."""
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


@contextmanager
def fed(model) -> Iterator[list[list[int]]]:
    """The rows of input_ids each forward call of `model`'s decoder receives (generation calls the whole model, the
    trainer's chunked log-probs the decoder and then the head: both pass through the decoder)."""
    seen: list[list[int]] = []

    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen.extend(ids.tolist())

    handle = model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def test_smollm2_loads_through_model_path(smol, smollm2_dir):
    model, tok = smol
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings
    assert tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
    ids = chat_ids(tok, PROBLEM.prompt)
    assert tok.decode(ids).endswith(f"<|im_start|>user\n{PROBLEM.prompt}<|im_end|>\n<|im_start|>assistant\n")


def test_every_path_feeds_smollm2_its_chat_template(smol):
    """Evals, sync rollouts, the rollout server's chat rendering and SFT give the model, for the same task prompt,
    exactly the ids of `apply_chat_template([user], add_generation_prompt=True)` (SFT: followed by the answer)."""
    from factory.core.rollout.engines.continuous import ContinuousEngine
    from factory.core.rollout.server.app import RolloutServer

    model, tok = smol
    want = chat_ids(tok, PROBLEM.prompt)
    with fed(model) as seen:
        evaluate(EmbeddedEngine(model, tok), tok, [PROBLEM], max_new_tokens=2)
    assert seen[0] == want  # the first forward of generation is the whole prompt

    spec = smollm2_spec("unused")
    producer = make_producer(spec, model, tok, [PROBLEM], 0, feed=feed_of([PROBLEM]))
    with fed(model) as seen:
        (group,) = producer.next_batch(0)
    assert seen[0] == want and all(s.prompt_ids == want for s in group.samples)

    # The chat endpoint's rendering (decoding through it is test_the_rollout_server_chat_endpoint_on_smollm2).
    server = RolloutServer(ContinuousEngine(model, tok, max_batch=2))
    assert server.template.render([{"role": "user", "content": PROBLEM.prompt}], generation_prompt=True) == want

    with fed(model) as seen:
        run_sft(model, tok, [PROBLEM], SFTSpec(steps=1, batch_size=1, lr=1e-12, stop_at_accuracy=None), seed=0)
    answer = tok("42", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert seen[0] == want + answer  # one sequence: no padding


def test_the_rollout_server_chat_endpoint_on_smollm2(smol):
    """`factory serve` on SmolLM2: the chat endpoint feeds the model its template's ids for a user message."""
    from factory.core.rollout.engines.continuous import ContinuousEngine
    from factory.core.rollout.server.app import launch_server

    model, tok = smol
    with launch_server(ContinuousEngine(model, tok, max_batch=2)) as handle:
        c = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": PROBLEM.prompt}],
                                      max_tokens=2, seed=1)
    (choice,) = r.choices
    assert choice.prompt_token_ids == chat_ids(tok, PROBLEM.prompt)


@pytest.mark.slow
def test_a_two_step_grpo_run_with_smollm2_succeeds(smollm2_dir, factory_home, lake, capsys):
    overrides = {"model.path": str(smollm2_dir), **PLAIN, "sft.steps": 0, "schedule.steps": 2,
                 "schedule.eval_pass_k": 1, "rollout.prompts_per_step": 2}
    argv = ["run", str(QUICKSTART), "--in-process"]
    for k, v in overrides.items():
        argv += ["--set", f"{k}={v}"]
    assert main(argv) == 0, capsys.readouterr().err
    runs = lake.read("runs")
    (run,) = runs.to_pylist()
    assert run["status"] == "succeeded"
    steps = lake.read("steps").to_pylist()
    assert sorted(s["step"] for s in steps) == [1, 2] and all(s["loss"] == s["loss"] for s in steps)
    (sft,) = factory_home.checkpoints.glob("sft-*/" + META_FILE)  # where the weights came from is recorded
    assert json.loads(sft.read_text())["model_source"] == {"path": str(smollm2_dir), "kind": "dir",
                                                           "dir": str(smollm2_dir.resolve())}
