"""A Postgres catalog stopped and restarted in the middle of a real `factory run`: does the run ride through it, keep
every step, and end with exit 0 and its report?

A fresh database on the machine's PostgreSQL (FACTORY_TEST_PG_URI, default the `factory` role on 127.0.0.1:5432)
is the run's catalog, reached through tests/tcp_proxy.py. Once the run's output shows RL step `--cut-at-step`, the
proxy goes down for `--outage-s` seconds (every open connection cut, new ones closed: a stopped server; the shared
server itself is never touched), then up again (the server back; every connection pooled before it is dead). Printed:
the run's output after the outage, its exit code, the steps the lake holds, and one JSON line last.

    .venv/bin/python benchmarks/catalog_outage.py [--spec examples/quickstart.yaml] [--steps 30] [--outage-s 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.tcp_proxy import TcpProxy  # noqa: E402

PG_ADMIN_URI = os.environ.get("FACTORY_TEST_PG_URI", "postgresql://factory:factory@127.0.0.1:5432/postgres")
RUN_LIMIT_S = 3600.0  # only turns a hung run into a failure


def _wait_for_line(out: Path, pattern: str, proc: subprocess.Popen, limit_s: float) -> bool:
    """Poll the run's output file until a line matches `pattern` (True) or the run ends or `limit_s` passes."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if re.search(pattern, out.read_text(errors="replace"), re.MULTILINE):
            return True
        time.sleep(0.5)  # polling a file another process writes
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "quickstart.yaml"))
    ap.add_argument("--steps", type=int, default=30, help="schedule.steps of the run")
    ap.add_argument("--cut-at-step", type=int, default=5, help="the RL step after which the catalog stops")
    ap.add_argument("--outage-s", type=float, default=30.0)
    ap.add_argument("--home", help="FACTORY_HOME of the run (default: a fresh temporary directory)")
    args = ap.parse_args()

    import psycopg2
    from sqlalchemy.engine import make_url

    db = f"checks_outage_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(PG_ADMIN_URI, connect_timeout=5)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {db}")
    url = make_url(PG_ADMIN_URI)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    catalog = url.set(drivername="postgresql+psycopg2", host="127.0.0.1", port=proxy.port, database=db)
    home = Path(args.home or tempfile.mkdtemp(prefix="catalog-outage-"))
    home.mkdir(parents=True, exist_ok=True)
    out = home / "run.out"
    env = {**os.environ, "FACTORY_HOME": str(home), "PYTHONPATH": str(ROOT),
           "FACTORY_CATALOG_URI": catalog.render_as_string(hide_password=False)}
    cmd = [sys.executable, "-m", "factory.cli", "run", args.spec, "--set", f"schedule.steps={args.steps}"]
    print(f"$ FACTORY_CATALOG_URI=<database {db} through 127.0.0.1:{proxy.port}> {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    try:
        with open(out, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        cut_at = None
        if _wait_for_line(out, rf"^step {args.cut_at_step}/", proc, RUN_LIMIT_S):
            cut_at = time.monotonic() - t0
            cut = proxy.down()
            print(f"catalog stopped after step {args.cut_at_step} ({cut_at:.0f} s into the run): {cut} connections "
                  f"cut", flush=True)
            time.sleep(args.outage_s)  # the outage itself
            proxy.up()
            print(f"catalog back after {args.outage_s:g} s ({proxy.refused} connections refused meanwhile)", flush=True)
        rc = proc.wait(RUN_LIMIT_S)
        wall = time.monotonic() - t0
        text = out.read_text(errors="replace")
        after = text[text.find(f"step {args.cut_at_step}/"):] if cut_at is not None else text
        print("--- the run's output from the step the catalog stopped at ---")
        print(after[-6000:], end="" if after.endswith("\n") else "\n")
        print("---")
        os.environ.update(FACTORY_HOME=str(home), FACTORY_CATALOG_URI=env["FACTORY_CATALOG_URI"])
        from factory.lake import Lake, query

        with Lake.open() as lake:
            steps = query("SELECT run_id, count(*) AS n, min(step) AS first, max(step) AS last FROM steps "
                          "GROUP BY run_id", lake).to_pylist()
            runs = query("SELECT run_id, status, attempts FROM runs", lake).to_pylist()
        print(f"exit code {rc}; lake: steps {steps}; runs {runs}")
        print(json.dumps({"exit_code": rc, "steps": args.steps, "cut_after_step": args.cut_at_step,
                          "outage_s": args.outage_s if cut_at is not None else None, "wall_s": round(wall, 1),
                          "lake_steps": steps[0]["n"] if len(steps) == 1 else steps,
                          "status": runs[0]["status"] if len(runs) == 1 else runs,
                          "report_printed": "### Run `" in after}))
    finally:
        proxy.close()
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        admin.close()


if __name__ == "__main__":
    main()
