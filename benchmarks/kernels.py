"""The Triton scan kernels compiled for NVIDIA GPUs without one: registers, spills, shared memory and a
static estimate of their loops.

    python -m benchmarks.kernels [--arch 80 90] [--T 1000] [--chunk 32] [--dot ieee] [--summary]
    python -m benchmarks.kernels --walk-warps 1      # the walks (spine, expand) as walk_warps(1) sets them

Every kernel configuration the modules can launch (``launch_configs``: kernel, mode, terms, diagonal,
offsets, fused or not, the H it serves, with the constexprs and warps of ``bppsa_core.triton``'s
``launch_config``, the settings the launches themselves use) is compiled ahead of time for each
``--arch`` (compute capability x 10: 80 = A100, 90 = H100) by Triton's compiler and the ptxas in the
triton wheel, as Triton's JIT compiles it on such a GPU: every pointer 16-byte aligned (as PyTorch
allocates), H specialized as Triton specializes an int (1 a constant, a multiple of 16 marked so),
every other integer a run-time i32 (the kernels never specialize on them). The wheel's cuobjdump then
reads each cubin: registers per thread, stack, local memory (spills), shared memory, and the SASS of
each loop: the instructions from a backward branch's target to the branch.

The estimate is static, a lower bound in cycles, not a measurement: the sum over a kernel's loops of
its SASS instructions per iteration (the body's shortest path: a forward branch inside may skip a
few) x its iterations at ``--T`` and ``--chunk`` (reduce and expand: one chunk per program; spine:
the remainder chunk, then one step per chunk aggregate) x ceil(warps / 4). It assumes
each of an SM's 4 warp schedulers issues at most one instruction per cycle and every warp of a program
issues every instruction of the loop; stalls on memory, on dependencies and on other programs sharing
the SM only add to it.

Needs only torch, triton and the suite's own modules (and tqdm, when installed, for the progress
bar): no GPU, no CUDA install, no Hydra; fails with one line if triton's ptxas or cuobjdump is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.common import positive_int, run_tool
from bppsa_core.dispatch import WALK_WARPS
from bppsa_core.triton import chunk_scan
from bppsa_core.triton.launch import DOT_PRECISION, Launch, padded
from bppsa_core.triton.lstm import CELL_STEPS, gates_launch, lstm_launch_config
from toolbox.cli import OneLineParser, cpu_cores
from toolbox.errors import SuiteError
from toolbox.files import output_file, write_atomic

ARCHS = (80, 90)
SCHEDULERS_PER_SM = 4  # warp schedulers per SM on sm_70 and later
REGISTERS_PER_SM = 65536
DEFAULT_T = 1000
DEFAULT_CHUNK = 32
# Per arch: shared memory per SM and the most a block may use (bytes), resident warps per SM
# (the CUDA C++ Programming Guide's table of compute capabilities).
SM_LIMITS = {
    80: (167936, 166912, 64),
    86: (102400, 101376, 48),
    89: (102400, 101376, 48),
    90: (233472, 232448, 64),
}
# Pointer arguments to float64 (a Newton solve's stopping record); every other points to float32.
FLOAT64_POINTERS = ("record_ptr",)  # and ``stop_ptr`` where the scan reads a record (STOP)
# What ``triton.compile`` takes besides the kernel: signature, constexprs by name, attributes.
Inputs = tuple[dict[str, str], dict[str, Any], dict]


class ToolchainError(SuiteError, RuntimeError):
    """Triton's ptxas or cuobjdump is missing, or the kernels cannot be compiled in this process."""


def tools() -> tuple[str, str]:
    """The paths of the ptxas and cuobjdump Triton uses (its wheel's, or ``TRITON_PTXAS_PATH`` and
    ``TRITON_CUOBJDUMP_PATH``); ToolchainError with one line when either is missing."""
    import triton

    paths = []
    for name in ("ptxas", "cuobjdump"):
        try:
            paths.append(getattr(triton.knobs.nvidia, name).path)
        except RuntimeError:
            env = f"TRITON_{name.upper()}_PATH"
            raise ToolchainError(
                f"triton's {name} was not found (not in the triton wheel; set {env})"
            ) from None
    return paths[0], paths[1]


def check_compilable() -> None:
    """Raise ToolchainError (one line) where the kernels cannot be compiled here: triton's ptxas or
    cuobjdump missing, or the kernels loaded for Triton's interpreter."""
    import triton

    tools()
    if not isinstance(chunk_scan._reduce, triton.JITFunction):
        raise ToolchainError(
            "the kernels were loaded for Triton's interpreter (TRITON_INTERPRET is set); run without it"
        )


