"""The paged KV page store (`factory/core/rollout/engines/paged/pages.py`): K/V written through slot mappings gather
back exactly (torch.equal), shared prompt pages included; one sequence's writes never change another's; padded rows
write only the scratch page; block tables keep their storage while they change."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from transformers import Qwen2Config

from factory.core.rollout.engines.kv_budget import KVBudget, kv_bytes_per_token
from factory.core.rollout.engines.paged.blocks import BlockManager
from factory.core.rollout.engines.paged.pages import BlockTables, PageStore
from tests.core.paged_machine import MACHINE_SETTINGS, BlockMachine

LAYERS, HEADS, DIM = 2, 2, 3


class PageMachine(BlockMachine):
    """The block machine with a page store beside it: every admission writes its prompt's K/V (a prefill), every
    fork runs its page copy, every append writes the new token's K/V; `decode_step` appends one token to every
    live sequence in one padded write, as a fixed-shape decode step does. Each sequence's gather must equal
    what was written for it."""

    def __init__(self) -> None:
        super().__init__()
        self.store: PageStore | None = None
        self.expected: dict[int, torch.Tensor] = {}  # seq -> [layers, 2, tokens, heads, dim]
        self.noise = torch.Generator().manual_seed(0)  # the padded rows' K/V
        self.stale: set[int] = set()  # sequences whose model K/V differ from the store until the next write

    def _kv(self, n: int) -> torch.Tensor:
        return torch.randn(LAYERS, 2, n, HEADS, DIM, generator=self.noise)

    def _kv_of(self, ids: list[int]) -> torch.Tensor:
        """[layers, 2, 1, heads, dim]: what a model computes at the last of `ids` under the current weights (a
        function of the prefix and the weights' generation, so a prefix-cache hit must read exactly this)."""
        key = hashlib.blake2b(repr((self.gen, ids)).encode(), digest_size=8).digest()
        return torch.randn(LAYERS, 2, 1, HEADS, DIM, generator=torch.Generator().manual_seed(int.from_bytes(key)))

    def _write(self, slots: list[int], kv: torch.Tensor, size: int | None = None) -> None:
        if size is not None:  # padded rows carry K/V too: garbage that must land in the scratch page only
            kv = torch.cat([kv, self._kv(size - len(slots))], dim=2)
        mapping = self.store.slot_mapping(slots, size)
        for layer in range(LAYERS):
            self.store.write(layer, mapping, kv[layer, 0], kv[layer, 1])

    def built(self) -> None:
        self.store = PageStore(LAYERS, self.mgr.num_pages, self.mgr.page_size, HEADS, DIM, torch.float32, "cpu")

    def admitted(self, seq: int) -> None:
        ids, cached = self.ids[seq], self.mgr.cached_tokens(seq)
        kv = torch.cat([self._kv_of(ids[: j + 1]) for j in range(len(ids))], dim=2)
        self._write(self.mgr.slots(seq, cached, len(ids)), kv[:, :, cached:])  # the prefill skips cached pages
        self.expected[seq] = kv

    def forked(self, parent: int, child: int, copy: tuple[int, int] | None) -> None:
        if copy is not None:
            self.store.copy_pages([copy[0]], [copy[1]])
        self.expected[child] = self.expected[parent].clone()

    def appended(self, seq: int, slot: int) -> None:
        kv = self._kv_of(self.ids[seq])
        self._write([slot], kv)
        self.expected[seq] = torch.cat([self.expected[seq], kv], dim=2)

    def freed(self, seq: int) -> None:
        del self.expected[seq]

    @precondition(lambda self: self.ids)
    @rule(pad=st.integers(0, 5), token=st.integers(0, 2))
    def decode_step(self, pad: int, token: int) -> None:
        growing = [s for s in sorted(self.ids) if self.tokens(s) < self.final[s]]
        slots = [self._append(s, (token + s) % 3) for s in growing]
        kv = torch.cat([self._kv_of(self.ids[s]) for s in growing], dim=2) if growing else self._kv(0)
        self._write(slots, kv, size=len(growing) + pad)
        for j, s in enumerate(growing):
            self.expected[s] = torch.cat([self.expected[s], kv[:, :, j : j + 1]], dim=2)

    def teardown(self) -> None:
        if self.store is not None:
            self.check_gathers()

    def check_gathers(self) -> None:
        for s, want in self.expected.items():
            for layer in range(LAYERS):
                k, v = self.store.gather(layer, self.mgr.block_table(s), self.tokens(s))
                assert torch.equal(k, want[layer, 0]) and torch.equal(v, want[layer, 1]), (s, layer)

    @precondition(lambda self: self.expected)
    @rule()
    def gathers_equal_what_was_written(self) -> None:
        self.check_gathers()


TestPageMachine = PageMachine.TestCase
TestPageMachine.settings = MACHINE_SETTINGS


def test_a_store_sized_from_a_model_and_budget_holds_its_pages_in_the_serving_dtype():
    config = Qwen2Config(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    per_token = kv_bytes_per_token(config, torch.bfloat16)  # 3 layers x 2 heads x 8 dims x K,V x 2 bytes
    mgr = BlockManager(KVBudget(per_token * 16 * 5, per_token), page_size=16)
    store = PageStore.for_model(config, mgr.num_pages, mgr.page_size, torch.bfloat16, "cpu")
    assert store.kv.shape == (3, 2, 6, 16, 2, 8) and store.kv.dtype == torch.bfloat16
    assert store.nbytes == per_token * 16 * (mgr.num_pages + 1)  # the budget's pages and the scratch page
    assert store.keys(1).shape == (6, 16, 2, 8) and store.keys(1).data_ptr() == store.kv[1, 0].data_ptr()


def test_padded_rows_write_only_the_scratch_page():
    store = PageStore(1, 3, 4, 1, 2, torch.float32, "cpu")
    k, v = torch.ones(5, 1, 2), torch.full((5, 1, 2), 2.0)
    store.write(0, store.slot_mapping([5], size=5), k, v)  # one real token (page 1, offset 1) and 4 padded rows
    written = (store.kv != 0).any(dim=(0, 1, 3, 4, 5))
    assert written.tolist() == [False, True, False, True]  # page 1 and the scratch page (3), nothing else
    assert torch.equal(store.gather(0, [1], 2)[1][1], v[0])
    with pytest.raises(ValueError, match="do not fit a mapping"):
        store.slot_mapping([1, 2, 3], size=2)


def test_block_tables_change_in_place_padded_with_the_scratch_page():
    mgr = BlockManager(KVBudget(8 * 4, 1), page_size=4)
    store = PageStore(1, mgr.num_pages, 4, 1, 1, torch.float32, "cpu")
    tables = BlockTables(max_seqs=3, max_pages=4, pad=store.scratch, device="cpu")
    ptr = tables.table.data_ptr()
    tables.set(0, mgr.admit("a", 5, 12))
    tables.set(1, mgr.admit("b", 4, 8))
    slot = mgr.append("b")  # position 4: a new page at the boundary
    tables.put(1, 1, slot // 4)
    table = tables.sync()
    assert table.data_ptr() == ptr and table.dtype == torch.int32
    assert table.tolist() == [[*mgr.block_table("a"), 8, 8], [*mgr.block_table("b"), 8, 8], [8] * 4]
    tables.clear(0)
    assert tables.sync()[0].tolist() == [8] * 4 and tables.table.data_ptr() == ptr
    with pytest.raises(ValueError, match="exceed the block table's 4 columns"):
        tables.set(2, [0] * 5)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
def test_a_cpu_store_reads_zero_and_costs_no_memory_until_written():
    """The store is allocated up front at the full budget; on the CPU only the pages sequences reach take memory
    (torch.zeros made all 256 MiB resident at construction), and every page reads 0 until written."""
    before = _resident_bytes()
    store = PageStore(2, 2047, 16, 8, 64, torch.float32, "cpu")  # 2 layers x 2048 pages of 64 KiB: 256 MiB
    assert store.nbytes == 256 * 2**20 and store.kv.is_contiguous()
    assert _resident_bytes() - before < 32 * 2**20
    store.write(1, store.slot_mapping([16 * 5 + 2]), torch.ones(1, 8, 64), torch.full((1, 8, 64), 2.0))
    k, v = store.gather(1, [5, store.scratch], 32)
    assert float(k[2].min()) == 1.0 and float(v[2].max()) == 2.0
    assert int((k != 0).sum()) == 8 * 64 and int((v != 0).sum()) == 8 * 64  # the rest reads 0, not garbage
    assert _resident_bytes() - before < 32 * 2**20
