"""Compiled CPU kernels of the chunked scan (numba): the CPU counterpart of ``bppsa_core.triton_scan``,
with the same three phases, element modes and fused layer backwards; the plain-PyTorch twin is
``bppsa_core.scan.chunked_scan`` (with ``bppsa_core.jacobians`` for the fused layer backwards).

The chain is ``M_k[b] = sum_j diag(s[k, b, j]) @ W_j (+ diag(e[k, b]))`` with K <= 3 terms and
optional offsets, scanned as ``x_k = x_{k+1} @ M_k + offsets[k]`` from x_n. One compiled call runs:

1. reduce: one task per (chunk 1..P-2, sample) folds its chunk into an H x H aggregate and offset;
2. spine: one task per sample walks the last chunk from x_n, then the chunk aggregates;
3. expand: one task per (chunk 0..P-2, sample) walks its chunk from its entry vector.

Each phase is a ``prange`` over its tasks, so CPU threads are real workers across chunks and
samples (``torch.get_num_threads()`` of them; with one, a serial build runs in the calling thread).
The chunk count comes from ``dispatch.numba_chunk``: a chunk's aggregate costs H times a
walk, so with as many samples as threads one chunk (every sample walked once, in parallel) is
cheapest, and chunks pay only where threads outnumber samples.

Elements are read in one of four modes (as in ``triton_scan``): ``SCALES`` (a stored
``FactoredChain``), ``TANH`` / ``RELU`` (an RNN layer: f'(z_t) read off its outputs) and ``GRU``
(the gates recomputed from the layer's two pre-activation GEMMs and h_{t-1}). The layer modes take
the outside gradient shifted by one step and write only g_0 and every step's pre-activation
gradients, as the fused Triton kernels do. Inputs are float32 or float64; the first call of each
dtype compiles (cached on disk by numba afterwards).

Subnormal numbers: numba's worker threads do not run in the caller's floating-point mode, so
``bppsa_core.denormals`` cannot reach them; instead every step's results (walked vectors, aggregate
rows and offsets) below the dtype's smallest normal number are set to 0, which is what flush-to-zero
does to them (docs/DESIGN.md, "Subnormal numbers"), for H compares a step against K·H² products.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import numba
import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from bppsa_core import dispatch

SCALES, TANH, RELU, GRU = 0, 1, 2, 3
ACTIVATIONS = {"tanh": TANH, "relu": RELU}


@njit(cache=True)
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@njit(cache=True)
def _element(mode, k, b, n_terms, has_diag, scales, diag, h, gi, gh, h_prev, s, e, dn):
    """Element k of sample b into s (3, H) (the scales of W_0..W_2), e (H) (the diagonal) and, for
    a GRU, dn (H) = (1 - z)(1 - n^2). See ``triton_scan._element`` for each mode's formulas."""
    hid = s.shape[1]
    if mode == GRU:
        for i in range(hid):
            r = _sigmoid(gi[k, b, i] + gh[k, b, i])
            z = _sigmoid(gi[k, b, hid + i] + gh[k, b, hid + i])
            m = gh[k, b, 2 * hid + i]
            nn = math.tanh(gi[k, b, 2 * hid + i] + r * m)
            d = (1.0 - z) * (1.0 - nn * nn)
            dn[i] = d
            s[0, i] = d * m * r * (1.0 - r)
            s[1, i] = (h_prev[k, b, i] - nn) * z * (1.0 - z)
            s[2, i] = d * r
            e[i] = z
    elif mode == SCALES:
        bs = b if scales.shape[1] > 1 else 0
        for j in range(n_terms):
            for i in range(hid):
                s[j, i] = scales[k, bs, j, i]
        if has_diag:
            for i in range(hid):
                e[i] = diag[k, b, i]
    elif mode == TANH:
        for i in range(hid):
            s[0, i] = 1.0 - h[k, b, i] * h[k, b, i]
    else:
        for i in range(hid):
            s[0, i] = 1.0 if h[k, b, i] > 0 else 0.0


