"""The `math_verify` verifier: a math answer scored by Hugging Face's math-verify against the row's gold answer.

The answer is the completion's *final* answer, not its whole text: the content of its last `\\boxed{...}`
(braces balanced, so `\\boxed{\\frac{1}{2}}` is whole), else of its last `<answer>...</answer>`; a completion
with neither scores 0. Gold and answer are each parsed by `math_verify.parse` as the content of a `\\boxed{}`,
and the reward is 1.0 when `math_verify.verify(gold, answer)` holds, else 0; it never raises.

Time is bounded on any thread: math-verify's own timeouts use SIGALRM, which works only on a main thread (off
it, parse raises) and cannot interrupt a computation that holds the GIL (a helper thread's deadline cannot
either: `\\boxed{9^{9^{9^{9^{9}}}}}` held one for minutes). So checks run in a checker process (started
once, reused; math-verify's timeouts active on its main thread), and one with no verdict within
3 * `MATH_TIMEOUT_S` is killed and scores 0. The process costs one interpreter with sympy (~100 MB).
"""

from __future__ import annotations

import atexit
import json
import re
import select
import subprocess
import sys
import threading

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


# The checker process: math-verify on its own main thread (so its SIGALRM timeouts work), one JSON line in
# ({"gold", "answer"}), one line out ("1" equal, "0" not or failed). Self-contained: it imports only math-verify.
_CHECKER = r"""
import json, sys
try:
    from math_verify import parse, verify
except ImportError:
    sys.exit(3)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        g = parse("\\boxed{" + req["gold"] + "}", parsing_timeout=req["timeout"])
        a = parse("\\boxed{" + req["answer"] + "}", parsing_timeout=req["timeout"])
        ok = bool(g) and bool(a) and bool(verify(g, a, timeout_seconds=req["timeout"]))
    except BaseException:
        ok = False
    print("1" if ok else "0", flush=True)
"""


class _Checker:
    """One checker process, started on first use and reused; a check past its deadline kills it (math-verify's
    own alarm cannot interrupt a computation that holds the GIL in C, e.g. a huge power) and the next check
    starts a fresh one. Thread-safe: checks take turns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _CHECKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        if proc.stdout.readline().strip() != "ready":
            proc.wait()
            raise ImportError(f"the math_verify verifier needs the math-verify package: pip install "
                              f"'factory[{EXTRA}]'")
        return proc

    def check(self, gold: str, answer: str, timeout_s: float) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            proc.stdin.write(json.dumps({"gold": gold, "answer": answer, "timeout": max(1, int(timeout_s))}) + "\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s * 3)  # parse, parse, verify
            line = proc.stdout.readline() if ready else ""
            if line.strip() not in ("0", "1"):  # past the deadline, or the process died: a fresh one next time
                proc.kill()
                proc.wait()
                self._proc = None
                return False
            return line.strip() == "1"

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None


_CHECKER_PROCESS = _Checker()
atexit.register(_CHECKER_PROCESS.close)


def math_verify_reward(completion: str, problem: Problem) -> float:
    """1.0 iff the completion's final answer is mathematically equal to `problem.answer`; 0 otherwise, for
    anything (no answer, unparsable, timed out, an error inside math-verify)."""
    answer = final_answer(completion)
    if answer is None or not problem.answer.strip():
        return 0.0
    try:
        return 1.0 if _CHECKER_PROCESS.check(problem.answer.strip(), answer, MATH_TIMEOUT_S) else 0.0
    except (OSError, ValueError, ImportError):  # no checker process (or its pipe broke): 0, never a raise
        return 0.0
