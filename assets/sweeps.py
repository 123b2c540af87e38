"""Sweep assets: each shared SFT warm start (trained once, members wait for it), one training run per sweep
member (a dynamic partition), and each sweep's summary comparing its members."""

import functools
from pathlib import Path

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    DagsterRunStatus,
    DataVersion,
    DynamicPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    RunsFilter,
    TableColumn,
    TableRecord,
    TableSchema,
    asset,
)

from assets._interruptions import report_interruptions
from assets._metadata import embedded, inline_picture, progress_tags, run_metadata
from assets._pending import progress as eval_progress
from assets._retries import (
    TRAINING_RETRY,
    factory_run_id,
    no_retry_for_what_needs_a_fix,
    wait_for_previous_attempt,
    watched_by_run_worker,
)
from assets.preflight import require_healthy_node
from factory.cockpit.sweep import (
    MEMBER_TAG,
    STATUS_TAG,
    member_label,
    member_short,
    read_member,
    read_sweep,
    read_warm_start_spec,
    refuse_member,
    short_label,
    sweep_id_of,
)
from factory.cockpit.sweep_search import TrialReporter
from factory.deploy.target import op_tags
from factory.intervals import share_text
from factory.progress import format_duration
from resources import FactoryHomeResource, LakeResource, MlflowResource, TrainingLauncherResource
from resources.study import sweep_study

sweep_members = DynamicPartitionsDefinition(name="sweep_members")
sweeps = DynamicPartitionsDefinition(name="sweeps")
warm_starts = DynamicPartitionsDefinition(name="warm_starts")


@asset(group_name="sweeps", code_version="1", partitions_def=warm_starts, kinds={"pytorch"},
       op_tags=op_tags("sweep_warm_start"))
def sweep_warm_start(context: AssetExecutionContext, home: FactoryHomeResource) -> MaterializeResult:
    """The SFT warm start shared by every sweep member with the same model, task, SFT settings and seed
    (partition `sft-<fingerprint>`): trained once; the launcher starts those members after it."""
    from factory.runs.pipeline import Pipeline  # noqa: PLC0415 heavy: torch

    paths = home.paths()
    try:
        spec = read_warm_start_spec(paths, context.partition_key)
    except (FileNotFoundError, ValueError) as e:
        raise Failure(f"warm start {context.partition_key}: {e}") from None
    pipeline = Pipeline(spec, paths, log=context.log.info, progress=progress_tags(context))
    res = pipeline.warm_start(pipeline.dataset()[1], shared=True)
    return MaterializeResult(
        metadata={"path": MetadataValue.path(str(res.checkpoint.path)), "sha256": res.checkpoint.sha256,
                  "accuracy": res.accuracy, "pass_at_k": res.pass_at_k, "steps": res.steps, "seconds": res.seconds},
        data_version=DataVersion(res.checkpoint.sha256),
    )


@asset(group_name="sweeps", code_version="2", partitions_def=sweep_members, kinds={"pytorch", "iceberg", "mlflow"},
       deps=[AssetDep(sweep_warm_start, partition_mapping=AllPartitionMapping())], retry_policy=TRAINING_RETRY,
       op_tags=op_tags("sweep_member_run"))
