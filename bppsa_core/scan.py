"""Scans over chains of transposed Jacobians: the heart of BPPSA.

Back-propagation through a recurrence is the affine chain, consumed from its end:

    x_k = x_{k+1} @ M_k + b_k,      k = n-1, ..., 0,   x_n given,

written for row vectors: ``x`` is a batch of gradients (B, H), ``M_k`` is one (H, H) element per
sample (or one shared by the whole batch; dense or factored, see ``bppsa_core.chain``) and ``b_k``
is an optional injected gradient. For a recurrent layer ``M_k = dh_{k+1}/dh_k`` (the Jacobian of step
k+1), ``b_k`` is the gradient that reaches h_k from outside the layer and x_k = dL/dh_k. For a row
vector, ``x @ J`` is the column-vector product ``J^T x``, so ``M_k`` holds the Jacobian itself and
the chain is docs/DESIGN.md's ``g_{t-1} = J_t^T g_t + u_{t-1}`` without a transpose copy; read from the
end, it is the paper's scan of [g_T, J_T^T, ..., J_1^T]. Composing two elements is a plain matrix
product (the later one on the left): ``x @ M_k @ M_{k-1}``. Affine maps compose associatively,
which is what lets the chain be scanned in parallel. Everything stays in time order: no strategy
flips or copies the chain.

Every strategy returns ``[x_0, x_1, ..., x_n]`` as one (n + 1, B, H) tensor:

* ``sequential``: n dependent matrix-vector steps; the reference twin of the others.
* ``blelloch``: the paper's work-efficient scan, one batched tensor operation per level: the up-sweep
  pairs neighbours (matrix @ matrix, except the spine that starts with ``x_n``, which stays a vector),
  the down-sweep fills in the rest (all matrix-vector). ``levels`` limits the up/down levels; the
  middle is scanned sequentially (the paper's heterogeneous variant). Each level writes a temporary
  of half the size of the one before, so the working set is about one extra chain.
* ``chunked``: the two-level scan. The chain is cut into chunks of ``chunk`` elements; all chunks are
  reduced to one matrix each in parallel (``chunk`` dependent batched products), the few chunk
  aggregates are scanned, and every chunk is expanded from its entry vector with matrix-vector
  products. The same O(n) matrix products as Blelloch's scan, depth ~2·chunk + scan(n / chunk), and a
  small working set.
* ``triton``: the chunked scan as three Triton kernels for a factored chain of up to three terms
  (RNN and GRU, H <= 64) or an LSTM's (H <= 32) (``bppsa_core.triton``, whose twin is ``chunked``).
* ``graph``: on a GPU, the eager per-level scan (Blelloch, or chunked when Blelloch's up-sweep
  would not fit) captured once per shape in a CUDA graph and replayed: one launch instead of one
  per op, for the chains the Triton kernels do not take.

No strategy pads the chain to a power of two, and elements shared by the batch (a batch dimension of
1) broadcast instead of being copied.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Literal

import torch
from torch import Tensor

from bppsa_core import dispatch
from bppsa_core.chain import Chain, DenseChain, FactoredChain, Index, LSTMChain, as_chain
from bppsa_core.denormals import flush_denormals
from bppsa_core.dispatch import ScanOptions

log = logging.getLogger(__name__)

Strategy = Literal["auto", "sequential", "blelloch", "chunked", "triton", "graph"]

# Up-sweep levels with more elements than this (B·H² each counted) are computed in _SLABS slabs.
_SLAB_THRESHOLD = 1 << 20
_SLABS = 16


def _vec(chain: Chain, x: Tensor, idx: Index, offsets: Tensor | None) -> Tensor:
    """Row vectors through selected elements: x @ M[idx] (+ offsets[idx]); x is ([S,] B, H)."""
    y = chain.rmul(x.unsqueeze(-2), idx).squeeze(-2)
    return y if offsets is None else y.add_(offsets[idx])


def _check(chain: Chain, x_last: Tensor, offsets: Tensor | None) -> None:
    n, bm, h = chain.length, chain.batch, chain.hidden
    if x_last.dim() != 2 or x_last.shape[1] != h:
        raise ValueError(f"x_last must have shape (B, {h}), got {tuple(x_last.shape)}")
    batch = x_last.shape[0]
    if bm not in (1, batch):
        raise ValueError(f"chain elements have batch size {bm}; accepted: 1 (shared) or x_last's {batch}")
    if offsets is not None and tuple(offsets.shape) != (n, batch, h):
        raise ValueError(f"offsets must have shape {(n, batch, h)}, got {tuple(offsets.shape)}")


def scan(
    elements: Tensor | Chain,
    x_last: Tensor,
    offsets: Tensor | None = None,
    *,
    strategy: Strategy = "auto",
    chunk: int | None = None,
    levels: int | None = None,
) -> Tensor:
    """Solve ``x_k = x_{k+1} @ M_k + offsets[k]`` for k = n-1..0 from x_n = x_last; return x_0..x_n.

    Args:
        elements: the chain M_0..M_{n-1}: a (n, B or 1, H, H) tensor, a ``DenseChain`` or a
            ``FactoredChain`` (``bppsa_core.chain``); a batch size of 1 is shared by all samples.
        x_last: (B, H) the vector the chain starts from (the gradient at the last time step).
        offsets: optional (n, B, H) injected gradients; None is the paper's pure linear chain.
        strategy: "sequential", "blelloch", "chunked", "triton", "graph", or "auto" (see
            ``bppsa_core.dispatch.choose``).
        chunk: chunk size for "chunked" and "triton"; default ``dispatch.default_chunk(n)``.
        levels: up/down levels for "blelloch" before a sequential middle; None runs all levels.

    Returns:
        (n + 1, B, H) tensor whose row k is x_k (row n is x_last).

    The scan is itself a backward pass and builds no autograd graph: inputs that require grad, with
    grad mode on, are refused.
    """
    options = ScanOptions(strategy, chunk, levels)
    chain = as_chain(elements)
    _check(chain, x_last, offsets)
    _no_graph("scan", (*chain.tensors(), x_last, offsets))
    device = x_last.device
    chosen = dispatch.resolve(
        strategy,
        chain.length,
        x_last.shape[0],
        chain.hidden,
        device,
        _kernels_take(chain),
        _numba_takes(chain, x_last, offsets),
    )
    log.debug("scan of %d elements: %s", chain.length, chosen)
    with flush_denormals(device):  # long products of Jacobians underflow: see bppsa_core.denormals
        return _run(chosen, chain, x_last, offsets, options)


def forward_scan(chain: Chain, v0: Tensor, c: Tensor, options: ScanOptions) -> Tensor:
    """Solve ``v_t = J_t v_{t-1} + c_t`` for t = 1..n forward in time from v_0; return v_0..v_n.

    The same scan, read the other way: ``chain`` holds the transposed elements J_n^T, ..., J_1^T (a
    cell's ``tangent_chain``), so x_k = v_{n-k}. A tangent takes this path (forward-mode
    differentiation) and so does each iteration of a Newton forward (``bppsa_core.newton``). The
    Triton kernels take transposed factored chains (and "auto" picks them on a GPU); the compiled
    CPU kernels do not: "numba" runs as "auto" here.
    """
    strategy = "auto" if options.strategy == "numba" else options.strategy
    return scan(chain, v0, c.flip(0), strategy=strategy, chunk=options.chunk, levels=options.levels).flip(0)


def _run(chosen: str, chain: Chain, x_last: Tensor, offsets: Tensor | None, options: ScanOptions) -> Tensor:
    """The scan by the strategy ``chosen``."""
    device = x_last.device
    if chosen in _EAGER:
        return _eager(chosen, chain, x_last, offsets, options)
    dispatch.check_device(chosen, device)
    if chosen == "graph":
        return _graphed(chain, x_last, offsets, options)
    if chosen == "numba":
        if not _numba_takes(chain, x_last, offsets):
            raise ValueError(dispatch.NUMBA_REFUSED)
        from bppsa_core import numba_scan

        if isinstance(chain, LSTMChain):  # walked whole, the samples in parallel: no chunks
            return numba_scan.lstm_scan(chain, x_last, offsets)
        return numba_scan.chunked_scan(
            chain.scales, chain.weights, x_last, offsets, options.chunk, chain.diagonal
        )
    if not _kernels_take(chain):
        raise ValueError(dispatch.KERNELS_REFUSED)
    return dispatch.with_kernels(
        options.strategy,
        device,
        lambda: _triton(chain, x_last, offsets, options.chunk),
        lambda: _graphed(chain, x_last, offsets, options),
    )


_EAGER = ("sequential", "blelloch", "chunked")


def _eager(name: str, chain: Chain, x_last: Tensor, offsets: Tensor | None, options: ScanOptions) -> Tensor:
    """One of the scans made of plain PyTorch ops, by name."""
    if name == "blelloch":
        return blelloch_scan(chain, x_last, offsets, levels=options.levels)
    if name == "chunked":
        return chunked_scan(chain, x_last, offsets, chunk=options.chunk)
    return sequential_scan(chain, x_last, offsets)


def _kernels_take(chain: Chain) -> bool:
    """Whether the Triton kernels take this chain: a factored one (transposed or not) that
    ``dispatch.kernels_take``, or an LSTM's, not transposed, that ``dispatch.lstm_kernels_take``."""
    dtypes = [t.dtype for t in chain.tensors()]
    if isinstance(chain, LSTMChain):
        return not chain.transposed and dispatch.lstm_kernels_take(chain.weights.shape[-1], *dtypes)
    return isinstance(chain, FactoredChain) and dispatch.kernels_take(
        chain.weights.shape[0], chain.hidden, *dtypes
    )


