"""Analytic, folded transposed Jacobians of recurrent cells, and the gradients that follow the scan.

For each time step the paper stores two elements, W^T and diag(f'(z_t)). Here each pair is one
element per (step, sample), ``J_t = dh_t / dh_{t-1}``, which in the row-vector convention of
``bppsa_core.scan`` is the transposed Jacobian acting on the gradient: ``g_{t-1} = g_t @ J_t``.
The elements come as a ``FactoredChain``: the per-step diagonal factors stay (T, B, K, H) vectors
and the shared weights are never copied per sample; each product of the scan folds them on the fly
(``FactoredChain.dense`` gives the explicit matrices).

A cell supplies three things, all parallel over time and batch:

* ``factors``: the per-step vectors the Jacobians and the weight gradients need, recovered from the
  layer's input, previous states and outputs (the forward ran in PyTorch's fused kernel and kept none).
* ``chain``: the elements J_t in time order (the scan consumes them from t = T down).
* ``preactivation_grads``: from g_t = dL/dh_t (which it may overwrite: the scan's output is
  scratch by then), the gradients of the input-side and hidden-side pre-activations, from which
  every weight, bias and input gradient is one reduction or matmul (``layer_grads``).

PyTorch's gate layouts are used throughout: RNN ``h' = f(W_ih x + b_ih + W_hh h + b_hh)``; GRU rows
(r, z, n), ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h' = (1 - z) * n + z * h``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bppsa_core.chain import FactoredChain


@dataclass(frozen=True)
class LayerWeights:
    """One layer's parameters in PyTorch's names: weight_ih, weight_hh, bias_ih, bias_hh."""

    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None = None
    b_hh: Tensor | None = None


def _affine(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x @ w^T + b over all leading dimensions at once."""
    return torch.nn.functional.linear(x, w, b)


class RNNCell:
    """Elman cell ``h' = f(W_ih x + b_ih + W_hh h + b_hh)`` with f = tanh or relu."""

    gates = 1

    def __init__(self, nonlinearity: str = "tanh") -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"unknown nonlinearity {nonlinearity!r}; accepted: tanh, relu")
        self.nonlinearity = nonlinearity

    def factors(self, x: Tensor, h_prev: Tensor, h: Tensor, w: LayerWeights) -> tuple[Tensor, ...]:
        """f'(z_t), read off the outputs: 1 - h^2 for tanh, [h > 0] for relu."""
        if self.nonlinearity == "tanh":
            return (h.square().neg_().add_(1.0),)
        return ((h > 0).to(h.dtype),)

    def chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> FactoredChain:
        """Elements ``diag(f'_t) @ W_hh``, t = 1..T."""
        (fp,) = factors
        return FactoredChain(fp.unsqueeze(-2), w.w_hh.unsqueeze(0))

    def preactivation_grads(self, g: Tensor, factors: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """delta_t = f'(z_t) * g_t, written into g; input and hidden sides share the pre-activation."""
        (fp,) = factors
        delta = g.mul_(fp)
        return delta, delta


class GRUCell:
    """PyTorch's GRU cell, gates (r, z, n)."""

    gates = 3

    def pre_activations(self, x: Tensor, h_prev: Tensor, w: LayerWeights) -> tuple[Tensor, Tensor]:
        """W_ih x + b_ih and W_hh h_{t-1} + b_hh (rows r, z, n) for all steps: two large matmuls."""
        return _affine(x, w.w_ih, w.b_ih), _affine(h_prev, w.w_hh, w.b_hh)

    def factors(self, x: Tensor, h_prev: Tensor, h: Tensor, w: LayerWeights) -> tuple[Tensor, ...]:
        """Recompute r, z, n and m = W_hn h + b_hn for all steps; keep h_{t-1}."""
        gi, gh = self.pre_activations(x, h_prev, w)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, m = gh.chunk(3, dim=-1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * m)
        return r, z, n, m, h_prev

    def chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> FactoredChain:
        """Elements of the GRU Jacobian (docs/DESIGN.md), t = 1..T, in W_hh's own row order r, z, n:

        dh'/dh = diag(c) W_hr + diag(d) W_hz + diag(a) W_hn + diag(z) with
        c = (1-z)(1-n^2) m r(1-r), d = (h-n) z(1-z), a = (1-z)(1-n^2) r.

        The weights are W_hh reshaped (a view, not a copy); the Triton kernels read them in this order too.
        """
        r, z, n, m, h_prev = factors
        dn = (1.0 - z) * (1.0 - n * n)
        scales = torch.stack((dn * m * r * (1.0 - r), (h_prev - n) * z * (1.0 - z), dn * r), dim=-2)
        hidden = w.w_hh.shape[1]
        return FactoredChain(scales, w.w_hh.reshape(3, hidden, hidden), z)

    def preactivation_grads(self, g: Tensor, factors: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """Gradients of W_ih x + b_ih (rows r, z, n) and of W_hh h + b_hh (rows r, z, n)."""
        r, z, n, m, h_prev = factors
        d_n = g * (1.0 - z) * (1.0 - n * n)
        d_r = d_n * m * r * (1.0 - r)
        d_z = g * (h_prev - n) * z * (1.0 - z)
        return torch.cat((d_r, d_z, d_n), dim=-1), torch.cat((d_r, d_z, d_n * r), dim=-1)


Cell = RNNCell | GRUCell


def layer_grads(
    grad_in: Tensor,
    grad_hid: Tensor,
    x: Tensor,
    h_prev: Tensor,
    w: LayerWeights,
    need_input: bool = True,
) -> tuple[Tensor | None, LayerWeights]:
    """Input and parameter gradients from the pre-activation gradients of all (T, B) steps.

    Every sum over time and batch is one matmul: dW_ih = sum_t gi_t^T x_t, dW_hh = sum_t gh_t^T h_{t-1}.
    """
    gi = grad_in.flatten(0, -2)
    gh = grad_hid.flatten(0, -2)
    d_w_ih = gi.t() @ x.flatten(0, -2)
    d_w_hh = gh.t() @ h_prev.flatten(0, -2)
    d_b_ih = gi.sum(0) if w.b_ih is not None else None
    d_b_hh = None
    if w.b_hh is not None:  # an RNN's two biases share one pre-activation: sum once, copy (H,)
        d_b_hh = d_b_ih.clone() if grad_hid is grad_in and d_b_ih is not None else gh.sum(0)
    dx = grad_in @ w.w_ih if need_input else None
    return dx, LayerWeights(d_w_ih, d_w_hh, d_b_ih, d_b_hh)
