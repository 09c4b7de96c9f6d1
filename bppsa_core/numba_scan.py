"""Compiled CPU kernels of the chunked scan (numba): the CPU counterpart of ``bppsa_core.triton``;
the plain-PyTorch twin is ``bppsa_core.scan.chunked_scan``.

The chain is a ``FactoredChain``, ``M_k[b] = sum_j diag(s[k, b, j]) @ W_j (+ diag(e[k, b]))`` with
K <= 3 terms (an RNN's one, a GRU's three and a diagonal) and optional offsets, scanned as
``x_k = x_{k+1} @ M_k + offsets[k]`` from x_n. One compiled call runs the three phases:

1. reduce: one task per (chunk 1..P-2, sample) folds its chunk into an H x H aggregate and offset;
2. spine: one task per group of samples walks the last chunk from x_n; then one task per sample
   applies the chunk aggregates;
3. expand: one task per (chunk 0..P-2, group of samples) walks its chunk from its entry vectors.

A walk steps its group's samples side by side (one group per thread), each step one indexed call
(``_apply``) for all of them.

Each phase is a ``prange`` over its tasks, so CPU threads are real workers across chunks and
samples (``torch.get_num_threads()`` of them; with one, a serial build runs in the calling thread).
The chunk count comes from ``dispatch.numba_chunk``: a chunk's aggregate costs H times a walk, so
with as many samples as threads one chunk (every sample walked once, in parallel) is cheapest, and
chunks pay only where threads outnumber samples. A module layer walks its chain block by block this
way (``bppsa_core.layer``), with the factors made by the cells' vectorized PyTorch code: exp and
tanh are cheaper there than in a scalar loop. Inputs are float32 or float64; the first call per
dtype and build compiles (seconds; numba caches it on disk).

Subnormal numbers: numba's worker threads do not run in the caller's floating-point mode, so
``bppsa_core.denormals`` cannot reach them; instead every step's results (walked vectors, aggregate
rows and offsets) below the dtype's smallest normal number are set to 0, which is what flush-to-zero
does to them (docs/DESIGN.md, "Subnormal numbers"), for H compares a step against K·H² products.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from torch import Tensor

from bppsa_core import dispatch
from bppsa_core.chain import LSTMChain
from bppsa_core.numba_math import (
    LANES_MIN,
    NUMPY_DTYPES,
    UNUSED,
    Vectors,
    add_hidden,
    build,
    padded,
    prefetch_row,
    put,
    running,
    threads,
    vector_arrays,
)


@njit(cache=True, inline="always")
def _apply(k, b0, per_row, n_terms, has_diag, tiny, scales, diag, w0, w1, w2, ys, u, acc):
    """acc[i] = ys[i] @ M_k[b] for every row i, b = b0 + i·per_row (a walk's rows are samples side by
    side, an aggregate's the rows of one sample's), with results below ``tiny`` in magnitude flushed
    to 0 (module docstring); w0, w1, w2 the terms' weights (``_terms``), u (rows, H) scratch. Each
    term scales the rows (u = ys * s_kj), then adds u @ W_j four rows at a time in vector registers
    (``numba_math.add_hidden``): each load of W serves four samples, which matters once W leaves
    the L1 cache (from H = 48 for a GRU's three terms), and no row's bits depend on its neighbours
    (re-measured by ``python -m benchmarks.backward --strategies numba``). Indexed, never sliced
    (a view per step costs its reference counting)."""
    rows, hid = ys.shape
    zero = ys.dtype.type(0)
    for i in range(rows):
        bd = b0 + i * per_row if diag.shape[1] > 1 else 0
        for j in range(hid):
            acc[i, j] = ys[i, j] * diag[k, bd, j] if has_diag else zero
    for t in range(n_terms):
        for i in range(rows):
            bs = b0 + i * per_row if scales.shape[1] > 1 else 0
            for r in range(hid):
                u[i, r] = ys[i, r] * scales[k, bs, t, r]
        add_hidden(acc, u, w0 if t == 0 else w1 if t == 1 else w2)  # one inlined copy: compile time
    for i in range(rows):
        for j in range(hid):
            if abs(acc[i, j]) < tiny:
                acc[i, j] = zero


@njit(cache=True, inline="always")
def _terms(w):
    """The K <= 3 weights (K, H, H) as ``_apply`` takes them: three C-contiguous (H, H) copies (the
    last one repeated where K < 3), their rows ``padded`` apart, made once per scan."""
    w0 = padded(w[0])
    w1 = padded(w[min(1, w.shape[0] - 1)])
    w2 = padded(w[min(2, w.shape[0] - 1)])
    return w0, w1, w2


@njit(cache=True, inline="always")  # into the builds: their names say which add_hidden
def _walk(n_terms, has_diag, has_b, tiny, lo, hi, b0, ys, scales, diag, w0, w1, w2, offsets, out):
    """Walk elements hi - 1 down to lo of samples b0 .. b0 + len(ys) - 1 from ys (one x_hi a row),
    side by side, storing every x_k into ``out``."""
    nb, hid = ys.shape
    u = np.empty_like(ys)
    nxt = np.empty_like(ys)
    for k in range(hi - 1, lo - 1, -1):
        for i in range(nb if k > lo else 0):  # the next step's rows, while this one's are worked on
            prefetch_row(scales, k - 1, b0 + i if scales.shape[1] > 1 else 0)
            prefetch_row(out, k - 1, b0 + i)
            if has_b:
                prefetch_row(offsets, k - 1, b0 + i)
        _apply(k, b0, 1, n_terms, has_diag, tiny, scales, diag, w0, w1, w2, ys, u, nxt)
        for i in range(nb):
            for j in range(hid):
                v = nxt[i, j] + offsets[k, b0 + i, j] if has_b else nxt[i, j]
                out[k, b0 + i, j] = v
                ys[i, j] = v


def _scan(n_terms, has_diag, has_b, tiny, chunk, groups, scales, diag, w, offsets, x_last, out):
    """The three phases (module docstring); chunk P-1 (the remainder) is walked by the spine."""
    n = scales.shape[0]
    batch, hid = x_last.shape
    p = (n + chunk - 1) // chunk
    nagg = max(p - 2, 0)
    agg = np.empty((max(nagg, 1), batch, hid, hid), x_last.dtype)
    agg_off = np.zeros((max(nagg, 1), batch, hid), x_last.dtype)
    entry = np.empty((max(p - 1, 1), batch, hid), x_last.dtype)
    w0, w1, w2 = _terms(w)
    for task in prange(nagg * batch):  # reduce: chunk q = 1..P-2, last element applied first
        q, b = np.int64(task) // batch + 1, np.int64(task) % batch  # a prange index is unsigned
        # the aggregate's rows and, with offsets, the offset's row after them: one product a step
        # for both, so one inlined copy of ``_apply`` (each row's bits are its own); the identity and
        # the copy out as loops: np.eye(N, M) and a sliced ``put`` ran the reduce slower (re-measured
        # by ``python -m benchmarks.backward --model rnn --B 1 --threads 2 --strategies numba --chunk 100``)
        a = np.zeros((hid + 1 if has_b else hid, hid), x_last.dtype)
        for i in range(hid):
            a[i, i] = 1
        u, nxt = np.empty_like(a), np.empty_like(a)
        for k in range(q * chunk + chunk - 1, q * chunk - 1, -1):
            _apply(k, b, 0, n_terms, has_diag, tiny, scales, diag, w0, w1, w2, a, u, nxt)
            a, nxt = nxt, a
            if has_b:
                for j in range(hid):
                    a[hid, j] += offsets[k, b, j]
        for i in range(hid):
            for j in range(hid):
                agg[q - 1, b, i, j] = a[i, j]
        if has_b:
            put(agg_off[q - 1, b], a[hid])
    for g in prange(groups):  # spine: the remainder chunk from x_n, a group of samples a task
        b0, b1 = g * batch // groups, (g + 1) * batch // groups
        ys = x_last[b0:b1].copy()
        put(out[n, b0:b1], ys)
        lo = (p - 1) * chunk
        _walk(n_terms, has_diag, has_b, tiny, lo, n, b0, ys, scales, diag, w0, w1, w2, offsets, out)
        if p > 1:
            put(entry[nagg, b0:b1], ys)
    for b_ in prange(batch if nagg else 0):  # then the aggregates, a sample a task
        b = np.int64(b_)
        y = entry[nagg, b].copy()
        for j in range(nagg - 1, -1, -1):
            y2 = agg_off[j, b].copy()
            for i in range(hid):
                for col in range(hid):
                    y2[col] += y[i] * agg[j, b, i, col]
            y = y2
            put(entry[j, b], y)
    for task in prange((p - 1) * groups):  # expand: chunk q = 0..P-2 from its entry vectors
        q, g = np.int64(task) // groups, np.int64(task) % groups
        b0, b1 = g * batch // groups, (g + 1) * batch // groups
        ys = entry[q, b0:b1].copy()
        lo = q * chunk
        _walk(n_terms, has_diag, has_b, tiny, lo, lo + chunk, b0, ys, scales, diag, w0, w1, w2, offsets, out)


@njit(cache=True, inline="always")  # into the builds: their names say which add_hidden
def _lstm_walk(
    has_hh, has_b, tiny, b0, b1, scales_h, scales_c, w_rows, diag_hc, diag_cc, diag_hh, offsets, out
):
    """Walk an LSTM chain's elements n - 1 down to 0 for samples b0 .. b1 - 1 side by side from
    out[n] = (x_h, x_c), storing every x_k into ``out``: the four gates' rows
    (x_h * scales_h + x_c * scales_c) against the stacked (4H, H) weights ``w_rows`` (``padded``)
    through ``add_hidden``, four samples a load of W as in ``_apply``; c's part is diagonal."""
    n, hid = scales_h.shape[0], scales_h.shape[3]
    ys = out[n, b0:b1].copy()
    nb = b1 - b0
    zero = ys.dtype.type(0)
    pre = np.empty((nb, 4 * hid), ys.dtype)
    acc = np.empty((nb, hid), ys.dtype)
    cn = np.empty((nb, hid), ys.dtype)
    for k in range(n - 1, -1, -1):
        for i in range(nb):
            b = b0 + i
            if k > 0:  # the next step's rows, while this one's are worked on
                prefetch_row(scales_h, k - 1, b)
                prefetch_row(scales_c, k - 1, b)
            for j in range(4):
                for r in range(hid):
                    pre[i, j * hid + r] = (
                        ys[i, r] * scales_h[k, b, j, r] + ys[i, hid + r] * scales_c[k, b, j, r]
                    )
            for col in range(hid):
                acc[i, col] = ys[i, col] * diag_hh[k, b, col] if has_hh else zero
                cn[i, col] = ys[i, col] * diag_hc[k, b, col] + ys[i, hid + col] * diag_cc[k, b, col]
        add_hidden(acc, pre, w_rows)
        for i in range(nb):
            b = b0 + i
            for col in range(2 * hid):
                v = acc[i, col] if col < hid else cn[i, col - hid]
                if has_b:
                    v += offsets[k, b, col]
                if abs(v) < tiny:
                    v = zero
                out[k, b, col] = v
                ys[i, col] = v


def _lstm_scan(has_hh, has_b, tiny, groups, scales_h, scales_c, w, diag_hc, diag_cc, diag_hh, offsets, out):
    """Every sample's walk from its x_n (out[n]), a group of samples a task."""
    batch = out.shape[1]
    w_rows = padded(w)
    for g in prange(groups):
        b0, b1 = g * batch // groups, (g + 1) * batch // groups
        _lstm_walk(
            has_hh, has_b, tiny, b0, b1, scales_h, scales_c, w_rows, diag_hc, diag_cc, diag_hh, offsets, out
        )


@intrinsic
def _lstm_row(typingctx, gates, h, c, delta, dh, dc, t, k, b, i, one, tiny):
    """The gate gradients delta[k, b] (delta (K, B, 4H): the walk's block of steps, or ``gates``
    itself with k = t: a block of lanes reads its gates before it writes them) and row i of the
    group's next dc at step t, sample b, from row i of dh and dc (nb, H): ``_lstm_layer``'s loop
    over a gate's H units in vectors of ``LANES`` (H at least that), the same operations in the
    same order on every lane, so the same bits. A ragged last block is the window of the last
    lanes (half a vector's where they fit), made from the values before the row and stored last
    (as ``numba_math.add_hidden``'s)."""
    if not vector_arrays((gates, h, c, delta, dh, dc), dh.dtype):
        return None

    def codegen(context, builder, signature, args):
        typed = zip(signature.args[:6], args[:6], strict=True)
        gs, hs, cs, ds, dhs, dcs = (context.make_array(t)(context, builder, v) for t, v in typed)
        i64 = ir.IntType(64)
        step, d_step, sample, row = (
            context.cast(builder, v, t, types.int64)
            for v, t in zip(args[6:10], signature.args[6:10], strict=True)
        )
        v = Vectors(context, builder, dh.dtype)
        half = v.halved()
        one_s, tiny_s = (
            context.cast(builder, a, t, dh.dtype) for a, t in zip(args[10:], signature.args[10:], strict=True)
        )
        hid = builder.extract_value(dhs.shape, 1)
        batch = builder.extract_value(hs.shape, 1)
        at_step, at_d = (builder.add(builder.mul(s, batch), sample) for s in (step, d_step))  # (t, b), (k, b)
        width = builder.mul(hid, ir.Constant(i64, 4))
        gate_row, d_row = (
            builder.gep(a.data, [builder.mul(at, width)]) for a, at in ((gs, at_step), (ds, at_d))
        )
        h_row, c_row = (builder.gep(a.data, [builder.mul(at_step, hid)]) for a in (hs, cs))
        dh_row, dc_row = (builder.gep(a.data, [builder.mul(row, hid)]) for a in (dhs, dcs))

        def gate(k, j):
            return builder.add(builder.mul(hid, ir.Constant(i64, k)), j)

        def grads(j, vec):
            """The lanes j .. j + lanes of ``vec``: (d_i, d_f, d_g, d_o) and the next dc, as the
            scalar loop."""
            one_v, tiny_v, zero = vec.splat(one_s), vec.splat(tiny_s), ir.Constant(vec.type, None)
            ig, f, g, o = (vec.load(gate_row, gate(k, j)) for k in range(4))
            hv, cv, dh, dc = (vec.load(row, j) for row in (h_row, c_row, dh_row, dc_row))
            fmul, fsub = builder.fmul, builder.fsub
            tj = builder.select(builder.fcmp_unordered("!=", o, zero), builder.fdiv(hv, o), zero)
            dcj = builder.fadd(dc, fmul(fmul(dh, o), fsub(one_v, fmul(tj, tj))))
            d_i = fmul(fmul(fmul(dcj, g), ig), fsub(one_v, ig))
            d_f = fmul(fmul(fmul(dcj, cv), f), fsub(one_v, f))
            d_g = fmul(fmul(dcj, ig), fsub(one_v, fmul(g, g)))
            d_o = fmul(fmul(fmul(dh, tj), o), fsub(one_v, o))
            nc = fmul(dcj, f)  # |nc| >= tiny, NaN failing it, as abs(nc) >= tiny
            big = builder.or_(
                builder.fcmp_ordered(">=", nc, tiny_v), builder.fcmp_ordered("<=", nc, builder.fneg(tiny_v))
            )
            return [d_i, d_f, d_g, d_o, builder.select(big, nc, zero)]

        def put_row(j, values, vec):
            for k in range(4):
                vec.store(values[k], d_row, gate(k, j))
            vec.store(values[4], dc_row, j)

        lanes = ir.Constant(i64, v.lanes)
        windows = [  # where, the window's first lane, its vectors, its values held until stored
            (fits, last, vec, [cgutils.alloca_once(builder, vec.type) for _ in range(5)])
            for fits, last, vec in v.windows(hid, half)[1]
        ]
        for fits, last, vec, held in windows:
            with builder.if_then(fits):
                for slot, value in zip(held, grads(last, vec), strict=True):
                    builder.store(value, slot)
        with cgutils.for_range(builder, builder.udiv(hid, lanes)) as loop:
            j = builder.mul(loop.index, lanes)
            put_row(j, grads(j, v), v)
        for fits, last, vec, held in windows:
            with builder.if_then(fits):
                put_row(last, [builder.load(slot) for slot in held], vec)
        return context.get_dummy_value()

    return types.void(gates, h, c, delta, dh, dc, t, k, b, i, one, tiny), codegen


@intrinsic
def _gru_row(typingctx, gates, h, u, dh, acc, d_in, d_hid, t, k, b, i, inject, one):
    """Step t's gradients of sample b, row i of the group's dh and acc (nb, H): ``_gru_layer``'s
    loop over the H units in vectors of ``LANES`` (H at least that), the same operations in the
    same order on every lane, so the same bits: the input and hidden sides' (dr, dz, dn) and
    (dr, dz, dn r) into row (k, b) of ``d_in`` and ``d_hid``, and u[t - 1, b] (where ``inject``,
    else 0) + g z into acc's row. A ragged last block is the window of the last lanes (half a
    vector's where they fit, as ``numba_math.add_hidden``'s): nothing it reads is written here."""
    if not vector_arrays((gates, h, u, dh, acc, d_in, d_hid), dh.dtype):
        return None

    def codegen(context, builder, signature, args):
        typed = zip(signature.args[:7], args[:7], strict=True)
        gs, hs, us, dhs, accs, ins, hids = (context.make_array(t)(context, builder, v) for t, v in typed)
        i64 = ir.IntType(64)
        step, d_step, sample, row = (
            context.cast(builder, v, t, types.int64)
            for v, t in zip(args[7:11], signature.args[7:11], strict=True)
        )
        inject = context.cast(builder, args[11], signature.args[11], types.boolean)
        one_s = context.cast(builder, args[12], signature.args[12], dh.dtype)
        v = Vectors(context, builder, dh.dtype)
        half = v.halved()
        hid = builder.extract_value(dhs.shape, 1)

        def at(a, first, width):
            """Row (first, sample) of a 3-D array whose rows are ``width`` elements."""
            batch = builder.extract_value(a.shape, 1)
            return builder.gep(a.data, [builder.mul(builder.add(builder.mul(first, batch), sample), width)])

        three = builder.mul(hid, ir.Constant(i64, 3))
        gate_row = at(gs, step, builder.mul(hid, ir.Constant(i64, 4)))
        h_row = at(hs, step, hid)
        in_row, hid_row = at(ins, d_step, three), at(hids, d_step, three)
        dh_row, acc_row = (builder.gep(a.data, [builder.mul(row, hid)]) for a in (dhs, accs))
        slots = {vec.lanes: cgutils.alloca_once(builder, vec.type) for vec in (v, half)}

        def gate(n, j):
            return builder.add(builder.mul(hid, ir.Constant(i64, n)), j)

        def put_row(j, vec):
            """The lanes j .. j + lanes of ``vec``, as the scalar loop."""
            one_v, zero = vec.splat(one_s), ir.Constant(vec.type, None)
            r, z, n, m = (vec.load(gate_row, gate(g, j)) for g in range(4))
            g, hv = vec.load(dh_row, j), vec.load(h_row, j)
            fmul, fsub = builder.fmul, builder.fsub
            dn = fmul(fmul(g, fsub(one_v, z)), fsub(one_v, fmul(n, n)))
            dz = fmul(fmul(fmul(g, fsub(hv, n)), z), fsub(one_v, z))
            dr = fmul(fmul(fmul(dn, m), r), fsub(one_v, r))
            for n_, value in enumerate((dr, dz, dn)):
                vec.store(value, in_row, gate(n_, j))
            for n_, value in enumerate((dr, dz, fmul(dn, r))):
                vec.store(value, hid_row, gate(n_, j))
            slot = slots[vec.lanes]
            builder.store(zero, slot)
            with builder.if_then(inject):  # u is read only where it is injected (else a placeholder)
                u_row = at(us, builder.sub(step, ir.Constant(i64, 1)), hid)
                builder.store(vec.load(u_row, j), slot)
            vec.store(builder.fadd(builder.load(slot), fmul(g, z)), acc_row, j)

        lanes = ir.Constant(i64, v.lanes)
        whole = builder.udiv(hid, lanes)
        (narrow, half_start, _), (wide, wide_start, _) = v.windows(hid, half)[1]
        # a whole vector's window is one more pass of the loop (one copy of the code: compile time)
        with cgutils.for_range(builder, builder.add(whole, builder.zext(wide, i64))) as loop:
            inside = builder.icmp_unsigned("<", loop.index, whole)
            put_row(builder.select(inside, builder.mul(loop.index, lanes), wide_start), v)
        with builder.if_then(narrow):
            put_row(half_start, half)
        return context.get_dummy_value()

    sig = types.void(gates, h, u, dh, acc, d_in, d_hid, t, k, b, i, inject, one)
    return sig, codegen


_SCALAR_ROWS = False  # a build with it set keeps the scalar loop at every H (the tests' twin)
_MAJOR = False  # a build with it set walks batch-major outputs (``_rnn_layer``)


def _lstm_layer(has_u, has_c, one, tiny, groups, first, last, gates, h, c, w_hh, u, ends, g_in, g_out, delta):
    """An LSTM layer's backward over steps ``first`` .. ``last`` - 1, each group of samples a task,
    from the activated gates (T, B, 4H; rows i, f, g, o), its outputs h_1..h_T (T, B, H) and c
    (T + 1, B, H) holding c_0 in its first row and, ``has_c``, c_1..c_T after it (else they are made
    first: c_t = f_t c_{t-1} + i_t g_t, for all T steps). Then the walk from (dL/dh, dL/dc) after
    step ``last`` - 1, ``g_in`` (2, B, H), back to those before step ``first``, ``g_out`` (2, B, H;
    may be ``g_in`` itself), the group's samples side by side. At step t the gates' pre-activation
    gradients d go straight into ``delta[t - first]`` (delta (last - first, B, 4H), or ``gates``
    itself with ``first`` 0: a step's gates are read before its d is written), then
    dL/dh_{t-1} = d @ W_hh + u[t-1] (the outputs' gradient, when ``has_u``; ``w_hh`` (4H, H)) and
    dL/dc_{t-1} = dc f, both flushed below ``tiny`` (module docstring). A sample's steps from
    ``ends[b]`` on (ends (B,) int64; T for all where none ends early) are past its end: the identity,
    their d 0, so the gradients pass through them unchanged (plus the outputs' ``u``, which is 0
    there but at the step of its last output).

    tanh(c_t) is h_t / o_t (0 where o_t is): a division, where a scalar tanh would cost most of the
    walk; it enters only multiplied by o_t, so its rounding near o_t = 0 does not carry. ``one`` and
    ``tiny`` come in the arrays' dtype, so that no step widens to float64; elements are indexed, not
    sliced (a view costs its reference counting), but for the one view of a step's rows of delta
    that ``add_hidden`` takes."""
    steps, batch, rows = gates.shape
    hid = rows // 4
    zero = one - one
    w_rows = padded(w_hh)
    for grp in prange(groups):
        lo, hi = grp * batch // groups, (grp + 1) * batch // groups
        nb = hi - lo
        for t in range(0 if has_c else steps):
            for i in range(nb):
                b = lo + i
                for j in range(hid):
                    i_g = gates[t, b, j] * gates[t, b, 2 * hid + j]
                    c[t + 1, b, j] = gates[t, b, hid + j] * c[t, b, j] + i_g
        dh, dc = g_in[0, lo:hi].copy(), g_in[1, lo:hi].copy()
        acc = np.empty((nb, hid), dh.dtype)
        for t in range(last - 1, first - 1, -1):
            k = t - first  # delta's row
            for i in range(nb):
                b = lo + i
                if t >= ends[b]:  # past the sample's end
                    for j in range(4 * hid):
                        delta[k, b, j] = zero
                    continue
                if t > first:  # the next step's rows, while this one's are worked on
                    for rows_of in (gates, h, c):
                        prefetch_row(rows_of, t - 1, b)
                    prefetch_row(delta, k - 1, b)
                if hid >= LANES_MIN and not _SCALAR_ROWS:  # the same loop in vectors
                    _lstm_row(gates, h, c, delta, dh, dc, t, k, b, i, one, tiny)
                else:
                    for j in range(hid):
                        ig, f = gates[t, b, j], gates[t, b, hid + j]
                        g, o = gates[t, b, 2 * hid + j], gates[t, b, 3 * hid + j]
                        tj = h[t, b, j] / o if o != zero else zero
                        dcj = dc[i, j] + dh[i, j] * o * (one - tj * tj)
                        delta[k, b, j] = dcj * g * ig * (one - ig)
                        delta[k, b, hid + j] = dcj * c[t, b, j] * f * (one - f)
                        delta[k, b, 2 * hid + j] = dcj * ig * (one - g * g)
                        delta[k, b, 3 * hid + j] = dh[i, j] * tj * o * (one - o)
                        nc = dcj * f
                        dc[i, j] = nc if abs(nc) >= tiny else zero
            inject = has_u and t > 0
            for i in range(nb):
                ended = t >= ends[lo + i]
                for j in range(hid):
                    a = u[t - 1, lo + i, j] if inject else zero
                    acc[i, j] = a + dh[i, j] if ended else a
            add_hidden(acc, delta[k, lo:hi], w_rows)
            for i in range(nb):
                for j in range(hid):
                    dh[i, j] = acc[i, j] if abs(acc[i, j]) >= tiny else zero
        put(g_out[0, lo:hi], dh)
        put(g_out[1, lo:hi], dc)


def _gru_layer(has_u, one, tiny, groups, first, last, gates, h, w_hh, u, ends, g_in, g_out, d_in, d_hid):
    """A GRU layer's backward over steps ``first`` .. ``last`` - 1, each group of samples a task,
    from its forward's tape: ``gates`` (T, B, 4H; r, z, n and m = W_hn h + b_hn) and the states
    h_0..h_T ``h`` (T + 1, B, H). The walk goes from dL/dh after step ``last`` - 1, ``g_in``
    (B, H), back to dL/dh before step ``first``, ``g_out`` (B, H; may be ``g_in``), the group's
    samples side by side. At step t, from g = dL/dh_{t+1}:

        dn = g (1 - z)(1 - n^2),  dz = g (h_t - n) z (1 - z),  dr = dn m r (1 - r),

    the input side's pre-activation gradients (dr, dz, dn) go into ``d_in[t - first]`` and the
    hidden side's (dr, dz, dn r) into ``d_hid[t - first]`` (each (last - first, B, 3H)), and
    dL/dh_t = g z + d_hid @ W_hh + u[t-1] (``w_hh`` (3H, H); the outputs' gradient when
    ``has_u``), flushed below ``tiny``. Steps from ``ends[b]`` on are past sample b's end: the
    identity, their gradients 0 (``_lstm_layer``'s). The factors are formed as the walk goes (none
    stored): the plain-PyTorch twin is ``GRUCell.factors``, its chain scanned, and
    ``GRUCell.preactivation_grads``. A step's row of a sample is one call of ``_gru_row`` (its
    loop in vectors; the walk a third faster at H = 20 than with the compiler's loop, re-measured
    by ``python -m benchmarks.backward --model gru --F 24 --threads 1 --strategies numba``)."""
    hid = gates.shape[2] // 4
    batch = gates.shape[1]
    zero = one - one
    w_rows = padded(w_hh)
    for grp in prange(groups):
        lo, hi = grp * batch // groups, (grp + 1) * batch // groups
        nb = hi - lo
        dh = g_in[lo:hi].copy()
        acc = np.empty((nb, hid), dh.dtype)
        for t in range(last - 1, first - 1, -1):
            k = t - first  # the deltas' row
            inject = has_u and t > 0
            for i in range(nb):
                b = lo + i
                if t >= ends[b]:  # past the sample's end
                    for j in range(3 * hid):
                        d_in[k, b, j] = zero
                        d_hid[k, b, j] = zero
                    for j in range(hid):
                        acc[i, j] = (u[t - 1, b, j] if inject else zero) + dh[i, j]
                    continue
                if t > first:  # the next step's rows, while this one's are worked on
                    for rows_of in (gates, h):
                        prefetch_row(rows_of, t - 1, b)
                    for rows_of in (d_in, d_hid):
                        prefetch_row(rows_of, k - 1, b)
                if hid >= LANES_MIN and not _SCALAR_ROWS:  # the same loop in vectors
                    _gru_row(gates, h, u, dh, acc, d_in, d_hid, t, k, b, i, inject, one)
                else:
                    for j in range(hid):
                        r, z = gates[t, b, j], gates[t, b, hid + j]
                        n, m = gates[t, b, 2 * hid + j], gates[t, b, 3 * hid + j]
                        g = dh[i, j]
                        dn = g * (one - z) * (one - n * n)
                        dz = g * (h[t, b, j] - n) * z * (one - z)
                        dr = dn * m * r * (one - r)
                        d_in[k, b, j] = dr
                        d_in[k, b, hid + j] = dz
                        d_in[k, b, 2 * hid + j] = dn
                        d_hid[k, b, j] = dr
                        d_hid[k, b, hid + j] = dz
                        d_hid[k, b, 2 * hid + j] = dn * r
                        acc[i, j] = (u[t - 1, b, j] if inject else zero) + g * z
            add_hidden(acc, d_hid[k, lo:hi], w_rows)
            for i in range(nb):
                for j in range(hid):
                    dh[i, j] = acc[i, j] if abs(acc[i, j]) >= tiny else zero
        put(g_out[lo:hi], dh)


def _rnn_layer(has_u, relu, one, tiny, groups, first, last, h_at, u_at, h, w_hh, u, ends, g_in, g_out, delta):
    """An RNN layer's backward over steps ``first`` .. ``last`` - 1, each group of samples a task,
    from its outputs h_1..h_T ``h`` (T, B, H) and hidden weights ``w_hh`` (H, H): the walk from
    dL/dh after step ``last`` - 1, ``g_in`` (B, H), back to dL/dh before step ``first``, ``g_out``
    (B, H; may be ``g_in``), the group's samples side by side. At step t, from g = dL/dh_{t+1}, the
    pre-activation gradient d = g f'(z_t) goes into ``delta[t - first]`` ((last - first, B, H)),
    f' read off the output (tanh: 1 - h^2; relu: 1 where not h <= 0, so that a NaN output passes
    its gradient, as autograd's ``threshold_backward``), then dL/dh_t = d @ W_hh flushed below
    ``tiny``, plus u[t-1] (the outputs' gradient, when ``has_u``). Steps from ``ends[b]`` on are
    past sample b's end: the identity, their d 0 (``_lstm_layer``'s). The operations and their
    order are those of the path it replaces (``RNNCell.factors``, the chain's walk in ``_scan`` and
    ``RNNCell.preactivation_grads``), so the bits are too, with no factors made and no second pass
    over the walked gradients (re-measured by
    ``python -m benchmarks.backward --model rnn --threads 1 --strategies numba``). ``h`` and ``u``
    may be windows of the sequence: their first rows are steps ``h_at`` and ``u_at``. In the builds
    with ``_MAJOR`` set, ``h`` is batch-major, (B, T, H), each sample's steps side by side (a
    sequence-parallel rank's group of samples, read where it lies)."""
    batch, hid = g_in.shape[0], h.shape[2]
    zero = one - one
    w_rows = padded(w_hh)
    for grp in prange(groups):
        lo, hi = grp * batch // groups, (grp + 1) * batch // groups
        nb = hi - lo
        g = g_in[lo:hi].copy()
        acc = np.empty((nb, hid), g.dtype)
        for t in range(last - 1, first - 1, -1):
            k = t - first  # the deltas' row
            for i in range(nb):
                b = lo + i
                if t >= ends[b]:  # past the sample's end
                    for j in range(hid):
                        delta[k, b, j] = zero
                        acc[i, j] = g[i, j]
                    continue
                if t > first:  # the next step's rows, while this one's are worked on
                    if _MAJOR:
                        prefetch_row(h, b, t - 1 - h_at)
                    else:
                        prefetch_row(h, t - 1 - h_at, b)
                    prefetch_row(delta, k - 1, b)
                for j in range(hid):
                    y = h[b, t - h_at, j] if _MAJOR else h[t - h_at, b, j]
                    fp = (zero if y <= zero else one) if relu else -(y * y) + one  # as RNNCell.factors
                    delta[k, b, j] = g[i, j] * fp
                    acc[i, j] = zero
            add_hidden(acc, delta[k, lo:hi], w_rows)
            inject = has_u and t > 0
            for i in range(nb):
                for j in range(hid):
                    v = zero if abs(acc[i, j]) < tiny else acc[i, j]
                    g[i, j] = v + u[t - 1 - u_at, lo + i, j] if inject else v
        put(g_out[lo:hi], g)


# One thread runs the serial build in the calling thread (no pool to wake, no worker spinning
# beside other work, each prange a plain loop); more threads run the parallel one.
_scan_serial = build(_scan, False)
_scan_parallel = build(_scan, True)
_lstm_scan_serial = build(_lstm_scan, False)
_lstm_scan_parallel = build(_lstm_scan, True)
_lstm_layer_serial = build(_lstm_layer, False)
_lstm_layer_parallel = build(_lstm_layer, True)
_gru_layer_serial = build(_gru_layer, False)
_gru_layer_parallel = build(_gru_layer, True)
_rnn_layer_serial = build(_rnn_layer, False)
_rnn_layer_parallel = build(_rnn_layer, True)
_rnn_layer_major_serial = build(_rnn_layer, False, major=True)
_rnn_layer_major_parallel = build(_rnn_layer, True, major=True)


def _arrays(*tensors: Tensor | np.ndarray) -> list[np.ndarray]:
    """The kernels' arrays: a tensor's memory (contiguous), an array as it is (an LSTM tape's)."""
    return [t if isinstance(t, np.ndarray) else t.contiguous().numpy(force=True) for t in tensors]


def chunked_scan(
    scales: Tensor,
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int | None,
    diagonal: Tensor | None = None,
    *,
    flush: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """The chunked scan of ``x_k = sum_j (x_{k+1} * s_kj) @ W_j + x_{k+1} * e_k + b_k``.

    scales (n, B or 1, K, H), weights (K, H, H), diagonal (n, B or 1, H) or None, x_last (B, H),
    offsets (n, B, H) or None; one dtype (float32 or float64). ``chunk``: None picks it for the
    threads at hand (``dispatch.numba_chunk``). ``flush``: flush subnormal results to 0. Returns
    x_0..x_n as (n + 1, B, H), written into ``out`` when given (contiguous, of that shape and dtype).
    """
    n, (batch, hid), terms = scales.shape[0], x_last.shape, weights.shape[0]
    chunk = chunk or dispatch.numba_chunk(n, batch, hid, terms, torch.get_num_threads())
    out = x_last.new_empty((n + 1, batch, hid)) if out is None else out
    if n == 0:
        return out.copy_(x_last.unsqueeze(0))
    placeholder = x_last.new_zeros((1, 1, 1))
    n_threads = threads()
    (_scan_parallel if n_threads > 1 else _scan_serial)(
        terms,
        diagonal is not None,
        offsets is not None,
        torch.finfo(x_last.dtype).tiny if flush else 0.0,
        min(chunk, n),
        min(n_threads, batch),
        *_arrays(scales, placeholder if diagonal is None else diagonal, weights),
        *_arrays(placeholder if offsets is None else offsets, x_last),
        out.numpy(),
    )
    return out


def lstm_scan(chain: LSTMChain, x_last: Tensor, offsets: Tensor | None, *, flush: bool = True) -> Tensor:
    """The scan of an LSTM's chain (``chain.LSTMChain``, not transposed) over its state (h, c):
    every sample walked from its x_n (B, 2H) through all n elements, a group of samples a thread, with
    offsets (n, B, 2H) or None; one dtype (float32 or float64). ``flush``: flush subnormal results
    to 0. Returns x_0..x_n as (n + 1, B, 2H)."""
    n = chain.length
    out = x_last.new_empty((n + 1, *x_last.shape))
    out[n] = x_last
    if n == 0:
        return out
    placeholder = x_last.new_zeros((1, 1, 1))
    hidden = chain.weights.shape[-1]
    n_threads = threads()
    (_lstm_scan_parallel if n_threads > 1 else _lstm_scan_serial)(
        chain.diag_hh is not None,
        offsets is not None,
        torch.finfo(x_last.dtype).tiny if flush else 0.0,
        min(n_threads, x_last.shape[0]),
        *_arrays(chain.scales_h, chain.scales_c, chain.weights.reshape(4 * hidden, hidden)),
        *_arrays(chain.diag_hc, chain.diag_cc, placeholder if chain.diag_hh is None else chain.diag_hh),
        *_arrays(placeholder if offsets is None else offsets),
        out.numpy(),
    )
    return out


def lstm_layer_backward(
    gates: Tensor,
    h: Tensor,
    c0: Tensor,
    w_hh: Tensor,
    g_h: Tensor,
    g_c: Tensor,
    u: Tensor | None,
    lengths: Tensor | None = None,
    *,
    flush: bool = True,
) -> tuple[Tensor, Tensor]:
    """An LSTM layer's backward in one compiled call: its cell states c_1..c_T from the activated
    ``gates`` (T, B, 4, H; i, f, g, o) and c0 (B, H), then every sample walked from (g_h, g_c)
    (B, H), the gradients of h_T and c_T, with ``h`` the layer's outputs h_1..h_T (T, B, H) and
    ``u`` (T, B, H) the outputs' gradients (or None; 0 past each end). The walk forms each step's
    factors from its gates on the fly (no factor tensors), so this is the whole chain and its
    pre-activation gradients in one pass. ``lengths`` (B,): each sample's steps (packed sequences,
    the identity past them), or None for all T.

    Returns the gates' pre-activation gradients (T, B, 4H; shared by the input and hidden sides),
    written over ``gates`` (contiguous), and g_0 = (dL/dh_0, dL/dc_0) (B, 2H). One dtype, float32
    or float64; ``flush``: flush subnormal results to 0. ``LSTMWalk`` walks a forward's kept gates
    block by block instead, leaving them as they are. The plain-PyTorch
    twin is the layer's generic path (``LSTMCell.factors``, ``LSTMChain`` and ``scan``), which the
    tests compare it with.
    """
    steps, batch, _, hidden = gates.shape
    c = gates.new_empty((steps + 1, batch, hidden))
    c[0] = c0
    g, delta = torch.stack((g_h, g_c)), gates.view(steps, batch, 4 * hidden)
    LSTMWalk(delta, h, w_hh, u, c, lengths, flush=flush, has_c=False)(0, steps, g, g, delta)
    return delta, torch.cat((g[0], g[1]), -1)


class LSTMWalk:
    """An LSTM layer's compiled backward (``_lstm_layer``) over the kept activated ``gates``
    (T, B, 4H), outputs ``h`` (T, B, H), ``cells`` c_0..c_T (T + 1, B, H; ``has_c`` False: only
    c_0 set, the rest made on the first call, which must then cover every step), the hidden
    weights ``w_hh`` (4H, H), the outputs' gradients ``u`` (T, B, H) or None and the samples'
    ``lengths`` (B,) or None (``lstm_layer_backward``), walked over any block of steps, the latest
    first: so that a layer's deltas are made and taken block by block (``bppsa_core.layer``) and
    only a block of them exists, in the cache, instead of T steps' through memory. ``gates``, ``h``
    and ``cells``: tensors or a tape's arrays (``layer.Tape``). The arrays are handed to the
    kernel once, not once a block."""

    def __init__(
        self,
        gates: Tensor | np.ndarray,
        h: Tensor | np.ndarray,
        w_hh: Tensor,
        u: Tensor | None,
        cells: Tensor | np.ndarray,
        lengths: Tensor | None = None,
        *,
        flush: bool = True,
        has_c: bool = True,
    ) -> None:
        one, tiny = _SCALARS[w_hh.dtype]
        n_threads = threads()
        self._kernel = _lstm_layer_parallel if n_threads > 1 else _lstm_layer_serial
        self._head = (u is not None, has_c, one, tiny if flush else one - one, min(n_threads, gates.shape[1]))
        self._arrays = (*_arrays(gates, h, cells, w_hh), *_outside_and_ends(u, lengths, gates, w_hh.dtype))

    def __call__(self, first: int, last: int, g_in: Tensor, g_out: Tensor, delta: Tensor) -> None:
        """Steps ``last`` - 1 down to ``first``: from the gradients (dL/dh, dL/dc) after them,
        ``g_in`` (2, B, H), to those before them into ``g_out`` (2, B, H; may be ``g_in``), the
        steps' pre-activation gradients into ``delta`` (last - first, B, 4H), all contiguous."""
        self._kernel(*self._head, first, last, *self._arrays, g_in.numpy(), g_out.numpy(), delta.numpy())


def _outside_and_ends(
    u: Tensor | None, lengths: Tensor | None, gates: Tensor | np.ndarray, dtype: torch.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """What a layer walk's kernel takes of the outputs' gradients ``u`` (an unused array without
    them) and of the samples' ``lengths`` (B,): each sample's ends, all T where None (``running``);
    T and B from the ``gates``."""
    return UNUSED[dtype] if u is None else _arrays(u)[0], _ends(lengths, gates)


def _ends(lengths: Tensor | None, gates: Tensor | np.ndarray) -> np.ndarray:
    """Each sample's ends for a layer walk's kernel: the samples' ``lengths`` (B,), all T where None
    (``running``); T and B from the ``gates`` (or the outputs)."""
    steps, batch = gates.shape[:2]
    return running(batch, steps) if lengths is None else lengths.to("cpu", torch.int64).numpy()


# per dtype, the scalars ``_lstm_layer`` and ``_gru_layer`` take: one and the flush threshold in that
# dtype (no step widens)
_SCALARS = {d: (t(1.0), t(torch.finfo(d).tiny)) for d, t in NUMPY_DTYPES.items()}


class RNNWalk:
    """An RNN layer's compiled backward (``_rnn_layer``) over its outputs ``h`` (T, B, H), with the
    hidden weights ``w_hh`` (H, H), ``relu`` (else tanh), the outputs' gradients ``u`` (T, B, H; 0
    past each end) or None and the samples' ``lengths`` (B,) or None, walked over any block of
    steps, the latest first, as ``LSTMWalk``: an RNN needs no tape, its outputs give the factors.
    Outputs in batch-major memory, a (T, B, H) view of (B, T, H) (a sequence-parallel rank's group
    of samples, ``jacobians.batch_major``), are read where they lie, by the kernel's batch-major
    build. Other strided outputs are taken a block at a time, side by side: ``outputs(lo, hi)``, the
    rows h_lo .. h_{hi-1} contiguous (a layer's: ``jacobians.PreviousStates.outputs``, whose copy
    the block's weight gradients then read too; by default a copy of those rows); strided gradients
    are copied by blocks into a buffer every block reuses (``jacobians.buffer``): a copy of them all
    would cost as much as the walk (both re-measured by
    ``python -m benchmarks.distributed --ranks 1 2``)."""

    def __init__(
        self,
        h: Tensor,
        w_hh: Tensor,
        relu: bool,
        u: Tensor | None,
        lengths: Tensor | None = None,
        *,
        flush: bool = True,
        outputs: Callable[[int, int], Tensor] | None = None,
    ) -> None:
        one, tiny = _SCALARS[w_hh.dtype]
        n_threads = threads()
        major = not h.is_contiguous() and h.transpose(0, 1).is_contiguous()  # the kernel's (B, T, H)
        if major:
            self._kernel = _rnn_layer_major_parallel if n_threads > 1 else _rnn_layer_major_serial
        else:
            self._kernel = _rnn_layer_parallel if n_threads > 1 else _rnn_layer_serial
        self._head = (u is not None, relu, one, tiny if flush else one - one, min(n_threads, h.shape[1]))
        self._u, self._w_hh, self._ends = u, _arrays(w_hh)[0], _ends(lengths, h)
        self._outputs = outputs or (lambda lo, hi: h[lo:hi])  # made contiguous by ``_h_block``
        # the kernel's arrays where they are the tensors' own memory (else None: copied by blocks)
        self._h_whole = None
        if h.is_contiguous() or major:
            self._h_whole = (h.transpose(0, 1) if major else h).numpy(force=True)
        self._u_whole = None
        if u is None or u.is_contiguous():
            self._u_whole = UNUSED[w_hh.dtype] if u is None else u.numpy(force=True)

    def __call__(self, first: int, last: int, g_in: Tensor, g_out: Tensor, delta: Tensor) -> None:
        """Steps ``last`` - 1 down to ``first``: from dL/dh after them, ``g_in`` (B, H), to dL/dh
        before them into ``g_out`` (B, H; may be ``g_in``), the steps' pre-activation gradients
        (both sides') into ``delta`` (last - first, B, H), all contiguous."""
        h_at, h = (0, self._h_whole) if self._h_whole is not None else self._h_block(first, last)
        u_at, u = (0, self._u_whole) if self._u_whole is not None else self._u_block(first, last)
        windows = (h_at, u_at, h, self._w_hh, u, self._ends)
        self._kernel(*self._head, first, last, *windows, g_in.numpy(), g_out.numpy(), delta.numpy())

    def _h_block(self, first: int, last: int) -> tuple[int, np.ndarray]:
        """The strided outputs h_first .. h_{last-1} side by side, and the step they start at."""
        return first, self._outputs(first, last).contiguous().numpy()

    def _u_block(self, first: int, last: int) -> tuple[int, np.ndarray]:
        """The strided outputs' gradients u_{first-1} .. u_{last-2} side by side, and the step they
        start at."""
        from bppsa_core.jacobians import buffer

        u_at = max(first - 1, 0)
        window = self._u[u_at : last - 1]
        return u_at, buffer("walk outputs' gradients", window.shape, self._u).copy_(window).numpy()


class GRUWalk:
    """A GRU layer's compiled backward (``_gru_layer``) over its forward's tape (``layer.Tape``):
    the gates (T, B, 4H; r, z, n, m) and the states h_0..h_T (T + 1, B, H), with the hidden
    weights ``w_hh`` (3H, H), the outputs' gradients ``u`` (T, B, H; 0 past each end) or None and
    the samples' ``lengths`` (B,) or None, walked over any block of steps, the latest first, as
    ``LSTMWalk``."""

    def __init__(
        self,
        gates: np.ndarray,
        states: np.ndarray,
        w_hh: Tensor,
        u: Tensor | None,
        lengths: Tensor | None = None,
        *,
        flush: bool = True,
    ) -> None:
        one, tiny = _SCALARS[w_hh.dtype]
        n_threads = threads()
        self._kernel = _gru_layer_parallel if n_threads > 1 else _gru_layer_serial
        self._head = (u is not None, one, tiny if flush else one - one, min(n_threads, gates.shape[1]))
        self._arrays = (*_arrays(gates, states, w_hh), *_outside_and_ends(u, lengths, gates, w_hh.dtype))

    def __call__(
        self, first: int, last: int, g_in: Tensor, g_out: Tensor, d_in: Tensor, d_hid: Tensor
    ) -> None:
        """Steps ``last`` - 1 down to ``first``: from dL/dh after them, ``g_in`` (B, H), to dL/dh
        before them into ``g_out`` (B, H; may be ``g_in``), the steps' input- and hidden-side
        pre-activation gradients into ``d_in`` and ``d_hid`` (last - first, B, 3H), all contiguous."""
        self._kernel(
            *self._head, first, last, *self._arrays, g_in.numpy(), g_out.numpy(), d_in.numpy(), d_hid.numpy()
        )
