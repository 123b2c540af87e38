"""The paged engine's decode step as one function over static buffers, per batch bucket: `runner.decode` then
`sampling.sample`, captured as a CUDA graph per bucket on a GPU, eager on the CPU.

Static buffers (allocated once, so a captured graph reads and writes the same addresses every replay):
- `inputs` [max_rows, FIELDS] int64: per row whether it runs (`live`), the position it feeds, its sampler knobs
  (counter, seed, top-k, greedy, temperature and top-p as float32 bit patterns) and the one block-table entry it
  gained this step (`new_col`, `new_page`; -1 when none). The host fills a pinned mirror and copies it in with one
  non-blocking host-to-device copy per step (`run`).
- `next_tokens` [max_rows] int64: the token each row feeds next. The step writes its sampled tokens there (live rows
  only), and a prefill writes its samples' first tokens (`set_tokens`), so step t+1 reads step t's tokens on the
  device and the host never has to know them to schedule it (the overlap in `engine.py`).
- the block tables' device tensor (`BlockTables.table`, fixed storage): the step applies its rows' new entries, so a
  decode step needs no table copy; the engine syncs the whole table only when sequences are placed (a prefill).
The step returns one packed float64 tensor [rows, 2 + 2k] (token, logprob, k top ids, k top logprobs; ids below 2^53
are exact), which `host_copy.py` brings back in one pinned copy.

Graph key (`StepKey`): rows (a power of two, the scheduler's bucket), block-table columns, whether top-k/top-p run
(`truncate`) and top-logprob columns (rounded up to a power of two). The width is in the key because attention is a
gather of the table's pages (`runner._attend`): a narrow table reads fewer keys. A runner whose attention reads
only each row's real length says so (`PagedRunner.reads_real_lengths`, the Triton kernel); then every graph takes
the full width, and there is one graph per (rows, truncate, k).

Why torch.cuda.CUDAGraph and not torch.compile(mode="reduce-overhead"): the buffers above are already static and
shared by every bucket (reduce-overhead's cudagraph trees copy inputs into their own buffers and forbid reading a
graph's outputs after the next replay, which the overlap does), capture takes one warm-up and one capture per
bucket (no Inductor compile, minutes on a real model across dozens of buckets), and the step mutates state
(`next_tokens`, the tables, the page store) that cudagraph trees treat as input mutation to be checked per replay.
Capture follows torch's docs: warm-up on a side stream, one memory pool for every graph (`graph_pool_handle`),
graphs never run concurrently. Capture-readiness (no graph break, no recompile within a bucket, no host sync) is
proven on the CPU with `compile("aot_eager")` (tests/core/test_paged_decode_step.py).

Weights are read from the model's parameters by address: an in-place weight update (`load_state_dict` copies into
the same tensors) keeps every graph valid.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from factory.core.rollout.engines.paged import sampling
from factory.core.rollout.engines.paged.runner import PagedRunner

# the columns of `inputs`
LIVE, POSITION, COUNTER, SEED, TOP_K, GREEDY, TEMPERATURE, TOP_P, NEW_COL, NEW_PAGE = range(10)
FIELDS = 10


class StepKey(NamedTuple):
    rows: int
    width: int
    truncate: bool
    top_logprobs: int


class RowInput(NamedTuple):
    """What the host tells the step about one running row."""

    row: int
    position: int
    counter: int
    seed: int
    top_k: int
    greedy: bool
    temperature: float
    top_p: float
    new_col: int = -1  # the block-table column this step's position opened (a new page), or -1
    new_page: int = -1


def top_columns(k: int) -> int:
    """Top-logprob columns a step computes for a batch whose largest request asks `k`: 0 or a power of two."""
    return 0 if k <= 0 else 1 << (k - 1).bit_length()


class DecodeStep:
    """The decode step of `runner` for up to `max_rows` rows over `tables` (the block tables' device tensor);
    `cuda_graphs`: capture one graph per `StepKey` (only on CUDA)."""

    def __init__(self, runner: PagedRunner, tables: Tensor, max_rows: int, cuda_graphs: bool = True):
        self.runner, self.tables = runner, tables
        self.device = tables.device
        self.scratch = runner.store.scratch
        self.max_rows = max_rows
        self.inputs = torch.zeros(max_rows, FIELDS, dtype=torch.int64, device=self.device)
        self.next_tokens = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self._staging = torch.zeros(max_rows, FIELDS, dtype=torch.int64, pin_memory=cuda)
        self._copied: torch.cuda.Event | None = None
        self.cuda_graphs = cuda_graphs and cuda
        self._graphs: dict[StepKey, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._compiled: Callable[[StepKey], Tensor] | None = None
        self.graphs_captured = 0
        self.capture_seconds = 0.0

    @property
    def length_bounded(self) -> bool:
        """Whether the runner's attention reads only each row's real length (then the full width costs nothing)."""
        return bool(self.runner.reads_real_lengths)

    @property
    def fixed_shapes(self) -> bool:
        """Whether steps are captured or compiled (then shapes come from buckets); an eager step takes any shape."""
        return self.cuda_graphs or self._compiled is not None

    def key(self, rows: int, width: int, truncate: bool, top_logprobs: int) -> StepKey:
        full = self.tables.shape[1]
        return StepKey(rows, full if self.length_bounded else min(width, full), truncate, top_columns(top_logprobs))

    def compile(self, backend: str) -> None:
        """Run the step through `torch.compile(fullgraph=True, dynamic=False)` with `backend` instead of eager
        or CUDA graphs (the CPU's capture-readiness check uses "aot_eager")."""
        self.cuda_graphs = False
        self._compiled = torch.compile(self.forward, backend=backend, fullgraph=True, dynamic=False)

    # -- the step
    def forward(self, key: StepKey, allowed: Tensor | None = None) -> Tensor:
        """The step over the static buffers (what is captured): returns the packed [rows, 2 + 2k] float64 results.
        No host sync, no data-dependent shape. `allowed` [rows, vocab] bool: constrained decoding's mask (run
        eagerly, never captured: it changes every step)."""
        b, w = key.rows, key.width
        inp = self.inputs[:b]
        live = inp[:, LIVE] > 0
        rows = torch.arange(b, device=inp.device)
        col = inp[:, NEW_COL].clamp(min=0)
        table = self.tables[:b]
        table[rows, col] = torch.where(inp[:, NEW_COL] >= 0, inp[:, NEW_PAGE].to(table.dtype), table[rows, col])
        # rows that do not run this step feed token 0 at position 0 over the scratch page (their writes land there)
        view = torch.where(live[:, None], table[:, :w], torch.full_like(table[:, :w], self.scratch))
        tokens = torch.where(live, self.next_tokens[:b], torch.zeros_like(self.next_tokens[:b]))
        positions = torch.where(live, inp[:, POSITION], torch.zeros_like(inp[:, POSITION]))
        logits = self.runner.decode(tokens, positions, view)
        knobs = sampling.Knobs(_float(inp[:, TEMPERATURE]), _float(inp[:, TOP_P]), inp[:, TOP_K],
                               inp[:, GREEDY] > 0, inp[:, SEED], inp[:, COUNTER])
        out = sampling.sample(logits, knobs, truncate=key.truncate, top_logprobs=key.top_logprobs, allowed=allowed)
        self.next_tokens[:b].copy_(torch.where(live, out.tokens, self.next_tokens[:b]))
        return pack(out)

    def run(self, key: StepKey, rows: list[RowInput], allowed: Tensor | None = None) -> Tensor:
        """One decode step of `rows` (the live ones; every other row of the bucket idles): their inputs in one
        host-to-device copy, then the step (a graph replay on CUDA). Returns the packed results on the device;
        valid until the next `run` (a graph's output is its pool's memory). A step with an `allowed` mask (see
        `forward`) runs eagerly."""
        graph = self._graph(key) if self.cuda_graphs and allowed is None else None
        self._settle()
        self._staging[: key.rows] = torch.from_numpy(encode(rows, key.rows))
        self.inputs[: key.rows].copy_(self._staging[: key.rows], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if allowed is not None:
            return self.forward(key, allowed)
        if graph is None:
            return (self._compiled or self.forward)(key)
        graph[0].replay()
        return graph[1]

    def set_tokens(self, rows: Tensor, tokens: Tensor) -> None:
        """Rows `rows` feed `tokens` next (a prefill's first samples), on the device."""
        self.next_tokens.index_copy_(0, rows, tokens)

    # -- capture
    def _graph(self, key: StepKey) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        if (found := self._graphs.get(key)) is not None:
            return found
        start = time.perf_counter()
        self._settle()
        # idle rows with neutral knobs: warm-up runs write only the scratch page and leave next_tokens as they are
        self._staging[: key.rows] = torch.from_numpy(encode([], key.rows))
        self.inputs[: key.rows].copy_(self._staging[: key.rows])
        # weights are held in the serving dtype, but a caller may run the engine under autocast: then the casts must
        # be kernels in the graph, not cached tensors freed when its context exits (torch's CUDA-graph notes)
        cast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"),
                              cache_enabled=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), cast:
            for _ in range(2):
                self.forward(key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), cast:
            out = self.forward(key)
        torch.cuda.synchronize()
        self._graphs[key] = (graph, out)
        self.graphs_captured += 1
        self.capture_seconds += time.perf_counter() - start
        return self._graphs[key]

    def _settle(self) -> None:
        """The previous input copy is done before the pinned staging buffer changes (long done by then)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None


def encode(rows: list[RowInput], size: int) -> np.ndarray:
    """The `inputs` block [size, FIELDS] for `rows` (every other row idle, with neutral knobs)."""
    out = np.zeros((size, FIELDS), dtype=np.int64)
    out[:, TEMPERATURE] = np.float32(1.0).view(np.int32)
    out[:, TOP_P] = np.float32(1.0).view(np.int32)
    out[:, NEW_COL] = -1
    if rows:
        cols = np.array([(1, r.position, r.counter, r.seed, r.top_k, r.greedy, 0, 0, r.new_col, r.new_page)
                         for r in rows], dtype=np.int64)
        # temperature and top-p are positive float32s: their bit patterns are below 2^31, exact in int32 and int64
        cols[:, TEMPERATURE] = np.array([r.temperature for r in rows], dtype=np.float32).view(np.int32)
        cols[:, TOP_P] = np.array([r.top_p for r in rows], dtype=np.float32).view(np.int32)
        out[[r.row for r in rows]] = cols
    return out


def _float(bits: Tensor) -> Tensor:
    return bits.to(torch.int32).view(torch.float32)


def pack(out: sampling.Sampled) -> Tensor:
    """[rows, 2 + 2k] float64: token, logprob, k top ids, k top logprobs (what one host copy brings back)."""
    return torch.cat([out.tokens[:, None].double(), out.logprobs[:, None].double(), out.top_ids.double(),
                      out.top_logprobs.double()], dim=1)
