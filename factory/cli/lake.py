"""`factory query`, `runs`, `best`, `compare`: reading the lake."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from factory.cli.common import emit, error, home_from
from factory.lake import Lake, QueryError, format_table, query
from factory.lake.history import HistoryError, best_runs, compare_runs, format_comparison
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK
from factory.runs.recovery import reconcile

T = TypeVar("T")

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


def _read_and_print(args: argparse.Namespace, read: Callable[[Lake], T], render: Callable[[T], str]) -> int:
    """Print `render(read(lake))`; a bad query, metric, benchmark or run name is a one-line error (exit 2)."""
    with Lake.open(home_from(args)) as lake:
        try:
            result = read(lake)
        except (QueryError, HistoryError) as e:
            error(str(e))
            return EXIT_BAD_INPUT
    emit(render(result))
    return EXIT_OK


def cmd_query(args: argparse.Namespace) -> int:
    """Run SQL over the lake tables and print the result."""
    return _read_and_print(args, lambda lake: query(args.sql, lake), lambda r: format_table(r, args.format))


def cmd_runs(args: argparse.Namespace) -> int:
    """List runs, newest first, with their final accuracy (a run whose process died shows `interrupted`)."""
    paths = home_from(args)
    with Lake.open(paths) as lake:
        reconcile(lake, paths.checkpoints)
        result = query(RUNS_SQL, lake)
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    """Rank runs by a metric at their final evaluated step."""
    return _read_and_print(
        args, lambda lake: best_runs(lake, args.metric, benchmark=args.benchmark, sweep_id=args.sweep, top=args.top,
                                     lowest=args.lowest),
        lambda r: format_table(r, args.format))


def cmd_compare(args: argparse.Namespace) -> int:
    """Two runs side by side: spec differences, final evals, step aggregates."""
    return _read_and_print(args, lambda lake: compare_runs(lake, args.run_a, args.run_b),
                           lambda c: format_comparison(c, args.format))
