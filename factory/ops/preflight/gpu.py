"""The accelerator check: GPUs counted and sized, ECC and row-remap state, XID errors, read from `nvidia-smi` and the
kernel log.

Sources: `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` (one line per GPU), `nvidia-smi
--query-remapped-rows=...` (Ampere and later; an older driver or GPU that rejects it is missing evidence, not a
defect), and `NVRM: Xid` lines in `dmesg`. Parsing is separate from running the commands, so it is tested on recorded
output; nothing here runs on a node without `nvidia-smi` on PATH, which then reports "no accelerator" and passes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, replace

from factory.ops.preflight.result import CheckResult

QUERY_FIELDS = ("index", "name", "pci.bus_id", "memory.total", "ecc.mode.current",
                "ecc.errors.uncorrected.volatile.total", "ecc.errors.corrected.volatile.total",
                "retired_pages.pending", "temperature.gpu")
REMAP_FIELDS = ("gpu_bus_id", "remapped_rows.pending", "remapped_rows.failure")

# XIDs that mean the hardware (memory, bus, NVLink, firmware) is at fault, not the application: the node needs a
# reset, a drain or an RMA. Others (13 graphics exception, 31 MMU fault, 43 stopped, 45 cleanup) usually follow
# a bad program and are reported without failing. From NVIDIA's XID catalogue
# (docs.nvidia.com/deploy/xid-errors) and its GPU memory error management guide.
HARDWARE_XIDS = {
    48: "double-bit ECC error", 61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
    63: "ECC page retirement / row remap recorded", 64: "ECC page retirement / row remap failure",
    74: "NVLink error", 79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
    94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
}

_XID_RE = re.compile(r"NVRM: Xid \((?P<dev>[^)]*)\): (?P<code>\d+)")
_COMMAND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    bus_id: str
    memory_mib: float | None
    ecc_mode: str  # "Enabled", "Disabled", or "" where not reported
    ecc_uncorrected: int | None
    ecc_corrected: int | None
    retired_pending: bool | None
    temperature_c: float | None
    remap_pending: bool | None = None
    remap_failure: bool | None = None


@dataclass(frozen=True)
class Xid:
    device: str  # e.g. "PCI:0000:3b:00"
    code: int
    line: str


def _field(v: str) -> str | None:
    v = v.strip()
    return None if not v or (v.startswith("[") and v.endswith("]")) else v  # [N/A], [Not Supported], ...


def _int(v: str) -> int | None:
    f = _field(v)
    return int(float(f)) if f is not None else None


def _float(v: str) -> float | None:
    f = _field(v)
    return float(f) if f is not None else None


def _flag(v: str) -> bool | None:
    f = _field(v)
    if f is None:
        return None
    low = f.lower()
    if low in ("yes", "true"):
        return True
    if low in ("no", "false"):
        return False
    return float(low) != 0  # counts and 0/1 flags


def parse_query_gpu(text: str) -> list[GpuInfo]:
    """GPUs from `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`. ValueError naming the line
    for output of another shape."""
    gpus = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(QUERY_FIELDS):
            raise ValueError(f"nvidia-smi --query-gpu line {n}: expected {len(QUERY_FIELDS)} fields "
                             f"({','.join(QUERY_FIELDS)}), got {len(cells)}: {line!r}")
        idx, name, bus, mem, ecc, unc, cor, pend, temp = cells
        gpus.append(GpuInfo(int(idx), name, bus.lower(), _float(mem), _field(ecc) or "", _int(unc), _int(cor),
                            _flag(pend), _float(temp)))
    return gpus


def parse_remapped_rows(text: str) -> dict[str, tuple[bool | None, bool | None]]:
    """{bus id: (pending, failure)} from `nvidia-smi --query-remapped-rows=<REMAP_FIELDS> --format=csv,noheader`."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(REMAP_FIELDS) and cells[0]:
            out[cells[0].lower()] = (_flag(cells[1]), _flag(cells[2]))
    return out


def with_remaps(gpus: list[GpuInfo], remaps: dict[str, tuple[bool | None, bool | None]]) -> list[GpuInfo]:

    return [replace(g, remap_pending=remaps[g.bus_id][0], remap_failure=remaps[g.bus_id][1])
            if g.bus_id in remaps else g for g in gpus]


def parse_xids(kernel_log: str) -> list[Xid]:
    """Every `NVRM: Xid (<device>): <code>, ...` line of a kernel log (dmesg or journalctl -k)."""
    return [Xid(m.group("dev"), int(m.group("code")), line.strip())
            for line in kernel_log.splitlines() if (m := _XID_RE.search(line))]


