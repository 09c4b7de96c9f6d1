"""Helpers every layer of the suite shares: atomic file writes and the positive-integer check.

They sit here, in the suite's lowest layer, so that the datasets, the experiments and the analysis
all use the same ones without an import pointing upward. (``bppsa_core`` is a library of its own
and keeps its own checks, ``bppsa_core.dispatch``.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def is_count(value: Any, minimum: int = 1) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``minimum``: 1 for a positive count."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def require_count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if ``is_count``; else ValueError naming ``name``, the value and what is accepted."""
    if not is_count(value, minimum):
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp_path)``, then rename the temporary file onto ``path``.

    A killed writer leaves the previous complete file (or none), never half of one; the temporary
    name (``.<name>.<pid>.tmp`` beside ``path``) is removed when ``write`` fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
