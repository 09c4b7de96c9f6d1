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
def _mat_step(agg, s_row, e_row, H, w0, w1, w2, K: tl.constexpr, HAS_E: tl.constexpr, HP: tl.constexpr):
    """agg @ M for one element: s_row points at its K scale vectors, e_row at its diagonal."""
    r = tl.arange(0, HP)
    vec = r < H
    s = tl.load(s_row + r, mask=vec, other=0.0)
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
def _vec_step(y, s_row, e_row, H, w0, w1, w2, K: tl.constexpr, HAS_E: tl.constexpr, HP: tl.constexpr):
    """y @ M for one element and one row vector y."""
    r = tl.arange(0, HP)
    vec = r < H
    s = tl.load(s_row + r, mask=vec, other=0.0)
    out = tl.sum((y * s)[:, None] * w0, axis=0)
    if K > 1:
        s = tl.load(s_row + H + r, mask=vec, other=0.0)
        out += tl.sum((y * s)[:, None] * w1, axis=0)
    if K > 2:
        s = tl.load(s_row + 2 * H + r, mask=vec, other=0.0)
        out += tl.sum((y * s)[:, None] * w2, axis=0)
    if HAS_E:
        out += y * tl.load(e_row + r, mask=vec, other=0.0)
    return out


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
        agg = _mat_step(agg, s_row, e_row, H, w0, w1, w2, K, HAS_E, HP)
        if HAS_B:
            c = _vec_step(c, s_row, e_row, H, w0, w1, w2, K, HAS_E, HP)
            c += tl.load(b_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
    j = q - 1
    tl.store(agg_ptr + ((j * B + b) * H + r[:, None]) * H + r[None, :], agg, mask=mat)
    tl.store(aggb_ptr + (j * B + b) * H + r, c, mask=vec)


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
    HP: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP)
    y = tl.load(x_ptr + b * H + r, mask=vec, other=0.0)
    tl.store(out_ptr + (N * B + b) * H + r, y, mask=vec)
    for i in range(0, REM):  # the remainder chunk, from x_n down
        k = N - 1 - i
        y = _vec_step(y, s_ptr + k * S_K + b * S_B, e_ptr + (k * B + b) * H, H, w0, w1, w2, K, HAS_E, HP)
        if HAS_B:
            y += tl.load(b_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        tl.store(out_ptr + (k * B + b) * H + r, y, mask=vec)
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
    B,
    H,
    S_K,
    S_B,
    C: tl.constexpr,
    K: tl.constexpr,
    HAS_E: tl.constexpr,
    HAS_B: tl.constexpr,
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
        y = _vec_step(y, s_ptr + k * S_K + b * S_B, e_ptr + (k * B + b) * H, H, w0, w1, w2, K, HAS_E, HP)
        if HAS_B:
            y += tl.load(b_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        tl.store(out_ptr + (k * B + b) * H + r, y, mask=vec)


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
    n, _, k, h = scales.shape
    batch = x_last.shape[0]
    p = math.ceil(n / chunk)
    if p < 2:  # a single chunk: nothing to run in parallel, the twin's sequential walk does it
        from bppsa_core.chain import FactoredChain
        from bppsa_core.scan import sequential_scan

        return sequential_scan(FactoredChain(scales, weights, diagonal), x_last, offsets)
    s = scales.contiguous()
    s_k, s_b = s.stride(0), (s.stride(1) if s.shape[1] == batch else 0)
    w = weights.contiguous()
    has_e, has_b = diagonal is not None, offsets is not None
    e = diagonal.expand(n, batch, h).contiguous() if has_e else s  # not read when HAS_E is false
    b = offsets.contiguous() if has_b else s
    hp = _padded(h)
    out = x_last.new_empty((n + 1, batch, h))
    agg = s.new_empty((max(p - 2, 1), batch, h, h))
    aggb = s.new_zeros((max(p - 2, 1), batch, h))
    entry = s.new_empty((p - 1, batch, h))
    flags = {"K": k, "HAS_E": has_e, "HAS_B": has_b, "HP": hp}
    if p > 2:
        _reduce[(p - 2, batch)](s, w, e, b, agg, aggb, batch, h, s_k, s_b, chunk, **flags)
    rem = n - (p - 1) * chunk
    _spine[(batch,)](
        s, w, e, b, agg, aggb, x_last.contiguous(), out, entry, batch, h, n, s_k, s_b, rem, p - 2, **flags
    )
    _expand[(p - 1, batch)](s, w, e, b, entry, out, batch, h, s_k, s_b, chunk, **flags)
    return out
