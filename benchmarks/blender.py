"""The blender (factory/data/blender.py) vs HF `datasets.interleave_datasets` vs naive weighted draws, on the
same three Parquet sources, one core each.

Writes three Parquet files (add2/add3/word, 50/30/20% of --rows rows, row groups of --block rows) into a
temp dir, plus a copy 10x smaller, and streams --draws prompts with weights 0.2/0.3/0.5 (the smallest source
gets the largest weight, so it wraps into new epochs) in a child process per contender, pinned to one CPU:

- blender: `take()` per prompt, `done()` one group of 64 behind (a group in flight, as the producer does);
  prompts/s, the largest quota error |served_i - w_i * t| over every prefix of the stream, peak RSS (the
  same stream over the 10x smaller sources shows memory does not grow with source size), and the resume
  latency (`load_state_dict` + first `take`, which serves a draw that was in flight) of states saved at
  draw 1k and at draw 900k, on a fresh blender over freshly opened files (median of 5);
- hf_interleave: `load_dataset("parquet", streaming=True)` per file and `interleave_datasets` with the
  same probabilities (offline; HF_HOME in the temp dir), over the first --hf-draws prompts (default 200k:
  at its rate the whole stream would take minutes, and the rate is steady);
- naive: `random.choices` weighted draws over rows read with pyarrow one row group at a time, unshuffled.

The Parquet reader is a minimal one written here (row group = block) so that the figures measure the
blender, not a column mapping.

    .venv/bin/python benchmarks/blender.py                 # 1M rows, 1M draws
    .venv/bin/python benchmarks/blender.py --rows 200000 --draws 200000

A fourth child streams the blender over factory/data/sources' ParquetSource (the reader runs will use).
Rates are wall-clock (prompts_per_s) and per CPU second of the process (steadier on a shared machine).

Prints a table, then one JSON line: prompts_per_s, prompts_per_cpu_s, speedup_vs_hf_interleave (wall),
speedup_vs_hf_interleave_cpu, speedup_vs_naive, hf_prompts_per_s, naive_prompts_per_s, resume_ms_at_1k,
resume_ms_at_900k, construct_ms, max_quota_error, peak_rss_mb, peak_rss_mb_small_sources,
factory_parquet_prompts_per_s, factory_parquet_resume_ms_at_900k, rows, draws.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from factory.data.blender import Blender  # noqa: E402
from factory.problem import Problem  # noqa: E402

SHARES = {"add2": 0.5, "add3": 0.3, "word": 0.2}  # of the rows
WEIGHTS = {"add2": 0.2, "add3": 0.3, "word": 0.5}  # of the stream
GROUP = 64


class ParquetBlocks:
    """A PromptSource over one Parquet file: row group b is block b."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.file = pq.ParquetFile(path)
        md = self.file.metadata
        self.block_rows = md.row_group(0).num_rows
        self.n = md.num_rows
        self._version = hashlib.sha256(f"{path.stat().st_size}:{md.num_rows}:{md.serialized_size}".encode()
                                       + md.schema.to_arrow_schema().to_string().encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self.n

    def version(self) -> str:
        return self._version

    def read_block(self, block: int) -> list[Problem]:
        cols = self.file.read_row_group(block, columns=["id", "prompt", "answer"]).to_pydict()
        meta = {"source": self.name, "verifier": "arithmetic"}
        return [Problem(i, p, a, "add", 0, meta) for i, p, a in zip(cols["id"], cols["prompt"], cols["answer"],
                                                                      strict=True)]


def write_sources(folder: Path, rows: int, block: int) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = {}
    for name, share in SHARES.items():
        n = int(rows * share)
        a, b = rng.integers(10, 1000, n), rng.integers(10, 1000, n)
        table = pa.table({"id": [f"{name}-{i}" for i in range(n)],
                          "prompt": [f"{x}+{y}=" for x, y in zip(a.tolist(), b.tolist(), strict=True)],
                          "answer": [str(x + y) for x, y in zip(a.tolist(), b.tolist(), strict=True)]})
        paths[name] = folder / f"{name}.parquet"
        pq.write_table(table, paths[name], row_group_size=block)
    return paths


def pin_one_core() -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})


