"""The sync GRPO loop's mechanics on a task a random micro model can learn in seconds.

Every problem's answer is the empty string, so a completion is right exactly when its first token
is <eos>: rewards are mixed from the start, and the policy has one clear thing to learn.
"""

import os

import pytest
import torch

from factory.config import parse_spec
from factory.core.loop import train_rl
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]


def spec(**algorithm):
    return parse_spec({"seed": 0, "model": {"preset": "micro"},
                       "algorithm": {"group_size": 8, "lr": 0.01, **algorithm},
                       "rollout": {"prompts_per_step": 8, "max_new_tokens": 3},
                       "trainer": {"threads": 1}, "schedule": {"steps": 25}})


@pytest.fixture
def model_and_tok():
    tok = build_tokenizer()
    return build_model("micro", tok, seed=0), tok


@pytest.mark.slow
def test_loop_records_and_learns(model_and_tok):
    model, tok = model_and_tok
    records = train_rl(spec(), model, tok, PROBLEMS)
    assert [r.step for r in records] == list(range(1, 26))
    assert [r.weight_version for r in records] == list(range(1, 26))
    assert all(r.staleness_max == 0 and r.logprob_mismatch < 1e-4 for r in records)
    assert all(0 <= r.trainer_idle_fraction <= 1 and r.tokens_per_s > 0 for r in records)
    first, last = records[0].reward_mean, sum(r.reward_mean for r in records[-5:]) / 5
    assert first < 0.5 and last > first + 0.3, (first, last)


def test_kl_to_reference_is_zero_then_positive(model_and_tok):
    model, tok = model_and_tok
    records = train_rl(spec(kl_coef=0.1).model_copy(update={"schedule": spec().schedule.model_copy(
        update={"steps": 4})}), model, tok, PROBLEMS)
    assert records[0].kl < 1e-6 < records[-1].kl


def test_metrics_not_measured_are_none_not_zero(model_and_tok):
    # kl_coef 0: no KL is computed; grpo: no dynamic-sampling filter; add problems: no reward-hack detector
    model, tok = model_and_tok
    records = train_rl(spec().model_copy(update={"schedule": spec().schedule.model_copy(update={"steps": 2})}),
                       model, tok, PROBLEMS)
    assert [(r.kl, r.filtered, r.hacks_any) for r in records] == [(None, None, None)] * 2
    assert all(r.loss is not None and r.nonfinite == 0.0 for r in records)


def test_resuming_at_a_step_numbers_records_from_there(model_and_tok):
    model, tok = model_and_tok
    s = spec().model_copy(update={"schedule": spec().schedule.model_copy(update={"steps": 12})})
    assert [r.step for r in train_rl(s, model, tok, PROBLEMS, start_step=10)] == [11, 12]


@pytest.mark.slow
@pytest.mark.parametrize("mode,buffer", [
    ("one_step_off", {}),
    ("async", {"policy": "bound", "max_staleness": 2}),
    ("async", {"policy": "importance", "max_staleness": 2}),
    ("async", {"policy": "bound", "max_staleness": 2, "correct_stale": True}),
])
def test_overlapped_modes_learn_within_their_staleness(model_and_tok, mode, buffer):
    model, tok = model_and_tok
    # Which weights generate which group depends on thread timing here, so runs differ. At lr 0.01 one run in ten
    # of one_step_off collapsed to reward 0 on a loaded 2-core machine; at 0.005, 14 of 14 (and 5 of 5 of each
    # async case) ended 0.58 or more above the first step.
    s = spec(lr=0.005).model_copy(update={
        "schedule": spec().schedule.model_copy(update={"mode": mode, "wait_timeout_s": 120}),
        "buffer": spec().buffer.model_copy(update=buffer),
    })
    records = train_rl(s, model, tok, PROBLEMS)
    assert [r.step for r in records] == list(range(1, 26))
    limit = 1 if mode == "one_step_off" else buffer["max_staleness"]
    if buffer.get("policy") != "importance":
        assert max(r.staleness_max for r in records) <= limit
    assert all(r.rejected == 0 for r in records)
    # measured after each publish, on the same weights in sampler and trainer
    assert max(r.logprob_mismatch for r in records) < 1e-4
    first, last = records[0].reward_mean, sum(r.reward_mean for r in records[-5:]) / 5
    assert last > first + 0.3, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dapo_dynamic_sampling_drops_uninformative_groups_and_still_learns(model_and_tok, mode):
    model, tok = model_and_tok
    s = spec(name="dapo").model_copy(update={"schedule": spec().schedule.model_copy(update={"mode": mode})})
    assert s.algorithm.uses_dynamic_sampling()
    records = train_rl(s, model, tok, PROBLEMS)
    first, last = records[0].reward_mean, sum(r.reward_mean for r in records[-5:]) / 5
    assert last > first + 0.3, (first, last)
    # early groups that are all wrong, late ones that are all right: dropped and counted
    assert sum(r.filtered for r in records) > 0
    assert all(r.filtered is not None for r in records)