@njit(cache=True)
def _vec_step(y, s, e, w, n_terms, has_diag, out, tiny):
    """out = y @ M for one element given as its factors (the j loop innermost: it vectorizes), with
    results below ``tiny`` in magnitude flushed to 0 (module docstring)."""
    hid = y.shape[0]
    for j in range(hid):
        out[j] = y[j] * e[j] if has_diag else 0.0
    for t in range(n_terms):
        for i in range(hid):
            a = y[i] * s[t, i]
            for j in range(hid):
                out[j] += a * w[t, i, j]
    for j in range(hid):
        if abs(out[j]) < tiny:
            out[j] = 0.0


@njit(cache=True)
def _walk(
    mode, n_terms, has_diag, has_b, shift, fused, tiny, lo, hi, b, y,
    scales, diag, h, gi, gh, h_prev, w, offsets, out, delta, g0,
):  # fmt: skip
    """Walk elements hi - 1 down to lo of sample b from y = x_hi; y ends as x_lo. Stores every x_k
    into ``out`` or (fused) step k's deltas into ``delta`` and x_0 into ``g0``."""
    hid = y.shape[0]
    s = np.zeros((3, hid), y.dtype)
    e = np.zeros(hid, y.dtype)
    dn = np.zeros(hid, y.dtype)
    nxt = np.empty(hid, y.dtype)
    for k in range(hi - 1, lo - 1, -1):
        _element(mode, k, b, n_terms, has_diag, scales, diag, h, gi, gh, h_prev, s, e, dn)
        _vec_step(y, s, e, w, n_terms, has_diag, nxt, tiny)
        if has_b and k >= shift:
            for j in range(hid):
                nxt[j] += offsets[k - shift, b, j]
        if fused:
            if mode == GRU:
                for i in range(hid):
                    delta[k, b, i] = y[i] * s[0, i]
                    delta[k, b, hid + i] = y[i] * s[1, i]
                    delta[k, b, 2 * hid + i] = y[i] * dn[i]
                    delta[k, b, 3 * hid + i] = y[i] * s[0, i]
                    delta[k, b, 4 * hid + i] = y[i] * s[1, i]
                    delta[k, b, 5 * hid + i] = y[i] * s[2, i]
            else:
                for i in range(hid):
                    delta[k, b, i] = y[i] * s[0, i]
            if k == 0:
                g0[b, :] = nxt
        else:
            out[k, b, :] = nxt
        y[:] = nxt


def _scan(
    mode, n_terms, has_diag, has_b, shift, fused, tiny, n, chunk,
    scales, diag, h, gi, gh, h_prev, w, offsets, x_last, out, delta, g0,
):  # fmt: skip
    """The three phases (module docstring); chunk P-1 (the remainder) is walked by the spine."""
    batch, hid = x_last.shape
    p = (n + chunk - 1) // chunk
    nagg = max(p - 2, 0)
    agg = np.empty((max(nagg, 1), batch, hid, hid), x_last.dtype)
    agg_off = np.zeros((max(nagg, 1), batch, hid), x_last.dtype)
    entry = np.empty((max(p - 1, 1), batch, hid), x_last.dtype)
    for task in prange(nagg * batch):  # reduce: chunk q = 1..P-2, last element applied first
        q, b = np.int64(task) // batch + 1, np.int64(task) % batch  # a prange index is unsigned
        s = np.zeros((3, hid), x_last.dtype)
        e = np.zeros(hid, x_last.dtype)
        dn = np.zeros(hid, x_last.dtype)
        a = np.eye(hid, dtype=x_last.dtype)
        nxt = np.empty((hid, hid), x_last.dtype)
        c = agg_off[q - 1, b]
        c_nxt = np.empty(hid, x_last.dtype)
        for k in range(q * chunk + chunk - 1, q * chunk - 1, -1):
            _element(mode, k, b, n_terms, has_diag, scales, diag, h, gi, gh, h_prev, s, e, dn)
            for r in range(hid):
                _vec_step(a[r], s, e, w, n_terms, has_diag, nxt[r], tiny)
            a[:, :] = nxt
            if has_b:
                _vec_step(c, s, e, w, n_terms, has_diag, c_nxt, tiny)
                if k >= shift:
                    for j in range(hid):
                        c_nxt[j] += offsets[k - shift, b, j]
                c[:] = c_nxt
        agg[q - 1, b] = a
    for b_ in prange(batch):  # spine: the remainder chunk from x_n, then the aggregates
        b = np.int64(b_)
        y = x_last[b].copy()
        if not fused:
            out[n, b, :] = y
        _walk(
            mode, n_terms, has_diag, has_b, shift, fused, tiny, (p - 1) * chunk, n, b, y,
            scales, diag, h, gi, gh, h_prev, w, offsets, out, delta, g0,
        )  # fmt: skip
        if p > 1:
            entry[nagg, b] = y
        for j in range(nagg - 1, -1, -1):
            y2 = agg_off[j, b].copy()
            for i in range(hid):
                for col in range(hid):
                    y2[col] += y[i] * agg[j, b, i, col]
            y = y2
            entry[j, b] = y
    for task in prange((p - 1) * batch):  # expand: chunk q = 0..P-2 from its entry vector
        q, b = np.int64(task) // batch, np.int64(task) % batch
        y = entry[q, b].copy()
        _walk(
            mode, n_terms, has_diag, has_b, shift, fused, tiny, q * chunk, q * chunk + chunk, b, y,
            scales, diag, h, gi, gh, h_prev, w, offsets, out, delta, g0,
        )  # fmt: skip


