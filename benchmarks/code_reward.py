"""What the trusted code harness costs per completion (`factory/envs/code_harness.py`).

Scores the reference solution of each of the 24 shipped `code` problems through the harness (the verifier's
path: harness + child interpreter + literal-only calls), and, in the same pool, the same tests run the unsafe
way, as one program with the function (what `code_reward` did before issue 23; its verdict could be forged):
the difference is the price of a verdict the completion cannot write.

    .venv/bin/python benchmarks/code_reward.py [--rounds 3] [--size 1] [--isolation bwrap]

Prints one JSON line: harness_ms_p50, harness_ms_mean, unsafe_ms_p50, unsafe_ms_mean, completions, size,
isolation. Serial calls (one client thread), so a pool of size 1 is enough.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from factory.config import TaskSpec
from factory.envs.reward_hacks import score_in
from factory.envs.sandbox import SandboxPool
from factory.envs.tasks import make_task_splits


def unsafe_program(completion: str, problem) -> str:
    """The tests appended to the function in one program, counting passes (the old, forgeable design)."""
    lines = [problem.prompt + completion, "", "_passed = 0"]
    for t in problem.meta["tests"]:
        lines += ["try:", f"    _passed += bool({t})", "except Exception:", "    pass"]
    return "\n".join(lines + [f"print(f'PASSED {{_passed}}/{len(problem.meta['tests'])}')"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=1)
    p.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    splits = make_task_splits(TaskSpec(name="code", n_train=16, n_eval=8), 0)
    problems = splits.train + splits.eval
    harness, unsafe = [], []
    with SandboxPool(size=args.size, isolation=args.isolation) as pool:
        for _ in range(args.rounds):  # interleaved, so both see the same load
            for q in problems:
                t = time.perf_counter()
                if score_in(pool, q.answer, q)[0] != 1.0:
                    raise SystemExit(f"{q.id}: the reference solution did not score 1.0")
                harness.append(time.perf_counter() - t)
                t = time.perf_counter()
                out = pool.run(unsafe_program(q.answer, q))
                unsafe.append(time.perf_counter() - t)
                if not out.stdout.endswith(f"PASSED {len(q.meta['tests'])}/{len(q.meta['tests'])}\n"):
                    raise SystemExit(f"{q.id}: the unsafe program did not pass: {out.stdout!r} {out.reason}")
    print(json.dumps({"harness_ms_p50": round(statistics.median(harness) * 1e3, 1),
                      "harness_ms_mean": round(statistics.mean(harness) * 1e3, 1),
                      "unsafe_ms_p50": round(statistics.median(unsafe) * 1e3, 1),
                      "unsafe_ms_mean": round(statistics.mean(unsafe) * 1e3, 1),
                      "completions": len(harness), "size": args.size, "isolation": args.isolation}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