def _numba_takes(chain: Chain, x_last: Tensor, offsets: Tensor | None) -> bool:
    """Whether the compiled CPU kernels take this chain: a factored one or an LSTM's, not
    transposed, that ``dispatch.numba_takes`` with the start vector and offsets of its dtype."""
    lstm = isinstance(chain, LSTMChain)
    if not (lstm or isinstance(chain, FactoredChain)) or chain.transposed:
        return False
    tensors = (*chain.tensors(), x_last) + (() if offsets is None else (offsets,))
    return dispatch.numba_takes(chain.weights.shape[0], *(t.dtype for t in tensors), lstm=lstm)


def _triton(chain: Chain, x_last: Tensor, offsets: Tensor | None, chunk: int | None) -> Tensor:
    """The chunked scan in Triton kernels (``bppsa_core.triton``)."""
    from bppsa_core import triton as triton_kernels

    run = triton_kernels.lstm_scan if isinstance(chain, LSTMChain) else triton_kernels.factored_scan
    return run(chain, x_last, offsets, chunk or dispatch.default_chunk(chain.length))


# Captured scans: (shapes, dtypes, options) -> (graph, static inputs, static output). Bounded: a
# training run sees a few shapes (its batch size, a smaller last batch).
_GRAPHS: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], Tensor]] = OrderedDict()
_MAX_GRAPHS = 16