@pytest.mark.slow
def test_rollout_server_killed_mid_run_is_restarted_and_no_group_is_lost_or_doubled(model_and_tok):
    from factory.core.producers.server import ServerProducer
    from factory.data.feed import feed_of

    model, tok = model_and_tok
    s = parse_spec({**spec().model_dump(mode="json"), "rollout": {**spec().rollout.model_dump(), "engine": "server"},
                    "schedule": {**spec().schedule.model_dump(), "mode": "async", "steps": 10, "wait_timeout_s": 120},
                    "buffer": {"policy": "bound", "max_staleness": 2}})
    producer = ServerProducer(s, model, tok, feed_of(PROBLEMS, s.seed), 0)
    trained: list[str] = []
    original_next = producer.next_batch

    def next_batch(step):
        groups = original_next(step)
        trained.extend(g.uid for g in groups)
        if step == 3:
            producer.service.kill()  # the server dies with requests in flight
        return groups

    producer.next_batch = next_batch
    records = train_rl(s, model, tok, PROBLEMS, producer=producer)
    assert producer.service.restarts == 1
    assert [r.step for r in records] == list(range(1, 11))
    assert len(trained) == len(set(trained)) == 10 * s.rollout.prompts_per_step  # none doubled, every step full
    assert all(r.rejected == 0 for r in records)  # nothing dropped as stale after the restart either
    assert max(r.logprob_mismatch for r in records) < 1e-4  # the restarted server got the current weights


@pytest.mark.slow
def test_environment_worker_killed_mid_run_is_restarted_and_no_group_is_lost_or_doubled(model_and_tok):
    """Trainer, rollout server and environment workers in three processes; the environment dies mid-run."""
    from factory.core.producers.server import ServerProducer
    from factory.data.feed import feed_of

    model, tok = model_and_tok
    s = parse_spec({**spec().model_dump(mode="json"),
                    "rollout": {**spec().rollout.model_dump(), "engine": "server", "environment": "service"},
                    "task": {**spec().task.model_dump(), "simulated_latency_s": 0.01},
                    "schedule": {**spec().schedule.model_dump(), "mode": "async", "steps": 8, "wait_timeout_s": 120},
                    "buffer": {"policy": "bound", "max_staleness": 2}})
    producer = ServerProducer(s, model, tok, feed_of(PROBLEMS, s.seed), 0)
    env_pids = {svc.pid for svc in producer.env.services}
    assert len({os.getpid(), producer.service.pid, *env_pids}) == 3
    trained: list[str] = []
    original_next = producer.next_batch

    def next_batch(step):
        groups = original_next(step)
        trained.extend(g.uid for g in groups)
        if step == 3:
            producer.env.services[0].kill()  # episodes are running in it
        return groups

    producer.next_batch = next_batch
    records = train_rl(s, model, tok, PROBLEMS, producer=producer)
    assert producer.env.services[0].restarts == 1
    assert [r.step for r in records] == list(range(1, 9))
    assert len(trained) == len(set(trained)) == 8 * s.rollout.prompts_per_step
    assert all(r.rejected == 0 for r in records)
    first, last = records[0].reward_mean, sum(r.reward_mean for r in records[-3:]) / 3
    assert last > first, (first, last)  # rewards from the worker process still teach


def test_rewards_keep_their_float64_precision():
    from types import SimpleNamespace

    from factory.core.loop import reward_tensor

    third = 1.0 / 3  # a Python float: float32 would round it (0.3333333432674408)
    rewards = reward_tensor([SimpleNamespace(reward=third), SimpleNamespace(reward=1.0)])
    assert rewards.dtype == torch.float64 and rewards[0].item() == third
