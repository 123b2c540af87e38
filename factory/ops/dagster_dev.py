"""`dagster dev` on 127.0.0.1 for a given FACTORY_HOME, as a supervised service (browser tests, benchmarks)."""

from __future__ import annotations

import sys
from pathlib import Path

from factory.ops.supervisor import ServiceProcess
from factory.sweep import dagster_instance_yaml

ROOT = Path(__file__).resolve().parents[2]


def dagster_dev(home: Path, max_concurrent_runs: int = 4, startup_timeout: float = 180.0) -> ServiceProcess:
    """The UI, daemon and code server of `workspace.yaml` on a free port, with FACTORY_HOME=`home` and its own
    DAGSTER_HOME (Factory's run queue, `dagster_instance_yaml`); not started. Its log is `home/dagster-dev.log`."""
    dagster_home = home / "dagster"
    dagster_home.mkdir(parents=True, exist_ok=True)
    (dagster_home / "dagster.yaml").write_text(dagster_instance_yaml(max_concurrent_runs=max_concurrent_runs))
    dagster = str(Path(sys.executable).parent / "dagster")
    # Default signal handling: dagster dev started in the background otherwise ignores SIGTERM.
    argv = ["env", "--default-signal=INT,TERM,HUP", dagster, "dev", "-w", "workspace.yaml",
            "-h", "127.0.0.1", "-p", "{port}"]
    env = {"FACTORY_HOME": str(home), "DAGSTER_HOME": str(dagster_home)}
    return ServiceProcess("dagster-dev", argv, health_path="/server_info", env=env, log_path=home / "dagster-dev.log",
                          startup_timeout=startup_timeout, max_restarts=0, cwd=ROOT)
