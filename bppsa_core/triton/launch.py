"""How a kernel family is launched: each kernel's compile settings (``Launch``), the run-time loop
bounds, and the three launches of a chunked scan (reduce, spine, expand).

Loop bounds (chunk size, remainder, aggregate count) are run-time arguments, and no integer that
changes with the data (length, chunk size, batch, the scales' strides) is specialized on, so a GPU
compiles each configuration once, whatever the sequence length (docs/DESIGN.md, "Loop bounds").
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from functools import cache
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.compiler import CompiledKernel
from triton.runtime.driver import driver

from bppsa_core.dispatch import WALK_WARPS

log = logging.getLogger(__name__)

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
# The installed Triton's (major, minor): compile settings that keep a kernel's values in registers
# differ by release (``chunk_scan.reduce_warps``).
TRITON_RELEASE = tuple(int(part) for part in triton.__version__.split(".")[:2])


def triton_from(first: tuple[int, int], release: tuple[int, ...] | None = None) -> bool:
    """Whether Triton ``release`` (None: the installed one, ``TRITON_RELEASE``) is ``first`` or later."""
    return (TRITON_RELEASE if release is None else release) >= first


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
        """The kernel on ``grid`` with the run-time ``args`` (by name) and these settings: the first
        launch of a specialization through Triton's ``kernel[grid](...)``, which compiles it, the
        later ones straight to its compiled kernel where they can be (``_direct``)."""
        if "src_ptrs" in args and len(args["src_ptrs"]) != self.sources:  # another binary: refuse it
            raise ValueError(f"{len(args['src_ptrs'])} source tensors for a launch of {self.sources}")
        if not isinstance(self.kernel, triton.JITFunction):  # Triton's interpreter: see ``BOUNDS``
            args = {k: tl.constexpr(v) if k in BOUNDS else v for k, v in args.items()}
            self.kernel[grid](**args, **self.constexprs, **self.options())
            return
        args.update(self.constexprs)
        plan = _direct(self, args)
        if plan is not None and plan.compiled is not None:
            try:
                plan.launch(grid)
            except TypeError as exc:  # the launcher parses its arguments before it launches anything
                _give_up(exc)
            else:
                return
        compiled = self.kernel[grid](**args, **self.options())
        if plan is None:  # a kernel's first launch on this device: Triton has made its binder now
            plan = _direct(self, args)
        if plan is not None and isinstance(compiled, CompiledKernel):
            _COMPILED[plan.key] = compiled


class _Plan(NamedTuple):
    """A launch's arguments as Triton binds them, its key among the compiled kernels (``_COMPILED``),
    the kernel compiled for that key (None before Triton's first launch of it) and the device."""

    bound: dict[str, Any]
    key: tuple
    compiled: Any
    device: int

    def launch(self, grid: tuple[int, ...]) -> None:
        """What Triton's ``JITFunction.run`` calls last, with no launch hooks (``_direct``)."""
        k, stream = self.compiled, driver.active.get_current_stream(self.device)
        g1, g2 = (grid[1] if len(grid) > 1 else 1), (grid[2] if len(grid) > 2 else 1)
        k.run(grid[0], g1, g2, stream, k.function, k.packed_metadata, None, None, None, *self.bound.values())


# The kernels Triton compiled, by ``_direct``'s key: the launch's kernel, device and compile options
# and Triton's own specialization of the arguments (dtypes, 16-byte alignment, specialized integers).
_COMPILED: dict[tuple, Any] = {}
_direct_launches = True  # ``direct_launches`` sets it
_refused: TypeError | None = None  # why the launcher refused a direct launch (``_give_up``), if it did
# The Triton releases whose ``JITFunction.run`` ``_direct`` follows, each checked against Triton's own
# path (tests/core/test_compile.py, the direct launches); under any other, launches take that path.
DIRECT_TRITONS = ("3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0")


def _direct(launch: Launch, args: dict[str, Any]) -> _Plan | None:
    """The plan of a launch straight to its compiled kernel, or None where Triton's own path must run:
    where a launch hook, a pre-run hook, debug mode or instrumentation is set (each needs what
    ``JITFunction.run`` does around the launch), where the installed Triton is not one it follows
    (``DIRECT_TRITONS``) or its launcher has refused a direct launch's arguments (``_give_up``).

    Why: after a kernel's first launch Triton's ``kernel[grid](...)`` still binds and specializes
    the arguments, looks the kernel up, checks the globals it read and builds the launch metadata on
    every call, the larger part of a short layer's launch cost on the host
    (re-measured by ``python -m benchmarks.launch``). The plan keeps Triton's binding, so a
    specialization (an unaligned pointer, another dtype) still gets its own binary, and drops the
    rest; a global a kernel reads is a module constant, never changed after its compile."""
    if not _direct_launches or _refused is not None or triton.__version__ not in DIRECT_TRITONS:
        return None
    kernel, runtime = launch.kernel, triton.knobs.runtime
    hooks = runtime.launch_enter_hook, runtime.launch_exit_hook
    if any(getattr(h, "calls", True) for h in hooks) or kernel.pre_run_hooks:
        return None
    if runtime.debug or kernel.debug or triton.knobs.compilation.instrumentation_mode:
        return None
    device = driver.active.get_current_device()
    caches = kernel.device_caches.get(device)
    if caches is None:  # no launch on this device yet: Triton's makes its binder
        return None
    bound, specialization, _ = caches[-1](**args)
    key = (id(kernel), device, launch.num_warps, launch.num_stages, launch.maxnreg, *specialization)
    return _Plan(bound, key, _COMPILED.get(key), device)


def _give_up(exc: TypeError) -> None:
    """The launcher refused a direct launch's arguments (a Triton that lays them out otherwise than
    ``_Plan.launch`` does): every launch of this process then takes Triton's path, said once."""
    global _refused
    _refused = exc
    log.warning("Triton's launcher refused a direct launch (%s); launching through Triton from now on", exc)


@contextlib.contextmanager
def direct_launches(enabled: bool) -> Iterator[None]:
    """Inside, launches go straight to their compiled kernels (``_direct``) where ``enabled``, else
    every one through Triton's ``kernel[grid](...)``; the setting before restored after."""
    global _direct_launches
    before, _direct_launches = _direct_launches, bool(enabled)
    try:
        yield
    finally:
        _direct_launches = before


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
