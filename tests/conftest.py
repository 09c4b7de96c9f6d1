"""pytest set-up: Triton's interpreter where there is no GPU, and the hypothesis profile.

Helpers the tests share are in ``tests/helpers.py``.
"""

from __future__ import annotations

import os

import torch
from hypothesis import settings

# Triton kernels run in Triton's interpreter where there is no GPU (CI): set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")
