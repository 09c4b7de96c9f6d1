"""Peak memory of the backward: the layers never hold a dense (T, B, H, H) Jacobian chain; and of the
forward in segments, which holds its outputs once.

Measured in a child process (``helpers.run_child``): the peak resident set during the backward (or
forward) less the resident set before it; the dense chain would be 250 MiB.
"""

from __future__ import annotations

import pytest
from helpers import run_child

STEPS, BATCH, HIDDEN = 2000, 8, 64
DENSE_BYTES = STEPS * BATCH * HIDDEN * HIDDEN * 4

CHILD = f"""
import sys, torch
from bppsa_core import nn as bnn
torch.manual_seed(0)
cls = bnn.GRU if sys.argv[1] == "gru" else bnn.RNN
rnn = cls(4, {HIDDEN}, strategy=sys.argv[2])
out, h_n = rnn(torch.randn({STEPS}, {BATCH}, 4))
loss = h_n.sum()
before = rss_bytes()
reset_peak()
loss.backward()
print(peak_bytes() - before)
"""


def backward_peak(kind: str, strategy: str) -> int:
    return int(run_child(CHILD, kind, strategy))


@pytest.mark.extended
@pytest.mark.parametrize(("kind", "bound"), [("rnn", 0.25), ("gru", 0.5)])
def test_chunked_backward_stays_far_below_one_dense_chain(kind: str, bound: float) -> None:
    # Measured: 0.14 (RNN) and 0.28 (GRU, whose per-step vectors are several times the RNN's).
    assert backward_peak(kind, "chunked") < bound * DENSE_BYTES


def test_blelloch_backward_holds_at_most_about_one_dense_chain() -> None:
    peak = backward_peak("rnn", "blelloch")
    # Its up-sweep levels do hold dense products, n/2 + n/4 + ... < n: the measurement sees them ...
    assert peak > DENSE_BYTES / 2
    # ... and they stay within one H x H element per (step, sample), plus a slab of temporaries.
    assert peak < 1.15 * DENSE_BYTES


LONG = """
import sys, torch
from bppsa_core import nn as bnn
torch.manual_seed(0)
cls = {"rnn": bnn.RNN, "gru": bnn.GRU, "lstm": bnn.LSTM}[sys.argv[1]]
steps = int(sys.argv[2])
rnn = cls(1, 20)
out, _ = rnn(torch.randn(steps, 1, 1))
loss = out[-1].sum()
before = rss_bytes()
reset_peak()
loss.backward()
print(peak_bytes() - before)
"""


@pytest.mark.extended
@pytest.mark.parametrize(("kind", "bound"), [("rnn", 3), ("gru", 3), ("lstm", 3)])
def test_a_million_steps_back_propagate_in_memory_linear_in_the_states(kind: str, bound: int) -> None:
    """T = 1,000,000, B = 1, H = 20 on the CPU: the backward's peak, counted in units of the layer's
    states (T * B * H floats), stays a small constant: no T x H x H chain, no per-step overhead, no
    step's deltas all at once (an LSTM's alone would be 4 units); the compiled kernels walked block
    by block hold little more than the outputs' gradient autograd hands in (docs/PERFORMANCE.md,
    "A million steps")."""
    steps = 1_000_000
    unit = steps * 1 * 20 * 4
    assert int(run_child(LONG, kind, str(steps))) < bound * unit


SEGMENTS = """
import sys, torch
from bppsa_core.layer import native_forward
torch.manual_seed(0)
rnn = torch.nn.RNN(1, 20)
x, h0 = torch.randn(200_000, 4, 1), torch.zeros(4, 20)
weights = [p.detach() for p in rnn._flat_weights]
before = rss_bytes()
reset_peak()
with torch.no_grad():
    out, _, _ = native_forward(
        "RNN_TANH", x, h0, None, weights, None, segment=10_000, batch_major=sys.argv[1] == "batch-major"
    )
print((peak_bytes() - before) / out.nbytes)
"""


@pytest.mark.extended
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_a_forward_in_segments_holds_its_outputs_once(layout: str) -> None:
    """Each segment's outputs go into the whole sequence's as they are made, in either layout.
    Measured: 1.4 times the outputs (2.3 when the segments were kept until the end and then
    joined)."""
    assert float(run_child(SEGMENTS, layout)) < 1.8