def sweep_member_run(context: AssetExecutionContext, home: FactoryHomeResource, lake: LakeResource,
                     mlflow: MlflowResource, launcher: TrainingLauncherResource) -> MaterializeResult:
    """A sweep member trained end to end (dataset, the shared SFT warm start, GRPO, held-out eval), nested in
    MLflow under its sweep's parent run; its `sweeps` row follows it from running to succeeded/failed, or pruned (a
    tpe sweep's member that its pruner stopped at a resume point: an outcome, not a failure). While it runs, its
    tags show the step, latest reward and ETA. Its run is supervised as the `launcher` says for this deployment
    (`supervision()`: in this process, or attempts restarted in child processes as `factory run` does)."""
    from factory.cockpit.reports import run_pictures  # noqa: PLC0415 heavy: mlflow, matplotlib, when the step runs
    from factory.runs.experiment import Pruned, run_sweep_member  # noqa: PLC0415 heavy: see assets/training.py

    key = context.partition_key
    paths = home.paths()
    try:
        spec, axes = read_member(paths, key)
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise Failure(f"sweep member {key}: {e}") from None
    try:
        require_healthy_node(context, spec.ops, home, lake)  # the preflight gate: no training on a node that failed it
    except Failure as e:  # the member never starts: its row says so and why, instead of staying queued
        with lake.lake() as lk:
            refuse_member(lk, key, e.description or "refused by the preflight gate")
        raise
    info = read_sweep(paths, sweep_id_of(key))
    lk, tracker = lake.lake(), mlflow.tracker()
    context.log.info(f"sweep member {key}: {short_label(axes)} ({member_label(axes)})")
    run_id = factory_run_id(context, spec.name)
    wait_for_previous_attempt(paths.checkpoints / run_id, spec.ops.hang_timeout_s, context.log.info)
    trial = _trial(context, paths, info, key)
    # anything else: a retry resumes the member's run; the run worker's death stops it at a resume point
    with no_retry_for_what_needs_a_fix(), watched_by_run_worker(context):  # (assets/_retries.py)
        res = run_sweep_member(spec, paths, lk, tracker, info["sweep_id"], key, axes,
                               sweep_name=info["definition"]["name"],
                               mlflow_parent_run_id=info.get("mlflow_parent_run_id"), log=context.log.info,
                               progress=progress_tags(context), run_id=run_id, trial=trial,
                               supervision=launcher.supervision())
    if isinstance(res, Pruned):  # stopped at a resume point by the sweep's pruner: an outcome, not a failure
        context.instance.add_run_tags(context.run_id, {STATUS_TAG: "pruned"})
        return MaterializeResult(metadata={"label": short_label(axes), "sweep_id": info["sweep_id"],
                                           "axes": member_label(axes),
                                           "status": "pruned", "reason": res.reason, "run_id": res.run_id,
                                           "trial": trial.trial_number()})
    context.instance.add_run_tags(context.run_id, {STATUS_TAG: "succeeded"})
    report_interruptions(context, lk, res.run_id)
    head, tail = run_metadata(run_pictures(lk, tracker, res.run_id, res.mlflow_run_id), tracker, res.run_id,
                              res.mlflow_run_id)
    return MaterializeResult(metadata={
        "label": short_label(axes), **head, "sweep_id": info["sweep_id"], "axes": member_label(axes),
        "accuracy": res.final_accuracy, "start_accuracy": res.start_accuracy,
        "checkpoint": MetadataValue.path(str(res.checkpoint.path)), "steps": res.steps, "seconds": res.seconds,
        "attempts": res.attempt, "goodput": res.goodput,
        **tail,
    })


def _trial(context: AssetExecutionContext, paths, info: dict, key: str):
    """The Optuna trial of a tpe sweep's member (a `TrialReporter`), else None."""
    if info["definition"].get("mode") != "tpe":
        return None
    entry = next(m for m in info["members"] if m["key"] == key)
    return TrialReporter(sweep_study(context.instance, paths, info), entry["trial_id"], info["definition"]["prune"],
                         log=context.log.warning)  # a member the pruner spared as inside the noise says so


@asset(group_name="sweeps", code_version="2", partitions_def=sweeps, kinds={"iceberg", "mlflow"},
       deps=[AssetDep(sweep_member_run, partition_mapping=AllPartitionMapping())], op_tags=op_tags("sweep_summary"))
