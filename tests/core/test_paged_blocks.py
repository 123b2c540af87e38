"""The paged KV block manager (`factory/core/rollout/engines/paged/blocks.py`): no page leaked or shared wrongly after
random admissions, forks, appends and frees; admission waits for pages and keeps every admitted sequence able to
finish; a request that can never fit is refused naming the setting."""

from __future__ import annotations

import pytest

from factory.core.rollout.engines.kv_budget import SETTING, KVBudget
from factory.core.rollout.engines.paged.blocks import BlockManager
from tests.core.paged_machine import MACHINE_SETTINGS, PER_TOKEN, BlockMachine

TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = MACHINE_SETTINGS


def manager(pages: int, page_size: int = 4) -> BlockManager:
    return BlockManager(KVBudget(pages * page_size * PER_TOKEN, PER_TOKEN), page_size)


def test_a_group_shares_its_full_prompt_pages_and_copies_the_partial_one():
    mgr = manager(20)
    parent = mgr.admit("a", prompt_tokens=10, final_length=14)  # pages of 4: two full, one with 2 positions
    copies = [mgr.fork("a", f"a{i}") for i in range(1, 4)]
    assert [c[0] for c in copies] == [parent[2]] * 3 and len({c[1] for c in copies}) == 3
    assert all(mgr.block_table(f"a{i}")[:2] == parent[:2] for i in range(1, 4))
    assert [mgr.refcount(p) for p in parent] == [4, 4, 1]
    assert mgr.used_pages == 2 + 4 and mgr.committed == 2 + 4 * 2  # each sample grows to 4 pages of its own 2
    slots = [mgr.append(s) for s in ("a", "a1", "a2", "a3")]  # position 10: the private third page, no new page
    assert mgr.used_pages == 6 and [s // 4 for s in slots] == [parent[2], *(c[1] for c in copies)]
    for s in ("a", "a1", "a2", "a3"):
        mgr.free(s)
    assert mgr.free_pages == 20 and mgr.committed == 0


def test_admission_waits_for_pages_and_succeeds_after_a_free():
    mgr = manager(10)
    assert mgr.can_admit(8, 20)  # 5 pages to finish
    mgr.admit("a", 8, 20)
    assert mgr.used_pages == 2 and mgr.committed == 5  # it holds 2 pages and may take 3 more
    assert mgr.can_admit(4, 20) and not mgr.can_admit(4, 24)  # 5 pages fit beside it, 6 do not
    mgr.admit("b", 4, 20)
    assert not mgr.can_admit(1, 1)  # every page is promised to a and b, though 7 are still free
    assert mgr.free_pages == 7
    with pytest.raises(RuntimeError, match="check can_admit"):
        mgr.admit("c", 1, 1)
    mgr.free("a")
    assert mgr.can_admit(4, 20) and mgr.admit("c", 4, 20)


def test_a_request_that_can_never_fit_gets_the_message_naming_the_setting():
    mgr = manager(10)
    assert mgr.problem(8, 40) is None  # all 10 pages
    message = mgr.problem(8, 41)
    assert message is not None and SETTING in message and "11 pages of 4 tokens" in message
    group = mgr.problem(8, 24, samples=3)  # 6 + 2 x 4 pages
    assert group is not None and "14 pages" in group and "3 samples" in group and SETTING in group
    assert not mgr.can_admit(8, 41)


def test_budget_rounds_down_to_whole_pages_and_misuse_raises():
    mgr = BlockManager(KVBudget(10 * 16 * 100 - 1, 100), page_size=16)
    assert mgr.num_pages == 9
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(KVBudget(100, 1), page_size=0)
    mgr.admit("a", 3, 4)
    with pytest.raises(KeyError, match="already admitted"):
        mgr.admit("a", 3, 4)
    with pytest.raises(ValueError, match="prompt_tokens <= final_length"):
        mgr.admit("b", 5, 4)
    mgr.append("a")
    with pytest.raises(RuntimeError, match="final length"):
        mgr.append("a")
    with pytest.raises(KeyError, match="no sequence"):
        mgr.free("b")


def test_the_prefix_cache_reuses_a_freed_prompts_pages_until_they_are_handed_out_or_the_weights_change():
    mgr = BlockManager(KVBudget(6 * 4 * PER_TOKEN, PER_TOKEN), page_size=4, prefix_cache=True)
    turn1 = list(range(10))  # pages [0..3] [4..7] [8, 9]
    first = mgr.admit("t1", 10, 12, token_ids=turn1)
    assert mgr.cached_tokens("t1") == 0
    mgr.append("t1", 10)
    mgr.append("t1", 11)  # the third page is full now: it names the prefix 0..11
    mgr.free("t1")
    turn2 = [*range(12), 20, 21, 22]  # the next turn: the conversation so far, then more
    assert mgr.can_admit(15, 16, token_ids=turn2)
    second = mgr.admit("t2", 15, 16, token_ids=turn2)
    assert second[:3] == first and mgr.cached_tokens("t2") == 12 and mgr.used_pages == 4
    assert mgr.admit("t3", 15, 16, token_ids=turn2)[:3] == first  # a live page: shared, no page taken
    assert mgr.refcount(first[0]) == 2 and mgr.used_pages == 5
    mgr.free("t2")
    mgr.free("t3")
    mgr.flush_prefix_cache()  # new weights: the old K/V are another policy's
    mgr.admit("t4", 15, 16, token_ids=turn2)
    assert mgr.cached_tokens("t4") == 0
    # the page of a prompt's last token is computed even when cached, for its logits
    mgr = BlockManager(KVBudget(6 * 4 * PER_TOKEN, PER_TOKEN), page_size=4, prefix_cache=True)
    mgr.admit("a", 8, 8, token_ids=list(range(8)))
    mgr.admit("b", 8, 8, token_ids=list(range(8)))
    assert mgr.cached_tokens("b") == 4 and mgr.used_pages == 3


def test_a_page_handed_out_again_or_filled_under_old_weights_is_never_found():
    mgr = BlockManager(KVBudget(3 * 2 * PER_TOKEN, PER_TOKEN), page_size=2, prefix_cache=True)
    mgr.admit("a", 3, 3, token_ids=[1, 2, 3])  # page 0 names the prefix [1, 2]
    mgr.free("a")
    mgr.admit("b", 6, 6, token_ids=[5] * 6)  # every page, page 0 last: it holds b's K/V now
    mgr.free("b")
    mgr.admit("c", 3, 3, token_ids=[1, 2, 3])
    assert mgr.cached_tokens("c") == 0
    mgr = BlockManager(KVBudget(7 * 2 * PER_TOKEN, PER_TOKEN), page_size=2, prefix_cache=True)
    mgr.admit("old", 3, 6, token_ids=[1, 2, 3])
    mgr.flush_prefix_cache()
    mgr.append("old", 4)  # fills [3, 4] with the old weights' K/V
    mgr.admit("new", 3, 3, token_ids=[1, 2, 7])  # the new weights' [1, 2]
    assert not mgr.can_admit(5, 5) and mgr.can_admit(5, 5, token_ids=[1, 2, 3, 4, 5])  # "new"'s live page is free
    mgr.admit("next", 5, 5, token_ids=[1, 2, 3, 4, 5])
    assert mgr.cached_tokens("next") == 2  # [1, 2] from "new", not [3, 4] from "old"