def _compiled(fn: Callable, name: str, parallel: bool) -> Callable:
    """``fn`` compiled under its own name, so that numba's on-disk cache keeps the serial and the
    parallel build apart (the cache is keyed by the function's name, not by its options)."""
    renamed = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    renamed.__qualname__ = name
    return njit(parallel=parallel, cache=True)(renamed)


# One thread runs the serial build in the calling thread (no pool to wake, no worker spinning
# beside other work, each prange a plain loop); more threads run the parallel one.
_scan_serial = _compiled(_scan, "_scan_serial", parallel=False)
_scan_parallel = _compiled(_scan, "_scan_parallel", parallel=True)


def _arr(t: Tensor | None, dtype: torch.dtype, dims: int) -> np.ndarray:
    """A C-contiguous NumPy view of ``t`` (copied only if it is not contiguous), or a one-element
    placeholder of ``dims`` dimensions for a source the mode does not read."""
    if t is None:
        return np.zeros((1,) * dims, dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    return t.detach().contiguous().numpy()


def _run(
    mode: int,
    sources: dict[str, Tensor],
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int | None,
    out: Tensor | None = None,
    delta: Tensor | None = None,
    g0: Tensor | None = None,
    *,
    n: int,
    shift: int,
    flush: bool = True,
) -> None:
    """One compiled call, by keyword; ``sources`` holds the mode's tensors by name (scales, diag,
    h, gi, gh, h_prev), the others get placeholders. ``flush``: flush subnormal results to 0."""
    batch, hid = x_last.shape
    terms = weights.numel() // (hid * hid)
    dt = x_last.dtype
    chunk = chunk or dispatch.numba_chunk(n, batch, hid, terms, torch.get_num_threads())
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if threads > 1:
        numba.set_num_threads(threads)
    fused = delta is not None
    (_scan_parallel if threads > 1 else _scan_serial)(
        mode, terms, "diag" in sources or mode == GRU, offsets is not None, shift, fused,
        torch.finfo(dt).tiny if flush else 0.0, n, min(chunk, n),
        _arr(sources.get("scales"), dt, 4), _arr(sources.get("diag"), dt, 3), _arr(sources.get("h"), dt, 3),
        _arr(sources.get("gi"), dt, 3), _arr(sources.get("gh"), dt, 3), _arr(sources.get("h_prev"), dt, 3),
        _arr(weights.reshape(terms, hid, hid), dt, 3), _arr(offsets, dt, 3), _arr(x_last, dt, 2),
        _arr(out, dt, 3), _arr(delta, dt, 3), _arr(g0, dt, 2),
    )  # fmt: skip


def chunked_scan(
    scales: Tensor,
    weights: Tensor,
    x_last: Tensor,
    offsets: Tensor | None,
    chunk: int | None,
    diagonal: Tensor | None = None,
) -> Tensor:
    """The chunked scan of ``x_k = sum_j (x_{k+1} * s_kj) @ W_j + x_{k+1} * e_k + b_k``.

    scales (n, B or 1, K, H), weights (K, H, H), diagonal (n, B or 1, H) or None, x_last (B, H),
    offsets (n, B, H) or None; one dtype (float32 or float64). Returns x_0..x_n as (n + 1, B, H).
    """
    n, batch, hid = scales.shape[0], x_last.shape[0], x_last.shape[1]
    sources = {"scales": scales}
    if diagonal is not None:
        sources["diag"] = diagonal.expand(n, batch, hid)
    out = x_last.new_empty((n + 1, batch, hid))
    _run(SCALES, sources, weights, x_last, offsets, chunk, out, n=n, shift=0)
    return out


def rnn_layer_backward(
    h: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, nonlinearity: str, chunk: int | None
) -> tuple[Tensor, Tensor]:
    """One tanh/relu RNN layer's backward: g_0 (B, H) and delta_t = f'(z_t) * dL/dh_t (T, B, H),
    from the outputs ``h`` (T, B, H), the gradient at h_T and the outside gradients ``u``; as
    ``triton_scan.rnn_layer_backward``."""
    n, batch, hid = h.shape
    g0 = g_last.new_empty((batch, hid))
    delta = h.new_empty((n, batch, hid))
    _run(ACTIVATIONS[nonlinearity], {"h": h}, w_hh, g_last, u, chunk, None, delta, g0, n=n, shift=1)
    return g0, delta


def gru_layer_backward(
    gi: Tensor, gh: Tensor, h_prev: Tensor, w_hh: Tensor, g_last: Tensor, u: Tensor | None, chunk: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One GRU layer's backward: g_0 (B, H) and the pre-activation gradients of W_ih x + b_ih and
    W_hh h + b_hh, each (T, B, 3H), from the pre-activations ``gi``, ``gh`` and ``h_prev``; as
    ``triton_scan.gru_layer_backward``."""
    n, batch, hid = h_prev.shape
    g0 = g_last.new_empty((batch, hid))
    deltas = h_prev.new_empty((n, batch, 6 * hid))
    sources = {"gi": gi, "gh": gh, "h_prev": h_prev}
    _run(GRU, sources, w_hh, g_last, u, chunk, None, deltas, g0, n=n, shift=1)
    return g0, deltas[..., : 3 * hid], deltas[..., 3 * hid :]


def walk_layer(
    mode: int,
    sources: Callable[[slice], dict[str, Tensor]],
    w_hh: Tensor,
    g_last: Tensor,
    u: Tensor | None,
    steps: int,
) -> tuple[Callable[[slice], tuple[Tensor, Tensor]], Callable[[], Tensor]]:
    """A layer's fused backward as one chunk (each sample walked once, samples in parallel), made
    block by block from the end as ``jacobians.layer_grads`` asks for its deltas, so only a block's
    sources (``sources(steps)``: a GRU's two pre-activation GEMMs) and deltas ever exist.

    Returns ``deltas(t)``, the input- and hidden-side pre-activation gradients of the slice t of
    steps (slices asked for from the last one down; asking for the last again starts over), and a
    function giving g_0 once the first block has been walked.
    """
    batch, hid = g_last.shape
    width = 6 * hid if mode == GRU else hid
    state = {"g": g_last, "next": steps}

    def deltas(t: slice) -> tuple[Tensor, Tensor]:
        lo, hi, _ = t.indices(steps)
        if hi == steps:
            state["g"] = g_last
        elif hi != state["next"]:
            need = state["next"]
            raise RuntimeError(f"steps {lo}..{hi} asked for; a walk from the end needs ..{need} next")
        n = hi - lo
        delta, g0 = g_last.new_empty((n, batch, width)), g_last.new_empty((batch, hid))
        offsets = None if u is None else u[max(lo - 1, 0) : hi - 1]  # element k reads u_{k-1}
        _run(mode, sources(t), w_hh, state["g"], offsets, n, None, delta, g0, n=n, shift=int(lo == 0))
        state["g"], state["next"] = g0, lo
        return (delta[..., : 3 * hid], delta[..., 3 * hid :]) if mode == GRU else (delta, delta)

    def first() -> Tensor:
        if state["next"] != 0:
            raise RuntimeError("g_0 is known once every block has been walked")
        return state["g"]

    return deltas, first
