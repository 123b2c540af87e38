"""The `math_verify` verifier: a math answer scored by Hugging Face's math-verify against the row's gold answer.

The answer is the completion's *final* answer, not its whole text: the content of its last `\\boxed{...}`
(braces balanced, so `\\boxed{\\frac{1}{2}}` is whole), else of its last `<answer>...</answer>`; a completion
with neither scores 0. Gold and answer are each parsed by `math_verify.parse` as the content of a `\\boxed{}`,
and the reward is 1.0 when `math_verify.verify(gold, answer)` holds, else 0; it never raises.

Time is bounded: math-verify's own timeouts use SIGALRM, which works only on the main thread (off it, parse
raises). On the main thread they are used as is; in any other thread (env-worker threads, the HTTP env
service) the call runs without them in a helper thread with a deadline (`protocol.call_guarded`), and a
call past `MATH_TIMEOUT_S` scores 0.
"""

from __future__ import annotations

import re
import threading

from factory.envs.protocol import call_guarded
from factory.problem import Problem

EXTRA = "real"  # the pyproject extra that installs math-verify
MATH_TIMEOUT_S = 5  # per parse and per comparison on the main thread; per whole check elsewhere

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` with balanced braces, or None (none, or never closed)."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED):i - 1].strip()
        start = text.rfind(_BOXED, 0, start)  # an unclosed last box: the one before it
    return None


def final_answer(completion: str) -> str | None:
    """The completion's final answer: its last `\\boxed{}` content, else its last `<answer>` tag's, else None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    tags = _ANSWER_TAG.findall(completion)
    return tags[-1].strip() if tags else None


def _math_verify():
    try:
        import math_verify  # optional: the `real` extra; only math_verify-scored sources need it
    except ImportError as e:
        raise ImportError(f"the math_verify verifier needs the math-verify package: pip install "
                          f"'factory[{EXTRA}]'") from e
    return math_verify


def _equivalent(gold: str, answer: str, timeout: int | None) -> bool:
    mv = _math_verify()
    g = mv.parse(_BOXED + gold + "}", parsing_timeout=timeout)
    a = mv.parse(_BOXED + answer + "}", parsing_timeout=timeout)
    return bool(g) and bool(a) and bool(mv.verify(g, a, timeout_seconds=timeout))


def math_verify_reward(completion: str, problem: Problem) -> float:
    """1.0 iff the completion's final answer is mathematically equal to `problem.answer`; 0 otherwise, for
    anything (no answer, unparsable, timed out, an error inside math-verify)."""
    answer = final_answer(completion)
    if answer is None or not problem.answer.strip():
        return 0.0
    if threading.current_thread() is threading.main_thread():
        try:
            return 1.0 if _equivalent(problem.answer, answer, MATH_TIMEOUT_S) else 0.0
        except Exception:  # noqa: BLE001 - includes math-verify's TimeoutException: a reward never raises
            return 0.0
    result = call_guarded(lambda a: 1.0 if _equivalent(problem.answer, a, None) else 0.0, [answer],
                          MATH_TIMEOUT_S, what="math_verify")[0]
    return result.reward
