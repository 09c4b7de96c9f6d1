"""Triton kernels of the chunked scan over a factored chain; the plain-PyTorch twin is
``bppsa_core.scan.chunked_scan``.

The chain is ``M_k[b] = sum_j diag(s[k, b, j]) @ W_j (+ diag(e[k, b]))`` with K <= 3 terms
(``FactoredChain``: a tanh or relu RNN has one term, a GRU three and a diagonal), with optional
offsets. Three launches, however long the chain:

1. ``_reduce``: one program per (chunk 1..P-2, sample) multiplies its chunk's C elements into one
   H x H aggregate (and offset) in registers: ``R <- sum_j (R * s_kj) @ W_j + R * e_k``, K ``tl.dot``
   per step;
2. ``_spine``: one program per sample walks the remainder chunk from x_n, then scans the chunk
   aggregates sequentially, writing every chunk's entry vector;
3. ``_expand``: one program per (chunk 0..P-2, sample) walks its chunk from its entry vector.

``rnn_layer_backward`` runs the same three kernels as a tanh/relu RNN layer's whole scan step of
the backward: they build each Jacobian from the layer's output (f'(z_t) = 1 - h_t^2 or [h_t > 0])
instead of reading a chain, and write the deltas f'(z_t) * g_t the weight gradients need instead of
every g_t, so the chain, the offsets copy and the delta pass never touch memory.

Loop bounds (chunk size, remainder, aggregate count) are compile-time constants: one compilation
per sequence length and chunk size, which a training run keeps fixed (and Triton's interpreter
cannot take a run-time loop bound with NumPy 2.4). H is padded to a power of two of at least 16
(``tl.dot``'s minimum) inside the programs, and the K weight matrices stay in registers, so a chain
fits one program when K * Hp^2 <= 4096 (RNN: H <= 64; GRU: H <= 32). ``tl.dot`` runs with
``input_precision="ieee"`` (full fp32: TF32's ~1e-3 error would exceed the gradient tolerances).
Elements shared by the batch are read with a batch stride of 0, never copied. Everything is checked
against the twin on the CPU with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_TERMS = 3
_MAX_REGISTERS = 4096  # K * Hp^2 weight entries one program keeps in registers


@triton.jit
def _load_weights(w_ptr, H, K: tl.constexpr, HP: tl.constexpr):
    """The K (<= 3) shared H x H weights, padded to HP x HP; unused terms repeat the first."""
    r = tl.arange(0, HP)
    mat = (r < H)[:, None] & (r < H)[None, :]
    offs = r[:, None] * H + r[None, :]
    w0 = tl.load(w_ptr + offs, mask=mat, other=0.0)
    w1 = w0
    w2 = w0
    if K > 1:
        w1 = tl.load(w_ptr + H * H + offs, mask=mat, other=0.0)
    if K > 2:
        w2 = tl.load(w_ptr + 2 * H * H + offs, mask=mat, other=0.0)
    return w0, w1, w2


@triton.jit
def _scale(ptr, r, vec, ACT: tl.constexpr):
    """One scale vector: read as is (ACT 0), or f'(z) from an RNN's output h: 1 - h^2 (1), [h > 0] (2)."""
    v = tl.load(ptr + r, mask=vec, other=0.0)
    if ACT == 1:
        v = 1.0 - v * v
    if ACT == 2:
        v = tl.where(v > 0, 1.0, 0.0)
    return v


@triton.jit
def _offset(b_ptr, k, b, B, H, r, vec, SHIFT: tl.constexpr):
    """Element k's offset: row k of the offsets, or row k - 1 with SHIFT (none for k = 0)."""
    return tl.load(b_ptr + ((k - SHIFT) * B + b) * H + r, mask=vec & (k >= SHIFT), other=0.0)


