"""The forward of one layer compiled for the CPU (numba): the counterpart of PyTorch's fused kernel
(``bppsa_core.layer.native_forward``), which is also its plain-PyTorch twin in the tests.

PyTorch's CPU kernel issues a handful of small ops per step, each a few microseconds of overhead
for B·G·H² multiply-adds that take well under one. Here the input projection of a segment is one
GEMM over all its steps (``x @ W_ih^T + biases``), and the recurrence one compiled loop, each sample
a task (a ``prange``, so samples run in parallel on ``torch.get_num_threads()`` threads; with one, a
serial build runs in the calling thread). A step is ``h @ W_hh^T`` as G·H-wide multiply-adds per
state element, then the cell's activations, elementwise:

* RNN: ``h' = tanh(a)`` or ``relu(a)``;
* GRU: ``r, z = sigmoid(.)``, ``n = tanh(a_n + r (W_hn h + b_hn))``, ``h' = n + z (h - n)``;
* LSTM: ``i, f, o = sigmoid(.)``, ``g = tanh(.)``, ``c' = f c + i g``, ``h' = o tanh(c')``;

the same formulas, in the same order, as PyTorch's CPU cells. A scalar libm ``tanh`` or ``exp``
costs more than the step's multiply-adds, so the activations come from one ``expm1`` per dtype
(``_make_activations``): range reduction to ``r`` in [-ln2/2, ln2/2] and a Taylor polynomial,
``2^k`` from the exponent bits, with selects rather than branches so that a step's activations
vectorize. They are accurate to a few ulps in each dtype (float32 arithmetic for float32 inputs,
float64 for float64), and NaN propagates. Everything compiles with NumPy's error model: a float
division by zero gives inf or NaN instead of raising, whose check would keep the loops scalar.
No fast-math: every build (serial or parallel, any group of samples) rounds alike, so the threads
change no bit of the results.

Packed sequences are padded steps with lengths, as in ``native_forward``: past a sample's end its
outputs are 0 and its state is carried to the last state.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from decimal import Decimal

import numpy as np
import torch
from numba import njit, prange
from numba.core import types as nbtypes
from numba.extending import intrinsic
from torch import Tensor

from bppsa_core.numba_scan import _add_hidden, _threads

# ------------------------------------------------------------------------------------- activations


@intrinsic
def _bits(typingctx, value):
    """The bits of a float as the integer of its width (LLVM's bitcast, which vectorizes)."""
    kinds = {nbtypes.float64: nbtypes.int64, nbtypes.float32: nbtypes.int32}
    if value not in kinds:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(signature.return_type))

    return kinds[value](value), codegen


@intrinsic
def _float(typingctx, bits, like):
    """The float of ``like``'s type whose bits are ``bits`` (truncated to that width)."""
    widths = {nbtypes.float64: nbtypes.int64, nbtypes.float32: nbtypes.int32}
    if not isinstance(bits, nbtypes.Integer) or like not in widths:
        return None

    def codegen(context, builder, signature, args):
        as_int = context.cast(builder, args[0], signature.args[0], widths[signature.return_type])
        return builder.bitcast(as_int, context.get_value_type(signature.return_type))

    return like(bits, like), codegen


_LN2 = Decimal("0.69314718055994530941723212145817656807550013436")  # ln 2 past float64's digits


def _make_activations(dtype: type) -> tuple[Callable, Callable, Callable]:
    """``expm1``, ``tanh`` and ``sigmoid`` for scalars of ``dtype`` (np.float32 or np.float64),
    their constants in that dtype so that no step widens."""
    f = dtype
    double = dtype is np.float64
    mantissa = 52 if double else 23
    bias = 1023 if double else 127
    # y = k ln2 + r, k = round(y / ln2): adding 1.5·2^mantissa rounds to an integer that the low
    # bits of the sum hold, so the same sum gives k as a float and 2^k's exponent bits.
    magic = f(1.5 * 2.0**mantissa)
    magic_bits = int(np.array(magic).view(np.int64 if double else np.int32))
    log2e = f(1.0 / math.log(2.0))
    # ln2 split so that k·ln2_hi is exact for every k in range (its low mantissa bits are 0)
    ln2_hi = f(float.fromhex("0x1.62e42fee00000p-1") if double else float.fromhex("0x1.62e000p-1"))
    ln2_lo = f(float(_LN2 - Decimal(float(ln2_hi))))
    # Taylor coefficients of expm1(r)/r, to the degree whose next term is below half an ulp at |r| = ln2/2
    degree = 13 if double else 7
    c = [f(1.0 / math.factorial(n + 1)) for n in range(degree)]
    zero, one, two = f(0.0), f(1.0), f(2.0)
    # past these, tanh and sigmoid round to +-1 (and exp(-y) to 0 relative to 1); below the
    # largest argument exp's result is finite in the dtype
    top = f(40.0 if double else 20.0)
    low, high = f(-top), f(700.0 if double else 88.0)
    c0, c1, c2, c3, c4, c5, c6 = c[:7]
    c7, c8, c9, c10, c11, c12 = (c[7:] + [f(0.0)] * 6)[:6]

    @njit(inline="always", error_model="numpy")
    def expm1(y):
        """exp(y) - 1 for y in [low, high] (the callers clamp)."""
        t = y * log2e + magic
        k = t - magic
        r = (y - k * ln2_hi) - k * ln2_lo
        if double:
            p = c12 * r + c11
            p = p * r + c10
            p = p * r + c9
            p = p * r + c8
            p = p * r + c7
            p = p * r + c6
        else:
            p = c6
        p = p * r + c5
        p = p * r + c4
        p = p * r + c3
        p = p * r + c2
        p = p * r + c1
        p = p * r + c0
        scale = _float((_bits(t) - magic_bits + bias) << mantissa, one)
        return scale * (p * r) + (scale - one)

    @njit(inline="always", error_model="numpy")
    def tanh(x):
        a = -x - x if x < 0 else x + x
        a = top if a > top else a
        e = expm1(a)
        v = e / (e + two)
        return -v if x < 0 else v

    @njit(inline="always", error_model="numpy")
    def sigmoid(x):
        y = high if -x > high else -x
        y = low if y < low else y
        v = one / (expm1(y) + two)
        return zero if -x > high else v  # below the smallest normal number, as if flushed

    return expm1, tanh, sigmoid


