"""Shared test helpers."""

from __future__ import annotations

import torch
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of b from the reference a."""
    return ((a - b).norm() / a.norm().clamp_min(1e-300)).item()
