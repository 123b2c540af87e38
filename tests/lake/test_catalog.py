"""Opening the catalog and creating its tables: processes starting together on a fresh home all succeed
and leave exactly one table of each name (no orphan metadata from a lost create)."""

from __future__ import annotations

import subprocess
import sys
import time

from factory.home import factory_home
from factory.lake import TABLES, Lake

# Wait for the go file so every process opens the fresh catalog at the same moment.
_RACER = """
import sys, time
from pathlib import Path
from factory.home import factory_home
from factory.lake import Lake
root, go, name = sys.argv[1:]
Path(go).with_name(f"ready-{name}").touch()
deadline = time.monotonic() + 120
while not Path(go).exists():
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.002)
Lake.open(factory_home(root)).close()
"""


def test_processes_opening_a_fresh_catalog_together_all_succeed(tmp_path):
    root, go, n = tmp_path / "home", tmp_path / "go", 6
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(root), str(go), f"p{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < n and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * n, "\n".join(outs)

    paths = factory_home(root)
    with Lake.open(paths) as lake:
        assert {t[1] for t in lake.catalog.list_tables("factory")} == set(TABLES)
    for name in TABLES:  # one create won: a single metadata file per table
        assert len(list((paths.warehouse / "factory" / name / "metadata").glob("*.metadata.json"))) == 1, name