_ACTIVATIONS = {np.float32: _make_activations(np.float32), np.float64: _make_activations(np.float64)}
# The kernels' activations: float64's here, each dtype's in its build (``_build``).
_, _tanh, _sigmoid = _ACTIVATIONS[np.float64]

# ------------------------------------------------------------------------------------------ kernels


def _rnn(relu, groups, xw, w_t, h0, steps, out, h_last):
    """An RNN's recurrence over a segment: xw (S, B, H) the projected inputs with both biases,
    w_t (H, H) = W_hh^T, h0 (B, H), ``steps`` (B,) the steps each sample runs (after them it
    outputs 0 and keeps its state); writes out (S, B, H) and the last states h_last (B, H).
    ``groups`` of samples run in parallel, each a task that steps its samples together."""
    seg, batch, hid = xw.shape
    zero = out.dtype.type(0)
    for g in prange(groups):
        lo, hi = g * batch // groups, (g + 1) * batch // groups
        h = h0[lo:hi].copy()
        acc = np.empty_like(h)
        for t in range(seg):
            for b in range(hi - lo):
                for j in range(acc.shape[1]):
                    acc[b, j] = xw[t, lo + b, j]
            _add_hidden(acc, h, w_t)
            for b in range(hi - lo):
                if t < steps[lo + b]:
                    if relu:
                        for j in range(hid):
                            h[b, j] = zero if acc[b, j] < zero else acc[b, j]
                    else:
                        for j in range(hid):
                            h[b, j] = _tanh(acc[b, j])
                    for j in range(hid):
                        out[t, lo + b, j] = h[b, j]
                else:
                    for j in range(hid):
                        out[t, lo + b, j] = zero
        h_last[lo:hi] = h


def _gru(groups, xw, w_t, b_hn, h0, steps, out, h_last):
    """A GRU's recurrence over a segment: xw (S, B, 3H) the projected inputs with b_ih and the r and
    z parts of b_hh, w_t (H, 3H) = W_hh^T (rows r, z, n), b_hn (H,); otherwise as ``_rnn``."""
    seg, batch, rows = xw.shape
    hid = rows // 3
    zero = out.dtype.type(0)
    for g in prange(groups):
        lo, hi = g * batch // groups, (g + 1) * batch // groups
        h = h0[lo:hi].copy()
        acc = np.empty((hi - lo, rows), h.dtype)
        for t in range(seg):
            for b in range(hi - lo):
                for j in range(2 * hid):
                    acc[b, j] = xw[t, lo + b, j]
                for j in range(hid):
                    acc[b, 2 * hid + j] = b_hn[j]
            _add_hidden(acc, h, w_t)
            for b in range(hi - lo):
                if t < steps[lo + b]:
                    for j in range(hid):
                        r = _sigmoid(acc[b, j])
                        z = _sigmoid(acc[b, hid + j])
                        n = _tanh(xw[t, lo + b, 2 * hid + j] + r * acc[b, 2 * hid + j])
                        h[b, j] = n + z * (h[b, j] - n)
                    for j in range(hid):
                        out[t, lo + b, j] = h[b, j]
                else:
                    for j in range(hid):
                        out[t, lo + b, j] = zero
        h_last[lo:hi] = h


