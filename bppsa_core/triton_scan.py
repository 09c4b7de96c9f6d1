"""Triton kernels of the chunked scan over a factored chain; the plain-PyTorch twin is
``bppsa_core.scan.chunked_scan`` (with ``bppsa_core.jacobians`` for the fused layer backwards).

The chain is ``M_k[b] = sum_j diag(s[k, b, j]) @ W_j (+ diag(e[k, b]))`` with K <= 3 terms
(``FactoredChain``: a tanh or relu RNN has one term, a GRU three and a diagonal), with optional
offsets. Three launches, however long the chain:

1. ``_reduce``: one program per (chunk 1..P-2, sample) multiplies its chunk's C elements into one
   H x H aggregate (and offset) in registers: ``R <- sum_j (R * s_kj) @ W_j + R * e_k``, K ``tl.dot``
   per step;
2. ``_spine``: one program per sample walks the remainder chunk from x_n, then scans the chunk
   aggregates sequentially, writing every chunk's entry vector;
3. ``_expand``: one program per (chunk 0..P-2, sample) walks its chunk from its entry vector.

The kernels read an element's factors in one of four modes (``_element``), each from its own
source tensors:

* ``SCALES``: a stored ``FactoredChain`` (``triton_chunked_scan``): ``scales`` and ``diag``;
  ``SCALES_T`` the same chain transposed (``FactoredChain(transposed=True)``: a tangent's chain, and
  each Newton iteration's of a forward solved parallel in time, ``bppsa_core.newton``): a vector
  product is ``sum_j (x @ W_j^T) * s_j + x * e`` (the walks load the weights transposed), and a
  chunk's aggregate, the product of transposed elements, is the transpose of the
  untransposed elements' product taken in the other order: ``_reduce`` multiplies as in ``SCALES``,
  from the chunk's first element, and stores its aggregate transposed. So the matrix loop, the one
  that holds the registers, is the same code in both modes;
* ``TANH``, ``RELU``: a tanh/relu RNN layer's backward (``rnn_layer_backward``): f'(z_t) read off
  the layer's outputs ``h`` (1 - h_t^2 or [h_t > 0]);
* ``GRU``: a GRU layer's backward (``gru_layer_backward``): the gates r, z, n recomputed from the
  two pre-activation GEMMs ``gi`` = W_ih x + b_ih and ``gh`` = W_hh h + b_hh and from ``h_prev``.

An LSTM's chain (``LSTMChain``, state (h, c) of 2H) has kernels of its own, ``_lstm_reduce``,
``_lstm_spine`` and ``_lstm_expand`` (``triton_lstm_scan``), organised the same way: a program holds
the four gates' H x H weights and an aggregate as two (2H x H) column blocks, the h and the c columns;
a step is four ``tl.dot`` for the h columns and two elementwise products for the c columns. The
chain fits one program when 2H <= 64 (``dispatch.lstm_kernels_take``).

The K weights are in W_hh's own row order (a GRU's W_hr, W_hz, W_hn), as ``GRUCell.chain`` has them.
In the layer modes the kernels also take the outside gradient shifted by one step (no offsets copy)
and write only what the weight gradients need: g_0 and the pre-activation gradients (deltas) of
every step, instead of every g_t. So the chain, the offsets copy and the delta pass never touch
memory; the weight gradients stay GEMMs over the deltas (docs/DESIGN.md, "Decisions").

H is padded to a power of two of at least 16 (``tl.dot``'s minimum) inside the programs and the K
weight matrices stay in registers, so a chain fits one program when H <= 64 (``dispatch.kernels_take``;
a GRU's 3 x 64^2 weights run on 8 warps instead of 4, which keeps them at 48 registers a thread); the
chunk aggregates go through memory padded to HP (``_reduce`` says why). ``tl.dot`` runs with
``input_precision="ieee"`` (full fp32: TF32's ~1e-3 error would exceed the gradient tolerances).
Elements shared by the batch are read with a batch stride of 0, never copied; offsets into memory are
64-bit, so tensors of more than 2^31 elements are indexed correctly. Everything is checked against the
twin on the CPU with ``TRITON_INTERPRET=1``.

Loop bounds (chunk size, remainder, aggregate count) are run-time arguments, and no integer that
changes with the data (length, chunk size, batch, the scales' strides) is specialized on, so a GPU
compiles each configuration once, whatever the sequence length; under Triton's interpreter the
launches hand the bounds in as ``tl.constexpr`` objects (``_BOUNDS``; docs/DESIGN.md, "Loop bounds").
The constexprs, warps and compile settings of every launch come from ``launch_config`` and
``lstm_launch_config``; ``launch_configs`` lists every configuration the modules can launch, and
``benchmarks.kernels`` (with ``tests/core/test_compile.py``) compiles them all for sm_80 and sm_90
without a GPU.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import triton
import triton.language as tl
from torch import Tensor

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
# The source tensors ``_element`` may read; a launch passes the ones of its mode.
SOURCES = ("scales_ptr", "diag_ptr", "h_ptr", "gi_ptr", "gh_ptr", "h_prev_ptr")

# The loops' bounds (chunk size C, remainder REM, aggregate count NAGG): run-time arguments. Triton's
# interpreter (the CPU tests) turns an int argument into a 1-element NumPy array, which ``range`` cannot
# take as a bound with NumPy 2 (``int()`` of a 1-d array is an error there), and passes a
# ``tl.constexpr`` object through as it is; so under the interpreter ``Launch.run`` hands them in so.
_BOUNDS = ("C", "REM", "NAGG")
# Integer arguments that change with the data (lengths, the chunk size, the batch, the scales' strides):
# never specialized on their values, so one binary serves every sequence length, chunk size and batch
# (Triton would otherwise compile again whenever one is 1 or turns a multiple of 16). Only H, fixed
# for a model, keeps Triton's specialization: a multiple of 16 lets the compiler vectorize row loads.
_BY_DATA = (*_BOUNDS, "N", "B", "stride_k", "stride_b")


@triton.jit
def _load_weights(w_ptr, H, K: tl.constexpr, HP: tl.constexpr, TRANSPOSE: tl.constexpr):
    """The K (<= 3) shared H x H weights, padded to HP x HP (each transposed with TRANSPOSE: the
    SCALES_T walks); unused terms repeat the first."""
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
    scales_ptr,
    diag_ptr,
    h_ptr,
    gi_ptr,
    gh_ptr,
    h_prev_ptr,
    k,
    b,
    B,
    H,
    stride_k,
    stride_b,
    K: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    MODE: tl.constexpr,
    HP: tl.constexpr,
):
    """Element k of sample b: its scales (s0, s1, s2) of W_0..W_2, its diagonal e, and (GRU) dn.

    SCALES: ``scales`` (n, B or 1, K, H) with element and batch strides ``stride_k``, ``stride_b``
    counted in rows of H (so that H alone tells the compiler how its rows are aligned),
    ``diag`` (n, B, H). TANH/RELU: ``h`` (n, B, H). GRU: ``gi``, ``gh`` (n, B, 3H, rows r, z, n) and
    ``h_prev`` (n, B, H); the scales of W_hr, W_hz, W_hn are dn m r (1 - r), (h_prev - n) z (1 - z)
    and dn r with dn = (1 - z)(1 - n^2) and m = W_hn h + b_hn, the diagonal is z. Unused values and
    padded lanes are 0.
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
        gi = gi_ptr + (k * B + b) * 3 * H + r
        gh = gh_ptr + (k * B + b) * 3 * H + r
        gate_r = tl.sigmoid(tl.load(gi, mask=vec, other=0.0) + tl.load(gh, mask=vec, other=0.0))
        z = tl.sigmoid(tl.load(gi + H, mask=vec, other=0.0) + tl.load(gh + H, mask=vec, other=0.0))
        m = tl.load(gh + 2 * H, mask=vec, other=0.0)
        n = 2.0 * tl.sigmoid(2.0 * (tl.load(gi + 2 * H, mask=vec, other=0.0) + gate_r * m)) - 1.0  # tanh
        h_prev = tl.load(h_prev_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        dn = tl.where(vec, (1.0 - z) * (1.0 - n * n), 0.0)
        s0 = dn * m * gate_r * (1.0 - gate_r)
        s1 = tl.where(vec, (h_prev - n) * z * (1.0 - z), 0.0)
        s2 = dn * gate_r
        e = tl.where(vec, z, 0.0)
    elif MODE == SCALES or MODE == SCALES_T:  # noqa: SIM109 (constexpr comparisons for Triton)
        row = scales_ptr + (k * stride_k + b * stride_b) * H
        s0 = tl.load(row + r, mask=vec, other=0.0)
        if K > 1:
            s1 = tl.load(row + H + r, mask=vec, other=0.0)
        if K > 2:
            s2 = tl.load(row + 2 * H + r, mask=vec, other=0.0)
        if HAS_DIAG:
            e = tl.load(diag_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
    else:
        h = tl.load(h_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        s0 = tl.where(vec, 1.0 - h * h, 0.0) if MODE == TANH else tl.where(h > 0, 1.0, 0.0)
    return s0, s1, s2, e, dn


@triton.jit
def _mat_step(agg, s0, s1, s2, e, w0, w1, w2, K: tl.constexpr, HAS_DIAG: tl.constexpr):
    """agg @ M for one element given as its factors (never transposed: see ``_reduce``)."""
    out = tl.dot(agg * s0[None, :], w0, input_precision="ieee")
    if K > 1:
        out += tl.dot(agg * s1[None, :], w1, input_precision="ieee")
    if K > 2:
        out += tl.dot(agg * s2[None, :], w2, input_precision="ieee")
    if HAS_DIAG:
        out += agg * e[None, :]
    return out


@triton.jit
def _vec_step(y, s0, s1, s2, e, w0, w1, w2, K: tl.constexpr, HAS_DIAG: tl.constexpr, MODE: tl.constexpr):
    """y @ M for one element given as its factors and one row vector y (SCALES_T: y @ M^T, with the
    weights loaded transposed)."""
    if MODE == SCALES_T:
        out = tl.sum(y[:, None] * w0, axis=0) * s0
        if K > 1:
            out += tl.sum(y[:, None] * w1, axis=0) * s1
        if K > 2:
            out += tl.sum(y[:, None] * w2, axis=0) * s2
    else:
        out = tl.sum((y * s0)[:, None] * w0, axis=0)
        if K > 1:
            out += tl.sum((y * s1)[:, None] * w1, axis=0)
        if K > 2:
            out += tl.sum((y * s2)[:, None] * w2, axis=0)
    if HAS_DIAG:
        out += y * e
    return out


@triton.jit
def _offset(offsets_ptr, k, b, B, H, r, vec, SHIFT: tl.constexpr):
    """Element k's offset: row k of the offsets, or row k - 1 with SHIFT (none for k = 0)."""
    return tl.load(offsets_ptr + ((k - SHIFT) * B + b) * H + r, mask=vec & (k >= SHIFT), other=0.0)


@triton.jit(do_not_specialize=_BY_DATA)
def _reduce(
    scales_ptr,
    diag_ptr,
    h_ptr,
    gi_ptr,
    gh_ptr,
    h_prev_ptr,
    w_ptr,
    offsets_ptr,
    agg_ptr,
    agg_offsets_ptr,
    B,
    H,
    stride_k,
    stride_b,
    C,
    K: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    HAS_B: tl.constexpr,
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    HP: tl.constexpr,
):
    """Chunk q (1..P-2) of sample b folded into one aggregate: agg[q - 1] and agg_offsets[q - 1].

    The chunk's last element is applied first. SCALES_T: the aggregate of the transposed elements,
    M_last^T ... M_first^T, is (M_first ... M_last)^T: the untransposed product P from the first
    element, stored transposed. Its offset, sum_k b_k M_{k-1}^T ... M_first^T, is sum_k b_k P_k^T
    with P_k the product before element k: each step adds P_k b_k^T, a row reduction of the
    aggregate itself, so no step of this mode reads the weights outside ``tl.dot``.
    """
    q = tl.program_id(0) + 1
    b = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a (T, B, 6H) GRU delta may pass 2^31
    r = tl.arange(0, HP)
    vec = r < H
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP, False)
    agg = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    c = tl.zeros([HP], dtype=tl.float32)
    for i in range(0, C):
        k = q * C + C - 1 - i
        k_mat = k
        if MODE == SCALES_T:
            k_mat = q * C + i
        s0, s1, s2, e, _ = _element(
            scales_ptr, diag_ptr, h_ptr, gi_ptr, gh_ptr, h_prev_ptr, k_mat, b, B, H, stride_k, stride_b,
            K, HAS_DIAG, MODE, HP,
        )  # fmt: skip
        if HAS_B and MODE == SCALES_T:
            c += tl.sum(agg * _offset(offsets_ptr, k_mat, b, B, H, r, vec, SHIFT)[None, :], axis=1)
        agg = _mat_step(agg, s0, s1, s2, e, w0, w1, w2, K, HAS_DIAG)
        if HAS_B and MODE != SCALES_T:
            c = _vec_step(c, s0, s1, s2, e, w0, w1, w2, K, HAS_DIAG, MODE)
            c += _offset(offsets_ptr, k, b, B, H, r, vec, SHIFT)
    j = q - 1
    # Stored whole, padding included (the scratch is HP wide; ``_spine`` reads it masked): a masked
    # store keeps its mask's predicates alive through the loop, and ptxas spilled them to the stack.
    if MODE == SCALES_T:
        tl.store(agg_ptr + ((j * B + b) * HP + r[None, :]) * HP + r[:, None], agg)
    else:
        tl.store(agg_ptr + ((j * B + b) * HP + r[:, None]) * HP + r[None, :], agg)
    tl.store(agg_offsets_ptr + (j * B + b) * HP + r, c)


@triton.jit
def _walk_step(
    y,
    s0,
    s1,
    s2,
    e,
    dn,
    w0,
    w1,
    w2,
    offsets_ptr,
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
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    """x_k from y = x_{k+1} through element k (its factors), stored: every x_k, or (FUSED) only x_0
    and step k's deltas.

    The deltas of a layer mode (y is dL/dh at that step): an RNN's f'(z) * y (n, B, H); a GRU's
    input-side (d_r, d_z, d_n) then hidden-side (d_r, d_z, d_n * r) pre-activation gradients,
    (n, B, 6H).
    """
    r = tl.arange(0, HP)
    vec = r < H
    y_next = _vec_step(y, s0, s1, s2, e, w0, w1, w2, K, HAS_DIAG, MODE)
    if HAS_B:
        y_next += _offset(offsets_ptr, k, b, B, H, r, vec, SHIFT)
    if FUSED:
        if MODE == GRU:
            row = delta_ptr + (k * B + b) * 6 * H + r
            tl.store(row, y * s0, mask=vec)
            tl.store(row + H, y * s1, mask=vec)
            tl.store(row + 2 * H, y * dn, mask=vec)
            tl.store(row + 3 * H, y * s0, mask=vec)
            tl.store(row + 4 * H, y * s1, mask=vec)
            tl.store(row + 5 * H, y * s2, mask=vec)
        else:
            tl.store(delta_ptr + (k * B + b) * H + r, y * s0, mask=vec)
        tl.store(out_ptr + b * H + r, y_next, mask=vec & (k == 0))
    else:
        tl.store(out_ptr + (k * B + b) * H + r, y_next, mask=vec)
    return y_next


@triton.jit(do_not_specialize=_BY_DATA)
def _spine(
    scales_ptr,
    diag_ptr,
    h_ptr,
    gi_ptr,
    gh_ptr,
    h_prev_ptr,
    w_ptr,
    offsets_ptr,
    agg_ptr,
    agg_offsets_ptr,
    x_last_ptr,
    out_ptr,
    delta_ptr,
    entry_ptr,
    B,
    H,
    N,
    stride_k,
    stride_b,
    REM,
    NAGG,
    K: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    HAS_B: tl.constexpr,
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    """Sample b's remainder chunk walked from x_n, then the chunk aggregates scanned: every chunk's
    entry vector into ``entry``."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP, MODE == SCALES_T)
    y = tl.load(x_last_ptr + b * H + r, mask=vec, other=0.0)
    if not FUSED:
        tl.store(out_ptr + (N * B + b) * H + r, y, mask=vec)
    for i in range(0, REM):  # the remainder chunk (the whole chain if it is one chunk), from x_n down
        k = N - 1 - i
        s0, s1, s2, e, dn = _element(
            scales_ptr, diag_ptr, h_ptr, gi_ptr, gh_ptr, h_prev_ptr, k, b, B, H, stride_k, stride_b,
            K, HAS_DIAG, MODE, HP,
        )  # fmt: skip
        y = _walk_step(
            y, s0, s1, s2, e, dn, w0, w1, w2, offsets_ptr, out_ptr, delta_ptr, k, b, B, H,
            K, HAS_DIAG, HAS_B, MODE, SHIFT, FUSED, HP,
        )  # fmt: skip
    tl.store(entry_ptr + (NAGG * B + b) * H + r, y, mask=vec)
    for i in range(0, NAGG):  # aggregates of chunks P-2 .. 1: entry of chunk j is x at (j + 1) C
        j = NAGG - 1 - i
        a = tl.load(agg_ptr + ((j * B + b) * HP + r[:, None]) * HP + r[None, :], mask=mat, other=0.0)
        y = tl.sum(y[:, None] * a, axis=0)
        y += tl.load(agg_offsets_ptr + (j * B + b) * HP + r, mask=vec, other=0.0)
        tl.store(entry_ptr + (j * B + b) * H + r, y, mask=vec)


@triton.jit(do_not_specialize=_BY_DATA)
def _expand(
    scales_ptr,
    diag_ptr,
    h_ptr,
    gi_ptr,
    gh_ptr,
    h_prev_ptr,
    w_ptr,
    offsets_ptr,
    entry_ptr,
    out_ptr,
    delta_ptr,
    B,
    H,
    stride_k,
    stride_b,
    C,
    K: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    HAS_B: tl.constexpr,
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    """Chunk q (0..P-2) of sample b walked from its entry vector."""
    q = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a (T, B, 6H) GRU delta may pass 2^31
    r = tl.arange(0, HP)
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP, MODE == SCALES_T)
    y = tl.load(entry_ptr + (q * B + b) * H + r, mask=r < H, other=0.0)
    for i in range(0, C):
        k = q * C + C - 1 - i
        s0, s1, s2, e, dn = _element(
            scales_ptr, diag_ptr, h_ptr, gi_ptr, gh_ptr, h_prev_ptr, k, b, B, H, stride_k, stride_b,
            K, HAS_DIAG, MODE, HP,
        )  # fmt: skip
        y = _walk_step(
            y, s0, s1, s2, e, dn, w0, w1, w2, offsets_ptr, out_ptr, delta_ptr, k, b, B, H,
            K, HAS_DIAG, HAS_B, MODE, SHIFT, FUSED, HP,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------- LSTM


@triton.jit
def _lstm_weights(w_ptr, H, HP: tl.constexpr):
    """The four gates' H x H weights (W_i, W_f, W_g, W_o), padded to HP x HP."""
    r = tl.arange(0, HP)
    mat = (r < H)[:, None] & (r < H)[None, :]
    offs = r[:, None] * H + r[None, :]
    w0 = tl.load(w_ptr + offs, mask=mat, other=0.0)
    w1 = tl.load(w_ptr + H * H + offs, mask=mat, other=0.0)
    w2 = tl.load(w_ptr + 2 * H * H + offs, mask=mat, other=0.0)
    w3 = tl.load(w_ptr + 3 * H * H + offs, mask=mat, other=0.0)
    return w0, w1, w2, w3


@triton.jit
def _lstm_element(sh_ptr, sc_ptr, hc_ptr, cc_ptr, hh_ptr, k, b, B, H, HAS_HH: tl.constexpr, HP: tl.constexpr):
    """Element k of sample b: the h and c scales of the four gates, and the diagonals h<-c, c<-c, h<-h."""
    k = k.to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    rows = (k * B + b) * 4 * H + r
    sh0 = tl.load(sh_ptr + rows, mask=vec, other=0.0)
    sh1 = tl.load(sh_ptr + rows + H, mask=vec, other=0.0)
    sh2 = tl.load(sh_ptr + rows + 2 * H, mask=vec, other=0.0)
    sh3 = tl.load(sh_ptr + rows + 3 * H, mask=vec, other=0.0)
    sc0 = tl.load(sc_ptr + rows, mask=vec, other=0.0)
    sc1 = tl.load(sc_ptr + rows + H, mask=vec, other=0.0)
    sc2 = tl.load(sc_ptr + rows + 2 * H, mask=vec, other=0.0)
    sc3 = tl.load(sc_ptr + rows + 3 * H, mask=vec, other=0.0)
    row = (k * B + b) * H + r
    d_hc = tl.load(hc_ptr + row, mask=vec, other=0.0)
    d_cc = tl.load(cc_ptr + row, mask=vec, other=0.0)
    d_hh = tl.zeros([HP], dtype=tl.float32)
    if HAS_HH:
        d_hh = tl.load(hh_ptr + row, mask=vec, other=0.0)
    return sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh


@triton.jit
def _lstm_mat_step(
    a_h, a_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3, HAS_HH: tl.constexpr
):
    """(a_h | a_c) @ M for one element: rows of the aggregate, its h columns and its c columns."""
    out_h = tl.dot(a_h * sh0[None, :] + a_c * sc0[None, :], w0, input_precision="ieee")
    out_h += tl.dot(a_h * sh1[None, :] + a_c * sc1[None, :], w1, input_precision="ieee")
    out_h += tl.dot(a_h * sh2[None, :] + a_c * sc2[None, :], w2, input_precision="ieee")
    out_h += tl.dot(a_h * sh3[None, :] + a_c * sc3[None, :], w3, input_precision="ieee")
    if HAS_HH:
        out_h += a_h * d_hh[None, :]
    out_c = a_h * d_hc[None, :] + a_c * d_cc[None, :]
    return out_h, out_c


@triton.jit
def _lstm_vec_step(
    y_h, y_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3, HAS_HH: tl.constexpr
):
    """(y_h | y_c) @ M for one element and one row vector."""
    out_h = tl.sum((y_h * sh0 + y_c * sc0)[:, None] * w0, axis=0)
    out_h += tl.sum((y_h * sh1 + y_c * sc1)[:, None] * w1, axis=0)
    out_h += tl.sum((y_h * sh2 + y_c * sc2)[:, None] * w2, axis=0)
    out_h += tl.sum((y_h * sh3 + y_c * sc3)[:, None] * w3, axis=0)
    if HAS_HH:
        out_h += y_h * d_hh
    return out_h, y_h * d_hc + y_c * d_cc


@triton.jit(do_not_specialize=_BY_DATA)
def _lstm_reduce(
    sh_ptr, sc_ptr, hc_ptr, cc_ptr, hh_ptr, w_ptr, offsets_ptr, agg_ptr, agg_offsets_ptr, B, H,
    C, HAS_HH: tl.constexpr, HAS_B: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """Chunk q (1..P-2) of sample b folded into one (2H x 2H) aggregate and its offset."""
    q = tl.program_id(0) + 1
    b = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, HP)
    rr = tl.arange(0, 2 * HP)  # the aggregate's rows: h rows, then c rows
    vec = r < H
    w0, w1, w2, w3 = _lstm_weights(w_ptr, H, HP)
    a_h = tl.where(rr[:, None] == r[None, :], 1.0, 0.0)
    a_c = tl.where(rr[:, None] == r[None, :] + HP, 1.0, 0.0)
    o_h = tl.zeros([HP], dtype=tl.float32)
    o_c = tl.zeros([HP], dtype=tl.float32)
    for i in range(0, C):  # the chunk's last element is applied first
        k = q * C + C - 1 - i
        sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh = _lstm_element(
            sh_ptr, sc_ptr, hc_ptr, cc_ptr, hh_ptr, k, b, B, H, HAS_HH, HP
        )
        a_h, a_c = _lstm_mat_step(
            a_h, a_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3, HAS_HH
        )
        if HAS_B:
            o_h, o_c = _lstm_vec_step(
                o_h, o_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3, HAS_HH
            )
            row = offsets_ptr + (k.to(tl.int64) * B + b) * 2 * H + r
            o_h += tl.load(row, mask=vec, other=0.0)
            o_c += tl.load(row + H, mask=vec, other=0.0)
    j = q - 1
    # Stored whole, padding included (2HP x 2HP: h rows, c rows; h columns, c columns), as ``_reduce``.
    base = agg_ptr + ((j * B + b) * 2 * HP + rr[:, None]) * 2 * HP
    tl.store(base + r[None, :], a_h)
    tl.store(base + HP + r[None, :], a_c)
    out = agg_offsets_ptr + (j * B + b) * 2 * HP + r
    tl.store(out, o_h)
    tl.store(out + HP, o_c)


@triton.jit
def _lstm_walk_step(
    y_h, y_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3,
    offsets_ptr, out_ptr, k, b, B, H, HAS_HH: tl.constexpr, HAS_B: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """x_k from y = x_{k+1} through element k, stored into row k of ``out``."""
    r = tl.arange(0, HP)
    vec = r < H
    y_h, y_c = _lstm_vec_step(
        y_h, y_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3, HAS_HH
    )
    k = k.to(tl.int64)
    if HAS_B:
        row = offsets_ptr + (k * B + b) * 2 * H + r
        y_h += tl.load(row, mask=vec, other=0.0)
        y_c += tl.load(row + H, mask=vec, other=0.0)
    out = out_ptr + (k * B + b) * 2 * H + r
    tl.store(out, y_h, mask=vec)
    tl.store(out + H, y_c, mask=vec)
    return y_h, y_c


@triton.jit(do_not_specialize=_BY_DATA)
def _lstm_spine(
    sh_ptr, sc_ptr, hc_ptr, cc_ptr, hh_ptr, w_ptr, offsets_ptr, agg_ptr, agg_offsets_ptr, x_last_ptr,
    out_ptr, entry_ptr, B, H, N,
    REM, NAGG, HAS_HH: tl.constexpr, HAS_B: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """Sample b's remainder chunk walked from x_n, then the chunk aggregates scanned: every chunk's
    entry vector into ``entry``."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w0, w1, w2, w3 = _lstm_weights(w_ptr, H, HP)
    y_h = tl.load(x_last_ptr + b * 2 * H + r, mask=vec, other=0.0)
    y_c = tl.load(x_last_ptr + b * 2 * H + H + r, mask=vec, other=0.0)
    last = out_ptr + (N * B + b) * 2 * H + r
    tl.store(last, y_h, mask=vec)
    tl.store(last + H, y_c, mask=vec)
    for i in range(0, REM):
        k = N - 1 - i
        sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh = _lstm_element(
            sh_ptr, sc_ptr, hc_ptr, cc_ptr, hh_ptr, k, b, B, H, HAS_HH, HP
        )
        y_h, y_c = _lstm_walk_step(
            y_h, y_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3,
            offsets_ptr, out_ptr, k, b, B, H, HAS_HH, HAS_B, HP,
        )  # fmt: skip
    entry = entry_ptr + (NAGG * B + b) * 2 * H + r
    tl.store(entry, y_h, mask=vec)
    tl.store(entry + H, y_c, mask=vec)
    for i in range(0, NAGG):  # aggregates of chunks P-2 .. 1
        j = NAGG - 1 - i
        base = agg_ptr + ((j * B + b) * 2 * HP + r[:, None]) * 2 * HP + r[None, :]  # see _lstm_reduce
        a_hh = tl.load(base, mask=mat, other=0.0)
        a_hc = tl.load(base + HP, mask=mat, other=0.0)
        a_ch = tl.load(base + HP * 2 * HP, mask=mat, other=0.0)
        a_cc = tl.load(base + HP * 2 * HP + HP, mask=mat, other=0.0)
        off = agg_offsets_ptr + (j * B + b) * 2 * HP + r
        new_h = tl.sum(y_h[:, None] * a_hh + y_c[:, None] * a_ch, axis=0) + tl.load(off, mask=vec, other=0.0)
        new_c = tl.sum(y_h[:, None] * a_hc + y_c[:, None] * a_cc, axis=0) + tl.load(
            off + HP, mask=vec, other=0.0
        )
        y_h = new_h
        y_c = new_c
        entry = entry_ptr + (j * B + b) * 2 * H + r
        tl.store(entry, y_h, mask=vec)
        tl.store(entry + H, y_c, mask=vec)


@triton.jit(do_not_specialize=_BY_DATA)
def _lstm_expand(
    sh_ptr, sc_ptr, hc_ptr, cc_ptr, hh_ptr, w_ptr, offsets_ptr, entry_ptr, out_ptr, B, H,
    C, HAS_HH: tl.constexpr, HAS_B: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """Chunk q (0..P-2) of sample b walked from its entry vector."""
    q = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    w0, w1, w2, w3 = _lstm_weights(w_ptr, H, HP)
    entry = entry_ptr + (q * B + b) * 2 * H + r
    y_h = tl.load(entry, mask=vec, other=0.0)
    y_c = tl.load(entry + H, mask=vec, other=0.0)
    for i in range(0, C):
        k = q * C + C - 1 - i
        sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh = _lstm_element(
            sh_ptr, sc_ptr, hc_ptr, cc_ptr, hh_ptr, k, b, B, H, HAS_HH, HP
        )
        y_h, y_c = _lstm_walk_step(
            y_h, y_c, sh0, sh1, sh2, sh3, sc0, sc1, sc2, sc3, d_hc, d_cc, d_hh, w0, w1, w2, w3,
            offsets_ptr, out_ptr, k, b, B, H, HAS_HH, HAS_B, HP,
        )  # fmt: skip


def triton_lstm_scan(
    scales_h: Tensor,
    scales_c: Tensor,
    weights: Tensor,
    diag_hc: Tensor,
    diag_cc: Tensor,
    diag_hh: Tensor | None,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
) -> Tensor:
    """The chunked scan of an LSTM chain (``LSTMChain``'s tensors, one per sample: B, not 1).

    scales_h, scales_c (n, B, 4, H), weights (4, H, H), the diagonals (n, B, H), x_last (B, 2H),
    offsets (n, B, 2H) or None. Returns x_0..x_n as (n + 1, B, 2H).
    """
    n, batch, _, h = scales_h.shape
    p = math.ceil(n / chunk)
    out = x_last.new_empty((n + 1, batch, 2 * h))
    hp = padded(h)
    agg = x_last.new_empty((max(p - 2, 1), batch, 2 * hp, 2 * hp))  # padded: see ``_lstm_reduce``
    agg_offsets = x_last.new_empty((max(p - 2, 1), batch, 2 * hp))
    entry = x_last.new_empty((max(p - 1, 1), batch, 2 * h))
    sources = [t.contiguous() for t in (scales_h, scales_c, diag_hc, diag_cc)]
    hh = sources[2] if diag_hh is None else diag_hh.contiguous()
    common = {
        "sh_ptr": sources[0],
        "sc_ptr": sources[1],
        "hc_ptr": sources[2],
        "cc_ptr": sources[3],
        "hh_ptr": hh,
        "w_ptr": weights.contiguous(),
        "offsets_ptr": sources[0] if offsets is None else offsets.contiguous(),
        "B": batch,
        "H": h,
    }
    kernels = lstm_launch_config(diag_hh is not None, offsets is not None, hp)
    _three_launches(kernels, common, {"out_ptr": out}, x_last, n, chunk, agg, agg_offsets, entry)
    return out


# ----------------------------------------------------------------------------------------- launch


def padded(h: int) -> int:
    """H as the programs hold it: a power of two of at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(h))


def num_warps(terms: int, hp: int) -> int:
    """4 warps, or 8 where the weights pass 4096 entries (a GRU at Hp = 64), to keep them in registers."""
    return 8 if terms * hp * hp > 4096 else 4


def lstm_num_warps(hp: int) -> int:
    """4 warps, or 8 at Hp = 32, where a program holds 4 x 32^2 weights and a 64 x 32 aggregate twice."""
    return 8 if hp >= 32 else 4


class Launch(NamedTuple):
    """How one kernel of a launch is compiled: its constexprs, warps and compile settings. Everything
    else it is given (pointers, sizes, the loop bounds) is a run-time argument."""

    kernel: Any  # a ``triton.jit`` kernel (``JITFunction``, or ``InterpretedFunction`` under the interpreter)
    constexprs: dict[str, int | bool]
    num_warps: int
    num_stages: int | None = None  # None: Triton's default, loads software-pipelined over 3 stages
    maxnreg: int | None = None  # None: ptxas picks the registers per thread

    def options(self) -> dict[str, int]:
        """The compile options Triton is given: the warps, and the stages and register cap where set."""
        settings = {"num_stages": self.num_stages, "maxnreg": self.maxnreg}
        return {"num_warps": self.num_warps, **{k: v for k, v in settings.items() if v is not None}}

    def run(self, grid: tuple[int, ...], **args: Any) -> None:
        """The kernel on ``grid`` with the run-time ``args`` (by name) and these settings."""
        if not isinstance(self.kernel, triton.JITFunction):  # Triton's interpreter: see ``_BOUNDS``
            args = {k: tl.constexpr(v) if k in _BOUNDS else v for k, v in args.items()}
        self.kernel[grid](**args, **self.constexprs, **self.options())


def launch_config(
    mode: int, terms: int, has_diag: bool, has_b: bool, shift: int, fused: bool, hp: int
) -> dict[str, Launch]:
    """The three kernels of a chunked-scan launch by role (``reduce``, ``spine``, ``expand``), as
    ``_launch`` runs them and ``benchmarks.kernels`` compiles them.

    ``mode``: ``SCALES``, ``SCALES_T``, ``TANH``, ``RELU`` or ``GRU`` (the value); ``terms``: K weights;
    ``has_diag``: a diagonal term (a GRU always has one); ``has_b``: offsets; ``shift``: offsets read
    one step late (the layer modes); ``fused``: only x_0 and the deltas written; ``hp``: ``padded(H)``.
    """
    chain = {
        "K": terms,
        "HAS_DIAG": has_diag or mode == GRU.value,
        "HAS_B": has_b,
        "MODE": mode,
        "SHIFT": shift,
        "HP": hp,
    }
    walks = {**chain, "FUSED": fused}  # the kernels that walk elements and write x_k or deltas
    warps = num_warps(terms, hp)
    gru = mode == GRU.value
    # Compile settings under which no configuration keeps a value in a stack slot (tests/core/test_compile.py;
    # docs/PERFORMANCE.md, "Compiled kernels", says what each one clears): a reduce loop is not
    # software-pipelined (a step loads a few vectors against an HP x HP product), except the GRU's
    # below HP = 64 or with offsets, where unpipelined compiles took a slot; the GRU's reduce at
    # HP = 64 and its expand at HP = 16, both without offsets, get a register cap above the count at
    # which ptxas parked a value.
    unpipelined = not gru or (hp == 64 and not has_b)
    reduce = Launch(_reduce, chain, warps, 1 if unpipelined else None, 128 if gru and unpipelined else None)
    expand = Launch(_expand, walks, warps, maxnreg=64 if gru and hp == 16 and not has_b else None)
    return {"reduce": reduce, "spine": Launch(_spine, walks, warps), "expand": expand}


def lstm_launch_config(has_hh: bool, has_b: bool, hp: int) -> dict[str, Launch]:
    """The three kernels of an LSTM launch by role, as ``triton_lstm_scan`` runs them: ``has_hh``, the
    h<-h diagonal (sequences of different lengths); ``has_b``, offsets; ``hp``, ``padded(H)``."""
    settings = {"HAS_HH": has_hh, "HAS_B": has_b, "HP": hp}
    warps = lstm_num_warps(hp)
    return {
        "reduce": Launch(_lstm_reduce, settings, warps, num_stages=1),  # as ``launch_config``'s reduce
        "spine": Launch(_lstm_spine, settings, warps),
        "expand": Launch(_lstm_expand, settings, warps),
    }


class KernelConfig(NamedTuple):
    """One kernel in one configuration the modules can launch (``launch_configs``)."""

    role: str  # reduce, spine or expand
    mode: str  # SCALES, SCALES_T, TANH, RELU, GRU or LSTM
    terms: int  # K weight terms (an LSTM: its 4 gates)
    diag: bool  # HAS_DIAG; an LSTM: HAS_HH
    affine: bool  # HAS_B
    fused: bool  # a layer mode: only x_0 and the deltas written
    hidden: tuple[int, ...]  # every H this binary serves; the first is the one to compile it with
    launch: Launch


def h_variants(largest: int) -> list[tuple[int, ...]]:
    """The H values 1..``largest`` grouped by the binary they get: by ``padded(H)`` and by how Triton
    specializes the int H (1 becomes a constant; a multiple of 16 is marked divisible by 16)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for h in range(1, largest + 1):
        kind = 1 if h == 1 else 16 if h % 16 == 0 else 0
        groups.setdefault((padded(h), kind), []).append(h)
    return sorted(tuple(hs) for hs in groups.values())


def launch_configs() -> list[KernelConfig]:
    """Every kernel configuration the modules can launch, each once.

    ``triton_chunked_scan``: SCALES with K = 1, 2, 3, with and without a diagonal, and SCALES_T as
    the modules' transposed chains have it (an RNN's K = 1 with and without a diagonal, a GRU's K = 3
    with one: tangents and Newton iterations); the fused layer backwards: TANH, RELU (K = 1) and GRU
    (K = 3, a diagonal); each with and without offsets, for
    every H the kernels take (``dispatch.MAX_HIDDEN``, grouped by ``h_variants``). ``triton_lstm_scan``:
    with and without the h<-h diagonal and offsets, H <= ``dispatch.MAX_LSTM_HIDDEN``. A configuration
    whose kernel, constexprs and compile options another already has (``_reduce`` takes no ``FUSED``)
    is listed once.
    """
    from bppsa_core.dispatch import MAX_HIDDEN, MAX_LSTM_HIDDEN

    scans = [(SCALES.value, k, diag, False) for k in (1, 2, 3) for diag in (False, True)]
    scans += [
        (SCALES_T.value, 1, False, False),
        (SCALES_T.value, 1, True, False),
        (SCALES_T.value, 3, True, False),
    ]
    scans += [(TANH.value, 1, False, True), (RELU.value, 1, False, True), (GRU.value, 3, True, True)]
    found: list[KernelConfig] = []
    for hidden in h_variants(MAX_HIDDEN):
        for mode, terms, diag, fused in scans:
            for affine in (False, True):
                launches = launch_config(mode, terms, diag, affine, int(fused), fused, padded(hidden[0]))
                found += [
                    KernelConfig(role, MODE_NAMES[mode], terms, diag, affine, fused, hidden, launch)
                    for role, launch in launches.items()
                ]
    for hidden in h_variants(MAX_LSTM_HIDDEN):
        for has_hh in (False, True):
            for affine in (False, True):
                launches = lstm_launch_config(has_hh, affine, padded(hidden[0]))
                found += [
                    KernelConfig(role, "LSTM", 4, has_hh, affine, False, hidden, launch)
                    for role, launch in launches.items()
                ]
    unique: dict[tuple, KernelConfig] = {}
    for config in found:
        launch = config.launch
        key = (
            launch.kernel,
            tuple(sorted(launch.constexprs.items())),
            tuple(launch.options().items()),
            config.hidden,
        )
        unique.setdefault(key, config)
    return list(unique.values())


def triton_chunked_scan(
    scales: Tensor,
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
    diagonal: Tensor | None = None,
    transposed: bool = False,
) -> Tensor:
    """The chunked scan of ``x_k = sum_j (x_{k+1} * s_kj) @ W_j + x_{k+1} * e_k + b_k``, or with
    ``transposed`` of ``x_k = sum_j (x_{k+1} @ W_j^T) * s_kj + x_{k+1} * e_k + b_k``.

    scales (n, B or 1, K, H), weights (K, H, H), diagonal (n, B or 1, H) or None, x_last (B, H),
    offsets (n, B, H) or None. Returns x_0..x_n as (n + 1, B, H).
    """
    n, h = scales.shape[0], scales.shape[-1]
    batch = x_last.shape[0]
    s = scales.contiguous()
    sources = {"scales_ptr": s}
    if diagonal is not None:
        sources["diag_ptr"] = diagonal.expand(n, batch, h).contiguous()
    out = x_last.new_empty((n + 1, batch, h))
    rows = {"stride_k": s.stride(0) // h, "stride_b": s.stride(1) // h if s.shape[1] == batch else 0}
    mode = SCALES_T if transposed else SCALES
    _launch(sources, weights, x_last, offsets, chunk, out, mode=mode, shift=0, strides=rows)
    return out


def rnn_layer_backward(
    h: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, nonlinearity: str, chunk: int
) -> tuple[Tensor, Tensor]:
    """One tanh/relu RNN layer's backward in the kernels, with its Jacobians built in them.

    h (T, B, H) are the layer's outputs h_1..h_T, ``g_last`` (B, H) the gradient at h_T, ``u``
    (T, B, H) or None the gradient reaching h_1..h_T from outside (its last row is already in
    ``g_last``). The kernels read f'(z_t) off h_t (1 - h^2 or [h > 0]) instead of a stored chain,
    take u shifted by one step instead of a copied offset tensor, and write only what the weight
    gradients need: g_0 = dL/dh_0 (B, H) and delta_t = f'(z_t) * dL/dh_t for t = 1..T (T, B, H).
    """
    n, batch, hid = h.shape
    g0 = g_last.new_empty((1, batch, hid))
    delta = h.new_empty((n, batch, hid))
    mode = ACTIVATIONS[nonlinearity]
    _launch({"h_ptr": h.contiguous()}, w_hh, g_last, u, chunk, g0, delta, mode=mode, shift=1)
    return g0[0], delta


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
    sources = {"gi_ptr": gi.contiguous(), "gh_ptr": gh.contiguous(), "h_prev_ptr": h_prev.contiguous()}
    _launch(sources, w_hh, g_last, u, chunk, g0, deltas, mode=GRU, shift=1)
    return g0[0], deltas[..., : 3 * hid], deltas[..., 3 * hid :]


def _launch(
    sources: dict[str, Tensor],
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
    out: Tensor,
    delta: Tensor | None = None,
    *,
    mode: tl.constexpr,
    shift: int,
    strides: dict[str, int] | None = None,
) -> None:
    """The three launches (one, ``_spine``, for a chain of a single chunk), by keyword.

    ``sources``: the mode's source tensors by pointer name (``SOURCES``; contiguous, one row per
    element); the others are never read. ``weights``: the K stacked H x H weights, (K, H, H) or
    (K * H, H) (a GRU's W_hh). ``delta``: where a layer mode writes its deltas (``out`` then gets
    only x_0); None writes every x_k into ``out``. ``strides``: the scales' element and batch
    strides in rows of H (SCALES and SCALES_T modes).
    """
    first = next(iter(sources.values()))
    n, (batch, h) = first.shape[0], x_last.shape
    terms = weights.numel() // (h * h)
    hp = padded(h)
    p = math.ceil(n / chunk)
    agg = first.new_empty((max(p - 2, 1), batch, hp, hp))  # HP x HP: see ``_reduce``
    agg_offsets = first.new_empty((max(p - 2, 1), batch, hp))  # every row read is written by _reduce
    entry = first.new_empty((max(p - 1, 1), batch, h))
    common = {
        **dict.fromkeys(SOURCES, first),  # placeholders for the pointers this mode does not read
        **sources,
        "w_ptr": weights.contiguous(),
        "offsets_ptr": first if offsets is None else offsets.contiguous(),
        "B": batch,
        "H": h,
        **(strides or {"stride_k": 0, "stride_b": 0}),
    }
    walk = {"out_ptr": out, "delta_ptr": out if delta is None else delta}
    kernels = launch_config(
        mode.value, terms, "diag_ptr" in sources, offsets is not None, shift, delta is not None, hp
    )
    _three_launches(kernels, common, walk, x_last, n, chunk, agg, agg_offsets, entry)


def _three_launches(
    kernels: dict[str, Launch],
    common: dict[str, Any],
    walk: dict[str, Tensor],
    x_last: Tensor,
    n: int,
    chunk: int,
    agg: Tensor,
    agg_offsets: Tensor,
    entry: Tensor,
) -> None:
    """Reduce (chunks 1..P-2), spine and expand (chunks 0..P-2) of a chain of n elements: ``common``
    the arguments all three take, ``walk`` the outputs the spine and the expand write."""
    batch = x_last.shape[0]
    p = math.ceil(n / chunk)
    if p > 2:
        kernels["reduce"].run((p - 2, batch), **common, agg_ptr=agg, agg_offsets_ptr=agg_offsets, C=chunk)
    kernels["spine"].run(
        (batch,),
        **common,
        **walk,
        agg_ptr=agg,
        agg_offsets_ptr=agg_offsets,
        x_last_ptr=x_last.contiguous(),
        entry_ptr=entry,
        N=n,
        REM=n - (p - 1) * chunk,
        NAGG=max(p - 2, 0),
    )
    if p > 1:
        kernels["expand"].run((p - 1, batch), **common, **walk, entry_ptr=entry, C=chunk)
