"""Run history over the lake: list runs with their result (`runs`), rank runs by a final eval metric (`best`),
and compare two runs (`compare`): spec fields that differ, evals side by side, training-step aggregates.

"Final" is per run and per (benchmark, metric): the value at the greatest step of that run that
recorded that benchmark and metric. `best` ranks like beside like: final results only (runs that
succeeded, each at its final evaluated step; a pruned, failed or still-training run's latest eval is from an
earlier step, e.g. a pruned member's pass@k is its step-0 one), or, with `step`, every run that recorded the
metric at that one step; it says which, and which runs it left out. `compare`
sets like beside like: two finished runs at their final evals, else at the greatest step both recorded.
Accuracies carry their n and 95% Wilson interval, pass@k the same score interval (conservative for a mean of
per-problem estimates); a difference of either its Newcombe interval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from factory.envs.eval_suites import HELD_OUT
from factory.intervals import Accuracy, share_difference, share_interval, verdict
from factory.lake.query import Format, connect, format_table, json_value, query, run_sql
from factory.lake.results import primary_benchmark, run_outcomes
from factory.lake.writer import Lake


class HistoryError(ValueError):
    """Bad input to `best` / `compare`: an unknown metric, benchmark, sweep or run id. One line."""


DIGITS = 3  # accuracies on hundreds of problems mean three decimals, not sixteen


def ci95(value: float | None, n: int | None, metric: str = "accuracy") -> str | None:
    """`[0.725, 0.799]`: the 95% interval of `metric` measured on n problems: Wilson's for an accuracy (None when
    `value` is not a count out of n), the same score interval around a pass@k (`share_interval`: an average of
    per-problem estimates, which varies no more than a proportion); None for other metrics or without n."""
    if value is None or not n or not has_interval(metric):
        return None
    try:
        ci = Accuracy(value, int(n)).interval() if is_accuracy(metric) else share_interval(value, int(n))
    except ValueError:
        return None
    return f"[{ci.low:.3f}, {ci.high:.3f}]"


def is_accuracy(metric: str) -> bool:
    """Whether `metric` is a share of right answers (k of n), which has a Wilson interval."""
    return metric.endswith("accuracy")


def has_interval(metric: str) -> bool:
    """Whether `metric` is shown with a 95% interval: an accuracy, or a pass@k."""
    return is_accuracy(metric) or metric.startswith("pass@")


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, DIGITS)


# -- runs ------------------------------------------------------------------------------------------

# The `runs` listing without its result: final_step is the greatest step the run recorded in `steps` or `evals`.
_RUNS_SQL = """
WITH last_step AS (
    SELECT run_id, max(step) AS step
    FROM (SELECT run_id, step FROM steps UNION ALL SELECT run_id, step FROM evals)
    GROUP BY run_id
)
SELECT r.run_id, r.name, r.status, r.started_at, r.ended_at, l.step AS final_step, r.sweep_id,
       r.attempts, r.restarts, round(r.goodput, 4) AS goodput