def assess(gpus: list[GpuInfo], xids: list[Xid], *, min_gpus: int, min_memory_mib: float, require_ecc: bool,
           xid_note: str = "") -> CheckResult:
    """The accelerator check's verdict on what nvidia-smi and the kernel log said. value: GPUs found."""
    problems: list[str] = []
    if len(gpus) < min_gpus:
        problems.append(f"{len(gpus)} GPUs visible, expected {min_gpus}")
    for g in gpus:
        tag = f"GPU {g.index} ({g.bus_id})"
        if g.memory_mib is not None and g.memory_mib < min_memory_mib:
            problems.append(f"{tag}: {g.memory_mib:.0f} MiB memory, expected >= {min_memory_mib:.0f}")
        if require_ecc and g.ecc_mode and g.ecc_mode.lower() != "enabled":
            problems.append(f"{tag}: ECC {g.ecc_mode.lower()}")
        if g.ecc_uncorrected:
            problems.append(f"{tag}: {g.ecc_uncorrected} uncorrected ECC errors since the driver loaded")
        if g.retired_pending:
            problems.append(f"{tag}: retired pages pending (needs a reset)")
        if g.remap_failure:
            problems.append(f"{tag}: row remapping failed (no spare rows left: RMA)")
        if g.remap_pending:
            problems.append(f"{tag}: row remap pending (needs a reset)")
    hard = [x for x in xids if x.code in HARDWARE_XIDS]
    for code in sorted({x.code for x in hard}):
        devs = sorted({x.device for x in hard if x.code == code})
        problems.append(f"XID {code} ({HARDWARE_XIDS[code]}) on {', '.join(devs)}")
    soft = sorted({x.code for x in xids if x.code not in HARDWARE_XIDS})
    names = sorted({g.name for g in gpus})
    seen = f"{len(gpus)} x {', '.join(names)}" if gpus else "no GPUs"
    notes = [n for n in (f"application XIDs seen: {soft}" if soft else "", xid_note) if n]
    if problems:
        msg = f"{seen}: " + "; ".join(problems)
    else:
        mem = min((g.memory_mib for g in gpus if g.memory_mib is not None), default=None)
        msg = f"{seen}" + (f", {mem:.0f} MiB each" if mem is not None else "") + ", no ECC/remap/XID faults"
    if notes:
        msg += " (" + "; ".join(notes) + ")"
    return CheckResult("accelerators", not problems, float(len(gpus)), float(min_gpus), "GPUs", f">= {min_gpus} GPUs, "
                       "0 uncorrected ECC errors, no pending remaps, no hardware XIDs", msg)


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, f"{type(e).__name__}: {e}"
    return p.returncode, p.stdout if p.returncode == 0 else (p.stderr or p.stdout)


def query_gpus() -> list[GpuInfo] | None:
    """The node's GPUs per nvidia-smi; None when nvidia-smi is not on PATH (a CPU node). RuntimeError when it is
    there but fails (driver not loaded, a GPU gone): a GPU node that cannot be queried is not healthy."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    code, out = _run([smi, f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"])
    if code != 0:
        raise RuntimeError(f"nvidia-smi failed (exit {code}): {out.strip()[:300]}")
    gpus = parse_query_gpu(out)
    code, out = _run([smi, f"--query-remapped-rows={','.join(REMAP_FIELDS)}", "--format=csv,noheader,nounits"])
    return with_remaps(gpus, parse_remapped_rows(out)) if code == 0 else gpus


def kernel_log() -> tuple[str, str]:
    """(the kernel log, a note when it could not be read) from `dmesg`."""
    exe = shutil.which("dmesg")
    if exe is None:
        return "", "XIDs not checked: no dmesg"
    code, out = _run([exe])
    return (out, "") if code == 0 else ("", f"XIDs not checked: dmesg failed: {out.strip()[:120]}")


def accelerators_check(gpus: list[GpuInfo] | None, *, min_gpus: int, min_memory_mib: float,
                       require_ecc: bool) -> CheckResult:
    """`gpus` as `query_gpus()` returned them (None: no nvidia-smi)."""
    if gpus is None:
        if min_gpus > 0:
            return CheckResult("accelerators", False, 0.0, float(min_gpus), "GPUs", f">= {min_gpus} GPUs",
                               f"no nvidia-smi on PATH, but this node kind expects {min_gpus} GPUs")
        return CheckResult("accelerators", True, 0.0, 0.0, "GPUs", "none needed", "no accelerator (CPU node)")
    log, note = kernel_log()
    return assess(gpus, parse_xids(log), min_gpus=min_gpus, min_memory_mib=min_memory_mib, require_ecc=require_ecc,
                  xid_note=note)
