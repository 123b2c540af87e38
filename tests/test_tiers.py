"""The test tiers: `make test` runs every test; `make test-fast` leaves out those marked `slow` and must still
cover every package, so every tests/<package>/ keeps at least one test that is not slow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_every_test_package_has_a_test_outside_the_slow_tier():
    packages = sorted(d.name for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                          "-p", "no:cacheprovider", str(TESTS)], cwd=TESTS.parent, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    fast = {line.split("/")[1] for line in out.stdout.splitlines() if line.startswith("tests/") and "::" in line}
    assert packages and [p for p in packages if p not in fast] == []