FROM runs r
LEFT JOIN last_step l ON r.run_id = l.run_id
ORDER BY r.started_at DESC, r.run_id
"""

# The result columns `runs` adds after final_step (lake/results.py): the primary benchmark, the step of its
# latest accuracy eval, that accuracy with its interval and n, its baseline (the same benchmark at step 0) with its
# interval, and the other benchmarks evaluated at that step.
_RESULT_COLUMNS = {"benchmark": pa.string(), "eval_step": pa.int64(), "accuracy": pa.float64(),
                   "ci95": pa.string(), "n": pa.int64(), "start_accuracy": pa.float64(), "start_ci95": pa.string(),
                   "other_benchmarks": pa.string()}


def runs_listing(lake: Lake) -> pa.Table:
    """Every run, newest first, with its result (`lake/results.py`): a run with no accuracy eval yet has nulls."""
    base = query(_RUNS_SQL, lake)
    outcomes = run_outcomes(lake)
    results = [outcomes.get(run_id) for run_id in base.column("run_id").to_pylist()]
    values: dict[str, list[Any]] = {
        "benchmark": [o.primary.benchmark if o and o.primary else None for o in results],
        "eval_step": [o.step if o else None for o in results],
        "accuracy": [_round(o.accuracy) if o else None for o in results],
        "ci95": [ci95(o.accuracy, o.n) if o else None for o in results],
        "n": [o.n if o else None for o in results],
        "start_accuracy": [_round(o.start.value) if o and o.start else None for o in results],
        "start_ci95": [ci95(o.start.value, o.start.n) if o and o.start else None for o in results],
        "other_benchmarks": [(o.others_text() or None) if o else None for o in results],
    }
    at = base.schema.get_field_index("final_step") + 1
    for offset, (name, typ) in enumerate(_RESULT_COLUMNS.items()):
        base = base.add_column(at + offset, pa.field(name, typ), pa.array(values[name], type=typ))
    return base


# -- best ------------------------------------------------------------------------------------------

# Each run's value of the metric: at its final evaluated step, or at step $step when given.
_FINAL_SQL = """
WITH final AS (
    SELECT run_id, max(step) AS step, arg_max(value, step) AS value, arg_max(n, step) AS n
    FROM evals WHERE metric = $metric AND benchmark = $benchmark AND ($step IS NULL OR step = $step)
    GROUP BY run_id
)
SELECT f.*, r.name, r.sweep_id, r.status, r.seed, ($step IS NOT NULL OR r.status = 'succeeded') AS ranked
FROM final f LEFT JOIN runs r ON r.run_id = f.run_id
WHERE $sweep IS NULL OR r.sweep_id = $sweep
"""
# The ranking. NaN values rank last in either direction: a diverged run is never "best".
_BEST_SQL = """
WITH final AS ({final}), ranked AS (
    SELECT row_number() OVER (ORDER BY isnan(value), value {direction}, run_id) AS rank,
           run_id, name, sweep_id, status, seed, $benchmark AS benchmark, $metric AS metric, $at AS at, step, value, n
    FROM final WHERE ranked
)
SELECT * FROM ranked WHERE rank <= $top ORDER BY rank
"""
_LEFT_OUT_SQL = """
SELECT f.run_id, coalesce(r.status, 'no runs row') AS status, f.step
FROM (SELECT run_id, max(step) AS step FROM evals WHERE metric = $metric AND benchmark = $benchmark GROUP BY run_id) f
LEFT JOIN runs r ON r.run_id = f.run_id
WHERE ($sweep IS NULL OR r.sweep_id = $sweep) AND f.run_id NOT IN (SELECT run_id FROM ({final}) WHERE ranked)
ORDER BY f.run_id
"""


@dataclass(frozen=True)
class Ranking:
    """`best`'s answer: the ranked runs (`table`), what they were ranked on (`at`: "final" or "step N") and the runs
    that recorded the metric but were not ranked (`left_out`: run_id, status, their latest step)."""

    table: pa.Table
    at: str
    left_out: list[dict[str, Any]]

    def note(self) -> str:
        """What was ranked, in words, and what was left out (printed under the table)."""
        what = ("final results: runs that succeeded, each at its final evaluated step" if self.at == "final" else
                f"every run that recorded it at {self.at}")
        text = f"ranked: {what}"
        if self.left_out:
            by: dict[str, list[str]] = {}
            for r in self.left_out:
                by.setdefault(r["status"], []).append(f"{r['run_id']} (step {r['step']})")
            text += "; not ranked: " + "; ".join(f"{len(v)} {k}: {', '.join(v)}" for k, v in sorted(by.items()))
            if self.at == "final":
                text += "; --step N ranks every run at step N"
        return text


DEFAULT_BENCHMARK = HELD_OUT  # every run records the task's held-out split under this name


def best_runs(lake: Lake, metric: str, benchmark: str | None = None, sweep_id: str | None = None,
              top: int = 10, lowest: bool = False, step: int | None = None) -> Ranking:
    """The `top` runs by `metric` on `benchmark`, best first (greatest value, or least with `lowest`), optionally
    only runs of sweep `sweep_id`: final results (runs that succeeded, each at its final evaluated step), or with
    `step` every run's value at that step. Values are rounded to 3 decimals, with their n and, for an accuracy (k of
    n), the 95% interval `ci95`; column `at` says "final" or "step N", and the answer names the runs left out.

    `benchmark` None picks the one whole benchmark (a name without '/', not a `bench/slice`) that has
    `metric` among the runs considered; when there are several, the runs' own held-out set when they all have the
    same one (`lake/results.py`: e.g. `source:chain_sum` for runs of the SmolLM2 example), else the task's held-out
    split every run records (`arithmetic_heldout`), else HistoryError asks for one rather than averaging them: runs
    evaluated on different benchmark sets would be ranked on different things.
    HistoryError (naming what exists) for an unknown metric, benchmark or sweep, or top < 1.
    """
    if top < 1:
        raise HistoryError(f"--top: must be >= 1, got {top}")
    if step is not None and step < 0:
        raise HistoryError(f"--step: must be >= 0, got {step}")
    at = "final" if step is None else f"step {step}"
    con = connect(lake, ["evals", "runs"])
    try:
        if sweep_id is not None:
            _check_sweep(con, sweep_id)
        _check_metric(con, metric)
        benchmark = _pick_benchmark(con, metric, benchmark, sweep_id)
        params = dict(metric=metric, benchmark=benchmark, sweep=sweep_id, step=step)
        sql = _BEST_SQL.format(final=_FINAL_SQL, direction="ASC" if lowest else "DESC")
        ranked = run_sql(con, sql, dict(params, top=top, at=at))
        left_out = run_sql(con, _LEFT_OUT_SQL.format(final=_FINAL_SQL), params).to_pylist()
    finally:
        con.close()
    values, ns = ranked.column("value").to_pylist(), ranked.column("n").to_pylist()
    ranked = ranked.drop_columns(["value", "n"])
    cis = [ci95(v, n, metric) for v, n in zip(values, ns, strict=True)]
    table = (ranked.append_column("value", pa.array([_round(v) for v in values], type=pa.float64()))
             .append_column("ci95", pa.array(cis, type=pa.string()))
             .append_column("n", pa.array(ns, type=pa.int64())))
    return Ranking(table, at, left_out)


def _values(con: Any, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    return run_sql(con, sql, params).column(0).to_pylist()


def _check_sweep(con: Any, sweep_id: str) -> None:
    if not _values(con, "SELECT count(*) FROM runs WHERE sweep_id = $s", dict(s=sweep_id))[0]:
        raise HistoryError(f"--sweep: no run belongs to sweep {sweep_id!r}")


def _check_metric(con: Any, metric: str) -> None:
    metrics = _values(con, "SELECT DISTINCT metric FROM evals ORDER BY metric")
    if metric not in metrics:
        known = ", ".join(metrics) if metrics else "none: no evals recorded yet"
        raise HistoryError(f"--metric: no eval recorded metric {metric!r}; metrics: {known}")


def _pick_benchmark(con: Any, metric: str, benchmark: str | None, sweep_id: str | None) -> str:
    sql = """SELECT DISTINCT e.benchmark FROM evals e LEFT JOIN runs r ON r.run_id = e.run_id
             WHERE e.metric = $m AND ($s IS NULL OR r.sweep_id = $s) ORDER BY e.benchmark"""
    have = _values(con, sql, dict(m=metric, s=sweep_id))
    if benchmark is not None:
        if benchmark not in have:
            raise HistoryError(f"--benchmark: no eval of {metric!r} on benchmark {benchmark!r}; "
                               f"benchmarks with {metric!r}: {', '.join(have) or 'none'}")
        return benchmark
    whole = [b for b in have if "/" not in b]
    if len(whole) == 1:
        return whole[0]
    own = _own_benchmarks(con, sweep_id)
    if len(own) == 1 and own[0] in whole:  # every run considered has the same own held-out set
        return own[0]
    if DEFAULT_BENCHMARK in whole:  # every run records its own held-out split: the common ground
        return DEFAULT_BENCHMARK
    if not whole:
        raise HistoryError(f"--benchmark: {metric!r} was only recorded on benchmark slices; "
                           f"pass --benchmark, one of: {', '.join(have) or 'none'}")
    raise HistoryError(f"--benchmark: {metric!r} was recorded on several benchmarks; pass --benchmark, "
                       f"one of: {', '.join(whole)}")


def _own_benchmarks(con: Any, sweep_id: str | None) -> list[str]:
    """The primary benchmarks (`lake/results.py`) of the runs considered, each once ("" for a run without one)."""
    sql = """SELECT DISTINCT e.run_id, e.benchmark FROM evals e LEFT JOIN runs r ON r.run_id = e.run_id
             WHERE e.metric = 'accuracy' AND ($s IS NULL OR r.sweep_id = $s)"""
    pairs = run_sql(con, sql, dict(s=sweep_id)).to_pylist()
    by_run: dict[str, list[str]] = {}
    for p in pairs:
        by_run.setdefault(p["run_id"], []).append(p["benchmark"])
    return sorted({primary_benchmark(names) or "" for names in by_run.values()})


# -- compare ---------------------------------------------------------------------------------------

_RUN_SQL = """
SELECT run_id, name, sweep_id, status, seed, code_version, spec_fingerprint, started_at, ended_at, spec
FROM runs WHERE run_id = $a OR run_id = $b
"""

_EVALS_SQL = """
SELECT run_id, benchmark, metric, step, value, n FROM evals WHERE run_id = $a OR run_id = $b
"""

FINISHED = ("succeeded", "failed")  # a run that records no more evals: its latest eval is its final one


def _eval_rows(rows: list[dict[str, Any]], run_a: str, run_b: str, done: bool) -> list[dict[str, Any]]:
    """One row per (benchmark, metric) with A's and B's value set like beside like: when both runs are `done` and
    both recorded it at their final evaluated step, each at that step (`at` = "final"); otherwise (a run still
    training, or an eval of a final checkpoint not in yet) both at the greatest step both recorded (`at` =
    "step N"), so a run's final value never stands beside the other's step-0 one. A (benchmark, metric) only one
    run has, or with no step in common, shows each run's latest and no difference."""
    last_a = max((r["step"] for r in rows if r["run_id"] == run_a), default=None)
    last_b = max((r["step"] for r in rows if r["run_id"] == run_b), default=None)
    by: dict[tuple[str, str], tuple[dict[int, dict], dict[int, dict]]] = {}
    for r in rows:
        sides = by.setdefault((r["benchmark"], r["metric"]), ({}, {}))
        sides[0 if r["run_id"] == run_a else 1][r["step"]] = r
        if run_a == run_b:  # a run compared with itself: the same rows on both sides
            sides[1][r["step"]] = r
    out = []
    for (benchmark, metric), (sa, sb) in sorted(by.items()):
        common = set(sa) & set(sb)
        if sa and sb and done and max(sa) == last_a and max(sb) == last_b:
            step_a, step_b, at = max(sa), max(sb), "final"
        elif common:
            step_a = step_b = max(common)
            at = f"step {step_a}"
        else:
            step_a, step_b = max(sa, default=None), max(sb, default=None)
            at = "A only" if not sb else "B only" if not sa else "no common step"
        ra, rb = sa.get(step_a), sb.get(step_b)
        out.append(_eval_row(benchmark, metric, at, step_a, ra, step_b, rb, comparable=at == "final" or bool(common)))
    return out


