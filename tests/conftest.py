"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import settings

# Triton kernels run in Triton's interpreter where there is no GPU (CI): set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of b from the reference a."""
    return ((a - b).norm() / a.norm().clamp_min(1e-300)).item()


# Peak-memory probes for child processes. getrusage's ru_maxrss is no use there: Linux carries
# the parent's high-water mark across fork and exec, so a child of a large pytest process starts
# with pytest's. /proc/self/status's VmHWM belongs to the child's own address space, and writing 5
# to /proc/self/clear_refs resets it to the current resident set.
MEMORY_PROBES = """
import re
def rss_bytes():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
def peak_bytes():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
"""


def run_child(code: str, *args: str) -> str:
    """Run ``MEMORY_PROBES + code`` in a fresh interpreter at the repository root; its stdout.

    malloc there returns every block of 64 KiB or more to the system when freed
    (MALLOC_MMAP_THRESHOLD_), so the resident set follows the live tensors.
    """
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBES + code, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env=env,
    )
    return done.stdout.strip()
