"""pytest set-up: Triton's interpreter where there is no GPU, the hypothesis profile, and CUDA's
graphs stood in for on a CPU (``cuda_stood_in_for``).

Helpers the tests share are in ``tests/helpers.py``.
"""

from __future__ import annotations

import contextlib
import os

import pytest
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


@pytest.fixture
def cuda_stood_in_for(monkeypatch) -> list[str]:
    """Streams, pools and graphs stood in for on a CPU: a "capture" runs its function once, a
    "replay" runs it again, a backward's from unset gradients (a captured backward writes its
    gradients, it does not add to them). Returns what ran, in order."""
    ran: list[str] = []

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def stream(*args, **kwargs):
        yield

    def capture(fn, pool):
        name = getattr(fn, "__name__", "")
        ran.append(f"capture {name}")
        fn()

        def replay():
            ran.append(name)
            if name == "_backward":
                for group in fn.__self__.optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
            fn()

        return replay

    for name, value in {"Stream": Stream, "current_stream": Stream, "stream": stream}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    from experiments import graphs

    monkeypatch.setattr(graphs, "capture", capture)
    return ran
