"""Named fault points: places in the code where a chaos test may want to strike (a kill during a resume-point
write, during a weight publish).

Off unless the environment asks:
- `FACTORY_FAULT_KILL=name:n`: the process SIGKILLs itself the n-th time it reaches point `name` (a test's
  way to die at an exact place, as a kill -9 from outside would, without the race);
- `FACTORY_FAULT_HANG=name:n`: the n-th time, it stops there for good (a hang: alive, silent);
- `FACTORY_FAULT_RAISE=name:n`: the n-th time, it raises `InjectedFault` (a crash the process survives);
- `FACTORY_FAULT_ENOSPC=name:n`: the n-th time, it raises OSError(ENOSPC) for the `path` the point names (a
  full disk at that write: a real small filesystem needs root to mount);
- `FACTORY_FAULT_ATTEMPT=k`: those two only in attempt k of a run (`FACTORY_ATTEMPT`, which the restart
  supervisor sets for each attempt), so the attempt that resumes does not die the same way;
- `FACTORY_FAULT_DIR`: each point touches `<dir>/<name>.<pid>` while the process is there (so a harness can
  see it and kill it) and holds there to keep the window open: `FACTORY_FAULT_HOLD_S` seconds, either one
  number for every point or per point, e.g. `resume_write:0.2,publish:0.05` (default 0).
Production code pays a few dictionary lookups per point.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

_hits: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """Raised at a fault point that FACTORY_FAULT_RAISE names."""


def _armed(var: str, name: str) -> bool:
    spec = os.environ.get(var)
    if not spec:
        return False
    target, _, n = spec.partition(":")
    if target != name:
        return False
    only = os.environ.get("FACTORY_FAULT_ATTEMPT")
    if only and os.environ.get("FACTORY_ATTEMPT", "1") != only:
        return False
    key = f"{var}:{name}"
    _hits[key] = _hits.get(key, 0) + 1
    return _hits[key] == int(n or 1)


def _hold(name: str) -> float:
    spec = os.environ.get("FACTORY_FAULT_HOLD_S", "") or "0"
    if ":" not in spec:
        return float(spec)
    holds = dict(item.split(":", 1) for item in spec.split(",") if item)
    return float(holds.get(name, 0))


def fault_point(name: str, path: str | Path | None = None) -> None:
    """This process reached fault point `name`, about to write `path` if it names one (no-op unless the
    environment asks, see the module docstring)."""
    if _armed("FACTORY_FAULT_ENOSPC", name):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else str(path))
    if _armed("FACTORY_FAULT_KILL", name):
        os.kill(os.getpid(), signal.SIGKILL)
    if _armed("FACTORY_FAULT_RAISE", name):
        raise InjectedFault(f"fault injected at {name} (FACTORY_FAULT_RAISE)")
    if _armed("FACTORY_FAULT_HANG", name):
        threading.Event().wait()  # forever: only a kill ends it
    root = os.environ.get("FACTORY_FAULT_DIR")
    if not root:
        return
    marker = Path(root) / f"{name}.{os.getpid()}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(time.time()))
    hold = _hold(name)
    if hold > 0:
        time.sleep(hold)
    marker.unlink(missing_ok=True)
