"""The all-reduce check: bus bandwidth of a sum all-reduce across local ranks, each its own process.

CPU nodes (and nodes with fewer than 2 GPUs): 2 ranks on gloo over 127.0.0.1. GPU nodes with 2 or more GPUs: one rank
per GPU on NCCL (NVLink / PCIe between them), written the same way but not yet run (docs/hardware.md). Each rank is
started as `python -m factory.ops.preflight.allreduce --rank R ...`; rank 0 prints one JSON line. The reduced values
are checked (every element must equal the sum of the ranks' fills), so a rank that computes garbage fails, not only a
slow one. Bus bandwidth is the nccl-tests convention: bytes x 2(n-1)/n / seconds per all-reduce, comparable across
world sizes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from factory.ops.preflight.result import CheckResult

SIZES_MB = {"quick": 8, "deep": 32}
ITERS = {"quick": 10, "deep": 30}
TIMEOUT_S = 120.0


def _rank_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.ops.preflight.allreduce")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="of the group's store, hosted by the check's process")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--mb", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    device = "cpu"
    if a.backend == "nccl":
        torch.cuda.set_device(a.rank)
        device = f"cuda:{a.rank}"
    timeout = dt.timedelta(seconds=TIMEOUT_S / 2)
    store = dist.TCPStore("127.0.0.1", a.port, a.world, is_master=False, timeout=timeout)
    dist.init_process_group(a.backend, store=store, rank=a.rank, world_size=a.world, timeout=timeout)
    try:
        n = (a.mb << 20) // 4
        t = torch.full((n,), float(a.rank + 1), device=device)
        dist.all_reduce(t)  # warm-up: connections and buffers
        want = a.world * (a.world + 1) / 2
        if not bool((t == want).all()):
            raise SystemExit(f"rank {a.rank}: all-reduce result wrong: expected every element {want}, got "
                             f"{t.min().item()}..{t.max().item()}")
        sync = torch.cuda.synchronize if a.backend == "nccl" else (lambda: None)
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(t)
        sync()
        seconds = (time.perf_counter() - t0) / a.iters
        if a.rank == 0:
            size = n * 4
            print(json.dumps({"seconds": seconds, "bytes": size, "algbw_gbs": size / seconds / 1e9,
                              "busbw_gbs": size * 2 * (a.world - 1) / a.world / seconds / 1e9}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def allreduce_check(floor_gbs: float, mode: str, gpus: int) -> CheckResult:
    backend, world = ("nccl", gpus) if gpus >= 2 else ("gloo", 2)
    # The group's store listens (on a port the kernel picks at bind) before any rank starts: a port found free and
    # bound later by rank 0 can be taken by other work in between.
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    mb, iters = SIZES_MB[mode], ITERS[mode]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "factory.ops.preflight.allreduce", "--rank", str(r),
                               "--world", str(world), "--port", str(port), "--backend", backend, "--mb", str(mb),
                               "--iters", str(iters)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(world)]
    outs: list[tuple[int, str, str]] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        return CheckResult("allreduce", False, None, floor_gbs, "GB/s", f">= {floor_gbs:g}",
                           f"{backend} all-reduce across {world} local ranks did not finish in {TIMEOUT_S:.0f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, code, err) for r, (code, _, err) in enumerate(outs) if code != 0]
    if bad:
        r, code, err = bad[0]
        tail = err.strip().splitlines()[-1] if err.strip() else "no output"
        return CheckResult("allreduce", False, None, floor_gbs, "GB/s", f">= {floor_gbs:g}",
                           f"{backend} rank {r} of {world} exited {code}: {tail}")
    res = json.loads(outs[0][1].strip().splitlines()[-1])
    bw = res["busbw_gbs"]
    how = (f"{backend}, {world} ranks on 127.0.0.1" if backend == "gloo" else f"nccl, {world} GPUs") + \
        f", {mb} MiB x {iters} all-reduces, {res['seconds'] * 1e3:.1f} ms each, results verified"
    ok = bw >= floor_gbs
    msg = f"bus bandwidth {bw:.2f} GB/s ({how})" if ok else \
        f"bus bandwidth {bw:.2f} GB/s is under the floor {floor_gbs:g} GB/s ({how})"
    return CheckResult("allreduce", ok, round(bw, 3), floor_gbs, "GB/s", f">= {floor_gbs:g}", msg)


if __name__ == "__main__":
    sys.exit(_rank_main())
