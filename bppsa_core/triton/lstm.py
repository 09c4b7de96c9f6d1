"""The chunked scan of an LSTM's chain (``LSTMChain``, state (h, c) of 2H) in three Triton kernels,
with its plain-PyTorch reference beside it (``lstm_scan_ref``).

``_lstm_reduce``, ``_lstm_spine`` and ``_lstm_expand`` are organised as the factored chain's kernels
(``bppsa_core.triton.chunk_scan``): a program holds the four gates' H x H weights and an aggregate as
two (2H x H) column blocks, the h and the c columns; a step is two ``tl.dot`` for the h columns (the
four gates' terms summed into each row block of the element first) and two elementwise products for
the c columns. The chain fits one program when 2H <= 64
(``dispatch.lstm_kernels_take``). The kernels read an element from the tuple ``src_ptrs`` =
(scales_h, scales_c, diag_hc, diag_cc[, diag_hh]).

``lstm_layer_backward`` is an LSTM layer's whole backward in the same kernels (``FUSED``): they read
the activated gates and the cell states instead (``src_ptrs`` = (gates, cells)), form each element's
factors from them as ``LSTMCell.factors`` does, take the outside gradient one step late, and write only
g_0 and the gates' pre-activation gradients, as ``chunk_scan``'s fused RNN and GRU backwards do.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from bppsa_core.chain import LSTMChain
from bppsa_core.jacobians import LSTMCell
from bppsa_core.scan import chunked_scan, elementwise_recurrence
from bppsa_core.triton.chunk_scan import _shifted
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

# ------------------------------------------------------------------------------ per-element helpers


@triton.jit
def _lstm_weights(w_ptr, H, HP: tl.constexpr):
    """The four gates' H x H weights (W_i, W_f, W_g, W_o), padded to HP x HP, as a tuple."""
    r = tl.arange(0, HP)
    mat = (r < H)[:, None] & (r < H)[None, :]
    offs = r[:, None] * H + r[None, :]
    w0 = tl.load(w_ptr + offs, mask=mat, other=0.0)
    w1 = tl.load(w_ptr + H * H + offs, mask=mat, other=0.0)
    w2 = tl.load(w_ptr + 2 * H * H + offs, mask=mat, other=0.0)
    w3 = tl.load(w_ptr + 3 * H * H + offs, mask=mat, other=0.0)
    return w0, w1, w2, w3


@triton.jit
def _lstm_element(
    src_ptrs, offsets_ptr, k, b, B, H, HAS_HH: tl.constexpr, HAS_B: tl.constexpr, FUSED: tl.constexpr,
    HP: tl.constexpr,
):  # fmt: skip
    """Element k of sample b: the four gates' h scales, their c scales (each a tuple of four), the
    diagonals h<-c, c<-c, h<-h, and its offset (h part, c part; zeros without HAS_B), none of it
    depending on the vectors a loop carries, so the loops read each element a step ahead (as
    ``chunk_scan``'s do). FUSED: formed from the activated gates i, f, g, o (n, B, 4H) and the
    cell states c_0..c_n (n + 1, B, H) as ``LSTMCell.factors`` forms them (with q = o (1 - tanh(c)^2):
    c's scales g i (1-i), c_{k} f (1-f), i (1-g^2), 0; h's q times those but tanh(c) o (1-o) for W_o;
    diagonals q f and f); padded lanes read 0 and give 0."""
    k = k.to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    if FUSED:
        rows = (k * B + b) * 4 * H + r
        i = tl.load(src_ptrs[0] + rows, mask=vec, other=0.0)
        f = tl.load(src_ptrs[0] + rows + H, mask=vec, other=0.0)
        g = tl.load(src_ptrs[0] + rows + 2 * H, mask=vec, other=0.0)
        o = tl.load(src_ptrs[0] + rows + 3 * H, mask=vec, other=0.0)
        c_prev = tl.load(src_ptrs[1] + (k * B + b) * H + r, mask=vec, other=0.0)
        c = tl.load(src_ptrs[1] + ((k + 1) * B + b) * H + r, mask=vec, other=0.0)
        tc = 2.0 * tl.sigmoid(2.0 * c) - 1.0  # tanh
        q = o * (1.0 - tc * tc)
        sc = (g * i * (1.0 - i), c_prev * f * (1.0 - f), i * (1.0 - g * g), tl.zeros([HP], dtype=tl.float32))
        sh = (q * sc[0], q * sc[1], q * sc[2], tc * o * (1.0 - o))
        d_hc = q * f
        d_cc = f
    else:
        sh, sc, d_hc, d_cc = _lstm_stored(src_ptrs, k * B + b, H, r, vec)
    d_hh = tl.zeros([HP], dtype=tl.float32)
    if HAS_HH:
        d_hh = tl.load(src_ptrs[4] + (k * B + b) * H + r, mask=vec, other=0.0)
    off = (tl.zeros([HP], dtype=tl.float32), tl.zeros([HP], dtype=tl.float32))
    if HAS_B:
        off = _lstm_offset(offsets_ptr, k, b, B, H, r, vec, FUSED, HP)
    return sh, sc, d_hc, d_cc, d_hh, off


