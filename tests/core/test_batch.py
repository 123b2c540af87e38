"""Packing (prompt, completion) pairs: masks and per-token values land on the completion targets."""

import pytest
import torch

from factory.core.batch import pack


def test_pack_aligns_targets():
    b = pack([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]], pad_id=0, completion_values={"v": [[.1, .2], [.3, .4, .5]]},
             per_seq={"adv": [1.0, -1.0]})
    assert b.input_ids.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    # target column t predicts input position t + 1
    assert b.loss_mask.tolist() == [[False, False, True, True], [False, True, True, True]]
    assert torch.allclose(b.per_token["v"], torch.tensor([[0, 0, .1, .2], [0, .3, .4, .5]]))
    assert b.n_tokens == 5 and b.per_seq["adv"].tolist() == [1.0, -1.0]
    sub = b.select(torch.tensor([1]))
    assert sub.input_ids.tolist() == [[1, 7, 9, 9, 2]] and len(sub) == 1


def test_pack_rejects_mismatched_values():
    with pytest.raises(ValueError, match="v\\[0\\] has 1 values for 2 completion tokens"):
        pack([[1]], [[2, 3]], 0, {"v": [[0.5]]})
