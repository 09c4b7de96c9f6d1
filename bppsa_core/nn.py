"""Drop-in ``torch.nn.RNN`` / ``torch.nn.GRU`` whose backward pass is a BPPSA scan.

The modules subclass PyTorch's, so constructor arguments, parameter names, ``state_dict`` and the
forward signature ``output, h_n = rnn(input, hx)`` are PyTorch's own. With ``backward="bppsa"`` the
forward still runs PyTorch's fused kernel (cuDNN on a GPU), one layer at a time so that every layer's
states are kept, and the backward is an ``autograd.Function`` that, per layer from the top:

1. recovers the per-step factors from the saved states (``bppsa_core.jacobians``),
2. forms one Jacobian per step, kept factored (``bppsa_core.chain``),
3. scans the affine chain ``g_{t-1} = g_t @ J_t + u_{t-1}`` (``bppsa_core.scan``), where u_t is the
   gradient that reaches h_t from outside: ``output``'s gradient on the top layer, the layer above's
   input gradient below it, plus ``h_n``'s gradient at the last step,
4. turns g into every input, state, weight and bias gradient with a few large matmuls.

When only ``h_n`` carries gradient (the paper's loss on the last state), ``output``'s gradient is
``None`` and the top layer's chain is the pure linear one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import PackedSequence

from bppsa_core import dispatch
from bppsa_core.denormals import flush_denormals
from bppsa_core.dispatch import ScanOptions
from bppsa_core.jacobians import Cell, GRUCell, LayerWeights, RNNCell, layer_grads
from bppsa_core.scan import scan

BACKWARDS: tuple[str, ...] = ("bppsa", "bptt")

_NATIVE = {
    "RNN_TANH": torch._VF.rnn_tanh,
    "RNN_RELU": torch._VF.rnn_relu,
    "GRU": torch._VF.gru,
}


@dataclass(frozen=True)
class _Spec:
    """What the autograd function needs to know besides tensors."""

    mode: str
    cell: Cell
    num_layers: int
    bias: bool
    options: ScanOptions

    @property
    def per_layer(self) -> int:
        return 4 if self.bias else 2

    def layer(self, weights: tuple[Tensor, ...], i: int) -> LayerWeights:
        return LayerWeights(*weights[i * self.per_layer : (i + 1) * self.per_layer])


def _native_layer(spec: _Spec, x: Tensor, h0: Tensor, w: tuple[Tensor, ...]) -> Tensor:
    """One layer of PyTorch's fused RNN/GRU forward, time-major; returns (T, B, H).

    On cuDNN, the weights of a layer after the first are a slice of the module's flattened buffer
    that cuDNN does not take as its own, so it copies them per call and warns; the warning is
    expected here and silenced (the copy is a few KB for the paper's sizes).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not part of single contiguous chunk of memory.*")
        out, _ = _NATIVE[spec.mode](x, h0.unsqueeze(0), list(w), spec.bias, 1, 0.0, False, False, False)
    return out


class _ScanBackward(torch.autograd.Function):
    """Forward: PyTorch's fused kernels, layer by layer. Backward: BPPSA."""

    @staticmethod
    def forward(ctx: Any, spec: _Spec, x: Tensor, h0: Tensor, *weights: Tensor) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        outs = []
        inp = x
        for i in range(spec.num_layers):
            w = weights[i * spec.per_layer : (i + 1) * spec.per_layer]
            inp = _native_layer(spec, inp, h0[i], w)
            outs.append(inp)
        h_n = torch.stack([o[-1] for o in outs])
        ctx.spec = spec
        ctx.save_for_backward(x, h0, *weights, *outs)
        return outs[-1], h_n

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor | None, grad_hn: Tensor | None) -> tuple[Tensor | None, ...]:
        with flush_denormals(ctx.saved_tensors[0].device):  # scans and gradient GEMMs: see denormals
            return _ScanBackward._backward(ctx, grad_out, grad_hn)

    @staticmethod
    def _backward(ctx: Any, grad_out: Tensor | None, grad_hn: Tensor | None) -> tuple[Tensor | None, ...]:
        spec: _Spec = ctx.spec
        x, h0, *rest = ctx.saved_tensors
        n_w = spec.num_layers * spec.per_layer
        weights, outs = tuple(rest[:n_w]), rest[n_w:]
        # Under autocast the forward kept lower-precision states; the backward runs in the weights'
        # dtype (autograd casts each returned gradient back to its input's dtype).
        dtype = weights[0].dtype
        x, h0, outs = x.to(dtype), h0.to(dtype), [o.to(dtype) for o in outs]
        grad_out = None if grad_out is None else grad_out.to(dtype)
        grad_hn = None if grad_hn is None else grad_hn.to(dtype)
        grad_w: list[Tensor | None] = [None] * n_w
        grad_h0 = [None] * spec.num_layers
        u = grad_out  # gradient reaching each h_t of the current layer from outside
        for i in reversed(range(spec.num_layers)):
            w = spec.layer(weights, i)
            inp = x if i == 0 else outs[i - 1]
            h = outs[i]
            h_prev = torch.cat((h0[i : i + 1], h[:-1]))
            last = None if grad_hn is None else grad_hn[i]
            fused = _fused_layer(spec, inp, h_prev, h, w, u, last)
            if fused is not None:
                grad_h0[i], g_in, g_hid = fused

                def deltas(t: slice, g_in=g_in, g_hid=g_hid) -> tuple[Tensor, Tensor]:
                    return g_in[t], g_hid[t]

            else:
                factors = spec.cell.factors(inp, h_prev, h, w)
                g = _state_grads(spec, factors, w, u, last, h)
                grad_h0[i] = g[0]

                def deltas(t: slice, g=g[1:], factors=factors) -> tuple[Tensor, Tensor]:
                    return spec.cell.preactivation_grads(g[t], tuple(f[t] for f in factors))

            need_input = i > 0 or ctx.needs_input_grad[1]
            u, dw = layer_grads(deltas, inp, h_prev, w, need_input)
            grad_w[i * spec.per_layer : (i + 1) * spec.per_layer] = [
                t for t in (dw.w_ih, dw.w_hh, dw.b_ih, dw.b_hh) if t is not None
            ]
        d_x = u if ctx.needs_input_grad[1] else None
        d_h0 = torch.stack(grad_h0) if ctx.needs_input_grad[2] else None
        return (None, d_x, d_h0, *grad_w)