@triton.jit
def _lstm_stored(src_ptrs, kb, H, r, vec):
    """Row kb = k B + b of a stored chain: its scales (n, B, 4H) and its diagonals h<-c, c<-c (n, B, H)."""
    rows = kb * 4 * H + r
    sh = (
        tl.load(src_ptrs[0] + rows, mask=vec, other=0.0),
        tl.load(src_ptrs[0] + rows + H, mask=vec, other=0.0),
        tl.load(src_ptrs[0] + rows + 2 * H, mask=vec, other=0.0),
        tl.load(src_ptrs[0] + rows + 3 * H, mask=vec, other=0.0),
    )
    sc = (
        tl.load(src_ptrs[1] + rows, mask=vec, other=0.0),
        tl.load(src_ptrs[1] + rows + H, mask=vec, other=0.0),
        tl.load(src_ptrs[1] + rows + 2 * H, mask=vec, other=0.0),
        tl.load(src_ptrs[1] + rows + 3 * H, mask=vec, other=0.0),
    )
    row = kb * H + r
    d_hc = tl.load(src_ptrs[2] + row, mask=vec, other=0.0)
    d_cc = tl.load(src_ptrs[3] + row, mask=vec, other=0.0)
    return sh, sc, d_hc, d_cc


@triton.jit
def _lstm_mat_step(a_h, a_c, f, w, HAS_HH: tl.constexpr, DOT: tl.constexpr):
    """(a_h | a_c) @ M for one element (its factors ``f``, ``_lstm_element``): rows of the aggregate,
    its h columns and its c columns; ``DOT``: the products' precision (``launch.dot_precision``).
    The gates' terms are summed into M's two row blocks first, sum_g diag(s_g) W_g for the h rows
    and for the c rows, so that a step is two HP x HP products, not four (compiled by
    ``python -m benchmarks.kernels``)."""
    sh, sc, d_hc, d_cc, d_hh = f[0], f[1], f[2], f[3], f[4]
    m_h = sh[0][:, None] * w[0] + sh[1][:, None] * w[1] + sh[2][:, None] * w[2] + sh[3][:, None] * w[3]
    m_c = sc[0][:, None] * w[0] + sc[1][:, None] * w[1] + sc[2][:, None] * w[2] + sc[3][:, None] * w[3]
    out_h = tl.dot(a_h, m_h, input_precision=DOT)
    out_h += tl.dot(a_c, m_c, input_precision=DOT)
    if HAS_HH:
        out_h += a_h * d_hh[None, :]
    out_c = a_h * d_hc[None, :] + a_c * d_cc[None, :]
    return out_h, out_c


@triton.jit
def _lstm_vec_step(y_h, y_c, f, w, HAS_HH: tl.constexpr):
    """(y_h | y_c) @ M for one element and one row vector: the gates' products summed before the one
    reduction across the lanes, which the walks wait on every step."""
    sh, sc, d_hc, d_cc, d_hh = f[0], f[1], f[2], f[3], f[4]
    p = (y_h * sh[0] + y_c * sc[0])[:, None] * w[0]
    p += (y_h * sh[1] + y_c * sc[1])[:, None] * w[1]
    p += (y_h * sh[2] + y_c * sc[2])[:, None] * w[2]
    p += (y_h * sh[3] + y_c * sc[3])[:, None] * w[3]
    out_h = tl.sum(p, axis=0)
    if HAS_HH:
        out_h += y_h * d_hh
    return out_h, y_h * d_hc + y_c * d_cc


