"""Analytic, folded transposed Jacobians of recurrent cells, and the gradients that follow the scan.

For each time step the paper stores two elements, W^T and diag(f'(z_t)). Here each pair is one
element per (step, sample), ``J_t = dh_t / dh_{t-1}``, which in the row-vector convention of
``bppsa_core.scan`` is the transposed Jacobian acting on the gradient: ``g_{t-1} = g_t @ J_t``.
The elements come as a ``FactoredChain``: the per-step diagonal factors stay (T, B, K, H) vectors
and the shared weights are never copied per sample; each product of the scan folds them on the fly
(``FactoredChain.dense`` gives the explicit matrices).

A cell supplies these, all parallel over time and batch:

* ``factors``: the per-step vectors the Jacobians and the weight gradients need, recovered from the
  layer's input, previous states and outputs (the forward ran in PyTorch's fused kernel and kept none).
  With ``keep`` (1 on a sequence's steps, 0 past its end) the steps past the end become identities:
  the state is carried unchanged, as PyTorch's packed sequences do.
* ``chain``: the elements J_t in time order (the scan consumes them from t = T down).
* ``preactivation_grads``: from g_t = dL/dh_t of a block of steps (which it may overwrite: the
  scan's output is scratch by then) and the block's factors, the gradients of the input-side and
  hidden-side pre-activations, from which every weight, bias and input gradient follows by GEMMs
  (``layer_grads``, block by block over time).
* ``step`` and ``bounds``, for a forward solved by Newton's method (``bppsa_core.newton``): every
  step at once from given previous states, the new states and the factors of the Jacobians at those
  states; and the box every state of a sequence lies in, whatever the inputs and weights.
* ``direct_tangent`` and ``tangent_chain``, for forward-mode differentiation: a tangent of the
  state obeys ``v_t = J_t v_{t-1} + c_t``, where c_t, the part that comes from the step's own
  inputs and weights, is ``preactivation_grads``' adjoint applied to the pre-activations' tangents;
  the same scan solves it over the transposed elements taken in reverse.

The state is h (H numbers per sample), or for an LSTM (h, c) (2H, h first).

PyTorch's gate layouts are used throughout: RNN ``h' = f(W_ih x + b_ih + W_hh h + b_hh)``; GRU rows
(r, z, n), ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h' = (1 - z) * n + z * h``; LSTM rows
(i, f, g, o), ``c' = f * c + i * g``, ``h' = o * tanh(c')``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from bppsa_core.chain import FactoredChain, LSTMChain
from bppsa_core.scan import elementwise_recurrence

# Bytes of temporaries the per-step work may use per block of time steps, by where it runs; a
# process-wide setting (``benchmarks.backward --block-mib`` sets it), which a ``block_budget``
# scope overrides. On a CPU, GRUCell.factors and layer_grads work block by block so that the
# temporaries stay in the cache. On a GPU no cache is at stake and a block costs its launches, a
# handful whatever its size (the fused kernels have made every step's gradient before the first
# block), so its blocks are large: small ones would put most of a long backward's launches in front of
# its GPU work (re-measured by ``python -m benchmarks.backward --device cuda --suite long --block-mib N``).
BLOCK_BYTES = {"cpu": 8 << 20, "gpu": 256 << 20}

# this thread's scopes: ``kept``, the buffers of its ``reusing_buffers`` scope by name; ``block_bytes``,
# the budget of its ``block_budget`` scope
_scope = threading.local()
# Bytes of a CPU scope's buffers that a thread keeps for its next scope (``reusing_buffers``): a few
# blocks' worth (``BLOCK_BYTES``), so every backward after the first of a shape takes memory already
# paged in (re-measured by ``python -m benchmarks.backward --tables epoch``, whose processes differed
# up to 2x in backward time by how glibc had come to hand back freed blocks).
KEEP_BYTES = 32 << 20
# Bytes under which ``buffer`` makes a new tensor even in a scope: malloc serves blocks that small
# from its heap's free lists, without new pages, and a named buffer's bookkeeping costs a short
# layer's backward more than it saves (re-measured by ``python -m benchmarks.host --models gru``).
SCRATCH_MIN_BYTES = 64 << 10


def _block_steps(bytes_per_step: int, device: torch.device) -> int:
    """Time steps per block of work on ``device`` that touches ``bytes_per_step`` bytes per step."""
    budget = getattr(_scope, "block_bytes", None) or default_block_bytes(device)
    return max(1, budget // max(1, bytes_per_step))


def block_kind(device: torch.device) -> str:
    """The key of ``BLOCK_BYTES`` that holds ``device``'s budget: "cpu" on a CPU, "gpu" on any other.
    A ``torch.device`` is read as it is (every layer backward asks), a name parsed."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return "cpu" if kind == "cpu" else "gpu"


def default_block_bytes(device: torch.device) -> int:
    """The budget of a block of time steps on ``device`` outside any ``block_budget`` scope."""
    return BLOCK_BYTES[block_kind(device)]