@triton.jit
def _mat_step(
    agg,
    s_row,
    e_row,
    H,
    w0,
    w1,
    w2,
    K: tl.constexpr,
    HAS_E: tl.constexpr,
    ACT: tl.constexpr,
    HP: tl.constexpr,
):
    """agg @ M for one element: s_row points at its K scale vectors, e_row at its diagonal."""
    r = tl.arange(0, HP)
    vec = r < H
    s = _scale(s_row, r, vec, ACT)
    out = tl.dot(agg * s[None, :], w0, input_precision="ieee")
    if K > 1:
        s = tl.load(s_row + H + r, mask=vec, other=0.0)
        out += tl.dot(agg * s[None, :], w1, input_precision="ieee")
    if K > 2:
        s = tl.load(s_row + 2 * H + r, mask=vec, other=0.0)
        out += tl.dot(agg * s[None, :], w2, input_precision="ieee")
    if HAS_E:
        out += agg * tl.load(e_row + r, mask=vec, other=0.0)[None, :]
    return out


@triton.jit
def _vec_step(
    y, s_row, e_row, H, w0, w1, w2, K: tl.constexpr, HAS_E: tl.constexpr, ACT: tl.constexpr, HP: tl.constexpr
):
    """y @ M for one element and one row vector y; also y * s (an RNN's delta when K = 1)."""
    r = tl.arange(0, HP)
    vec = r < H
    ys = y * _scale(s_row, r, vec, ACT)
    out = tl.sum(ys[:, None] * w0, axis=0)
    if K > 1:
        s = tl.load(s_row + H + r, mask=vec, other=0.0)
        out += tl.sum((y * s)[:, None] * w1, axis=0)
    if K > 2:
        s = tl.load(s_row + 2 * H + r, mask=vec, other=0.0)
        out += tl.sum((y * s)[:, None] * w2, axis=0)
    if HAS_E:
        out += y * tl.load(e_row + r, mask=vec, other=0.0)
    return out, ys


@triton.jit
def _reduce(
    s_ptr,
    w_ptr,
    e_ptr,
    b_ptr,
    agg_ptr,
    aggb_ptr,
    B,
    H,
    S_K,
    S_B,
    C: tl.constexpr,
    K: tl.constexpr,
    HAS_E: tl.constexpr,
    HAS_B: tl.constexpr,
    ACT: tl.constexpr,
    SHIFT: tl.constexpr,
    HP: tl.constexpr,
):
    q = tl.program_id(0) + 1  # chunks 1..P-2
    b = tl.program_id(1)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP)
    agg = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    c = tl.zeros([HP], dtype=tl.float32)
    for i in range(0, C):  # the chunk's last element is applied first
        k = q * C + C - 1 - i
        s_row = s_ptr + k * S_K + b * S_B
        e_row = e_ptr + (k * B + b) * H
        agg = _mat_step(agg, s_row, e_row, H, w0, w1, w2, K, HAS_E, ACT, HP)
        if HAS_B:
            c, _ = _vec_step(c, s_row, e_row, H, w0, w1, w2, K, HAS_E, ACT, HP)
            c += _offset(b_ptr, k, b, B, H, r, vec, SHIFT)
    j = q - 1
    tl.store(agg_ptr + ((j * B + b) * H + r[:, None]) * H + r[None, :], agg, mask=mat)
    tl.store(aggb_ptr + (j * B + b) * H + r, c, mask=vec)


