"""Processes that start at one moment (a start-up race), for tests of what a fresh FACTORY_HOME does when several
processes set it up at once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# Each racer says it is ready, then waits for the go file, so all of them run `body` at the same moment.
# `body` sees `root` (the FACTORY_HOME) and `name` (p0, p1, ...).
_PRELUDE = """
import sys, time
from pathlib import Path
root, go, name = sys.argv[1:]
Path(go).with_name(f"ready-{name}").touch()
deadline = time.monotonic() + 120
while not Path(go).exists():
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.002)
"""


def race(tmp_path: Path, body: str, n: int) -> Path:
    """Run `body` in `n` processes released together on the fresh home `tmp_path/home`; assert they all exit 0
    (showing every output otherwise); return the home."""
    root, go = tmp_path / "home", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _PRELUDE + body, str(root), str(go), f"p{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]
    try:
        deadline = time.monotonic() + 120  # imports take seconds on a busy machine
        while len(list(tmp_path.glob("ready-*"))) < n and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * n, "\n".join(outs)
    return root