@contextlib.contextmanager
def block_budget(nbytes: int | None) -> Iterator[None]:
    """A scope (this thread's) whose blocks of time steps use ``nbytes`` of temporaries instead of the
    device's default (``default_block_bytes``); None leaves the budget as it is. Where processes share
    a CPU's cache, each may take less of it: ``bppsa_core.distributed`` gives a rank of several its
    own budget."""
    before = getattr(_scope, "block_bytes", None)
    _scope.block_bytes = nbytes or before
    try:
        yield
    finally:
        _scope.block_bytes = before


class reusing_buffers:  # noqa: N801 (a context manager, named as a function)
    """A scope whose block-by-block walks take their scratch from buffers kept until it ends
    (``buffer``), instead of fresh tensors for every block.

    Why: a block's scratch is a few MB, and glibc hands such blocks back to the system when they are
    freed (it unmaps them, or trims the heap's top), so every block's scratch arrives as fresh pages
    that fault in on first touch, a few thousand per call. Where a sequence-parallel rank walks its
    slice in several groups of samples, those faults cost it a good part of its backward on a CPU
    (re-measured by ``python -m benchmarks.distributed --ranks 2``). For the same reason the thread
    keeps a CPU scope's buffers, up to ``KEEP_BYTES`` (the smallest first), for its next scope: the
    next backward of the shape allocates nothing. A GPU's are freed (PyTorch's caching allocator
    keeps their memory). A scope inside a scope is the same scope. Walks in one scope must run one
    after another: they share the buffers; nothing made in a buffer may outlive its scope. A class,
    not a generator: a short layer's backward enters one (re-measured by ``python -m benchmarks.host``)."""

    def __enter__(self) -> None:
        self._outer = getattr(_scope, "kept", None) is None
        if self._outer:
            _scope.kept, _scope.spare = getattr(_scope, "spare", None) or {}, None

    def __exit__(self, *exc: object) -> None:
        if self._outer:
            kept, _scope.kept = _scope.kept, None
            _scope.spare, total = {}, 0
            for name, t in sorted(kept.items(), key=lambda item: item[1].nbytes):
                if t.device.type == "cpu" and total + t.nbytes <= KEEP_BYTES:
                    _scope.spare[name], total = t, total + t.nbytes


def buffer(name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialized tensor of ``shape``, of ``like``'s dtype and device: inside
    ``reusing_buffers``, a view of the scope's buffer ``name`` (grown when too small; its contents
    are whatever the last user left), elsewhere, or under ``SCRATCH_MIN_BYTES``, a new one."""
    kept = getattr(_scope, "kept", None)
    n = math.prod(shape)
    if kept is None or n * like.element_size() < SCRATCH_MIN_BYTES:
        return like.new_empty(shape)
    held = kept.get(name)
    if held is None or held.numel() < n or held.dtype != like.dtype or held.device != like.device:
        held = kept[name] = like.new_empty(n)
    return held[:n].view(shape)


@dataclass(frozen=True)
class LayerWeights:
    """One layer's parameters in PyTorch's names: weight_ih, weight_hh, bias_ih, bias_hh."""

    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None = None
    b_hh: Tensor | None = None


def _affine(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x @ w^T + b over all leading dimensions at once, as one GEMM. A strided x (a group of samples
    viewed out of the batch, as a sequence-parallel rank walks it) is copied first: given weights
    that need no gradient, PyTorch 2.13 runs it as one small product per step instead (much slower,
    and rounded differently from the group's copy)."""
    return torch.nn.functional.linear(x.contiguous(), w, b)


def _affine_into(x: Tensor, w: Tensor, b: Tensor | None, name: str) -> Tensor:
    """``_affine`` written into the scope's buffer ``name`` (``buffer``): the same GEMM, no new
    tensor; under ``SCRATCH_MIN_BYTES``, ``_affine`` itself, whose one call costs a short block less."""
    shape = (*x.shape[:-1], w.shape[0])
    if math.prod(shape) * x.element_size() < SCRATCH_MIN_BYTES:
        return _affine(x, w, b)
    out = buffer(name, shape, x)
    flat, rows = out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])
    if b is None:
        return torch.mm(rows, w.t(), out=flat).view(out.shape)
    return torch.addmm(b, rows, w.t(), out=flat).view(out.shape)


def _carry(prev: Tensor, new: Tensor, keep: Tensor | None) -> Tensor:
    """The new states, and past a sequence's end (``keep`` 0) the previous ones, carried."""
    return new if keep is None else torch.lerp(prev, new, keep)


