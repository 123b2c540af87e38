"""The cockpit: the Dagster UI (webserver, daemon, code server) and the MLflow UI beside it, on 127.0.0.1, for one
FACTORY_HOME, each a supervised service. `make ui` runs `main()`; the browser tests and benchmarks use `cockpit()`.

The MLflow UI runs beside Dagster because the assets show their pictures in place (a short markdown image
whose bytes the MLflow UI serves) and link runs into it; both addresses are fixed before the Dagster
processes start ($FACTORY_MLFLOW_UI), so every run worker writes links that work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from factory.home import factory_home
from factory.infra.supervisor import ServiceProcess
from factory.ops.instance import ensure_instance_yaml

ROOT = Path(__file__).resolve().parents[2]
LOCATION = "factory"  # workspace.yaml's location_name
# The asset groups (assets/: every asset's group_name) and those of the quickstart job's assets; a group left out
# is drawn folded (tests/ops/test_cockpit.py checks both against the Definitions).
GROUPS = ("data", "datasets", "training", "evals", "sweeps", "ops")
QUICKSTART_GROUPS = ("data", "datasets", "training", "evals")
QUICKSTART_QUERY = 'job:"quickstart"'  # the quickstart job's assets, in Dagster's asset selection syntax


def _expanded(groups: tuple[str, ...]) -> str:
    # The UI keeps the groups it shows opened in `expanded`, each named `global@global:<group>` (read off
    # Dagster 1.13's UI after "expand all"); without it a graph spanning several groups opens collapsed.
    return quote(",".join(f"global@global:{g}" for g in groups), safe="")


def _lineage(query: str) -> str:
    # The global lineage view's path carries its asset selection after a `~` (Dagster 1.13's explorerPathToString).
    return f"/asset-groups~{quote(query, safe='')}/" if query else "/asset-groups"


def cockpit_urls(dagster_url: str = "http://127.0.0.1:3000") -> dict[str, str]:
    """Where to look: the quickstart's asset graph opened out, every asset's lineage opened out, the sweep
    launchpad, the runs. The quickstart's graph is the lineage view filtered to the job's assets, not the job's own
    page: that page always draws the job's Info panel beside the graph, over a third of a 1600 px window."""
    base = dagster_url.rstrip("/")
    return {
        "quickstart": f"{base}{_lineage(QUICKSTART_QUERY)}?expanded={_expanded(QUICKSTART_GROUPS)}",
        "lineage": f"{base}{_lineage('')}?expanded={_expanded(GROUPS)}",
        "sweep_launchpad": f"{base}/locations/{LOCATION}/jobs/sweep/playground",
        "runs": f"{base}/runs",
    }


def mlflow_ui(home: Path, port: int | None = None, startup_timeout: float = 120.0) -> ServiceProcess:
    """The MLflow UI over FACTORY_HOME's tracking store, on 127.0.0.1; not started."""
    paths = factory_home(home)
    mlflow = str(Path(sys.executable).parent / "mlflow")
    # One worker and no job runner: by default MLflow starts 4 web workers and 6 job consumers, a lot beside
    # training on a laptop, for a UI one person reads.
    argv = [mlflow, "ui", "--backend-store-uri", f"sqlite:///{paths.mlflow_db}",
            "--default-artifact-root", paths.mlflow_artifacts.as_uri(), "--host", "127.0.0.1", "--port", "{port}",
            "--workers", "1"]
    return ServiceProcess("mlflow-ui", argv, port=port, health_path="/health", log_path=paths.root / "mlflow-ui.log",
                          env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, startup_timeout=startup_timeout,
                          max_restarts=0, cwd=ROOT)


def dagster_dev(home: Path, port: int | None = None, mlflow_url: str | None = None,
                startup_timeout: float = 180.0) -> ServiceProcess:
    """The Dagster UI, daemon and code server of `workspace.yaml` with FACTORY_HOME=`home` and DAGSTER_HOME
    `home/dagster` (Factory's instance settings added where missing, as `make demo` does); not started. Its log
    is `home/dagster-dev.log`."""
    paths = factory_home(home)
    ensure_instance_yaml(paths.dagster_home)
    dagster = str(Path(sys.executable).parent / "dagster")
    # Default signal handling: dagster dev started in the background otherwise ignores SIGTERM.
    argv = ["env", "--default-signal=INT,TERM,HUP", dagster, "dev", "-w", "workspace.yaml",
            "-h", "127.0.0.1", "-p", "{port}"]
    env = {"FACTORY_HOME": str(paths.root), "DAGSTER_HOME": str(paths.dagster_home)}
    if mlflow_url:
        env["FACTORY_MLFLOW_UI"] = mlflow_url
    return ServiceProcess("dagster-dev", argv, port=port, health_path="/server_info", env=env,
                          log_path=paths.root / "dagster-dev.log", startup_timeout=startup_timeout, max_restarts=0,
                          cwd=ROOT)


@contextlib.contextmanager
def cockpit(home: Path, dagster_port: int | None = None, mlflow_port: int | None = None
            ) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """Both UIs started (MLflow first: the Dagster processes learn its address), stopped on exit."""
    with mlflow_ui(home, mlflow_port) as mlflow:  # without a port: one picked, another if it was taken
        with dagster_dev(home, dagster_port, mlflow_url=mlflow.url) as dagster:
            yield dagster, mlflow


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start the Dagster UI and the MLflow UI for FACTORY_HOME.")
    parser.add_argument("--port", type=int, default=3000, help="Dagster UI port (default 3000)")
    parser.add_argument("--mlflow-port", type=int, default=5000, help="MLflow UI port (default 5000)")
    args = parser.parse_args(argv)
    # SIGTERM (a service manager, `kill`) unwinds like Ctrl-C, so both UIs are stopped with the cockpit.
    signal.signal(signal.SIGTERM, _interrupt)
    paths = factory_home()
    if os.environ.get("DAGSTER_HOME") and Path(os.environ["DAGSTER_HOME"]).resolve() != paths.dagster_home:
        print(f"note: DAGSTER_HOME={os.environ['DAGSTER_HOME']} is ignored; the cockpit uses {paths.dagster_home}")
    for change in ensure_instance_yaml(paths.dagster_home):  # an older file gains what it lacks
        print(change)
    print(f"starting the MLflow UI and the Dagster UI for {paths.root} (logs: {paths.root}/*.log) ...", flush=True)
    with cockpit(paths.root, args.port, args.mlflow_port) as (dagster, mlflow):
        urls = cockpit_urls(dagster.url)
        print(f"\nDagster UI   {urls['runs']}\n  quickstart graph  {urls['quickstart']}\n"
              f"  all assets        {urls['lineage']}\n  launch a sweep    {urls['sweep_launchpad']}\n"
              f"MLflow UI    {mlflow.url}\n\nCtrl-C stops both.", flush=True)
        try:
            while dagster.alive() and mlflow.alive():
                time.sleep(1.0)  # waiting for Ctrl-C; a service that exits ends the cockpit
        except KeyboardInterrupt:
            return 0
    print("a UI process exited; see the logs above", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
