"""Shared by the trainer's tests: random weights large enough that a tiny model's log-probs spread."""

from __future__ import annotations

import torch


def spread_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every matrix of `model` drawn from N(0, 0.2) (seeded); returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2, generator=g)
    return model
