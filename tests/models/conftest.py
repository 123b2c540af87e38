"""Fixtures for tests/models: a small HF model directory with a real byte-level BPE tokenizer, built once; the S3
server (tests/s3_server.py) for checkpoints on an object store."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.s3_server import moto_endpoint, s3_server  # noqa: F401


@pytest.fixture(scope="session")
def bpe_model_dir(tmp_path_factory) -> Path:
    """`factory.models.bpe.build_bpe_model_dir` (seed 0): config.json, weights, tokenizer.json, chat template.
    Read-only for tests: copy it before changing anything in it."""
    import torch

    from factory.models.bpe import build_bpe_model_dir

    torch.set_num_threads(1)
    return build_bpe_model_dir(tmp_path_factory.mktemp("bpe-model") / "model", seed=0)
