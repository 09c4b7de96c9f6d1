"""Folded per-step Jacobians against autograd's, one cell step at a time."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from bppsa_core.jacobians import GRUCell, LayerWeights, RNNCell

F64 = torch.float64


def weights(cell_gates: int, features: int, hidden: int, seed: int) -> LayerWeights:
    g = torch.Generator().manual_seed(seed)
    rows = cell_gates * hidden
    return LayerWeights(
        torch.randn(rows, features, generator=g, dtype=F64),
        torch.randn(rows, hidden, generator=g, dtype=F64) * 0.5,
        torch.randn(rows, generator=g, dtype=F64),
        torch.randn(rows, generator=g, dtype=F64),
    )


def step(cell, x: torch.Tensor, h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """One step through PyTorch's own cell functions."""
    if isinstance(cell, GRUCell):
        return torch.gru_cell(x, h, w.w_ih, w.w_hh, w.b_ih, w.b_hh)
    fn = torch.rnn_tanh_cell if cell.nonlinearity == "tanh" else torch.rnn_relu_cell
    return fn(x, h, w.w_ih, w.w_hh, w.b_ih, w.b_hh)


@pytest.mark.parametrize("cell", [RNNCell("tanh"), RNNCell("relu"), GRUCell()], ids=["tanh", "relu", "gru"])
@pytest.mark.parametrize("hidden", [1, 5])
def test_chain_elements_are_the_step_jacobians(cell, hidden: int) -> None:
    steps, batch, features = 4, 3, 2
    w = weights(cell.gates, features, hidden, seed=hidden)
    x = torch.randn(steps, batch, features, dtype=F64)
    h = [torch.randn(batch, hidden, dtype=F64)]
    for t in range(steps):
        h.append(step(cell, x[t], h[-1], w))
    hs = torch.stack(h[1:])
    h_prev = torch.stack(h[:-1])
    elements = cell.chain(cell.factors(x, h_prev, hs, w), w).dense()
    assert elements.shape == (steps, batch, hidden, hidden)
    for t in range(steps):
        for b in range(batch):
            one = x[t, b : b + 1]
            jac = torch.autograd.functional.jacobian(
                lambda hp, one=one: step(cell, one, hp.unsqueeze(0), w)[0], h_prev[t, b]
            )
            assert rel_err(jac, elements[t, b]) < 1e-12, (t, b)


def test_unknown_nonlinearity_is_named() -> None:
    with pytest.raises(ValueError, match="unknown nonlinearity 'sigmoid'; accepted: tanh, relu"):
        RNNCell("sigmoid")


def test_layer_grads_consume_the_deltas_block_by_block_and_sum_them_exactly() -> None:
    from bppsa_core.jacobians import layer_grads

    g = torch.Generator().manual_seed(0)
    steps, batch, features, hidden = 5000, 4, 3, 5
    w = weights(3, features, hidden, seed=3)
    x = torch.randn(steps, batch, features, generator=g, dtype=F64)
    h_prev = torch.randn(steps, batch, hidden, generator=g, dtype=F64)
    gi = torch.randn(steps, batch, 3 * hidden, generator=g, dtype=F64)
    gh = torch.randn(steps, batch, 3 * hidden, generator=g, dtype=F64)
    asked = []

    def deltas(t: slice):
        asked.append(t)
        return gi[t], gh[t]

    dx, dw = layer_grads(deltas, x, h_prev, w)
    assert len(asked) > 1 and sum(len(range(steps)[t]) for t in asked) == steps  # blocks, each step once
    flat = lambda t: t.flatten(0, -2)  # noqa: E731
    assert rel_err(flat(gi).t() @ flat(x), dw.w_ih) < 1e-12
    assert rel_err(flat(gh).t() @ flat(h_prev), dw.w_hh) < 1e-12
    assert rel_err(flat(gi).sum(0), dw.b_ih) < 1e-12 and rel_err(flat(gh).sum(0), dw.b_hh) < 1e-12
    assert rel_err(gi @ w.w_ih, dx) < 1e-12
