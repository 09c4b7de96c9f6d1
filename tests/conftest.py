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

# One thread, as run.py's jobs take on a CPU: the compiled kernels' serial builds, each compiled once
# for the whole run (a first compile costs seconds). The tests about threads set two themselves.
torch.set_num_threads(1)

settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")