def _state_grads(
    spec: _Spec,
    factors: tuple[Tensor, ...],
    w: LayerWeights,
    u: Tensor | None,
    u_last: Tensor | None,
    h: Tensor,
) -> Tensor:
    """g_t = dL/dh_t for t = 0..T of one layer, by scanning its Jacobian chain from the end.

    ``u`` (T, B, H) is the gradient reaching h_1..h_T from outside the layer, ``u_last`` the extra
    gradient on h_T (from h_n); either may be None.
    """
    offsets = None
    if u is not None:  # u_0 = 0 (nothing reaches h_0 from outside), u_1, ..., u_{T-1}
        offsets = torch.cat((torch.zeros_like(u[:1]), u[:-1]))
    chain = spec.cell.chain(factors, w)
    start = _last_grad(u, u_last, h)
    o = spec.options
    return scan(chain, start, offsets, strategy=o.strategy, chunk=o.chunk, levels=o.levels)


def _last_grad(u: Tensor | None, u_last: Tensor | None, h: Tensor) -> Tensor:
    """dL/dh_T: what reaches the last state from the outputs and from h_n."""
    parts = [t for t in (None if u is None else u[-1], u_last) if t is not None]
    return sum(parts[1:], parts[0]) if parts else torch.zeros_like(h[-1])