class RNNCell:
    """Elman cell ``h' = f(W_ih x + b_ih + W_hh h + b_hh)`` with f = tanh or relu."""

    gates = 1

    def __init__(self, nonlinearity: str = "tanh") -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"unknown nonlinearity {nonlinearity!r}; accepted: tanh, relu")
        self.nonlinearity = nonlinearity

    def factors(
        self,
        x: Tensor,
        h_prev: Tensor,
        h: Tensor,
        w: LayerWeights,
        c0: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """f'(z_t), read off the outputs: 1 - h^2 for tanh, [not h <= 0] for relu (autograd's
        ``threshold_backward``: a NaN output passes its gradient, as torch.nn's does). With ``keep``
        (T, B, 1), f' is 0 past a sequence's end and a second factor, 1 - keep, is the identity there."""
        if self.nonlinearity == "tanh":
            fp = torch.square(h, out=buffer("factors", h.shape, h)).neg_().add_(1.0)
        else:
            fp = (h <= 0).logical_not_().to(h.dtype)
        if keep is None:
            return (fp,)
        return fp.mul_(keep), torch.rsub(keep, 1.0).expand_as(fp)

    def step(
        self, x: Tensor, h_prev: Tensor, w: LayerWeights, keep: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """h_t = f(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh) for every t at once, from given h_{t-1}
        (T, B, H), and ``factors`` there; with ``keep``, the state is carried past a sequence's end."""
        z = _affine(x, w.w_ih, w.b_ih).add_(_affine(h_prev, w.w_hh, w.b_hh))
        h = torch.tanh_(z) if self.nonlinearity == "tanh" else torch.relu_(z)
        return _carry(h_prev, h, keep), self.factors(x, h_prev, h, w, keep=keep)

    def bounds(self, s0: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        """Lower and upper bounds (B, H) of h_1..h_T: tanh's range, or relu's (never negative),
        each widened to hold h_0 (a sequence that ends at once keeps it)."""
        lo, hi = (-1.0, 1.0) if self.nonlinearity == "tanh" else (0.0, math.inf)
        return s0.clamp(max=lo), s0.clamp(min=hi)

    def chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> FactoredChain:
        """Elements ``diag(f'_t) @ W_hh`` (+ the identity past a sequence's end), t = 1..T."""
        fp, *past_end = factors
        return FactoredChain(fp.unsqueeze(-2), w.w_hh.unsqueeze(0), *past_end)

    def preactivation_grads(self, g: Tensor, factors: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """delta_t = f'(z_t) * g_t, written into g; input and hidden sides share the pre-activation."""
        delta = g.mul_(factors[0])
        return delta, delta

    def direct_tangent(self, e_in: Tensor, e_hid: Tensor, factors: tuple[Tensor, ...]) -> Tensor:
        """c_t = f'(z_t) (e_in + e_hid): the adjoint of ``preactivation_grads``."""
        return (e_in + e_hid).mul_(factors[0])

    def tangent_chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> FactoredChain:
        """The transposed elements J_T^T, ..., J_1^T: a tangent's chain, read from its end."""
        fp, *past_end = factors
        return FactoredChain(
            fp.flip(0).unsqueeze(-2), w.w_hh.unsqueeze(0), *(d.flip(0) for d in past_end), transposed=True
        )


class GRUCell:
    """PyTorch's GRU cell, gates (r, z, n)."""

    gates = 3

    def pre_activations(self, x: Tensor, h_prev: Tensor, w: LayerWeights) -> tuple[Tensor, Tensor]:
        """W_ih x + b_ih and W_hh h_{t-1} + b_hh (rows r, z, n) for all steps: two large matmuls."""
        return _affine(x, w.w_ih, w.b_ih), _affine(h_prev, w.w_hh, w.b_hh)

    def factors(
        self,
        x: Tensor,
        h_prev: Tensor,
        h: Tensor,
        w: LayerWeights,
        c0: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """The Jacobians' scales (T, B, 3, H), their diagonal z and dn = (1-z)(1-n^2), for all steps.

        The gates r, z, n and m = W_hn h + b_hn are recomputed from the two pre-activation GEMMs, and
        every factor is computed once, in few passes: the scales serve the chain and the
        pre-activation gradients alike (in W_hh's row order r, z, n):

            c = dn m r (1-r),   d = (h_prev - n) z (1-z),   a = dn r.
        """
        return self._all_factors(x, h_prev, w, keep)

    def step(
        self, x: Tensor, h_prev: Tensor, w: LayerWeights, keep: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The GRU's h_t for every t at once, from given h_{t-1} (T, B, H), and ``factors`` there,
        made in the same pass; with ``keep``, the state is carried past a sequence's end."""
        h = torch.empty_like(h_prev)
        factors = self._all_factors(x, h_prev, w, keep, h)
        return _carry(h_prev, h, keep), factors

    def bounds(self, s0: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        """Lower and upper bounds (B, H) of h_1..h_T: each h_t is a convex combination of tanh's
        n_t and h_{t-1}, so it stays within [min(-1, h_0), max(1, h_0)]."""
        return s0.clamp(max=-1.0), s0.clamp(min=1.0)

    def _all_factors(
        self, x: Tensor, h_prev: Tensor, w: LayerWeights, keep: Tensor | None, h: Tensor | None = None
    ) -> tuple[Tensor, ...]:
        """``factors``, and into ``h`` (when given) each step's new state from the same gates."""
        steps, batch, hidden = h_prev.shape
        scales = buffer("gru scales", (steps, batch, 3, hidden), h_prev)
        z, dn = buffer("gru z", h_prev.shape, h_prev), buffer("gru dn", h_prev.shape, h_prev)
        # In blocks of time steps: the pre-activations and temporaries (about 14 H numbers per step
        # and sample) stay in the CPU's cache, and only the factors go to memory.
        block = _block_steps(14 * hidden * batch * h_prev.element_size(), h_prev.device)
        for s in range(0, steps, block):
            t = slice(s, s + block)
            self._factors(x[t], h_prev[t], w, scales[t], z[t], dn[t], None if h is None else h[t])
        if keep is not None:  # past a sequence's end: no scales, diagonal 1
            scales.mul_(keep.unsqueeze(-1))
            z.mul_(keep).add_(torch.rsub(keep, 1.0))
            dn.mul_(keep)
        return scales, z, dn

    def _factors(
        self,
        x: Tensor,
        h_prev: Tensor,
        w: LayerWeights,
        scales: Tensor,
        z: Tensor,
        dn: Tensor,
        h: Tensor | None = None,
    ) -> None:
        """``factors`` of a block of steps, written into ``scales``, ``z`` and ``dn`` (and the new
        states, n + z (h_prev - n), into ``h`` when given)."""
        # the block's temporaries in the scope's buffers (``reusing_buffers``): no fresh pages per block
        gi, gh = _affine_into(x, w.w_ih, w.b_ih, "gru gi"), _affine_into(h_prev, w.w_hh, w.b_hh, "gru gh")
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, m = gh.chunk(3, dim=-1)
        r = torch.add(i_r, h_r, out=buffer("gru r", z.shape, z)).sigmoid_()
        torch.add(i_z, h_z, out=z).sigmoid_()
        n = torch.addcmul(i_n, r, m, out=buffer("gru n", z.shape, z)).tanh_()
        one_minus_z = torch.neg(z, out=buffer("gru 1 - z", z.shape, z)).add_(1.0)
        torch.mul(n, n, out=dn).neg_().add_(1.0).mul_(one_minus_z)
        c, d, a = scales.unbind(-2)
        torch.mul(dn, r, out=a)
        torch.mul(a, m, out=c).mul_(r.neg_().add_(1.0))  # r is not read again: 1 - r in its place
        torch.sub(h_prev, n, out=d)
        if h is not None:
            torch.addcmul(n, z, d, out=h)
        d.mul_(z).mul_(one_minus_z)

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
        hidden_side = torch.mul(g.unsqueeze(-2), scales, out=buffer("gru hidden side", scales.shape, g))
        input_side = buffer("gru input side", scales.shape, g).copy_(hidden_side)
        torch.mul(g, dn, out=input_side[..., 2, :])
        return input_side.flatten(-2), hidden_side.flatten(-2)

    def direct_tangent(self, e_in: Tensor, e_hid: Tensor, factors: tuple[Tensor, ...]) -> Tensor:
        """c_t from the pre-activations' tangents (rows r, z, n): the adjoint of ``preactivation_grads``."""
        scales, _, dn = factors
        hidden = scales.shape[-1]
        e_in, e_hid = e_in.unflatten(-1, (3, hidden)), e_hid.unflatten(-1, (3, hidden))
        c = (e_hid * scales).sum(-2)
        c.addcmul_(e_in[..., 0, :], scales[..., 0, :]).addcmul_(e_in[..., 1, :], scales[..., 1, :])
        return c.addcmul_(e_in[..., 2, :], dn)

    def tangent_chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> FactoredChain:
        """The transposed elements J_T^T, ..., J_1^T: a tangent's chain, read from its end."""
        scales, z, _ = factors
        hidden = w.w_hh.shape[1]
        return FactoredChain(scales.flip(0), w.w_hh.reshape(3, hidden, hidden), z.flip(0), transposed=True)


class LSTMCell:
    """PyTorch's LSTM cell, gates (i, f, g, o), without projections; its state is (h, c)."""

    gates = 4

    def factors(
        self,
        x: Tensor,
        h_prev: Tensor,
        h: Tensor,
        w: LayerWeights,
        c0: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """The chain's factors (``LSTMChain``): scales_h, scales_c (T, B, 4, H), diag_hc, diag_cc
        (T, B, H), and with ``keep`` diag_hh = 1 - keep, h's identity past a sequence's end.

        The gates come from the two pre-activation GEMMs; the cell states, which PyTorch's forward
        does not return, from ``c_t = f c_{t-1} + i g`` solved as an elementwise linear recurrence
        (``scan.elementwise_recurrence``). With k = o (1 - tanh(c)^2), the scales of W_i, W_f, W_g,
        W_o are, for c: g i (1-i), c_{t-1} f (1-f), i (1-g^2), 0; for h: k times those, except
        tanh(c) o (1-o) for W_o; and dc'/dc = f, dh'/dc = k f.
        """
        if c0 is None:
            raise ValueError("an LSTM's factors need its initial cell state c0")
        steps, batch, hidden = h_prev.shape
        # In blocks of time steps, as GRUCell.factors: the gates and temporaries (about 16 H numbers
        # per step and sample) stay in the CPU's cache. Two passes: the recurrence's coefficients,
        # then, with the cell states known, the factors (the gates' GEMMs are made twice).
        blocks = self._blocks(h_prev)
        c = self.cell_states(x, h_prev, w, c0, keep)
        scales_h, scales_c = (h_prev.new_empty((steps, batch, 4, hidden)) for _ in range(2))
        diag_hc, diag_cc = torch.empty_like(h_prev), torch.empty_like(h_prev)
        for t in blocks:
            c_prev = c[t.start - 1 : t.stop - 1] if t.start else torch.cat((c0.unsqueeze(0), c[: t.stop - 1]))
            gates = self._gates(x[t], h_prev[t], w)
            self._factors(gates, c_prev, c[t], scales_h[t], scales_c[t], diag_hc[t], diag_cc[t])
        return _past_end((scales_h, scales_c, diag_hc, diag_cc), keep)

    def _blocks(self, h_prev: Tensor) -> list[slice]:
        steps, batch, hidden = h_prev.shape
        block = _block_steps(16 * hidden * batch * h_prev.element_size(), h_prev.device)
        return [slice(s, min(s + block, steps)) for s in range(0, steps, block)]

    def cell_states(
        self, x: Tensor, h_prev: Tensor, w: LayerWeights, c0: Tensor, keep: Tensor | None = None
    ) -> Tensor:
        """c_1..c_T (T, B, H) given every h_{t-1}: ``c_t = f c_{t-1} + i g`` solved as an elementwise
        linear recurrence; with ``keep``, c is carried past a sequence's end."""
        f_keep, ig = torch.empty_like(h_prev), torch.empty_like(h_prev)
        for t in self._blocks(h_prev):
            i, f, g, _ = self._gates(x[t], h_prev[t], w)
            torch.mul(i, g, out=ig[t])
            f_keep[t] = f
            if keep is not None:  # past a sequence's end: c_t = c_{t-1}
                f_keep[t].mul_(keep[t]).add_(torch.rsub(keep[t], 1.0))
                ig[t].mul_(keep[t])
        return elementwise_recurrence(f_keep, ig, c0)

    def step(
        self, x: Tensor, s_prev: Tensor, w: LayerWeights, keep: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The LSTM's state (h_t, c_t) for every t at once, from given (h_{t-1}, c_{t-1}) (T, B, 2H),
        and ``factors`` there; with ``keep``, the state is carried past a sequence's end."""
        steps, batch, two_h = s_prev.shape
        hidden = two_h // 2
        h_prev, c_prev = s_prev[..., :hidden], s_prev[..., hidden:]
        s = torch.empty_like(s_prev)
        scales_h, scales_c = (s_prev.new_empty((steps, batch, 4, hidden)) for _ in range(2))
        diag_hc, diag_cc = torch.empty_like(h_prev), torch.empty_like(h_prev)
        for t in self._blocks(h_prev):
            i, f, g, o = gates = self._gates(x[t], h_prev[t], w)
            c = s[t, :, hidden:]
            torch.addcmul(i * g, f, c_prev[t], out=c)
            torch.mul(o, torch.tanh(c), out=s[t, :, :hidden])
            self._factors(gates, c_prev[t], c, scales_h[t], scales_c[t], diag_hc[t], diag_cc[t])
        return _carry(s_prev, s, keep), _past_end((scales_h, scales_c, diag_hc, diag_cc), keep)

    def bounds(self, s0: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        """Lower and upper bounds (B, 2H) of (h, c)_1..T: h = o tanh(c) within [-1, 1] (or h_0),
        and |c_t| <= |c_{t-1}| + 1 (f, i in (0, 1), |g| < 1), so |c| <= |c_0| + T."""
        hidden = s0.shape[-1] // 2
        h0, c0 = s0[..., :hidden], s0[..., hidden:]
        c_max = c0.abs() + steps
        return torch.cat((h0.clamp(max=-1.0), -c_max), -1), torch.cat((h0.clamp(min=1.0), c_max), -1)

    def activations(self, x: Tensor, h_prev: Tensor, w: LayerWeights) -> Tensor:
        """The gates i, f, g, o of every step as one (T, B, 4, H) tensor, from the two GEMMs."""
        pre = _affine(x, w.w_ih, w.b_ih).add_(_affine(h_prev, w.w_hh, w.b_hh))
        pre = pre.unflatten(-1, (4, h_prev.shape[-1]))
        g = torch.tanh(pre[..., 2, :])
        pre.sigmoid_()
        pre[..., 2, :] = g
        return pre

    def gate_sums(self, x: Tensor, h_prev: Tensor, w: LayerWeights) -> Tensor:
        """x_t W_ih^T + b_ih + h_{t-1} W_hh^T of every step (T, B, 4H), without b_hh, which the GPU
        kernel adds as it activates them (``triton.lstm_gates``): the second GEMM accumulated into
        the first's result, two launches where ``activations`` takes six."""
        pre = _affine(x, w.w_ih, w.b_ih)
        pre.view(-1, pre.shape[-1]).addmm_(h_prev.reshape(-1, h_prev.shape[-1]), w.w_hh.t())
        return pre

    def _gates(self, x: Tensor, h_prev: Tensor, w: LayerWeights) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The gates i, f, g, o of a block of steps (``activations``' rows)."""
        i, f, g, o = self.activations(x, h_prev, w).unbind(-2)
        return i, f, g, o

    def _factors(
        self,
        gates: tuple[Tensor, Tensor, Tensor, Tensor],
        c_prev: Tensor,
        c: Tensor,
        scales_h: Tensor,
        scales_c: Tensor,
        diag_hc: Tensor,
        diag_cc: Tensor,
    ) -> None:
        """``factors`` of a block of steps from its gates, written into the last four tensors."""
        i, f, g, o = gates
        s_i, s_f, s_g, s_o = scales_c.unbind(-2)
        torch.mul(i, i, out=s_i).neg_().add_(i).mul_(g)  # i (1 - i) g
        torch.mul(f, f, out=s_f).neg_().add_(f).mul_(c_prev)
        torch.mul(g, g, out=s_g).neg_().add_(1.0).mul_(i)
        s_o.zero_()
        tc = torch.tanh(c)
        k = torch.mul(tc, tc).neg_().add_(1.0).mul_(o)
        torch.mul(scales_c, k.unsqueeze(-2), out=scales_h)
        torch.mul(o, o, out=scales_h[..., 3, :]).neg_().add_(o).mul_(tc)
        diag_cc.copy_(f)
        torch.mul(k, f, out=diag_hc)

    def chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> LSTMChain:
        """Elements of the LSTM Jacobian over (h, c), t = 1..T, in W_hh's row order i, f, g, o."""
        hidden = w.w_hh.shape[1]
        return LSTMChain(*factors[:2], w.w_hh.reshape(4, hidden, hidden), *factors[2:])

    def preactivation_grads(self, g: Tensor, factors: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """The gates' pre-activation gradients g_h * scales_h + g_c * scales_c (rows i, f, g, o),
        shared by the input and hidden sides, from g = (dL/dh, dL/dc)."""
        scales_h, scales_c = factors[:2]
        hidden = scales_h.shape[-1]
        g_h, g_c = g[..., :hidden].unsqueeze(-2), g[..., hidden:].unsqueeze(-2)
        delta = (g_h * scales_h).addcmul_(g_c, scales_c).flatten(-2)
        return delta, delta

    def direct_tangent(self, e_in: Tensor, e_hid: Tensor, factors: tuple[Tensor, ...]) -> Tensor:
        """(c_h, c_c) from the gates' pre-activation tangents: the adjoint of ``preactivation_grads``."""
        scales_h, scales_c = factors[:2]
        e = (e_in + e_hid).unflatten(-1, (4, scales_h.shape[-1]))
        return torch.cat(((e * scales_h).sum(-2), (e * scales_c).sum(-2)), -1)

    def tangent_chain(self, factors: tuple[Tensor, ...], w: LayerWeights) -> LSTMChain:
        """The transposed elements J_T^T, ..., J_1^T: a tangent's chain, read from its end."""
        hidden = w.w_hh.shape[1]
        scales_h, scales_c, *diagonals = (f.flip(0) for f in factors)
        return LSTMChain(scales_h, scales_c, w.w_hh.reshape(4, hidden, hidden), *diagonals, transposed=True)


def _past_end(factors: tuple[Tensor, Tensor, Tensor, Tensor], keep: Tensor | None) -> tuple[Tensor, ...]:
    """An LSTM's factors with the steps past a sequence's end (``keep`` 0) made identities: no
    scales, c carried (diag_cc 1), and a fifth factor, diag_hh = 1 - keep, carrying h."""
    if keep is None:
        return factors
    scales_h, scales_c, diag_hc, diag_cc = factors
    scales_h.mul_(keep.unsqueeze(-1))
    scales_c.mul_(keep.unsqueeze(-1))
    diag_hc.mul_(keep)
    past_end = torch.rsub(keep, 1.0).expand_as(diag_hc)
    return scales_h, scales_c, diag_hc, diag_cc.mul_(keep).add_(past_end), past_end


Cell = RNNCell | GRUCell | LSTMCell


Deltas = Callable[[slice], tuple[Tensor, Tensor]]


def batch_major(t: Tensor) -> bool:
    """Whether ``t`` (T, B, F) is strided with each sample's steps side by side: a view of batch-major
    (B, T, F) memory, as a sequence-parallel rank holds its outputs to walk its samples in groups
    (``bppsa_core.distributed``). A product reads such steps sample by sample, where it lies."""
    return t.dim() == 3 and not t.is_contiguous() and t.stride(2) == 1 and t.stride(0) == t.shape[2]


class PreviousStates:
    """The states h_{t-1} of steps t = 0 .. T-1 (h0, then the outputs but the last), taken by blocks
    of steps without a copy of the whole sequence: a block that starts after step 0 is a view of the
    outputs, only the first is joined to h0. The copy it avoids is T·B·H numbers, freshly paged in
    on every backward (about a quarter of a long one-thread layer's backward on the CPU).

    Outputs in batch-major memory (``batch_major``: a sequence-parallel rank's group of samples)
    are taken as views too, each sample's steps side by side. Outputs otherwise strided (a group
    viewed out of time-major memory) are instead copied a block at a time: h_{lo-1} .. h_{hi-1},
    the block's steps side by side in one buffer that every block reuses (inside
    ``reusing_buffers``, the scope's: the next group's walk takes it over), of which the block's
    previous states (``self[lo:hi]``) and outputs (``outputs(lo, hi)``) are both views, valid until
    the next block is taken. The block's work then reads memory in order, and a rank holds one
    block's copy instead of its group's whole slice, for a little more backward time (re-measured by
    ``python -m benchmarks.distributed --ranks 2``). ``whole``: h_0..h_{T-1} side by side where the
    caller has them already (a tape, ``layer.Tape``), of which every block is a view."""

    def __init__(self, h0: Tensor, h: Tensor, whole: Tensor | None = None) -> None:
        self.h0, self.h = h0, h
        self.shape = h.shape
        self._strided = not h.is_contiguous() and not batch_major(h)  # blocks copied side by side
        self._block: tuple[int, int] | None = None  # the steps lo, hi the buffer holds
        self._buffer: Tensor | None = None
        # ``whole()``'s copy, once made, or the caller's (``whole``): every block is a view of it
        self._whole: Tensor | None = whole
        self._first: Tensor | None = None

    def __getitem__(self, t: slice) -> Tensor:
        lo, hi = self._steps(t)
        if self._whole is not None:
            return self._whole[lo:hi]
        if self._strided and hi > lo:
            return self._side_by_side(lo, hi)[:-1]
        return self._joined(lo, hi)

    def outputs(self, lo: int, hi: int) -> Tensor:
        """The outputs h_lo .. h_{hi-1}: ``h[lo:hi]``, or where the samples are strided, a view of
        the block's copy (valid until another block is taken)."""
        if self._strided and hi > lo:
            return self._side_by_side(lo, hi)[1:]
        return self.h[lo:hi]

    def whole(self) -> Tensor:
        """Every step's previous state as one (T, B, H) tensor (a copy, made once: later blocks are
        views of it, no second copy)."""
        if self._whole is None:
            self._whole = self._joined(0, self.shape[0])
        return self._whole

    def _steps(self, t: slice) -> tuple[int, int]:
        lo, hi, stride = t.indices(self.shape[0])
        if stride != 1:
            raise IndexError(f"previous states are taken by contiguous blocks of steps, got step {stride}")
        return lo, max(lo, hi)

    def _joined(self, lo: int, hi: int) -> Tensor:
        if hi <= lo:
            return self.h[:0]
        if lo > 0:
            return self.h[lo - 1 : hi - 1]
        if self._first is not None and self._first.shape[0] == hi:  # a block's factors took it first
            return self._first
        first = buffer("first previous states", (hi, *self.shape[1:]), self.h)
        self._first = torch.cat((self.h0.unsqueeze(0), self.h[: hi - 1]), out=first)  # one launch
        return first

    def _side_by_side(self, lo: int, hi: int) -> Tensor:
        """h_{lo-1} .. h_{hi-1} (h_{-1} = h0) contiguous in the reused buffer."""
        shape = (hi - lo + 1, *self.shape[1:])
        n = math.prod(shape)
        if self._buffer is None or self._buffer.numel() < n:
            self._buffer, self._block = buffer("previous states", shape, self.h).view(-1), None
        block = self._buffer[:n].view(shape)
        if self._block != (lo, hi):
            if lo == 0:
                block[0].copy_(self.h0)
                block[1:].copy_(self.h[:hi])
            else:
                block.copy_(self.h[lo - 1 : hi])
            self._block = (lo, hi)
        return block


def layer_grads(
    deltas: Deltas,
    x: Tensor,
    h_prev: Tensor | PreviousStates,
    w: LayerWeights,
    need_input: bool = True,
) -> tuple[Tensor | None, LayerWeights]:
    """Input and parameter gradients from the pre-activation gradients of all (T, B) steps.

    ``deltas(steps)`` gives the input-side and hidden-side pre-activation gradients of a slice of
    time steps. They are made and consumed block by block, so they never all exist at once and
    each block's stay in the CPU's cache between the two: dW_ih += gi^T x, dW_hh += gh^T h_{t-1},
    the biases' sums, and the input gradient gi @ W_ih of the block, all GEMMs. Blocks are taken
    from the last one down, the order in which a backward walk makes them.
    """
    steps, batch, hidden = h_prev.shape
    rows = w.w_ih.shape[0]  # gates x H
    # per step and sample: both deltas and their making (4 rows), the input and the previous state
    block = _block_steps(batch * (4 * rows + x.shape[-1] + hidden) * x.element_size(), x.device)
    dx = x.new_empty((*x.shape[:-1], w.w_ih.shape[1])) if need_input else None
    d_w_ih = d_w_hh = d_b_ih = d_b_hh = None  # the first block's products start each sum (no zero fill)
    shared = False
    for s in reversed(range(0, steps, block)):
        t = slice(s, s + block)
        gi, gh = deltas(t)
        shared = gh is gi  # an RNN or an LSTM: both sides share one pre-activation
        gi2 = gi.flatten(0, -2)
        gh2 = gi2 if shared else gh.flatten(0, -2)
        d_w_ih = _add_product(d_w_ih, gi, x[t])
        d_w_hh = _add_product(d_w_hh, gh, h_prev[t])
        if w.b_ih is not None:
            d_b_ih = gi2.sum(0) if d_b_ih is None else d_b_ih.add_(gi2.sum(0))
        if w.b_hh is not None and not shared:
            d_b_hh = gh2.sum(0) if d_b_hh is None else d_b_hh.add_(gh2.sum(0))
        if dx is not None:
            torch.matmul(gi, w.w_ih, out=dx[t])
    if steps == 0:  # no block: nothing reached the weights
        d_w_ih, d_w_hh = torch.zeros_like(w.w_ih), torch.zeros_like(w.w_hh)
        d_b_ih = None if w.b_ih is None else torch.zeros_like(w.b_ih)
        d_b_hh = None if w.b_hh is None else torch.zeros_like(w.b_hh)
    if w.b_hh is not None and shared:  # summed once, copied (H,)
        d_b_hh = d_b_ih.clone() if d_b_ih is not None else _sum_shared(deltas, steps, block)
    return dx, LayerWeights(d_w_ih, d_w_hh, d_b_ih, d_b_hh)


def _add_product(total: Tensor | None, d: Tensor, b: Tensor) -> Tensor:
    """``total += d^T @ b`` over a block's steps and samples in place, or ``d^T @ b`` itself for the
    first block (no zero fill); d (K, B, rows) a block's pre-activation gradients, b (K, B, columns)
    its inputs or previous states.

    A product of a few columns (``_NARROW``) and more rows, such as a GRU's or an LSTM's dW_hh at
    H = 20 (60 or 80 x 20), is kept column-major, so that every block's GEMM is the transposed one
    with the wide side as its columns: 15-30 % faster on one CPU thread, and slower from 64 columns
    (re-measured by ``python -m benchmarks.backward --model lstm --threads 1``). Any other product of
    a b in batch-major memory (``batch_major``) at least ``_SAMPLE_WISE`` wide is one product per
    sample, summed, where flattening b would copy it; a narrower b (a single input feature) is
    copied, faster than such thin products (re-measured by
    ``python -m benchmarks.distributed --ranks 1 2``)."""
    cpu = d.device.type == "cpu"
    column_major = cpu and b.shape[-1] <= _NARROW < d.shape[-1]
    if cpu and not column_major and b.shape[-1] >= _SAMPLE_WISE and batch_major(b):
        part = torch.bmm(d.permute(1, 2, 0), b.transpose(0, 1)).sum(0)
        return part if total is None else total.add_(part)
    d, b = d.flatten(0, -2), b.flatten(0, -2)
    if total is not None:
        return total.addmm_(d.t(), b)  # a column-major total stays so: the same transposed GEMM
    if column_major:
        return torch.mm(b.t(), d).t()
    return torch.mm(d.t(), b)


# Columns up to which a CPU weight gradient with more rows is accumulated column-major (``_add_product``).
_NARROW = 32
# Columns from which a product reads batch-major inputs sample by sample (``_add_product``).
_SAMPLE_WISE = 16


def _sum_shared(deltas: Deltas, steps: int, block: int) -> Tensor:
    """The bias gradient of a shared pre-activation when there is no input-side bias to copy."""
    return sum(deltas(slice(s, s + block))[0].flatten(0, -2).sum(0) for s in reversed(range(0, steps, block)))
