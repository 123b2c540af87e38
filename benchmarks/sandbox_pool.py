"""The sandbox pool's speed: warm acquire, cold start, executions per second against a fresh interpreter.

Measured side by side in one run, on whatever cores the machine has (the goals are for 2):

- warm acquire: `acquire()` + `release()` of a warm worker (the acquire pings it), p50/p99;
- cold start: starting a new worker until it answers, p50/p99 (bwrap, interpreter, preloads);
- executions per second, `print(1)` and a small unit-test file (a function and a few asserts), with the
  pool at its default size and as many client threads, against the naive way at the same concurrency:
  `subprocess.run([sys.executable, "-c", code])`, a fresh interpreter per execution (and no isolation).

    .venv/bin/python benchmarks/sandbox_pool.py            # ~1 min
    .venv/bin/python benchmarks/sandbox_pool.py --quick    # ~10 s
    .venv/bin/python benchmarks/sandbox_pool.py --isolation none

Goals: warm acquire p50 <= 5 ms, cold start p50 <= 100 ms, >= 300 trivial executions/s, >= 5x naive.
Prints a table, then one JSON line: warm_acquire_p50_ms, warm_acquire_p99_ms, cold_start_p50_ms,
cold_start_p99_ms, execs_per_s, naive_execs_per_s, speedup_vs_naive, unit_execs_per_s,
naive_unit_execs_per_s, unit_speedup_vs_naive, size, isolation, memory_limit, cpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from factory.envs.sandbox import SandboxPool  # noqa: E402

TRIVIAL = "print(1)"
UNIT_TEST = '''
def fizzbuzz(n):
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)


assert fizzbuzz(3) == "Fizz"
assert fizzbuzz(5) == "Buzz"
assert fizzbuzz(15) == "FizzBuzz"
assert fizzbuzz(7) == "7"
assert [fizzbuzz(i) for i in range(1, 6)] == ["1", "2", "Fizz", "4", "Buzz"]
print("5 passed")
'''


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def throughput(run_one: Callable[[], bool], threads: int, seconds: float) -> float:
    """Executions per second with `threads` clients for `seconds` (every execution must succeed)."""
    done = [0] * threads
    failed: list[str] = []
    end = time.perf_counter() + seconds

    def client(i: int) -> None:
        while time.perf_counter() < end:
            if not run_one():
                failed.append("an execution failed")
                return
            done[i] += 1

    ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if failed:
        raise RuntimeError(failed[0])
    return sum(done) / (time.perf_counter() - t0)


def naive(code: str, expect: str) -> Callable[[], bool]:
    def run_one() -> bool:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        return p.returncode == 0 and p.stdout == expect

    return run_one


def pooled(pool: SandboxPool, code: str, expect: str) -> Callable[[], bool]:
    def run_one() -> bool:
        r = pool.run(code)
        return r.ok and r.stdout == expect

    return run_one


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter phases (~10 s in all)")
    p.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap")
    p.add_argument("--size", type=int, default=4, help="pool size and client threads (default: 4, the default)")
    args = p.parse_args(argv)
    phase_s = 2.0 if args.quick else 10.0
    n_acquire = 500 if args.quick else 3000
    n_cold = 10 if args.quick else 40

    # Defaults but the size: workers are recycled every 100 executions, so throughput pays for cold starts.
    with SandboxPool(size=args.size, isolation=args.isolation) as pool:
        for _ in range(20):  # warm up both paths
            pool.run(TRIVIAL)
        acquire = []
        for _ in range(n_acquire):
            t0 = time.perf_counter()
            sb = pool.acquire()
            pool.release(sb)
            acquire.append(time.perf_counter() - t0)

        cold = []
        for _ in range(n_cold):
            sb = pool._make_sandbox()  # a worker like the pool's own, outside its rotation
            try:
                cold.append(sb.start())
            finally:
                sb.kill()
                sb.reap()

        # Alternate pool and naive phases so both see the same machine (other load comes and goes).
        rates = {"pool": [], "naive": [], "pool_unit": [], "naive_unit": []}
        for _ in range(1 if args.quick else 2):
            rates["pool"].append(throughput(pooled(pool, TRIVIAL, "1\n"), args.size, phase_s / 2))
            rates["naive"].append(throughput(naive(TRIVIAL, "1\n"), args.size, phase_s / 2))
            rates["pool_unit"].append(throughput(pooled(pool, UNIT_TEST, "5 passed\n"), args.size, phase_s / 2))
            rates["naive_unit"].append(throughput(naive(UNIT_TEST, "5 passed\n"), args.size, phase_s / 2))
        metrics = pool.metrics()

    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    out = {
        "warm_acquire_p50_ms": round(pct(acquire, 0.5) * 1e3, 3),
        "warm_acquire_p99_ms": round(pct(acquire, 0.99) * 1e3, 3),
        "cold_start_p50_ms": round(pct(cold, 0.5) * 1e3, 1),
        "cold_start_p99_ms": round(pct(cold, 0.99) * 1e3, 1),
        "execs_per_s": round(mean["pool"], 1),
        "naive_execs_per_s": round(mean["naive"], 1),
        "speedup_vs_naive": round(mean["pool"] / mean["naive"], 2),
        "unit_execs_per_s": round(mean["pool_unit"], 1),
        "naive_unit_execs_per_s": round(mean["naive_unit"], 1),
        "unit_speedup_vs_naive": round(mean["pool_unit"] / mean["naive_unit"], 2),
        "size": args.size, "isolation": args.isolation, "memory_limit": metrics["memory_limit"],
        "cpus": os.cpu_count(),
    }
    goals = {"warm_acquire_p50_ms": ("<=", 5.0), "cold_start_p50_ms": ("<=", 100.0), "execs_per_s": (">=", 300.0),
             "speedup_vs_naive": (">=", 5.0)}
    print(f"sandbox pool: size {args.size}, isolation {args.isolation}, memory limit {metrics['memory_limit']}, "
          f"{os.cpu_count()} cpus, {args.size} client threads")
    print(f"{'measure':<32} {'value':>10}  goal")
    for key, value in out.items():
        if isinstance(value, float):
            op, bound = goals.get(key, ("", None))
            goal = ""
            if bound is not None:
                met = value <= bound if op == "<=" else value >= bound
                goal = f"{op} {bound:g} {'met' if met else 'MISSED'}"
            print(f"{key:<32} {value:>10}  {goal}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