# ---------------------------------------------------------------------------------------- catalogue


class KernelConfig(NamedTuple):
    """One kernel in one configuration the modules can launch (``launch_configs``)."""

    role: str  # reduce, spine or expand
    mode: str  # SCALES, SCALES_T, TANH, RELU, GRU or LSTM
    terms: int  # K weight terms (an LSTM: its 4 gates)
    diag: bool  # HAS_DIAG; an LSTM: HAS_HH
    affine: bool  # HAS_B
    fused: bool  # a layer mode: only x_0 and the deltas written
    hidden: tuple[int, ...]  # every H this binary serves; the first is the one to compile it with
    launch: Launch


def h_variants(largest: int) -> list[tuple[int, ...]]:
    """The H values 1..``largest`` grouped by the binary they get: by ``padded(H)`` and by how Triton
    specializes the int H (1 becomes a constant; a multiple of 16 is marked divisible by 16)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for h in range(1, largest + 1):
        kind = 1 if h == 1 else 16 if h % 16 == 0 else 0
        groups.setdefault((padded(h), kind), []).append(h)
    return sorted(tuple(hs) for hs in groups.values())


def launch_configs(dot: str = DOT_PRECISION, walk_warps: int | None = None) -> list[KernelConfig]:
    """Every kernel configuration the modules can launch, each once; ``dot``: the reduce kernels'
    ``tl.dot`` precision asked of ``launch_config`` (``launch.dot_precision``: ``LOWERED_DOT_PRECISION``
    under a lowered float32 matmul precision); ``walk_warps``: the walks' warps a program set
    (``launch.walk_warps``; None: the launches' own).

    ``factored_scan``: SCALES with K = 1, 2, 3, with and without a diagonal, and SCALES_T as the
    modules' transposed chains have it (an RNN's K = 1 with and without a diagonal, a GRU's K = 3
    with one: tangents and Newton iterations); the fused layer backwards: TANH, RELU (K = 1) and GRU
    (K = 3, a diagonal); each with and without offsets, for every H the kernels take
    (``dispatch.MAX_HIDDEN``, grouped by ``h_variants``). ``lstm_scan``: with and without the h<-h
    diagonal and offsets, and the fused ``lstm_layer_backward`` with and without offsets, H <=
    ``dispatch.MAX_LSTM_HIDDEN``, with its gates' kernel (``lstm_gates``, with and without b_hh). A
    fused Newton iteration's transposed scans (an RNN's and a GRU's, with offsets, reading the
    solve's record: "SCALES_T newton") and its pointwise kernels (``newton_configs``). A
    configuration whose kernel, constexprs, sources and compile options another already has
    (``_reduce`` takes no ``FUSED``) is listed once.
    """
    from bppsa_core.dispatch import MAX_HIDDEN, MAX_LSTM_HIDDEN

    cs = chunk_scan
    scans = [(cs.SCALES.value, k, diag, False) for k in (1, 2, 3) for diag in (False, True)]
    scans += [(cs.SCALES_T.value, 1, False, False), (cs.SCALES_T.value, 1, True, False)]
    scans += [(cs.SCALES_T.value, 3, True, False), (cs.TANH.value, 1, False, True)]
    scans += [(cs.RELU.value, 1, False, True), (cs.GRU.value, 3, True, True)]
    found: list[KernelConfig] = []
    for hidden in h_variants(MAX_HIDDEN):
        for mode, terms, diag, fused in scans:
            for affine in (False, True):
                hp = padded(hidden[0])
                launches = cs.launch_config(
                    mode, terms, diag, affine, int(fused), fused, hp, dot=dot, walk_warps=walk_warps
                )
                found += [
                    KernelConfig(role, cs.MODE_NAMES[mode], terms, diag, affine, fused, hidden, launch)
                    for role, launch in launches.items()
                ]
        for terms, diag in ((1, False), (3, True)):  # a fused Newton iteration's, reading its record
            launches = cs.launch_config(
                cs.SCALES_T.value, terms, diag, True, 0, False, padded(hidden[0]), True, dot, walk_warps
            )
            found += [
                KernelConfig(role, "SCALES_T newton", terms, diag, True, False, hidden, launch)
                for role, launch in launches.items()
            ]
    lstm_scans = [(False, False), (True, False), (False, True)]  # (has_hh, fused): the layer's own fused
    for hidden in h_variants(MAX_LSTM_HIDDEN):
        for has_hh, fused in lstm_scans:
            for affine in (False, True):
                launches = lstm_launch_config(has_hh, affine, padded(hidden[0]), fused, dot, walk_warps)
                found += [
                    KernelConfig(role, "LSTM", 4, has_hh, affine, fused, hidden, launch)
                    for role, launch in launches.items()
                ]
    every_lstm = tuple(range(1, MAX_LSTM_HIDDEN + 1))  # its gates' kernel: one binary for any H
    found += [
        KernelConfig("gates", "LSTM", 4, False, has_b, True, every_lstm, gates_launch(has_b))
        for has_b in (False, True)
    ]
    found += newton_configs(MAX_HIDDEN)
    found += diagonal_configs(MAX_HIDDEN)
    unique: dict[tuple, KernelConfig] = {}
    for config in found:
        launch = config.launch
        key = (
            launch.kernel,
            tuple(sorted(launch.constexprs.items())),
            tuple(launch.options().items()),
            launch.sources,
            config.hidden,
        )
        unique.setdefault(key, config)
    return list(unique.values())


def with_dot(configs: list[KernelConfig], precision: str) -> list[KernelConfig]:
    """``configs`` with ``tl.dot``'s precision ``precision`` where a kernel takes one (``DOT``: the
    reduce kernels), to compare the library's (``launch.DOT_PRECISION``) with another compiled."""
    out = []
    for config in configs:
        launch = config.launch
        if "DOT" in launch.constexprs:
            launch = launch._replace(constexprs={**launch.constexprs, "DOT": precision})
        out.append(config._replace(launch=launch))
    return out