def _fused_layer(
    spec: _Spec,
    x: Tensor,
    h_prev: Tensor,
    h: Tensor,
    w: LayerWeights,
    u: Tensor | None,
    u_last: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """g_0 and the input- and hidden-side pre-activation gradients of a layer from the fused Triton
    kernels (``triton_scan.rnn_layer_backward`` / ``gru_layer_backward``), or None.

    Taken where the layer's strategy resolves to "triton" (``dispatch.resolve``: "triton" itself,
    or "auto" on a GPU) and the kernels take the layer and run on its device; everything else goes
    through ``scan``, which also gives "triton"'s error messages.
    """
    steps, batch, hidden = h.shape
    fits = dispatch.kernels_take(spec.cell.gates, hidden, h.dtype, w.w_hh.dtype)
    strategy = spec.options.strategy
    chosen = dispatch.resolve(strategy, steps, batch, hidden, h.device, fits)
    if chosen != "triton" or not fits or not dispatch.kernels_run_on(h.device):
        return None
    from bppsa_core import triton_scan

    chunk = spec.options.chunk or dispatch.default_chunk(steps)
    g_last = _last_grad(u, u_last, h)

    def kernels() -> tuple[Tensor, Tensor, Tensor]:
        if isinstance(spec.cell, RNNCell):
            g0, delta = triton_scan.rnn_layer_backward(h, w.w_hh, g_last, u, spec.cell.nonlinearity, chunk)
            return g0, delta, delta
        gi, gh = spec.cell.pre_activations(x, h_prev, w)
        return triton_scan.gru_layer_backward(gi, gh, h_prev, w.w_hh, g_last, u, chunk)

    return dispatch.with_kernels(strategy, h.device, kernels, lambda: None)


class _BPPSAMixin:
    """Shared by RNN and GRU: option checks and the forward that routes through the scan."""

    def __init__(
        self,
        *args: Any,
        backward: str = "bppsa",
        strategy: str = "auto",
        chunk: int | None = None,
        levels: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)  # torch.nn.RNN / GRU: its arguments, parameters and checks
        if backward not in BACKWARDS:
            raise ValueError(f"unknown backward {backward!r}; accepted: {', '.join(BACKWARDS)}")
        ScanOptions(strategy, chunk, levels)  # checked now, and again at every forward (_spec)
        if backward == "bppsa":
            unsupported = {
                "bidirectional=True": self.bidirectional,
                f"dropout={self.dropout} between layers": self.dropout > 0 and self.num_layers > 1,
            }
            for what, bad in unsupported.items():
                if bad:
                    raise ValueError(f"{what} is not supported by backward='bppsa' yet; use backward='bptt'")
        self.backward_mode = backward
        self.strategy, self.chunk, self.levels = strategy, chunk, levels

    def _spec(self) -> _Spec:
        cell: Cell = GRUCell() if self.mode == "GRU" else RNNCell(self.nonlinearity)
        options = ScanOptions(self.strategy, self.chunk, self.levels)
        return _Spec(self.mode, cell, self.num_layers, self.bias, options)

    def forward(self, input: Tensor | PackedSequence, hx: Tensor | None = None) -> tuple[Any, Tensor]:
        """Same contract as ``torch.nn.RNN.forward``; the backward is BPPSA in ``bppsa`` mode."""
        if self.backward_mode == "bptt":
            return super().forward(input, hx)
        if isinstance(input, PackedSequence):
            raise ValueError(
                "packed sequences are not supported by backward='bppsa' yet; pad them "
                "(torch.nn.utils.rnn.pad_packed_sequence) or use backward='bptt'"
            )
        self._update_flat_weights()  # weights swapped by functional_call or a parametrization
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad
            or (hx is not None and hx.requires_grad)
            or any(p.requires_grad for p in self._flat_weights)
        )
        if not needs_grad:  # inference: the same fused kernel, nothing to scan
            return super().forward(input, hx)
        unbatched = input.dim() == 2
        if unbatched:
            input = input.unsqueeze(0 if self.batch_first else 1)
            hx = None if hx is None else hx.unsqueeze(1)
        if hx is None:
            batch = input.shape[0 if self.batch_first else 1]
            hx = input.new_zeros(self.num_layers, batch, self.hidden_size)
        self.check_forward_args(input, hx, None)
        x = input.transpose(0, 1) if self.batch_first else input
        out, h_n = _ScanBackward.apply(self._spec(), x, hx, *self._flat_weights)
        if self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out, h_n = out.squeeze(0 if self.batch_first else 1), h_n.squeeze(1)
        return out, h_n

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", backward={self.backward_mode!r}"
        if self.backward_mode == "bppsa":
            s += f", strategy={self.strategy!r}, chunk={self.chunk}, levels={self.levels}"
        return s


class RNN(_BPPSAMixin, torch.nn.RNN):
    """``torch.nn.RNN`` with ``backward="bppsa"`` (default) or ``"bptt"`` (PyTorch's own backward).

    Extra keyword arguments: ``strategy``, ``chunk`` and ``levels`` are passed to
    ``bppsa_core.scan.scan``. Not supported with ``bppsa``: bidirectional, dropout between
    layers, packed sequences (rejected with an error).
    """


class GRU(_BPPSAMixin, torch.nn.GRU):
    """``torch.nn.GRU`` with ``backward="bppsa"`` (default) or ``"bptt"``; see ``RNN``."""
