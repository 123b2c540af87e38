"""`factory query`, `runs`, `best`, `compare`: reading the lake."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from factory.cli.common import emit, error, home_from
from factory.lake import Lake, QueryError, format_table, query
from factory.lake.history import HistoryError, best_runs, compare_runs, format_comparison, runs_listing
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK
from factory.runs.recovery import reconcile

T = TypeVar("T")

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
    """List runs, newest first, with their result (a run whose process died shows `interrupted`): the held-out
    accuracy at the step of its latest held-out eval with its 95% interval and n, the other benchmarks beside it
    (factory/lake/results.py)."""
    paths = home_from(args)
    with Lake.open(paths) as lake:
        reconcile(lake, paths.checkpoints)
        result = runs_listing(lake)
    emit(format_table(result, args.format))
    return EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    """Rank runs by a metric: final results (succeeded runs at their final evaluated step), or every run at --step;
    a table says under it which, and which runs were left out (csv and json: the column `at`)."""
    return _read_and_print(
        args, lambda lake: best_runs(lake, args.metric, benchmark=args.benchmark, sweep_id=args.sweep, top=args.top,
                                     lowest=args.lowest, step=args.step),
        lambda r: format_table(r.table, args.format) + (f"\n{r.note()}" if args.format == "table" else ""))


def cmd_compare(args: argparse.Namespace) -> int:
    """Two runs side by side: spec differences, final evals, step aggregates."""
    return _read_and_print(args, lambda lake: compare_runs(lake, args.run_a, args.run_b),
                           lambda c: format_comparison(c, args.format))
