"""Fixtures shared by tests/core: `served`, a real rollout server of the micro model on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """(handle, server state) of a rollout server over the micro model (seed 0, max_batch 2), one per test module;
    its context length is the module's `CONTEXT` (tokens), the bound that module's prompts are sized against."""
    context = getattr(request.module, "CONTEXT", None)
    if not isinstance(context, int) or context < 1:
        raise TypeError(f"{request.module.__name__}: the `served` fixture needs a module-level CONTEXT, a positive "
                        f"int (the server's context length in tokens); got {context!r}")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tok = build_tokenizer()
    engine = ContinuousEngine(build_model("micro", tok, seed=0, max_positions=context), tok, max_batch=2,
                              name="micro")
    with launch_server(engine) as handle:
        yield handle, handle.app.state.rollout
