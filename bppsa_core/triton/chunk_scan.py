"""The chunked scan of a factored chain (a tanh/relu RNN's or a GRU's) in three Triton kernels, with
the plain-PyTorch reference of each entry point beside it (``*_ref``).

The chain is ``M_k[b] = sum_j diag(s[k, b, j]) @ W_j (+ diag(e[k, b]))`` with K <= 3 terms
(``FactoredChain``: a tanh or relu RNN has one term, a GRU three and a diagonal), with optional
offsets. The kernels read an element's factors in one of five modes (``_element``), each from the
source tensors of its own, handed in as the tuple ``src_ptrs``:

* ``SCALES``: a stored ``FactoredChain`` (``factored_scan``): ``(scales[, diagonal])``;
  ``SCALES_T`` the same chain transposed (``FactoredChain(transposed=True)``: a tangent's chain, and
  each Newton iteration's of a forward solved parallel in time, ``bppsa_core.newton``): a vector
  product is ``sum_j (x @ W_j^T) * s_j + x * e`` (the walks load the weights transposed), and a
  chunk's aggregate, the product of transposed elements, is the transpose of the untransposed
  elements' product taken in the other order: ``_reduce`` multiplies as in ``SCALES``, from the
  chunk's first element, and stores its aggregate transposed. So the matrix loop, the one that holds
  the registers, is the same code in both modes;
* ``TANH``, ``RELU``: a tanh/relu RNN layer's backward (``rnn_layer_backward``): ``(h,)``, f'(z_t)
  read off the layer's outputs (1 - h_t^2 or [not h_t <= 0], as autograd's relu backward);
* ``GRU``: a GRU layer's backward (``gru_layer_backward``): ``(gi, gh, h_prev)``, the gates r, z, n
  recomputed from the two pre-activation GEMMs gi = W_ih x + b_ih and gh = W_hh h + b_hh.

The K weights are in W_hh's own row order (a GRU's W_hr, W_hz, W_hn), as ``GRUCell.chain`` has them.
In the layer modes the kernels also take the outside gradient shifted by one step (no offsets copy)
and write only what the weight gradients need: g_0 and the pre-activation gradients (deltas) of
every step, instead of every g_t. So the chain, the offsets copy and the delta pass never touch
memory; the weight gradients stay GEMMs over the deltas (docs/DESIGN.md, "Decisions").

H is padded to ``padded(H)`` inside the programs and the K weight matrices stay in registers, so a
chain fits one program when H <= 64 (``dispatch.kernels_take``; a GRU's 3 x 64^2 weights run on 8
warps instead of 4, which keeps them at 48 registers a thread).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from bppsa_core.chain import FactoredChain
from bppsa_core.scan import chunked_scan
from bppsa_core.triton.launch import (
    BY_DATA,
    DOT_PRECISION,
    Launch,
    chain_args,
    dot_precision,
    padded,
    three_launches,
    triton_from,
    walk_warps_set,
)

# How ``_element`` reads an element's factors (see the module docstring).
SCALES = tl.constexpr(0)
TANH = tl.constexpr(1)
RELU = tl.constexpr(2)
GRU = tl.constexpr(3)
SCALES_T = tl.constexpr(4)
ACTIVATIONS = {"tanh": TANH, "relu": RELU}
MODE_NAMES = {
    SCALES.value: "SCALES",
    TANH.value: "TANH",
    RELU.value: "RELU",
    GRU.value: "GRU",
    SCALES_T.value: "SCALES_T",
}


# ------------------------------------------------------------------------------ per-element helpers


@triton.jit
def _load_weights(w_ptr, H, K: tl.constexpr, HP: tl.constexpr, TRANSPOSE: tl.constexpr):
    """The K (<= 3) shared H x H weights, padded to HP x HP (each transposed with TRANSPOSE: the
    SCALES_T walks), as a tuple of three; unused terms repeat the first."""
    r = tl.arange(0, HP)
    mat = (r < H)[:, None] & (r < H)[None, :]
    offs = r[:, None] * H + r[None, :]
    if TRANSPOSE:
        offs = r[None, :] * H + r[:, None]
    w0 = tl.load(w_ptr + offs, mask=mat, other=0.0)
    w1 = w0
    w2 = w0
    if K > 1:
        w1 = tl.load(w_ptr + H * H + offs, mask=mat, other=0.0)
    if K > 2:
        w2 = tl.load(w_ptr + 2 * H * H + offs, mask=mat, other=0.0)
    return w0, w1, w2


@triton.jit
def _element(
    src_ptrs,
    offsets_ptr,
    k,
    b,
    B,
    H,
    stride_k,
    stride_b,
    K: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    HAS_B: tl.constexpr,
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    HP: tl.constexpr,
):
    """Element k of sample b as a tuple: its scales (s0, s1, s2) of W_0..W_2, its diagonal e,
    (GRU) dn, and its offset (with HAS_B; ``_offset``). None of it depends on the vector or aggregate
    a loop carries, so the loops read each element a step ahead: its loads are then not waited on
    in the step they are issued.

    SCALES: ``src_ptrs`` = (scales[, diag]): scales (n, B or 1, K, H) with element and batch strides
    ``stride_k``, ``stride_b`` counted in rows of H (so that H alone tells the compiler how its rows
    are aligned), diag (n, B, H). TANH/RELU: (h,), (n, B, H). GRU: (gi, gh, h_prev), (n, B, 3H, rows
    r, z, n) twice and (n, B, H); the scales of W_hr, W_hz, W_hn are dn m r (1 - r),
    (h_prev - n) z (1 - z) and dn r with dn = (1 - z)(1 - n^2) and m = W_hn h + b_hn, the diagonal
    is z. Unused values and padded lanes are 0.
    """
    k = k.to(tl.int64)  # k * stride_k * H may pass 2^31 (b already is 64-bit)
    r = tl.arange(0, HP)
    vec = r < H
    zero = tl.zeros([HP], dtype=tl.float32)
    s0 = zero
    s1 = zero
    s2 = zero
    e = zero
    dn = zero
    if MODE == GRU:
        gi = src_ptrs[0] + (k * B + b) * 3 * H + r
        gh = src_ptrs[1] + (k * B + b) * 3 * H + r
        gate_r = tl.sigmoid(tl.load(gi, mask=vec, other=0.0) + tl.load(gh, mask=vec, other=0.0))
        z = tl.sigmoid(tl.load(gi + H, mask=vec, other=0.0) + tl.load(gh + H, mask=vec, other=0.0))
        m = tl.load(gh + 2 * H, mask=vec, other=0.0)
        n = 2.0 * tl.sigmoid(2.0 * (tl.load(gi + 2 * H, mask=vec, other=0.0) + gate_r * m)) - 1.0  # tanh
        h_prev = tl.load(src_ptrs[2] + (k * B + b) * H + r, mask=vec, other=0.0)
        dn = tl.where(vec, (1.0 - z) * (1.0 - n * n), 0.0)
        s0 = dn * m * gate_r * (1.0 - gate_r)
        s1 = tl.where(vec, (h_prev - n) * z * (1.0 - z), 0.0)
        s2 = dn * gate_r
        e = tl.where(vec, z, 0.0)
    elif MODE == SCALES or MODE == SCALES_T:  # noqa: SIM109 (constexpr comparisons for Triton)
        row = src_ptrs[0] + (k * stride_k + b * stride_b) * H
        s0 = tl.load(row + r, mask=vec, other=0.0)
        if K > 1:
            s1 = tl.load(row + H + r, mask=vec, other=0.0)
        if K > 2:
            s2 = tl.load(row + 2 * H + r, mask=vec, other=0.0)
        if HAS_DIAG:
            e = tl.load(src_ptrs[1] + (k * B + b) * H + r, mask=vec, other=0.0)
    else:
        h = tl.load(src_ptrs[0] + (k * B + b) * H + r, mask=vec, other=0.0)
        s0 = tl.where(vec, 1.0 - h * h, 0.0) if MODE == TANH else tl.where(h <= 0, 0.0, 1.0)  # NaN passes
    o = zero
    if HAS_B:
        o = _offset(offsets_ptr, k, b, B, H, r, vec, SHIFT)
    return s0, s1, s2, e, dn, o


@triton.jit
def _mat_step(agg, f, w, K: tl.constexpr, HAS_DIAG: tl.constexpr, DOT: tl.constexpr):
    """agg @ M for one element given as its factors ``f`` (``_element``) and the weights ``w``
    (never transposed: see ``_reduce``); ``DOT``: the products' precision (``launch.dot_precision``).
    M's weight terms are summed first, sum_j diag(s_j) W_j, so that a GRU's three terms cost one
    HP x HP product, not three (compiled by ``python -m benchmarks.kernels``)."""
    if K == 1:  # one term: the aggregate scaled instead, fewer instructions (python -m benchmarks.kernels)
        out = tl.dot(agg * f[0][None, :], w[0], input_precision=DOT)
    else:
        m = f[0][:, None] * w[0] + f[1][:, None] * w[1]
        if K > 2:
            m += f[2][:, None] * w[2]
        out = tl.dot(agg, m, input_precision=DOT)
    if HAS_DIAG:
        out += agg * f[3][None, :]
    return out


@triton.jit
def _vec_step(y, f, w, K: tl.constexpr, HAS_DIAG: tl.constexpr, MODE: tl.constexpr):
    """y @ M for one element given as its factors and one row vector y (SCALES_T: y @ M^T, with the
    weights loaded transposed); the weight terms' products are summed before the one reduction
    across the lanes, which the walks wait on every step."""
    if MODE == SCALES_T and K == 1:
        out = tl.sum(y[:, None] * w[0], axis=0) * f[0]
    elif MODE == SCALES_T:
        m = w[0] * f[0][None, :] + w[1] * f[1][None, :]
        if K > 2:
            m += w[2] * f[2][None, :]
        out = tl.sum(y[:, None] * m, axis=0)
    else:
        p = (y * f[0])[:, None] * w[0]
        if K > 1:
            p += (y * f[1])[:, None] * w[1]
        if K > 2:
            p += (y * f[2])[:, None] * w[2]
        out = tl.sum(p, axis=0)
    if HAS_DIAG:
        out += y * f[3]
    return out


@triton.jit
def _offset(offsets_ptr, k, b, B, H, r, vec, SHIFT: tl.constexpr):
    """Element k's offset: row k of the offsets, or row k - 1 with SHIFT (none for k = 0)."""
    return tl.load(offsets_ptr + ((k - SHIFT) * B + b) * H + r, mask=vec & (k >= SHIFT), other=0.0)


