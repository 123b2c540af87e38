"""Running a preflight: the checks in order, per mode, timed; the report; its rows in the lake table `node_health`.

Quick mode (the gate's, ~10-15 s on 2 cores) runs every check that is cheap (the `logprob_gap` one among them: the
rollout engine against the trainer on a fixed probe, `logprob_gap.py`); deep mode measures longer and adds the
all-reduce, the rollout server and the whole sandbox red-team suite. Checks run one after another: the throughput
checks must not share the CPU with the others.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from factory.home import FactoryPaths, factory_home
from factory.ops.preflight.disk import disk_checks
from factory.ops.preflight.gpu import GpuInfo, accelerators_check, query_gpus
from factory.ops.preflight.nodes import NodeKind, node_kind, node_name
from factory.ops.preflight.result import CheckResult, PreflightReport
from factory.ops.preflight.services import lake_commit_check, mlflow_check, sandbox_check
from factory.progress import Log

if TYPE_CHECKING:
    from factory.lake.writer import Lake

_log = logging.getLogger(__name__)
Mode = Literal["quick", "deep"]
MODES: tuple[str, ...] = ("quick", "deep")
MIN_PYTHON = (3, 11)  # pyproject's requires-python
# Imported here: the checks in this process use them. transformers and mlflow are imported (and used) by the
# determinism and mlflow checks, each in its own process, and only looked up here (importing them costs seconds);
# dagster is only looked up (factory imports no dagster). Deep mode imports every looked-up one in a child process.
PACKAGES = ("torch", "pyiceberg")
LOOKED_UP = ("transformers", "mlflow", "dagster")
CHILD_TIMEOUT_S = 300.0


@dataclass
class Context:
    paths: FactoryPaths
    node: str
    kind: NodeKind
    mode: Mode
    preflight_id: str
    started_at: dt.datetime
    gpus: list[GpuInfo] | None
    gpu_error: str
    lake_given: Lake | None
    spec_path: str | None = None  # the logprob_gap check gates this experiment's setup (default: the tiny one)
    _lake: Lake | None = field(default=None, repr=False)

    def lake(self) -> Lake:
        """The lake the caller gave, else one opened here (once)."""
        if self.lake_given is not None:
            return self.lake_given
        if self._lake is None:
            # a preflight given a lake or recording nothing never loads pyiceberg and duckdb
            from factory.lake.writer import Lake  # noqa: PLC0415 heavy: pyiceberg, duckdb; opened on first use

            self._lake = Lake.open(self.paths)
        return self._lake


@dataclass(frozen=True)
class Probe:
    name: str
    checks: tuple[str, ...]  # the names of the results it produces, in order
    deep_only: bool
    run: Callable[[Context], list[CheckResult]]
    # Throughput probes run first, alone. Then background probes start, each in a child process, and run beside
    # the rest: importing transformers' model code or MLflow costs seconds of one core that the other core hides.
    quiet: bool = False
    background: bool = False


def _python(ctx: Context) -> list[CheckResult]:
    v = sys.version_info
    ok = (v.major, v.minor) >= MIN_PYTHON
    want = ".".join(map(str, MIN_PYTHON))
    # As a number: 3.11 -> 3.11, 3.9 -> 3.09, so versions order as numbers do.
    value, floor = float(f"{v.major}.{v.minor:02d}"), float(f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]:02d}")
    msg = f"Python {v.major}.{v.minor}.{v.micro} ({sys.executable})" + ("" if ok else f", need >= {want}")
    return [CheckResult("python", ok, value, floor, "version", f">= {want}", msg)]


def _packages(ctx: Context) -> list[CheckResult]:
    found, problems = [], []
    for name in PACKAGES:
        try:
            mod = importlib.import_module(name)
            found.append(f"{name} {getattr(mod, '__version__', None) or importlib.metadata.version(name)}")
        except Exception as e:  # noqa: BLE001 - a package that fails to import, for any reason, is the finding
            problems.append(f"{name}: {type(e).__name__}: {e}")
    for name in LOOKED_UP:
        try:
            version = importlib.metadata.version(name)
            if importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"no module {name}")
            if ctx.mode == "deep":
                p = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                                   timeout=120)
                if p.returncode != 0:
                    raise ImportError((p.stderr.strip().splitlines() or ["failed"])[-1])
            found.append(f"{name} {version}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: {type(e).__name__}: {e}")
    n = len(PACKAGES) + len(LOOKED_UP)
    msg = ", ".join(found) + (f"; MISSING or broken: {'; '.join(problems)}" if problems else "")
    return [CheckResult("packages", not problems, float(len(found)), float(n), "packages", "all importable", msg)]


def _accelerators(ctx: Context) -> list[CheckResult]:
    if ctx.gpu_error:
        return [CheckResult("accelerators", False, None, float(ctx.kind.gpus), "GPUs", f">= {ctx.kind.gpus} GPUs",
                            ctx.gpu_error)]
    return [accelerators_check(ctx.gpus, min_gpus=ctx.kind.gpus, min_memory_mib=ctx.kind.gpu_memory_mib,
                               require_ecc=ctx.kind.ecc)]


# The checks that import torch (and transformers, the core) are imported by their probe, when it runs: loading the
# preflight package (the code location, `factory run`'s gate) stays light, and a failing import fails that check only.
def _matmul(ctx: Context) -> list[CheckResult]:
    from factory.ops.preflight.perf import matmul_check  # noqa: PLC0415 heavy: torch; imported by its probe

    return [matmul_check(ctx.kind.matmul_gflops, ctx.mode, gpus_expected=ctx.kind.gpus > 0)]


def _memory(ctx: Context) -> list[CheckResult]:
    from factory.ops.preflight.perf import memory_bandwidth_check  # noqa: PLC0415 heavy: torch; imported by its probe

    return [memory_bandwidth_check(ctx.kind.memory_gbs, ctx.mode)]


def _determinism(ctx: Context) -> list[CheckResult]:
    from factory.ops.preflight.determinism import determinism_check  # noqa: PLC0415 heavy: torch; by its probe

    return [determinism_check()]


def _logprob_gap(ctx: Context) -> list[CheckResult]:
    from factory.ops.preflight.logprob_gap import logprob_gap_check  # noqa: PLC0415 heavy: torch; by its probe

    return [logprob_gap_check(ctx.paths, ctx.spec_path)]


def _disk(label: str, where: Callable[[FactoryPaths], object]) -> Callable[[Context], list[CheckResult]]:
    def run(ctx: Context) -> list[CheckResult]:
        k = ctx.kind
        return disk_checks(label, where(ctx.paths), ctx.mode, free_floor_gb=k.disk_free_gb,  # type: ignore[arg-type]
                           write_floor_mbs=k.disk_write_mbs, read_floor_mbs=k.disk_read_mbs)
    return run


def _allreduce(ctx: Context) -> list[CheckResult]:
    from factory.ops.preflight.allreduce import allreduce_check  # noqa: PLC0415 heavy: torch; imported by its probe

    return [allreduce_check(ctx.kind.allreduce_gbs, ctx.mode, len(ctx.gpus or []))]


def _lake_commit(ctx: Context) -> list[CheckResult]:
    return [lake_commit_check(ctx.lake, ctx.node, ctx.started_at, ctx.preflight_id, ctx.mode)]


def _mlflow(ctx: Context) -> list[CheckResult]:
    return [mlflow_check(ctx.paths)]


def _sandbox(ctx: Context) -> list[CheckResult]:
    return [sandbox_check(ctx.mode)]


def _rollout_server(ctx: Context) -> list[CheckResult]:
    from factory.ops.preflight.rollout_server import rollout_server_check  # noqa: PLC0415 heavy: torch; by its probe

    return [rollout_server_check(ctx.paths)]


def _disk_probe(label: str, where: Callable[[FactoryPaths], object]) -> Probe:
    return Probe(f"disk_{label}", tuple(f"disk_{m}_{label}" for m in ("free", "write", "read")), False,
                 _disk(label, where))


PROBES: tuple[Probe, ...] = (
    Probe("python", ("python",), False, _python, quiet=True),
    Probe("packages", ("packages",), False, _packages),  # after the throughput checks: it imports for seconds
    Probe("accelerators", ("accelerators",), False, _accelerators, quiet=True),
    Probe("matmul", ("matmul",), False, _matmul, quiet=True),
    Probe("memory_bandwidth", ("memory_bandwidth",), False, _memory, quiet=True),
    Probe("allreduce", ("allreduce",), True, _allreduce, quiet=True),
    Probe("determinism", ("determinism",), False, _determinism, background=True),
    Probe("logprob_gap", ("logprob_gap",), False, _logprob_gap, background=True),
    _disk_probe("checkpoints", lambda p: p.checkpoints),
    _disk_probe("lake", lambda p: p.warehouse),
    Probe("lake_commit", ("lake_commit",), False, _lake_commit),
    Probe("mlflow", ("mlflow",), False, _mlflow, background=True),
    Probe("sandbox", ("sandbox",), False, _sandbox),
    Probe("rollout_server", ("rollout_server",), True, _rollout_server),
)
CHECK_NAMES: tuple[str, ...] = tuple(c for p in PROBES for c in p.checks)


def select_probes(mode: Mode, only: Sequence[str] | None = None) -> list[Probe]:
    """The probes a run makes: those of `mode`, or those that produce any check named in `only` (probe or check
    names; any mode). ValueError naming the unknown ones and the valid names."""
    if mode not in MODES:
        raise ValueError(f"preflight mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not only:
        return [p for p in PROBES if mode == "deep" or not p.deep_only]
    known = {p.name for p in PROBES} | set(CHECK_NAMES)
    unknown = [c for c in only if c not in known]
    if unknown:
        raise ValueError(f"unknown preflight check(s) {', '.join(unknown)}; valid: {', '.join(CHECK_NAMES)}")
    return [p for p in PROBES if p.name in only or set(p.checks) & set(only)]


def run_preflight(paths: FactoryPaths, lake: Lake | None = None, *, mode: Mode = "quick",
                  only: Sequence[str] | None = None, kind: str | None = None, record: bool = True,
                  log: Log = _log.info, spec_path: str | None = None) -> PreflightReport:
    """Run the checks of `mode` (or just `only`) on this node and, with `record`, write one `node_health` row per
    check. A check that fails or crashes is a failed result; the report says whether the rows were written
    (`recorded`, else `record_error`). `spec_path`: the experiment whose engine/trainer setup the `logprob_gap` check
    gates (default: the tiny one). ValueError for an unknown mode, check or node kind."""
    probes = select_probes(mode, only)
    gpus, gpu_error = None, ""
    try:
        gpus = query_gpus()
    except (RuntimeError, ValueError) as e:
        gpu_error = str(e)
    nk = node_kind(kind, [g.name for g in gpus] if gpus else None)
    started = dt.datetime.now(dt.UTC)
    ctx = Context(paths, node_name(), nk, mode, uuid.uuid4().hex[:12], started, gpus, gpu_error, lake, spec_path)
    report = PreflightReport(ctx.preflight_id, ctx.node, nk.name, mode, started)
    t0 = time.perf_counter()
    log(f"preflight {ctx.preflight_id} on {ctx.node} ({nk.name}, {mode}): {len(probes)} probes")
    done: dict[str, list[CheckResult]] = {}
    for p in [p for p in probes if p.quiet]:
        done[p.name] = _guarded(p.checks, lambda p=p: p.run(ctx), log)
    background = [(p, _start_child(p, ctx)) for p in probes if p.background]
    for p in [p for p in probes if not p.quiet and not p.background]:
        done[p.name] = _guarded(p.checks, lambda p=p: p.run(ctx), log)
    for p, wait in background:
        done[p.name] = _guarded(p.checks, wait, log)
    report.results = [r for p in probes for r in done[p.name]]
    report.seconds = time.perf_counter() - t0
    if record:
        try:
            ctx.lake().upsert("node_health", report.rows())
            report.recorded = True
        except Exception as e:  # noqa: BLE001 - the results stand; the caller reports that they were not written
            report.record_error = f"{type(e).__name__}: {e}"
            log(f"preflight: results NOT recorded in the lake: {report.record_error}")
    if ctx._lake is not None:
        ctx._lake.close()
    return report


def _start_child(probe: Probe, ctx: Context) -> Callable[[], list[CheckResult]]:
    """Start `probe` in a child process (`python -m factory.ops.preflight.runner --child ...`); returns the wait for
    its results. A child that fails, hangs or prints garbage fails the probe's checks with what it said."""
    argv = [sys.executable, "-m", "factory.ops.preflight.runner", "--child", probe.name, "--home", str(ctx.paths.root),
            "--mode", ctx.mode, "--kind", ctx.kind.name, *(["--spec", ctx.spec_path] if ctx.spec_path else [])]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        err: Exception = e

        def cannot() -> list[CheckResult]:
            raise err
        return cannot

    def wait() -> list[CheckResult]:
        try:
            out, errs = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"{probe.name} did not finish in {CHILD_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            tail = (errs.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"its process exited {proc.returncode}: {tail}")
        return [CheckResult(**d) for d in json.loads(out.strip().splitlines()[-1])]

    return wait