def _graphed(chain: Chain, x_last: Tensor, offsets: Tensor | None, options: ScanOptions) -> Tensor:
    """The eager per-level scan, captured in a CUDA graph once per shape and replayed.

    The inputs are copied into the graph's static buffers and the result is copied out, so the
    caller may keep or overwrite it. Blelloch's scan is captured (with ``levels``), or the chunked
    one when Blelloch's up-sweep would not fit (``dispatch.eager_strategy``). Inside a capture the
    caller runs (a whole training step captured), the eager scan runs as it is, captured with the rest.
    """
    inner = dispatch.eager_strategy(chain.length, x_last.shape[0], chain.hidden, x_last.device)
    if torch.cuda.is_current_stream_capturing():  # a whole step being captured: graphs do not nest
        return _eager(inner, chain, x_last, offsets, options)
    tensors = [*chain.tensors(), x_last] + ([] if offsets is None else [offsets])
    key = (type(chain), tuple((tuple(t.shape), t.dtype, t.device) for t in tensors), inner, options)
    n_chain = len(chain.tensors())

    def run(ts: list[Tensor]) -> Tensor:
        b = None if offsets is None else ts[n_chain + 1]
        return _eager(inner, chain.with_tensors(ts[:n_chain]), ts[n_chain], b, options)

    if key not in _GRAPHS:
        static = [t.detach().clone() for t in tensors]
        side = torch.cuda.Stream(device=x_last.device)
        side.wait_stream(torch.cuda.current_stream(x_last.device))
        with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs require
            run(static)
        torch.cuda.current_stream(x_last.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the autograd engine calls the backward from its own device thread
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = run(static)
        _GRAPHS[key] = (graph, static, out)
        if len(_GRAPHS) > _MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    _GRAPHS.move_to_end(key)
    graph, static, out = _GRAPHS[key]
    for dst, src in zip(static, tensors, strict=True):
        dst.copy_(src)
    graph.replay()
    return out.clone()


def sequential_scan(elements: Tensor | Chain, x_last: Tensor, offsets: Tensor | None = None) -> Tensor:
    """The reference twin: n dependent matrix-vector steps, as BPTT takes them."""
    chain = as_chain(elements)
    n = chain.length
    out = x_last.new_empty((n + 1, *x_last.shape))
    out[n] = x = x_last
    for k in reversed(range(n)):
        x = _vec(chain, x, k, offsets)
        out[k] = x
    return out


def blelloch_scan(
    elements: Tensor | Chain, x_last: Tensor, offsets: Tensor | None = None, *, levels: int | None = None
) -> Tensor:
    """Blelloch's up-sweep/down-sweep, one batched op per level, any chain length.

    One level pairs the chain from its end: the spine takes M_{n-1} (a matrix-vector product), then
    (M_{n-2} M_{n-3}), (M_{n-4} M_{n-5}), ... become one dense element each (matrix-matrix); an
    unpaired M_0 is left for the down-sweep. Scanning the paired chain one level down yields x_k at
    every other k; the down-sweep gets the rest from their neighbours (all matrix-vector). With
    ``levels`` set, the scan turns sequential after that many levels (heterogeneous BPPSA).
    """
    chain = as_chain(elements)
    n = chain.length
    if n == 0 or levels == 0:
        return sequential_scan(chain, x_last, offsets)
    pairs = (n - 1) // 2
    lo0 = (n - 1) - 2 * pairs  # 1 when M_0 stays unpaired
    lo, hi = slice(lo0, lo0 + 2 * pairs, 2), slice(lo0 + 1, lo0 + 1 + 2 * pairs, 2)
    # Up-sweep: the spine absorbs M_{n-1}; each pair (hi, lo) = (k+1, k) folds into M_{k+1} @ M_k.
    spine = _vec(chain, x_last, n - 1, offsets)
    up = DenseChain(_pair_products(chain, lo0, pairs))
    up_b = None if offsets is None else _vec(chain, offsets[hi], lo, offsets)
    kept = blelloch_scan(up, spine, up_b, levels=None if levels is None else levels - 1)
    out = x_last.new_empty((n + 1, *x_last.shape))
    out[n] = x_last
    out[lo0:n:2] = kept  # x at lo0, lo0 + 2, ..., n - 1
    # Down-sweep: every other x_j = x_{j+1} @ M_j + b_j, all at once.
    rest = slice(1 - lo0, n - 1, 2)
    count = len(range(1 - lo0, n - 1, 2))
    if count:
        out[rest] = _vec(chain, out[2 - lo0 : n : 2][:count], rest, offsets)
    return out


def _pair_products(chain: Chain, lo0: int, pairs: int) -> Tensor:
    """The up-sweep's products M_{k+1} @ M_k for k = lo0, lo0 + 2, ...: (pairs, B or 1, H, H).

    A large level is computed in slabs, so that the temporaries (the left factors made dense, a
    product's scaled copy) stay a fraction of the output: the level's peak memory is about its
    output, not three times it.
    """
    h = chain.hidden
    big = pairs * chain.batch * h * h > _SLAB_THRESHOLD
    slab = max(1, math.ceil(pairs / _SLABS)) if big else max(pairs, 1)
    out = None
    for s in range(0, max(pairs, 1), slab):
        e = min(pairs, s + slab)
        hi, lo = slice(lo0 + 1 + 2 * s, lo0 + 1 + 2 * e, 2), slice(lo0 + 2 * s, lo0 + 2 * e, 2)
        prod = chain.rmul(chain.dense(hi), lo)
        if e == pairs and out is None:
            return prod
        if out is None:
            out = prod.new_empty((pairs, *prod.shape[1:]))
        out[s:e] = prod
    return out


def chunked_scan(
    elements: Tensor | Chain, x_last: Tensor, offsets: Tensor | None = None, *, chunk: int | None = None
) -> Tensor:
    """Two-level scan: reduce chunks in parallel, scan their aggregates, expand inside chunks.

    Chunks q = 0..P-2 are the full runs [qC, (q+1)C); the last, the spine, holds the remainder
    r = n - (P-1)·C (1 <= r <= C). The spine starts at x_n, so it is walked with matrix-vector products
    during the reduce loop and is done by then; chunk 0's aggregate is never needed, so only chunks
    1..P-2 are reduced to matrices. Every step of every loop selects one strided slice of elements:
    no padding, no copy of the chain, and the loop's large buffers are reused.
    """
    chain = as_chain(elements)
    n = chain.length
    if chunk is None:
        element = x_last.shape[0] * _terms(chain) * chain.hidden**2 * x_last.element_size()
        chunk = dispatch.default_chunk(n, element)
    c = chunk
    p = math.ceil(n / c)
    if p <= 2:  # at most one chunk besides the spine: nothing to reduce in parallel
        return sequential_scan(chain, x_last, offsets)
    full = (p - 1) * c  # chunks 0..P-2 end here; the spine is [full, n)

    out = x_last.new_empty((n + 1, *x_last.shape))
    out[n] = x = x_last
    first = slice(2 * c - 1, full, c)  # the last element of chunks 1..P-2: applied first
    agg = chain.dense(first).clone(memory_format=torch.contiguous_format)  # a buffer we may overwrite
    spare, work = torch.empty_like(agg), agg.new_empty(chain.work_shape(agg))
    agg_b = None if offsets is None else offsets[first]
    for i in range(c):
        if i < n - full:  # the spine
            k = n - 1 - i
            x = _vec(chain, x, k, offsets)
            out[k] = x
        if i > 0:  # reduce chunks 1..P-2 to one affine element each
            idx = slice(2 * c - 1 - i, full, c)
            if agg_b is not None:
                agg_b = _vec(chain, agg_b, idx, offsets)
            agg, spare = chain.rmul(agg, idx, out=spare, work=work), agg
    # x at the top of chunks 0..P-2: a scan over the P-2 aggregates, started from the spine's end.
    y = scan(agg, x, agg_b, strategy=dispatch.eager_strategy(p - 2, agg.shape[1], chain.hidden, x.device))
    for i in range(c):
        idx = slice(c - 1 - i, full, c)
        y = _vec(chain, y, idx, offsets)
        out[idx] = y
    return out


def _no_graph(name: str, inputs: tuple[Tensor | None, ...]) -> None:
    """Refuse inputs that would need an autograd graph: a scan or fold is itself a backward pass, and
    it reuses buffers in place."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise ValueError(
            f"{name}() builds no autograd graph; pass tensors that do not require grad "
            "(detach them, or call it under torch.no_grad())"
        )


def fold(
    elements: Tensor | Chain, offsets: Tensor | None = None, *, chunk: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """The whole chain as one affine element: ``x_0 = x_n @ A + b`` for any x_n.

    Returns A (B or 1, H, H) and b (B, H), or None without offsets. The chain is cut into chunks of
    ``chunk`` elements (default about sqrt(n)), all chunks are reduced at once, as the chunked scan's
    reduce does, then the chunk aggregates are composed: chunk + n / chunk dependent products instead
    of n. A distributed scan hands this element to the other ranks (``bppsa_core.distributed``).
    Like ``scan``, it builds no autograd graph: inputs that require grad, with grad mode on, are
    refused.
    """
    chain = as_chain(elements)
    _no_graph("fold", (*chain.tensors(), offsets))
    n, hidden = chain.length, chain.hidden
    c = chunk or max(1, math.isqrt(n))
    p = n // c  # full chunks [qc, (q+1)c); the remainder [pc, n) is folded first, on its own
    a = b = None

    def compose(a, b, a_next, b_next):  # (x @ a + b) @ a_next + b_next
        a_out = a_next if a is None else a @ a_next
        if b is not None:
            b = (b.unsqueeze(-2) @ a_next).squeeze(-2)
        return a_out, (b if b_next is None else b_next if b is None else b + b_next)

    with flush_denormals(chain.tensors()[0].device):
        for k in range(n - 1, p * c - 1, -1):  # the remainder, one element at a time
            a, b = compose(a, b, chain.dense(slice(k, k + 1))[0], None if offsets is None else offsets[k])
        if p:
            top = slice(c - 1, p * c, c)  # each chunk's last element: applied first
            agg = chain.dense(top).clone(memory_format=torch.contiguous_format)
            # the loop's buffers, reused as the chunked scan's are: no allocation per product
            spare, work = torch.empty_like(agg), agg.new_empty(chain.work_shape(agg))
            agg_b = None if offsets is None else offsets[top].clone()
            for i in range(1, c):
                idx = slice(c - 1 - i, p * c, c)
                if agg_b is not None:
                    agg_b = _vec(chain, agg_b, idx, offsets)
                agg, spare = chain.rmul(agg, idx, out=spare, work=work), agg
            for q in range(p - 1, -1, -1):
                a, b = compose(a, b, agg[q], None if agg_b is None else agg_b[q])
    if offsets is not None and b is None:
        b = torch.zeros_like(offsets[0])
    if a is None:  # an empty chain is the identity
        like = chain.tensors()[0]
        a = torch.eye(hidden, dtype=like.dtype, device=like.device).expand(1, hidden, hidden)
    return a, b


def _terms(chain: Chain) -> int:
    """How many (state x state) matrices one product by an element touches: its weights and the
    scaled copy of the multiplied rows (an LSTM's scaled copy is 2H x 4H, its output 2H x 2H)."""
    if isinstance(chain, FactoredChain):
        return chain.weights.shape[0]
    return 3 if isinstance(chain, LSTMChain) else 1


def elementwise_recurrence(a: Tensor, b: Tensor, x0: Tensor, chunk: int | None = None) -> Tensor:
    """x_t = a_t * x_{t-1} + b_t for t = 1..n, elementwise, from x0; returns x_1..x_n as (n, ...).

    The diagonal case of the chain, solved forward in time by the same two-level scheme as
    ``chunked_scan``: every chunk is scanned from 0 in parallel (with its running products of a),
    the chunks' entry values follow one after the other, and one fused multiply-add corrects
    every chunk: about 2·chunk + n / chunk dependent steps instead of n. An LSTM's backward
    recovers its cell states this way (``jacobians.LSTMCell``).
    """
    n = a.shape[0]
    c = chunk or dispatch.default_chunk(n)
    p = n // c
    out = torch.empty_like(b)
    x = x0
    if p >= 2:
        full = p * c
        a_c, b_c = a[:full].unflatten(0, (p, c)), b[:full].unflatten(0, (p, c))
        local, prod = out[:full].unflatten(0, (p, c)), torch.empty_like(a_c)
        local[:, 0], prod[:, 0] = b_c[:, 0], a_c[:, 0]
        for i in range(1, c):
            torch.addcmul(b_c[:, i], a_c[:, i], local[:, i - 1], out=local[:, i])
            torch.mul(a_c[:, i], prod[:, i - 1], out=prod[:, i])
        entries = torch.empty_like(local[:, 0])
        for q in range(p):
            entries[q] = x
            x = torch.addcmul(local[q, -1], prod[q, -1], x)
        local.addcmul_(prod, entries.unsqueeze(1))
    else:
        full = 0
    for t in range(full, n):
        x = torch.addcmul(b[t], a[t], x)
        out[t] = x
    return out
