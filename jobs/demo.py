"""`make demo`: run the quickstart job in-process on the persistent Dagster instance, then print results.

The runs land in FACTORY_HOME/dagster, so `make ui` shows them afterwards next to the assets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from factory.home import factory_home
from factory.ops.cockpit import cockpit_urls
from factory.ops.instance import ensure_instance_yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", default="examples/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override a spec field, e.g. --set seed=1 (repeatable)")
    args = parser.parse_args(argv)

    paths = factory_home()
    os.environ.setdefault("DAGSTER_HOME", str(paths.dagster_home))
    os.environ["FACTORY_SPEC"] = args.spec  # the asset graph's prompt sources are this spec's (jobs/__init__.py)
    # The same instance settings as `make ui` and the tests (factory/ops/instance.py); an existing file keeps
    # what it sets and gains what it lacks.
    for change in ensure_instance_yaml(os.environ["DAGSTER_HOME"]):
        print(change)

    # heavy: dagster, the lake and every asset module; after --help and the instance file
    from dagster import DagsterInstance  # noqa: PLC0415 heavy: dagster; after --help and the instance file

    from factory.lake.writer import Lake  # noqa: PLC0415 heavy: pyiceberg, duckdb; after --help
    from factory.runs.stages import eval_summary, render_report  # noqa: PLC0415 heavy: torch; after --help
    from jobs import defs, make_resources  # noqa: PLC0415 every asset module (torch-free, seconds); after --help

    job = defs.resolve_job_def("quickstart")
    t0 = time.perf_counter()
    with DagsterInstance.get() as instance:
        result = job.execute_in_process(
            instance=instance,
            resources=make_resources(args.spec, args.overrides, str(paths.root)),
            run_config={"loggers": {"console": {"config": {"log_level": "INFO"}}}},
            raise_on_error=False,
        )
        if not result.success:
            print("quickstart job failed; see the log above", file=sys.stderr)
            return 1
        run_md = result.asset_materializations_for_node("grpo_run")[0].metadata
        run_id = run_md["run_id"].value
    summary = eval_summary(Lake.open(paths), run_id)
    print()
    print(render_report(summary))
    print(f"\nquickstart finished in {time.perf_counter() - t0:.0f}s (dagster run {result.run_id})")
    print(f"records under {paths.root}:")
    print("  .venv/bin/factory runs            # Iceberg `runs`")
    print(f"  .venv/bin/factory query \"SELECT step, reward_mean, accuracy FROM steps WHERE run_id = '{run_id}'\"")
    print(f"  make ui                           # Dagster UI: {cockpit_urls()['quickstart']}")
    print(f"  .venv/bin/mlflow ui --backend-store-uri sqlite:///{paths.mlflow_db}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
