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
* ``preactivation_grads``: from g_t = dL/dh_t of a block of steps (which it may overwrite: the
  scan's output is scratch by then) and the block's factors, the gradients of the input-side and
  hidden-side pre-activations, from which every weight, bias and input gradient follows by GEMMs
  (``layer_grads``, block by block over time).

PyTorch's gate layouts are used throughout: RNN ``h' = f(W_ih x + b_ih + W_hh h + b_hh)``; GRU rows
(r, z, n), ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h' = (1 - z) * n + z * h``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from bppsa_core.chain import FactoredChain

# Bytes of temporaries the per-step work may use per block of time steps (GRUCell.factors and
# layer_grads work block by block, so that the temporaries stay in the CPU's cache).
_BLOCK_BYTES = 8 << 20


def _block_steps(bytes_per_step: int) -> int:
    """Time steps per block of work that touches ``bytes_per_step`` bytes per step."""
    return max(1, _BLOCK_BYTES // bytes_per_step)


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
        """The Jacobians' scales (T, B, 3, H), their diagonal z and dn = (1-z)(1-n^2), for all steps.

        The gates r, z, n and m = W_hn h + b_hn are recomputed from the two pre-activation GEMMs, and
        every factor is computed once, in few passes: the scales serve the chain and the
        pre-activation gradients alike (in W_hh's row order r, z, n):

            c = dn m r (1-r),   d = (h_prev - n) z (1-z),   a = dn r.
        """
        steps, batch, hidden = h_prev.shape
        scales = h_prev.new_empty((steps, batch, 3, hidden))
        z, dn = torch.empty_like(h_prev), torch.empty_like(h_prev)
        # In blocks of time steps: the pre-activations and temporaries (about 14 H numbers per step
        # and sample) stay in the CPU's cache, and only the factors go to memory.
        block = _block_steps(14 * hidden * batch * h_prev.element_size())
        for s in range(0, steps, block):
            t = slice(s, s + block)
            self._factors(x[t], h_prev[t], w, scales[t], z[t], dn[t])
        return scales, z, dn

    def _factors(
        self, x: Tensor, h_prev: Tensor, w: LayerWeights, scales: Tensor, z: Tensor, dn: Tensor
    ) -> None:
        """``factors`` of a block of steps, written into ``scales``, ``z`` and ``dn``."""
        gi, gh = self.pre_activations(x, h_prev, w)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, m = gh.chunk(3, dim=-1)
        r = torch.sigmoid_(i_r + h_r)
        torch.sigmoid(i_z + h_z, out=z)
        n = torch.tanh_(torch.addcmul(i_n, r, m))
        one_minus_z = torch.rsub(z, 1.0)
        torch.mul(n, n, out=dn).neg_().add_(1.0).mul_(one_minus_z)
        c, d, a = scales.unbind(-2)
        torch.mul(dn, r, out=a)
        torch.mul(a, m, out=c).mul_(torch.rsub(r, 1.0))
        torch.sub(h_prev, n, out=d).mul_(z).mul_(one_minus_z)

    def chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> FactoredChain:
        """Elements of the GRU Jacobian (docs/DESIGN.md), t = 1..T, in W_hh's own row order r, z, n:

        dh'/dh = diag(c) W_hr + diag(d) W_hz + diag(a) W_hn + diag(z).

        The weights are W_hh reshaped (a view, not a copy); the Triton kernels read them in this order too.
        """
        scales, z, _ = factors
        hidden = w.w_hh.shape[1]
        return FactoredChain(scales, w.w_hh.reshape(3, hidden, hidden), z)

    def preactivation_grads(self, g: Tensor, factors: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """Gradients of W_ih x + b_ih (rows r, z, n) and of W_hh h + b_hh (rows r, z, n).

        The hidden side is g times the Jacobians' scales, (d_r, d_z, d_n r); the input side differs in
        its n rows, d_n = g dn.
        """
        scales, _, dn = factors
        hidden_side = g.unsqueeze(-2) * scales
        input_side = hidden_side.clone()
        torch.mul(g, dn, out=input_side[..., 2, :])
        return input_side.flatten(-2), hidden_side.flatten(-2)


Cell = RNNCell | GRUCell


Deltas = Callable[[slice], tuple[Tensor, Tensor]]


def layer_grads(
    deltas: Deltas,
    x: Tensor,
    h_prev: Tensor,
    w: LayerWeights,
    need_input: bool = True,
) -> tuple[Tensor | None, LayerWeights]:
    """Input and parameter gradients from the pre-activation gradients of all (T, B) steps.

    ``deltas(steps)`` gives the input-side and hidden-side pre-activation gradients of a slice of
    time steps. They are made and consumed block by block, so they never all exist at once and
    each block's stay in the CPU's cache between the two: dW_ih += gi^T x, dW_hh += gh^T h_{t-1},
    the biases' sums, and the input gradient gi @ W_ih of the block, all GEMMs.
    """
    steps, batch, hidden = h_prev.shape
    rows = w.w_ih.shape[0]  # gates x H
    # per step and sample: both deltas and their making (4 rows), the input and the previous state
    block = _block_steps(batch * (4 * rows + x.shape[-1] + hidden) * x.element_size())
    d_w_ih, d_w_hh = torch.zeros_like(w.w_ih), torch.zeros_like(w.w_hh)
    d_b_ih = None if w.b_ih is None else torch.zeros_like(w.b_ih)
    d_b_hh = None if w.b_hh is None else torch.zeros_like(w.b_hh)
    dx = x.new_empty((*x.shape[:-1], w.w_ih.shape[1])) if need_input else None
    shared = False
    for s in range(0, steps, block):
        t = slice(s, s + block)
        gi, gh = deltas(t)
        shared = gh is gi  # an RNN: both sides share one pre-activation
        gi2, gh2 = gi.flatten(0, -2), gh.flatten(0, -2)
        d_w_ih.addmm_(gi2.t(), x[t].flatten(0, -2))
        d_w_hh.addmm_(gh2.t(), h_prev[t].flatten(0, -2))
        if d_b_ih is not None:
            d_b_ih += gi2.sum(0)
        if d_b_hh is not None and not shared:
            d_b_hh += gh2.sum(0)
        if dx is not None:
            torch.matmul(gi, w.w_ih, out=dx[t])
    if d_b_hh is not None and shared:  # summed once, copied (H,)
        d_b_hh = d_b_ih.clone() if d_b_ih is not None else _sum_shared(deltas, steps, block)
    return dx, LayerWeights(d_w_ih, d_w_hh, d_b_ih, d_b_hh)


def _sum_shared(deltas: Deltas, steps: int, block: int) -> Tensor:
    """The bias gradient of a shared pre-activation when there is no input-side bias to copy."""
    return sum(deltas(slice(s, s + block))[0].flatten(0, -2).sum(0) for s in range(0, steps, block))
