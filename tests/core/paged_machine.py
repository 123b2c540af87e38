"""A hypothesis state machine over the paged block manager (`factory/core/rollout/engines/paged/blocks.py`): random
admissions of GRPO groups, forks, appends, frees and (with the prefix cache) weight-update flushes, beside a model
of each sequence's token ids and each page's content, checking the manager's invariants after every step.
`tests/core/test_paged_pages.py` extends it with a page store."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from factory.core.rollout.engines.kv_budget import KVBudget
from factory.core.rollout.engines.paged.blocks import BlockManager

PER_TOKEN = 8  # bytes of one token's K/V (any value: the manager counts pages)
# prompts start with a prefix of one of these, so the prefix cache finds pages; token ids come from {0, 1, 2}
BASES = [[random.Random(b).randrange(3) for _ in range(40)] for b in range(3)]

# derandomized: the same examples on every run and machine, so the suite never flakes on a new draw
MACHINE_SETTINGS = settings(derandomize=True, max_examples=80, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockMachine(RuleBasedStateMachine):
    """The manager under random use, beside a model: each live sequence's token ids, final length and family (the
    admission it was forked from); each page's content as (generation of the weights, the token prefix it ends);
    the pages that were ever shared since they were last handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr: BlockManager | None = None
        self.ids: dict[int, list[int]] = {}
        self.final: dict[int, int] = {}
        self.family: dict[int, int] = {}
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.ever_shared: set[int] = set()
        self.history: list[list[int]] = []  # the token ids of the last sequences freed or admitted
        self.gen = 0  # weight updates so far (prefix cache flushes)
        self.next_id = 0

    @initialize(page_size=st.sampled_from([1, 3, 4, 16]), pages=st.integers(1, 40), prefix=st.booleans())
    def build(self, page_size: int, pages: int, prefix: bool) -> None:
        budget = KVBudget(pages * page_size * PER_TOKEN + PER_TOKEN - 1, PER_TOKEN)
        self.mgr = BlockManager(budget, page_size, prefix_cache=prefix)
        assert self.mgr.num_pages == pages  # the budget's bytes round down to whole pages
        self.built()

    # -- hooks for the page-store machine (hypothesis collects only decorated methods: subclasses override these)
    def built(self) -> None: ...

    def admitted(self, seq: int) -> None: ...

    def forked(self, parent: int, child: int, copy: tuple[int, int] | None) -> None: ...

    def appended(self, seq: int, slot: int) -> None: ...

    def freed(self, seq: int) -> None: ...

    # -- the model's view
    def tokens(self, seq: int) -> int:
        return len(self.ids[seq])

    def pages_to_finish(self) -> int:
        """Distinct pages held + the pages each live sequence may still take (computed afresh)."""
        held = {page for s in self.ids for page in self.mgr.block_table(s)}
        return len(held) + sum(ceil_div(self.final[s], self.mgr.page_size) - len(self.mgr.block_table(s))
                               for s in self.ids)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, i: int) -> int:
        live = sorted(self.ids)
        return live[i % len(live)]

    def _wrote(self, seq: int, upto: int) -> None:
        """The sequence just wrote position upto - 1: its page now ends that prefix."""
        page = self.mgr.block_table(seq)[(upto - 1) // self.mgr.page_size]
        self.content[page] = (self.gen, tuple(self.ids[seq][:upto]))

    def _fork(self, parent: int) -> int:
        child = self._new_id()
        before = set(self.mgr.block_table(parent))
        copy = self.mgr.fork(parent, child)
        table = self.mgr.block_table(child)
        full = self.tokens(parent) // self.mgr.page_size
        assert table[:full] == self.mgr.block_table(parent)[:full]
        if copy is None:
            assert self.tokens(parent) % self.mgr.page_size == 0 and len(table) == full
        else:
            assert copy[0] == self.mgr.block_table(parent)[full] and copy[1] == table[full] not in before
            self.content[copy[1]] = self.content[copy[0]]
        self.ever_shared.update(table[:full])
        self.ids[child], self.final[child], self.family[child] = list(self.ids[parent]), self.final[parent], \
            self.family[parent]
        self.forked(parent, child, copy)
        return child

    # -- rules
    @precondition(lambda self: self.mgr is not None)
    @rule(base=st.integers(0, 2), shared=st.sampled_from([12, 24, 40]) | st.integers(0, 40),
          tail=st.lists(st.integers(0, 2), max_size=8),
          new=st.integers(0, 40), samples=st.integers(1, 4))
    def admit_group(self, base: int, shared: int, tail: list[int], new: int, samples: int) -> None:
        self._admit((BASES[base][:shared] + tail) or [0], new, samples)

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 1000), cut=st.integers(0, 3), tail=st.lists(st.integers(0, 2), max_size=5),
          new=st.integers(0, 20))
    def next_turn(self, i: int, cut: int, tail: list[int], new: int) -> None:
        """A multi-turn episode's next request: a live or finished sequence's tokens (maybe less a few), then
        more: the prefix cache's case, pages filled by appends and freed pages included."""
        ids = self.history[i % len(self.history)]
        self._admit((ids[: len(ids) - cut] + tail) or [0], new, 1)

    def _admit(self, ids: list[int], new: int, samples: int) -> None:
        prompt, p = len(ids), self.mgr.page_size
        final = prompt + new
        oracle = samples * ceil_div(final, p) - (samples - 1) * (prompt // p)  # the group at its final lengths
        fits = self.pages_to_finish() + oracle <= self.mgr.num_pages
        assert self.mgr.can_admit(prompt, final, samples) == fits
        assert (self.mgr.problem(prompt, final, samples) is None) == (oracle <= self.mgr.num_pages)
        if not self.mgr.can_admit(prompt, final, samples, token_ids=ids):
            assert not fits  # pages live sequences hold can only help
            return
        seq = self._new_id()
        free_before = set(self.mgr.free_list())
        self.mgr.admit(seq, prompt, final, token_ids=ids)
        self.ids[seq], self.final[seq], self.family[seq] = list(ids), final, seq
        self.history = [*self.history[-7:], self.ids[seq]]  # the list itself: it sees the appends
        table, cached = self.mgr.block_table(seq), self.mgr.cached_tokens(seq)
        assert len(table) == ceil_div(prompt, p) and cached % p == 0 and cached < prompt
        assert cached == 0 or self.mgr.prefix is not None
        for i, page in enumerate(table[: cached // p]):  # a hit holds this generation's K/V of this very prefix
            assert self.content[page] == (self.gen, tuple(ids[: (i + 1) * p]))
        self.ever_shared.update(page for page in table[: cached // p] if self.mgr.refcount(page) > 1)
        fresh = table[cached // p:]
        assert set(fresh) <= free_before and not self.ever_shared & set(fresh)
        for upto in range(cached + p, prompt + p, p):  # the prefill writes every page it did not find
            self._wrote(seq, min(upto, prompt))
        self.admitted(seq)
        for _ in range(samples - 1):
            self._fork(seq)

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 1000))
    def fork_later(self, i: int) -> None:
        """A fork of a sequence mid-generation: it fits exactly when its own pages to come fit the budget."""
        parent = self._pick(i)
        need = ceil_div(self.final[parent], self.mgr.page_size) - self.tokens(parent) // self.mgr.page_size
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

    def _append(self, seq: int, token: int) -> int:
        free_before = self.mgr.free_pages
        slot = self.mgr.append(seq, token)
        page, offset = divmod(slot, self.mgr.page_size)
        assert offset == self.tokens(seq) % self.mgr.page_size
        # a fresh page only at a page boundary, and no write into a page that was ever shared
        assert self.mgr.free_pages == free_before - (offset == 0)
        assert self.mgr.refcount(page) == 1 and page not in self.ever_shared
        assert self.mgr.slot(seq, self.tokens(seq)) == slot
        self.ids[seq].append(token)
        self._wrote(seq, self.tokens(seq))
        return slot

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 1000), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, i: int, tokens: list[int]) -> None:
        seq = self._pick(i)
        for token in tokens:
            if self.tokens(seq) == self.final[seq]:
                try:
                    self.mgr.append(seq, token)
                except RuntimeError:
                    return
                raise AssertionError("an append past the final length was allowed")
            self.appended(seq, self._append(seq, token))

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 1000))
    def free(self, i: int) -> None:
        seq = self._pick(i)
        self.mgr.free(seq)
        self.history = [*self.history[-7:], self.ids[seq]]
        for d in (self.ids, self.final, self.family):
            del d[seq]
        held = {page for s in self.ids for page in self.mgr.block_table(s)}
        self.ever_shared &= held  # a page back on the free list starts afresh
        self.freed(seq)

    @precondition(lambda self: self.mgr is not None and self.mgr.prefix is not None)
    @rule(draw=st.integers(0, 7))
    def update_weights(self, draw: int) -> None:
        if draw:  # one draw in 8: a rule without arguments would run as often as all the others together
            return
        self.mgr.flush_prefix_cache()
        self.gen += 1

    # -- invariants
    @invariant()
    def no_page_leaked_or_shared_wrongly(self) -> None:
        if self.mgr is None:
            return
        p = self.mgr.page_size
        holders: dict[int, list[tuple[int, int]]] = {}
        for s in self.ids:
            table = self.mgr.block_table(s)
            assert len(table) == ceil_div(self.tokens(s), p) and self.mgr.tokens(s) == self.tokens(s)
            assert len(set(table)) == len(table)
            for idx, page in enumerate(table):  # each page holds this sequence's own prefix
                assert self.content[page][1] == tuple(self.ids[s][: min((idx + 1) * p, self.tokens(s))])
                holders.setdefault(page, []).append((s, idx))
        free = self.mgr.free_list()
        assert len(set(free)) == len(free) and not set(free) & set(holders)
        assert len(free) + len(holders) == self.mgr.num_pages
        assert all(self.mgr.refcount(page) == len(h) for page, h in holders.items())
        assert all(self.mgr.refcount(page) == 0 for page in free)
        for page, h in holders.items():  # shared: full in every holder at one index, never written since
            if len(h) > 1:
                assert len({idx for _, idx in h}) == 1 and page in self.ever_shared
                assert all(self.tokens(s) >= (idx + 1) * p for s, idx in h)
                if self.mgr.prefix is None:  # and, without the prefix cache, one family's
                    assert len({self.family[s] for s, _ in h}) == 1

    @invariant()
    def admitted_sequences_can_finish_inside_the_budget(self) -> None:
        if self.mgr is None:
            return
        assert self.mgr.committed == self.pages_to_finish() <= self.mgr.num_pages