def peak_rss_mb() -> float:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child would report its parent's peak
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def open_blender(folder: Path, reader: str = "local", block: int = 4096) -> Blender:
    if reader == "factory":
        from factory.data.sources.files import ParquetSource

        srcs = [ParquetSource(n, folder / f"{n}.parquet", "arithmetic", block_rows=block) for n in SHARES]
    else:
        srcs = [ParquetBlocks(n, folder / f"{n}.parquet") for n in SHARES]
    return Blender(srcs, weights=WEIGHTS, seed=0)


def child_blender(folder: Path, draws: int, reader: str = "local", block: int = 4096) -> dict:
    names = list(SHARES)
    index = {n: i for i, n in enumerate(names)}
    b = open_blender(folder, reader, block)
    seq = bytearray()
    states: dict[int, tuple[dict, int]] = {}
    capture = {1000, 900_000}
    prev: list[int] = []
    n, paused = 0, 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    while n < draws:
        batch = [b.take() for _ in range(GROUP)]
        for _, p in batch:
            seq.append(index[p.meta["source"]])
        if prev:
            b.done(prev)
        prev = [d for d, _ in batch]
        n += GROUP
        for c in [c for c in capture if n - GROUP < c <= n]:
            t = time.perf_counter()  # a checkpoint, not part of the stream's rate
            states[c] = (b.state_dict(), prev[0])
            paused += time.perf_counter() - t
    wall = time.perf_counter() - t0 - paused
    cpu = time.process_time() - c0 - paused
    peak = peak_rss_mb()  # while streaming; the quota check below allocates arrays of the whole stream
    s = np.frombuffer(bytes(seq), dtype=np.uint8)
    t = np.arange(1, len(s) + 1)
    max_err = max(float(np.abs(np.cumsum(s == i) - WEIGHTS[name] / sum(WEIGHTS.values()) * t).max())
                  for i, name in enumerate(names))
    resume: dict[str, float | None] = {}
    construct = []
    for c in sorted(capture):
        if c not in states:
            resume[str(c)] = None
            continue
        state, first_in_flight = states[c]
        times = []
        for _ in range(5):
            t1 = time.perf_counter()
            fresh = open_blender(folder, reader, block)
            t2 = time.perf_counter()
            fresh.load_state_dict(state)
            draw, _ = fresh.take()
            t3 = time.perf_counter()
            assert draw == first_in_flight, (draw, first_in_flight)
            construct.append(t2 - t1)
            times.append(t3 - t2)
        resume[str(c)] = statistics.median(times) * 1000
    return {"prompts_per_s": n / wall, "prompts_per_cpu_s": n / cpu, "max_quota_error": max_err, "peak_rss_mb": peak,
            "resume_ms": resume, "construct_ms": statistics.median(construct) * 1000, "draws": n,
            "report": {k: {f: v[f] for f in ("target_share", "realized_share", "epoch")}
                       for k, v in b.report()["sources"].items()}}


def child_hf(folder: Path, draws: int) -> dict:
    from datasets import interleave_datasets, load_dataset

    sets = [load_dataset("parquet", data_files=str(folder / f"{n}.parquet"), split="train", streaming=True)
            for n in SHARES]
    total = sum(WEIGHTS.values())
    mixed = interleave_datasets(sets, probabilities=[WEIGHTS[n] / total for n in SHARES], seed=0,
                                stopping_strategy="all_exhausted")
    t = time.perf_counter()
    it = iter(mixed)  # setup takes seconds at times (not streaming): it and the first example are left out
    next(it)
    first_s = time.perf_counter() - t
    t0, c0 = time.perf_counter(), time.process_time()
    n = 1 + sum(1 for _ in itertools.islice(it, draws - 1))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"prompts_per_s": (n - 1) / wall, "prompts_per_cpu_s": (n - 1) / cpu, "peak_rss_mb": peak_rss_mb(),
            "draws": n, "first_example_s": first_s}


