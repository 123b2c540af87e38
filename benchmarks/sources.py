"""Read throughput of prompt sources (factory/data/sources) through `read_block`, one core.

A 1M-row Parquet file (64k-row groups) read block by block in order and in a shuffled block order, the same
rows as JSONL, and a 1M-row generated arithmetic level. Prints a table, then one JSON line
(`parquet_rows_per_s`, `parquet_shuffled_rows_per_s`, `jsonl_rows_per_s`, `arithmetic_rows_per_s`).
~1 minute; `--rows N`.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from factory.data.sources import ArithmeticSource, JsonlSource, ParquetSource
from factory.data.sources.base import PromptSource, num_blocks

COLUMNS = {"id": "uid", "prompt": "text", "answer": "label"}


def rate(src: PromptSource, blocks: list[int]) -> float:
    t = time.perf_counter()
    n = sum(len(src.read_block(b)) for b in blocks)
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args()
    n = args.rows
    with tempfile.TemporaryDirectory() as d:
        table = pa.table({"uid": pa.array(range(n), pa.int64()),
                          "text": [f"What is {i} plus {i + 1}? Answer with a number." for i in range(n)],
                          "label": [str(2 * i + 1) for i in range(n)]})
        pq.write_table(table, Path(d) / "p.parquet", row_group_size=65536)
        with open(Path(d) / "p.jsonl", "w") as f:
            for r in table.to_pylist():
                f.write(json.dumps(r) + "\n")
        del table
        pq_src = ParquetSource("pq", Path(d) / "p.parquet", "arithmetic", COLUMNS)
        order = list(range(num_blocks(pq_src)))
        shuffled = random.Random(0).sample(order, min(200, len(order)))
        out = {
            "rows": n,
            "parquet_rows_per_s": rate(pq_src, order),
            "parquet_shuffled_rows_per_s": rate(ParquetSource("pq", Path(d) / "p.parquet", "arithmetic", COLUMNS),
                                                shuffled),
            "jsonl_rows_per_s": rate(JsonlSource("js", Path(d) / "p.jsonl", "arithmetic", COLUMNS), order),
        }
        arith = ArithmeticSource("add7", "add", 7, n=n)
        out["arithmetic_rows_per_s"] = rate(arith, list(range(min(200, num_blocks(arith)))))
    for k, v in out.items():
        print(f"{k:32s} {v:>14,.0f}")
    print(json.dumps({k: round(v) for k, v in out.items()}))


if __name__ == "__main__":
    main()
