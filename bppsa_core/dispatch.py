"""Which scan runs where: the scan options, what "auto" picks, and what the Triton kernels take.

Every decision about scan strategies is made here, so that ``bppsa_core.scan``, the modules of
``bppsa_core.nn`` and the suite all ask the same place:

* ``ScanOptions``: strategy, chunk size and Blelloch levels, checked once, when made;
* ``check_device``: whether a strategy can run on a device at all (``graph`` needs CUDA, ``triton``
  CUDA or Triton's interpreter);
* ``kernels_take``, ``lstm_kernels_take``: whether the Triton kernels take a chain (float32, at most
  3 weight terms and H <= 64, or an LSTM's with 2H <= 64: the weights stay in one program's registers);
* ``resolve``: the strategy "auto" stands for, given the chain, the device and the kernels;
* ``torch_nn_instead``: where "auto" leaves a whole module to ``torch.nn``'s own forward and backward;
* ``with_kernels``: the one fallback. Under "auto", kernels that fail to compile for the GPU at
  hand (Triton's ``CompilationError`` or ``OutOfResources``) are logged once, not tried again on
  that device, and the caller's fallback runs instead; under "triton" the error propagates.

The cost model behind "auto" is ``choose`` (and ``eager_strategy`` for scans made of plain PyTorch
ops); ``default_chunk`` is the chunk size of the chunked scans.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

STRATEGIES: tuple[str, ...] = ("auto", "sequential", "blelloch", "chunked", "numba", "triton", "graph")
# The Triton kernels keep the K shared (H x H) weights of a chain in one program's registers.
MAX_TERMS = 3
MAX_HIDDEN = 64
# An LSTM's state is (h, c): 2H numbers, and its four gates' H x H weights stay in registers.
MAX_LSTM_HIDDEN = MAX_HIDDEN // 2
# The warps a program may ask the kernels' walks to run on (``bppsa_core.triton.launch.walk_warps``):
# no more than 4, their own at HP <= 32 (on 8 the GRU's expand at HP = 32 spilled).
WALK_WARPS = (1, 2, 4)

# Below this many elements, a chunked scan has too few chunks to pay for its extra matrix work.
_MIN_PARALLEL_LENGTH = 16
# Multiply-adds a CPU does in large GEMMs in the time one small tensor op costs in overhead: where the
# scan's O(H) extra work stops paying for its shorter dependency chain (re-measured by
# ``python -m benchmarks.backward --tables scan``).
_CPU_FLOPS_PER_OP = 2.0e5
# Bytes a chunked scan's reduce step may work on (one element per chunk, scaled copy included)
# before it takes fewer chunks: about what stays in a server CPU's cache.
_CHUNK_WORKING_SET = 24 << 20
# Largest Blelloch up-sweep (bytes of dense float32 elements) that "auto" accepts on a GPU.
_GPU_BLELLOCH_BYTES = 1 << 30
# Per device type and mode, the widths (lo, hi] at which no BPPSA path beats torch.nn's own module,
# so "auto" runs that instead (``torch_nn_instead``). A GPU: every width above the Triton kernels'
# (H = 64, an LSTM's 32), where the general scans do H times a matrix-vector step's work: within
# cuDNN's persistent kernels (RNN H <= 256, GRU and LSTM 128) they lose 2-30 times; at H = 256, past
# them, only a GRU's scan is ahead (1.1-1.2 times; an LSTM's 0.7-0.8), and wider the H^3 work against
# cuDNN's H^2 halves a lead with each doubling of H. A CPU: from where the compiled walk's small
# products lose to the batched GEMMs of PyTorch's kernel (an LSTM above H = 192: 1.03-1.35 times
# slower at H = 256, T = 100 to 10,000; with AVX-512's wider vectors above _WIDE_TAPED_LSTM_MAX_HIDDEN,
# ``torch_nn_widths``), or where no tape is kept (a GRU's above H = 512, where its
# compiled forward stops: its walk over the tape still wins at 512). Re-measured by
# ``python -m benchmarks.gpu_check --steps capture``, and on a CPU by
# ``python -m benchmarks.backward --threads 1 --strategies numba --model lstm --H 256 --F 256`` and
# ``python -m benchmarks.backward --threads 1 --strategies numba --model gru --H 512 --F 512``.
_TORCH_NN_HIDDEN: dict[str, dict[str, tuple[tuple[int, float], ...]]] = {
    "cuda": {
        "RNN_TANH": ((MAX_HIDDEN, math.inf),), "RNN_RELU": ((MAX_HIDDEN, math.inf),),
        "GRU": ((MAX_HIDDEN, 128), (256, math.inf)), "LSTM": ((MAX_LSTM_HIDDEN, math.inf),),
    },
    "cpu": {"GRU": ((512, math.inf),), "LSTM": ((192, math.inf),)},
}  # fmt: skip

T = TypeVar("T")


def is_count(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass(frozen=True)
class ScanOptions:
    """How to scan: a strategy of ``STRATEGIES``, the chunk size of the chunked scans (None:
    ``default_chunk``) and the Blelloch levels before a sequential middle (None: all). Checked when made."""

    strategy: str = "auto"
    chunk: int | None = None
    levels: int | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown scan strategy {self.strategy!r}; accepted: {', '.join(STRATEGIES)}")
        if self.chunk is not None and not is_count(self.chunk, 1):
            raise ValueError(f"chunk must be a positive integer or None, got {self.chunk!r}")
        if self.levels is not None and not is_count(self.levels, 0):
            raise ValueError(f"levels must be a non-negative integer or None, got {self.levels!r}")


def chunked_steps(n: int, chunk: int) -> int:
    """Dependent steps of a chunked scan of n elements in chunks of ``chunk``: a chunk reduced, the
    spine's remainder r = n - (P-1)·C walked and the P-2 chunk aggregates scanned, a chunk expanded
    (2C + r + P - 2; the remainder then one chunk for P = 2; n for one chunk)."""
    p = math.ceil(n / chunk)
    rem = n - (p - 1) * chunk
    return n if p == 1 else rem + chunk if p == 2 else 2 * chunk + rem + p - 2


def default_chunk(n: int, element_bytes: int = 0) -> int:
    """Chunk size with the fewest dependent steps (``chunked_steps``).

    A chunked scan's dependent steps (a few ops each in the eager scan, a loop step in the kernels)
    are ~2·C + n/C, fewest near C = sqrt(n / 2), where that sum is flat; within half to twice it, the
    chunk that also leaves the spine a short remainder r saves up to C steps (the window holds the
    minimum over all chunks for every n that tests/core/test_dispatch.py checks). Each reduce step also
    works on one element per chunk (``element_bytes`` each, with its GEMM's scaled copy: B·K·H²·itemsize);
    when those would pass ``_CHUNK_WORKING_SET``, fewer, longer chunks keep a step's working set in the
    CPU's cache (re-measured by ``python -m benchmarks.backward --suite long``, its GRU rows).
    """
    c = _fewest_steps_chunk(n)
    if element_bytes:
        c = max(c, math.ceil(n * element_bytes / _CHUNK_WORKING_SET))
    return c


@lru_cache(maxsize=1024)  # a pure function of n, asked once per scan
def _fewest_steps_chunk(n: int) -> int:
    balanced = max(1, round(math.sqrt(n / 2)))
    near = range(max(1, balanced // 2), 2 * balanced + 2)
    return min(near, key=lambda c: (chunked_steps(n, c), abs(c - balanced)))


# ------------------------------------------------------------------------------------ where it runs


# found once, plain values: torch.compile reads them, where it would trace a cached function and warn
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
_NUMBA_INSTALLED = importlib.util.find_spec("numba") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def numba_installed() -> bool:
    return _NUMBA_INSTALLED


def kernels_run_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on this device: a GPU, or the CPU under TRITON_INTERPRET=1."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(strategy: str, device: torch.device) -> bool:
    """Whether ``strategy`` can run on ``device`` at all (for some chain)."""
    if strategy == "graph":
        return device.type == "cuda"
    if strategy == "triton":
        return triton_installed() and kernels_run_on(device)
    if strategy == "numba":
        return numba_installed() and device.type == "cpu"
    return True


def check_device(strategy: str, device: torch.device) -> None:
    """Raise ValueError, naming the strategies that do run here, if ``strategy`` cannot run on ``device``."""
    if runs_on(strategy, device):
        return
    here = ", ".join(s for s in STRATEGIES if runs_on(s, device))
    if strategy == "numba" and not numba_installed():
        need = "the numba package (pip install numba), which is not installed"
    elif strategy == "triton" and not triton_installed():
        need = "the triton package (pip install triton), which is not installed"
    else:
        where = {"graph": "a CUDA device", "numba": "a CPU device"}.get(
            strategy, "a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
        )
        need = f"{where}, and this device is {device}"
    raise ValueError(f"strategy='{strategy}' needs {need}; accepted here: {here}")


def kernels_take(terms: int, hidden: int, *dtypes: torch.dtype) -> bool:
    """Whether the Triton kernels take a factored chain of ``terms`` (hidden x hidden) weights whose
    tensors have ``dtypes``: float32, terms <= 3 (an RNN has 1, a GRU 3), hidden <= 64."""
    return (
        terms <= MAX_TERMS
        and hidden <= MAX_HIDDEN
        and all(d == torch.float32 for d in dtypes)
        and triton_installed()
    )


def lstm_kernels_take(hidden: int, *dtypes: torch.dtype) -> bool:
    """Whether the Triton kernels take an LSTM chain over (h, c) of this H: float32, H <= 32."""
    return hidden <= MAX_LSTM_HIDDEN and all(d == torch.float32 for d in dtypes) and triton_installed()


def numba_takes(terms: int, *dtypes: torch.dtype, lstm: bool = False) -> bool:
    """Whether the compiled CPU kernels (``bppsa_core.numba_scan``) take a factored chain of
    ``terms`` weights (or, ``lstm``, an LSTM's chain) whose tensors have ``dtypes``: one dtype,
    float32 or float64, terms <= 3."""
    return (
        (lstm or terms <= MAX_TERMS)
        and len(set(dtypes)) == 1
        and dtypes[0] in (torch.float32, torch.float64)
        and numba_installed()
    )


# Widest state at which the compiled CPU forward (``bppsa_core.numba_forward``) beats PyTorch's fused
# kernel, per mode: its per-step loop wins while a step's multiply-adds are few, PyTorch's GEMMs
# beyond (the RNN's still wins at H = 1024, the widest measured; a stacked GRU's is even at 512);
# PyTorch's LSTM is one fused kernel
# already, which the compiled loop beats below H = 32 on one thread
# (re-measured by ``python -m benchmarks.forward --tables compiled --no-grad``, and --models lstm).
# A taped LSTM forward (``layer.Tape``) spares its backward the gates' recomputation: forward
# and backward together win up to _TAPED_LSTM_MAX_HIDDEN, the cells charging a forward slower
# than torch.nn's (re-measured by ``python -m benchmarks.backward --model lstm``).
# On more threads the compiled LSTM shares its samples among them, where PyTorch's kernel's
# per-step products are too small to: it wins up to H = 112 on two
# (re-measured by ``python -m benchmarks.forward --tables compiled --models lstm --threads 2 --no-grad``).
_COMPILED_FORWARD_MAX_HIDDEN = {"RNN_TANH": 1024, "RNN_RELU": 1024, "GRU": 512, "LSTM": 31}
_PARALLEL_LSTM_MAX_HIDDEN = 112
_TAPED_LSTM_MAX_HIDDEN = 128
# With AVX-512 (``numba_math.WIDE``: twice the lanes in the products) the taped LSTM's forward and
# walk together, one thread, up to H = 384: within 15 % of torch.nn's at T = 100, 1.1-2 times faster at
# T = 1000 against autograd with subnormals flushed (6-10 times in PyTorch's default mode); re-measured by
# ``python -m benchmarks.backward --model lstm --threads 1 --strategies numba --H 384 --F 384 --flush-bptt``.
_WIDE_TAPED_LSTM_MAX_HIDDEN = 384


def wide_vectors() -> bool:
    """Whether the compiled CPU kernels run in AVX-512's vectors (``numba_math.WIDE``), which moves
    where their LSTM wins; False without numba. Not cached: torch.compile traces into a cached
    function and warns that it does; after the first call the import is a lookup."""
    if not numba_installed():
        return False
    from bppsa_core import numba_math

    return numba_math.WIDE


# The scan strategies whose layers may run the compiled forward; the others keep PyTorch's.
COMPILED_FORWARD_STRATEGIES = ("auto", "numba")


def compiled_forward(
    strategy: str, mode: str, hidden: int, *tensors: torch.Tensor | None, taped: bool = False
) -> bool:
    """Whether a layer's forward runs compiled (``bppsa_core.numba_forward``) rather than by
    PyTorch's fused kernel: where ``compiled_forward_takes`` the layer, with nothing recorded for
    autograd and no autocast."""
    if strategy not in COMPILED_FORWARD_STRATEGIES:  # the rest is asked only of those that may take it
        return False
    present = [t for t in tensors if t is not None]
    return (
        bool(present)
        and compiled_forward_takes(
            strategy, mode, hidden, present[0].device.type, tuple(t.dtype for t in present), taped
        )
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in present))
        and not torch.is_autocast_enabled("cpu")
    )


def compiled_forward_takes(
    strategy: str, mode: str, hidden: int, device_type: str, dtypes: tuple[torch.dtype, ...], taped: bool
) -> bool:
    """Whether the compiled forward takes a layer: CPU tensors of one dtype, float32 or float64,
    numba installed; then always under "numba", and under "auto" where it is the faster
    (``_COMPILED_FORWARD_MAX_HIDDEN``; ``taped``: an LSTM's forward that keeps its gates for the
    backward, ``_TAPED_LSTM_MAX_HIDDEN``; an LSTM's on more than one thread,
    ``_PARALLEL_LSTM_MAX_HIDDEN``). Other strategies keep PyTorch's forward."""
    threads = torch.get_num_threads() > 1
    return _compiled_forward_takes(strategy, mode, hidden, device_type, dtypes, taped, threads)


@lru_cache(maxsize=256)  # asked once per layer call, whose host work at small T is about as long
def _compiled_forward_takes(
    strategy: str, mode: str, hidden: int, device_type: str, dtypes: tuple[torch.dtype, ...], taped: bool,
    threads: bool,
) -> bool:  # fmt: skip
    if strategy not in COMPILED_FORWARD_STRATEGIES or device_type != "cpu":
        return False
    if mode == "LSTM" and taped:
        widest = _WIDE_TAPED_LSTM_MAX_HIDDEN if wide_vectors() else _TAPED_LSTM_MAX_HIDDEN
    elif mode == "LSTM" and threads:
        widest = _PARALLEL_LSTM_MAX_HIDDEN
    else:
        widest = _COMPILED_FORWARD_MAX_HIDDEN[mode]
    return (strategy != "auto" or hidden <= widest) and numba_takes(0, *dtypes)


NUMBA_REFUSED = (
    f"strategy='numba' takes a factored chain of at most {MAX_TERMS} terms (an RNN's or a GRU's) "
    "or an LSTM's, "
    "float32 or float64, not transposed; accepted for this chain: auto, sequential, blelloch, chunked"
)


@lru_cache(maxsize=1024)  # a pure function of its counts, asked once per layer backward
def numba_chunk(n: int, batch: int, hidden: int, terms: int, threads: int) -> int:
    """Chunk size of the compiled CPU scan: the one whose three phases finish first on ``threads``.

    Work in units of one element applied to one vector (terms·H² multiply-adds): a walk costs 1 a
    step, folding a step into a chunk aggregate H. Phases run their tasks (reduce: chunks 1..P-2 x
    samples; spine: samples; expand: chunks 0..P-2 x samples) ``threads`` at a time. With at least
    as many samples as threads this gives one chunk (P = 1: the sequential scan, samples in parallel).
    """

    def rounds(tasks: int) -> int:
        return math.ceil(tasks / threads)

    def cost(p: int) -> float:
        c = math.ceil(n / p)
        p = math.ceil(n / c)
        rem = n - (p - 1) * c
        return (
            rounds(max(p - 2, 0) * batch) * c * hidden
            + rounds(batch) * (rem + max(p - 2, 0) / terms)
            + rounds((p - 1) * batch) * c
        )

    best = min(range(1, min(n, 2 + 4 * threads) + 1), key=cost)
    return math.ceil(n / best)


KERNELS_REFUSED = (
    f"strategy='triton' takes a float32 factored chain of at most {MAX_TERMS} terms with H <= "
    f"{MAX_HIDDEN} (an RNN's or a GRU's, transposed or not) or an LSTM's with H <= {MAX_LSTM_HIDDEN}, "
    "not transposed; "
    "accepted for this chain: auto, sequential, blelloch, chunked, graph"
)


# ------------------------------------------------------------------------------------------ choice


def choose(
    n: int,
    batch: int,
    hidden: int,
    device: torch.device,
    kernels_fit: bool = False,
    numba_fit: bool = False,
) -> str:
    """The strategy "auto" picks for n elements of (hidden x hidden), ``batch`` samples each.

    CPU: the compiled kernels where they take the chain (``numba_fit``: ``numba_takes``; one call,
    no per-operation overhead), else see ``eager_strategy``. GPU: the Triton kernels when the chain
    fits them and they work on this GPU (``kernels_fit``), else the eager scan captured in a CUDA
    graph: on a GPU the cost is launches, and both paths issue a handful however long the chain.
    """
    if device.type != "cuda":
        return "numba" if numba_fit and device.type == "cpu" else eager_strategy(n, batch, hidden, device)
    return "triton" if kernels_fit else "graph"


def eager_strategy(n: int, batch: int, hidden: int, device: torch.device) -> str:
    """The best scan made of plain PyTorch ops, one launch each.

    CPU: the sequential scan issues ~n dependent small ops; the chunked scan ~3·sqrt(2n) ops plus
    n·B·H³ extra multiply-adds in large GEMMs. Pick the cheaper, an op costing ``_CPU_FLOPS_PER_OP``.
    GPU: the paper's Blelloch scan, whose depth is 2·log2(n) batched levels, unless its up-sweep
    (about one dense chain, n·B·H² elements) would pass ``_GPU_BLELLOCH_BYTES``; then the chunked
    scan, whose working set is a few chunk aggregates.
    """
    if n < _MIN_PARALLEL_LENGTH:
        return "sequential"
    if device.type == "cuda":
        return "blelloch" if n * batch * hidden**2 * 4 <= _GPU_BLELLOCH_BYTES else "chunked"
    cost_seq = n * _CPU_FLOPS_PER_OP + n * batch * hidden**2
    cost_chunk = 3 * math.sqrt(2 * n) * _CPU_FLOPS_PER_OP + n * batch * hidden**3
    return "chunked" if cost_chunk < cost_seq else "sequential"


def resolve(
    strategy: str,
    n: int,
    batch: int,
    hidden: int,
    device: torch.device,
    kernels_fit: bool,
    numba_fit: bool = False,
) -> str:
    """The concrete strategy: ``strategy`` itself, or what "auto" picks. ``kernels_fit``: whether the
    Triton kernels take the chain (``kernels_take``); "auto" takes them only where they work.
    ``numba_fit``: whether the compiled CPU kernels take it (``numba_takes``)."""
    if strategy != "auto":
        return strategy
    return choose(n, batch, hidden, device, kernels_fit and kernels_usable(device), numba_fit)


def torch_nn_widths(device_type: str, mode: str) -> tuple[tuple[int, float], ...]:
    """The widths (lo, hi] at which "auto" leaves a module of this ``mode`` on this device type to
    torch.nn (``_TORCH_NN_HIDDEN``); a CPU's LSTM from past its taped path's widest with AVX-512."""
    if device_type == "cpu" and mode == "LSTM" and wide_vectors():
        return ((_WIDE_TAPED_LSTM_MAX_HIDDEN, math.inf),)
    return _TORCH_NN_HIDDEN.get(device_type, {}).get(mode, ())


def torch_nn_instead(
    strategy: str, mode: str, hidden: int, device: torch.device, dtype: torch.dtype, inference: bool = False
) -> bool:
    """Whether "auto" runs a module of this ``mode`` (torch.nn's: RNN_TANH, RNN_RELU, GRU, LSTM),
    H and parameter ``dtype`` as ``torch.nn`` does, its fused forward and autograd's backward
    (cuDNN's on a GPU): float32, at the widths of ``_TORCH_NN_HIDDEN`` for the device, where no
    BPPSA path is faster; but not an ``inference`` call (no backward follows) that the compiled
    forward takes (``compiled_forward_takes``: it beats PyTorch's forward there). Any other
    strategy runs BPPSA as asked."""
    widths = torch_nn_widths(device.type, mode)
    return (
        strategy == "auto"
        and dtype == torch.float32
        and any(lo < hidden <= hi for lo, hi in widths)
        and (device.type != "cuda" or torch.backends.cudnn.enabled)
        and not (inference and compiled_forward_takes(strategy, mode, hidden, device.type, (dtype,), False))
    )


# ---------------------------------------------------------------------------------------- fallback

# CUDA devices on which the Triton kernels failed to compile; "auto" stops trying them there.
_BROKEN_KERNELS: set[int | None] = set()


def kernels_usable(device: torch.device) -> bool:
    """Whether "auto" may run the Triton kernels on this device: a GPU where they have not failed."""
    return device.type == "cuda" and device.index not in _BROKEN_KERNELS


def kernel_errors() -> tuple[type[BaseException], ...]:
    """Triton's compile-time failures (too many registers, an unsupported GPU)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return (CompilationError, OutOfResources)


def with_kernels(
    strategy: str, device: torch.device, kernels: Callable[[], T], fallback: Callable[[], T]
) -> T:
    """``kernels()``; under ``strategy`` "auto", a compile failure is logged, the device marked (so
    "auto" picks another strategy there from now on) and ``fallback()`` returned instead."""
    try:
        return kernels()
    except kernel_errors() as exc:
        if strategy != "auto":
            raise
        _BROKEN_KERNELS.add(device.index)
        log.warning("Triton scan kernels failed on %s (%s); using the graph scan", device, exc)
        return fallback()