def child_naive(folder: Path, draws: int) -> dict:
    names = list(SHARES)
    files = [pq.ParquetFile(folder / f"{n}.parquet") for n in names]
    cursors = [[0, 0, []] for _ in names]  # row group, row, rows of the row group
    rng = random.Random(0)
    w = [WEIGHTS[n] for n in names]
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    while n < draws:
        for i in rng.choices(range(len(names)), weights=w, k=GROUP):
            c = cursors[i]
            if c[1] >= len(c[2]):
                c[0] = (c[0] + 1) % files[i].num_row_groups if c[2] else 0
                cols = files[i].read_row_group(c[0], columns=["id", "prompt", "answer"]).to_pydict()
                c[1], c[2] = 0, [Problem(a, b, d, "add", 0, {"source": names[i]})
                                 for a, b, d in zip(cols["id"], cols["prompt"], cols["answer"], strict=True)]
            _ = c[2][c[1]]
            c[1] += 1
        n += GROUP
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"prompts_per_s": n / wall, "prompts_per_cpu_s": n / cpu, "peak_rss_mb": peak_rss_mb(), "draws": n}


def run_child(kind: str, folder: Path, draws: int, home: Path, block: int = 4096) -> dict:
    env = dict(os.environ, HF_HOME=str(home / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", str(folder), "--draws", str(draws),
                          "--block", str(block)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the three sources together")
    ap.add_argument("--draws", type=int, default=1_000_000, help="prompts streamed per contender")
    ap.add_argument("--hf-draws", type=int, default=200_000,
                    help="prompts streamed through HF interleave_datasets (it is slow; its rate is steady)")
    ap.add_argument("--block", type=int, default=4096, help="rows per Parquet row group (= blender block)")
    ap.add_argument("--child", choices=["blender", "blender-factory", "hf", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        pin_one_core()
        if args.child.startswith("blender"):
            reader = "factory" if args.child == "blender-factory" else "local"
            print(json.dumps(child_blender(args.dir, args.draws, reader, args.block)))
        else:
            print(json.dumps({"hf": child_hf, "naive": child_naive}[args.child](args.dir, args.draws)))
        return

    with tempfile.TemporaryDirectory(prefix="blender-bench-") as tmp:
        home = Path(tmp)
        big, small = home / "big", home / "small"
        t = time.perf_counter()
        write_sources(big, args.rows, args.block)
        write_sources(small, args.rows // 10, args.block)
        print(f"wrote {args.rows:,} + {args.rows // 10:,} rows of Parquet in {time.perf_counter() - t:.1f} s")
        blend = run_child("blender", big, args.draws, home, args.block)
        if "error" in blend:
            raise SystemExit(f"blender failed: {blend['error']}")
        blend_small = run_child("blender", small, args.draws, home, args.block)
        blend_factory = run_child("blender-factory", big, args.draws, home, args.block)
        hf = run_child("hf", big, min(args.draws, args.hf_draws), home)
        naive = run_child("naive", big, args.draws, home)

    def rate(r: dict) -> str:
        if "prompts_per_s" not in r:
            return f"{'failed':>12}{'':>12}"
        return f"{r['prompts_per_s']:>12,.0f}{r['prompts_per_cpu_s']:>12,.0f}"

    def rss(r: dict) -> str:
        return f"{r['peak_rss_mb']:>9.0f}" if "peak_rss_mb" in r else f"{'-':>9}"

    print(f"\n{'contender':<28}{'prompts/s':>12}{'per CPU s':>12}{'peak MB':>9}  notes")
    print(f"{'blender':<28}{rate(blend)}{rss(blend)}  max quota error {blend['max_quota_error']:.3f}")
    print(f"{'blender, 10x smaller files':<28}{rate(blend_small)}{rss(blend_small)}  same stream length")
    factory_note = blend_factory.get("error", "factory/data/sources ParquetSource (column mapping, text cast)")
    print(f"{'blender, factory Parquet':<28}{rate(blend_factory)}{rss(blend_factory)}  {factory_note}")
    hf_note = hf.get("error", f"streaming=True, {hf.get('draws', 0):,} draws; setup + first "
                              f"{hf.get('first_example_s', 0):.1f} s, not counted")
    print(f"{'hf interleave_datasets':<28}{rate(hf)}{rss(hf)}  {hf_note}")
    print(f"{'naive random.choices':<28}{rate(naive)}{rss(naive)}  {naive.get('error', 'unshuffled, not resumable')}")
    r1k, r900k = blend["resume_ms"].get("1000"), blend["resume_ms"].get("900000")
    fmt = lambda v: "n/a" if v is None else f"{v:.2f} ms"  # noqa: E731
    print(f"\nresume (load_state_dict + first take, 64 draws in flight): at 1k {fmt(r1k)}, at 900k {fmt(r900k)}; "
          f"opening a fresh blender over the files: {blend['construct_ms']:.2f} ms")
    if "resume_ms" in blend_factory:
        rf = blend_factory["resume_ms"]
        print(f"with factory ParquetSource: resume at 1k {fmt(rf.get('1000'))}, at 900k {fmt(rf.get('900000'))}; "
              f"opening (hashes the files for their version): {blend_factory['construct_ms']:.1f} ms")
    print("realized vs target share:", {k: (round(v["realized_share"], 4), v["target_share"])
                                        for k, v in blend["report"].items()})
    speedup_hf = blend["prompts_per_s"] / hf["prompts_per_s"] if "prompts_per_s" in hf else None
    print(json.dumps({
        "prompts_per_s": round(blend["prompts_per_s"]),
        "prompts_per_cpu_s": round(blend["prompts_per_cpu_s"]),
        "speedup_vs_hf_interleave": None if speedup_hf is None else round(speedup_hf, 2),
        "speedup_vs_hf_interleave_cpu": round(blend["prompts_per_cpu_s"] / hf["prompts_per_cpu_s"], 2)
        if "prompts_per_cpu_s" in hf else None,
        "speedup_vs_hf_reason": None if speedup_hf is not None else hf.get("error"),
        "speedup_vs_naive": round(blend["prompts_per_s"] / naive["prompts_per_s"], 2)
        if "prompts_per_s" in naive else None,
        "hf_prompts_per_s": round(hf["prompts_per_s"]) if "prompts_per_s" in hf else None,
        "naive_prompts_per_s": round(naive["prompts_per_s"]) if "prompts_per_s" in naive else None,
        "resume_ms_at_1k": None if r1k is None else round(r1k, 3),
        "resume_ms_at_900k": None if r900k is None else round(r900k, 3),
        "construct_ms": round(blend["construct_ms"], 3),
        "max_quota_error": round(blend["max_quota_error"], 4),
        "peak_rss_mb": round(blend["peak_rss_mb"], 1),
        "peak_rss_mb_small_sources": round(blend_small["peak_rss_mb"], 1) if "peak_rss_mb" in blend_small else None,
        "factory_parquet_prompts_per_s": round(blend_factory["prompts_per_s"]) if "prompts_per_s" in blend_factory
        else None,
        "factory_parquet_resume_ms_at_900k": (lambda v: None if v is None else round(v, 3))(
            blend_factory.get("resume_ms", {}).get("900000")),
        "rows": args.rows, "draws": blend["draws"], "block_rows": args.block, "cores": 1,
    }))


if __name__ == "__main__":
    main()