def sweep_summary(context: AssetExecutionContext, lake: LakeResource, mlflow: MlflowResource) -> MaterializeResult:
    """A sweep's members compared: their curves and held-out accuracy by step overlaid, accuracy against each
    axis, and per member its axis values, accuracy, pass@k, reward, wall time and links to its Dagster run, MLflow
    run and checkpoint; best first, a tie reported as a tie. Pictures are also stored on the MLflow parent run.
    Drawn as soon as every member has ended: `pending_evals` names the members' checkpoint evals not landed yet,
    and the summarizer draws it again as they land (jobs/_summary.py)."""
    from factory.cockpit.plots import DPI, sweep_summary_png  # noqa: PLC0415 heavy: matplotlib, when the step runs
    from factory.cockpit.reports import compare_sweep, small, store  # noqa: PLC0415 heavy: mlflow, when the step runs

    sweep_id = context.partition_key
    try:
        cmp = compare_sweep(lake.lake(), sweep_id)
    except LookupError as e:
        raise Failure(str(e)) from None
    tracker = mlflow.tracker()
    parent = _parent_run(lake, sweep_id)
    members = cmp.members
    axes = list(dict.fromkeys(a for m in members for a in m.axes))
    pictures = dict(cmp.pictures)
    scored = [{**m.axes, "final_accuracy": m.accuracy} for m in members if m.rank is not None]  # final results
    if scored:  # else nothing to draw against the axes
        for axis in axes:
            others = [a for a in axes if a != axis and a != "seed"] or None
            pictures[f"accuracy_vs_{_axis_name(axis, axes)}"] = functools.partial(
                sweep_summary_png, scored, axis, group_by=others, title=f"{sweep_id}: accuracy vs {axis}")
    head, shots = {}, {}
    for name, render in pictures.items():
        if parent:
            shots[name] = store(tracker, parent, f"plots/{name}.png", lambda dpi, r=render: r(dpi=dpi))
            head[name] = inline_picture(f"{name} of {sweep_id} (served by the MLflow UI; without it, open `pictures`)",
                                        tracker.artifact_url(parent, small(f"plots/{name}.png")))
        else:
            shots[name] = render(dpi=DPI)
    runs = _dagster_runs(context, [m.member for m in members])
    best, top = cmp.best, cmp.top
    counts = {s: sum(m.status == s for m in members) for s in ("succeeded", "failed", "pruned", "interrupted")}
    if parent:  # every member has ended (the summarizer's rule): so has the sweep's MLflow parent run
        tracker.set_tags(parent, {"factory.members": len(members), **{f"factory.{s}": n for s, n in counts.items()}})
        tracker.end_run(parent, "FINISHED")
    # The evals of the members' checkpoints not landed yet: the summarizer draws the summary again as they land;
    # the data version is the set of evals done, so each version of the summary is one set.
    evals = eval_progress(context.instance, lake.lake(), _member_runs(lake, sweep_id))
    return MaterializeResult(data_version=DataVersion(evals.version), metadata={
        **head,
        "pending_evals": evals.text(),  # `none`, or `2: <run_id>@<step> x heldout, ...`
        "pending_evals_count": len(evals.pending),
        "best_member": (best[0] if len(best) == 1 else f"tie: {', '.join(best)}") if best else "",
        "best_accuracy": _fmt(top.accuracy) if top else None,  # the best-ranked member's, whatever ranks below it
        "best_accuracy_ci95": top.accuracy_text() if top else "",  # `0.764 [0.725, 0.799] n=500`
        "verdict": cmp.verdict,  # the top member against the runner-up: a win only outside the noise
        "ranked_by": cmp.ranked_by,  # final results only: which, at which step, and who is left out
        **({"points_over_seeds": MetadataValue.md(_points_md(cmp.points)), "point_verdict": cmp.point_verdict}
           if cmp.points else {}),  # a `seed` axis: points ranked by their mean over seeds
        "members_table": _members_table(members, axes, runs),
        "links": MetadataValue.md(_links_md(members, runs, tracker, lake.home.paths().root)),
        "members": len(members), **counts,
        # links with short text: a long URL does not wrap, and widened the value column past the page
        **({"mlflow_parent_run_id": MetadataValue.md(f"[{parent}]({tracker.run_url(parent)})"),
            "mlflow_members_charts": MetadataValue.md(
                f"[the members side by side]({tracker.sweep_url(parent, sweep_id)})")} if parent else {}),
        "pictures": embedded(shots),
    })


def _axis_name(axis: str, axes: list[str]) -> str:
    """An axis as a metadata key names it: its last path segment (`lr`), unless another axis ends the same. A long key
    widens the key column, and the pictures in the value column were cut on the right (`accuracy_vs_algorithm.
    group_size`)."""
    last = axis.rpartition(".")[2]
    return last if [a.rpartition(".")[2] for a in axes].count(last) == 1 else axis


