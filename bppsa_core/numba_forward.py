"""The forward of one layer compiled for the CPU (numba): the counterpart of PyTorch's fused kernel
(``bppsa_core.layer.native_forward``), which is also its plain-PyTorch twin in the tests.

PyTorch's CPU kernel issues a handful of small ops per step, each a few microseconds of overhead
for B·G·H² multiply-adds that take well under one. Here the recurrence is one compiled loop, each
group of samples a task (a ``prange`` over ``torch.get_num_threads()`` groups; with one thread, a
serial build runs in the calling thread) that steps its samples side by side. A step is the
inputs' side ``x_t @ W_ih^T + b_ih`` (made in the step by ``numba_math.add_hidden``, or for wide
inputs one GEMM a segment on the host: ``_project``) plus b_hh plus ``h @ W_hh^T`` (``add_hidden``),
then the cell's activations, elementwise:

* RNN: ``h' = tanh(a)`` or ``relu(a)``;
* GRU: ``r, z = sigmoid(.)``, ``n = tanh(a_n + r (W_hn h + b_hn))``, ``h' = n + z (h - n)``;
* LSTM: ``i, f, o = sigmoid(.)``, ``g = tanh(.)``, ``c' = f c + i g``, ``h' = o tanh(c')``;

the same formulas, in the same order, as PyTorch's CPU cells, with ``numba_math``'s vectorizable
sigmoid and tanh (a few ulps in each dtype; a build per dtype). Every build rounds alike, so the
threads change no bit of the results.

Packed sequences are padded steps with lengths, as in ``native_forward``: past a sample's end its
outputs are 0 and its state is carried to the last state.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from bppsa_core.numba_math import (
    ACTIVATIONS,
    GATE_SIGMOID,
    GATE_TANH,
    NUMPY_DTYPES,
    UNUSED,
    add_hidden,
    build,
    padded,
    put,
    running,
    threads,
)

# The kernels' activations: float64's here, each dtype's in its build (``numba_math.build``); the
# GRU's and LSTM's untaped builds, whose taped ones (``_kernel``) set _TAPED.
_, _tanh, _sigmoid, _gate = ACTIVATIONS[np.float64]
_TAPED = False

# ------------------------------------------------------------------------------------------ kernels


@njit(inline="always", error_model="numpy")
def _project(xin, flat, xt, inputs, t, lo, b_ih):
    """xin (N, R) = the group's input side at step t (samples lo .. lo + N - 1), b_ih included;
    ``flat`` is xin's flat view (N * R,). ``inputs`` = (xw, x, w_ih_t, b_ih, b_hh)
    (``_transposed``): with x (S, B, F) not empty, x_t w_ih^T + b_ih made here (``add_hidden``;
    xt (N, F) takes the step's inputs, ``b_ih`` is the bias in N rows, ``_rows``), so that no
    projected inputs go through memory and no tensor op runs on the host; else xw (S, B, R), the
    inputs projected on the host."""
    xw, x, w_ih_t, _, _ = inputs
    if x.shape[0]:
        for b in range(xin.shape[0]):
            for f in range(xt.shape[1]):
                xt[b, f] = x[t, lo + b, f]
        for k in range(b_ih.size):
            flat[k] = b_ih[k]
        add_hidden(xin, xt, w_ih_t)
    else:
        for b in range(xin.shape[0]):
            for j in range(xin.shape[1]):
                xin[b, j] = xw[t, lo + b, j]


@njit(inline="always", error_model="numpy")
def _transposed(inputs):
    """``inputs`` with w_ih (R, F) as its transpose (F, R), the layout ``add_hidden`` reads
    (``padded``): a copy of F·R numbers a call, cheaper than a tensor op on the host."""
    xw, x, w_ih, b_ih, b_hh = inputs
    return xw, x, padded(w_ih.T), b_ih, b_hh


@njit(inline="always", error_model="numpy")
def _step_inputs(inputs, n):
    """The buffer of a group's inputs at one step (``_project``): (n, F), or empty for an xw."""
    x = inputs[1]
    return np.empty((n if x.shape[0] else 0, x.shape[2]), x.dtype)


@njit(inline="always", error_model="numpy")
def _rows(bias, n):
    """``bias`` (R,) in n rows, flat (n * R,): so that a group's bias is set or added in one loop
    over all its samples' units (``_project``, ``_load``), not a loop of R per sample whose
    remainder runs in scalars (with the RNN's activations so: its forward a fifth faster at
    H = 20, re-measured by ``python -m benchmarks.forward --tables compiled --models rnn``)."""
    rows = np.empty(n * bias.size, bias.dtype)
    for b in range(n):
        for j in range(bias.size):
            rows[b * bias.size + j] = bias[j]
    return rows


@njit(inline="always", error_model="numpy")
def _load(acc, xin, b_hh):
    """acc = the input side xin (``_project``) + b_hh in N rows (``_rows``), all flat (N * R,)."""
    for k in range(acc.size):
        acc[k] = xin[k] + b_hh[k]


@njit(inline="always", error_model="numpy")
def _store(out, t, lo, steps, h):
    """out[t] of the group: each sample's state while it runs (t < its steps), 0 after."""
    zero = out.dtype.type(0)
    for b in range(h.shape[0]):
        running = t < steps[lo + b]
        for j in range(h.shape[1]):
            out[t, lo + b, j] = h[b, j] if running else zero


def _rnn(relu, groups, inputs, w_hh, h0, steps, out, h_last):
    """An RNN's recurrence over a segment: ``inputs`` the input side (``_project``), w_hh (H, H),
    h0 (B, H), ``steps`` (B,) the steps each sample runs (after them it outputs 0 and
    keeps its state); writes out (S, B, H) and the last states h_last (B, H). ``groups`` of
    samples run in parallel, each a task that steps its samples together. Each kernel transposes
    its w_hh itself: a copy of G·H² numbers, cheaper than a tensor op on the host per call."""
    seg, batch, hid = out.shape
    zero = out.dtype.type(0)
    w_t = padded(w_hh.T)
    inputs = _transposed(inputs)
    for g in prange(groups):
        lo, hi = g * batch // groups, (g + 1) * batch // groups
        n = hi - lo
        h = h0[lo:hi].copy()
        acc, xin, xt = np.empty_like(h), np.empty_like(h), _step_inputs(inputs, n)
        xin_flat = xin.reshape(xin.size)
        b_ih, b_hh = _rows(inputs[3], n), _rows(inputs[4], n)
        shortest = seg
        for b in range(n):
            shortest = min(shortest, steps[lo + b])
        for t in range(seg):
            acc_flat = acc.reshape(acc.size)  # a view a step: acc and h change places
            _project(xin, xin_flat, xt, inputs, t, lo, b_ih)
            _load(acc_flat, xin_flat, b_hh)
            add_hidden(acc, h, w_t)
            if relu:  # the group's units in one loop: no remainder a sample
                for k in range(acc.size):
                    acc_flat[k] = zero if acc_flat[k] < zero else acc_flat[k]
            else:
                for k in range(acc.size):
                    acc_flat[k] = _tanh(acc_flat[k])
            if t < shortest:  # every sample runs: the new states are acc's, the old its buffer
                h, acc = acc, h
            else:
                for b in range(n):
                    if t < steps[lo + b]:
                        for j in range(hid):
                            h[b, j] = acc[b, j]
            _store(out, t, lo, steps, h)
        put(h_last[lo:hi], h)


def _gru(groups, inputs, w_hh, h0, steps, out, h_last, gates, states):
    """A GRU's recurrence over a segment: ``inputs`` the input side (``_project``), w_hh (3H, H) (rows
    r, z, n), b_hh's n part inside r; otherwise as ``_rnn``. A step's sigmoids are one loop over
    a sample's 2H units (r, z side by side), its tanh one loop over the group's candidates n, as
    the LSTM's (``_lstm``): PyTorch's formulas, in its order. Its taped build (``_TAPED``) also
    writes each step's r, z, n and m = W_hn h + b_hn into gates (S, B, 4H) and the states
    h_0..h_S into states (S + 1, B, H), what the backward takes (``layer.Tape``), zeros past a
    sample's end, as the LSTM's."""
    seg, batch, hid = out.shape
    rows = w_hh.shape[0]
    b_hh = inputs[4]
    w_t = padded(w_hh.T)
    inputs = _transposed(inputs)
    for g in prange(groups):
        lo, hi = g * batch // groups, (g + 1) * batch // groups
        n = hi - lo
        h = h0[lo:hi].copy()
        if _TAPED:
            put(states[0, lo:hi], h)
        acc, xin, xt = np.empty((n, rows), h.dtype), np.empty((n, rows), h.dtype), _step_inputs(inputs, n)
        cand = np.empty(n * hid, h.dtype)
        acc_flat, xin_flat = acc.reshape(acc.size), xin.reshape(xin.size)
        b_ih_rows, b_hh_rows = _rows(inputs[3], n), _rows(b_hh, n)
        for t in range(seg):
            _project(xin, xin_flat, xt, inputs, t, lo, b_ih_rows)
            _load(acc_flat, xin_flat, b_hh_rows)
            for b in range(n):  # the n gate's hidden side starts from b_hn alone (r multiplies it)
                for j in range(hid):
                    acc[b, 2 * hid + j] = b_hh[2 * hid + j]
            add_hidden(acc, h, w_t)
            for b in range(n):
                for j in range(2 * hid):
                    acc[b, j] = _sigmoid(acc[b, j])
            for b in range(n):
                for j in range(hid):
                    cand[b * hid + j] = xin[b, 2 * hid + j] + acc[b, j] * acc[b, 2 * hid + j]
            for k in range(n * hid):
                cand[k] = _tanh(cand[k])
            for b in range(n):
                if t < steps[lo + b]:
                    for j in range(hid):  # h' = n + z (h - n)
                        c = cand[b * hid + j]
                        h[b, j] = c + acc[b, hid + j] * (h[b, j] - c)
                    if _TAPED:
                        for j in range(2 * hid):
                            gates[t, lo + b, j] = acc[b, j]
                        for j in range(hid):
                            gates[t, lo + b, 2 * hid + j] = cand[b * hid + j]
                            gates[t, lo + b, 3 * hid + j] = acc[b, 2 * hid + j]
                            states[t + 1, lo + b, j] = h[b, j]
                elif _TAPED:  # past the sample's end: zeros, as its outputs
                    for j in range(4 * hid):
                        gates[t, lo + b, j] = 0.0
                    for j in range(hid):
                        states[t + 1, lo + b, j] = 0.0
            _store(out, t, lo, steps, h)
        put(h_last[lo:hi], h)


def _lstm(groups, inputs, w_hh, h0, c0, steps, out, h_last, c_last, gates, cells, states):
    """An LSTM's recurrence over a segment: ``inputs`` the input side (``_project``), w_hh (4H, H)
    (rows i, f, g, o), h0 and c0 (B, H); writes the outputs and the last
    (h, c); otherwise as ``_rnn``. Its taped build (``_TAPED``) also writes the activated gates
    (S, B, 4H), the cell states c_0..c_S into cells (S + 1, B, H) and the states h_0..h_S into
    states (S + 1, B, H), what the backward takes (``layer.Tape``), zeros past a sample's end;
    a build of its own, as a run-time flag in the loop slows both down.

    A step activates each sample's 4H gates in one loop (``_gate``, sigmoid or tanh by column) and
    the group's new cell states' tanh in another, over all its samples at once: loops of 4H and
    group x H, not one of H per sample whose remainder runs in narrower vectors (re-measured by
    ``python -m benchmarks.forward --tables compiled``)."""
    seg, batch, hid = out.shape
    rows = w_hh.shape[0]
    w_t = padded(w_hh.T)
    inputs = _transposed(inputs)
    for g in prange(groups):
        lo, hi = g * batch // groups, (g + 1) * batch // groups
        n = hi - lo
        h, c = h0[lo:hi].copy(), c0[lo:hi].copy()
        if _TAPED:
            put(cells[0, lo:hi], c)
            put(states[0, lo:hi], h)
        acc, xin, xt = np.empty((n, rows), h.dtype), np.empty((n, rows), h.dtype), _step_inputs(inputs, n)
        scale, p, q = np.empty(rows, h.dtype), np.empty(rows, h.dtype), np.empty(rows, h.dtype)
        for j in range(rows):  # the g gate's columns are tanh, the others sigmoid
            scale[j], p[j], q[j] = GATE_TANH if 2 * hid <= j < 3 * hid else GATE_SIGMOID
        c_new, tanh_c = np.empty(n * hid, h.dtype), np.empty(n * hid, h.dtype)
        acc_flat, xin_flat = acc.reshape(acc.size), xin.reshape(xin.size)
        b_ih, b_hh = _rows(inputs[3], n), _rows(inputs[4], n)
        for t in range(seg):
            _project(xin, xin_flat, xt, inputs, t, lo, b_ih)
            _load(acc_flat, xin_flat, b_hh)
            add_hidden(acc, h, w_t)
            for b in range(n):
                for j in range(rows):
                    acc[b, j] = _gate(acc[b, j], scale[j], p[j], q[j])
            for b in range(n):  # c' = f c + i g
                for j in range(hid):
                    c_new[b * hid + j] = acc[b, hid + j] * c[b, j] + acc[b, j] * acc[b, 2 * hid + j]
            for k in range(n * hid):
                tanh_c[k] = _tanh(c_new[k])
            for b in range(n):
                if t < steps[lo + b]:
                    for j in range(hid):  # h' = o tanh(c')
                        c[b, j] = c_new[b * hid + j]
                        h[b, j] = acc[b, 3 * hid + j] * tanh_c[b * hid + j]
                    if _TAPED:
                        for j in range(rows):
                            gates[t, lo + b, j] = acc[b, j]
                        for j in range(hid):
                            cells[t + 1, lo + b, j] = c[b, j]
                            states[t + 1, lo + b, j] = h[b, j]
                elif _TAPED:  # past the sample's end: zeros, as its outputs
                    for j in range(rows):
                        gates[t, lo + b, j] = 0.0
                    for j in range(hid):
                        cells[t + 1, lo + b, j] = 0.0
                        states[t + 1, lo + b, j] = 0.0
            _store(out, t, lo, steps, h)
        put(h_last[lo:hi], h)
        put(c_last[lo:hi], c)


_KERNELS: dict[tuple[str, type, bool, bool], Callable] = {}
_CELLS = {"GRU": "gru", "LSTM": "lstm"}  # the kernel of a mode; the RNN's otherwise


def _kernel(cell: str, dtype: torch.dtype, parallel: bool, taped: bool = False) -> Callable:
    key = (cell, NUMPY_DTYPES[dtype], parallel, taped)
    if key not in _KERNELS:
        fn = {"rnn": _rnn, "gru": _gru, "lstm": _lstm}[cell]
        _KERNELS[key] = build(fn, parallel, key[1], taped=taped)
    return _KERNELS[key]


# ------------------------------------------------------------------------------------------- calls


class TapeMemory:
    """The memory of the tapes (``tape_arrays``), kept for the next forward's once their backward
    has freed them, as PyTorch's caching allocator keeps a GPU's.

    Why: a long sequence's tape is hundreds of MB, which glibc maps fresh for every forward and
    unmaps when freed, so each training step's forward faulted its tape in again, page by page: a
    fifth to a third of a GRU's or an LSTM's forward at T = 30,000 (re-measured by the harness's
    phase times, ``python run.py model=gru dataset.seq_len=30000``: DESIGN.md). A tape takes the
    smallest free buffer that holds it; where none does, a new one is made and the free ones, all
    too small, are let go, so that what is kept never exceeds what the steps held at once.
    ``release`` lets every free buffer go (``bppsa_core.release_tapes``). A buffer is in use while
    any array or tensor of its memory lives: each holds its lease, a ctypes view of the buffer
    (NumPy's views keep the object their memory came from), and the buffer keeps a weak reference
    to it. Tapes under ``KEEP_MIN_BYTES`` are new arrays: glibc reuses their blocks itself."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # ``lease`` lets the free buffers go by ``release``
        self._buffers: list[tuple[np.ndarray, weakref.ref]] = []  # (memory, its lease)

    def lease(self, nbytes: int) -> ctypes.Array:
        """``nbytes`` of memory, whatever the last tape left there, alive while anything holds it."""
        with self._lock:
            best = None
            for i in reversed(range(len(self._buffers))):  # the last leased first: warmest in cache
                memory, lease = self._buffers[i]
                smaller = best is None or memory.nbytes < self._buffers[best][0].nbytes
                if memory.nbytes >= nbytes and smaller and lease() is None:
                    best = i
            if best is None:  # the free ones are all too small: let them go
                self.release()
                memory = np.empty(nbytes, np.uint8)
            else:
                memory = self._buffers.pop(best)[0]
            lease = (ctypes.c_byte * nbytes).from_buffer(memory)
            self._buffers.append((memory, weakref.ref(lease)))
            return lease

    def release(self) -> None:
        """Let every free buffer go; those in use go when their tapes do."""
        with self._lock:
            self._buffers = [b for b in self._buffers if b[1]() is not None]

    def kept_bytes(self) -> tuple[int, int]:
        """The bytes kept: in use, and free."""
        with self._lock:
            used = sum(memory.nbytes for memory, lease in self._buffers if lease() is not None)
            return used, sum(memory.nbytes for memory, _ in self._buffers) - used


TAPES = TapeMemory()
# Bytes from which a tape's memory is kept (``TapeMemory``): glibc maps a block this large fresh
# every time (its largest mmap threshold); a smaller freed block raises the threshold, and later
# ones of its size come from the heap, paged in already. Kept, smaller tapes would keep it low for
# everything else (re-measured by ``python -m benchmarks.host --models gru lstm --T 1000 10000``).
KEEP_MIN_BYTES = 32 << 20


def tape_arrays(
    steps: int, batch: int, hidden: int, dtype: torch.dtype, cells: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A tape's uninitialized arrays (``layer.Tape``): gates (T, B, 4H), cells (an LSTM's, ``cells``,
    else None) and states (T + 1, B, H), C-contiguous, in one buffer of ``TAPES``."""
    kind = NUMPY_DTYPES[dtype]
    gates, state = (steps, batch, 4 * hidden), (steps + 1, batch, hidden)
    n_gates, n_state = steps * batch * 4 * hidden, (steps + 1) * batch * hidden
    n = n_gates + n_state * (2 if cells else 1)
    if n * dtype.itemsize < KEEP_MIN_BYTES:
        return np.empty(gates, kind), np.empty(state, kind) if cells else None, np.empty(state, kind)
    flat = np.frombuffer(TAPES.lease(n * dtype.itemsize), kind)
    kept_cells = flat[n_gates : n_gates + n_state].reshape(state) if cells else None
    return flat[:n_gates].reshape(gates), kept_cells, flat[n - n_state :].reshape(state)


@functools.lru_cache(maxsize=64)
def _zeros(rows: int, kind: type) -> np.ndarray:
    """The biases of a layer without them: zeros, made once per shape (the kernels only read them)."""
    return np.zeros(rows, kind)


# per dtype, the input side's arrays a call does not use (``_project``): x and w_ih of a projected xw
_EMPTY = {d: (np.zeros((0, 0, 0), t), np.zeros((0, 0), t)) for d, t in NUMPY_DTYPES.items()}
# Inputs whose weights take at most this many bytes are projected in the kernels' steps
# (``_project``): no (T, B, R) projection written and read back through memory, and no host op; the
# wider ones' weights, read again each step, would stream from beyond the core's cache, so they are
# one GEMM a segment. Re-measured by
# ``python -m benchmarks.forward --tables compiled --no-grad --other-projection --F 128 256 --H 256``.
PROJECT_IN_STEP_MAX_BYTES = 256 * 1024


def projects_in_step(w_ih: Tensor) -> bool:
    """Whether a layer with these input weights has its inputs projected in the kernels' steps
    (``PROJECT_IN_STEP_MAX_BYTES``) rather than on the host."""
    return w_ih.numel() * w_ih.element_size() <= PROJECT_IN_STEP_MAX_BYTES


def new_outputs(steps: int, batch: int, hidden: int, dtype: torch.dtype, batch_major: bool = False) -> Tensor:
    """Uninitialized (T, B, H) outputs in NumPy's memory: time-major, or a view of batch-major
    (B, T, H). NumPy asks the system for huge pages for a large array, which a tensor's fresh memory
    does not get where the system gives them on request only; the steps' writes then fault a few
    pages instead of one every 4 KB (re-measured by ``python -m benchmarks.distributed --ranks 2``,
    whose ranks write batch-major)."""
    kind = NUMPY_DTYPES[dtype]
    if batch_major:
        return torch.from_numpy(np.empty((batch, steps, hidden), kind)).transpose(0, 1)
    return torch.from_numpy(np.empty((steps, batch, hidden), kind))


def layer_forward(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
    segment: int,
    out: Tensor | None = None,
    tape: tuple[np.ndarray, np.ndarray | None, np.ndarray] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One layer's forward: ``native_forward``'s results (h0 and c0 (B, H) or (1, B, H), the last
    states shaped as they are), written into ``out`` (T, B, H; any strides; None: new,
    time-major), the inputs projected in the kernels' steps or, where their weights exceed
    ``PROJECT_IN_STEP_MAX_BYTES``, as one GEMM per segment of at most ``segment`` steps (so that
    only a segment's projection exists). ``tape``: a GRU's or an LSTM's arrays (``layer.Tape``:
    gates (T, B, 4H), cells (an LSTM's, else None) and states (T + 1, B, H)), into which its gates,
    cell states c_0..c_T and states h_0..h_T are written. Returns (out, h_T, c_T), c_T None but for an LSTM.
    Nothing is recorded for autograd here (``dispatch.compiled_forward``). Arrays the kernels write
    are made as arrays, the tensors returned are their memory: a short layer's call is mostly such
    host work (re-measured by ``python -m benchmarks.host``)."""
    steps, batch = x.shape[:2]
    w_ih, w_hh, *biases = weights
    rows, hidden = w_hh.shape
    kind = NUMPY_DTYPES[x.dtype]
    if biases:
        b_ih, b_hh = biases[0].numpy(force=True), biases[1].numpy(force=True)
    else:
        b_ih = b_hh = _zeros(rows, kind)
    cell = _CELLS.get(mode, "rnn")
    w_hh = w_hh.numpy(force=True)
    n_threads = threads()
    groups = min(n_threads, batch)
    kernel = _kernel(cell, x.dtype, n_threads > 1, tape is not None)
    # each segment reads the state its predecessor wrote: (h, c) in, fresh (h, c) out, as arrays
    # (no tensor, no conversion, until the last)
    h = h0.contiguous().numpy(force=True).reshape(batch, hidden)  # NumPy's reshapes: no tensor views
    c = None if c0 is None else c0.contiguous().numpy(force=True).reshape(batch, hidden)
    out = new_outputs(steps, batch, hidden, x.dtype) if out is None else out
    outs = out.numpy()
    features = x.shape[-1]
    in_step = projects_in_step(w_ih)
    if in_step:
        xs = np.ascontiguousarray(x.numpy(force=True))
        w_in = w_ih.numpy(force=True)
    else:
        flat = x.reshape(steps * batch, features)
    ends = None if lengths is None else lengths.to("cpu", torch.int64).numpy()
    whole = steps <= segment  # one segment: the arrays themselves, no slices
    for s in range(0, steps, segment):
        e = min(steps, s + segment)
        seg = running(batch, e - s) if ends is None else np.clip(ends - s, 0, e - s)
        if in_step:
            inputs = (UNUSED[x.dtype], xs if whole else xs[s:e], w_in, b_ih, b_hh)
        else:
            seg_x = flat if whole else flat[s * batch : e * batch]
            xw = torch.addmm(biases[0], seg_x, w_ih.t()) if biases else torch.mm(seg_x, w_ih.t())
            inputs = (xw.numpy().reshape(e - s, batch, rows), *_EMPTY[x.dtype], b_ih, b_hh)
        h_next = np.empty_like(h)
        outputs = (outs if whole else outs[s:e], h_next)
        if cell == "rnn":
            kernel(mode == "RNN_RELU", groups, inputs, w_hh, h, seg, *outputs)
        elif cell == "gru":
            kept = (UNUSED[x.dtype],) * 2
            if tape is not None:
                kept = (tape[0], tape[2]) if whole else (tape[0][s:e], tape[2][s : e + 1])
            kernel(groups, inputs, w_hh, h, seg, *outputs, *kept)
        else:
            c_next = np.empty_like(c)
            kept = (UNUSED[x.dtype],) * 3
            if tape is not None:
                kept = tape if whole else (tape[0][s:e], tape[1][s : e + 1], tape[2][s : e + 1])
            kernel(groups, inputs, w_hh, h, c, seg, *outputs, c_next, *kept)
            c = c_next
        h = h_next
    c = None if c is None else torch.from_numpy(c.reshape(h0.shape))
    return out, torch.from_numpy(h.reshape(h0.shape)), c
