"""A diagonal chain's recurrence x_t = a_t x_{t-1} + b_t (elementwise over N channels) in three launches
of two kernels (one launch for a single chunk), beside its plain-PyTorch reference
(``diagonal_recurrence_ref``): a quasi-Newton iteration's correction (``bppsa_core.newton``), which
the eager chunked scan (``scan.elementwise_recurrence``) runs in about 3·sqrt(2 T) launches.

The steps fall into P chunks of C (a multiple of TILE) and the channels into blocks of BLOCK_N:

1. ``_diagonal_reduce``: one program per (chunk 0..P-2, block) composes its chunk's maps into one,
   x -> prod x + end, tile by tile: a tile's TILE steps solved at once as a scan of affine maps
   (``tl.associative_scan``), as ``lstm._lstm_cells`` solves an LSTM's cell states;
2. ``_diagonal_expand`` over those P - 1 maps, one chunk a block: the value after each, which is
   the next chunk's entry value;
3. ``_diagonal_expand`` over the steps: one program per (chunk, block) walks its chunk from its
   entry value (x_0 for the first), tile by tile, writing x.

Its dependent chain is 2 C / TILE + P / TILE tiles. Every program first reads a Newton solve's
record where it is given one (STOP) and does nothing once it says stopped.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from bppsa_core.scan import elementwise_recurrence
from bppsa_core.triton.launch import Launch
from bppsa_core.triton.lstm import _linear_pair

TILE = 64  # steps a tile: 2 x TILE x BLOCK_N numbers in registers, combined in log2(TILE) levels
BLOCK_N = 32  # channels a program takes
SIZES = ("T", "N", "C", "P")  # run-time sizes and loop bounds, never specialized on


@triton.jit
def _tile(a_ptr, b_ptr, t, cols, T, N, live):
    """The maps of steps t (TILE of them) on the columns ``cols``, composed from the first: past T or
    outside N the identity (a = 1, b = 0), so the last row is the whole tile's map."""
    ok = (t < T)[:, None] & live[None, :]
    at = tl.load(a_ptr + t[:, None] * N + cols[None, :], mask=ok, other=1.0)
    bt = tl.load(b_ptr + t[:, None] * N + cols[None, :], mask=ok, other=0.0)
    return tl.associative_scan((at, bt), 0, _linear_pair)