@triton.jit
def _lstm_offset(offsets_ptr, k, b, B, H, r, vec, FUSED: tl.constexpr, HP: tl.constexpr):
    """Element k's offset (h part, c part): row k of the (n, B, 2H) offsets; FUSED, the outside
    gradient u (n, B, H) one step late, u_{k-1} for h (none for k = 0) and 0 for c."""
    k = k.to(tl.int64)
    if FUSED:
        o_h = tl.load(offsets_ptr + ((k - 1) * B + b) * H + r, mask=vec & (k >= 1), other=0.0)
        o_c = tl.zeros([HP], dtype=tl.float32)
    else:
        row = offsets_ptr + (k * B + b) * 2 * H + r
        o_h = tl.load(row, mask=vec, other=0.0)
        o_c = tl.load(row + H, mask=vec, other=0.0)
    return o_h, o_c


@triton.jit
def _lstm_aggregate(agg_ptr, agg_offsets_ptr, j, b, B, r, mat, vec, HP: tl.constexpr):
    """Aggregate j of sample b as ``_lstm_reduce`` stored it (2HP x 2HP), read masked: its h<-h, c<-h,
    h<-c and c<-c blocks and its offset's h and c parts."""
    base = agg_ptr + ((j * B + b) * 2 * HP + r[:, None]) * 2 * HP + r[None, :]
    off = agg_offsets_ptr + (j * B + b) * 2 * HP + r
    return (
        tl.load(base, mask=mat, other=0.0),
        tl.load(base + HP, mask=mat, other=0.0),
        tl.load(base + HP * 2 * HP, mask=mat, other=0.0),
        tl.load(base + HP * 2 * HP + HP, mask=mat, other=0.0),
        tl.load(off, mask=vec, other=0.0),
        tl.load(off + HP, mask=vec, other=0.0),
    )