def _member_runs(lake: LakeResource, sweep_id: str) -> set[str]:
    rows = lake.lake().read("sweeps", f"sweep_id = '{sweep_id}'").select(["run_id"]).to_pylist()
    return {r["run_id"] for r in rows if r["run_id"]}


def _parent_run(lake: LakeResource, sweep_id: str) -> str | None:
    rows = lake.lake().read("sweeps", f"sweep_id = '{sweep_id}'").select(["mlflow_parent_run_id"]).to_pylist()
    return next((r["mlflow_parent_run_id"] for r in rows if r["mlflow_parent_run_id"]), None)


def _dagster_runs(context: AssetExecutionContext, members: list[str]) -> dict[str, str]:
    """member -> the Dagster run that materialized it (its latest successful one)."""
    out = {}
    for m in members:
        done = context.instance.get_runs(RunsFilter(tags={MEMBER_TAG: m}, statuses=[DagsterRunStatus.SUCCESS]),
                                         limit=1)
        if done:
            out[m] = done[0].run_id
    return out


def _fmt(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def _members_table(members, axes: list[str], runs: dict[str, str]) -> MetadataValue:
    """One row per member (ranked ones by `rank`; `ranked_by` says how), narrow enough for the value column at
    1600 px, a browser's scrollbars included (status, accuracy and the intervals were off to the right): a member by
    its short key and label (axis values once, wrapping between them), how far it got and in what wall time, and
    each figure as text with its interval and n, which wraps. Its Dagster run is in `links`."""
    ks = {m.k for m in members if m.pass_at_k is not None}
    passes = f"pass@{ks.pop()}" if len(ks) == 1 else "pass@k"
    cols = ["rank", "member", "status", "accuracy", passes, "reward"]
    records = [TableRecord({
        "rank": m.rank, "member": f"{member_short(m.member)} {m.label.replace(',', ', ')}",
        "status": f"{m.status}, {m.steps} steps" + (f", {format_duration(m.wall_s)}" if m.wall_s else ""),
        "accuracy": m.accuracy_text() if m.accuracy is not None else "",  # `0.764 [0.725, 0.799] n=500`
        passes: ("" if m.pass_at_k is None else  # the k in the cell when members measured different ones
                 ("" if passes != "pass@k" else f"@{m.k} ") + share_text(m.pass_at_k, m.n)),
        "reward": _fmt(m.reward)})
        for m in members]
    types = {"rank": "int", "reward": "float"}
    return MetadataValue.table(records, schema=TableSchema([TableColumn(c, types.get(c, "string")) for c in cols]))


def _under(path: str, home) -> str:
    """`path` relative to the home's root when it lies under it (an object store's URI, or elsewhere: as it is)."""
    p = Path(path)
    return str(p.relative_to(home)) if p.is_absolute() and p.is_relative_to(home) else path


def _points_md(points) -> str:
    """The sweep's points ranked by their mean accuracy over seeds, each with its interval and per-seed values."""
    lines = ["| point | mean accuracy over seeds [95% CI] | per seed |", "|---|---|---|"]
    lines += [f"| {p.label or '(base)'} | {p.text()} | "
              f"{', '.join(f'seed {s}: {a:.3f}' for s, a in zip(p.seeds, p.accuracies, strict=True))} |"
              for p in points]
    return "\n".join(lines)


def _links_md(members, runs: dict[str, str], tracker, home) -> str:
    # Members by their short key alone (`members_table` has their labels), checkpoints by their path under
    # FACTORY_HOME (`checkpoints/<run_id>/final`; the member's page has the whole path): a label or a home's path
    # does not wrap, and widened the value column past the page.
    lines = ["| member | Dagster run | MLflow run | checkpoint (under FACTORY_HOME) |", "|---|---|---|---|"]
    for m in members:
        dagster = f"[{runs[m.member][:8]}](/runs/{runs[m.member]})" if m.member in runs else ""
        mlflow = f"[{m.mlflow_run_id[:8]}]({tracker.run_url(m.mlflow_run_id)})" if m.mlflow_run_id else ""
        lines.append(f"| {member_short(m.member)} | {dagster} | {mlflow} | "
                     f"{'`' + _under(m.checkpoint, home) + '`' if m.checkpoint else ''} |")
    return "\n".join(lines)
