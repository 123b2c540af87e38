"""The test tiers: `make test` runs every test; `make test-fast` leaves out those marked `slow` and must still
cover every package, so every tests/<package>/ keeps at least one test that is not slow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def _fast_packages(request) -> set[str]:
    """The packages with a test outside the slow tier: from this session's items when it collected the whole suite
    (`make test`, `make test-fast`: free), else from a collection of it in a subprocess (tens of seconds)."""
    opt = request.config.option
    whole = [Path(a).resolve() for a in request.config.args] in ([TESTS.resolve()], [TESTS.parent.resolve()])
    filtered = opt.keyword or opt.markexpr not in ("", "not slow") or getattr(opt, "lf", False) or opt.deselect
    if whole and not filtered:
        nodes = [item.nodeid for item in request.session.items if item.get_closest_marker("slow") is None]
    else:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                              "-p", "no:cacheprovider", str(TESTS)], cwd=TESTS.parent, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        nodes = [line for line in out.stdout.splitlines() if "::" in line]
    return {n.split("/")[1] for n in nodes if n.startswith("tests/") and n.count("/") >= 2}


def test_every_test_package_has_a_test_outside_the_slow_tier(request):
    packages = sorted(d.name for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))
    fast = _fast_packages(request)
    assert packages and [p for p in packages if p not in fast] == []
