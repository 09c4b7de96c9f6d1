"""What the compiled CPU kernels (numba) share: vectorizable activations, the hidden-side product
in vector registers, the array copy, the builds and the threads they take.

A scalar libm ``tanh`` or ``exp`` costs more than a recurrent step's multiply-adds, and numba's LLVM
has no vector math library, so the activations come from one ``expm1`` per dtype
(``_make_activations``): range reduction to ``r`` in [-ln2/2, ln2/2] and a Taylor polynomial,
``2^k`` from the exponent bits, with selects rather than branches so that a loop of them
vectorizes. They are accurate to a few ulps in each dtype (float32 arithmetic for float32 inputs,
float64 for float64), and NaN propagates. A kernel that calls ``_tanh`` or ``_sigmoid`` is built
once per dtype (``build``), each build binding that dtype's.

Every kernel compiles with NumPy's error model (a float division by zero gives inf or NaN instead of
raising, whose check would keep the loops scalar) and without fast-math, so every build, serial or
parallel, rounds alike and the threads change no bit of the results.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import types
from collections.abc import Callable, Iterator
from decimal import Decimal

import numba
import numpy as np
import torch
from llvmlite import binding, ir
from numba import njit
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

try:  # POSIX: the on-disk cache's writes are serialized (``_SerializedCacheFile``); elsewhere numba's own
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None
try:
    from numba.core.caching import IndexDataCacheFile
except ImportError:  # pragma: no cover - a numba whose cache is laid out otherwise keeps its own
    IndexDataCacheFile = None


@intrinsic
def _bits(typingctx, value):
    """The bits of a float as the integer of its width (LLVM's bitcast, which vectorizes)."""
    kinds = {nbtypes.float64: nbtypes.int64, nbtypes.float32: nbtypes.int32}
    if value not in kinds:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(signature.return_type))

    return kinds[value](value), codegen


def _target_has(feature: str) -> bool:
    """Whether the CPU numba compiles for has this x86 feature (LLVM's name: "fma", "avx512f")."""
    if numba.config.CPU_FEATURES is not None:  # numba's rule: the features named (none for "generic")
        return f"+{feature}" in numba.config.CPU_FEATURES.split(",")
    try:  # else the host's, whatever NUMBA_CPU_NAME says
        return bool(binding.get_host_cpu_features().get(feature, False))
    except RuntimeError:  # LLVM cannot read this host's features: assume none
        return False


def _target_fuses_multiply_add() -> bool:
    """Whether the CPU numba compiles for has a fused multiply-add instruction (x86 since 2013, every
    64-bit ARM): only then is an FMA one instruction; elsewhere LLVM makes it a library call."""
    return platform.machine().lower() in ("aarch64", "arm64") or _target_has("fma")