def _lstm(groups, xw, w_t, h0, c0, steps, out, h_last, c_last):
    """An LSTM's recurrence over a segment: xw (S, B, 4H) the projected inputs with both biases,
    w_t (H, 4H) = W_hh^T (rows i, f, g, o), h0 and c0 (B, H); writes the outputs and the last
    (h, c); otherwise as ``_rnn``."""
    seg, batch, rows = xw.shape
    hid = rows // 4
    zero = out.dtype.type(0)
    for g in prange(groups):
        lo, hi = g * batch // groups, (g + 1) * batch // groups
        h, c = h0[lo:hi].copy(), c0[lo:hi].copy()
        acc = np.empty((hi - lo, rows), h.dtype)
        for t in range(seg):
            for b in range(hi - lo):
                for j in range(acc.shape[1]):
                    acc[b, j] = xw[t, lo + b, j]
            _add_hidden(acc, h, w_t)
            for b in range(hi - lo):
                if t < steps[lo + b]:
                    for j in range(hid):
                        i = _sigmoid(acc[b, j])
                        f = _sigmoid(acc[b, hid + j])
                        gg = _tanh(acc[b, 2 * hid + j])
                        o = _sigmoid(acc[b, 3 * hid + j])
                        c[b, j] = f * c[b, j] + i * gg
                        h[b, j] = o * _tanh(c[b, j])
                    for j in range(hid):
                        out[t, lo + b, j] = h[b, j]
                else:
                    for j in range(hid):
                        out[t, lo + b, j] = zero
        h_last[lo:hi] = h
        c_last[lo:hi] = c


def _build(fn: Callable, dtype: type, parallel: bool) -> Callable:
    """``fn`` compiled for ``dtype``'s activations, under a name of its own (numba's on-disk cache is
    keyed by the name, not by the globals or the options)."""
    _, tanh, sigmoid = _ACTIVATIONS[dtype]
    name = f"{fn.__name__}_{np.dtype(dtype).name}_{'parallel' if parallel else 'serial'}"
    scope = {**fn.__globals__, "_tanh": tanh, "_sigmoid": sigmoid}
    renamed = types.FunctionType(fn.__code__, scope, name, fn.__defaults__, fn.__closure__)
    renamed.__qualname__ = name
    return njit(parallel=parallel, cache=True, error_model="numpy")(renamed)


_KERNELS: dict[tuple[str, type, bool], Callable] = {}


def _kernel(cell: str, dtype: torch.dtype, parallel: bool) -> Callable:
    key = (cell, np.float32 if dtype == torch.float32 else np.float64, parallel)
    if key not in _KERNELS:
        _KERNELS[key] = _build({"rnn": _rnn, "gru": _gru, "lstm": _lstm}[cell], key[1], parallel)
    return _KERNELS[key]


# ------------------------------------------------------------------------------------------- calls


def takes(x: Tensor, *tensors: Tensor | None) -> bool:
    """Whether the compiled forward takes this call: CPU tensors of one dtype, float32 or float64."""
    dtypes = {t.dtype for t in (x, *tensors) if t is not None}
    return x.device.type == "cpu" and len(dtypes) == 1 and x.dtype in (torch.float32, torch.float64)


def layer_forward(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
    segment: int,
    out: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One layer's forward: ``native_forward``'s results, written into ``out`` (T, B, H; any
    strides), the inputs' projection one GEMM per segment of at most ``segment`` steps (so that
    only a segment's of it exists). Returns (out, h_T, c_T), c_T None but for an LSTM."""
    steps, batch = x.shape[:2]
    hidden = h0.shape[-1]
    w_ih, w_hh, *biases = (t.detach() for t in weights)
    rows = w_hh.shape[0]
    bias = biases[0] + biases[1] if biases else x.new_zeros(rows)
    b_hn = biases[1][2 * hidden :] if biases else x.new_zeros(hidden)
    if mode == "GRU" and biases:  # b_hn is applied inside r (W_hn h + b_hn)
        bias[2 * hidden :] = biases[0][2 * hidden :]
    w_t = w_hh.t().contiguous().numpy()
    threads = _threads()
    groups = min(threads, batch)
    cell = {"GRU": "gru", "LSTM": "lstm"}.get(mode, "rnn")
    kernel = _kernel(cell, x.dtype, threads > 1)
    # each segment reads the state its predecessor wrote: (h, c) in, fresh (h, c) out
    h = h0.detach().contiguous()
    c = None if c0 is None else c0.detach().contiguous()
    flat = x.detach().reshape(steps * batch, x.shape[-1])
    ends = None if lengths is None else lengths.to("cpu", torch.int64).numpy()
    for s in range(0, steps, segment):
        e = min(steps, s + segment)
        seg = np.full(batch, e - s, np.int64) if ends is None else np.clip(ends - s, 0, e - s)
        xw = torch.addmm(bias, flat[s * batch : e * batch], w_ih.t()).view(e - s, batch, rows).numpy()
        h_next = torch.empty_like(h)
        args = (groups, xw, w_t, h.numpy(), seg, out[s:e].numpy(), h_next.numpy())
        if cell == "rnn":
            kernel(mode == "RNN_RELU", *args)
        elif cell == "gru":
            kernel(groups, xw, w_t, b_hn.numpy(), *args[3:])
        else:
            c_next = torch.empty_like(c)
            kernel(groups, xw, w_t, h.numpy(), c.numpy(), seg, *args[5:], c_next.numpy())
            c = c_next
        h = h_next
    return out, h, c
