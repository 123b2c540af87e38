"""The paged engine's page store: the K/V pages on the device, written through slot mappings, and the block tables
the attention kernels read, at fixed shapes.

Layout: one tensor `kv` [layers, 2, num_pages + 1, page_size, kv_heads, head_dim] in the serving dtype, allocated
once (sized from the budget: `BlockManager.num_pages`) and reading as zeros until written (`_zeroed`): an attention
that reads past a sequence's length (the gather path's masked keys) multiplies what it finds by 0, which stays 0
only for finite values, and uninitialized memory may hold NaN bit patterns. On a GPU that is a memset (~20 ms for
70 GiB at HBM speed); on the CPU the store is an anonymous memory mapping, which the kernel zero-fills page by page
on first touch, so pages no sequence reaches cost neither time nor resident memory (`torch.zeros` wrote all of
them: 1.2 s and 5.6 GiB resident for SmolLM2's 16 rows x 8k context). `keys(layer)` / `values(layer)` are its views
[pages, page_size, kv_heads, head_dim], the layout of flash-attn's and vLLM's paged kernels; flattened to
[pages * page_size, kv_heads, head_dim], slot s = page * page_size + offset is one position.

The extra last page (`scratch`) belongs to no sequence: the padded rows of a fixed-shape batch write their K/V
there (their slots are `scratch_slot`), and block tables are padded with it. Neither -1 nor 0: a -1 entry makes
any gather or kernel that reads past a sequence's length index out of bounds, and 0 is a live page that a padded
row's write would corrupt; the scratch page is in bounds and nobody's data.

Writes (`write`) are one `index_copy_` per K and V over the step's slot tensor, no Python loop over tokens; the
slots of one step are distinct except the padding's, which all land in the scratch page. `copy_pages` runs a
fork's partial-page copies for every layer in one indexed copy. `gather` returns a sequence's contiguous K/V: the
reference for tests and an SDPA fallback.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from factory.core.rollout.engines.kv_budget import kv_shape


class PageStore:
    """`num_pages` K/V pages (+ the scratch page) for a model of `layers` x `kv_heads` x `head_dim`."""

    def __init__(self, layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if min(layers, num_pages, page_size, kv_heads, head_dim) < 1:
            raise ValueError(f"a page store needs at least one layer, page, token per page, head and head dim; got "
                             f"{layers}, {num_pages}, {page_size}, {kv_heads}, {head_dim}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch = num_pages
        self.kv = _zeroed((layers, 2, num_pages + 1, page_size, kv_heads, head_dim), dtype, torch.device(device))

    @classmethod
    def for_model(cls, config: Any, num_pages: int, page_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> PageStore:
        """A store shaped for a transformers model `config` (the shape `kv_budget.kv_bytes_per_token` prices)."""
        layers, kv_heads, head_dim = kv_shape(config)
        return cls(layers, num_pages, page_size, kv_heads, head_dim, dtype, device)

    @property
    def scratch_slot(self) -> int:
        return self.scratch * self.page_size

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def keys(self, layer: int) -> Tensor:
        return self.kv[layer, 0]

    def values(self, layer: int) -> Tensor:
        return self.kv[layer, 1]

    def slot_mapping(self, slots: Sequence[int], size: int | None = None) -> Tensor:
        """`slots` as an int64 tensor on the store's device, padded with `scratch_slot` to `size` (a batch
        bucket's fixed length)."""
        size = len(slots) if size is None else size
        if size < len(slots):
            raise ValueError(f"{len(slots)} slots do not fit a mapping of {size}")
        out = torch.full((size,), self.scratch_slot, dtype=torch.int64)
        out[: len(slots)] = torch.tensor(slots, dtype=torch.int64)
        return out.to(self.device, non_blocking=True)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store one step's new K and V of `layer` ([tokens, kv_heads, head_dim] each) at `slots` ([tokens],
        int64 on the store's device)."""
        flat = self.kv[layer].flatten(1, 2)  # [2, pages * page_size, kv_heads, head_dim], a view
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))

    def copy_pages(self, src: Sequence[int] | Tensor, dst: Sequence[int] | Tensor) -> None:
        """Copy pages `src[i]` to `dst[i]` in every layer (a fork's partial last pages); `dst` are fresh pages, so
        no page is both a source and a destination."""
        src_t = torch.as_tensor(src, dtype=torch.int64).to(self.device, non_blocking=True)
        dst_t = torch.as_tensor(dst, dtype=torch.int64).to(self.device, non_blocking=True)
        self.kv.index_copy_(2, dst_t, self.kv.index_select(2, src_t))

    def gather(self, layer: int, pages: Sequence[int] | Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The first `length` positions' K and V ([length, kv_heads, head_dim] each, contiguous copies) of the
        sequence whose block table is `pages`."""
        if length > len(pages) * self.page_size:
            raise IndexError(f"{length} positions do not fit {len(pages)} pages of {self.page_size}")
        idx = torch.as_tensor(pages, dtype=torch.int64).to(self.device, non_blocking=True)
        kv = self.kv[layer].index_select(1, idx).flatten(1, 2)[:, :length]
        return kv[0], kv[1]


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor; on the CPU backed by an anonymous mmap (zero-filled lazily by the OS, untouched pages never
    resident), elsewhere `torch.zeros`."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    # the tensor keeps the mapping alive (frombuffer holds a reference to it); unmapped when the tensor is freed
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


class BlockTables:
    """Every running sequence's block table as one int32 tensor [max_seqs, max_pages] on the device, its storage
    fixed for the engine's life (captured graphs read it), entries past a sequence's pages padded with `pad` (the
    page store's scratch page).

    Changes land in a host mirror (pinned on a GPU); `sync` copies the mirror into the device tensor in place,
    without blocking. Before the mirror changes again the previous copy must be done: `_settle` waits on its event,
    which has long finished by the next step.
    """

    def __init__(self, max_seqs: int, max_pages: int, pad: int, device: torch.device | str):
        device = torch.device(device)
        self.pad = pad
        self.host = torch.full((max_seqs, max_pages), pad, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.table = torch.full((max_seqs, max_pages), pad, dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.host.shape)  # type: ignore[return-value]

    def set(self, row: int, pages: Sequence[int]) -> None:
        """Row `row` becomes `pages`, padded."""
        if len(pages) > self.host.shape[1]:
            raise ValueError(f"{len(pages)} pages exceed the block table's {self.host.shape[1]} columns")
        self._settle()
        self.host[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.host[row, len(pages):] = self.pad

    def put(self, row: int, index: int, page: int) -> None:
        """Entry `index` of row `row` becomes `page` (a sequence's new page at a page boundary)."""
        self._settle()
        self.host[row, index] = page

    def clear(self, row: int) -> None:
        self._settle()
        self.host[row] = self.pad

    def sync(self) -> Tensor:
        """Copy the host mirror into the device table (same storage); returns the table."""
        self.table.copy_(self.host, non_blocking=True)
        if self.table.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.table

    def _settle(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