def _eval_row(benchmark: str, metric: str, at: str, step_a: int | None, ra: dict | None, step_b: int | None,
              rb: dict | None, comparable: bool) -> dict[str, Any]:
    a, b = (ra or {}).get("value"), (rb or {}).get("value")
    n_a, n_b = (ra or {}).get("n"), (rb or {}).get("n")
    row: dict[str, Any] = dict(benchmark=benchmark, metric=metric, at=at, step_a=step_a, a=_round(a),
                               ci95_a=ci95(a, n_a, metric), n_a=n_a, step_b=step_b, b=_round(b),
                               ci95_b=ci95(b, n_b, metric), n_b=n_b, difference=None,
                               difference_ci95=None, verdict=None)
    if not comparable or a is None or b is None:
        return row
    row["difference"] = _round(b - a)
    if row["ci95_a"] and row["ci95_b"]:  # both with intervals: so has the difference (Newcombe's)
        if is_accuracy(metric):
            ci = verdict("B", Accuracy(b, int(n_b)), "A", Accuracy(a, int(n_a))).interval
        else:  # pass@k
            ci = share_difference(b, int(n_b), a, int(n_a))
        row["difference_ci95"] = f"[{ci.low:+.3f}, {ci.high:+.3f}]"
        row["verdict"] = ("B better" if ci.low > 0 else "A better") if ci.excludes_zero() \
            else "no significant difference"
    return row


