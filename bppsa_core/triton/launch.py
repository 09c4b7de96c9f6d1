"""How a kernel family is launched: each kernel's compile settings (``Launch``), the run-time loop
bounds, and the three launches of a chunked scan (reduce, spine, expand).

Loop bounds (chunk size, remainder, aggregate count) are run-time arguments, and no integer that
changes with the data (length, chunk size, batch, the scales' strides) is specialized on, so a GPU
compiles each configuration once, whatever the sequence length (docs/DESIGN.md, "Loop bounds").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import cache
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from bppsa_core.dispatch import WALK_WARPS

# The loops' bounds (chunk size C, remainder REM, aggregate count NAGG, an LSTM's steps T for its
# cell states, a Newton iteration's partial count P): run-time arguments. Triton's interpreter (the
# CPU tests) turns an int argument into a 1-element NumPy array, which ``range`` cannot take as a
# bound with NumPy 2 (``int()`` of a 1-d array is an error there), and passes a ``tl.constexpr``
# object through as it is; so under the interpreter ``Launch.run`` hands them in so.
BOUNDS = ("C", "REM", "NAGG", "T", "P")
# Integer arguments that change with the data (lengths, the chunk size, the batch, the scales' strides):
# never specialized on their values, so one binary serves every sequence length, chunk size and batch
# (Triton would otherwise compile again whenever one is 1 or turns a multiple of 16). Only H, fixed
# for a model, keeps Triton's specialization: a multiple of 16 lets the compiler vectorize row loads.
BY_DATA = (*BOUNDS, "N", "B", "stride_k", "stride_b")
# ``tl.dot``'s precision in the reduce kernels (their ``DOT``), the only products on tensor-core
# shapes: full float32 ("ieee") under PyTorch's default float32 matmul precision, "highest". Where a
# program lowers it (``torch.set_float32_matmul_precision("high")``, as for cuBLAS's TF32), chains of
# one weight term and the LSTM's take three TF32 products ("tf32x3", within a few float32 roundings
# of a product); ``benchmarks.capture --matmul-precision highest high`` times both.
DOT_PRECISION = "ieee"
LOWERED_DOT_PRECISION = "tf32x3"


def dot_precision() -> str:
    """The reduce kernels' ``tl.dot`` precision for PyTorch's float32 matmul precision now: full
    float32 under "highest", three TF32 products under "high" or "medium"."""
    return DOT_PRECISION if torch.get_float32_matmul_precision() == "highest" else LOWERED_DOT_PRECISION


# The warps of the walks (spine and expand), where a program sets them (``walk_warps``): None keeps
# each launch's own. At 4 warps a walk step's one reduction crosses warps (barriers on the dependent
# chain); on fewer it stays in a warp, with fewer lanes: ``benchmarks.capture --walk-warps`` times both.
_walk_warps: int | None = None


@contextlib.contextmanager
def walk_warps(warps: int | None) -> Iterator[None]:
    """Inside, the chunked scans' walks run on ``warps`` warps (one of ``dispatch.WALK_WARPS``; None: each
    launch's own), where their weights fit (``launch_config``, ``lstm_launch_config``); the setting
    before restored after."""
    global _walk_warps
    if warps is not None and warps not in WALK_WARPS:
        accepted = ", ".join(map(str, WALK_WARPS))
        raise ValueError(f"walk warps must be one of {accepted} or None, got {warps!r}")
    before, _walk_warps = _walk_warps, warps
    try:
        yield
    finally:
        _walk_warps = before


def walk_warps_set() -> int | None:
    """The walks' warps set by ``walk_warps`` now, or None."""
    return _walk_warps


@cache  # asked by every launch
def padded(h: int) -> int:
    """H as the programs hold it: a power of two of at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(h))


class Launch(NamedTuple):
    """How one kernel of a launch is compiled: its constexprs, warps, compile settings and how many
    source tensors its ``src_ptrs`` tuple holds (a tuple's length is compiled in). Everything else
    it is given (pointers, sizes, the loop bounds) is a run-time argument."""

    kernel: Any  # a ``triton.jit`` kernel (``JITFunction``, or ``InterpretedFunction`` under the interpreter)
    constexprs: dict[str, int | bool]
    num_warps: int
    num_stages: int | None = None  # None: Triton's default, loads software-pipelined over 3 stages
    maxnreg: int | None = None  # None: ptxas picks the registers per thread
    sources: int = 1  # the length of the kernel's ``src_ptrs``

    def options(self) -> dict[str, int]:
        """The compile options Triton is given: the warps, and the stages and register cap where set."""
        settings = {"num_stages": self.num_stages, "maxnreg": self.maxnreg}
        return {"num_warps": self.num_warps, **{k: v for k, v in settings.items() if v is not None}}

    def run(self, grid: tuple[int, ...], **args: Any) -> None:
        """The kernel on ``grid`` with the run-time ``args`` (by name) and these settings."""
        if "src_ptrs" in args and len(args["src_ptrs"]) != self.sources:  # another binary: refuse it
            raise ValueError(f"{len(args['src_ptrs'])} source tensors for a launch of {self.sources}")
        if not isinstance(self.kernel, triton.JITFunction):  # Triton's interpreter: see ``BOUNDS``
            args = {k: tl.constexpr(v) if k in BOUNDS else v for k, v in args.items()}
        self.kernel[grid](**args, **self.constexprs, **self.options())


def chain_args(
    sources: tuple[Tensor, ...], weights: Tensor, offsets: Tensor | None, batch: int, hidden: int
) -> dict[str, Any]:
    """The arguments every kernel of a chain's launch takes: its source tensors, its weights, its
    offsets (the first source in their place where there are none: never read then), B and H."""
    return {
        "src_ptrs": sources,
        "w_ptr": weights.contiguous(),
        "offsets_ptr": sources[0] if offsets is None else offsets.contiguous(),
        "B": batch,
        "H": hidden,
    }


def three_launches(
    kernels: dict[str, Launch],
    common: dict[str, Any],
    walk: dict[str, Tensor],
    x_last: Tensor,
    n: int,
    chunk: int,
    held: int,
) -> None:
    """Reduce (chunks 1..P-2), spine and expand (chunks 0..P-2) of a chain of n elements: ``common``
    the arguments all three take, ``walk`` the outputs the spine and the expand write. A chain of a
    single chunk takes the spine alone. Their scratch is made here: the chunks' aggregates as the
    programs hold them, ``held`` x ``held`` (the state padded) with their offsets, and each chunk's
    entry state, of x_last's width (B, S)."""
    batch, width = x_last.shape
    p = math.ceil(n / chunk)
    agg = x_last.new_empty((max(p - 2, 1), batch, held, held))
    agg_offsets = x_last.new_empty((max(p - 2, 1), batch, held))  # every row read is written by reduce
    entry = x_last.new_empty((max(p - 1, 1), batch, width))
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
