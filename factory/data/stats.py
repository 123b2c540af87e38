"""Per-prompt statistics over finished runs: the lake's `prompt_stats`, recomputed from `prompt_attempts`.

`update_prompt_stats(lake)` aggregates the trained groups of every *succeeded* run (a failed or running run's
groups are left out until it succeeds: its attempts may be redone on resume) into one row per (source,
prompt_id) and writes only the rows whose numbers changed, so running it twice writes nothing the second
time (no new snapshot, `updated_at` kept). Rows of prompts no longer backed by any succeeded run are removed.
`read_prompt_stats(lake)` gives {(source, prompt_id): (attempts, passes)} and the snapshot it read, which
a run records for lineage (what the offline filter, `data.filter`, saw).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
from pyiceberg.expressions import AlwaysTrue, In

from factory.lake.query import connect, run_sql
from factory.lake.schemas import table_def
from factory.lake.writer import Lake, key_filter_for, to_arrow

STATS = "prompt_stats"
# The columns a recomputation compares: a row whose numbers are unchanged is not written again.
_COMPARED = ("attempts", "passes", "groups", "runs", "pass_rate", "last_run_id")

_AGGREGATE = """
SELECT a.source, a.prompt_id,
       SUM(a.samples)::BIGINT AS attempts, SUM(a.passes)::BIGINT AS passes, COUNT(*)::BIGINT AS groups,
       COUNT(DISTINCT a.run_id)::BIGINT AS runs,
       -- the run that last trained it: latest start, ties broken by run id so the answer never depends on order
       arg_max(a.run_id, struct_pack(s := r.started_at, id := a.run_id)) AS last_run_id
FROM prompt_attempts a JOIN runs r ON a.run_id = r.run_id
WHERE r.status = 'succeeded'
GROUP BY a.source, a.prompt_id
"""


def _recomputed(lake: Lake) -> dict[tuple[str, str], dict]:
    con = connect(lake, ["prompt_attempts", "runs"])
    try:
        rows = run_sql(con, _AGGREGATE).to_pylist()
    finally:
        con.close()
    out = {}
    for r in rows:
        r["pass_rate"] = r["passes"] / r["attempts"] if r["attempts"] else 0.0
        out[(r["source"], r["prompt_id"])] = r
    return out


def update_prompt_stats(lake: Lake) -> int:
    """Recompute `prompt_stats` from the `prompt_attempts` of succeeded runs; returns the rows changed (written or
    removed), 0 when nothing changed since the last call."""
    want = _recomputed(lake)
    have = {(r["source"], r["prompt_id"]): r for r in lake.read(STATS).to_pylist()}
    now = datetime.now(UTC)
    changed = [{**row, "updated_at": now} for key, row in sorted(want.items())
               if key not in have or any(have[key][c] != row[c] for c in _COMPARED)]
    gone = [{"source": s, "prompt_id": p, "attempts": 0, "passes": 0, "groups": 0, "runs": 0, "pass_rate": 0.0,
             "updated_at": now} for (s, p) in sorted(set(have) - set(want))]
    if gone:
        lake.delete(STATS, key_filter_for(table_def(STATS), to_arrow(STATS, gone)))
    return lake.upsert(STATS, changed) + len(gone)  # an empty upsert commits nothing


def read_prompt_stats(lake: Lake, sources: list[str] | None = None, snapshot_id: int | None = None
                      ) -> tuple[dict[tuple[str, str], tuple[int, int]], int | None]:
    """{(source, prompt_id): (attempts, passes)} of `sources` (default: all) and the id of the `prompt_stats`
    snapshot read (None: the table was never written). `snapshot_id` reads that snapshot (a resumed run reads
    what its first attempt read); one that no longer exists (expired) falls back to the current one."""
    tbl = lake.table(STATS)
    snap = (tbl.snapshot_by_id(snapshot_id) if snapshot_id is not None else None) or tbl.current_snapshot()
    if snap is None:
        return {}, None
    row_filter = AlwaysTrue() if sources is None else In("source", list(sources)) if sources else None
    if row_filter is None:
        return {}, snap.snapshot_id
    data: pa.Table = tbl.scan(row_filter=row_filter, snapshot_id=snap.snapshot_id,
                              selected_fields=("source", "prompt_id", "attempts", "passes")).to_arrow()
    cols = data.to_pydict()
    return ({(s, p): (a, n) for s, p, a, n in zip(cols["source"], cols["prompt_id"], cols["attempts"],
                                                   cols["passes"], strict=True)}, snap.snapshot_id)
