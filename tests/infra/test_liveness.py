"""Signs of life from long work (`infra/liveness.py`): pulses reach the open `beating` block's beat (at its rate),
nothing outside one; `covered` vouches for one long call from a thread, and stops vouching after its limit; and the
long phases pulse from inside: an eval per decode step and verified answer, SFT per step."""

from __future__ import annotations

import threading
import time

import torch

from factory.config import SFTSpec, TaskSpec
from factory.core.evaluate import evaluate
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.sft import run_sft
from factory.envs.tasks import make_task_splits
from factory.infra import liveness
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from tests.polling import wait_for


def test_pulses_beat_only_inside_a_beating_block_and_at_its_rate():
    beats: list[int] = []
    liveness.pulse()  # no block open: nothing to call
    with liveness.beating(lambda: beats.append(1), every_s=0.0):
        for _ in range(5):
            liveness.pulse()
        with liveness.beating(lambda: beats.append(2), every_s=3600.0):  # nested: its own beat, its own rate
            for _ in range(5):
                liveness.pulse()
        liveness.pulse()  # the outer block's beat again
    liveness.pulse()
    assert beats == [1] * 5 + [2] + [1]


def test_covered_vouches_for_a_long_call_and_stops_after_its_limit():
    beats: list[float] = []
    with liveness.beating(lambda: beats.append(time.monotonic()), every_s=0.0):
        with liveness.covered(limit_s=0.3, every_s=0.01):
            wait_for("beats from the cover thread", lambda: len(beats) >= 3, limit_s=30)
            # past its limit the thread gives up, so a call that never returns falls silent and is killed as hung
            wait_for("the cover thread to end", lambda: not any(t.name == "liveness-cover"
                                                                 for t in threading.enumerate()), limit_s=30)
            after = len(beats)
        assert len(beats) == after
    with liveness.covered(limit_s=0.3, every_s=0.01):  # no beating block: no thread at all
        assert not any(t.name == "liveness-cover" for t in threading.enumerate())


def test_evals_and_sft_pulse_from_inside():
    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    problems = make_task_splits(TaskSpec(n_train=200, n_eval=8), 0).eval
    beats: list[str] = []
    phase = ["eval"]
    with liveness.beating(lambda: beats.append(phase[0]), every_s=0.0):
        evaluate(EmbeddedEngine(model, tok), tok, problems, max_new_tokens=4, k=2, seed=0)
        phase[0] = "sft"
        run_sft(model, tok, problems, SFTSpec(steps=3, batch_size=4, stop_at_accuracy=None), seed=0)
    # an eval: a pulse per decode step of the greedy and the sampled pass, and per verified answer (8 + 2 x 8)
    assert beats.count("eval") >= 8 + 16 + 2
    # SFT: a pulse per step, and per block forward and backward (its trainer's hooks)
    assert beats.count("sft") == 3 * (1 + 2 * len(model.model.layers))


def test_a_trainer_step_pulses_block_by_block_forward_and_backward():
    # One forward and backward is one long call on a loaded machine: its blocks pulse as they finish, forward (a hook
    # per block) and backward (a hook on each block's output gradient), and the gradients are what they were.
    from factory.core.algorithms import sft_loss
    from factory.core.batch import pack
    from factory.core.trainer.torch_trainer import TorchTrainer
    from factory.models.prompting import answer_ids, prompt_ids

    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    plain = build_model("micro", tok, seed=0)
    layers = len(model.model.layers)
    problems = make_task_splits(TaskSpec(n_train=200, n_eval=8), 0).eval
    batch = pack([prompt_ids(tok, p.prompt) for p in problems], [answer_ids(tok, p.answer) for p in problems],
                 tok.pad_token_id)
    beats: list[int] = []
    trainer = TorchTrainer(model, lr=0.0)  # lr 0: the step leaves the weights as they were
    assert all(len(block._forward_hooks) == 1 for block in model.model.layers)  # the trainer hooked its blocks
    liveness.pulse_from_layers(model)  # a second time adds no hooks
    with liveness.beating(lambda: beats.append(1), every_s=0.0):
        trainer.step(batch, lambda logp, b: sft_loss(logp, b.loss_mask))
    assert len(beats) == 2 * layers  # each block's forward and its backward: no more (hooks added once)
    ref = TorchTrainer(plain, lr=0.0)
    plain.train()
    ref.step(batch, lambda logp, b: sft_loss(logp, b.loss_mask))
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad) if p.grad is not None else q.grad is None, name
