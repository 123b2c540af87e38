"""A hypothesis state machine over the paged block manager (`factory/core/rollout/paged/blocks.py`): random
admissions of GRPO groups, forks, appends and frees, with a model of what each sequence holds and the manager's
invariants checked after every step. `tests/core/test_paged_pages.py` extends it with a page store."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from factory.core.rollout.kv_budget import KVBudget
from factory.core.rollout.paged.blocks import BlockManager

PER_TOKEN = 8  # bytes of one token's K/V (any value: the manager counts pages)

# derandomized: the same examples on every run and machine, so the suite never flakes on a new draw
MACHINE_SETTINGS = settings(derandomize=True, max_examples=60, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockMachine(RuleBasedStateMachine):
    """The manager under random use, beside a model: each live sequence's token count, final length and family
    (the admission it was forked from), and the pages that were ever shared since they were last allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr: BlockManager | None = None
        self.tokens: dict[int, int] = {}
        self.final: dict[int, int] = {}
        self.family: dict[int, int] = {}
        self.ever_shared: set[int] = set()
        self.next_id = 0

    @initialize(page_size=st.sampled_from([1, 3, 4, 16]), pages=st.integers(1, 40))
    def build(self, page_size: int, pages: int) -> None:
        self.mgr = BlockManager(KVBudget(pages * page_size * PER_TOKEN + PER_TOKEN - 1, PER_TOKEN), page_size)
        assert self.mgr.num_pages == pages  # the budget's bytes round down to whole pages
        self.built()

    # -- hooks for the page-store machine (hypothesis collects only decorated methods: subclasses override these)
    def built(self) -> None: ...

    def admitted(self, seq: int) -> None: ...

    def forked(self, parent: int, child: int, copy: tuple[int, int] | None) -> None: ...

    def appended(self, seq: int, slot: int) -> None: ...

    def freed(self, seq: int) -> None: ...

    # -- the model's view
    def pages_to_finish(self) -> int:
        """Distinct pages held + the pages each live sequence may still take (computed afresh)."""
        held = {page for s in self.tokens for page in self.mgr.block_table(s)}
        return len(held) + sum(ceil_div(self.final[s], self.mgr.page_size) - len(self.mgr.block_table(s))
                               for s in self.tokens)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, i: int) -> int:
        live = sorted(self.tokens)
        return live[i % len(live)]

    def _fork(self, parent: int) -> int:
        child = self._new_id()
        before = set(self.mgr.block_table(parent))
        copy = self.mgr.fork(parent, child)
        table = self.mgr.block_table(child)
        full = self.tokens[parent] // self.mgr.page_size
        assert table[:full] == self.mgr.block_table(parent)[:full]
        if copy is None:
            assert self.tokens[parent] % self.mgr.page_size == 0 and len(table) == full
        else:
            assert copy[0] == self.mgr.block_table(parent)[full] and copy[1] == table[full] not in before
        self.ever_shared.update(table[:full])
        self.tokens[child], self.final[child], self.family[child] = self.tokens[parent], self.final[parent], \
            self.family[parent]
        self.forked(parent, child, copy)
        return child

    # -- rules
    @precondition(lambda self: self.mgr is not None)
    @rule(prompt=st.integers(1, 40), new=st.integers(0, 40), samples=st.integers(1, 4))
    def admit_group(self, prompt: int, new: int, samples: int) -> None:
        final, p = prompt + new, self.mgr.page_size
        oracle = samples * ceil_div(final, p) - (samples - 1) * (prompt // p)  # the group at its final lengths
        fits = self.pages_to_finish() + oracle <= self.mgr.num_pages
        assert self.mgr.can_admit(prompt, final, samples) == fits
        assert (self.mgr.problem(prompt, final, samples) is None) == (oracle <= self.mgr.num_pages)
        if not fits:
            return
        seq = self._new_id()
        self.mgr.admit(seq, prompt, final)
        self.tokens[seq], self.final[seq], self.family[seq] = prompt, final, seq
        assert len(self.mgr.block_table(seq)) == ceil_div(prompt, p)
        assert not self.ever_shared & set(self.mgr.block_table(seq))
        self.admitted(seq)
        for _ in range(samples - 1):
            self._fork(seq)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 1000))
    def fork_later(self, i: int) -> None:
        """A fork of a sequence mid-generation: it fits exactly when its own pages to come fit the budget."""
        parent = self._pick(i)
        need = ceil_div(self.final[parent], self.mgr.page_size) - self.tokens[parent] // self.mgr.page_size
        if self.pages_to_finish() + need <= self.mgr.num_pages:
            self._fork(parent)
        else:
            before = self.mgr.committed
            try:
                self.mgr.fork(parent, -1)
            except RuntimeError as e:
                assert "does not fit" in str(e)
            else:
                raise AssertionError("a fork past the budget was allowed")
            assert -1 not in self.mgr and self.mgr.committed == before

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 1000), steps=st.integers(1, 6))
    def append(self, i: int, steps: int) -> None:
        seq = self._pick(i)
        for _ in range(steps):
            if self.tokens[seq] == self.final[seq]:
                try:
                    self.mgr.append(seq)
                except RuntimeError:
                    return
                raise AssertionError("an append past the final length was allowed")
            free_before = self.mgr.free_pages
            slot = self.mgr.append(seq)
            page, offset = divmod(slot, self.mgr.page_size)
            assert offset == self.tokens[seq] % self.mgr.page_size
            # a fresh page only at a page boundary, and no write into a page that was ever shared
            assert self.mgr.free_pages == free_before - (offset == 0)
            assert self.mgr.refcount(page) == 1 and page not in self.ever_shared
            assert self.mgr.slot(seq, self.tokens[seq]) == slot
            self.tokens[seq] += 1
            self.appended(seq, slot)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 1000))
    def free(self, i: int) -> None:
        seq = self._pick(i)
        self.mgr.free(seq)
        for d in (self.tokens, self.final, self.family):
            del d[seq]
        held = {page for s in self.tokens for page in self.mgr.block_table(s)}
        self.ever_shared &= held  # a page back on the free list starts afresh
        self.freed(seq)

    # -- invariants
    @invariant()
    def no_page_leaked_or_miscounted(self) -> None:
        if self.mgr is None:
            return
        holders: dict[int, list[tuple[int, int]]] = {}
        for s in self.tokens:
            table = self.mgr.block_table(s)
            assert len(table) == ceil_div(self.tokens[s], self.mgr.page_size) and self.mgr.tokens(s) == self.tokens[s]
            assert len(set(table)) == len(table)
            for idx, page in enumerate(table):
                holders.setdefault(page, []).append((s, idx))
        free = self.mgr.free_list()
        assert len(set(free)) == len(free) and not set(free) & set(holders)
        assert len(free) + len(holders) == self.mgr.num_pages
        assert all(self.mgr.refcount(page) == len(h) for page, h in holders.items())
        assert all(self.mgr.refcount(page) == 0 for page in free)
        for page, h in holders.items():  # shared: one family, same index, full in every holder, never written
            if len(h) > 1:
                assert len({self.family[s] for s, _ in h}) == 1 and len({idx for _, idx in h}) == 1
                assert all(self.tokens[s] >= (idx + 1) * self.mgr.page_size for s, idx in h)
                assert page in self.ever_shared

    @invariant()
    def admitted_sequences_can_finish_inside_the_budget(self) -> None:
        if self.mgr is None:
            return
        assert self.mgr.committed == self.pages_to_finish() <= self.mgr.num_pages
