"""The resident memory of this process, and its peak since a reset, from Linux's /proc.

getrusage's ru_maxrss is no use for a measurement that starts after other work: it is the
high-water mark since the process began (and Linux carries a parent's across fork and exec).
/proc/self/status's VmHWM belongs to this address space, and writing 5 to /proc/self/clear_refs
resets it to the current resident set. Run with ``MALLOC_MMAP_THRESHOLD_=65536`` in the
environment (``MALLOC``) so that malloc returns every block of 64 KiB or more to the system when
freed: the resident set then follows the live tensors instead of keeping their space for reuse.
Small blocks still come from malloc's heap, and a heap that many small tensors have fragmented
(autograd's graph of a long sequence) can later hold large ones without the resident set growing:
``reset_peak`` first hands every free page of the heap back (glibc's ``malloc_trim``), and the
memory ``bppsa_core`` keeps for its next tapes (``bppsa_core.release_tapes``), so that a measured
step counts its tapes as a first step does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re

from bppsa_core import release_tapes

MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def rss_bytes() -> int:
    """The resident set now."""
    return _status("VmRSS")


def peak_bytes() -> int:
    """The resident set's high-water mark since the last ``reset_peak``."""
    return _status("VmHWM")


def _trim() -> None:
    """Return the free pages of malloc's heaps to the system, where the C library can (glibc)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def reset_peak() -> bool:
    """Reset the high-water mark to the resident set now, with the kept tapes' free memory and
    malloc's free pages given back first; False where the system does not allow it."""
    release_tapes()
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
