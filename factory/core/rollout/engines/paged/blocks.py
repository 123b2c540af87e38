"""The paged engine's KV block manager: which pages of the KV page store each sequence holds, in plain Python.

A page holds the K/V of `page_size` consecutive positions of one sequence, in every layer. Each sequence has a
block table (page i holds its positions [i*page_size, (i+1)*page_size)) and a token count; each page a refcount,
the number of block tables that hold it; a page whose count falls to 0 returns to the free list.

- admit: a sequence of N prompt tokens gets ceil(N / page_size) fresh pages (its prefill writes them).
- fork: a GRPO group's samples share the prompt's K/V. The child holds every FULL page of the parent by refcount
  and gets its own copy of a partial last page at once (`fork` returns the (source, destination) page copy for the
  page store to run). Copied at fork, not on first write: every sample writes into that page at its first decode
  step anyway, so copy-on-write would copy the same pages one step later, and copying at fork keeps the one rule
  the append path relies on: a shared page is full, so nothing ever writes into it.
- append: one more position; a fresh page only when the last is full (never a copy of an existing page).
- free: every page's refcount drops by one.
- prefix cache (`prefix_cache=True`, `prefix.py`): an admission given its prompt's token ids takes, instead of
  fresh pages, the cached pages that hold its prompt's leading full pages (live ones by refcount, freed ones back
  off the free list), all but the page of its last prompt token, which the prefill must compute for its logits;
  `cached_tokens` says how many positions the prefill skips. The prefill must write an admitted sequence's pages
  in the step it is admitted (they are findable from then on); `flush_prefix_cache` after every weight update.
  Freed pages keep their K/V until handed out again, oldest freed first.

Budget: `num_pages` pages in all: the bytes of the `kv_budget.KVBudget` it is built with over the bytes of a
page, rounded down. Admission keeps every admitted sequence able to grow to its final length (prompt + max_tokens,
within the context): the pages in use plus the pages the running sequences may still take (`reserved`) never pass
`num_pages`, so a running sequence never waits for a page. A request that cannot fit even into an empty cache gets
`problem`'s message, which names the setting (`kv_budget.never_fits`).

Page size: 16 tokens by default (vLLM's default; nano-vllm takes 256 because flash-attn's paged kernel wants
multiples of 256). A sequence wastes at most page_size - 1 positions at its tail, and each sample of a group copies
at most page_size - 1 prompt positions at fork; at 256, a GRPO group of 8 on 300-token prompts would copy 7 x 44
positions and leave up to 255 unused per sequence. The cost of small pages, longer block tables, is a few
int32s per sequence. A kernel that needs larger pages (FlexAttention's block mask column size, flash-attn's 256)
passes its own `page_size`; nothing here depends on the value.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from factory.core.rollout.engines.kv_budget import KVBudget, never_fits
from factory.core.rollout.engines.paged.prefix import PrefixCache, chain

PAGE_SIZE = 16


@dataclass
class SeqBlocks:
    """One sequence's pages: `pages[i]` holds positions [i*page_size, (i+1)*page_size); `tokens` positions are
    written; it may grow to `final` positions."""

    pages: list[int] = field(default_factory=list)
    tokens: int = 0
    final: int = 0
    cached: int = 0  # leading prompt positions found in the prefix cache
    generation: int = -1  # the prefix cache's generation it registers pages in (-1: none)
    digests: list[bytes] = field(default_factory=list)  # its full pages' prefix digests (prefix cache only)
    tail: list[int] = field(default_factory=list)  # the token ids in its partial last page (prefix cache only)


class BlockManager:
    """Pages, refcounts and block tables for the sequences of one page store (see the module docstring).

    Sequence ids are the caller's (any hashable). Misuse (an unknown or live id, an admission the caller did not
    check with `can_admit`, an append past the final length) raises: it is a scheduler bug, not a user error.
    """

    def __init__(self, budget: KVBudget, page_size: int = PAGE_SIZE, prefix_cache: bool = False,
                 set_aside: int = 0):
        """`set_aside`: pages of the budget kept for something else (the page store's scratch page), not handed
        out; messages still name the whole budget."""
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.budget = budget
        self.page_size = page_size
        self.num_pages = max(0, budget.total_bytes // max(1, budget.per_token * page_size) - set_aside)
        # oldest freed first, so the prefix cache loses its least recently used pages first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_pages))
        self._refs = [0] * self.num_pages
        self.prefix = PrefixCache(self.num_pages) if prefix_cache else None
        self._seqs: dict[object, SeqBlocks] = {}
        self.reserved = 0  # pages the live sequences may still take to reach their final lengths

    # -- reading
    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` positions."""
        return -(-tokens // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def committed(self) -> int:
        """Pages the live sequences hold or may still take: never more than `num_pages`."""
        return self.used_pages + self.reserved

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def free_list(self) -> list[int]:
        """The free pages, oldest freed first (a copy)."""
        return list(self._free)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def sequences(self) -> list[object]:
        return list(self._seqs)

    def block_table(self, seq_id: object) -> list[int]:
        """The sequence's pages in position order (the manager's own list: read it, do not change it)."""
        return self._seq(seq_id).pages

    def tokens(self, seq_id: object) -> int:
        return self._seq(seq_id).tokens

    def cached_tokens(self, seq_id: object) -> int:
        """Leading prompt positions whose K/V the sequence found in the prefix cache: its prefill starts there."""
        return self._seq(seq_id).cached

    def slot(self, seq_id: object, position: int) -> int:
        """Where position `position` of the sequence lives in the page store: page * page_size + offset."""
        s = self._seq(seq_id)
        if not 0 <= position < len(s.pages) * self.page_size:
            raise IndexError(f"position {position} is outside sequence {seq_id!r}'s {len(s.pages)} pages")
        return s.pages[position // self.page_size] * self.page_size + position % self.page_size

    def slots(self, seq_id: object, start: int, end: int) -> list[int]:
        """`slot` of positions [start, end): a prefill's slot mapping."""
        s, p = self._seq(seq_id), self.page_size
        if not 0 <= start <= end <= len(s.pages) * p:
            raise IndexError(f"positions [{start}, {end}) are outside sequence {seq_id!r}'s {len(s.pages)} pages")
        return [s.pages[i // p] * p + i % p for i in range(start, end)]

    # -- admission
    def need(self, prompt_tokens: int, final_length: int, samples: int = 1) -> int:
        """Pages a group of `samples` sequences of `prompt_tokens` prompt positions takes to reach `final_length`
        positions each, its samples sharing the prompt's full pages."""
        whole = self.pages_for(max(final_length, prompt_tokens))
        return whole + (samples - 1) * (whole - prompt_tokens // self.page_size)

    def can_admit(self, prompt_tokens: int, final_length: int, samples: int = 1,
                  token_ids: Sequence[int] | None = None) -> bool:
        """Whether such a group can join now with every live sequence still able to reach its final length
        (`token_ids`: its prompt, whose pages live sequences already hold cost nothing)."""
        need = self.need(prompt_tokens, final_length, samples)
        if token_ids is not None:
            need -= sum(self._refs[page] > 0 for page in self._hits(token_ids)[0])
        return self.committed + need <= self.num_pages

    def problem(self, prompt_tokens: int, final_length: int, samples: int = 1) -> str | None:
        """Why such a group could never run inside the budget even into an empty cache, or None."""
        need = self.need(prompt_tokens, final_length, samples)
        if need <= self.num_pages:
            return None
        group = f", {samples} samples sharing the prompt's full pages" if samples > 1 else ""
        return never_fits(need * self.page_size * self.budget.per_token,
                          f"{need} pages of {self.page_size} tokens: {prompt_tokens} prompt tokens, up to "
                          f"{final_length} positions with the completion{group}, {self.budget.per_token:,} bytes "
                          f"a token", self.budget.total_bytes)

    # -- changes
    def admit(self, seq_id: object, prompt_tokens: int, final_length: int,
              token_ids: Sequence[int] | None = None) -> list[int]:
        """Give a new sequence the pages of its `prompt_tokens` positions; it may grow to `final_length`. With the
        prefix cache, `token_ids` (the prompt) finds its cached pages and registers its new ones. Returns its block
        table."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} is already admitted")
        if not 1 <= prompt_tokens <= final_length:
            raise ValueError(f"need 1 <= prompt_tokens <= final_length, got {prompt_tokens} and {final_length}")
        if token_ids is not None and len(token_ids) != prompt_tokens:
            raise ValueError(f"token_ids has {len(token_ids)} ids for a prompt of {prompt_tokens} tokens")
        if not self.can_admit(prompt_tokens, final_length, token_ids=token_ids):
            raise RuntimeError(f"sequence {seq_id!r} does not fit: {self.committed} of {self.num_pages} pages are "
                               f"committed and it needs {self.need(prompt_tokens, final_length)} (check can_admit)")
        hits, digests = self._hits(token_ids) if token_ids is not None else ([], [])
        for page in hits:
            if self._refs[page] == 0:
                del self._free[page]
            self._refs[page] += 1
        now = self.pages_for(prompt_tokens)
        s = SeqBlocks(hits + [self._take() for _ in range(now - len(hits))], prompt_tokens, final_length,
                      cached=len(hits) * self.page_size)
        if self.prefix is not None and token_ids is not None:
            s.generation, s.digests = self.prefix.generation, digests
            for page, digest in zip(s.pages, digests, strict=False):
                self.prefix.register(page, digest)
            s.tail = list(token_ids[len(digests) * self.page_size:])
        self._seqs[seq_id] = s
        self.reserved += self.pages_for(final_length) - now
        return s.pages

    def fork(self, parent: object, child: object, final_length: int | None = None) -> tuple[int, int] | None:
        """Make `child` a copy of `parent` as it is now (one more sample of a group): it shares the parent's full
        pages and gets a fresh copy of a partial last page. Returns that copy as (source, destination) page, for
        the page store (`PageStore.copy_pages`), or None when every page is full. `final_length` defaults to the
        parent's."""
        if child in self._seqs:
            raise KeyError(f"sequence {child!r} is already admitted")
        p = self._seq(parent)
        final = p.final if final_length is None else final_length
        if final < p.tokens:
            raise ValueError(f"final_length {final} is shorter than the {p.tokens} positions the fork copies")
        full = p.tokens // self.page_size
        need = self.pages_for(final) - full
        if self.committed + need > self.num_pages:
            raise RuntimeError(f"fork of {parent!r} does not fit: {self.committed} of {self.num_pages} pages are "
                               f"committed and it needs {need} (check can_admit with samples)")
        for page in p.pages[:full]:
            self._refs[page] += 1
        pages, copy = p.pages[:full], None
        if full < len(p.pages):
            copy = (p.pages[full], self._take())
            pages.append(copy[1])
        self._seqs[child] = SeqBlocks(pages, p.tokens, final, p.cached, p.generation, p.digests[:full], list(p.tail))
        self.reserved += need - (len(pages) - full)
        return copy

    def append(self, seq_id: object, token_id: int | None = None) -> int:
        """One more position for the sequence (its new token's K/V; `token_id`, the token fed at it, lets the
        prefix cache find the page once full): returns the slot to write it to."""
        s = self._seq(seq_id)
        if s.tokens >= s.final:
            raise RuntimeError(f"sequence {seq_id!r} already holds its final length of {s.final} positions")
        offset = s.tokens % self.page_size
        if offset == 0:  # the last page is full (pages hold ceil(tokens / page_size))
            s.pages.append(self._take())
            self.reserved -= 1
        page = s.pages[-1]
        if self._refs[page] != 1:  # never reached while fork copies partial pages: the invariant's last guard
            raise RuntimeError(f"sequence {seq_id!r} would write into page {page}, shared by {self._refs[page]}")
        s.tokens += 1
        if self.prefix is not None and s.generation == self.prefix.generation:
            if token_id is None:
                s.generation = -1  # its pages from here on are unnamed
            else:
                s.tail.append(token_id)
                if len(s.tail) == self.page_size:
                    s.digests.append(chain(s.digests[-1] if s.digests else b"", s.tail))
                    self.prefix.register(page, s.digests[-1])
                    s.tail = []
        return page * self.page_size + offset

    def flush_prefix_cache(self) -> None:
        """Forget every cached page (call it when the weights change: cached K/V are the old policy's)."""
        if self.prefix is not None:
            self.prefix.flush()

    def free(self, seq_id: object) -> None:
        """Drop the sequence: its pages' refcounts fall by one, those at 0 return to the free list."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise KeyError(f"no sequence {seq_id!r}")
        self.reserved -= self.pages_for(s.final) - len(s.pages)
        for page in reversed(s.pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None

    def _take(self) -> int:
        page, _ = self._free.popitem(last=False)  # admission reserved it: the free list is never empty here
        if self.prefix is not None:
            self.prefix.evict(page)
        self._refs[page] = 1
        return page

    def _hits(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached pages holding the prompt's leading full pages, up to the page of its last token, which is
        always computed; and the digests of all its full pages."""
        p, digests, hits = self.page_size, [], []
        if self.prefix is None:
            return hits, digests
        for i in range(len(token_ids) // p):
            digests.append(chain(digests[-1] if digests else b"", token_ids[i * p:(i + 1) * p]))
            found = self.prefix.lookup(digests[-1]) if len(hits) == i and (i + 1) * p < len(token_ids) else None
            if found is not None:
                hits.append(found)
        return hits, digests

    def _seq(self, seq_id: object) -> SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r}") from None
