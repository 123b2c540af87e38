"""Code rewards and the calculator tool run in the sandbox pool; a code-generation run and a tool-use run train
through the async core. Skipped where bubblewrap cannot run, unless FACTORY_REQUIRE_SANDBOX=1 (CI)."""


import pytest

from factory.config import TaskSpec, parse_spec
from factory.envs import pool, tasks
from factory.envs.tasks import code_reward, make_task_splits
from factory.envs.tools import calculator, calculator_program, run_tool


@pytest.fixture(autouse=True, scope="module")
def _sandbox(require_sandbox):
    yield
    if pool._POOL is not None:
        pool._POOL.close()
        pool._POOL = None


def test_calculator_runs_in_the_sandbox():
    assert calculator_program("007+1=") == "print(7+1)"
    assert calculator_program("__import__('os')=") is None and run_tool("import os=") == "error"
    before = tasks.sandbox_pool().metrics()["executions"]
    assert run_tool("12+30*2-5=") == calculator("12+30*2-5=") == "67"
    assert tasks.sandbox_pool().metrics()["executions"] == before + 1


@pytest.mark.slow
def test_code_reward_is_the_unit_test_pass_rate():
    splits = make_task_splits(TaskSpec(name="code", n_train=16, n_eval=8), 0)
    p = next(x for x in splits.train + splits.eval if x.id.endswith("-maximum"))
    assert code_reward(p.answer, p) == 1.0
    assert code_reward("    return a\n", p) == pytest.approx(2 / 3)  # maximum(5, -1) and maximum(3, 3) pass
    assert code_reward("    while True: pass\n", p) == 0.0  # the sandbox's limits end it; scored 0
    assert code_reward("    import os; os.kill(os.getppid(), 9)\n", p) == 0.0
    assert code_reward(p.answer, p) == 1.0  # the pool still serves


def small(spec: dict) -> dict:
    return {"seed": 0, "model": {"preset": "micro"}, "trainer": {"threads": 1},
            "algorithm": {"group_size": 4, "lr": 0.01}, "buffer": {"policy": "bound", "max_staleness": 2},
            "schedule": {"mode": "async", "steps": 3, "wait_timeout_s": 180}, **spec}


@pytest.mark.slow
def test_a_code_generation_run_trains_through_the_async_core():
    from factory.core.loop import train_rl
    from factory.models.build import build_model
    from factory.models.tokenizer import tokenizer_for

    s = parse_spec(small({"model": {"preset": "micro", "max_positions": 128},
                          "task": {"name": "code", "n_train": 16, "n_eval": 8},
                          "rollout": {"prompts_per_step": 4, "max_new_tokens": 12}}))
    splits = make_task_splits(s.task, s.seed)
    tok = tokenizer_for("code")
    model = build_model("micro", tok, seed=0, max_positions=s.model.max_positions)
    before = tasks.sandbox_pool().metrics()["executions"]
    records = train_rl(s, model, tok, splits.train)
    assert [r.step for r in records] == [1, 2, 3]
    assert all(0.0 <= r.reward_mean <= 1.0 and r.logprob_mismatch < 1e-4 for r in records)
    # every completion was scored by running it in the pool: 3 steps x 4 prompts x 4 samples at least
    assert tasks.sandbox_pool().metrics()["executions"] - before >= 3 * 4 * 4


@pytest.mark.slow
def test_a_tool_use_run_trains_through_the_async_core():
    """A policy first taught to echo its prompt (an expression ending in '=', i.e. a calculator call) calls the
    tool; the tool's reply is in the episode's tokens but never in the loss."""
    from factory.config import SFTSpec
    from factory.core.loop import train_rl
    from factory.core.producers.server import ServerProducer
    from factory.core.sft import run_sft
    from factory.data.feed import feed_of
    from factory.envs.arithmetic import make_splits
    from factory.models.build import build_model
    from factory.models.tokenizer import tokenizer_for
    from factory.problem import Problem

    s = parse_spec(small({"task": {"digits": [1], "n_train": 20, "n_eval": 8, "environment": "calculator_tool",
                                   "episode_timeout_s": 60},
                          "rollout": {"engine": "server", "prompts_per_step": 4, "max_new_tokens": 4,
                                      "temperature": 0.3}}))
    splits = make_splits(s.task, s.seed)
    tok = tokenizer_for("arithmetic")
    model = build_model("micro", tok, seed=0)
    echo = [Problem(id=p.id, prompt=p.prompt, answer=p.prompt, op=p.op, digits=p.digits) for p in splits.train]
    run_sft(model, tok, echo, SFTSpec(steps=300, batch_size=16, lr=3e-3, stop_at_accuracy=None), seed=0)
    producer = ServerProducer(s, model, tok, feed_of(splits.train, s.seed), 0)
    seen = []
    original = producer.next_batch
    producer.next_batch = lambda step: seen.extend(g := original(step)) or g
    records = train_rl(s, model, tok, splits.train, producer=producer)
    assert [r.step for r in records] == [1, 2, 3]
    samples = [x for g in seen for x in g.samples]
    assert len(samples) == 3 * 4 * 4
    with_tool = [x for x in samples if x.meta["turns"] > 1]
    assert len(with_tool) >= len(samples) // 2, [x.meta for x in samples[:4]]  # the echo policy calls the tool
    for x in samples:
        masked_out = [t for t, m in zip(x.token_ids, x.mask, strict=True) if not m]
        if x.meta["turns"] == 1:
            assert not masked_out  # one reply: every token is the model's
            continue
        # the tool's reply (what the calculator printed for the model's call) is exactly what is masked out
        first_reply = tok.decode([t for t, m in zip(x.token_ids, x.mask, strict=True) if m][: x.mask.index(0)],
                                 skip_special_tokens=True)
        assert tok.decode(masked_out, skip_special_tokens=True) == calculator(first_reply), (first_reply, x)
        assert all(lp == 0.0 for lp, m in zip(x.logprobs, x.mask, strict=True) if not m)


def test_the_spec_sizes_the_pool_and_isolation_none_is_explicit_and_loud(caplog, monkeypatch):
    import logging

    from factory.envs import sandbox as sandbox_mod
    from factory.envs.workers import make_environment

    monkeypatch.setattr(sandbox_mod, "_WARNED_UNISOLATED", False)  # warned once per process: see it here

    make_environment(0.0, "in_process", sandbox_workers=2, sandbox_isolation="bwrap")
    assert tasks.sandbox_pool().metrics()["warm"] + tasks.sandbox_pool().metrics()["busy"] == 2
    with caplog.at_level(logging.WARNING):
        make_environment(0.0, "in_process", sandbox_workers=1, sandbox_isolation="none")
        pool = tasks.sandbox_pool()
        assert pool.run("print(6 * 7)").stdout == "42\n"
    assert any("untrusted code is NOT isolated" in r.getMessage() for r in caplog.records
               if r.levelno >= logging.WARNING)
    make_environment(0.0, "in_process", sandbox_workers=4, sandbox_isolation="bwrap")  # back to the default
    assert parse_spec({"task": {"sandbox_isolation": "none"}}).task.sandbox_isolation == "none"
    with pytest.raises(Exception, match="sandbox_isolation"):
        parse_spec({"task": {"sandbox_isolation": "docker"}})
