"""Flush-to-zero for the CPU scans, set and restored in every thread the work runs on.

A long chain of Jacobians whose norms are below 1 multiplies down into the subnormal range
(below 2^-126 in float32), where a CPU's arithmetic takes a microcode assist per operation, one to
two orders of magnitude slower. The chunked scan's aggregates reach it first, after a few hundred
steps, and a long backward then runs several times slower than it should.
``flush_denormals()`` turns on the CPU's flush-to-zero and denormals-are-zero modes (x86 MXCSR
FTZ and DAZ; AArch64 FPCR FZ) for the duration of a ``with`` block, in the calling thread and in
every worker thread of PyTorch's OpenMP pool (where its GEMMs run), and afterwards puts the calling
thread's previous floating-point environment back in all of them, so the process is left as it was
(the pool's workers share the calling thread's mode unless something changed theirs behind
PyTorch's back). Switching costs a few microseconds.

Why it is safe: a flushed value is below 2^-126 ≈ 1.2e-38, so each flush changes a result by less
than 1.2e-38 times the largest operand, far below float32's rounding of anything it is added to
(2^-24 relative); float64's range (2^-1022) is only reached by products that are zero for every
purpose. Gradients differ from autograd's only where autograd's are themselves below that. (A GPU
needs none of this: the Triton kernels keep subnormals, with no flush-to-zero instruction in their
PTX, and a GPU computes on them at full speed.)

The pool's threads are reached through libgomp's ``GOMP_parallel`` (the OpenMP runtime of PyTorch's
Linux builds, also MKL's threading layer there), which runs libm's ``fesetenv`` in each of them.
PyTorch's wheels bundle their own libgomp, and numba's OpenMP layer loads the system's beside it:
the one taken is PyTorch's (``_loaded``): regions opened in numba's pool would leave PyTorch's
threads unflushed and, with two threads, set the two pools taking the cores from each other, a
layer's training step many times ``torch.nn``'s (re-measured by
``python -m benchmarks.host --threads 2 --T 1000``).
Where that is not available (another OS, another OpenMP runtime, another architecture) the block
runs unchanged, and ``available()`` says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import platform
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Where the flush bits live in glibc's fenv_t, by machine: (byte offset of the 32-bit register, bits).
_LAYOUT = {
    "x86_64": (28, 0x8040),  # MXCSR after the 28-byte x87 environment: FTZ (bit 15) and DAZ (bit 6)
    "aarch64": (0, 1 << 24),  # FPCR: FZ (bit 24)
}
_ENV_BYTES = 64  # larger than fenv_t on both
_state = threading.local()


class _Runtime:
    """libgomp and libm: set a floating-point environment in every thread of the OpenMP pool."""

    def __init__(self, gomp: ctypes.CDLL, libm: ctypes.CDLL, offset: int, bits: int) -> None:
        self.gomp, self.libm, self.offset, self.bits = gomp, libm, offset, bits
        gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self.fesetenv = ctypes.cast(libm.fesetenv, ctypes.c_void_p)
        self._flushing: dict[bytes, ctypes.Array] = {}

    def get(self) -> ctypes.Array:
        """The calling thread's environment."""
        env = ctypes.create_string_buffer(_ENV_BYTES)
        self.libm.fegetenv(env)
        return env

    def set_everywhere(self, env: ctypes.Array) -> None:
        """``fesetenv(env)`` in the calling thread and each worker of a pool as large as torch's
        (with one thread, in the calling thread alone: no parallel region to open)."""
        threads = torch.get_num_threads()
        if threads == 1:
            self.libm.fesetenv(env)
        else:
            self.gomp.GOMP_parallel(self.fesetenv, ctypes.cast(env, ctypes.c_void_p), threads, 0)

    def flushing(self, env: ctypes.Array) -> ctypes.Array:
        """A copy of ``env`` with the flush bits set, kept for the next call with the same
        environment (every layer backward asks; a few kept, as the status bits may vary)."""
        key = env.raw
        if key not in self._flushing:
            if len(self._flushing) >= 8:
                self._flushing.clear()
            self._flushing[key] = self._with_flush_bits(env)
        return self._flushing[key]

    def _with_flush_bits(self, env: ctypes.Array) -> ctypes.Array:
        out = ctypes.create_string_buffer(env.raw, _ENV_BYTES)
        word = int.from_bytes(out.raw[self.offset : self.offset + 4], "little") | self.bits
        ctypes.memmove(ctypes.addressof(out) + self.offset, word.to_bytes(4, "little"), 4)
        return out


@cache
def _runtime() -> _Runtime | None:
    """The runtime on this machine, or None where flushing in every thread is not possible."""
    layout = _LAYOUT.get(platform.machine())
    libm_name = ctypes.util.find_library("m")
    gomp_path = _loaded("libgomp", prefer=str(Path(torch.__file__).parent))
    if layout is None or libm_name is None or gomp_path is None:
        log.debug(
            "flush-to-zero not available (%s, libm %s, libgomp %s)", platform.machine(), libm_name, gomp_path
        )
        return None
    try:
        return _Runtime(ctypes.CDLL(gomp_path), ctypes.CDLL(libm_name), *layout)
    except (OSError, AttributeError) as exc:
        log.debug("flush-to-zero not available (%s)", exc)
        return None


def _loaded(name: str, prefer: str = "", maps: str | None = None) -> str | None:
    """The path of a shared library this process has loaded whose file name starts with ``name``:
    the first whose path starts with ``prefer``, else the first (``maps``: /proc/self/maps's text).
    PyTorch's wheels bundle their libgomp (in torch/lib, or torch.libs under a hashed name), and
    numba's OpenMP layer may load the system's beside it: torch's is the pool its GEMMs run on."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    paths = [line.split()[-1] for line in maps.splitlines() if len(line.split()) >= 6]
    found = [p for p in paths if Path(p).name.startswith(name) and ".so" in p]
    return next((p for p in found if p.startswith(prefer)), found[0] if found else None)


def available() -> bool:
    """Whether ``flush_denormals`` sets the mode here (else it runs its block unchanged)."""
    return _runtime() is not None


@contextlib.contextmanager
def flush_denormals(device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block with subnormal floats flushed to zero in every thread, then restore the mode.
    A no-op on a GPU, inside another such block, and where ``available()`` is False."""
    runtime = _runtime()
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind != "cpu" or runtime is None or getattr(_state, "active", False):
        yield
        return
    saved = runtime.get()
    _state.active = True
    runtime.set_everywhere(runtime.flushing(saved))
    try:
        yield
    finally:
        runtime.set_everywhere(saved)
        _state.active = False
