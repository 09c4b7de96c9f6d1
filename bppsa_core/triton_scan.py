"""Triton kernels of the chunked scan for an RNN's factored chain; the plain-PyTorch twin is
``bppsa_core.scan.chunked_scan``.

The chain is ``M_k[b] = diag(s[k, b]) @ W`` (a tanh or relu RNN's Jacobians, ``FactoredChain`` with
one term and no diagonal), with optional offsets. Three launches, however long the chain:

1. ``_reduce``: one program per (chunk 1..P-2, sample) multiplies its chunk's C elements into one
   H x H aggregate (and offset) in registers: ``R <- (R * s_k) @ W``, a ``tl.dot`` per step;
2. ``_spine``: one program per sample walks the remainder chunk from x_n, then scans the chunk
   aggregates sequentially, writing every chunk's entry vector;
3. ``_expand``: one program per (chunk 0..P-2, sample) walks its chunk from its entry vector.

Loop bounds (chunk size, remainder, aggregate count) are compile-time constants: one compilation
per sequence length and chunk size, which a training run keeps fixed (and Triton's interpreter
cannot take a run-time loop bound with NumPy 2.4). H is padded to a power of two of at least 16
(``tl.dot``'s minimum) inside the programs; ``tl.dot`` runs with ``input_precision="ieee"`` (full
fp32: TF32's ~1e-3 error would exceed the gradient tolerances). Everything is checked against the
twin on the CPU with ``TRITON_INTERPRET=1``. The GPU timings of these kernels are still to be
measured (no GPU was lent to the task that wrote them); they run only when asked for
(``strategy="triton"``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _reduce(
    s_ptr, w_ptr, b_ptr, agg_ptr, aggb_ptr, B, H, C: tl.constexpr, HAS_B: tl.constexpr, HP: tl.constexpr
):
    q = tl.program_id(0) + 1  # chunks 1..P-2
    b = tl.program_id(1)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w = tl.load(w_ptr + r[:, None] * H + r[None, :], mask=mat, other=0.0)
    first = q * C + C - 1  # the chunk's last element is applied first
    s = tl.load(s_ptr + (first * B + b) * H + r, mask=vec, other=0.0)
    agg = s[:, None] * w  # diag(s) @ W
    c = tl.zeros([HP], dtype=tl.float32)
    if HAS_B:
        c = tl.load(b_ptr + (first * B + b) * H + r, mask=vec, other=0.0)
    for i in range(1, C):
        k = first - i
        s = tl.load(s_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        agg = tl.dot(agg * s[None, :], w, input_precision="ieee")
        if HAS_B:
            bk = tl.load(b_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
            c = tl.sum((c * s)[:, None] * w, axis=0) + bk
    j = q - 1
    tl.store(agg_ptr + ((j * B + b) * H + r[:, None]) * H + r[None, :], agg, mask=mat)
    tl.store(aggb_ptr + (j * B + b) * H + r, c, mask=vec)


@triton.jit
def _spine(
    s_ptr,
    w_ptr,
    b_ptr,
    agg_ptr,
    aggb_ptr,
    x_ptr,
    out_ptr,
    entry_ptr,
    B,
    H,
    N,
    REM: tl.constexpr,
    NAGG: tl.constexpr,
    HAS_B: tl.constexpr,
    HP: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w = tl.load(w_ptr + r[:, None] * H + r[None, :], mask=mat, other=0.0)
    y = tl.load(x_ptr + b * H + r, mask=vec, other=0.0)
    tl.store(out_ptr + (N * B + b) * H + r, y, mask=vec)
    for i in range(0, REM):  # the remainder chunk, from x_n down
        k = N - 1 - i
        s = tl.load(s_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        y = tl.sum((y * s)[:, None] * w, axis=0)
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
    s_ptr, w_ptr, b_ptr, entry_ptr, out_ptr, B, H, C: tl.constexpr, HAS_B: tl.constexpr, HP: tl.constexpr
):
    q = tl.program_id(0)  # chunks 0..P-2
    b = tl.program_id(1)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w = tl.load(w_ptr + r[:, None] * H + r[None, :], mask=mat, other=0.0)
    y = tl.load(entry_ptr + (q * B + b) * H + r, mask=vec, other=0.0)
    for i in range(0, C):
        k = q * C + C - 1 - i
        s = tl.load(s_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        y = tl.sum((y * s)[:, None] * w, axis=0)
        if HAS_B:
            y += tl.load(b_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        tl.store(out_ptr + (k * B + b) * H + r, y, mask=vec)


def supports(scales: Tensor, weights: Tensor, diagonal: Tensor | None) -> bool:
    """Whether a factored chain has the single-term RNN form these kernels take (fp32, H <= 64)."""
    return (
        diagonal is None
        and weights.shape[0] == 1
        and weights.shape[-1] <= 64
        and scales.dtype == torch.float32
        and weights.dtype == torch.float32
    )


def triton_chunked_scan(
    scales: Tensor, weight: Tensor, x_last: Tensor, offsets: Tensor | None, chunk: int
) -> Tensor:
    """The chunked scan of ``x_k = (x_{k+1} * s_k) @ W + b_k``: scales (n, B, H), weight (H, H)."""
    n, batch, h = scales.shape
    p = math.ceil(n / chunk)
    s = scales.contiguous()
    w = weight.contiguous()
    if p < 2:  # a single chunk: nothing to run in parallel, the twin's sequential walk does it
        from bppsa_core.chain import FactoredChain
        from bppsa_core.scan import sequential_scan

        return sequential_scan(FactoredChain(s.unsqueeze(2), w.unsqueeze(0)), x_last, offsets)
    hp = max(16, triton.next_power_of_2(h))
    has_b = offsets is not None
    b = offsets.contiguous() if has_b else s  # not read when HAS_B is false
    out = x_last.new_empty((n + 1, batch, h))
    agg = s.new_empty((max(p - 2, 1), batch, h, h))
    aggb = s.new_zeros((max(p - 2, 1), batch, h))
    entry = s.new_empty((p - 1, batch, h))
    if p > 2:
        _reduce[(p - 2, batch)](s, w, b, agg, aggb, batch, h, chunk, HAS_B=has_b, HP=hp)
    _spine[(batch,)](
        s,
        w,
        b,
        agg,
        aggb,
        x_last.contiguous(),
        out,
        entry,
        batch,
        h,
        n,
        n - (p - 1) * chunk,
        p - 2,
        HAS_B=has_b,
        HP=hp,
    )
    _expand[(p - 1, batch)](s, w, b, entry, out, batch, h, chunk, HAS_B=has_b, HP=hp)
    return out