def newton_configs(largest: int) -> list[KernelConfig]:
    """A Newton iteration's kernels (``bppsa_core.triton.newton``): the RNN's residual (tanh, relu) and
    the GRU's (by how Triton specializes its int H: 1, a multiple of 16, the rest), the update reading
    the corrections in time order or reversed, the decision for Newton, quasi-Newton and Picard
    sweeps, and a captured solve's fallback walk (tanh, relu, GRU; by ``h_variants``, its weights in
    registers).
    The update and the decision serve any width, so every H up to ``largest`` is listed for them."""
    from bppsa_core.triton import newton

    every = tuple(range(1, largest + 1))
    gru = [(1,), tuple(h for h in every if h % 16 == 0), tuple(h for h in every if h > 1 and h % 16)]

    def config(role: str, mode: str, hidden: tuple[int, ...], launch: Launch) -> KernelConfig:
        return KernelConfig(role, mode, 0, False, False, False, hidden, launch)

    modes = (("tanh", chunk_scan.TANH.value), ("relu", chunk_scan.RELU.value), ("gru", chunk_scan.GRU.value))
    configs = [
        config("residual", f"{name} residual", every, newton.residual_launch(mode))
        for name, mode in modes[:2]
    ]
    configs += [
        config("residual", "gru residual", hidden, newton.residual_launch(modes[2][1])) for hidden in gru
    ]
    configs += [
        config("fallback", f"{name} walk", hidden, newton.walk_launch(mode, padded(hidden[0])))
        for hidden in h_variants(largest)
        for name, mode in modes
    ]
    for flag, (update_mode, decide_mode) in (
        (False, ("d in time order", "newton")),
        (True, ("d reversed", "quasi-newton")),
    ):
        update, decide = newton.update_launches(flag, flag)
        configs += [
            config("update", update_mode, every, update),
            config("decide", decide_mode, every, decide),
        ]
    configs.append(config("decide", "sweep", every, newton.update_launches(False, True, True)[1]))
    return configs


DIAGONAL_ROLES = ("diagonal reduce", "diagonal expand")


def diagonal_configs(largest: int) -> list[KernelConfig]:
    """A diagonal chain's recurrence (``bppsa_core.triton.diagonal``, a quasi-Newton iteration's
    correction): its reduce and expand, reading a Newton solve's record or not. They serve any
    width (the channels are B S), so every H up to ``largest`` is listed."""
    from bppsa_core.triton import diagonal

    every = tuple(range(1, largest + 1))
    return [
        KernelConfig(role, "diagonal", 0, False, False, False, every, launch)
        for stop in (False, True)
        for role, launch in zip(DIAGONAL_ROLES, diagonal.diagonal_launches(stop), strict=True)
    ]


# ------------------------------------------------------------------------------------------ compile


