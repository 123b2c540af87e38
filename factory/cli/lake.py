"""`factory query`, `runs`, `best`, `compare`: reading the lake."""

from __future__ import annotations

import argparse

from factory.cli.common import add_format, emit, error, home_from
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK

# The `runs` listing. "Final accuracy" is the mean over whole benchmarks (not their `bench/slice` rows)
# of metric 'accuracy' at the run's last step, the greatest step the run recorded in `steps` or
# `evals`; NULL when no accuracy eval ran at that step (a run still going, or one that failed
# before its final eval).
RUNS_SQL = """
WITH last_step AS (
    SELECT run_id, max(step) AS step
    FROM (SELECT run_id, step FROM steps UNION ALL SELECT run_id, step FROM evals)
    GROUP BY run_id
),
final_acc AS (
    SELECT e.run_id, avg(e.value) AS accuracy, string_agg(DISTINCT e.benchmark, ',') AS benchmarks
    FROM evals e JOIN last_step l ON e.run_id = l.run_id AND e.step = l.step
    WHERE e.metric = 'accuracy' AND e.benchmark NOT LIKE '%/%'  -- whole benchmarks, not their slices
    GROUP BY e.run_id
)
SELECT r.run_id, r.name, r.status, r.started_at, r.ended_at,
       l.step AS final_step, a.accuracy AS final_accuracy, a.benchmarks, r.sweep_id,
       r.attempts, r.restarts, round(r.goodput, 4) AS goodput
FROM runs r
LEFT JOIN last_step l ON r.run_id = l.run_id
LEFT JOIN final_acc a ON r.run_id = a.run_id
ORDER BY r.started_at DESC, r.run_id
"""


def cmd_query(args: argparse.Namespace) -> int:
    """Run SQL over the lake tables and print the result."""
    from factory.lake import Lake, QueryError, format_table, query  # heavy: pyiceberg, duckdb

    with Lake.open(home_from(args)) as lake:
        try:
            result = query(args.sql, lake)
        except QueryError as e:
            error(str(e))
            return EXIT_BAD_INPUT
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    """List runs, newest first, with their final accuracy (a run whose process died shows `interrupted`)."""
    from factory.lake import Lake, format_table, query  # heavy: pyiceberg, duckdb
    from factory.runs.recovery import reconcile  # heavy: torch

    paths = home_from(args)
    with Lake.open(paths) as lake:
        reconcile(lake, paths.checkpoints)
        result = query(RUNS_SQL, lake)
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    """Rank runs by a metric at their final evaluated step."""
    from factory.lake import Lake, format_table  # heavy: pyiceberg, duckdb
    from factory.lake.history import HistoryError, best_runs  # heavy: pyiceberg, duckdb

    with Lake.open(home_from(args)) as lake:
        try:
            result = best_runs(lake, args.metric, benchmark=args.benchmark, sweep_id=args.sweep,
                               top=args.top, lowest=args.lowest)
        except HistoryError as e:
            error(str(e))
            return EXIT_BAD_INPUT
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    """Two runs side by side: spec differences, final evals, step aggregates."""
    from factory.lake import Lake  # heavy: pyiceberg, duckdb
    from factory.lake.history import HistoryError, compare_runs, format_comparison  # heavy: pyiceberg, duckdb

    with Lake.open(home_from(args)) as lake:
        try:
            comparison = compare_runs(lake, args.run_a, args.run_b)
        except HistoryError as e:
            error(str(e))
            return EXIT_BAD_INPUT
    emit(format_comparison(comparison, args.format))
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("query", help="run SQL (DuckDB) over the lake tables",
                       description="Tables: runs, steps, checkpoints, evals, rollouts, node_health, sweeps.")
    p.add_argument("sql", help="e.g. \"SELECT step, loss FROM steps WHERE run_id = '...' ORDER BY step\"")
    add_format(p)
    p.set_defaults(func=cmd_query)

    p = sub.add_parser("runs", help="list runs with status and final accuracy")
    add_format(p)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("best", help="rank runs by an eval metric at their final evaluated step",
                       description="Ranks runs by METRIC (table `evals`) at each run's greatest step that "
                                   "recorded it on the benchmark, best first.")
    p.add_argument("--metric", required=True, help="eval metric, e.g. accuracy or pass@8")
    p.add_argument("--benchmark", help="benchmark (default: the one whole benchmark, i.e. without '/', "
                                       "that has the metric; required when there are several)")
    p.add_argument("--sweep", metavar="SWEEP_ID", help="only runs of this sweep")
    p.add_argument("--top", type=int, default=10, metavar="N", help="how many runs (default: 10)")
    p.add_argument("--lowest", action="store_true", help="lowest value first (for losses, error rates)")
    add_format(p)
    p.set_defaults(func=cmd_best)

    p = sub.add_parser("compare", help="compare two runs: spec differences, final evals, step aggregates")
    p.add_argument("run_a", metavar="RUN_A", help="run id (see `factory runs`)")
    p.add_argument("run_b", metavar="RUN_B", help="run id")
    # No csv: its three sections have different columns; json is one object for scripts.
    p.add_argument("--format", "-f", choices=("table", "json"), default="table",
                   help="output format (default: table)")
    p.set_defaults(func=cmd_compare)
