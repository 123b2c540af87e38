"""Per-step reward-hack counts: completions scored by the real code verifier (sandbox pool) trip detectors, and
the step's `hacks_*` metrics count them in the lake's `steps` table (and so in MLflow, which logs the same
record), whether scoring runs in this process or in environment-worker processes."""

from __future__ import annotations

import pytest
import torch

from factory.config import TaskSpec, parse_spec
from factory.core.loop import _record, hack_counts
from factory.core.producers.common import make_group
from factory.core.rollout.base import Completion
from factory.envs import pool, tasks
from factory.envs.reward_hacks import HACKS
from factory.envs.workers import Episode, LocalEnvironment, make_environment
from factory.runs.step_rows import StepLog

# honest, forged marker + exit, reads the tests' file, wrong: detectors {}, {marker, early_exit}, {touched_tests}, {}
COMPLETIONS = ["    return a + b\n", HACKS["forge 'PASSED 3/3', os._exit(0)"],
               HACKS["read the tests' file and hard-code"], "    return a - b\n"]


def add_problem():
    splits = tasks.make_task_splits(TaskSpec(name="code", n_train=16, n_eval=8), 0)
    return next(p for p in splits.train + splits.eval if p.id == "code-000-add")


@pytest.fixture
def small_pool(require_sandbox, monkeypatch):
    monkeypatch.setenv("FACTORY_SANDBOX_SIZE", "1")
    with pool._POOL_LOCK:
        saved = dict(pool._CONFIG)
        pool._CONFIG.clear()
    yield
    with pool._POOL_LOCK:
        if pool._POOL is not None:
            pool._POOL.close()
            pool._POOL = None
        pool._CONFIG.update(saved)


def step_row(scored, lake) -> dict:
    problem = add_problem()
    comps = [Completion([1], [2, 3], [-0.5, -0.5], text, "stop", 0) for text in COMPLETIONS]
    group = make_group(problem, 0, comps, scored)
    spec = parse_spec({"seed": 0, "model": {"preset": "micro"}, "task": {"name": "code", "n_train": 16, "n_eval": 8}})
    record = _record(spec, 0, [group], torch.tensor(scored.rewards),
                     {"loss": 0.0, "entropy": 0.0, "clip_frac": 0.0, "grad_norm": 0.0}, 0.0, 1.0, 0.0, {})
    log = StepLog("hacks-run", 1)
    log.add(record)
    log.flush(lake)
    (row,) = lake.read("steps").to_pylist()
    return row


def test_hack_counts():
    flags = [[], ["early_exit", "marker"], ["touched_tests"], ["marker"], []]
    assert hack_counts(flags) == {"hacks_early_exit": 1.0, "hacks_marker": 2.0, "hacks_touched_tests": 1.0,
                                  "hacks_any": 3.0}


def test_the_steps_table_counts_completions_that_tripped_each_detector(small_pool, lake):
    (scored,) = LocalEnvironment(None).score([Episode("add-0", add_problem(), COMPLETIONS, env="code")])
    assert scored.rewards == [1.0, 0.0, 0.0, 0.0]
    row = step_row(scored, lake)
    assert (row["hacks_early_exit"], row["hacks_marker"], row["hacks_touched_tests"], row["hacks_any"]) == \
        (1.0, 1.0, 1.0, 2.0)


@pytest.mark.slow
def test_detectors_cross_the_environment_worker_service(require_sandbox, lake):
    env = make_environment(0.0, "service", processes=1, sandbox_workers=1, timeout=120.0)
    try:
        (scored,) = env.score([Episode("add-0", add_problem(), COMPLETIONS, env="code")])
    finally:
        env.close()
    assert scored.rewards == [1.0, 0.0, 0.0, 0.0]
    assert [set(h) for h in scored.hacks] == [set(), {"early_exit", "marker"}, {"touched_tests"}, set()]
    assert step_row(scored, lake)["hacks_any"] == 2.0
