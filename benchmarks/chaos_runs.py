"""The supervised runs that `benchmarks/chaos.py` and `benchmarks/chaos_faults.py` strike: `Run`, one
`factory run` of the tiny model on its own FACTORY_HOME and what it has on disk (run directory, heartbeat, attempt
lock, fault-point markers, lake rows), and the /proc helpers that find a run's processes.

Imported as `benchmarks.chaos_runs`: the repository root must be on `sys.path` (chaos.py puts it there; the tests
run from it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from factory.home import FactoryPaths
from factory.lake import Lake

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 1800.0  # only so a broken run cannot hang the benchmark


def wait_for(pred: Callable[[], object], timeout: float, every: float = 0.05) -> bool:
    """Poll `pred` every `every` s until it holds (True) or `timeout` s have passed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            # a service started in a warm spare (factory/infra/spare.py) keeps its parent's command line and is
            # named by its comm: shown here as `[comm] cmdline`
            out[int(d.name)] = (int(fields[1]), f"[{(d / 'comm').read_text().strip()}] {cmd}")
        except (OSError, ValueError, IndexError):
            continue
    return out


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live direct children of `pid`."""
    return [(p, cmd) for p, (ppid, cmd) in proc_table().items() if ppid == pid]


def descendants(pid: int) -> set[int]:
    """The live children of `pid`, their children, and so on."""
    table = proc_table()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def lake_rows(home: Path, table: str) -> list[dict]:
    """Every row of `table` in the lake of FACTORY_HOME `home`."""
    with Lake.open(FactoryPaths(home)) as lake:
        return lake.read(table).to_pylist()


def step_faults(seen: list[int], steps: int) -> tuple[int, int]:
    """(duplicated, missing) steps among the `steps` rows' step numbers `seen` of a run of `steps` steps."""
    return len(seen) - len(set(seen)), len(set(range(1, steps + 1)) - set(seen))


class Run:
    """A supervised `factory run` on its own FACTORY_HOME (`work/name`), its log (`work/name.log`), and what it
    has on disk. `start` launches one; the constructor only wraps a process already started."""

    def __init__(self, work: Path, name: str, proc: subprocess.Popen, faults: Path | None = None):
        self.work, self.home, self.name, self.proc, self.faults = work, work / name, name, proc, faults
        self.log_path = work / f"{name}.log"

    @classmethod
    def start(cls, work: Path, name: str, spec: Path, args: list[str], env: dict[str, str] | None = None,
              faults: Path | None = None) -> Run:
        """`factory run SPEC --set name=NAME ARGS` with `env` added to this process's environment; `faults` is the
        FACTORY_FAULT_DIR the caller put in `env`, where `at_point` looks for markers."""
        with (work / f"{name}.log").open("w") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, "-m", "factory.cli", "--home", str(work / name), "run",
                                     str(spec), "--set", f"name={name}", *args],
                                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                    cwd=ROOT)
        return cls(work, name, proc, faults)

    def run_dir(self) -> Path | None:
        dirs = list((self.home / "checkpoints").glob(f"{self.name}-*"))
        return dirs[0] if dirs else None

    def step(self) -> int:
        """The step in the run's heartbeat (0 before the first)."""
        d = self.run_dir()
        try:
            text = (d / "heartbeat").read_text().strip() if d else ""
        except OSError:
            return 0
        return int(text) if text.isdigit() else 0

    def beat_at(self) -> float:
        """When the heartbeat was last written (0.0 before the first)."""
        d = self.run_dir()
        try:
            return (d / "heartbeat").stat().st_mtime if d else 0.0
        except OSError:
            return 0.0

    def attempt_pid(self) -> int | None:
        """The live attempt (rank 0 of a group): it writes its pid into the lock it holds."""
        d = self.run_dir()
        try:
            pid = int((d / "attempt.lock").read_text().strip()) if d else 0
        except (OSError, ValueError):
            return None
        return pid if pid and alive(pid) else None

    def service(self, kind: str) -> int | None:
        """The live attempt's 'rollout-server' or 'env-worker' child process."""
        pid = self.attempt_pid()
        if pid is None:
            return None
        want = {"rollout-server": (" serve ", "[rollout-server]"), "env-worker": (" env-serve ", "[env-worker]")}[kind]
        found = [c for c, cmd in children(pid) if any(w in f" {cmd} " for w in want)]
        return found[0] if found else None

    def at_point(self, point: str, pid: int, timeout: float = 60) -> bool:
        """Wait until process `pid` is at fault point `point` (its marker file in `faults` exists); False if the
        run ends or `timeout` s pass first."""
        if self.faults is None:
            raise ValueError(f"Run {self.name!r}: at_point needs the run started with faults=FACTORY_FAULT_DIR")
        marker = self.faults / f"{point}.{pid}"
        wait_for(lambda: marker.exists() or self.proc.poll() is not None, timeout, every=0.002)
        return marker.exists()

    def reached(self, step: int) -> bool:
        """Step `step` trained (or the run ended: the caller checks which)."""
        return self.step() >= step or self.proc.poll() is not None

    def wait(self, timeout: float = LIMIT_S) -> int:
        return self.proc.wait(timeout=timeout)

    def resume(self, run_id: str) -> int:
        """`factory resume RUN_ID` without any fault, its output appended to the log."""
        with self.log_path.open("a") as log:
            log.write(f"\n--- factory resume {run_id}\n")
            log.flush()
            return subprocess.run([sys.executable, "-m", "factory.cli", "--home", str(self.home), "resume", run_id],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=LIMIT_S).returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rows(self, table: str) -> list[dict]:
        return lake_rows(self.home, table)

    def run_row(self) -> dict:
        (row,) = self.rows("runs")
        return row

    def step_faults(self, steps: int) -> tuple[int, int]:
        """(duplicated, missing) `steps` rows of a run of `steps` steps."""
        return step_faults([r["step"] for r in self.rows("steps")], steps)
