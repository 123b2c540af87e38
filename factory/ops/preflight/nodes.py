"""Which node this is: its name (FACTORY_NODE, else the hostname) and its kind, whose floors the checks are held to.

Floors are per node kind, chosen by detection (GPU model from nvidia-smi, else the CPU core count) and overridable
with FACTORY_NODE_KIND or `factory preflight --kind`. The CPU floors come from measurements on a 2-vCPU VM
shared with other work (see `NODE_KINDS`); the GPU floors are typed from the parts' published figures with a wide
margin, not measured.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

GPU_COUNTS = (8, 4, 2, 1)  # GPUs a node (or a pod that asked for part of one) sees
EXPECTED_GPUS_ENV = "FACTORY_EXPECTED_GPUS"  # set by a pod that requested GPUs: how many it should see


@dataclass(frozen=True)
class NodeKind:
    name: str
    matmul_gflops: float  # CPU: fp32 on one thread; GPU: bf16 on GPU 0
    memory_gbs: float  # CPU: 64 MiB copy on one thread; GPU: device-memory copy
    disk_write_mbs: float
    disk_read_mbs: float
    disk_free_gb: float
    allreduce_gbs: float  # bus bandwidth: gloo 2 ranks on loopback (CPU), NCCL across the GPUs (GPU)
    gpus: int = 0
    gpu_memory_mib: float = 0.0
    ecc: bool = False
    basis: str = ""  # where the floors come from


def _gpu_kind(model: str, gpus: int) -> NodeKind:
    """H100 SXM: dense bf16 ~990 TFLOP/s, HBM3 3.35 TB/s, 80 GB; H200: the same compute, HBM3e 4.8 TB/s, 141 GB;
    NVLink 4 all-reduce across 8 GPUs ~350-450 GB/s bus bandwidth in nccl-tests. Floors at a third or less of
    those; local NVMe for checkpoints. With one GPU the all-reduce runs on gloo over loopback (16+ cores)."""
    return NodeKind(f"gpu-{model}x{gpus}", matmul_gflops=300_000.0, memory_gbs=1_500.0 if model == "h100" else 2_000.0,
                    disk_write_mbs=500.0, disk_read_mbs=1_000.0, disk_free_gb=200.0,
                    allreduce_gbs=100.0 if gpus > 1 else 0.3, gpus=gpus,
                    gpu_memory_mib=79_000.0 if model == "h100" else 135_000.0, ecc=True,
                    basis=f"typed from published {model.upper()} SXM figures (not measured)")


# cpu-2core, measured on an Intel Xeon VM (AVX512, 2 vCPUs shared with other test runs; medians of 6 windows):
#   matmul 512x512 fp32 1 thread: 60-160 GFLOP/s healthy (the low end while other test suites ran beside it: 20
#     quick preflights in a row under load average 3-9 gave min 60, median 126), 26-53 with 2 extra busy-loop
#     processes, 1.6-3.5 with 48; on its core the thread always ran at ~135-150.
#   memory copy 64 MiB 1 thread: 3.5-15 GB/s healthy (same 20 runs: min 3.5, median 8.6), 0.2-0.5 with 48 busy loops.
#   disk (ext4 on virtio) 32 MiB write+fsync 53-580 MB/s, read 93-1280 MB/s (the low ends while other test suites
#     wrote and fsynced beside it); 512 MiB 200-620 / 400-1150.
#   gloo all-reduce 2 ranks on loopback, bus bandwidth 0.7-1.1 GB/s.
# Floors sit 3x or more below the lowest healthy figure and far above what an oversubscribed CPU gives: a healthy
# node (even a shared one) passes; one where the check's thread gets less than about a seventh of a
# core fails matmul. Milder contention passes by design: on a shared machine, healthy and mildly busy look alike.
NODE_KINDS: dict[str, NodeKind] = {k.name: k for k in (
    NodeKind("cpu-2core", matmul_gflops=20.0, memory_gbs=1.0, disk_write_mbs=10.0, disk_read_mbs=20.0,
             disk_free_gb=1.0, allreduce_gbs=0.1, basis="measured on the development machine (2 shared vCPUs)"),
    # Any other CPU node: per-core rates like cpu-2core's (the throughput checks use one thread).
    NodeKind("cpu", matmul_gflops=20.0, memory_gbs=1.0, disk_write_mbs=10.0, disk_read_mbs=20.0,
             disk_free_gb=1.0, allreduce_gbs=0.1, basis="cpu-2core's per-core floors"),
    *(_gpu_kind(model, n) for model in ("h100", "h200") for n in GPU_COUNTS),
    NodeKind("gpu", matmul_gflops=20_000.0, memory_gbs=300.0, disk_write_mbs=200.0, disk_read_mbs=400.0,
             disk_free_gb=50.0, allreduce_gbs=0.1, gpus=1, gpu_memory_mib=15_000.0, ecc=False,
             basis="any other NVIDIA GPU: loose floors (not measured)"),
)}


def node_name() -> str:
    """This node's name in `node_health`: $FACTORY_NODE, else the hostname."""
    return os.environ.get("FACTORY_NODE") or socket.gethostname()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def expected_gpus() -> int | None:
    """The GPUs this pod asked for ($FACTORY_EXPECTED_GPUS, set by `factory deploy preflight`'s Jobs), if any."""
    raw = os.environ.get(EXPECTED_GPUS_ENV)
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{EXPECTED_GPUS_ENV}: expected a GPU count of 1 or more, got {raw!r}")
    return int(raw)


def detect_kind(gpu_names: list[str] | None) -> str:
    """The node kind for the GPUs nvidia-smi listed (None: no nvidia-smi), else for the CPU core count. The count is
    the one the pod asked for when it says ($FACTORY_EXPECTED_GPUS: a pod with 4 of a node's 8 GPUs is a 4-GPU
    kind). Otherwise a count with no kind of its own (7 of 8 visible: one fell off the bus) maps to the 8-GPU kind;
    either way the count check then fails on a missing GPU rather than a kind accepting it."""
    if gpu_names:
        name = gpu_names[0].upper()
        for model in ("H200", "H100"):
            if model in name:
                count = expected_gpus() or len(gpu_names)
                kind = f"gpu-{model.lower()}x{count}"
                return kind if kind in NODE_KINDS else f"gpu-{model.lower()}x8"
        return "gpu"
    kind = f"cpu-{usable_cores()}core"
    return kind if kind in NODE_KINDS else "cpu"


def node_kind(name: str | None, gpu_names: list[str] | None) -> NodeKind:
    """`name` (or $FACTORY_NODE_KIND) if given, else the detected kind. ValueError naming the valid kinds."""
    name = name or os.environ.get("FACTORY_NODE_KIND") or detect_kind(gpu_names)
    if name not in NODE_KINDS:
        raise ValueError(f"unknown node kind {name!r} (from --kind or FACTORY_NODE_KIND); valid kinds: "
                         f"{', '.join(NODE_KINDS)}")
    return NODE_KINDS[name]