def compile_inputs(config: KernelConfig, arch: int) -> Inputs:
    """The signature, constexprs and attributes Triton's JIT compiles ``config`` with, for H =
    ``config.hidden[0]``: pointers float32 and 16-byte aligned, constexprs from ``launch_config``, an
    int the kernel never specializes (``do_not_specialize``) a plain i32, H as Triton specializes it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch, 32))
    kernel = config.launch.kernel
    constexprs = dict(config.launch.constexprs)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for param in kernel.params:
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
            if isinstance(constexprs[name], str):  # the JIT gives a string (``DOT``) an empty attribute list
                attrs[(param.num,)] = []
        elif name == "src_ptrs":  # a tuple of pointers, each aligned as the others
            signature[name] = ("*fp32",) * config.launch.sources
            for i in range(config.launch.sources):
                attrs[(param.num, i)] = backend.parse_attr("D")
        elif name.endswith("_ptr"):
            record = name in FLOAT64_POINTERS or (name == "stop_ptr" and constexprs.get("STOP"))
            signature[name] = "*fp64" if record else "*fp32"
            attrs[(param.num,)] = backend.parse_attr("D")
        elif param.do_not_specialize:
            signature[name] = "i32"
        elif name == "H":
            h = config.hidden[0]
            if h == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
            else:
                signature[name] = "i32"
                attrs[(param.num,)] = backend.parse_attr("D" if h % 16 == 0 else "")  # "": none, as the JIT
        else:
            raise ValueError(f"{kernel.__name__}: no rule for the specialized argument {name!r}")
    return signature, constexprs, attrs


@contextlib.contextmanager
def launches_recorded() -> Iterator[list[tuple[Launch, dict[str, Any]]]]:
    """Inside, the kernel launches made through ``bppsa_core.triton`` are recorded instead of run, each
    ``Launch`` with its run-time arguments, in the list yielded."""
    launches: list[tuple[Launch, dict[str, Any]]] = []
    run = Launch.run
    Launch.run = lambda self, grid, **args: launches.append((self, args))  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        Launch.run = run  # type: ignore[method-assign]


def recorded_launches(call: Callable[[], object]) -> list[tuple[Launch, dict[str, Any]]]:
    """The kernel launches ``call()`` makes through ``bppsa_core.triton`` (``launches_recorded``): what a
    module's call would compile, on any machine."""
    with launches_recorded() as launches:
        call()
    return launches


def jit_inputs(launch: Launch, args: dict[str, Any], arch: int) -> Inputs:
    """The signature, constexprs (by name) and attributes Triton's JIT would compile ``launch`` with,
    given its run-time ``args``, on an sm_``arch`` GPU: Triton's own specialization of the values,
    through its binder (``create_function_from_signature``) and ``JITFunction._pack_args``, internals
    of the triton version the project pins (``tests/core/test_compile.py`` notices if they change)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {
        **args,
        **launch.constexprs,
        **launch.options(),
        "debug": False,
        "instrumentation_mode": triton.knobs.compilation.instrumentation_mode,
    }
    bound, specialization, options = binder(**kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    names = {(p.num,): p.name for p in kernel.params}
    return signature, {names[path]: value for path, value in constexprs.items()}, attrs


def config_of(launch: Launch, hidden: int) -> KernelConfig:
    """The configuration of ``launch_configs()`` that compiles ``launch`` for this H."""
    for config in launch_configs():
        if config.launch == launch and hidden in config.hidden:
            return config
    raise LookupError(
        f"{launch.kernel.__name__} {launch.constexprs} at H = {hidden} is not in launch_configs()"
    )


def compile_config(config: KernelConfig, arch: int) -> Any:
    """``config`` compiled for sm_``arch``: Triton's ``CompiledKernel`` (``asm["cubin"]``, ``metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = compile_inputs(config, arch)
    source = ASTSource(fn=config.launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=config.launch.options())


def cuobjdump(cubin: bytes) -> str:
    """cuobjdump's resource usage and SASS of a cubin."""
    _, tool = tools()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        done = subprocess.run(
            [tool, "--dump-resource-usage", "-sass", str(path)], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ToolchainError(f"cuobjdump failed: {last}")
    return done.stdout


def resources(dump: str) -> dict[str, int]:
    """Registers per thread, stack, static shared and local bytes of the (one) function in ``dump``."""
    line = re.search(r"^\s*REG:.*$", dump, re.MULTILINE)
    if line is None:
        raise ValueError("cuobjdump printed no resource usage")
    fields = dict(re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line.group()))
    return {key.lower(): int(fields[key]) for key in ("REG", "STACK", "SHARED", "LOCAL")}