@triton.jit
def _lstm_walk_step(
    y_h, y_c, f, w, out_ptr, delta_ptr, k, b, B, H, HAS_HH: tl.constexpr, HAS_B: tl.constexpr,
    FUSED: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """x_k from y = x_{k+1} through element k, stored into row k of ``out``; FUSED, only x_0 is
    stored (``out`` (B, 2H)) and step k's pre-activation gradients y_h * scales_h + y_c * scales_c
    (rows i, f, g, o of ``delta`` (n, B, 4H))."""
    r = tl.arange(0, HP)
    vec = r < H
    x_h, x_c = _lstm_vec_step(y_h, y_c, f, w, HAS_HH)
    k = k.to(tl.int64)
    if HAS_B:
        x_h += f[5][0]
        x_c += f[5][1]
    if FUSED:
        sh, sc = f[0], f[1]
        row = delta_ptr + (k * B + b) * 4 * H + r
        tl.store(row, y_h * sh[0] + y_c * sc[0], mask=vec)
        tl.store(row + H, y_h * sh[1] + y_c * sc[1], mask=vec)
        tl.store(row + 2 * H, y_h * sh[2] + y_c * sc[2], mask=vec)
        tl.store(row + 3 * H, y_h * sh[3] + y_c * sc[3], mask=vec)
        tl.store(out_ptr + b * 2 * H + r, x_h, mask=vec & (k == 0))
        tl.store(out_ptr + b * 2 * H + H + r, x_c, mask=vec & (k == 0))
    else:
        out = out_ptr + (k * B + b) * 2 * H + r
        tl.store(out, x_h, mask=vec)
        tl.store(out + H, x_c, mask=vec)
    return x_h, x_c


@triton.jit
def _lstm_walk(
    y_h, y_c, last, count, src_ptrs, w, offsets_ptr, out_ptr, delta_ptr, b, B, H, HAS_HH: tl.constexpr,
    HAS_B: tl.constexpr, FUSED: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """(y_h, y_c) walked down through elements ``last``, ``last - 1``, ... (``count`` of them), each
    read a step ahead (the last read a spare copy of element 0), as ``chunk_scan._walk``; each step's
    x or deltas stored (``_lstm_walk_step``); the pair past the last returned."""
    f = _lstm_element(src_ptrs, offsets_ptr, last, b, B, H, HAS_HH, HAS_B, FUSED, HP)
    for i in range(0, count):
        k = last - i
        f_next = _lstm_element(src_ptrs, offsets_ptr, tl.maximum(k - 1, 0), b, B, H, HAS_HH, HAS_B, FUSED, HP)
        y_h, y_c = _lstm_walk_step(y_h, y_c, f, w, out_ptr, delta_ptr, k, b, B, H, HAS_HH, HAS_B, FUSED, HP)
        f = f_next
    return y_h, y_c


# ------------------------------------------------------------------------------------------ kernels


@triton.jit(do_not_specialize=BY_DATA)
def _lstm_reduce(
    src_ptrs, w_ptr, offsets_ptr, agg_ptr, agg_offsets_ptr,  # pointers: read, then the aggregates written
    B, H, C,  # sizes: batch, hidden, chunk
    HAS_HH: tl.constexpr, HAS_B: tl.constexpr, FUSED: tl.constexpr, HP: tl.constexpr,  # meta-parameters
    DOT: tl.constexpr,
):  # fmt: skip
    """Chunk q (1..P-2) of sample b folded into one (2H x 2H) aggregate and its offset."""
    q = tl.program_id(0) + 1
    b = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, HP)
    rr = tl.arange(0, 2 * HP)  # the aggregate's rows: h rows, then c rows
    w = _lstm_weights(w_ptr, H, HP)
    a_h = tl.where(rr[:, None] == r[None, :], 1.0, 0.0)
    a_c = tl.where(rr[:, None] == r[None, :] + HP, 1.0, 0.0)
    o_h = tl.zeros([HP], dtype=tl.float32)
    o_c = tl.zeros([HP], dtype=tl.float32)
    last = q * C + C - 1
    f = _lstm_element(src_ptrs, offsets_ptr, last, b, B, H, HAS_HH, HAS_B, FUSED, HP)
    for i in range(0, C):  # the chunk's last element is applied first; the one before it is in the chain
        k = last - i
        f_next = _lstm_element(src_ptrs, offsets_ptr, k - 1, b, B, H, HAS_HH, HAS_B, FUSED, HP)
        a_h, a_c = _lstm_mat_step(a_h, a_c, f, w, HAS_HH, DOT)
        if HAS_B:
            o_h, o_c = _lstm_vec_step(o_h, o_c, f, w, HAS_HH)
            o_h += f[5][0]
            o_c += f[5][1]
        f = f_next
    j = q - 1
    # Stored whole, padding included (2HP x 2HP: h rows, c rows; h columns, c columns), as ``_reduce``.
    base = agg_ptr + ((j * B + b) * 2 * HP + rr[:, None]) * 2 * HP
    tl.store(base + r[None, :], a_h)
    tl.store(base + HP + r[None, :], a_c)
    out = agg_offsets_ptr + (j * B + b) * 2 * HP + r
    tl.store(out, o_h)
    tl.store(out + HP, o_c)


@triton.jit(do_not_specialize=BY_DATA)
def _lstm_spine(
    # pointers: the sources, weights, offsets, aggregates and x_n read; x (or x_0 and the deltas) and
    # the entry vectors written
    src_ptrs, w_ptr, offsets_ptr, agg_ptr, agg_offsets_ptr, x_last_ptr, out_ptr, delta_ptr, entry_ptr,
    B, H, N, REM, NAGG,  # sizes: batch, hidden, chain length, remainder chunk, aggregate count
    HAS_HH: tl.constexpr, HAS_B: tl.constexpr, FUSED: tl.constexpr, HP: tl.constexpr,  # meta-parameters
):  # fmt: skip
    """``_spine`` of the factored chain over (h, c): sample b's remainder chunk walked from x_n, then
    the chunk aggregates scanned into ``entry``."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w = _lstm_weights(w_ptr, H, HP)
    y_h = tl.load(x_last_ptr + b * 2 * H + r, mask=vec, other=0.0)
    y_c = tl.load(x_last_ptr + b * 2 * H + H + r, mask=vec, other=0.0)
    if not FUSED:
        last = out_ptr + (N * B + b) * 2 * H + r
        tl.store(last, y_h, mask=vec)
        tl.store(last + H, y_c, mask=vec)
    y_h, y_c = _lstm_walk(
        y_h, y_c, N - 1, REM, src_ptrs, w, offsets_ptr, out_ptr, delta_ptr, b, B, H, HAS_HH, HAS_B, FUSED, HP
    )
    entry = entry_ptr + (NAGG * B + b) * 2 * H + r
    tl.store(entry, y_h, mask=vec)
    tl.store(entry + H, y_c, mask=vec)
    a = _lstm_aggregate(agg_ptr, agg_offsets_ptr, tl.maximum(NAGG - 1, 0), b, B, r, mat, vec, HP)
    for i in range(0, NAGG):  # aggregates of chunks P-2 .. 1, each read a step ahead
        j = NAGG - 1 - i
        a_next = _lstm_aggregate(agg_ptr, agg_offsets_ptr, tl.maximum(j - 1, 0), b, B, r, mat, vec, HP)
        a_hh, a_hc, a_ch, a_cc, o_h, o_c = a
        new_h = tl.sum(y_h[:, None] * a_hh + y_c[:, None] * a_ch, axis=0) + o_h
        new_c = tl.sum(y_h[:, None] * a_hc + y_c[:, None] * a_cc, axis=0) + o_c
        y_h = new_h
        y_c = new_c
        a = a_next
        entry = entry_ptr + (j * B + b) * 2 * H + r
        tl.store(entry, y_h, mask=vec)
        tl.store(entry + H, y_c, mask=vec)


@triton.jit(do_not_specialize=BY_DATA)
def _lstm_expand(
    src_ptrs, w_ptr, offsets_ptr, entry_ptr, out_ptr, delta_ptr,  # pointers: read, then x (or deltas) written
    B, H, C,  # sizes: batch, hidden, chunk
    HAS_HH: tl.constexpr, HAS_B: tl.constexpr, FUSED: tl.constexpr, HP: tl.constexpr,  # meta-parameters
):  # fmt: skip
    """Chunk q (0..P-2) of sample b walked from its entry vector, every x_k of the chunk written
    (the entry vectors come from ``_lstm_spine``)."""
    q = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    w = _lstm_weights(w_ptr, H, HP)
    entry = entry_ptr + (q * B + b) * 2 * H + r
    y_h = tl.load(entry, mask=vec, other=0.0)
    y_c = tl.load(entry + H, mask=vec, other=0.0)
    _lstm_walk(
        y_h, y_c, q * C + C - 1, C, src_ptrs, w, offsets_ptr, out_ptr, delta_ptr, b, B, H, HAS_HH, HAS_B,
        FUSED, HP,
    )  # fmt: skip


@triton.jit
def _linear_pair(a1, b1, a2, b2):
    """x -> a1 x + b1, then x -> a2 x + b2, as one map: (a1 a2, b1 a2 + b2)."""
    return a1 * a2, b1 * a2 + b2


@triton.jit(do_not_specialize=BY_DATA)
def _lstm_cells(
    gates_ptr, c0_ptr, cells_ptr,  # pointers: the activated gates and c_0 read; c_0..c_T written
    T, B, H,  # sizes: steps, batch, hidden
    TB: tl.constexpr, HP: tl.constexpr,  # meta-parameters: steps a tile, padded H
):  # fmt: skip
    """Sample b's cell states c_t = f_t c_{t-1} + i_t g_t, t = 1..T, from c_0: tiles of TB steps,
    each solved at once as a scan of affine maps (``tl.associative_scan``) and started from the
    last state of the tile before, so the dependent chain is T / TB tiles of log TB steps."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    steps = tl.arange(0, TB)
    c = tl.load(c0_ptr + b * H + r, mask=vec, other=0.0)
    tl.store(cells_ptr + b * H + r, c, mask=vec)
    for t0 in range(0, T, TB):
        t = (t0 + steps).to(tl.int64)
        ok = (t < T)[:, None] & vec[None, :]
        row = gates_ptr + (t[:, None] * B + b) * 4 * H + r[None, :]
        i = tl.load(row, mask=ok, other=0.0)
        f = tl.load(row + H, mask=ok, other=0.0)
        g = tl.load(row + 2 * H, mask=ok, other=0.0)
        prod, add = tl.associative_scan((f, i * g), 0, _linear_pair)
        tile = prod * c[None, :] + add
        tl.store(cells_ptr + ((t[:, None] + 1) * B + b) * H + r[None, :], tile, mask=ok)
        last = tl.minimum(T - t0, TB) - 1
        c = tl.sum(tl.where(steps[:, None] == last, tile, 0.0), axis=0)


@triton.jit(do_not_specialize=("N", "H"))
def _lstm_gates(
    pre_ptr, b_ptr,  # pointers: the gates' pre-activations, activated in place; b_hh (read where HAS_B)
    N, H,  # sizes: T B 4H elements, hidden
    HAS_B: tl.constexpr, BLOCK: tl.constexpr,  # meta-parameters: b_hh given, elements a program
):  # fmt: skip
    """The gates i, f, g, o from their pre-activations (rows of 4H), in place: b_hh added where
    given, then the sigmoid, and for g tanh (2 sigmoid(2 z) - 1, as ``_lstm_element``'s)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    z = tl.load(pre_ptr + idx, mask=ok, other=0.0)
    col = idx % (4 * H)
    if HAS_B:
        z += tl.load(b_ptr + col, mask=ok, other=0.0)
    is_g = (col >= 2 * H) & (col < 3 * H)
    s = tl.sigmoid(tl.where(is_g, 2.0 * z, z))
    tl.store(pre_ptr + idx, tl.where(is_g, 2.0 * s - 1.0, s), mask=ok)


# ------------------------------------------------------------------------------------------- launch


GATE_BLOCK = 1024  # elements a program of ``_lstm_gates`` takes (4 a thread at 8 warps)
# Steps of a tile of ``_lstm_cells``: its dependent chain is T / CELL_STEPS tiles of log2(CELL_STEPS)
# combines; a tile's gates (3 x CELL_STEPS x HP numbers) stay in registers.
CELL_STEPS = 64


def lstm_num_warps(hp: int) -> int:
    """4 warps, or 8 at Hp = 32, where a program holds 4 x 32^2 weights and a 64 x 32 aggregate twice."""
    return 8 if hp >= 32 else 4


@cache  # made once per configuration (read, never changed): a layer backward's host work counts
def lstm_launch_config(
    has_hh: bool,
    has_b: bool,
    hp: int,
    fused: bool = False,
    dot: str = DOT_PRECISION,
    walk_warps: int | None = None,
) -> dict[str, Launch]:
    """The three kernels of an LSTM launch by role, as ``lstm_scan`` and ``lstm_layer_backward`` run
    them: ``has_hh``, the h<-h diagonal (sequences of different lengths); ``has_b``, offsets; ``hp``,
    ``padded(H)``; ``fused``, a layer's backward (factors from the gates and cell states); ``dot``, the
    reduce's ``tl.dot`` precision (``launch.dot_precision``); ``walk_warps``, the spine's and the
    expand's warps (``launch.walk_warps``), at least 2 at HP = 32, where on 1 the spine spills."""
    settings = {"HAS_HH": has_hh, "HAS_B": has_b, "FUSED": fused, "HP": hp}
    warps = lstm_num_warps(hp)
    sources = 2 if fused else 5 if has_hh else 4
    reduce = {**settings, "DOT": dot}  # the one kernel with matrix products
    # the reduce unpipelined, as ``chunk_scan.launch_config``'s; at HP = 16 with a register cap: left
    # to itself, ptxas kept it at 72 registers on sm_80 with a stack slot, and at 128 some compiles
    # spilled (python -m benchmarks.kernels)
    cap = 192 if hp == 16 else None
    walk_num_warps = warps if walk_warps is None else max(walk_warps, hp // 16)
    launches = {
        "reduce": Launch(_lstm_reduce, reduce, warps, num_stages=1, maxnreg=cap, sources=sources),
        "spine": Launch(_lstm_spine, settings, walk_num_warps, maxnreg=spine_cap(hp), sources=sources),
        "expand": Launch(_lstm_expand, settings, walk_num_warps, sources=sources),
    }
    if fused:  # the cell states first, from the gates
        launches["cells"] = _cells_launch(hp)
    return launches


def spine_cap(hp: int, release: tuple[int, ...] | None = None) -> int | None:
    """``_lstm_spine``'s register cap under Triton ``release`` (None: the installed one): none; but 255
    at HP = 32 from Triton 3.8, whose ptxas holds the spine on 8 warps to 128 registers with a stack
    slot where it needs about 150 (python -m benchmarks.kernels)."""
    return 255 if hp == 32 and triton_from((3, 8), release) else None


@cache
def gates_launch(has_b: bool) -> Launch:
    """``_lstm_gates``, with b_hh or without (a layer with no biases): one binary for any H, 8 warps."""
    return Launch(_lstm_gates, {"HAS_B": has_b, "BLOCK": GATE_BLOCK}, 8)


@cache
def _cells_launch(hp: int) -> Launch:
    """``_lstm_cells`` at ``hp`` = ``padded(H)``: tiles of CELL_STEPS steps, 4 warps."""
    return Launch(_lstm_cells, {"TB": CELL_STEPS, "HP": hp}, 4)


def _launch(
    sources: tuple[Tensor, ...],
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
    walk: dict[str, Tensor],
    *,
    has_hh: bool = False,
    fused: bool = False,
) -> None:
    """The three launches of a chain of ``sources[0].shape[0]`` elements over (h, c), by keyword, as
    ``chunk_scan._launch`` for the factored chains: ``weights`` the four gates' (H, H) blocks stacked,
    x_last (B, 2H), ``walk`` the tensors the spine and the expand write (``out_ptr``, ``delta_ptr``)."""
    n, (batch, two_h) = sources[0].shape[0], x_last.shape
    h = two_h // 2
    hp = padded(h)  # the aggregates 2HP x 2HP: see ``_lstm_reduce``
    common = chain_args(sources, weights, offsets, batch, h)
    kernels = lstm_launch_config(has_hh, offsets is not None, hp, fused, dot_precision(), walk_warps_set())
    three_launches(kernels, common, walk, x_last, n, chunk, 2 * hp)


# ------------------------------------------------------------------------------ entry point and ref


def lstm_scan(chain: LSTMChain, x_last: Tensor, offsets: Tensor | None, chunk: int) -> Tensor:
    """The chunked scan of an LSTM chain (not transposed).

    ``chain``: scales_h, scales_c (n, B or 1, 4, H), weights (4, H, H), the diagonals (n, B or 1, H);
    x_last (B, 2H), offsets (n, B, 2H) or None. Returns x_0..x_n as (n + 1, B, 2H).
    """
    n, batch = chain.length, x_last.shape[0]
    out = x_last.new_empty((n + 1, batch, x_last.shape[1]))
    tensors = [chain.scales_h, chain.scales_c, chain.diag_hc, chain.diag_cc, chain.diag_hh]
    sources = tuple(t.expand(n, batch, *t.shape[2:]).contiguous() for t in tensors if t is not None)
    walk = {"out_ptr": out, "delta_ptr": out}  # no deltas: not written
    _launch(sources, chain.weights, x_last, offsets, chunk, walk, has_hh=chain.diag_hh is not None)
    return out


def lstm_scan_ref(chain: LSTMChain, x_last: Tensor, offsets: Tensor | None, chunk: int) -> Tensor:
    """``lstm_scan`` in plain PyTorch: ``bppsa_core.scan.chunked_scan``, the chunked twin."""
    return chunked_scan(chain, x_last, offsets, chunk=chunk)


def lstm_layer_backward(
    gates: Tensor, cells: Tensor, w_hh: Tensor, g_h: Tensor, g_c: Tensor, u: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """One LSTM layer's backward in the kernels, its elements formed in them (``cells`` from
    ``lstm_cells``).

    ``gates`` (T, B, 4, H): the activated gates i, f, g, o of steps 1..T (``LSTMCell.activations``);
    ``cells`` (T + 1, B, H): c_0..c_T; ``w_hh`` (4H, H); ``g_h``, ``g_c`` (B, H): the gradients at h_T
    and c_T; ``u`` (T, B, H) or None: the gradient reaching h_1..h_T from outside (its last row
    already in ``g_h``). Returns g_0 = (dL/dh_0, dL/dc_0) (B, 2H) and the gates' pre-activation
    gradients (T, B, 4H), shared by the input and hidden sides.
    """
    n, batch, _, h = gates.shape
    g0 = gates.new_empty((batch, 2 * h))
    delta = gates.new_empty((n, batch, 4 * h))
    sources = (gates.contiguous(), cells.contiguous())
    walk = {"out_ptr": g0, "delta_ptr": delta}
    _launch(sources, w_hh, torch.cat((g_h, g_c), -1), u, chunk, walk, fused=True)  # w_hh: (4H, H) blocks
    return g0, delta


def lstm_layer_backward_ref(
    gates: Tensor, cells: Tensor, w_hh: Tensor, g_h: Tensor, g_c: Tensor, u: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """``lstm_layer_backward`` in plain PyTorch: the factors as ``LSTMCell`` forms them, the chain
    scanned (``chunked_scan``), then the pre-activation gradients."""
    cell = LSTMCell()
    steps, batch, _, hidden = gates.shape
    scales_h, scales_c = (gates.new_empty((steps, batch, 4, hidden)) for _ in range(2))
    diag_hc, diag_cc = (gates.new_empty((steps, batch, hidden)) for _ in range(2))
    cell._factors(gates.unbind(-2), cells[:-1], cells[1:], scales_h, scales_c, diag_hc, diag_cc)
    factors = (scales_h, scales_c, diag_hc, diag_cc)
    chain = LSTMChain(scales_h, scales_c, w_hh.reshape(4, hidden, hidden), diag_hc, diag_cc)
    offsets = None if u is None else torch.cat((_shifted(u), torch.zeros_like(u)), -1)
    g = chunked_scan(chain, torch.cat((g_h, g_c), -1), offsets, chunk=chunk)
    return g[0], cell.preactivation_grads(g[1:], factors)[0]


def lstm_gates(pre: Tensor, b_hh: Tensor | None) -> Tensor:
    """An LSTM layer's gates i, f, g, o (T, B, 4, H) from their pre-activations without b_hh
    (T, B, 4H, contiguous: ``LSTMCell.gate_sums``), made in place: b_hh added, the sigmoid, tanh
    for g (``_lstm_gates``), one launch where PyTorch's ops take four."""
    if not pre.is_contiguous():
        raise ValueError("the gates' pre-activations must be contiguous: they are activated in place")
    n, hidden = pre.numel(), pre.shape[-1] // 4
    gates_launch(b_hh is not None).run(
        (triton.cdiv(n, GATE_BLOCK),),
        pre_ptr=pre,
        b_ptr=pre if b_hh is None else b_hh.contiguous(),  # not read without b_hh
        N=n,
        H=hidden,
    )
    return pre.unflatten(-1, (4, hidden))


def lstm_gates_ref(pre: Tensor, b_hh: Tensor | None) -> Tensor:
    """``lstm_gates`` in plain PyTorch (a new tensor): ``LSTMCell.activations``' activation."""
    z = (pre if b_hh is None else pre + b_hh).unflatten(-1, (4, pre.shape[-1] // 4))
    gates = torch.sigmoid(z)
    gates[..., 2, :] = torch.tanh(z[..., 2, :])
    return gates


def lstm_cells(gates: Tensor, c0: Tensor) -> Tensor:
    """An LSTM layer's cell states c_0..c_T (T + 1, B, H) from its activated gates (T, B, 4, H) and
    c_0 (B, H): ``c_t = f_t c_{t-1} + i_t g_t`` (``_lstm_cells``, one program a sample)."""
    steps, batch, _, hidden = gates.shape
    cells = gates.new_empty((steps + 1, batch, hidden))
    _cells_launch(padded(hidden)).run(
        (batch,),
        gates_ptr=gates.contiguous(),
        c0_ptr=c0.contiguous(),
        cells_ptr=cells,
        T=steps,
        B=batch,
        H=hidden,
    )
    return cells


def lstm_cells_ref(gates: Tensor, c0: Tensor) -> Tensor:
    """``lstm_cells`` in plain PyTorch: ``scan.elementwise_recurrence``."""
    i, f, g, _ = gates.unbind(-2)
    return torch.cat((c0.unsqueeze(0), elementwise_recurrence(f, i * g, c0)))
