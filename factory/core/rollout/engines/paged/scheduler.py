"""The paged engine's scheduler: the waiting queue, admission inside the page budget, GRPO forks, decode rows and
retirement, in plain Python (the engine runs the model and the sampler on what it decides).

A request is a group: the samples of one prompt. Samples arrive one by one (`enqueue`: the server and `generate`
submit each of a prompt's n samples separately) and join a waiting group of the same prompt and final length, so
identical prompts queued before an admission are prefilled once and forked; a group grows only while it could
still run alone (`max_rows` rows, the page budget). A group waits in arrival order; the head joins when
`BlockManager.can_admit` says the whole group can grow to its final length (prompt + max_new_tokens, within the
context) next to every running sequence, and there are n free decode rows; until then it and everything behind it
waits, so a large request is not starved by small ones. Admission takes at most `max_prefill_tokens` packed prompt
tokens per prefill (at least one group).

A group is prefilled once (its first sample, the parent); its other samples fork the parent at its admission
(`BlockManager.fork`: they share the prompt's full pages and get a copy of its partial last one, which the engine
runs right after the prefill: `Group.copies`), so the prompt's K/V are computed and stored once per group, and the
next group's admission sees every page the group may take. Each sample then draws its own first token from the parent's
prefill logits and decodes on its own row.

Rows: sequence i of the decode batch sits at a fixed row of the block tables (`BlockTables`) from admission to
retirement; a decode step runs the rows [0, bucket), bucket the smallest power of two above the highest live row
(capped at `max_rows`), and the block-table columns [0, width), width the smallest power of two holding the longest
live sequence's pages, so shapes come from a handful of sizes (the CUDA graphs to capture later), not one per
batch, and a step reads no more keys than twice the longest sequence's. Rows without a sequence feed token 0 at
position 0 over the scratch page.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from factory.core.rollout.engines.paged.blocks import BlockManager
from factory.core.rollout.engines.paged.pages import BlockTables
from factory.core.rollout.engines.sequences import Sequence


@dataclass(eq=False)
class PagedSequence(Sequence):
    """One sample being generated (see `sequences.Sequence`), with its sampler seed and its decode row."""

    seed: int = 0  # `sequences.mix_seed(request seed, sample index)`: the sampler's counter-based noise key
    row: int = -1
    inflight: int = 0  # tokens sampled on the device that the host has not read yet (the engine's overlap)
    # identity, not value: the block manager keys its tables by sequence (Sequence's dataclass __eq__ unhashes it)
    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass(eq=False)
class Group:
    """The samples of one prompt, admitted and prefilled together (`samples[0]` is prefilled, the rest fork it)."""

    samples: list[PagedSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) pages to copy after prefill

    @property
    def prompt(self) -> list[int]:
        return self.samples[0].prompt_ids


class Scheduler:
    """Who waits, who runs at which row, and their pages (`blocks`), for up to `max_rows` running sequences of at
    most `max_seq_len` positions."""

    def __init__(self, blocks: BlockManager, tables: BlockTables, max_seq_len: int, max_prefill_tokens: int,
                 prefix_cache: bool = False):
        self.blocks, self.tables = blocks, tables
        self.max_rows = tables.shape[0]
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[Group] = deque()
        self._open: dict[tuple[tuple[int, ...], int], Group] = {}  # waiting groups by (prompt, final length)
        self.rows: list[PagedSequence | None] = [None] * self.max_rows
        self.live = 0  # sequences on rows
        self.queued = 0  # samples in the waiting groups
        self.waited_for_kv = 0  # admissions the budget (not the rows) held back

    @property
    def running(self) -> list[PagedSequence]:
        return [s for s in self.rows if s is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or self.live > 0

    def add(self, group: Group) -> None:
        self.waiting.append(group)
        self.queued += len(group.samples)

    def enqueue(self, seq: PagedSequence) -> None:
        """Queue one sample: into the waiting group of its prompt and final length if that group could still run
        alone with it, else as a new group at the tail."""
        final = seq.final_length(self.max_seq_len)
        key = (tuple(seq.prompt_ids), final)
        g = self._open.get(key)
        if g is not None and len(g.samples) < self.max_rows \
                and self.blocks.need(len(seq.prompt_ids), final, len(g.samples) + 1) <= self.blocks.num_pages:
            g.samples.append(seq)
            self.queued += 1
            return
        g = Group([seq])
        self._open[key] = g
        self.add(g)

    def prune(self) -> None:
        """Drop the cancelled samples of the waiting groups (and the groups left empty)."""
        for g in list(self.waiting):
            live = [s for s in g.samples if not s.future.cancelled()]
            if len(live) != len(g.samples):
                self.queued -= len(g.samples) - len(live)
                g.samples = live
                if not live:
                    self.waiting.remove(g)
                    self._forget(g)

    def drain(self) -> list[PagedSequence]:
        """Remove every waiting sample; returns them."""
        out = [s for g in self.waiting for s in g.samples]
        self.waiting.clear()
        self._open.clear()
        self.queued = 0
        return out

    def head_fits(self) -> bool:
        """Whether the head group could be admitted now (cancelled samples pruned first)."""
        self.prune()
        if not self.waiting:
            return False
        g = self.waiting[0]
        ids = g.prompt if self.prefix_cache else None
        return len(g.samples) <= self.rows.count(None) and self.blocks.can_admit(
            len(g.prompt), g.samples[0].final_length(self.max_seq_len), len(g.samples), token_ids=ids)

    def _forget(self, g: Group) -> None:
        key = (tuple(g.prompt), g.samples[0].final_length(self.max_seq_len)) if g.samples else None
        if key is not None and self._open.get(key) is g:
            del self._open[key]
        else:  # emptied by prune: find it by identity
            for k, v in list(self._open.items()):
                if v is g:
                    del self._open[k]

    # -- admission
    def admit(self) -> list[Group]:
        """Admit waiting groups from the head while they fit; each parent gets its prompt's pages and a row, its
        other samples fork it and get rows (the caller prefills the parents, then runs each group's `copies`)."""
        out: list[Group] = []
        self.prune()
        free_rows = self.rows.count(None)
        tokens = 0
        while self.waiting:
            g = self.waiting[0]
            n, prompt = len(g.samples), g.prompt
            final = g.samples[0].final_length(self.max_seq_len)
            if out and tokens + len(prompt) > self.max_prefill_tokens:
                break
            ids = prompt if self.prefix_cache else None
            if n > free_rows:
                break
            if not self.blocks.can_admit(len(prompt), final, n, token_ids=ids):
                self.waited_for_kv += 1
                break
            self.waiting.popleft()
            self._forget(g)
            self.queued -= n
            parent = g.samples[0]
            self.blocks.admit(parent, len(prompt), final, token_ids=ids)
            self._place(parent)
            g.copies = self._fork(g)
            free_rows -= n
            tokens += len(prompt) - self.blocks.cached_tokens(parent)
            out.append(g)
        return out

    def _fork(self, group: Group) -> list[tuple[int, int]]:
        """Fork the group's other samples from its parent; returns the page copies to run once it is prefilled."""
        copies = []
        parent = group.samples[0]
        for child in group.samples[1:]:
            if (copy := self.blocks.fork(parent, child)) is not None:
                copies.append(copy)
            self._place(child)
        return copies

    def _place(self, seq: PagedSequence) -> None:
        seq.row = self.rows.index(None)
        self.rows[seq.row] = seq
        self.live += 1
        self.tables.set(seq.row, self.blocks.block_table(seq))

    # -- decode
    def bucket(self, exact: bool = False) -> int:
        """Rows the next decode step runs: the smallest power of two past the highest live row, at most max_rows
        (`exact`: the rows up to the highest live one, for a step that is neither captured nor compiled)."""
        top = max((i for i, s in enumerate(self.rows) if s is not None), default=0) + 1
        return top if exact else min(1 << (top - 1).bit_length(), self.max_rows)

    def width(self, exact: bool = False) -> int:
        """Block-table columns the next decode step reads: the smallest power of two holding the longest live
        sequence's pages, at most the table's width (attention gathers every column it is given; `exact`: that
        sequence's pages)."""
        pages = max((len(self.blocks.block_table(s)) for s in self.rows if s is not None), default=1)
        return pages if exact else min(1 << (pages - 1).bit_length(), self.tables.shape[1])

    def append(self, seq: PagedSequence) -> int:
        """The position the sequence's last token is fed at (its K/V go to a page the block table now holds).
        A token still on the device (`inflight`) is fed unnamed: the prefix cache stops naming the sequence's
        pages from there."""
        position = self.blocks.tokens(seq)
        before = len(self.blocks.block_table(seq))
        self.blocks.append(seq, seq.tokens[-1] if self.prefix_cache and not seq.inflight else None)
        pages = self.blocks.block_table(seq)
        if len(pages) != before:
            self.tables.put(seq.row, len(pages) - 1, pages[-1])
        return position

    # -- retirement
    def retire(self, seq: PagedSequence) -> None:
        """Free a finished sequence's pages and row."""
        self.blocks.free(seq)
        self.tables.clear(seq.row)
        self.rows[seq.row] = None
        self.live -= 1
        seq.row = -1

    def reset(self) -> None:
        """Free every running sequence (a failed step: their pages may hold half-written K/V, so the prefix cache
        forgets every page too)."""
        for s in self.running:
            if s in self.blocks:
                self.blocks.free(s)
            self.tables.clear(s.row)
            self.rows[s.row] = None
            s.row = -1
        self.live = 0
        self.blocks.flush_prefix_cache()

    def flush_prefix_cache(self) -> None:
        self.blocks.flush_prefix_cache()