# Step aggregates, in the order they are shown: (name, SQL expression over one run's steps). `from_end`
# is 1 for a run's last step, so "last 10" means its 10 greatest steps.
STEP_AGGREGATES: tuple[tuple[str, str], ...] = (
    ("steps", "count(*)"),
    ("last_step", "max(step)"),
    ("reward_mean_last10", "avg(reward_mean) FILTER (WHERE from_end <= 10)"),
    ("trainer_idle_fraction_mean", "avg(trainer_idle_fraction)"),
    ("staleness_max", "max(staleness_max)"),
    ("logprob_mismatch_max", "max(logprob_mismatch)"),
    # The sampler/trainer gap over the steps that measured it (NULL for a run that measured none): its typical size,
    # its worst step, what recomputing the trainer's log-probs cost, and what the corrections dropped.
    ("gap_abs_mean_mean", "avg(gap_abs_mean)"),
    ("gap_kl_max", "max(gap_kl)"),
    ("gap_out_frac_max", "max(gap_out_frac)"),
    ("recompute_s_mean", "avg(recompute_s)"),
    ("correction_masked_tokens_mean", "avg(correction_masked_tokens)"),
)

_STEPS_SQL = """
WITH s AS (
    SELECT *, row_number() OVER (PARTITION BY run_id ORDER BY step DESC) AS from_end
    FROM steps WHERE run_id = $r
)
SELECT {columns} FROM s
"""


