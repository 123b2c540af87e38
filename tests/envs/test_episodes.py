"""The environment protocol: loading, guarding, exact tokens from sessions, and multi-turn episodes that train
through the async core with a loss mask over the model's own tokens only."""

import asyncio

import pytest

from factory.config import parse_spec
from factory.envs.protocol import (
    EpisodeResult,
    GymAdapter,
    run_guarded,
    score_guarded,
    tokens_from_session,
)
from factory.envs.registry import load_environment
from factory.envs.tools import calculator
from factory.problem import Problem

OBS = "12"  # what the two-turn environment inserts between the model's turns


class TwoTurnEnv:
    """Gym-style: the prompt, a reply, the observation OBS, a second reply; reward 1 if it says the answer."""

    def reset(self, task):
        self.task, self.turn = task, 0
        return task["prompt"]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return OBS, 0.0, False, {}
        return "", float(action.strip() == self.task["answer"]), True, {"answer": action}


async def broken_episode(task, client):
    raise RuntimeError("the verifier crashed")


async def slow_episode(task, client):
    await asyncio.sleep(3600)


def test_loading_by_name_and_import_path():
    assert load_environment("arithmetic").kind == "single_turn"
    assert load_environment("calculator_tool").kind == "multi_turn"
    assert isinstance(load_environment("tests.envs.test_episodes:TwoTurnEnv").run_episode, GymAdapter)
    assert load_environment("tests.envs.test_episodes:broken_episode").kind == "multi_turn"
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        load_environment("nope")
    with pytest.raises(ValueError, match="cannot import 'missing'"):
        load_environment("tests.envs.test_episodes:missing")


def test_environments_resolve_through_the_registry():
    from factory.envs.registry import BUILTINS, ENVIRONMENTS

    assert BUILTINS == ("arithmetic", "calculator_tool", "python_tool")
    ENVIRONMENTS.register("shout", lambda prompt, completion, **meta: completion.isupper())
    try:
        env = load_environment("shout")
        assert env.kind == "single_turn" and env.name == "shout"
        assert score_guarded(env, "say hi", "HI").reward == 1.0
        assert load_environment("tests.envs.test_episodes:TwoTurnEnv") is load_environment(
            "tests.envs.test_episodes:TwoTurnEnv")  # resolved once
    finally:
        ENVIRONMENTS.unregister("shout")
    with pytest.raises(ValueError, match=r"^unknown environment 'shout': one of arithmetic, calculator_tool, "
                                         r"python_tool, or an import path"):
        load_environment("shout")
    with pytest.raises(ValueError, match=r"environment 'math:pi' is neither a reward function, an async "
                                         r"run_episode, nor a reset/step class \(got float\)"):
        load_environment("math:pi")


def test_a_plugins_environment_resolves_by_its_entry_point(installed_plugin):
    installed_plugin("factory.environments", two_turns="tests.envs.test_episodes:TwoTurnEnv")
    env = load_environment("two_turns")
    assert env.kind == "multi_turn" and isinstance(env.run_episode, GymAdapter)


def test_a_raising_or_slow_environment_scores_zero_with_the_reason():
    env = load_environment("arithmetic")
    assert score_guarded(env, "1+1=", "2", answer="2").reward == 1.0
    r = score_guarded(env, "1+1=", "2")  # no answer given: the reward function raises
    assert r.reward == 0.0 and "answer" in r.reason
    broken = load_environment("tests.envs.test_episodes:broken_episode")
    assert asyncio.run(run_guarded(broken, {}, None, 5)) == EpisodeResult(
        0.0, "episode raised RuntimeError: the verifier crashed")
    slow = load_environment("tests.envs.test_episodes:slow_episode")
    assert asyncio.run(run_guarded(slow, {}, None, 0.05)).reason == "episode timed out after 0.05s"


def test_calculator_tool():
    assert calculator("12+30*2-5=") == "67"
    assert calculator("import os=") == "error" and calculator("1+") == "error"


def turn(i, prompt, completion, continues=None, version=0):
    return {"turn": i, "prompt_ids": prompt, "completion_ids": completion, "logprobs": [-0.5] * len(completion),
            "token_versions": [version] * len(completion), "weight_version": version, "continues_turn": continues}


def test_tokens_from_session_masks_what_the_environment_inserted():
    t0 = turn(0, [1, 5, 6], [7, 8, 2])
    t1 = turn(1, [1, 5, 6, 7, 8, 2, 9, 9], [4, 2], continues=0, version=1)  # 9, 9: the environment's turn
    ep = tokens_from_session({"session_id": "s", "turns": [t0, t1]})
    assert ep.prompt_ids == [1, 5, 6] and ep.token_ids == [7, 8, 2, 9, 9, 4, 2]
    assert ep.mask == [1, 1, 1, 0, 0, 1, 1]
    assert ep.logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert ep.versions == [0, 1] and ep.turns == 2
    bad = turn(1, [1, 5, 6, 7, 3, 2, 9], [4], continues=0)  # claims to continue turn 0, but does not
    with pytest.raises(ValueError, match="re-tokenized"):
        tokens_from_session({"session_id": "s", "turns": [t0, bad]})
    with pytest.raises(ValueError, match="no turns"):
        tokens_from_session({"session_id": "s", "turns": []})


