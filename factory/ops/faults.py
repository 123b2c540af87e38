"""Named fault points: places in the code where a chaos test may want to strike (a kill during a resume-point
write, during a weight publish).

Off unless the environment asks:
- `FACTORY_FAULT_DIR`: each point touches `<dir>/<name>.<pid>` while the process is there (so a harness can
  see it and kill it) and holds for `FACTORY_FAULT_HOLD_S` seconds (default 0) to keep the window open;
- `FACTORY_FAULT_KILL=name:n`: the process SIGKILLs itself the n-th time it reaches point `name` (a test's
  way to die at an exact place, as a kill -9 from outside would, without the race).
Production code pays two dictionary lookups per point.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """This process reached fault point `name` (no-op unless the environment asks, see the module docstring)."""
    kill = os.environ.get("FACTORY_FAULT_KILL")
    if kill:
        target, _, n = kill.partition(":")
        if target == name:
            _hits[name] = _hits.get(name, 0) + 1
            if _hits[name] == int(n or 1):
                os.kill(os.getpid(), signal.SIGKILL)
    root = os.environ.get("FACTORY_FAULT_DIR")
    if not root:
        return
    marker = Path(root) / f"{name}.{os.getpid()}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(time.time()))
    hold = float(os.environ.get("FACTORY_FAULT_HOLD_S", "0") or 0)
    if hold > 0:
        time.sleep(hold)
    marker.unlink(missing_ok=True)
