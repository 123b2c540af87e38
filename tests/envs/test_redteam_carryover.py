"""Nothing one execution leaves reaches a later one on the same worker (issue 32): every oracle of
`factory.envs.redteam_carryover` (a secret planted in SysV shared memory, message queues, semaphores, POSIX
message queues and shared memory, the keyrings, files, a process left running, and counters: pids, tmpfs inode
numbers, SysV ids, a TIME_WAIT port) is not read back; the HumanEval/0 answer table never scores; 300 MB left in
shared memory breaks no later allocation. Real bubblewrap pools of one worker; skipped where bubblewrap cannot run.
"""

from __future__ import annotations

import random

import pytest

from factory.envs.redteam_carryover import ORACLES, answer_table_attack, memory_leftover, run_oracle
from factory.envs.sandbox import SandboxPool


@pytest.fixture(scope="module")
def pool(require_sandbox):
    with SandboxPool(size=1) as p:
        yield p


@pytest.mark.parametrize("oracle", ORACLES, ids=[o.name for o in ORACLES])
def test_a_planted_secret_does_not_reach_the_next_execution(pool, oracle):
    secret = f"{random.Random(oracle.name).getrandbits(128):032x}"
    outcome = run_oracle(pool, oracle, secret)
    assert outcome.contained, f"{oracle.name}: {outcome.detail}"


def test_the_humaneval_answer_table_never_scores_on_a_pool_of_one(pool):
    # Before executions had namespaces of their own, it reached 1.0 at its 4th execution here.
    assert answer_table_attack(pool, 6) == [0.0] * 6


def test_300mb_left_in_shared_memory_breaks_no_later_allocation(pool):
    # Before, with the worker's cgroup at 512 + 64 MB, every later 300 MB allocation failed ("memory limit").
    ok, reasons = memory_leftover(pool, later=3)
    assert ok == 3, reasons
