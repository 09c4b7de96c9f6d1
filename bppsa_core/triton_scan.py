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

The kernels read an element's factors in one of four modes (``_element``):

* ``SCALES``: a stored ``FactoredChain`` (``triton_chunked_scan``);
* ``TANH``, ``RELU``: a tanh/relu RNN layer's backward (``rnn_layer_backward``), f'(z_t) read off
  the layer's output h_t (1 - h_t^2 or [h_t > 0]);
* ``GRU``: a GRU layer's backward (``gru_layer_backward``), the gates r, z, n recomputed from the two
  pre-activation GEMMs W_ih x + b_ih and W_hh h + b_hh and from h_{t-1}.

In the layer modes the kernels also take the outside gradient shifted by one step (no offsets copy)
and write only what the weight gradients need: g_0 and the pre-activation gradients (deltas) of
every step, instead of every g_t. So the chain, the offsets copy and the delta pass never touch
memory; the weight gradients stay GEMMs over the deltas (see ``rnn_layer_backward``).

Loop bounds (chunk size, remainder, aggregate count) are compile-time constants: one compilation
per sequence length and chunk size, which a training run keeps fixed (and Triton's interpreter
cannot take a run-time loop bound with NumPy 2.4). H is padded to a power of two of at least 16
(``tl.dot``'s minimum) inside the programs, and the K weight matrices stay in registers, so a chain
fits one program when H <= 64 (a GRU's 3 x 64^2 weights run on 8 warps instead of 4, which keeps
them at 48 registers a thread; whether that is also fast is for the GPU benchmark to show).
``tl.dot`` runs with ``input_precision="ieee"`` (full fp32: TF32's ~1e-3 error would exceed the
gradient tolerances). Elements shared by the batch are read with a batch stride of 0, never copied;
offsets into memory are 64-bit, so tensors of more than 2^31 elements are indexed correctly.
Everything is checked against the twin on the CPU with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_TERMS = 3
MAX_HIDDEN = 64  # the K padded H x H weights stay in one program's registers
SCALES, TANH, RELU, GRU = 0, 1, 2, 3  # how ``_element`` reads an element's factors
ACTIVATIONS = {"tanh": TANH, "relu": RELU}


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
def _element(
    f0_ptr,
    f1_ptr,
    f2_ptr,
    k,
    b,
    B,
    H,
    S_K,
    S_B,
    K: tl.constexpr,
    HAS_E: tl.constexpr,
    MODE: tl.constexpr,
    HP: tl.constexpr,
):
    """Element k of sample b: its scales (s0, s1, s2) for W_0..W_2, its diagonal e, and dn.

    SCALES: f0 holds the scales (strides S_K, S_B), f1 the diagonal. TANH/RELU: f0 holds h (strides
    S_K, S_B). GRU: f0 and f1 hold the (n, B, 3H) pre-activations W_ih x + b_ih and W_hh h + b_hh
    (rows r, z, n), f2 the (n, B, H) previous states; the weights are W_hr, W_hz, W_hn, the scales
    dn m r (1 - r), (h_prev - n) z (1 - z), dn r with dn = (1 - z)(1 - n^2) and m = W_hn h + b_hn,
    and the diagonal z. Unused values and padded lanes are 0.
    """
    k = k.to(tl.int64)  # k * S_K may pass 2^31 (b already is 64-bit)
    r = tl.arange(0, HP)
    vec = r < H
    zero = tl.zeros([HP], dtype=tl.float32)
    s0 = zero
    s1 = zero
    s2 = zero
    e = zero
    dn = zero
    if MODE == 3:
        gi = f0_ptr + (k * B + b) * 3 * H + r
        gh = f1_ptr + (k * B + b) * 3 * H + r
        gate_r = tl.sigmoid(tl.load(gi, mask=vec, other=0.0) + tl.load(gh, mask=vec, other=0.0))
        z = tl.sigmoid(tl.load(gi + H, mask=vec, other=0.0) + tl.load(gh + H, mask=vec, other=0.0))
        m = tl.load(gh + 2 * H, mask=vec, other=0.0)
        n = 2.0 * tl.sigmoid(2.0 * (tl.load(gi + 2 * H, mask=vec, other=0.0) + gate_r * m)) - 1.0  # tanh
        h_prev = tl.load(f2_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
        dn = tl.where(vec, (1.0 - z) * (1.0 - n * n), 0.0)
        s0 = dn * m * gate_r * (1.0 - gate_r)
        s1 = tl.where(vec, (h_prev - n) * z * (1.0 - z), 0.0)
        s2 = dn * gate_r
        e = tl.where(vec, z, 0.0)
    else:
        row = f0_ptr + k * S_K + b * S_B
        s0 = tl.load(row + r, mask=vec, other=0.0)
        if MODE == 1:
            s0 = tl.where(vec, 1.0 - s0 * s0, 0.0)
        if MODE == 2:
            s0 = tl.where(s0 > 0, 1.0, 0.0)
        if K > 1:
            s1 = tl.load(row + H + r, mask=vec, other=0.0)
        if K > 2:
            s2 = tl.load(row + 2 * H + r, mask=vec, other=0.0)
        if HAS_E:
            e = tl.load(f1_ptr + (k * B + b) * H + r, mask=vec, other=0.0)
    return s0, s1, s2, e, dn


@triton.jit
def _mat_step(agg, s0, s1, s2, e, w0, w1, w2, K: tl.constexpr, HAS_E: tl.constexpr):
    """agg @ M for one element given as its factors."""
    out = tl.dot(agg * s0[None, :], w0, input_precision="ieee")
    if K > 1:
        out += tl.dot(agg * s1[None, :], w1, input_precision="ieee")
    if K > 2:
        out += tl.dot(agg * s2[None, :], w2, input_precision="ieee")
    if HAS_E:
        out += agg * e[None, :]
    return out


@triton.jit
def _vec_step(y, s0, s1, s2, e, w0, w1, w2, K: tl.constexpr, HAS_E: tl.constexpr):
    """y @ M for one element given as its factors and one row vector y."""
    out = tl.sum((y * s0)[:, None] * w0, axis=0)
    if K > 1:
        out += tl.sum((y * s1)[:, None] * w1, axis=0)
    if K > 2:
        out += tl.sum((y * s2)[:, None] * w2, axis=0)
    if HAS_E:
        out += y * e
    return out


@triton.jit
def _offset(b_ptr, k, b, B, H, r, vec, SHIFT: tl.constexpr):
    """Element k's offset: row k of the offsets, or row k - 1 with SHIFT (none for k = 0)."""
    return tl.load(b_ptr + ((k - SHIFT) * B + b) * H + r, mask=vec & (k >= SHIFT), other=0.0)


@triton.jit
def _reduce(
    f0_ptr,
    f1_ptr,
    f2_ptr,
    w_ptr,
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
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    HP: tl.constexpr,
):
    q = tl.program_id(0) + 1  # chunks 1..P-2
    b = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a (T, B, 6H) GRU delta may pass 2^31
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP)
    agg = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    c = tl.zeros([HP], dtype=tl.float32)
    for i in range(0, C):  # the chunk's last element is applied first
        k = q * C + C - 1 - i
        s0, s1, s2, e, _ = _element(f0_ptr, f1_ptr, f2_ptr, k, b, B, H, S_K, S_B, K, HAS_E, MODE, HP)
        agg = _mat_step(agg, s0, s1, s2, e, w0, w1, w2, K, HAS_E)
        if HAS_B:
            c = _vec_step(c, s0, s1, s2, e, w0, w1, w2, K, HAS_E) + _offset(b_ptr, k, b, B, H, r, vec, SHIFT)
    j = q - 1
    tl.store(agg_ptr + ((j * B + b) * H + r[:, None]) * H + r[None, :], agg, mask=mat)
    tl.store(aggb_ptr + (j * B + b) * H + r, c, mask=vec)


@triton.jit
def _walk_step(
    y,
    k,
    b,
    f0_ptr,
    f1_ptr,
    f2_ptr,
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
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    """x_k from y = x_{k+1}, stored: every x_k, or (FUSED) only x_0 and step k's deltas.

    The deltas of a layer mode (y is dL/dh at that step): an RNN's f'(z) * y (n, B, H); a GRU's
    input-side (d_r, d_z, d_n) then hidden-side (d_r, d_z, d_n * r) pre-activation gradients,
    (n, B, 6H).
    """
    r = tl.arange(0, HP)
    vec = r < H
    s0, s1, s2, e, dn = _element(f0_ptr, f1_ptr, f2_ptr, k, b, B, H, S_K, S_B, K, HAS_E, MODE, HP)
    y_next = _vec_step(y, s0, s1, s2, e, w0, w1, w2, K, HAS_E)
    if HAS_B:
        y_next += _offset(b_ptr, k, b, B, H, r, vec, SHIFT)
    if FUSED:
        if MODE == 3:
            row = d_ptr + (k * B + b) * 6 * H + r
            tl.store(row, y * s0, mask=vec)
            tl.store(row + H, y * s1, mask=vec)
            tl.store(row + 2 * H, y * dn, mask=vec)
            tl.store(row + 3 * H, y * s0, mask=vec)
            tl.store(row + 4 * H, y * s1, mask=vec)
            tl.store(row + 5 * H, y * s2, mask=vec)
        else:
            tl.store(d_ptr + (k * B + b) * H + r, y * s0, mask=vec)
        tl.store(out_ptr + b * H + r, y_next, mask=vec & (k == 0))
    else:
        tl.store(out_ptr + (k * B + b) * H + r, y_next, mask=vec)
    return y_next


@triton.jit
def _spine(
    f0_ptr,
    f1_ptr,
    f2_ptr,
    w_ptr,
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
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    mat = vec[:, None] & vec[None, :]
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP)
    y = tl.load(x_ptr + b * H + r, mask=vec, other=0.0)
    if not FUSED:
        tl.store(out_ptr + (N * B + b) * H + r, y, mask=vec)
    for i in range(0, REM):  # the remainder chunk (the whole chain if it is one chunk), from x_n down
        k = N - 1 - i
        y = _walk_step(
            y, k, b, f0_ptr, f1_ptr, f2_ptr, b_ptr, out_ptr, d_ptr, B, H, S_K, S_B, w0, w1, w2,
            K, HAS_E, HAS_B, MODE, SHIFT, FUSED, HP,
        )  # fmt: skip
    tl.store(entry_ptr + (NAGG * B + b) * H + r, y, mask=vec)
    for i in range(0, NAGG):  # aggregates of chunks P-2 .. 1: entry of chunk j is x at (j + 1) C
        j = NAGG - 1 - i
        a = tl.load(agg_ptr + ((j * B + b) * H + r[:, None]) * H + r[None, :], mask=mat, other=0.0)
        y = tl.sum(y[:, None] * a, axis=0) + tl.load(aggb_ptr + (j * B + b) * H + r, mask=vec, other=0.0)
        tl.store(entry_ptr + (j * B + b) * H + r, y, mask=vec)


@triton.jit
def _expand(
    f0_ptr,
    f1_ptr,
    f2_ptr,
    w_ptr,
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
    MODE: tl.constexpr,
    SHIFT: tl.constexpr,
    FUSED: tl.constexpr,
    HP: tl.constexpr,
):
    q = tl.program_id(0)  # chunks 0..P-2
    b = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a (T, B, 6H) GRU delta may pass 2^31
    r = tl.arange(0, HP)
    w0, w1, w2 = _load_weights(w_ptr, H, K, HP)
    y = tl.load(entry_ptr + (q * B + b) * H + r, mask=r < H, other=0.0)
    for i in range(0, C):
        k = q * C + C - 1 - i
        y = _walk_step(
            y, k, b, f0_ptr, f1_ptr, f2_ptr, b_ptr, out_ptr, d_ptr, B, H, S_K, S_B, w0, w1, w2,
            K, HAS_E, HAS_B, MODE, SHIFT, FUSED, HP,
        )  # fmt: skip


def _padded(h: int) -> int:
    return max(16, triton.next_power_of_2(h))


def fits(terms: int, hidden: int, *tensors: Tensor) -> bool:
    """Whether a chain of ``terms`` H x H weights fits the kernels: float32, K <= 3, H <= 64."""
    return terms <= MAX_TERMS and hidden <= MAX_HIDDEN and all(t.dtype == torch.float32 for t in tensors)


def _num_warps(terms: int, hp: int) -> int:
    """4 warps, or 8 where the weights pass 4096 entries (a GRU at Hp = 64), to keep them in registers."""
    return 8 if terms * hp * hp > 4096 else 4


def supports(scales: Tensor, weights: Tensor, diagonal: Tensor | None) -> bool:
    """Whether a factored chain fits these kernels (``fits``)."""
    tensors = (scales, weights) + (() if diagonal is None else (diagonal,))
    return fits(weights.shape[0], weights.shape[-1], *tensors)


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
    batch = x_last.shape[0]
    s = scales.contiguous()
    e = None if diagonal is None else diagonal.expand(n, batch, h).contiguous()
    out = x_last.new_empty((n + 1, batch, h))
    strides = (s.stride(0), s.stride(1) if s.shape[1] == batch else 0)
    _launch((s, e, None), strides, weights, x_last, offsets, chunk, out, None, mode=SCALES, shift=0)
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
    The weight gradients then stay GEMMs over delta (``layer_grads``): delta must be written for
    the input-side gradients anyway, and reducing dW_hh inside the kernels would need per-program
    partial sums about as large as delta, or non-deterministic atomics.
    """
    n, batch, hid = h.shape
    hc = h.contiguous()
    g0 = g_last.new_empty((1, batch, hid))
    delta = h.new_empty((n, batch, hid))
    mode = ACTIVATIONS[nonlinearity]
    _launch((hc, None, None), (batch * hid, hid), w_hh, g_last, u, chunk, g0, delta, mode=mode, shift=1)
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
    sources = (gi.contiguous(), gh.contiguous(), h_prev.contiguous())
    _launch(sources, (0, 0), w_hh, g_last, u, chunk, g0, deltas, mode=GRU, shift=1)
    return g0[0], deltas[..., : 3 * hid], deltas[..., 3 * hid :]


def _launch(
    sources: tuple[Tensor, Tensor | None, Tensor | None],
    strides: tuple[int, int],
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int,
    out: Tensor,
    delta: Tensor | None,
    *,
    mode: int,
    shift: int,
) -> None:
    """The three launches (one, ``_spine``, for a chain of a single chunk).

    ``sources`` are ``_element``'s f0, f1, f2 (contiguous, f0 with one row per element; None where
    the mode reads nothing), ``strides`` f0's element and batch strides in SCALES/TANH/RELU modes,
    ``weights`` the K stacked H x H weights, (K, H, H) or (K * H, H): a GRU's W_hh is W_hr, W_hz,
    W_hn stacked.
    """
    f0 = sources[0]
    f1, f2 = (f0 if t is None else t for t in sources[1:])  # never read when None
    n, (batch, h) = f0.shape[0], x_last.shape
    terms = weights.numel() // (h * h)
    p = math.ceil(n / chunk)
    w = weights.contiguous()
    has_b = offsets is not None
    b = offsets.contiguous() if has_b else f0
    agg = f0.new_empty((max(p - 2, 1), batch, h, h))
    aggb = f0.new_empty((max(p - 2, 1), batch, h))  # every row read is written by _reduce
    entry = f0.new_empty((max(p - 1, 1), batch, h))
    flags = {
        "K": terms,
        "HAS_E": sources[1] is not None,  # a diagonal, or a GRU's gh (its diagonal is z)
        "HAS_B": has_b,
        "MODE": mode,
        "SHIFT": shift,
        "HP": _padded(h),
        "num_warps": _num_warps(terms, _padded(h)),
    }
    fused = delta is not None
    d = out if delta is None else delta
    s_k, s_b = strides
    if p > 2:
        _reduce[(p - 2, batch)](f0, f1, f2, w, b, agg, aggb, batch, h, s_k, s_b, chunk, **flags)
    rem = n - (p - 1) * chunk
    x = x_last.contiguous()
    _spine[(batch,)](
        f0, f1, f2, w, b, agg, aggb, x, out, d, entry, batch, h, n, s_k, s_b, rem, max(p - 2, 0),
        FUSED=fused, **flags,
    )  # fmt: skip
    if p > 1:
        _expand[(p - 1, batch)](
            f0, f1, f2, w, b, entry, out, d, batch, h, s_k, s_b, chunk, FUSED=fused, **flags
        )
