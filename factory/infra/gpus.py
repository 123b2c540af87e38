"""The GPUs this machine can give a run, counted without importing torch (`factory validate` must stay light), and
the check that refuses a spec asking for more of them than there are.

Counting: the NVIDIA GPUs the driver shows (/proc/driver/nvidia/gpus/*, else `nvidia-smi -L` under a short
timeout, else none), narrowed by CUDA_VISIBLE_DEVICES the way CUDA reads it: a comma list of indices or
GPU-/MIG- UUIDs, visible up to the first entry that names no device; set but empty means none.

A spec uses CUDA when it says so (`device: cuda` / `cuda:N`), places GPUs (`trainer.devices`, `rollout.devices`),
trains with Megatron, or leaves `device: auto` on a machine with a GPU (the trainer's ranks then go to
cuda:LOCAL_RANK; SGLang servers it starts get GPUs from 0). Only then are GPUs counted against it: a two-rank gloo
run on a CPU machine stays valid.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from factory.config import ExperimentSpec

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
SMI_TIMEOUT_S = 5.0  # nvidia-smi can hang on a wedged driver; validate must answer anyway


@dataclass(frozen=True)
class Gpus:
    """How many GPUs a process started here would see, and how that was found (for error messages)."""

    count: int
    source: str


def _driver_gpus() -> tuple[int, str]:
    """GPUs the NVIDIA driver shows, ignoring CUDA_VISIBLE_DEVICES: (count, where it was read)."""
    try:
        found = [p for p in PROC_GPUS.iterdir() if p.is_dir()]
    except OSError:
        found = []
    if found:
        return len(found), str(PROC_GPUS)
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return 0, "no NVIDIA driver found (no /proc/driver/nvidia/gpus, no nvidia-smi)"
    # MIG instances are listed indented under their GPU: count the GPU lines only.
    n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return (n, "nvidia-smi -L") if out.returncode == 0 else (0, f"nvidia-smi -L failed (exit {out.returncode})")


def _visible(setting: str, physical: int) -> int:
    """How many entries of a CUDA_VISIBLE_DEVICES value CUDA keeps: those before the first one naming no device
    (an index past the driver's GPUs, a negative or malformed entry, a repeat)."""
    seen: set[str] = set()
    for raw in setting.split(","):
        entry = raw.strip()
        if entry in seen:
            break
        if re.fullmatch(r"\d+", entry):
            if int(entry) >= physical:
                break
        elif not re.match(r"(GPU|MIG)-[0-9A-Fa-f-]+", entry) or physical == 0:
            break
        seen.add(entry)
    return min(len(seen), physical) if physical else 0


def count_gpus(environ: dict[str, str] | None = None) -> Gpus:
    """The GPUs CUDA would show a process started here with `environ` (default: this process's environment)."""
    env = os.environ if environ is None else environ
    physical, source = _driver_gpus()
    setting = env.get("CUDA_VISIBLE_DEVICES")
    if setting is None:
        return Gpus(physical, source)
    if not setting.strip():
        return Gpus(0, "CUDA_VISIBLE_DEVICES is set and empty")
    return Gpus(_visible(setting, physical), f"CUDA_VISIBLE_DEVICES={setting!r} over {physical} from {source}")


def check_gpus(spec: ExperimentSpec, gpus: Gpus | None = None) -> None:
    """Refuse (ValueError naming the field, what was asked and what this machine has) a spec needing more GPUs, or
    other GPU indices, than `gpus` (default: `count_gpus()`)."""
    reasons = spec.resolved.cuda_asked  # config/resolved.py
    sglang = spec.rollout.sglang if spec.rollout.sglang is not None and not spec.rollout.sglang.urls else None
    if not reasons and spec.device != "auto" and sglang is None:
        return  # device: cpu and nothing GPU-only: no GPU is touched
    have = gpus if gpus is not None else count_gpus()
    n = have.count
    machine = f"this machine has {n} GPU{'s' if n != 1 else ''} ({have.source})"
    if not reasons and n == 0:
        return  # device: auto on a CPU machine: everything on the CPU (gloo ranks included), SGLang as configured
    if n == 0:
        field, value = reasons[0]
        raise ValueError(f"{field}: {value} needs a CUDA GPU, but {machine}; on a CPU machine use device: cpu or "
                         f"auto, the torch backend and no GPU lists")

    def refuse_index(field: str, asked: list[int]) -> None:
        bad = [i for i in asked if i >= n]
        if bad:
            raise ValueError(f"{field}: GPU {bad[0]} asked for (got {asked}), but {machine}: indices 0..{n - 1}")

    if re.fullmatch(r"cuda:\d+", spec.device):
        refuse_index("device", [int(spec.device.split(":")[1])])
    if spec.trainer.devices:
        refuse_index("trainer.devices", list(spec.trainer.devices))
    elif spec.device != "cpu" and spec.trainer.world_size > n:
        # Unplaced ranks go to cuda:LOCAL_RANK: rank n would fail later with "invalid device ordinal".
        raise ValueError(f"trainer.world_size: {spec.trainer.world_size} ranks, one GPU each, but {machine}; use at "
                         f"most {n} ranks, or device: cpu to run them on the CPU (gloo)")
    if spec.rollout.devices:
        refuse_index("rollout.devices", list(spec.rollout.devices))
    elif sglang is not None:
        if (tp := sglang.tp_size) > n:  # unplaced servers start from GPU 0
            raise ValueError(f"rollout.sglang.tp_size: {tp} GPUs per server, but {machine}")