@triton.jit
def _program(N, TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's chunk (64-bit: offsets may pass 2^31), its channels, which of them exist, and
    a tile's step indices."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.program_id(0).to(tl.int64), cols, cols < N, tl.arange(0, TILE)


@triton.jit
def _last_row(rows, steps, TILE: tl.constexpr):
    """Row TILE - 1 of a (TILE, BLOCK_N) tile."""
    return tl.sum(tl.where(steps[:, None] == TILE - 1, rows, 0.0), axis=0)


@triton.jit(do_not_specialize=SIZES)
def _diagonal_reduce(
    a_ptr, b_ptr, stop_ptr, prod_ptr, end_ptr,  # pointers: a, b (T, N) and the record read; the maps written
    T, N, C,  # sizes: steps, channels, chunk
    STOP: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Chunk q's map over its C steps on this block's channels: prod[q] the product of its a, end[q]
    its value from x = 0."""
    if STOP:  # noqa: SIM102 (a constexpr test alone: no load is compiled without STOP)
        if tl.load(stop_ptr) != 0:  # a Newton solve that has stopped: nothing to do
            return
    q, cols, live, steps = _program(N, TILE, BLOCK_N)
    prod = tl.full((BLOCK_N,), 1.0, tl.float32)
    end = tl.zeros((BLOCK_N,), tl.float32)
    for i in range(0, C, TILE):
        pa, pb = _tile(a_ptr, b_ptr, q * C + i + steps, cols, T, N, live)
        last_a = _last_row(pa, steps, TILE)
        end = last_a * end + _last_row(pb, steps, TILE)
        prod = last_a * prod
    tl.store(prod_ptr + q * N + cols, prod, mask=live)
    tl.store(end_ptr + q * N + cols, end, mask=live)


@triton.jit(do_not_specialize=SIZES)
def _diagonal_expand(
    a_ptr, b_ptr, x0_ptr, stop_ptr, entry_ptr, out_ptr,  # pointers: x_1..x_T (T, N) written
    T, N, C,  # sizes: steps, channels, chunk
    STOP: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Chunk q on this block's channels, walked tile by tile from x_0 (q = 0) or entry[q - 1]."""
    if STOP:  # noqa: SIM102 (a constexpr test alone: no load is compiled without STOP)
        if tl.load(stop_ptr) != 0:  # a Newton solve that has stopped: nothing to do
            return
    q, cols, live, steps = _program(N, TILE, BLOCK_N)
    x = tl.load(x0_ptr + cols, mask=live & (q == 0), other=0.0)
    x += tl.load(entry_ptr + (q - 1) * N + cols, mask=live & (q > 0), other=0.0)
    for i in range(0, C, TILE):
        t = q * C + i + steps
        pa, pb = _tile(a_ptr, b_ptr, t, cols, T, N, live)
        rows = pa * x[None, :] + pb
        tl.store(out_ptr + t[:, None] * N + cols[None, :], rows, mask=(t < T)[:, None] & live[None, :])
        x = _last_row(rows, steps, TILE)


# ------------------------------------------------------------------------------------------- launch


@cache
def diagonal_launches(stop: bool) -> tuple[Launch, Launch]:
    """``_diagonal_reduce`` and ``_diagonal_expand`` (``stop``: reading a Newton solve's record), as
    ``diagonal_recurrence`` runs them and ``benchmarks.kernels`` compiles them; made once."""
    settings = {"STOP": stop, "TILE": TILE, "BLOCK_N": BLOCK_N}
    return Launch(_diagonal_reduce, settings, 4), Launch(_diagonal_expand, settings, 4)


def default_chunk(steps: int) -> int:
    """Steps a chunk, a multiple of TILE: about sqrt(T TILE / 8), which balances the 2 C / TILE tiles
    of a chunk's two walks against the P / TILE tiles of the maps' walk, P = T / C."""
    return TILE * max(1, round(math.sqrt(steps / (8 * TILE))))


def diagonal_recurrence(
    a: Tensor, b: Tensor, x0: Tensor, chunk: int | None = None, stop: Tensor | None = None
) -> Tensor:
    """x_1..x_n (n, *S) of x_t = a_t x_{t-1} + b_t, elementwise, from x0 (S); a and b (n, *S),
    float32. ``chunk``: steps a chunk (rounded up to a multiple of TILE; None: ``default_chunk``).
    ``stop``: a Newton solve's record (``bppsa_core.newton.judge``); once it says stopped, the
    kernels return at once and the result is left unwritten."""
    steps = b.shape[0]
    out = torch.empty_like(b, memory_format=torch.contiguous_format)
    width = x0.numel()
    if steps == 0 or width == 0:
        return out
    c = TILE * math.ceil((chunk or default_chunk(steps)) / TILE)
    p = math.ceil(steps / c)
    a, b, x0 = a.expand_as(b).contiguous(), b.contiguous(), x0.contiguous()
    marker = b if stop is None else stop  # not read without a record
    reduce, expand = diagonal_launches(stop is not None)
    blocks = triton.cdiv(width, BLOCK_N)
    common = {"x0_ptr": x0, "stop_ptr": marker, "N": width}
    entries = b  # one chunk: never read
    if p > 1:
        maps = b.new_empty((2, p - 1, width))  # the chunks' maps but the last's: prod, end
        entries = b.new_empty((p - 1, width))  # after map k: chunk k + 1's entry value
        reduce.run(
            (p - 1, blocks), a_ptr=a, b_ptr=b, stop_ptr=marker, prod_ptr=maps[0], end_ptr=maps[1],
            T=steps, N=width, C=c,
        )  # fmt: skip
        spine = TILE * math.ceil((p - 1) / TILE)  # the maps walked as one chunk
        expand.run(
            (1, blocks), a_ptr=maps[0], b_ptr=maps[1], entry_ptr=b, out_ptr=entries, T=p - 1, C=spine,
            **common,
        )  # fmt: skip
    expand.run((p, blocks), a_ptr=a, b_ptr=b, entry_ptr=entries, out_ptr=out, T=steps, C=c, **common)
    return out


def diagonal_recurrence_ref(a: Tensor, b: Tensor, x0: Tensor) -> Tensor:
    """``diagonal_recurrence`` in plain PyTorch: ``scan.elementwise_recurrence``."""
    return elementwise_recurrence(a.expand_as(b), b, x0)
