"""Run history over the lake: rank runs by a final eval metric (`best`), and compare two runs
(`compare`): spec fields that differ, final evals side by side, training-step aggregates.

"Final" is per run and per (benchmark, metric): the value at the greatest step of that run that
recorded that benchmark and metric. A run still training therefore ranks by its latest eval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from factory.envs.eval_suites import HELD_OUT
from factory.lake.query import Format, connect, format_table, json_value, run_sql
from factory.lake.writer import Lake


class HistoryError(ValueError):
    """Bad input to `best` / `compare`: an unknown metric, benchmark, sweep or run id. One line."""


# -- best ------------------------------------------------------------------------------------------

# The ranking. NaN values rank last in either direction: a diverged run is never "best".
_BEST_SQL = """
WITH final AS (
    SELECT run_id, max(step) AS step, arg_max(value, step) AS value
    FROM evals WHERE metric = $metric AND benchmark = $benchmark
    GROUP BY run_id
), ranked AS (
    SELECT row_number() OVER (ORDER BY isnan(f.value), f.value {direction}, f.run_id) AS rank,
           f.run_id, r.name, r.sweep_id, r.status, r.seed,
           $benchmark AS benchmark, $metric AS metric, f.step, f.value
    FROM final f LEFT JOIN runs r ON r.run_id = f.run_id
    WHERE $sweep IS NULL OR r.sweep_id = $sweep
)
SELECT * FROM ranked WHERE rank <= $top ORDER BY rank
"""


DEFAULT_BENCHMARK = HELD_OUT  # every run records its held-out split under this name


def best_runs(lake: Lake, metric: str, benchmark: str | None = None, sweep_id: str | None = None,
              top: int = 10, lowest: bool = False) -> pa.Table:
    """The `top` runs by `metric` on `benchmark` at each run's final evaluated step, best first
    (greatest value, or least with `lowest`), optionally only runs of sweep `sweep_id`.

    `benchmark` None picks the one whole benchmark (a name without '/', not a `bench/slice`) that has
    `metric` among the runs considered; when there are several, the held-out split every run records
    (`arithmetic_heldout`), else HistoryError asks for one rather than averaging them: runs evaluated
    on different benchmark sets would be ranked on different things.
    HistoryError (naming what exists) for an unknown metric, benchmark or sweep, or top < 1.
    """
    if top < 1:
        raise HistoryError(f"--top: must be >= 1, got {top}")
    con = connect(lake, ["evals", "runs"])
    try:
        if sweep_id is not None:
            _check_sweep(con, sweep_id)
        _check_metric(con, metric)
        benchmark = _pick_benchmark(con, metric, benchmark, sweep_id)
        sql = _BEST_SQL.format(direction="ASC" if lowest else "DESC")
        return run_sql(con, sql, dict(metric=metric, benchmark=benchmark, sweep=sweep_id, top=top))
    finally:
        con.close()


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
    if DEFAULT_BENCHMARK in whole:  # every run records its own held-out split: the common ground
        return DEFAULT_BENCHMARK
    if not whole:
        raise HistoryError(f"--benchmark: {metric!r} was only recorded on benchmark slices; "
                           f"pass --benchmark, one of: {', '.join(have) or 'none'}")
    raise HistoryError(f"--benchmark: {metric!r} was recorded on several benchmarks; pass --benchmark, "
                       f"one of: {', '.join(whole)}")


# -- compare ---------------------------------------------------------------------------------------

_RUN_SQL = """
SELECT run_id, name, sweep_id, status, seed, code_version, spec_fingerprint, started_at, ended_at, spec
FROM runs WHERE run_id = $a OR run_id = $b
"""

_EVALS_SQL = """
WITH final AS (
    SELECT run_id, benchmark, metric, max(step) AS step, arg_max(value, step) AS value
    FROM evals WHERE run_id = $a OR run_id = $b
    GROUP BY run_id, benchmark, metric
), a AS (SELECT * FROM final WHERE run_id = $a), b AS (SELECT * FROM final WHERE run_id = $b)
SELECT coalesce(a.benchmark, b.benchmark) AS benchmark, coalesce(a.metric, b.metric) AS metric,
       a.step AS step_a, a.value AS a, b.step AS step_b, b.value AS b, b.value - a.value AS difference
FROM a FULL OUTER JOIN b ON a.benchmark = b.benchmark AND a.metric = b.metric
ORDER BY benchmark, metric
"""

# Step aggregates, in the order they are shown: (name, SQL expression over one run's steps). `from_end`
# is 1 for a run's last step, so "last 10" means its 10 greatest steps.
STEP_AGGREGATES: tuple[tuple[str, str], ...] = (
    ("steps", "count(*)"),
    ("last_step", "max(step)"),
    ("reward_mean_last10", "avg(reward_mean) FILTER (WHERE from_end <= 10)"),
    ("trainer_idle_fraction_mean", "avg(trainer_idle_fraction)"),
    ("staleness_max", "max(staleness_max)"),
    ("logprob_mismatch_max", "max(logprob_mismatch)"),
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
    evals: list[dict[str, Any]]  # {benchmark, metric, step_a, a, step_b, b, difference}
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
        evals = run_sql(con, _EVALS_SQL, dict(a=run_a, b=run_b)).to_pylist()
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
_EVAL_COLUMNS = {"benchmark": pa.string(), "metric": pa.string(), "step_a": pa.int64(), "a": pa.float64(),
                 "step_b": pa.int64(), "b": pa.float64(), "difference": pa.float64()}
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
        "final evals (each at its run's last step with that benchmark and metric)",
        _section(c.evals, _EVAL_COLUMNS), "",
        "steps", _section(c.steps, _STEP_COLUMNS),
    ])


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
