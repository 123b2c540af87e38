"""Sweep assets: one training run per sweep member (a dynamic partition), and each sweep's summary."""

import json

from dagster import (
    AssetExecutionContext,
    DynamicPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from factory.sweep import read_member, read_sweep, sweep_id_of
from resources import FactoryHomeResource, LakeResource, MlflowResource

sweep_members = DynamicPartitionsDefinition(name="sweep_members")
sweeps = DynamicPartitionsDefinition(name="sweeps")


@asset(group_name="sweeps", code_version="1", partitions_def=sweep_members, kinds={"pytorch", "iceberg", "mlflow"})
def sweep_member_run(context: AssetExecutionContext, home: FactoryHomeResource, lake: LakeResource,
                     mlflow: MlflowResource) -> MaterializeResult:
    """A sweep member trained end to end (dataset, shared SFT warm start, GRPO, held-out eval), nested in
    MLflow under its sweep's parent run; its `sweeps` row follows it from running to succeeded/failed."""
    from factory.experiment import run_curves, run_sweep_member  # heavy: see assets/training.py
    from factory.plots import markdown_image

    key = context.partition_key
    paths = home.paths()
    try:
        spec, axes = read_member(paths, key)
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise Failure(f"sweep member {key}: {e}") from e
    info = read_sweep(paths, sweep_id_of(key))
    lk, tracker = lake.lake(), mlflow.tracker()
    res = run_sweep_member(spec, paths, lk, tracker, info["sweep_id"], key, axes,
                           sweep_name=info["definition"]["name"],
                           mlflow_parent_run_id=info.get("mlflow_parent_run_id"), log=context.log.info)
    curves = run_curves(lk, tracker, res.run_id, res.mlflow_run_id)
    return MaterializeResult(metadata={
        "curves": MetadataValue.md(markdown_image(curves, f"reward and accuracy of {res.run_id}")),
        "run_id": res.run_id, "mlflow_run_id": res.mlflow_run_id, "sweep_id": info["sweep_id"],
        "axes": MetadataValue.json(axes), "accuracy": res.final_accuracy, "start_accuracy": res.start_accuracy,
        "checkpoint": MetadataValue.path(str(res.checkpoint.path)), "steps": res.steps, "seconds": res.seconds,
    })


@asset(group_name="sweeps", code_version="1", partitions_def=sweeps, kinds={"iceberg", "mlflow"})
def sweep_summary(context: AssetExecutionContext, lake: LakeResource, mlflow: MlflowResource) -> MaterializeResult:
    """Every member of a sweep with its axis values and final held-out accuracy, best first, and a plot of
    accuracy against each axis (also on the sweep's MLflow parent run)."""
    from factory.plots import markdown_image, sweep_summary_png

    sweep_id = context.partition_key
    rows = lake.lake().read("sweeps", f"sweep_id = '{sweep_id}'").to_pylist()
    if not rows:
        raise Failure(f"sweep {sweep_id}: no rows in the `sweeps` table")
    rows.sort(key=lambda r: -(r["final_accuracy"] if r["final_accuracy"] is not None else -1.0))
    axes = sorted({k for r in rows for k in json.loads(r["axes"])})
    header = "| member | " + " | ".join(axes) + " | status | accuracy |\n|---|" + "---|" * (len(axes) + 2)
    def acc(r: dict) -> str:
        return "" if r["final_accuracy"] is None else f"{r['final_accuracy']:.3f}"

    lines = [f"| {r['member']} | " + " | ".join(str(json.loads(r["axes"]).get(a)) for a in axes) +
             f" | {r['status']} | {acc(r)} |" for r in rows]
    done = [r for r in rows if r["status"] == "succeeded"]
    best = done[0] if done else None
    pictures = {}
    members = [{**json.loads(r["axes"]), "final_accuracy": r["final_accuracy"]} for r in rows]
    parent = next((r["mlflow_parent_run_id"] for r in rows if r["mlflow_parent_run_id"]), None)
    for axis in axes:
        if not done:
            break
        png = sweep_summary_png(members, axis, group_by=[a for a in axes if a != axis and a != "seed"] or None,
                                title=f"{sweep_id}: accuracy vs {axis}")
        pictures[f"accuracy_vs_{axis}"] = MetadataValue.md(markdown_image(png, f"accuracy vs {axis}"))
        if parent:
            mlflow.tracker().log_png(parent, f"plots/accuracy_vs_{axis}.png", png)
    return MaterializeResult(metadata={
        **pictures,
        "members": len(rows), "succeeded": len(done), "failed": sum(r["status"] == "failed" for r in rows),
        "best_member": best["member"] if best else "", "best_accuracy": best["final_accuracy"] if best else None,
        "table": MetadataValue.md(header + "\n" + "\n".join(lines)),
    })