_INSTRUCTION = re.compile(
    r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.MULTILINE
)


class Loop(NamedTuple):
    """A loop in SASS: its instructions (from the backward branch's target to the branch, both
    included), those on its shortest path (less what forward branches inside it can skip), its
    local-memory loads and stores (register spills, LDL/STL) and its barriers (BAR: where the
    program's warps wait for one another, as a reduction across warps does)."""

    instructions: int
    shortest: int
    local: int = 0
    barriers: int = 0


def sass_loops(dump: str) -> list[Loop]:
    """The loops of the (one) function in ``dump``, in address order. A branch to itself (the padding
    after the last EXIT) is not a loop."""
    instructions = [(int(addr, 16), op, rest) for addr, op, rest in _INSTRUCTION.findall(dump)]
    branches = []
    for addr, op, rest in instructions:
        if op == "BRA" or op.startswith("BRA."):
            target = re.search(r"0x([0-9a-f]+)", rest)
            if target is None:
                raise ValueError(f"a branch without an address: {op}{rest}")
            branches.append((addr, int(target.group(1), 16)))
    loops = []
    for end, start in branches:
        if start >= end:
            continue
        body = [(a, op) for a, op, _ in instructions if start <= a <= end]
        skipped = {a for a, _ in body for at, to in branches if start < at < to <= end and at < a < to}
        local = sum(op.startswith(("LDL", "STL")) for _, op in body)
        barriers = sum(op.startswith("BAR") for _, op in body)
        loops.append(Loop(len(body), len(body) - len(skipped), local, barriers))
    return loops