def test_spec_refuses_a_multi_turn_environment_without_the_rollout_server():
    from factory.config import SpecError

    with pytest.raises(SpecError, match="task.environment: a multi-turn environment talks to the rollout server"):
        parse_spec({"task": {"environment": "calculator_tool"}, "schedule": {"mode": "async"}})


PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]


@pytest.mark.slow
@pytest.mark.parametrize("medium", ["in_process", "service"])
def test_multi_turn_episodes_train_through_the_async_core(medium):
    from factory.core.loop import train_rl
    from factory.core.producers.server import ServerProducer
    from factory.data.feed import feed_of
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    s = parse_spec({"seed": 0, "model": {"preset": "micro"},
                    "task": {"environment": "tests.envs.test_episodes:TwoTurnEnv", "episode_timeout_s": 60},
                    "algorithm": {"group_size": 4, "lr": 0.01},
                    "rollout": {"engine": "server", "environment": medium, "prompts_per_step": 4, "max_new_tokens": 3},
                    "trainer": {"threads": 1}, "buffer": {"policy": "bound", "max_staleness": 2},
                    "schedule": {"mode": "async", "steps": 4, "wait_timeout_s": 120}})
    producer = ServerProducer(s, model, tok, feed_of(PROBLEMS, s.seed), 0)
    seen = []
    original = producer.next_batch

    def next_batch(step):
        groups = original(step)
        seen.extend(groups)
        return groups

    producer.next_batch = next_batch
    records = train_rl(s, model, tok, PROBLEMS, producer=producer)
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert all(r.logprob_mismatch < 1e-4 for r in records)
    samples = [x for g in seen for x in g.samples]
    assert len(samples) == 4 * 4 * 4
    obs = tok(OBS, add_special_tokens=False).input_ids
    for x in samples:
        assert x.meta["turns"] == 2
        inserted = [t for t, m in zip(x.token_ids, x.mask, strict=True) if m == 0]
        assert inserted == obs  # exactly the environment's observation is masked out
        assert sum(x.mask) == len(x.token_ids) - len(obs) > 0  # the model's two replies are trained on
        assert all(lp == 0.0 for lp, m in zip(x.logprobs, x.mask, strict=True) if m == 0)


def length_reward(prompt, completion, **meta):
    """A user's single-turn environment: rewards short completions (and sees the problem's fields)."""
    assert "answer" in meta
    return 1.0 if len(completion.strip()) <= 1 else 0.0


def test_a_single_turn_environment_by_import_path_scores_completions():
    from factory.envs.service import score_completions

    problem = PROBLEMS[0].to_dict()
    assert score_completions("tests.envs.test_episodes:length_reward", problem, ["7", "777"]) == ([1.0, 0.0],
                                                                                                 [None, None])
    rewards, reasons = score_completions("tests.envs.test_episodes:length_reward", {"prompt": "x"}, ["7"])
    assert rewards == [0.0] and reasons[0].startswith("reward raised AssertionError")  # raising: 0 with the reason
    rewards, reasons = score_completions("tests.envs.nowhere:f", problem, ["7"])
    assert rewards == [0.0] and "cannot import" in reasons[0]


def test_a_single_turn_environment_trains_in_sync_mode():
    from factory.core.loop import train_rl
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    s = parse_spec({"seed": 0, "model": {"preset": "micro"}, "task": {"environment":
                    "tests.envs.test_episodes:length_reward"}, "algorithm": {"group_size": 4, "lr": 0.01},
                    "rollout": {"prompts_per_step": 4, "max_new_tokens": 3}, "trainer": {"threads": 1},
                    "schedule": {"steps": 12}})
    records = train_rl(s, build_model("micro", tok, seed=0), tok, PROBLEMS)
    first, last = records[0].reward_mean, sum(r.reward_mean for r in records[-3:]) / 3
    assert last > first, (first, last)  # the user's reward is what it learned from


def test_a_multi_turn_environment_by_import_path_needs_the_rollout_server():
    from factory.core.loop import make_producer
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    s = parse_spec({"model": {"preset": "micro"}, "task": {"environment": "tests.envs.test_episodes:TwoTurnEnv"},
                    "schedule": {"mode": "async"}})
    with pytest.raises(ValueError, match="is multi-turn: it talks to the rollout server"):
        make_producer(s, build_model("micro", tok), tok, PROBLEMS, 0)