@dataclass(frozen=True)
class Comparison:
    """Two runs side by side. `a` and `b` are their `runs` rows (without the spec); each section is a
    list of row dicts, with `a` / `b` columns and, where numeric, `difference` = b - a."""

    a: dict[str, Any]
    b: dict[str, Any]
    spec: list[dict[str, Any]]  # {path, a, b}; a key is left out where that run's spec lacks the path
    evals: list[dict[str, Any]]  # {benchmark, metric, at, step_a, a, ci95_a, n_a, step_b, b, ci95_b, n_b,
    #                               difference, difference_ci95, verdict}: `_eval_rows`
    steps: list[dict[str, Any]]  # {aggregate, a, b, difference}


def compare_runs(lake: Lake, run_a: str, run_b: str) -> Comparison:
    """Compare runs `run_a` and `run_b`. HistoryError naming the run ids not in `runs`."""
    con = connect(lake, ["runs", "evals", "steps"])
    try:
        runs = {r["run_id"]: r for r in run_sql(con, _RUN_SQL, dict(a=run_a, b=run_b)).to_pylist()}
        unknown = [r for r in dict.fromkeys((run_a, run_b)) if r not in runs]
        if unknown:
            raise HistoryError(f"unknown run id{'s' if len(unknown) > 1 else ''} "
                               f"{', '.join(map(repr, unknown))}; `factory runs` lists them")
        a, b = dict(runs[run_a]), dict(runs[run_b])
        spec = spec_diff(a.pop("spec"), b.pop("spec"))
        done = a["status"] in FINISHED and b["status"] in FINISHED
        evals = _eval_rows(run_sql(con, _EVALS_SQL, dict(a=run_a, b=run_b)).to_pylist(), run_a, run_b, done)
        steps = _step_rows(_step_aggregates(con, run_a), _step_aggregates(con, run_b))
    finally:
        con.close()
    return Comparison(a=a, b=b, spec=spec, evals=evals, steps=steps)


def _step_aggregates(con: Any, run_id: str) -> dict[str, Any]:
    columns = ", ".join(f"{expr} AS {name}" for name, expr in STEP_AGGREGATES)
    return run_sql(con, _STEPS_SQL.format(columns=columns), dict(r=run_id)).to_pylist()[0]


def _step_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(aggregate=name, a=a[name], b=b[name], difference=_difference(a[name], b[name]))
            for name, _ in STEP_AGGREGATES]


def _difference(a: Any, b: Any) -> float | int | None:
    numeric = (int, float)
    if isinstance(a, bool) or isinstance(b, bool) or not (isinstance(a, numeric) and isinstance(b, numeric)):
        return None
    return b - a


_ABSENT = object()


def spec_diff(spec_a: str, spec_b: str) -> list[dict[str, Any]]:
    """The leaf fields (dotted paths) whose values differ between two JSON specs, sorted by path."""
    fa, fb = flatten_spec(spec_a), flatten_spec(spec_b)
    rows = []
    for path in sorted(fa.keys() | fb.keys()):
        va, vb = fa.get(path, _ABSENT), fb.get(path, _ABSENT)
        if va == vb and type(va) is type(vb):  # 1 and 1.0, or 1 and True, are different settings
            continue
        row: dict[str, Any] = {"path": path}
        if va is not _ABSENT:
            row["a"] = va
        if vb is not _ABSENT:
            row["b"] = vb
        rows.append(row)
    return rows