def iterations(role: str, length: int, chunk: int) -> list[int]:
    """Each loop's iterations in one program of ``role``, in the kernel's order, for a chain of
    ``length`` elements in chunks of ``chunk`` (``_launch``'s P, REM and NAGG)."""
    p = math.ceil(length / chunk)
    if role == "spine":
        return [length - (p - 1) * chunk, max(p - 2, 0)]
    if role == "cells":  # an LSTM's cell states: tiles of CELL_STEPS steps
        return [math.ceil(length / CELL_STEPS)]
    if role in ("residual", "update", "gates"):  # pointwise: one element each, no loop
        return []
    if role == "decide":  # its partials, a block of 1,024 a pass: one pass up to 2^20 states
        return [1]
    if role == "fallback":  # a captured Newton solve's native walk: every step
        return [length]
    if role in DIAGONAL_ROLES:  # the tiles of its own chunk (the expand over the steps)
        from bppsa_core.triton import diagonal

        return [diagonal.default_chunk(length) // diagonal.TILE]
    return [chunk]


def loop_estimate(loop_instructions: Sequence[int], loop_iterations: Sequence[int], warps: int) -> int:
    """A static lower bound in cycles on a program's loops: instructions per iteration (a loop's
    shortest path) x iterations, summed over the loops, x ceil(warps / 4): each of the SM's 4 warp
    schedulers issues at most one instruction per cycle, and every warp issues every instruction."""
    if len(loop_instructions) != len(loop_iterations):
        raise ValueError(f"{len(loop_instructions)} loops in the SASS, {len(loop_iterations)} in the kernel")
    issued = sum(n * i for n, i in zip(loop_instructions, loop_iterations, strict=True))
    return issued * math.ceil(warps / SCHEDULERS_PER_SM)


def warps_per_sm(registers: int, warps: int, shared: int = 0, arch: int | None = None) -> int:
    """Warps of this kernel an SM holds at once: whole programs of ``warps`` warps, as many as its
    registers (each warp taking ``registers`` x 32, rounded up to the allocation unit of 256, of the
    SM's 65,536), its ``shared`` bytes per program (plus the 1 KB CUDA reserves per block) and the
    SM's warp slots allow; shared memory and warp slots only for an arch in ``SM_LIMITS``."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    programs = REGISTERS_PER_SM // (per_warp * warps)
    if arch in SM_LIMITS:
        shared_per_sm, _, max_warps = SM_LIMITS[arch]
        programs = min(programs, shared_per_sm // (shared + 1024), max_warps // warps)
    return programs * warps


def row(
    config: KernelConfig, arch: int, kernel: Any, dump: str, compile_s: float, length: int, chunk: int
) -> dict[str, Any]:
    """One row of the table: ``config``'s ``kernel``, compiled for sm_``arch`` in ``compile_s``
    seconds, and what cuobjdump printed of it (``dump``)."""
    used = resources(dump)
    loops = sass_loops(dump)
    shortest = [loop.shortest for loop in loops]
    its = iterations(config.role, length, chunk)
    warps = config.launch.num_warps
    return {
        "kernel": config.launch.kernel.__name__,
        "role": config.role,
        "mode": config.mode,
        "K": config.terms,
        "diag": config.diag,
        "affine": config.affine,
        "fused": config.fused,
        "HP": config.launch.constexprs.get("HP", "-"),  # "-": a pointwise kernel, no padded H
        "H": list(config.hidden),
        "warps": warps,
        "arch": arch,
        "regs": used["reg"],
        "stack": used["stack"],
        "local": used["local"],
        "shared": used["shared"],
        "triton_shared": kernel.metadata.shared,
        "warps_per_sm": warps_per_sm(used["reg"], warps, used["shared"] + kernel.metadata.shared, arch),
        "loops": [loop.instructions for loop in loops],
        "loops_shortest": shortest,
        "loop_barriers": [loop.barriers for loop in loops],
        "local_in_loops": sum(loop.local for loop in loops),
        "ftz": kernel.asm["ptx"].count(".ftz"),  # flush-to-zero instructions: none, subnormals kept
        "iterations": its,
        "T": length,
        "chunk": chunk,
        "estimate": loop_estimate(shortest, its, warps) if len(loops) == len(its) else None,
        "compile_s": compile_s,
    }


def representative(configs: Iterable[KernelConfig]) -> list[KernelConfig]:
    """A subset with every kernel and every mode: at each kernel's widest H (a multiple of 16, the
    variant with vectorized loads) with offsets, a diagonal where the mode may have one, and every K;
    a Newton iteration's pointwise kernels and walk (``newton_configs``: no offsets), an LSTM's
    gates' and cell states' kernels (no offsets or diagonal of their own) and the diagonal
    recurrence (``diagonal_configs``) at theirs."""
    configs = list(configs)
    widest: dict[str, int] = {}
    for c in configs:
        widest[c.mode] = max(widest.get(c.mode, 0), c.hidden[-1])
    unchained = ("residual", "update", "decide", "fallback", "gates", "cells")  # no chain's variants

    def kept(c: KernelConfig) -> bool:
        return (
            c.role in unchained
            or c.mode == "diagonal"
            or (c.affine and (c.diag or c.mode in ("TANH", "RELU")))
        )

    return [c for c in configs if c.hidden[-1] == widest[c.mode] and kept(c)]


# The H values every launch of the modules is compiled at by the default test (tests/core/test_compile.py).
LISTED_H = (1, 20, 32, 64)


def listed(configs: Iterable[KernelConfig]) -> list[KernelConfig]:
    """Every configuration whose binary serves H = 1, 20, 32 or 64 (``LISTED_H``; the LSTM's
    largest, 32, among them): each mode, affine or not, fused or not, at those widths."""
    return [c for c in configs if set(c.hidden) & set(LISTED_H)]


def compile_all(
    archs: Sequence[int] = ARCHS,
    configs: Sequence[KernelConfig] | None = None,
    length: int = DEFAULT_T,
    chunk: int = DEFAULT_CHUNK,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Every configuration (``launch_configs()`` unless given) compiled for each arch: one row each,
    in that order.

    Kernels compile one after the other in this process; cuobjdump reads each cubin in a process of
    its own (its SASS takes about half a second a kernel, most of the time once Triton's cache holds
    the compiles), as many at once as this process may use cores, while the next kernels compile."""
    check_compilable()
    configs = launch_configs() if configs is None else configs
    jobs = [(c, a) for a in archs for c in configs]
    bar = _progress(len(jobs), progress)
    workers = cpu_cores()
    rows: list[dict[str, Any]] = []
    pending: deque[tuple[KernelConfig, int, Any, float, Future[str]]] = deque()

    def finish_oldest() -> None:
        config, arch, kernel, compile_s, dump = pending.popleft()
        rows.append(row(config, arch, kernel, dump.result(), compile_s, length, chunk))
        hp = config.launch.constexprs.get("HP", "-")  # "-": a pointwise kernel
        bar(f"sm_{arch} {config.launch.kernel.__name__} {config.mode} HP={hp}")

    with ThreadPoolExecutor(max_workers=workers) as dumps:
        for config, arch in jobs:
            started = time.perf_counter()
            kernel = compile_config(config, arch)
            compile_s = round(time.perf_counter() - started, 3)
            pending.append((config, arch, kernel, compile_s, dumps.submit(cuobjdump, kernel.asm["cubin"])))
            if len(pending) > workers:
                finish_oldest()
        while pending:
            finish_oldest()
    bar(None)
    return rows