def _child_main(argv: list[str] | None = None) -> int:
    """One probe, run for a parent preflight: prints its results as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m factory.ops.preflight.runner")
    p.add_argument("--child", required=True, choices=[pr.name for pr in PROBES])
    p.add_argument("--home", required=True)
    p.add_argument("--mode", choices=MODES, default="quick")
    p.add_argument("--kind")
    p.add_argument("--spec")
    a = p.parse_args(argv)

    probe = next(pr for pr in PROBES if pr.name == a.child)
    ctx = Context(factory_home(a.home), node_name(), node_kind(a.kind, None), a.mode, "child",
                  dt.datetime.now(dt.UTC), None, "", None, a.spec)
    print(json.dumps([r.to_dict() for r in _guarded(probe.checks, lambda: probe.run(ctx), lambda _: None)]))
    return 0


def _guarded(checks: tuple[str, ...], fn: Callable[[], list[CheckResult]],
             log: Log) -> list[CheckResult]:
    """fn's results, each with its duration (the call's, unless it set one); if fn raises, every check it owns fails
    with the error: a check that crashes is a failed check, never a crashed preflight."""
    t0 = time.perf_counter()
    try:
        results = fn()
    except Exception as e:  # noqa: BLE001
        results = [CheckResult(c, False, message=f"check raised {type(e).__name__}: {e}") for c in checks]
    seconds = time.perf_counter() - t0
    results = [r if r.duration_s else replace(r, duration_s=seconds / len(results)) for r in results]
    for r in results:
        log(f"preflight: {r.name} {'ok' if r.passed else 'FAILED'}: {r.message}")
    return results


if __name__ == "__main__":
    sys.exit(_child_main())
