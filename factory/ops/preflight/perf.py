"""Throughput checks: matmul GFLOP/s and memory-copy GB/s, each held to the node kind's floor.

Each is the median of several short timed windows: one stalled window (a page fault, another process's burst) does
not fail a healthy node and one lucky window does not pass a busy one (under heavy contention the best window was 3x
the median, measured), while sustained contention, throttling or a slow part lowers most windows and does. On a CPU
node both run on one thread: a one-thread rate does not depend on the core count and does not collapse when another
process holds a core the way a rate split over every core does (on a 2-core machine shared with other work, the
best window at 2 threads fell to a fifth of the 1-thread rate). A CPU whose cores are all oversubscribed still
gives the thread only its share, and fails the floor; the message then says which it was, from the thread's CPU time:
the share of a core it got, and its rate on that core. On a GPU node they run on GPU 0 (bf16 matmul, device copy).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from factory.ops.preflight.result import CheckResult

# (windows, seconds per window) per mode: deep measures longer for a steadier number.
WINDOWS = {"quick": (6, 0.08), "deep": (25, 0.1)}
CPU_MATMUL_N = 512  # 268 MFLOP per product: ~2 ms on one modern core, long enough to time, small enough to repeat
GPU_MATMUL_N = 8192
CPU_COPY_MB = 64  # past the last-level cache of common server CPUs, so the copy measures memory, not cache
GPU_COPY_MB = 1024


@dataclass(frozen=True)
class Rate:
    median: float  # work per wall second in the median window: the check's value
    best: float
    windows: int
    cpu_share: float  # this thread's CPU time / wall time over all windows: the share of a core it got
    on_cpu: float  # work per second of this thread's CPU time: the rate with the core to itself


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def window_rate(step: Callable[[], None], work_per_step: float, windows: int, window_s: float,
              sync: Callable[[], None] = lambda: None) -> Rate:
    """Run `step` repeatedly for `windows` windows of about `window_s` seconds; work per second of each window."""
    step()
    sync()  # warm-up: first-call allocation and kernel selection
    rates = []
    wall0, cpu0, total = time.perf_counter(), time.thread_time(), 0
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while True:
            step()
            n += 1
            sync()
            dt = time.perf_counter() - t0
            if dt >= window_s:
                break
        rates.append(n * work_per_step / dt)
        total += n
    wall, cpu = time.perf_counter() - wall0, max(time.thread_time() - cpu0, 1e-9)
    rates.sort()
    return Rate(rates[len(rates) // 2], rates[-1], windows, min(1.0, cpu / wall), total * work_per_step / cpu)


def cpu_pressure() -> str:
    """The kernel's CPU pressure (PSI: share of the last 10 s some task waited for a CPU), for messages; '' if
    unavailable."""
    try:
        with open("/proc/pressure/cpu") as f:
            line = f.readline().split()
        fields = dict(kv.split("=") for kv in line[1:])
        return f"CPU pressure {float(fields['avg10']):.0f}% (some task waited for a CPU, last 10 s)"
    except (OSError, KeyError, ValueError, IndexError):
        return ""


def _use_cuda() -> bool:
    return torch.cuda.is_available()


def matmul_check(floor: float, mode: str, gpus_expected: bool) -> CheckResult:
    windows, window_s = WINDOWS[mode]
    if gpus_expected and not _use_cuda():
        return CheckResult("matmul", False, None, floor, "GFLOP/s", f">= {floor:g}",
                           "nvidia-smi lists GPUs but torch sees no CUDA device (driver/CUDA mismatch, or a CPU-only "
                           "torch build)")
    if _use_cuda():
        n, dtype, dev = GPU_MATMUL_N, torch.bfloat16, "cuda"
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        rate = window_rate(lambda: torch.mm(a, b), 2 * n**3 / 1e9, windows, window_s, torch.cuda.synchronize)
        how = f"{windows} windows, {n}x{n} bf16 on {torch.cuda.get_device_name(0)}"
        return _rated("matmul", rate, floor, "GFLOP/s", how, on_gpu=True)
    else:
        n = CPU_MATMUL_N
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        out = torch.empty(n, n)
        with torch_threads(1):
            rate = window_rate(lambda: torch.mm(a, b, out=out), 2 * n**3 / 1e9, windows, window_s)
        how = f"{windows} windows of {window_s:g} s, {n}x{n} fp32, 1 thread"
    return _rated("matmul", rate, floor, "GFLOP/s", how)


def memory_bandwidth_check(floor: float, mode: str) -> CheckResult:
    windows, window_s = WINDOWS[mode]
    if _use_cuda():
        mb, dev, sync = GPU_COPY_MB, "cuda", torch.cuda.synchronize
    else:
        mb, dev, sync = CPU_COPY_MB, "cpu", lambda: None
    src = torch.ones(mb << 18, device=dev)  # float32: mb MiB
    dst = torch.empty_like(src)
    with torch_threads(1):
        # A copy reads and writes every byte: 2 x the buffer per step.
        rate = window_rate(lambda: dst.copy_(src), 2 * (mb << 20) / 1e9, windows, window_s, sync)
    how = f"{windows} windows, {mb} MiB copy on {dev}" + (", 1 thread" if dev == "cpu" else "")
    return _rated("memory_bandwidth", rate, floor, "GB/s", how, on_gpu=dev == "cuda")


def _rated(name: str, rate: Rate, floor: float, unit: str, how: str, on_gpu: bool = False) -> CheckResult:
    ok = rate.median >= floor
    share = f"the check's thread got {100 * rate.cpu_share:.0f}% of a core"
    msg = f"{rate.median:.1f} {unit} (best window {rate.best:.1f}; median of {how})"
    if not ok:
        if on_gpu:
            why = "the GPU is slow, throttled or shared"
        elif rate.cpu_share < 0.5:
            why = f"the CPU is busy with other work ({share}; on its core it ran at {rate.on_cpu:.1f} {unit})"
        else:
            why = f"the CPU itself is slow or throttled ({share}, so not contention)"
        pressure = "" if on_gpu else cpu_pressure()
        msg = (f"{rate.median:.1f} {unit} is under the floor {floor:g} {unit}: {why}; median of {how}"
               + (f"; {pressure}" if pressure else ""))
    elif not on_gpu:
        msg = msg[:-1] + f"; {share})"
    return CheckResult(name, ok, rate.median, floor, unit, f">= {floor:g}", msg)