@triton.jit
def _walk_step(
    y,
    k,
    b,
    s_ptr,
    e_ptr,
    b_ptr,
    out_ptr,
    d_ptr,
    B,
    H,
    S_K,
    S_B,
    w0,
    w1,
    w2,
    K: tl.constexpr,
    HAS_E: tl.constexpr,
    HAS_B: tl.constexpr,
    ACT: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    """x_k from y = x_{k+1}, stored: every x_k, or (FUSED) only x_0 and every delta = x_{k+1} * s_k."""
    r = tl.arange(0, HP)
    vec = r < H
    y_next, ys = _vec_step(
        y, s_ptr + k * S_K + b * S_B, e_ptr + (k * B + b) * H, H, w0, w1, w2, K, HAS_E, ACT, HP
    )
    if HAS_B:
        y_next += _offset(b_ptr, k, b, B, H, r, vec, SHIFT)
    if FUSED:
        tl.store(d_ptr + (k * B + b) * H + r, ys, mask=vec)
        tl.store(out_ptr + b * H + r, y_next, mask=vec & (k == 0))
    else:
        tl.store(out_ptr + (k * B + b) * H + r, y_next, mask=vec)
    return y_next


@triton.jit
def _spine(
    s_ptr,
    w_ptr,
    e_ptr,
    b_ptr,
    agg_ptr,
    aggb_ptr,
    x_ptr,
    out_ptr,
    d_ptr,
    entry_ptr,
    B,
    H,
    N,
    S_K,
    S_B,
    REM: tl.constexpr,
    NAGG: tl.constexpr,
    K: tl.constexpr,
    HAS_E: tl.constexpr,
    HAS_B: tl.constexpr,
    ACT: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP)
    y = tl.load(x_ptr + b * H + r, mask=vec, other=0.0)
    if not FUSED:
        tl.store(out_ptr + (N * B + b) * H + r, y, mask=vec)
    for i in range(0, REM):  # the remainder chunk, from x_n down
        k = N - 1 - i
        y = _walk_step(
            y, k, b, s_ptr, e_ptr, b_ptr, out_ptr, d_ptr, B, H, S_K, S_B, w0, w1, w2,
            K, HAS_E, HAS_B, ACT, SHIFT, FUSED, HP,
        )  # fmt: skip
    tl.store(entry_ptr + (NAGG * B + b) * H + r, y, mask=vec)
    for i in range(0, NAGG):  # aggregates of chunks P-2 .. 1: entry of chunk j is x at (j + 1) C
        j = NAGG - 1 - i
        a = tl.load(agg_ptr + ((j * B + b) * H + r[:, None]) * H + r[None, :], mask=mat, other=0.0)
        y = tl.sum(y[:, None] * a, axis=0) + tl.load(aggb_ptr + (j * B + b) * H + r, mask=vec, other=0.0)
        tl.store(entry_ptr + (j * B + b) * H + r, y, mask=vec)


@triton.jit
def _expand(
    s_ptr,
    w_ptr,
    e_ptr,
    b_ptr,
    entry_ptr,
    out_ptr,
    d_ptr,
    B,
    H,
    S_K,
    S_B,
    C: tl.constexpr,
    K: tl.constexpr,
    HAS_E: tl.constexpr,
    HAS_B: tl.constexpr,
    ACT: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    q = tl.program_id(0)  # chunks 0..P-2
    b = tl.program_id(1)
    r = tl.arange(0, HP)
    vec = r < H
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP)
    y = tl.load(entry_ptr + (q * B + b) * H + r, mask=vec, other=0.0)
    for i in range(0, C):
        k = q * C + C - 1 - i
        y = _walk_step(
            y, k, b, s_ptr, e_ptr, b_ptr, out_ptr, d_ptr, B, H, S_K, S_B, w0, w1, w2,
            K, HAS_E, HAS_B, ACT, SHIFT, FUSED, HP,
        )  # fmt: skip


def _padded(h: int) -> int:
    return max(16, triton.next_power_of_2(h))


def supports(scales: Tensor, weights: Tensor, diagonal: Tensor | None) -> bool:
    """Whether a factored chain fits these kernels: float32, K <= 3 terms, K * Hp^2 <= 4096."""
    k, h = weights.shape[0], weights.shape[-1]
    tensors = (scales, weights) + (() if diagonal is None else (diagonal,))
    return (
        k <= MAX_TERMS
        and k * _padded(h) ** 2 <= _MAX_REGISTERS
        and all(t.dtype == torch.float32 for t in tensors)
    )


def triton_chunked_scan(
    scales: Tensor,
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
    diagonal: Tensor | None = None,
) -> Tensor:
    """The chunked scan of ``x_k = sum_j (x_{k+1} * s_kj) @ W_j + x_{k+1} * e_k + b_k``.

    scales (n, B or 1, K, H), weights (K, H, H), diagonal (n, B or 1, H) or None, x_last (B, H),
    offsets (n, B, H) or None. Returns x_0..x_n as (n + 1, B, H).
    """
    n, h = scales.shape[0], scales.shape[-1]
    if math.ceil(n / chunk) < 2:  # a single chunk: nothing to run in parallel, the twin walks it
        from bppsa_core.chain import FactoredChain
        from bppsa_core.scan import sequential_scan

        return sequential_scan(FactoredChain(scales, weights, diagonal), x_last, offsets)
    out = x_last.new_empty((n + 1, x_last.shape[0], h))
    _launch(scales, weights, diagonal, x_last, offsets, chunk, out, None, act=0, shift=0)
    return out


ACTIVATIONS = {"tanh": 1, "relu": 2}


def rnn_layer_backward(
    h: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, nonlinearity: str, chunk: int
) -> tuple[Tensor, Tensor]:
    """One tanh/relu RNN layer's backward in the kernels, with its Jacobians built in them.

    h (T, B, H) are the layer's outputs h_1..h_T, ``g_last`` (B, H) the gradient at h_T, ``u``
    (T, B, H) or None the gradient reaching h_1..h_T from outside (its last row is already in
    ``g_last``). The kernels read f'(z_t) off h_t (1 - h^2 or [h > 0]) instead of a stored chain,
    take u shifted by one step instead of a copied offset tensor, and write only what the weight
    gradients need: g_0 = dL/dh_0 (B, H) and delta_t = f'(z_t) * dL/dh_t for t = 1..T (T, B, H).
    The weight gradients then stay GEMMs over delta (``layer_grads``): delta must be written for
    the input-side gradients anyway, and reducing dW_hh inside the kernels would need per-program
    partial sums about as large as delta, or non-deterministic atomics.
    """
    n, batch, hid = h.shape
    if math.ceil(n / chunk) < 2:  # a single chunk: the twin's sequential walk
        from bppsa_core.jacobians import LayerWeights, RNNCell
        from bppsa_core.scan import sequential_scan

        cell, w = RNNCell(nonlinearity), LayerWeights(w_ih=w_hh, w_hh=w_hh)  # only w_hh is read
        factors = cell.factors(h, h, h, w)  # f'(z_t), read off h alone
        offsets = None if u is None else torch.cat((torch.zeros_like(u[:1]), u[:-1]))
        g = sequential_scan(cell.chain(factors, w), g_last, offsets)
        return g[0], cell.preactivation_grads(g[1:], factors)[0]
    g0 = g_last.new_empty((1, batch, hid))
    delta = h.new_empty((n, batch, hid))
    _launch(
        h.unsqueeze(2), w_hh.unsqueeze(0), None, g_last, u, chunk, g0, delta, ACTIVATIONS[nonlinearity], 1
    )
    return g0[0], delta


def _launch(
    scales: Tensor,
    weights: Tensor,
    diagonal: Tensor | None,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
    out: Tensor,
    delta: Tensor | None,
    act: int,
    shift: int,
) -> None:
    """The three launches, for a chain of at least two chunks."""
    n, _, k, h = scales.shape
    batch = x_last.shape[0]
    p = math.ceil(n / chunk)
    s = scales.contiguous()
    s_k, s_b = s.stride(0), (s.stride(1) if s.shape[1] == batch else 0)
    w = weights.contiguous()
    has_e, has_b = diagonal is not None, offsets is not None
    e = diagonal.expand(n, batch, h).contiguous() if has_e else s  # not read when HAS_E is false
    b = offsets.contiguous() if has_b else s
    d = out if delta is None else delta
    agg = s.new_empty((max(p - 2, 1), batch, h, h))
    aggb = s.new_zeros((max(p - 2, 1), batch, h))
    entry = s.new_empty((p - 1, batch, h))
    flags = {"K": k, "HAS_E": has_e, "HAS_B": has_b, "ACT": act, "SHIFT": shift, "HP": _padded(h)}
    if p > 2:
        _reduce[(p - 2, batch)](s, w, e, b, agg, aggb, batch, h, s_k, s_b, chunk, **flags)
    rem = n - (p - 1) * chunk
    fused = delta is not None
    x = x_last.contiguous()
    _spine[(batch,)](
        s, w, e, b, agg, aggb, x, out, d, entry, batch, h, n, s_k, s_b, rem, p - 2, FUSED=fused, **flags
    )
    _expand[(p - 1, batch)](s, w, e, b, entry, out, d, batch, h, s_k, s_b, chunk, FUSED=fused, **flags)
