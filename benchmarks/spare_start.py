"""Seconds from asking for a rollout server to its first completion: started cold vs in a warm spare, side by side.

Cold is what a restarted attempt did before: `python -m factory.cli serve` as a new interpreter, which imports torch,
transformers and the engine before it builds the model and binds its port. Warm is what an attempt forked by the
standby does now (`runs/standby.py`): the same command run in a spare (`infra/spare.py`) forked from a process that
already has those imports. Both go through `ServiceProcess` exactly as the run's producer starts its server; the
model is a freshly built preset (`--preset`, default micro) on `--device` (auto: a GPU when torch sees one). Starts
alternate cold/warm, `--n` of each. On a GPU the warm server also shows that a process forked after the imports (and
before any torch operation, as the standby forks) computes on CUDA.

Prints a table, then one JSON line: cold_s_p50, warm_s_p50, ratio (cold/warm), n, device, each start's seconds.

    .venv/bin/python benchmarks/spare_start.py            # 5 of each
    .venv/bin/python benchmarks/spare_start.py --n 3 --device cuda
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from factory.infra.spare import Spare  # noqa: E402
from factory.infra.supervisor import ServiceProcess  # noqa: E402


def _preload() -> str:
    """Import what the standby imports (the attempt's command); where that is missing (the device kit has no
    MLflow), what the server's command needs."""
    for module in ("factory.cli.run", "factory.cli.serve"):
        try:
            importlib.import_module(module)
            return module
        except ImportError:
            continue
    raise SystemExit("cannot import factory.cli.serve")


def _start(argv: list[str], log: Path, spare: Spare | None) -> tuple[float, float, int]:
    """Seconds to healthy and to the first completion; the server's pid."""
    t0 = time.perf_counter()
    svc = ServiceProcess("rollout-server", argv, log_path=log, startup_timeout=600, spare=spare).start()
    healthy = time.perf_counter() - t0
    try:
        r = httpx.post(f"{svc.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 1.0,
                                                          "seed": 0}, timeout=600)
        r.raise_for_status()
        assert r.json()["choices"][0]["token_ids"], r.text
        return healthy, time.perf_counter() - t0, svc.pid
    finally:
        svc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5, help="starts of each kind")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--preset", default="micro")
    args = ap.parse_args()
    t = time.perf_counter()
    preloaded = _preload()
    preload_s = time.perf_counter() - t
    work = Path(tempfile.mkdtemp(prefix="factory-spare-"))
    argv = [sys.executable, "-m", "factory.cli", "serve", "--preset", args.preset, "--port", "{port}",
            "--device", args.device, "--threads", "1"]
    cold, warm = [], []
    for i in range(args.n):
        cold.append(_start(argv, work / f"cold{i}.log", None))
        spare = Spare.fork()
        h, first, pid = _start(argv, work / f"warm{i}.log", spare)
        assert pid == spare.pid, "the warm start did not run in the spare"
        warm.append((h, first, pid))
        print(f"start {i + 1}/{args.n}: cold {cold[-1][1]:.2f} s, warm {warm[-1][1]:.2f} s", file=sys.stderr,
              flush=True)
    c = statistics.median(x[1] for x in cold)
    w = statistics.median(x[1] for x in warm)
    served_on = next((line for line in (work / "warm0.log").read_text().splitlines() if "serving" in line), "?")
    print(f"\nrollout server start, {args.n} of each ({preloaded} preloaded in {preload_s:.1f} s; {served_on})")
    print(f"  {'':<6} {'healthy p50':>12} {'first completion p50':>21}")
    for name, xs in (("cold", cold), ("warm", warm)):
        healthy, first = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        print(f"  {name:<6} {healthy:>10.2f} s {first:>19.2f} s")
    print(f"  cold / warm: x{c / w:.1f}")
    print(json.dumps({"cold_s_p50": round(c, 3), "warm_s_p50": round(w, 3), "ratio": round(c / w, 2), "n": args.n,
                      "device": args.device, "served": served_on, "preloaded": preloaded,
                      "cold_s": [round(x[1], 3) for x in cold], "warm_s": [round(x[1], 3) for x in warm]}))


if __name__ == "__main__":
    main()
