"""Reward functions that fail inside a real run (tests/ops/test_isolation_runs.py), loaded by import path."""

import sys
import threading

_never = threading.Event()


def flaky_reward(prompt: str, completion: str, **meta) -> float:
    """Raises on some completions and hangs on others (past any small timeout); 1.0 for an empty answer."""
    n = sum(map(ord, prompt + completion)) % 4
    if n == 0:
        raise ValueError("the verifier broke")
    if n == 1:
        _never.wait(3.0)  # longer than the tests' task.reward_timeout_s
        return 1.0
    return 1.0 if completion == "" else 0.0


def overflowing_reward(prompt: str, completion: str, **meta) -> float:
    """Finite in Python, but a group's sum of them overflows even in float64 (the advantages' precision, that of
    the rewards): the advantages (and the loss) become NaN."""
    return sys.float_info.max if completion == "" else -sys.float_info.max


def plain_reward(prompt: str, completion: str, **meta) -> float:
    """A well-behaved reward, for comparison with the ones above."""
    return 1.0 if completion == "" else 0.0