@triton.jit
def _step_element(
    f, src_ptrs, offsets_ptr, k, b, B, H, stride_k, stride_b, K: tl.constexpr, HAS_DIAG: tl.constexpr,
    HAS_B: tl.constexpr, MODE: tl.constexpr, SHIFT: tl.constexpr, HP: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """The element a walk's step k takes and the one it hands to the next step. AHEAD: ``f``, read
    by the step before, and element k - 1 read now (a spare copy of element 0 after it), so that no
    step waits on the loads it issues; else element k, read now (where holding two elements' factors
    spills: ``launch_config``)."""
    if AHEAD:
        f_next = _element(
            src_ptrs, offsets_ptr, tl.maximum(k - 1, 0), b, B, H, stride_k, stride_b, K, HAS_DIAG, HAS_B,
            MODE, SHIFT, HP,
        )  # fmt: skip
        return f, f_next
    else:
        now = _element(
            src_ptrs, offsets_ptr, k, b, B, H, stride_k, stride_b, K, HAS_DIAG, HAS_B, MODE, SHIFT, HP
        )
        return now, f  # ``f`` handed on unchanged: nothing is carried from one step to the next


@triton.jit
def _walk(
    y, last, count, src_ptrs, w, offsets_ptr, out_ptr, delta_ptr, b, B, H, stride_k, stride_b,
    K: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_B: tl.constexpr, MODE: tl.constexpr, SHIFT: tl.constexpr,
    FUSED: tl.constexpr, HP: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """y walked down through elements ``last``, ``last - 1``, ... (``count`` of them), each step's x
    or deltas stored (``_walk_step``); the vector past the last returned."""
    f = _element(
        src_ptrs, offsets_ptr, last, b, B, H, stride_k, stride_b, K, HAS_DIAG, HAS_B, MODE, SHIFT, HP
    )
    for i in range(0, count):
        k = last - i
        f, f_next = _step_element(
            f, src_ptrs, offsets_ptr, k, b, B, H, stride_k, stride_b, K, HAS_DIAG, HAS_B, MODE, SHIFT, HP,
            AHEAD,
        )  # fmt: skip
        y = _walk_step(y, f, w, out_ptr, delta_ptr, k, b, B, H, K, HAS_DIAG, HAS_B, MODE, FUSED, HP)
        f = f_next
    return y


@triton.jit
def _aggregate(agg_ptr, agg_offsets_ptr, j, b, B, r, mat, vec, HP: tl.constexpr):
    """Aggregate j of sample b and its offset, as ``_reduce`` stored them (HP wide), read masked."""
    a = tl.load(agg_ptr + ((j * B + b) * HP + r[:, None]) * HP + r[None, :], mask=mat, other=0.0)
    return a, tl.load(agg_offsets_ptr + (j * B + b) * HP + r, mask=vec, other=0.0)


@triton.jit
def _walk_step(
    y,
    f,
    w,
    out_ptr,
    delta_ptr,
    k,
    b,
    B,
    H,
    K: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    HAS_B: tl.constexpr,
    MODE: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    """x_k from y = x_{k+1} through element k (its factors and offset ``f``), stored: every x_k, or (FUSED)
    only x_0 and step k's deltas.

    The deltas of a layer mode (y is dL/dh at that step): an RNN's f'(z) * y (n, B, H); a GRU's
    input-side (d_r, d_z, d_n) then hidden-side (d_r, d_z, d_n * r) pre-activation gradients,
    (n, B, 6H).
    """
    r = tl.arange(0, HP)
    vec = r < H
    y_next = _vec_step(y, f, w, K, HAS_DIAG, MODE)
    if HAS_B:
        y_next += f[5]
    if FUSED:
        if MODE == GRU:
            row = delta_ptr + (k * B + b) * 6 * H + r
            tl.store(row, y * f[0], mask=vec)
            tl.store(row + H, y * f[1], mask=vec)
            tl.store(row + 2 * H, y * f[4], mask=vec)
            tl.store(row + 3 * H, y * f[0], mask=vec)
            tl.store(row + 4 * H, y * f[1], mask=vec)
            tl.store(row + 5 * H, y * f[2], mask=vec)
        else:
            tl.store(delta_ptr + (k * B + b) * H + r, y * f[0], mask=vec)
        tl.store(out_ptr + b * H + r, y_next, mask=vec & (k == 0))
    else:
        tl.store(out_ptr + (k * B + b) * H + r, y_next, mask=vec)
    return y_next


# ------------------------------------------------------------------------------------------ kernels


@triton.jit(do_not_specialize=BY_DATA)
def _reduce(
    # pointers: the mode's sources, the weights and offsets read; the chunk aggregates written
    src_ptrs, w_ptr, offsets_ptr, stop_ptr, agg_ptr, agg_offsets_ptr,
    # sizes: batch, hidden, chunk
    B, H, C,
    # strides of the scales (SCALES, SCALES_T), in rows of H
    stride_k, stride_b,
    # meta-parameters
    K: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_B: tl.constexpr, MODE: tl.constexpr,
    SHIFT: tl.constexpr, STOP: tl.constexpr, HP: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Chunk q (1..P-2) of sample b folded into one aggregate: agg[q - 1] and agg_offsets[q - 1].

    The chunk's last element is applied first. SCALES_T: the aggregate of the transposed elements,
    M_last^T ... M_first^T, is (M_first ... M_last)^T: the untransposed product P from the first
    element, stored transposed. Its offset, sum_k b_k M_{k-1}^T ... M_first^T, is sum_k b_k P_k^T
    with P_k the product before element k: each step adds P_k b_k^T, a row reduction of the
    aggregate itself, so no step of this mode reads the weights outside ``tl.dot``.
    """
    if STOP:  # noqa: SIM102 (a constexpr test alone: no load is compiled without STOP)
        if tl.load(stop_ptr) != 0:  # a Newton solve that has stopped: nothing to scan
            return
    q = tl.program_id(0) + 1
    b = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a (T, B, 6H) GRU delta may pass 2^31
    r = tl.arange(0, HP)
    w = _load_weights(w_ptr, H, K, HP, False)
    agg = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    c = tl.zeros([HP], dtype=tl.float32)
    # the elements in the order applied, from the chunk's last (SCALES_T: its first), each read a
    # step ahead; the one past the chunk is in the chain (chunks 1..P-2 are reduced)
    first = q * C + C - 1
    step = -1
    if MODE == SCALES_T:
        first = q * C
        step = 1
    f = _element(
        src_ptrs, offsets_ptr, first, b, B, H, stride_k, stride_b, K, HAS_DIAG, HAS_B, MODE, SHIFT, HP
    )
    for i in range(0, C):
        k = first + step * i
        f_next = _element(
            src_ptrs, offsets_ptr, k + step, b, B, H, stride_k, stride_b, K, HAS_DIAG, HAS_B, MODE, SHIFT, HP
        )
        if HAS_B and MODE == SCALES_T:
            c += tl.sum(agg * f[5][None, :], axis=1)
        agg = _mat_step(agg, f, w, K, HAS_DIAG, DOT)
        if HAS_B and MODE != SCALES_T:
            c = _vec_step(c, f, w, K, HAS_DIAG, MODE) + f[5]
        f = f_next
    j = q - 1
    # Stored whole, padding included (the scratch is HP wide; ``_spine`` reads it masked): a masked
    # store keeps its mask's predicates alive through the loop, and ptxas spilled them to the stack.
    if MODE == SCALES_T:
        tl.store(agg_ptr + ((j * B + b) * HP + r[None, :]) * HP + r[:, None], agg)
    else:
        tl.store(agg_ptr + ((j * B + b) * HP + r[:, None]) * HP + r[None, :], agg)
    tl.store(agg_offsets_ptr + (j * B + b) * HP + r, c)


@triton.jit(do_not_specialize=BY_DATA)
def _spine(
    # pointers: the mode's sources, the weights, offsets, aggregates and x_n read; x or deltas written
    src_ptrs, w_ptr, offsets_ptr, stop_ptr, agg_ptr, agg_offsets_ptr, x_last_ptr, out_ptr, delta_ptr,
    entry_ptr,
    # sizes: batch, hidden, chain length, remainder chunk, aggregate count
    B, H, N, REM, NAGG,
    # strides of the scales (SCALES, SCALES_T), in rows of H
    stride_k, stride_b,
    # meta-parameters
    K: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_B: tl.constexpr, MODE: tl.constexpr,
    SHIFT: tl.constexpr, FUSED: tl.constexpr, STOP: tl.constexpr, HP: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """Sample b's remainder chunk walked from x_n, then the chunk aggregates scanned: every chunk's
    entry vector into ``entry``."""
    if STOP:  # noqa: SIM102 (a constexpr test alone: no load is compiled without STOP)
        if tl.load(stop_ptr) != 0:  # a Newton solve that has stopped: nothing to scan
            return
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w = _load_weights(w_ptr, H, K, HP, MODE == SCALES_T)
    y = tl.load(x_last_ptr + b * H + r, mask=vec, other=0.0)
    if not FUSED:
        tl.store(out_ptr + (N * B + b) * H + r, y, mask=vec)
    y = _walk(  # the remainder chunk (the whole chain if it is one chunk), from x_n down
        y, N - 1, REM, src_ptrs, w, offsets_ptr, out_ptr, delta_ptr, b, B, H, stride_k, stride_b, K, HAS_DIAG,
        HAS_B, MODE, SHIFT, FUSED, HP, AHEAD,
    )  # fmt: skip
    tl.store(entry_ptr + (NAGG * B + b) * H + r, y, mask=vec)
    # aggregates of chunks P-2 .. 1 (read a step ahead, as the elements): entry of chunk j is x at (j + 1) C
    a = _aggregate(agg_ptr, agg_offsets_ptr, tl.maximum(NAGG - 1, 0), b, B, r, mat, vec, HP)
    for i in range(0, NAGG):
        j = NAGG - 1 - i
        if AHEAD:
            a_next = _aggregate(agg_ptr, agg_offsets_ptr, tl.maximum(j - 1, 0), b, B, r, mat, vec, HP)
        else:
            a_next = a  # handed on unchanged, as in ``_step_element``
            a = _aggregate(agg_ptr, agg_offsets_ptr, j, b, B, r, mat, vec, HP)
        y = tl.sum(y[:, None] * a[0], axis=0) + a[1]
        tl.store(entry_ptr + (j * B + b) * H + r, y, mask=vec)
        a = a_next


@triton.jit(do_not_specialize=BY_DATA)
def _expand(
    # pointers: the mode's sources, the weights, offsets and entry vectors read; x or deltas written
    src_ptrs, w_ptr, offsets_ptr, stop_ptr, entry_ptr, out_ptr, delta_ptr,
    # sizes: batch, hidden, chunk
    B, H, C,
    # strides of the scales (SCALES, SCALES_T), in rows of H
    stride_k, stride_b,
    # meta-parameters
    K: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_B: tl.constexpr, MODE: tl.constexpr,
    SHIFT: tl.constexpr, FUSED: tl.constexpr, STOP: tl.constexpr, HP: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """Chunk q (0..P-2) of sample b walked from its entry vector."""
    if STOP:  # noqa: SIM102 (a constexpr test alone: no load is compiled without STOP)
        if tl.load(stop_ptr) != 0:  # a Newton solve that has stopped: nothing to scan
            return
    q = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a (T, B, 6H) GRU delta may pass 2^31
    r = tl.arange(0, HP)
    w = _load_weights(w_ptr, H, K, HP, MODE == SCALES_T)
    y = tl.load(entry_ptr + (q * B + b) * H + r, mask=r < H, other=0.0)
    _walk(
        y, q * C + C - 1, C, src_ptrs, w, offsets_ptr, out_ptr, delta_ptr, b, B, H, stride_k, stride_b, K,
        HAS_DIAG, HAS_B, MODE, SHIFT, FUSED, HP, AHEAD,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- launch


def num_warps(terms: int, hp: int) -> int:
    """4 warps, or 8 where the weights pass 4096 entries (a GRU at Hp = 64), to keep them in registers."""
    return 8 if terms * hp * hp > 4096 else 4


def reduce_warps(mode: int, terms: int, hp: int, release: tuple[int, ...] | None = None) -> int:
    """The reduce kernel's warps under Triton ``release`` (None: the installed one): ``num_warps``; but at
    HP = 64 from Triton 3.7, whose HP x HP products ptxas spills on those warps (to 4.7 KB of stack on
    sm_80 under 3.8), 8 for a chain of one or two terms (from 3.8 a transposed chain of one term only)
    and 16 for the others: so ``python -m benchmarks.kernels`` finds every reduce but a few chains of
    three terms compiled without spills. Chosen by compiling, not timed on a GPU (3.6's were)."""
    if hp < 64 or not triton_from((3, 7), release):
        return num_warps(terms, hp)
    if not triton_from((3, 8), release):
        return 8 if terms <= 2 else 16
    return 8 if terms == 1 and mode == SCALES_T.value else 16


def source_count(mode: int, has_diag: bool) -> int:
    """How many source tensors a mode's kernels read (``_element``)."""
    if mode == GRU.value:
        return 3
    if mode in (SCALES.value, SCALES_T.value):
        return 2 if has_diag else 1
    return 1


@cache  # made once per configuration (read, never changed): a layer backward's host work counts
def launch_config(
    mode: int,
    terms: int,
    has_diag: bool,
    has_b: bool,
    shift: int,
    fused: bool,
    hp: int,
    stop: bool = False,
    dot: str = DOT_PRECISION,
    walk_warps: int | None = None,
) -> dict[str, Launch]:
    """The three kernels of a chunked-scan launch by role (``reduce``, ``spine``, ``expand``), as
    ``_launch`` runs them and ``benchmarks.kernels`` compiles them.

    ``mode``: ``SCALES``, ``SCALES_T``, ``TANH``, ``RELU`` or ``GRU`` (the value); ``terms``: K weights;
    ``has_diag``: a diagonal term (a GRU always has one); ``has_b``: offsets; ``shift``: offsets read
    one step late (the layer modes); ``fused``: only x_0 and the deltas written; ``hp``: ``padded(H)``;
    ``stop``: every program first reads a Newton solve's record and does nothing once it says stopped;
    ``dot``: the reduce's ``tl.dot`` precision (``launch.dot_precision``) where the chain has one term;
    ``walk_warps``: the spine's and the expand's warps (``launch.walk_warps``) where HP <= 32, else theirs.
    """
    gru = mode == GRU.value
    chain = {"K": terms, "HAS_DIAG": has_diag or gru, "HAS_B": has_b, "MODE": mode, "SHIFT": shift}
    chain |= {"STOP": stop, "HP": hp}
    # the kernels that walk elements and write x_k or deltas, each element read a step ahead; but the
    # transposed chains' walks at HP = 64 spilled on 4 warps with it (near 255 registers without), so
    # they read as they go, on 8 warps (python -m benchmarks.kernels)
    ahead = not (mode == SCALES_T.value and hp == 64)
    walks = {**chain, "FUSED": fused, "AHEAD": ahead}
    # the one kernel with matrix products; chains of two or three terms (a GRU's) keep full float32:
    # with three TF32 products their reduce spills at HP = 64 and issues more instructions below
    # (python -m benchmarks.kernels --dot tf32x3)
    reduce = {**chain, "DOT": dot if terms == 1 else DOT_PRECISION}
    warps = num_warps(terms, hp)
    walk_num_warps = walk_warps if walk_warps is not None and hp <= 32 else warps if ahead else 8
    sources = source_count(mode, has_diag)
    # Compile settings under which no configuration spills to a stack slot (re-checked by
    # ``python -m benchmarks.kernels`` and tests/core/test_compile.py): a reduce loop is not
    # software-pipelined (a step loads a few vectors against an HP x HP product; the loops read each
    # element a step ahead themselves), except the GRU's below HP = 64 or with offsets, where the
    # unpipelined compile spills; the GRU's expand at HP = 16 without offsets gets a register cap that
    # keeps ptxas from spilling (64 on 4 warps, 128 on others: under 64 they spilled, and on 2 warps
    # without a cap), and so does the reduce of other chains of several terms at HP = 64 under Triton
    # 3.6, which ptxas kept at 80-128 registers with a stack slot (later releases: ``reduce_warps``; on
    # 16 warps 128 is the most, and 3.7's two-term reduce spilled on 8 under the cap, not without).
    unpipelined = not gru or (hp == 64 and not has_b)
    reducing = reduce_warps(mode, terms, hp)
    several = 192 if terms > 1 and hp == 64 and not gru and not triton_from((3, 7)) else None
    stages, reduce_cap = (1, several) if unpipelined else (None, None)
    expand_cap = (64 if walk_num_warps == 4 else 128) if gru and hp == 16 and not has_b else None
    return {
        "reduce": Launch(_reduce, reduce, reducing, num_stages=stages, maxnreg=reduce_cap, sources=sources),
        "spine": Launch(_spine, walks, walk_num_warps, sources=sources),
        "expand": Launch(_expand, walks, walk_num_warps, maxnreg=expand_cap, sources=sources),
    }


def _launch(
    sources: tuple[Tensor, ...],
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
    out: Tensor,
    delta: Tensor | None = None,
    *,
    mode: tl.constexpr,
    shift: int,
    has_diag: bool = False,
    strides: tuple[int, int] = (0, 0),
    stop: Tensor | None = None,
) -> None:
    """The three launches (one, ``_spine``, for a chain of a single chunk), by keyword.

    ``sources``: the mode's source tensors (``_element``; contiguous, one row per element).
    ``weights``: the K stacked H x H weights, (K, H, H) or (K * H, H) (a GRU's W_hh). ``delta``: where
    a layer mode writes its deltas (``out`` then gets only x_0); None writes every x_k into ``out``.
    ``strides``: the scales' element and batch strides in rows of H (SCALES and SCALES_T modes).
    ``stop``: a Newton solve's record (``bppsa_core.newton.judge``): nothing is scanned once it says
    stopped; None: always scanned.
    """
    n, (batch, h) = sources[0].shape[0], x_last.shape
    terms = weights.numel() // (h * h)
    hp = padded(h)  # the aggregates HP x HP: see ``_reduce``
    common = {
        **chain_args(sources, weights, offsets, batch, h),
        "stride_k": strides[0],
        "stride_b": strides[1],
        "stop_ptr": sources[0] if stop is None else stop,  # not read without a record
    }
    walk = {"out_ptr": out, "delta_ptr": out if delta is None else delta}  # delta not read unless fused
    fused, has_b = delta is not None, offsets is not None
    stops = stop is not None
    kernels = launch_config(
        mode.value, terms, has_diag, has_b, shift, fused, hp, stops, dot_precision(), walk_warps_set()
    )
    three_launches(kernels, common, walk, x_last, n, chunk, hp)


# ------------------------------------------------------------------------------ entry points and refs


def factored_scan(
    chain: FactoredChain, x_last: Tensor, offsets: Tensor | None, chunk: int, stop: Tensor | None = None
) -> Tensor:
    """The chunked scan of ``x_k = sum_j (x_{k+1} * s_kj) @ W_j + x_{k+1} * e_k + b_k``, or for a
    transposed chain of ``x_k = sum_j (x_{k+1} @ W_j^T) * s_kj + x_{k+1} * e_k + b_k``.

    ``chain``: scales (n, B or 1, K, H), weights (K, H, H), diagonal (n, B or 1, H) or None; x_last
    (B, H), offsets (n, B, H) or None. Returns x_0..x_n as (n + 1, B, H). ``stop``: a Newton solve's
    record; once it says stopped, the kernels return at once and the result is left unwritten.
    """
    n, h = chain.length, chain.hidden
    batch = x_last.shape[0]
    s = chain.scales.contiguous()
    diagonal = chain.diagonal
    sources = (s,) if diagonal is None else (s, diagonal.expand(n, batch, h).contiguous())
    out = x_last.new_empty((n + 1, batch, h))
    rows = (s.stride(0) // h, s.stride(1) // h if s.shape[1] == batch else 0)
    mode = SCALES_T if chain.transposed else SCALES
    _launch(
        sources, chain.weights, x_last, offsets, chunk, out,
        mode=mode, shift=0, has_diag=diagonal is not None, strides=rows, stop=stop,
    )  # fmt: skip
    return out


def factored_scan_ref(
    chain: FactoredChain, x_last: Tensor, offsets: Tensor | None, chunk: int, stop: Tensor | None = None
) -> Tensor:
    """``factored_scan`` in plain PyTorch: ``bppsa_core.scan.chunked_scan``, the chunked twin (which
    scans whatever ``stop`` says)."""
    return chunked_scan(chain, x_last, offsets, chunk=chunk)


def rnn_layer_backward(
    h: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, nonlinearity: str, chunk: int
) -> tuple[Tensor, Tensor]:
    """One tanh/relu RNN layer's backward in the kernels, with its Jacobians built in them.

    h (T, B, H) are the layer's outputs h_1..h_T, ``g_last`` (B, H) the gradient at h_T, ``u``
    (T, B, H) or None the gradient reaching h_1..h_T from outside (its last row is already in
    ``g_last``). The kernels read f'(z_t) off h_t (1 - h^2 or [not h <= 0]) instead of a stored chain,
    take u shifted by one step instead of a copied offset tensor, and write only what the weight
    gradients need: g_0 = dL/dh_0 (B, H) and delta_t = f'(z_t) * dL/dh_t for t = 1..T (T, B, H).
    """
    n, batch, hid = h.shape
    g0 = g_last.new_empty((1, batch, hid))
    delta = h.new_empty((n, batch, hid))
    _launch((h.contiguous(),), w_hh, g_last, u, chunk, g0, delta, mode=ACTIVATIONS[nonlinearity], shift=1)
    return g0[0], delta


def rnn_layer_backward_ref(
    h: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, nonlinearity: str, chunk: int
) -> tuple[Tensor, Tensor]:
    """``rnn_layer_backward`` in plain PyTorch: the chain of f'(z_t) and W_hh scanned, then the deltas."""
    fp = 1 - h * h if nonlinearity == "tanh" else (h <= 0).logical_not().to(h.dtype)
    g = chunked_scan(FactoredChain(fp.unsqueeze(2), w_hh.unsqueeze(0)), g_last, _shifted(u), chunk=chunk)
    return g[0], g[1:] * fp


def gru_layer_backward(
    gi: Tensor, gh: Tensor, h_prev: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """One GRU layer's backward in the kernels, with its Jacobians built in them.

    gi, gh (T, B, 3H) are the pre-activations W_ih x_t + b_ih and W_hh h_{t-1} + b_hh (rows r, z, n;
    two GEMMs, kept outside the kernels), h_prev (T, B, H) the states h_0..h_{T-1}, ``g_last`` and
    ``u`` as in ``rnn_layer_backward``. The kernels recompute the gates and the Jacobians from them
    and write g_0 (B, H) and the pre-activation gradients of W_ih x + b_ih and W_hh h + b_hh
    (``GRUCell.preactivation_grads``), each (T, B, 3H): views of one (T, B, 6H) buffer.
    """
    n, batch, hid = h_prev.shape
    g0 = g_last.new_empty((1, batch, hid))
    deltas = h_prev.new_empty((n, batch, 6 * hid))
    sources = (gi.contiguous(), gh.contiguous(), h_prev.contiguous())
    _launch(sources, w_hh, g_last, u, chunk, g0, deltas, mode=GRU, shift=1)
    return g0[0], deltas[..., : 3 * hid], deltas[..., 3 * hid :]


def gru_layer_backward_ref(
    gi: Tensor, gh: Tensor, h_prev: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``gru_layer_backward`` in plain PyTorch: the gates and factors as ``_element`` recomputes them,
    the chain scanned, then the deltas as ``_walk_step`` writes them."""
    hid = h_prev.shape[-1]
    (i_r, i_z, i_n), (h_r, h_z, m) = gi.split(hid, -1), gh.split(hid, -1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * m)
    dn = (1 - z) * (1 - n * n)
    s = (dn * m * r * (1 - r), (h_prev - n) * z * (1 - z), dn * r)
    chain = FactoredChain(torch.stack(s, 2), w_hh.reshape(3, hid, hid), z)
    g = chunked_scan(chain, g_last, _shifted(u), chunk=chunk)
    y = g[1:]
    return g[0], torch.cat((y * s[0], y * s[1], y * dn), -1), torch.cat([y * t for t in s], -1)


def _shifted(u: Tensor | None) -> Tensor | None:
    """The offsets of a layer's chain: the outside gradients one step late (none reaches h_0)."""
    return None if u is None else torch.cat((torch.zeros_like(u[:1]), u[:-1]))
