"""Seeded epoch orders: bijective block permutations, every row once per epoch, constant-time lookup."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.shuffle import EpochOrder, FeistelPermutation, mix64, name_key


@pytest.mark.slow
@given(n=st.integers(1, 600), key=st.integers(0, 2**64 - 1))
@settings(max_examples=150, deadline=None)
def test_feistel_is_a_bijection_with_its_inverse(n: int, key: int) -> None:
    p = FeistelPermutation(n, key)
    images = [p(x) for x in range(n)]
    assert sorted(images) == list(range(n))
    assert [p.inverse(y) for y in images] == list(range(n))


def test_feistel_depends_on_the_key() -> None:
    n = 1000
    a, b = FeistelPermutation(n, 1), FeistelPermutation(n, 2)
    assert [a(x) for x in range(n)] != [b(x) for x in range(n)]
    assert [a(x) for x in range(n)] != list(range(n))


@pytest.mark.slow
@given(n_rows=st.integers(1, 400), block_rows=st.integers(1, 64), key=st.integers(0, 2**32))
@settings(max_examples=150, deadline=None)
def test_an_epoch_serves_every_row_exactly_once(n_rows: int, block_rows: int, key: int) -> None:
    order = EpochOrder(n_rows, block_rows, key)
    rows = []
    perms: dict[int, list[int]] = {}
    for pos in range(n_rows):
        block, off, start = order.locate(pos)
        assert 0 <= off < order.block_len(block) and start == pos - off
        perm = perms.setdefault(block, order.row_perm(block))
        rows.append(block * block_rows + perm[off])
    assert sorted(rows) == list(range(n_rows))


def test_the_short_last_block_is_shuffled_too_and_epochs_differ() -> None:
    n_rows, block_rows = 1000, 64  # 15 full blocks and one of 40 rows
    places = {EpochOrder(n_rows, block_rows, mix64(7, e)).short_at for e in range(20)}
    assert len(places) > 1
    first = [EpochOrder(n_rows, block_rows, mix64(7, e)).locate(0)[0] for e in range(20)]
    assert len(set(first)) > 1


def test_name_key_is_stable() -> None:
    assert name_key("add2") == name_key("add2") != name_key("add3")
    assert mix64(1, 2) == mix64(1, 2) != mix64(2, 1)
