"""The continuous engine's KV cache: per layer one buffer of slots (rows) x columns that sequences join and leave.

KV layout: per layer one buffer [rows, kv_heads, capacity, head_dim]. Running sequences are rows 0..n-1 (a
finished row is replaced by the last one, so rows stay dense and every step works on views, no gather). All rows
share one write column `width`: each step writes every row's new K/V at column `width`, and a sequence's valid
columns are [start, width) — a new sequence is placed right-aligned, ending at `width`, and a boolean mask hides
the columns left of its start. When the oldest sequences leave, the dead columns on the left are dropped in one
copy (compaction); the buffer grows by doubling.

It is handed to the model as its `cache` argument: transformers' attention layers call
`update(k, v, layer_idx)`, and the model's mask builders return the engine's explicit 4-D mask untouched, so
only `update` and `get_seq_length` of the `transformers.Cache` interface are used.

Device: the buffers live where the prefill's K/V were computed (the model's device); the bookkeeping (each row's
start column, the width) is plain Python on the host, so compaction and retirement never wait for the device.

Memory: the buffers are allocated when the first rows arrive and grow by doubling, their rows up to `slots` and
their columns up to `max_columns` (the engine's context + the write column), unless that would pass `allow` (in
slot-columns: one token of one row in every layer; the engine's KV budget, `kv_budget.py`): then with fewer spare
rows, then fewer spare columns, down to what the running rows need (compacted first). Spare rows never change a
sequence's numbers: every step works on the first n rows, whose strides do not depend on how many follow.
"""

from __future__ import annotations

import torch
from torch import Tensor

UNBOUNDED = 1 << 62  # `allow` when no budget applies