def _progress(total: int, enabled: bool) -> Callable[[str | None], None]:
    """A progress bar on stderr (tqdm, or a line per tenth without it); called once per step, then None."""
    if not enabled:
        return lambda _: None
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def line(text: str | None) -> None:
            if text is not None:
                done[0] += 1
                if done[0] % max(total // 10, 1) == 0 or done[0] == total:
                    print(f"compiled {done[0]}/{total}", file=sys.stderr, flush=True)

        return line
    bar = tqdm(total=total, desc="compiling", unit="kernel", file=sys.stderr)

    def step(text: str | None) -> None:
        if text is None:
            bar.close()
        else:
            bar.set_postfix_str(text, refresh=False)
            bar.update()

    return step


# ------------------------------------------------------------------------------------------- tables


def hidden_text(hidden: Sequence[int]) -> str:
    """H values as ranges: 1, 2-15, 33-47 49-63."""
    runs: list[list[int]] = []
    for h in hidden:
        if runs and h == runs[-1][-1] + 1:
            runs[-1].append(h)
        else:
            runs.append([h])
    return " ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _caption(rows: Sequence[dict[str, Any]]) -> str:
    import triton

    t, chunk = (rows[0]["T"], rows[0]["chunk"]) if rows else (DEFAULT_T, DEFAULT_CHUNK)
    spilled = sum(1 for r in rows if r["stack"] or r["local"])
    return (
        f"Triton {triton.__version__}: {spilled} of {len(rows)} compiles spill (stack or local memory). "
        f"Estimate: a static lower bound in cycles at T = {t}, chunk = {chunk}: loop SASS instructions "
        "(shortest path) x iterations x ceil(warps / 4), one instruction issued per cycle per warp "
        "scheduler (4 per SM); not a measurement. Loop instructions: one count per loop (the spine's "
        "remainder walk, then its aggregate scan); loop barriers: its BAR instructions an iteration, "
        "where the program's warps wait for one another. Shared: the cubin's static bytes + the dynamic "
        "bytes Triton launches with. Warps/SM: resident per SM by registers, shared memory (plus the 1 "
        "KB reserved per block) and warp slots."
    )


def _flags(r: dict[str, Any]) -> str:
    parts = [f"K={r['K']}"]
    parts += [name for name in ("diag", "affine", "fused") if r[name]]
    return " ".join(parts)


def _loops(r: dict[str, Any], key: str = "loops") -> str:
    return " + ".join(str(n) for n in r[key])


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Every row: kernel, mode, flags, HP, H, warps, arch, registers, stack, local, shared, resident
    warps per SM, the loops' instruction counts and the estimate, with the assumptions as a caption."""
    head = [
        "kernel", "mode", "K/diag/affine/fused", "HP", "H", "warps", "sm", "regs", "stack", "local",
        "shared B", "warps/SM", "loop instr", "loop barriers", "estimate (cycles)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["kernel"], r["mode"], _flags(r), r["HP"], hidden_text(r["H"]), r["warps"], r["arch"], r["regs"],
            r["stack"], r["local"], f"{r['shared']} + {r['triton_shared']}", r["warps_per_sm"], _loops(r),
            _loops(r, "loop_barriers"), "n/a" if r["estimate"] is None else r["estimate"],
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join([*lines, "", _caption(rows)])


def _span(values: Iterable[int]) -> str:
    values = sorted(set(values))
    if not values:
        return "n/a"
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def summary(rows: Sequence[dict[str, Any]], arch: int = 90) -> str:
    """One line per kernel, mode and HP over its variants (K, diagonal, offsets, H): ranges of
    registers (at ``arch``, then at the other archs), spills (all archs), and at ``arch`` shared
    bytes, resident warps per SM, loop instructions and the estimate."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["mode"], r["HP"]), []).append(r)
    others = sorted({r["arch"] for r in rows} - {arch})
    head = [
        "kernel", "mode", "HP", "H", "warps", f"regs sm_{arch}",
        *(f"regs sm_{a}" for a in others), "spills (stack + local B)", f"shared B sm_{arch}",
        f"warps/SM sm_{arch}", f"loop instr sm_{arch}", f"loop barriers sm_{arch}",
        f"estimate sm_{arch} (cycles)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (kernel, mode, hp), group in groups.items():
        here = [r for r in group if r["arch"] == arch]
        if not here:
            continue
        loops = range(len(here[0]["loops"]))  # none in a pointwise kernel: its cells read "–"
        per_loop = [  # loop instructions, then barriers
            " / ".join(_span(r[key][i] for r in here) for i in loops) or "–"
            for key in ("loops", "loop_barriers")
        ]
        cells = [
            kernel,
            mode,
            hp,
            hidden_text(sorted({h for r in group for h in r["H"]})),
            _span(r["warps"] for r in here),
            _span(r["regs"] for r in here),
            *(_span(r["regs"] for r in group if r["arch"] == a) for a in others),
            _span(r["stack"] + r["local"] for r in group),
            _span(r["shared"] + r["triton_shared"] for r in here),
            _span(r["warps_per_sm"] for r in here),
            *per_loop,
            _span(r["estimate"] for r in here if r["estimate"] is not None) if loops else "–",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join([*lines, "", _caption(rows)])


# ---------------------------------------------------------------------------------------------- CLI


def _arch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number; accepted: a compute capability 75 to 120, like 80 or 90"
        ) from None
    if value < 75:
        raise argparse.ArgumentTypeError(
            f"sm_{value}: the kernels' tl.dot needs sm_75 or later; accepted: 75 to 120"
        )
    if value > 120:
        raise argparse.ArgumentTypeError(f"sm_{value}: no such GPU yet; accepted: 75 to 120")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = OneLineParser(
        prog="python -m benchmarks.kernels",
        description=(
            "Compile every Triton scan kernel configuration the modules can launch for NVIDIA GPUs, "
            "without one (Triton's compiler and ptxas), and print a Markdown table of what cuobjdump "
            "reads from each cubin: registers per thread, stack, local (spills), shared bytes, SASS "
            "instructions per loop, and a static estimate: loop instructions x iterations at --T and "
            "--chunk x ceil(warps / 4), a lower bound in cycles assuming one instruction issued per "
            "cycle per warp scheduler (4 per SM). Not a measurement."
        ),
    )
    parser.add_argument(
        "--arch", type=_arch, nargs="+", default=list(ARCHS), help="compute capabilities x 10"
    )
    parser.add_argument("--T", type=positive_int, default=DEFAULT_T, help="chain length of the estimate")
    parser.add_argument(
        "--chunk", type=positive_int, default=DEFAULT_CHUNK, help="chunk size of the estimate"
    )
    parser.add_argument(
        "--configs",
        choices=("all", "listed", "representative"),
        default="all",
        help="every configuration; those at H = 1, 20, 32, 64; or one per kernel and mode at the "
        "widest H (with offsets, diagonal)",
    )
    parser.add_argument(
        "--dot",
        choices=("ieee", "tf32x3", "tf32"),
        default=DOT_PRECISION,
        help="tl.dot's input_precision in the reduce kernels (the library's: ieee)",
    )
    parser.add_argument(
        "--walk-warps",
        type=int,
        choices=WALK_WARPS,
        default=None,
        help="the walks' warps a program sets (bppsa_core.triton.launch.walk_warps): their kernels only",
    )
    parser.add_argument(
        "--summary", action="store_true", help="one line per kernel, mode and HP instead of every row"
    )
    parser.add_argument(
        "--json", type=output_file, default=None, help="also write the rows to this JSON file"
    )
    args = parser.parse_args(argv)
    try:
        configs = launch_configs(walk_warps=args.walk_warps)
        if args.walk_warps is not None:  # the kernels the setting changes
            configs = [c for c in configs if c.role in ("spine", "expand")]
        if args.configs == "representative":
            configs = representative(configs)
        elif args.configs == "listed":
            configs = listed(configs)
        configs = with_dot(configs, args.dot)
        rows = compile_all(args.arch, configs, args.T, args.chunk)
    except ToolchainError as exc:
        print(f"benchmarks.kernels: {exc}", file=sys.stderr)
        return 2
    if args.json is not None:
        import json

        write_atomic(args.json, lambda tmp: tmp.write_text(json.dumps(rows, indent=1) + "\n"))
    print(summary(rows, max(args.arch)) if args.summary else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool("benchmarks.kernels", main))
