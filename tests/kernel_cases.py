"""Cases the kernel tests share (Triton's and numba's): inputs of a chunked scan or a fused layer
backward, and what the plain-PyTorch twin (``scan.chunked_scan`` with ``jacobians``) gives for them."""

from __future__ import annotations

import torch

from bppsa_core.chain import FactoredChain
from bppsa_core.jacobians import GRUCell, LayerWeights, LSTMCell, RNNCell
from bppsa_core.scan import chunked_scan

CHAIN_CASES = [
    (n, batch, hidden, chunk, affine, terms)
    for n in (2, 5, 37)
    for batch, hidden in ((1, 1), (3, 5), (2, 20))
    for chunk in (1, 4)
    for affine in (False, True)
    for terms in (1, 3)
]
CHAIN_ARGS = ("n", "batch", "hidden", "chunk", "affine", "terms")


def chain_case(
    n: int, batch: int, hidden: int, affine: bool, terms: int, dtype: torch.dtype = torch.float32
) -> tuple[FactoredChain, torch.Tensor, torch.Tensor | None]:
    """terms=1: an RNN's chain; terms=3: a GRU's (three weights and a diagonal). Elements of odd n
    are shared by the batch (batch dimension 1), to check the kernels' broadcast reads. Returns the
    chain, x_last and the offsets (None unless ``affine``)."""
    g = torch.Generator().manual_seed(n * 100 + hidden + terms)
    bm = 1 if n % 2 == 1 and batch > 1 else batch
    s = torch.rand(n, bm, terms, hidden, generator=g, dtype=dtype)
    w = torch.randn(terms, hidden, hidden, generator=g, dtype=dtype) / (terms * hidden) ** 0.5
    e = torch.rand(n, bm, hidden, generator=g, dtype=dtype) if terms > 1 else None
    x = torch.randn(batch, hidden, generator=g, dtype=dtype)
    b = torch.randn(n, batch, hidden, generator=g, dtype=dtype) if affine else None
    return FactoredChain(s, w, e), x, b


def fused_rnn_case(
    nonlinearity: str,
    n: int,
    batch: int,
    hidden: int,
    chunk: int,
    outside: bool,
    dtype: torch.dtype,
    non_finite: bool = False,
) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """The arguments (h, w_hh, g_last, u) of a fused RNN layer backward, and the twin's g_0 and
    deltas f'(z_t) * g_t (``RNNCell``'s factors, read off h, scanned); ``non_finite``: a relu's
    outputs with a NaN and an inf (what an infinite input leaves), through which autograd passes the
    gradient."""
    g = torch.Generator().manual_seed(n + hidden)
    h = torch.rand(n, batch, hidden, generator=g, dtype=dtype) * 2 - 1  # tanh outputs: (-1, 1)
    h = h if nonlinearity == "tanh" else h.clamp_min(0)
    if non_finite:
        h[n // 2, 0, 0], h[n // 2 + 1, -1, -1] = float("nan"), float("inf")
    w = torch.randn(hidden, hidden, generator=g, dtype=dtype) / hidden**0.5
    g_last = torch.randn(batch, hidden, generator=g, dtype=dtype)
    u = torch.randn(n, batch, hidden, generator=g, dtype=dtype) if outside else None
    cell, weights = RNNCell(nonlinearity), LayerWeights(torch.empty(hidden, 0, dtype=dtype), w)
    factors = cell.factors(h, h, h, weights)  # an RNN's factors read h alone
    x = chunked_scan(cell.chain(factors, weights), g_last, _shifted(u), chunk=chunk)
    return (h, w, g_last, u), (x[0], cell.preactivation_grads(x[1:].clone(), factors)[0])


def _gated_layer(
    n: int, batch: int, hidden: int, gates: int, dtype: torch.dtype
) -> tuple[torch.Generator, LayerWeights, torch.Tensor, torch.Tensor]:
    """A fused GRU or LSTM case's generator, then its weights, inputs (2 features) and h_0..h_{T-1}
    drawn from it."""
    g = torch.Generator().manual_seed(n + hidden)
    rows = gates * hidden
    shapes = ((rows, 2), (rows, hidden), (rows,), (rows,))
    w = LayerWeights(*(torch.randn(*s, generator=g, dtype=dtype) / hidden**0.5 for s in shapes))
    x = torch.randn(n, batch, 2, generator=g, dtype=dtype)
    h_prev = torch.rand(n, batch, hidden, generator=g, dtype=dtype) * 2 - 1
    return g, w, x, h_prev


def _shifted(u: torch.Tensor | None) -> torch.Tensor | None:
    """A layer chain's offsets from the outside gradients: u_{k-1} at element k (none at 0)."""
    return None if u is None else torch.cat((torch.zeros_like(u[:1]), u[:-1]))


def fused_gru_case(
    n: int, batch: int, hidden: int, chunk: int, outside: bool, dtype: torch.dtype
) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The arguments (gi, gh, h_prev, w_hh, g_last, u) of a fused GRU layer backward, and the twin's
    g_0 and input- and hidden-side pre-activation gradients."""
    cell = GRUCell()
    g, w, x, h_prev = _gated_layer(n, batch, hidden, 3, dtype)
    g_last = torch.randn(batch, hidden, generator=g, dtype=dtype)
    u = torch.randn(n, batch, hidden, generator=g, dtype=dtype) if outside else None
    factors = cell.factors(x, h_prev, h_prev, w)  # a GRU's factors do not read h
    twin = chunked_scan(cell.chain(factors, w), g_last, _shifted(u), chunk=chunk)
    d_in, d_hid = cell.preactivation_grads(twin[1:].clone(), factors)
    gi, gh = cell.pre_activations(x, h_prev, w)
    return (gi, gh, h_prev, w.w_hh, g_last, u), (twin[0], d_in, d_hid)


def fused_lstm_case(
    n: int, batch: int, hidden: int, chunk: int, outside: bool, dtype: torch.dtype
) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """The arguments (gates, cells, w_hh, g_h, g_c, u) of a fused LSTM layer backward, and the twin's
    g_0 and pre-activation gradients (``LSTMCell``'s factors from x and h_{t-1}, scanned)."""
    cell = LSTMCell()
    g, w, x, h_prev = _gated_layer(n, batch, hidden, 4, dtype)
    c0 = torch.randn(batch, hidden, generator=g, dtype=dtype)
    g_h, g_c = (torch.randn(batch, hidden, generator=g, dtype=dtype) for _ in range(2))
    u = torch.randn(n, batch, hidden, generator=g, dtype=dtype) if outside else None
    factors = cell.factors(x, h_prev, h_prev, w, c0)  # an LSTM's factors do not read h
    offsets = None if u is None else torch.cat((_shifted(u), torch.zeros_like(u)), -1)  # to h only
    twin = chunked_scan(cell.chain(factors, w), torch.cat((g_h, g_c), -1), offsets, chunk=chunk)
    delta = cell.preactivation_grads(twin[1:].clone(), factors)[0]
    gates = cell.activations(x, h_prev, w)
    cells = torch.cat((c0.unsqueeze(0), cell.cell_states(x, h_prev, w, c0)))
    return (gates, cells, w.w_hh, g_h, g_c, u), (twin[0], delta)