# Each product of ``add_hidden`` and its plain twin is one fused multiply-add where the target has
# it (one rounding, half the vector operations of a multiply and an add): the compiled forwards at
# H >= 64 and the LSTM's walk are faster (``python -m benchmarks.forward --tables compiled``).
FMA = _target_fuses_multiply_add()


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c, rounded once (LLVM's fma): ``add_hidden_reference``'s products."""
    if a not in (nbtypes.float32, nbtypes.float64) or b != a or c != a:
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


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


def _make_activations(dtype: type) -> tuple[Callable, Callable, Callable, Callable]:
    """``expm1``, ``tanh``, ``sigmoid`` and ``gate`` (either of the two by its constants:
    ``GATE_SIGMOID``, ``GATE_TANH``) for scalars of ``dtype`` (np.float32 or np.float64), their
    constants in that dtype so that no step widens."""
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

    @njit(inline="always", error_model="numpy")
    def gate(x, scale, p, q):
        y0 = scale * x
        y = high if y0 > high else y0
        y = low if y < low else y
        e = expm1(y)
        v = (p + q * e) / (e + two)
        return q if y0 > high else v  # the limit: sigmoid's 0 (as if flushed), tanh's -1

    return expm1, tanh, sigmoid, gate


ACTIVATIONS = {np.float32: _make_activations(np.float32), np.float64: _make_activations(np.float64)}

# ``gate``'s constants (scale, p, q): it is (p + q e) / (e + 2) with e = expm1(scale x), sigmoid
# or tanh by the constants alone, so that a row of gates mixing the two (an LSTM's i, f, g, o) is
# one vectorized loop over per-column constants instead of a loop per gate, each of H columns and
# its remainder (re-measured by ``python -m benchmarks.forward --tables compiled --models lstm``).
GATE_SIGMOID = (-1.0, 1.0, 0.0)
GATE_TANH = (-2.0, 0.0, -1.0)


# Whether the CPU numba compiles for has AVX-512: 32 registers of 512 bits, against AVX2's 16 of 256.
WIDE = _target_has("avx512f")
# Lanes of the kernels' vectors, by dtype: a register's width (the hidden product at twice the lanes
# is 1.4-1.8 times faster on AVX-512; on AVX2 LLVM would split each vector in two and spill).
LANES = {nbtypes.float32: 16, nbtypes.float64: 8} if WIDE else {nbtypes.float32: 8, nbtypes.float64: 4}
LANES_MIN = max(LANES.values())  # rows narrower than this take the plain loops (either dtype)


def vector_arrays(arrays: tuple, dtype: object) -> bool:
    """Whether an intrinsic can take these numba array types in ``Vectors`` of ``dtype``: every one
    C-contiguous and of that dtype, one the vectors have lanes for (else its typing declines)."""
    return dtype in LANES and all(
        isinstance(a, nbtypes.Array) and a.layout == "C" and a.dtype == dtype for a in arrays
    )


class Vectors:
    """LLVM vectors of ``LANES[dtype]`` elements (or ``lanes``) in an intrinsic's code: the vector type, a
    pointer to the vector at element j of a row (``at``), its load and store (element-aligned),
    and a scalar broadcast to every lane (``splat``); vectors of half the lanes (``halved``) and
    the windows that cover a row's last lanes (``windows``)."""

    def __init__(self, context, builder, dtype, lanes: int | None = None) -> None:
        self.builder, self.lanes = builder, lanes or LANES[dtype]
        self._context, self._dtype = context, dtype
        element = context.get_value_type(dtype)
        self.type = ir.VectorType(element, self.lanes)
        self.align = context.get_abi_alignment(element)
        self._zeros = ir.Constant(ir.VectorType(ir.IntType(32), self.lanes), [0] * self.lanes)

    def halved(self) -> Vectors:
        """Vectors of half as many lanes, for a row's last lanes (``windows``)."""
        return Vectors(self._context, self.builder, self._dtype, self.lanes // 2)

    def windows(self, count, half: Vectors) -> tuple:
        """Whether a row of ``count`` elements has lanes past its whole vectors (``ragged``, an i1),
        and the two windows that may cover them, each (where, its first element, its vectors): the
        last ``half.lanes`` elements where those lanes fit in them, else the last ``lanes``. Half
        a vector is half the work on a CPU that splits its widest vectors (re-measured by
        ``python -m benchmarks.backward``)."""
        b, i64 = self.builder, ir.IntType(64)
        left_over = b.urem(count, ir.Constant(i64, self.lanes))
        ragged = b.icmp_unsigned("!=", left_over, ir.Constant(i64, 0))
        narrow = b.and_(ragged, b.icmp_unsigned("<=", left_over, ir.Constant(i64, half.lanes)))
        return ragged, (
            (narrow, b.sub(count, ir.Constant(i64, half.lanes)), half),
            (b.and_(ragged, b.not_(narrow)), b.sub(count, ir.Constant(i64, self.lanes)), self),
        )

    def at(self, base, j):
        return self.builder.bitcast(self.builder.gep(base, [j]), self.type.as_pointer())

    def load(self, base, j):
        return self.builder.load(self.at(base, j), align=self.align)

    def store(self, value, base, j) -> None:
        self.builder.store(value, self.at(base, j), align=self.align)

    def splat(self, scalar):
        b = self.builder
        v = b.insert_element(ir.Constant(self.type, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
        return b.shuffle_vector(v, v, self._zeros)


# The longest row ``prefetch_row`` asks for: eight cache lines (an LSTM's gates at H = 32 in float32).
_PREFETCH_MAX_BYTES = 512


@intrinsic
def prefetch_row(typingctx, array, t, b):
    """Asks the CPU to bring ``array[t, b]`` (of a C-contiguous array of 3 or more dimensions) into
    its cache, one prefetch per 64-byte line, where it is at most ``_PREFETCH_MAX_BYTES``; changes no
    value. A walk reads and writes the step before the one it is on, down through memory, in rows
    too short for the hardware prefetchers to follow: the LSTM's walk at H = 20 is 6-18 % faster
    with it. Longer rows they follow, and asking slows the walk (the LSTM's at H = 64 by a fifth)
    (re-measured by ``python -m benchmarks.backward --model lstm --threads 1 --strategies numba``,
    --T 10000, and --H 64 --F 24)."""
    if not (isinstance(array, nbtypes.Array) and array.ndim >= 3 and array.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        i64, i32, i8p = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        step, sample = (
            context.cast(builder, v, ty, nbtypes.int64)
            for v, ty in zip(args[1:], signature.args[1:], strict=True)
        )
        width = builder.extract_value(a.shape, 2)
        for d in range(3, array.ndim):
            width = builder.mul(width, builder.extract_value(a.shape, d))
        at = builder.mul(builder.add(builder.mul(step, builder.extract_value(a.shape, 1)), sample), width)
        row = builder.bitcast(builder.gep(a.data, [at]), i8p)
        size = ir.Constant(i64, context.get_abi_sizeof(context.get_data_type(array.dtype)))
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        prefetch = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        line, nbytes = ir.Constant(i64, 64), builder.mul(width, size)
        short = builder.icmp_unsigned("<=", nbytes, ir.Constant(i64, _PREFETCH_MAX_BYTES))
        with (
            builder.if_then(short),
            cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, line) as (k, _),
        ):
            # a read (0), kept in every cache level (3), of data (1)
            builder.call(prefetch, [builder.gep(row, [k]), *(ir.Constant(i32, v) for v in (0, 3, 1))])
        return context.get_dummy_value()

    return nbtypes.void(array, t, b), codegen


def _product_tile(rows: int, pers: tuple[int, ...]) -> Callable:
    """An intrinsic ``tile(acc, h, w_t, b0)``: ``acc[b0:b0 + rows] += h[b0:b0 + rows] @ w_t[:, :R]``
    for C-contiguous acc (N, R), h (N, K) and w_t (K, R') with R' >= R >= ``LANES``. Each block of
    ``LANES`` columns holds the ``rows`` rows' sums in registers while k runs (one load of w_t's
    row serves every row), and every element adds its products one at a time, k ascending (each a
    fused multiply-add where ``FMA``): the same bits as a plain loop in that order, whatever the
    tile. Blocks go ``pers[0]`` at a time, those left over ``pers[1]`` at a time, and so on: each
    is a chain of K dependent additions, so a tile of few rows needs more blocks in flight to keep
    the vector units busy, and a few passes for the leftovers keep the code (and its compile)
    short. The last block, where R is not a multiple of the lanes, is the window of the last
    ``LANES`` columns, or of the last ``LANES / 2`` where the ragged columns fit in them (at H = 20 in
    float32 on AVX-512, four); summed in the last pass (at H = 20 one pass of k, not two) from the
    values before this update and stored last (the columns it shares with the block before are the
    same operations, so the same bits)."""

    @intrinsic
    def tile(typingctx, acc, h, w_t, b0):
        arrays = (acc, h, w_t)
        if not vector_arrays(arrays, acc.dtype) or any(a.ndim != 2 for a in arrays):
            return None

        def codegen(context, builder, signature, args):
            typed = zip(signature.args[:3], args[:3], strict=True)
            a, x, w = (context.make_array(t)(context, builder, v) for t, v in typed)
            i64 = ir.IntType(64)
            cols, inner = builder.extract_value(a.shape, 1), builder.extract_value(x.shape, 1)
            w_cols = builder.extract_value(w.shape, 1)  # its row stride: ``padded``'s rows
            v = Vectors(context, builder, acc.dtype)
            half = v.halved()
            element = "f32" if acc.dtype == nbtypes.float32 else "f64"

            def fused(vec):
                fma_type = ir.FunctionType(vec.type, [vec.type] * 3)
                name = f"llvm.fma.v{vec.lanes}{element}"
                return cgutils.get_or_insert_function(builder.module, fma_type, name)

            fuse = {vec.lanes: fused(vec) for vec in (v, half)}

            def multiply_add(x, y, z, vec):
                """x * y + z: fused where the target has FMA (``FMA``), as the plain twin does."""
                if FMA:
                    return builder.call(fuse[vec.lanes], [x, y, z])
                return builder.fadd(z, builder.fmul(x, y))

            first = context.cast(builder, args[3], signature.args[3], nbtypes.int64)

            def row(data, i, width):
                return builder.gep(data, [builder.mul(builder.add(first, ir.Constant(i64, i)), width)])

            acc_rows = [row(a.data, i, cols) for i in range(rows)]
            h_rows = [row(x.data, i, inner) for i in range(rows)]
            # the sums of up to max(pers) blocks of columns and a window at once: independent chains
            sums = [[cgutils.alloca_once(builder, v.type) for _ in range(max(pers) + 1)] for _ in range(rows)]
            half_sums = [cgutils.alloca_once(builder, half.type) for _ in range(rows)]

            def slot(i, c, vec):
                return sums[i][c] if vec is v else half_sums[i]

            def blocks(starts):
                """Row i's columns j .. j + lanes for each (j, vectors) of ``starts`` summed in its
                slot, every k's product added in order."""
                for i in range(rows):
                    for c, (j, vec) in enumerate(starts):
                        builder.store(vec.load(acc_rows[i], j), slot(i, c, vec))
                with cgutils.for_range(builder, inner) as loop:
                    k = loop.index
                    w_row = builder.gep(w.data, [builder.mul(k, w_cols)])
                    wk = [vec.load(w_row, j) for j, vec in starts]
                    for i in range(rows):
                        hk = builder.load(builder.gep(h_rows[i], [k]))
                        splats = {vec.lanes: vec.splat(hk) for _, vec in starts}
                        for c, (_, vec) in enumerate(starts):
                            total = multiply_add(splats[vec.lanes], wk[c], builder.load(slot(i, c, vec)), vec)
                            builder.store(total, slot(i, c, vec))

            def update(starts):
                """The blocks at ``starts`` summed, then stored in that order."""
                blocks(starts)
                for i in range(rows):
                    for c, (j, vec) in enumerate(starts):
                        vec.store(builder.load(slot(i, c, vec)), acc_rows[i], j)

            def const(n):
                return ir.Constant(i64, n)

            width = const(v.lanes)
            ragged, windows = v.windows(cols, half)  # the ragged columns' window: half a vector or whole

            def with_window(when, starts):
                """``update(starts)`` and the ragged window, where ``when``."""
                for fits, start, vec in windows:
                    with builder.if_then(builder.and_(when, fits)):
                        update([*starts, (start, vec)])

            def sweep(j0, count, pers):
                """``count`` blocks from column ``j0``, ``pers[0]`` at a time, those left over by
                ``pers[1:]`` (the last per's leftovers one pass each). A ragged window joins the
                last pass (the blocks left over, or the last group where none are), so that its k
                loop is not a pass of its own: it is summed from the values before the update like
                the rest, and stored last."""
                per = pers[0]
                groups, left = builder.udiv(count, const(per)), builder.urem(count, const(per))
                none_left = builder.icmp_unsigned("==", left, const(0))
                some = builder.icmp_unsigned("!=", count, const(0))
                joins = builder.and_(ragged, builder.and_(none_left, some))
                with cgutils.for_range(builder, builder.sub(groups, builder.zext(joins, i64))) as loop:
                    j = builder.add(j0, builder.mul(loop.index, const(per * v.lanes)))
                    update([(builder.add(j, const(c * v.lanes)), v) for c in range(per)])
                j = builder.add(j0, builder.mul(builder.sub(groups, const(1)), const(per * v.lanes)))
                with_window(joins, [(builder.add(j, const(c * v.lanes)), v) for c in range(per)])
                j = builder.add(j0, builder.mul(groups, const(per * v.lanes)))  # the blocks left over
                if len(pers) > 1:
                    sweep(j, left, pers[1:])
                    return
                for n in range(1, per):
                    starts = [(builder.add(j, const(c * v.lanes)), v) for c in range(n)]
                    is_n = builder.icmp_unsigned("==", left, const(n))
                    with_window(is_n, starts)
                    with builder.if_then(builder.and_(is_n, builder.not_(ragged))):
                        update(starts)

            sweep(const(0), builder.udiv(cols, width), pers)
            return context.get_dummy_value()

        return nbtypes.void(acc, h, w_t, b0), codegen

    return tile


# The tiles' rows and blocks a pass, so that their sums stay in registers (at most rows x (blocks + 1)
# with a ragged block): AVX-512's 32 hold eight rows' of two blocks, then four rows'; AVX2's 16 four
# rows' of two. One row's blocks go eight at a time, chains enough for the vector units, then two
# (re-measured by ``python -m benchmarks.forward --tables compiled`` and ``python -m benchmarks.backward``).
TILE_ROWS = 8 if WIDE else 4
_tile_many, _tile4, _tile1 = _product_tile(TILE_ROWS, (2,)), _product_tile(4, (2,)), _product_tile(1, (8, 2))


@njit(inline="always", error_model="numpy")
def padded(w):
    """A C-contiguous copy of the 2-D ``w`` (any layout, ``w_hh.T`` included) for ``add_hidden``'s
    w_t, each row followed by one cache line that is never read where its bytes are a power of two
    from 1 KB. Rows that far apart share a few of the L1 cache's sets, and a column block's rows,
    which the tiles read down, then evict each other: padded, the RNN's forward at H = 1024 is about
    a quarter faster; other strides gained nothing (the GRU's at H = 1024, 12 KB, lost) (re-measured
    by ``python -m benchmarks.forward --tables compiled --models rnn gru --H 256 1024 --T 200``)."""
    rows, cols = w.shape
    stride = cols * w.itemsize
    width = cols + 64 // w.itemsize if stride >= 1024 and stride & (stride - 1) == 0 else cols
    out = np.empty((rows, width), w.dtype)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = w[i, j]
    return out


@njit(inline="always", error_model="numpy")
def add_hidden(acc, h, w_t):
    """acc (N, R) += h (N, K) @ w_t[:, :R], all C-contiguous, w_t (K, R') with R' >= R (its rows
    may be ``padded``; the columns past R are never read): rows in tiles of ``TILE_ROWS``, then of
    four, then one by one, in vector registers (``_product_tile``), each element's products added
    one at a time, k ascending (fused where ``FMA``), so that the rows' grouping (the threads'
    groups of samples) changes no bit.
    Rows narrower than a vector take the same order in plain loops. The compiled forward's
    recurrence and the walks (``numba_scan``); its plain twin is ``add_hidden_reference``."""
    n, cols = acc.shape
    if cols < LANES_MIN:
        add_hidden_reference(acc, h, w_t)
        return
    b = 0
    while n - b >= TILE_ROWS:
        _tile_many(acc, h, w_t, b)
        b += TILE_ROWS
    if WIDE and n - b >= 4:  # a compile-time constant: AVX2's tiles are of four rows already
        _tile4(acc, h, w_t, b)
        b += 4
    while b < n:
        _tile1(acc, h, w_t, b)
        b += 1


@njit(inline="always", error_model="numpy")
def add_hidden_reference(acc, h, w_t):
    """``add_hidden`` in plain loops, the same order: its twin in the tests, and its rows narrower
    than a vector."""
    for b in range(acc.shape[0]):
        for k in range(h.shape[1]):
            hk = h[b, k]
            for j in range(acc.shape[1]):
                if FMA:  # a compile-time constant
                    acc[b, j] = fma(hk, w_t[k, j], acc[b, j])
                else:
                    acc[b, j] += hk * w_t[k, j]


# the kernels' dtypes: each torch dtype they take and its NumPy twin
NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}

# per dtype, an array the kernels take in place of an absent one (an untaped build's tape, a walk
# without outside gradients): never read
UNUSED = {d: np.zeros((1, 1, 1), t) for d, t in NUMPY_DTYPES.items()}


@functools.lru_cache(maxsize=64)
def running(batch: int, steps: int) -> np.ndarray:
    """The steps each sample runs where none ends early: all of them, (B,) int64 (the kernels only
    read it; made once per shape, as a short layer's call costs a few such allocations)."""
    return np.full(batch, steps, np.int64)


@njit(inline="always", error_model="numpy")
def put(dst, src):
    """dst[...] = src, element by element (any number of dimensions, one shape). Numba's array
    assignment compiles its broadcasting and its error messages, seconds of a kernel's first
    compile; every kernel copies arrays with this instead."""
    for i in np.ndindex(src.shape):
        dst[i] = src[i]


# The builds' options, in their names: numba's on-disk cache keys a function by its name and source
# file, not by its options or by the code it inlines from this module, so a build made with other
# options or an older ``add_hidden`` is not loaded from an older cache (the tag changes with them).
_OPTIONS = dict(cache=True, error_model="numpy", nogil=True)
_OPTIONS_TAG = "ng14"


def build(fn: Callable, parallel: bool, dtype: type | None = None, **constants: bool) -> Callable:
    """``fn`` compiled under a name of its own (numba's on-disk cache is keyed by the function's
    name, not by its globals or options): its serial or parallel build and, given ``dtype``
    (np.float32 or np.float64), with that dtype's ``_tanh``, ``_sigmoid`` and ``_gate``;
    ``constants``: globals it reads set for this build (compile-time constants, each a build of its
    own). Every build releases the interpreter while it runs (nogil): a long call (an LSTM layer's
    backward over a million steps) leaves it to other threads, a sequence-parallel run's heartbeat
    among them. Its on-disk cache is written by one process at a time (``_SerializedCacheFile``)."""
    variant = "".join(f"{k}_" for k, v in sorted(constants.items()) if v)
    name = (
        f"{fn.__name__}_{np.dtype(dtype).name + '_' if dtype else ''}{variant}"
        f"{'parallel' if parallel else 'serial'}_{_OPTIONS_TAG}"
    )
    scope = dict(fn.__globals__)
    if dtype is not None:
        _, scope["_tanh"], scope["_sigmoid"], scope["_gate"] = ACTIVATIONS[dtype]
    scope.update({f"_{k.upper()}": v for k, v in constants.items()})
    renamed = types.FunctionType(fn.__code__, scope, name, fn.__defaults__, fn.__closure__)
    renamed.__qualname__ = name
    dispatcher = njit(parallel=parallel, **_OPTIONS)(renamed)
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if fcntl is not None and type(cache_file) is IndexDataCacheFile:  # else numba's own writes
        cache_file.__class__ = _SerializedCacheFile
    return dispatcher


if IndexDataCacheFile is not None:

    class _SerializedCacheFile(IndexDataCacheFile):
        """A build's on-disk cache (its index and data files), written by one process at a time.
        numba writes each file atomically, but numbers a new specialization's data file from the
        index it read: two processes compiling two specializations of one build at once (a float32
        and a float64 walk, in sequence-parallel ranks, parallel test workers or a sweep's jobs) may
        both take number 1, and the index left may name one's types with the other's code, which
        every later process then loads and calls with arrays it was not compiled for. Under an
        exclusive lock on the cache folder, the index read is the last one written."""

        def save(self, key: object, data: object) -> None:
            with _locked(self._cache_path):
                super().save(key, data)


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` (released when the block ends or the process dies); on a
    filesystem that has no locks (some network ones), numba's unserialized writes, as before."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def threads() -> int:
    """The threads the kernels take: torch's, within numba's pool (set to them when more than one)."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if threads > 1:
        numba.set_num_threads(threads)
    return threads