def flatten_spec(spec: str) -> dict[str, Any]:
    """A JSON spec as {dotted path: leaf value}. Paths are those of `--set PATH=VALUE`: mappings are
    walked, lists are leaf values (an override sets a list whole). Text that is not a JSON object is
    one leaf at path `spec`."""
    try:
        data = json.loads(spec)
    except ValueError:
        return {"spec": spec}
    if not isinstance(data, dict):
        return {"spec": data}
    out: dict[str, Any] = {}
    _flatten(data, "", out)
    return out


def _flatten(node: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            _flatten(value, path + ".", out)
        else:
            out[path] = value


# -- rendering -------------------------------------------------------------------------------------

COMPARE_FORMATS: tuple[str, ...] = ("table", "json")

# Column types of the table rendering: spec values are shown as text (they mix types); step
# aggregates mix counts and means, so they are shown as floats.
_SPEC_COLUMNS = {"path": pa.string(), "a": pa.string(), "b": pa.string()}
_EVAL_COLUMNS = {"benchmark": pa.string(), "metric": pa.string(), "at": pa.string(), "a": pa.string(),
                 "b": pa.string(), "b - a": pa.string(), "verdict": pa.string()}
_STEP_COLUMNS = {"aggregate": pa.string(), "a": pa.float64(), "b": pa.float64(), "difference": pa.float64()}


def format_comparison(c: Comparison, fmt: Format = "table") -> str:
    """'table': a header naming A and B, then one aligned table per section; 'json': one object
    {a, b, spec, evals, steps} (NaN/inf as null). CSV has no form for differently shaped sections."""
    if fmt == "json":
        obj = {"a": c.a, "b": c.b, "spec": c.spec, "evals": c.evals, "steps": c.steps}
        return json.dumps(json_value(obj), ensure_ascii=False)
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r} for compare; use one of {', '.join(COMPARE_FORMATS)}")
    spec = [{"path": r["path"], "a": _spec_text(r, "a"), "b": _spec_text(r, "b")} for r in c.spec]
    return "\n".join([
        _run_line("A", c.a), _run_line("B", c.b), "",
        f"spec fields that differ ({len(spec)})", _section(spec, _SPEC_COLUMNS), "",
        "evals (both runs finished: each at its final step; else both at the greatest step both recorded)",
        _section([_eval_text(r) for r in c.evals], _EVAL_COLUMNS), "",
        "steps", _section(c.steps, _STEP_COLUMNS),
    ])


def _eval_text(r: dict[str, Any]) -> dict[str, Any]:
    """An eval row as printed: `0.600 [0.462, 0.724] n=50` (an accuracy), the difference with its interval."""
    def side(s: str) -> str | None:
        v = r[s]
        if v is None:
            return None
        text = f"{v:.3f} {r['ci95_' + s]} n={r['n_' + s]}" if r["ci95_" + s] else f"{v:.3f}"
        return text if r["difference"] is not None else f"{text} (step {r['step_' + s]})"
    diff = None if r["difference"] is None else f"{r['difference']:+.3f}" + (
        f" {r['difference_ci95']}" if r["difference_ci95"] else "")
    return dict(benchmark=r["benchmark"], metric=r["metric"], at=r["at"], a=side("a"), b=side("b"),
                **{"b - a": diff}, verdict=r["verdict"])


def _run_line(label: str, run: dict[str, Any]) -> str:
    sweep = f"  sweep {run['sweep_id']}" if run.get("sweep_id") else ""
    return f"{label}: {run['run_id']}  {run['name']}  {run['status']}  seed {run['seed']}{sweep}"


def _spec_text(row: dict[str, Any], side: str) -> str:
    if side not in row:
        return "(absent)"
    v = row[side]
    return v if isinstance(v, str) else json.dumps(v)


def _section(rows: list[dict[str, Any]], columns: dict[str, pa.DataType]) -> str:
    arrays = {col: pa.array([r.get(col) for r in rows], type=t) for col, t in columns.items()}
    return format_table(pa.table(arrays))