class SlotKVCache:
    """K/V buffers for the running rows, shaped for the transformers attention modules.

    It is passed to the model as `cache` (transformers calls `update(k, v, layer_idx)` in every attention layer).
    In capture mode (`begin_prefill`) it only records the new K/V, for a prefill that runs on its own batch.
    `allow` arguments bound the allocation in slot-columns (see the module docstring).
    """

    def __init__(self, slots: int, initial_capacity: int = 64, max_columns: int | None = None):
        self.slots = slots
        self.initial_capacity = initial_capacity
        self.max_columns = max_columns  # no row ever needs more (None: no bound)
        self.keys: list[Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[Tensor] = []
        self.start = [0] * slots  # first valid column of each row (host-side: read without a device sync)
        self.n = 0  # running rows: 0..n-1
        self.width = 0  # columns in use; the next decode step writes column `width`
        self._captured: list[tuple[Tensor, Tensor]] | None = None

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def rows(self) -> int:
        """Rows allocated, running and spare."""
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def token_bytes(self) -> int:
        """Bytes of one slot-column across every layer (0 before the first allocation)."""
        return sum(b.shape[1] * b.shape[3] * b.element_size() for bufs in (self.keys, self.values) for b in bufs)

    @property
    def allocated_bytes(self) -> int:
        return self.rows * self.capacity * self.token_bytes

    # -- the part of the transformers Cache interface the attention layers use
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[Tensor, Tensor]:
        if self._captured is not None:
            self._captured.append((key_states, value_states))
            return key_states, value_states
        w, n = self.width, self.n
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:n, :, w] = key_states[:, :, 0]
        v[:n, :, w] = value_states[:, :, 0]
        return k[:n, :, : w + 1], v[:n, :, : w + 1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    # -- prefill capture
    def begin_prefill(self) -> None:
        self._captured = []

    def end_prefill(self) -> list[tuple[Tensor, Tensor]]:
        kv, self._captured = self._captured or [], None
        return kv

    # -- layout
    @property
    def device(self) -> torch.device | None:
        """Where the buffers live (None before the first insert)."""
        return self.keys[0].device if self.keys else None

    def decode_mask(self, start: Tensor) -> Tensor:
        """[n, 1, 1, width + 1] bool: the columns each row attends to in the next decode step (True = attend).
        `start` is `self.start[:n]` as a long tensor on the buffers' device (the caller copies it there together
        with the step's other inputs, in one transfer)."""
        cols = torch.arange(self.width + 1, device=start.device)
        return (cols[None, :] >= start[:, None])[:, None, None, :]

    def _reallocate(self, rows: int, capacity: int) -> None:
        """Reallocate every buffer as `rows` x `capacity`, keeping the running rows' columns (one layer's old and
        new buffers exist at once, never all of them)."""
        w, n = self.width, self.n
        if rows < n or capacity < w:
            raise RuntimeError(f"a {rows} x {capacity} KV buffer cannot hold {n} rows of {w} columns")
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(rows, old.shape[1], capacity, old.shape[3])
                new[:n, :, :w] = old[:n, :, :w]
                buffers[i] = new
                del old

    def _shape(self, rows: int, cols: int, allow: int) -> tuple[int, int]:
        """The buffer shape that holds `rows` x `cols` within `allow` slot-columns: the current one when it holds
        them and fits; else doubled rows (at most `slots`) and doubled columns (at most `max_columns`), with fewer
        spare rows, then fewer spare columns, where that would not fit."""
        have_rows, have_cols = self.rows, self.capacity
        if have_rows >= rows and have_cols >= cols and have_rows * have_cols <= allow:
            return have_rows, have_cols
        new_rows = have_rows if have_rows >= rows else min(self.slots, max(2 * have_rows, rows))
        new_cols = have_cols if have_cols >= cols else max(2 * have_cols, cols)
        if self.max_columns is not None:
            new_cols = max(cols, min(new_cols, self.max_columns))
        if new_rows * new_cols > allow:
            new_rows = max(rows, min(new_rows, allow // new_cols))
            if new_rows * new_cols > allow:
                new_cols = max(cols, allow // max(1, new_rows))
        if new_rows * new_cols > allow:  # the engine admitted more than its budget holds: a bug, not an OOM
            raise RuntimeError(f"{rows} KV rows of {cols} columns do not fit in {allow} slot-columns")
        return new_rows, new_cols

    def fit(self, allow: int) -> None:
        """Shrink the buffers to within `allow` slot-columns (compacting first), e.g. to make room for a prefill's
        K/V; none at all when no row runs."""
        if not self.keys or self.rows * self.capacity <= allow:
            return
        if self.n == 0:
            self.release()
            return
        self.compact()
        self._reallocate(*self._shape(self.n, self.width + 1, allow))

    def _shift(self, by: int) -> None:
        """Move the running rows' columns right (by > 0) or left (by < 0)."""
        w, n = self.width, self.n
        lo = max(0, -by)  # columns left of `lo` are dropped when shifting left
        for buffers in (self.keys, self.values):
            for buf in buffers:
                # the source and destination overlap, so copy through a temporary
                buf[:n, :, lo + by : w + by] = buf[:n, :, lo:w].clone()
        self.start[:n] = [s + by for s in self.start[:n]]
        self.width = w + by

    def compact(self, min_gain: int = 1) -> None:
        """Drop the leading columns no running row uses, if at least `min_gain` of them."""
        if self.n == 0:
            self.width = 0
            return
        dead = min(self.start[: self.n])
        if dead >= min_gain:
            self._shift(-dead)

    def reserve_decode(self, allow: int = UNBOUNDED) -> None:
        """Make room for one more column."""
        if self.width + 1 <= self.capacity:
            return
        self.compact()
        if self.width + 1 > self.capacity:
            self._reallocate(*self._shape(self.n, self.width + 1, allow))

    def insert(self, kv: list[tuple[Tensor, Tensor]], src: Tensor, lengths: list[int],
               allow: int = UNBOUNDED) -> None:
        """Append rows n.. from a prefill's K/V: row j takes prefill row `src[j]` (left-padded to width P), of
        which the last `lengths[j]` columns are its prompt."""
        k_count = len(lengths)
        if self.n + k_count > self.slots:
            raise RuntimeError(f"{self.n} + {k_count} rows exceed {self.slots} slots")
        p = kv[0][0].shape[2]
        if self.n == 0:
            self.width = 0

        def cols() -> int:  # the new prompts need p columns left of the write column
            return p + 1 if self.width < p else self.width

        if not self.keys:
            want = max(self.initial_capacity, cols())
            rows, cap = self._shape(k_count, want if k_count * want <= allow else cols(), allow)
            for k, v in kv:
                self.keys.append(k.new_zeros(rows, k.shape[1], cap, k.shape[3]))
                self.values.append(v.new_zeros(rows, v.shape[1], cap, v.shape[3]))
        elif (shape := self._shape(self.n + k_count, cols(), allow)) != (self.rows, self.capacity):
            if shape[1] < self.width:  # only a binding budget narrows the buffer: drop the dead columns first
                self.compact()
                shape = self._shape(self.n + k_count, cols(), allow)
            self._reallocate(*shape)
        if self.width < p:
            self._shift(p - self.width)
        w, n = self.width, self.n
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][n : n + k_count, :, w - p : w] = k.index_select(0, src)
            self.values[layer][n : n + k_count, :, w - p : w] = v.index_select(0, src)
        self.start[n : n + k_count] = [w - length for length in lengths]
        self.n = n + k_count

    def remove(self, row: int) -> None:
        """Free `row` by moving the last running row into it (callers remove rows in descending order)."""
        last = self.n - 1
        if row != last:
            w = self.width
            for buffers in (self.keys, self.values):
                for buf in buffers:
                    buf[row, :, :w] = buf[last, :, :w]
            self.start[row] = self.start[last]
        self.n = last

    def release(self) -> None:
        """Free the buffers (only when no row is running)."""
        if self.n:
            raise RuntimeError("cannot release the KV cache while sequences are running")
        self.keys, self.values, self.width = [], [], 0
