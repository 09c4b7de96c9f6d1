"""Helpers every layer of the suite shares: atomic file writes, the positive-integer check, and the
errors that say in one line what is wrong with the data or with a file.

They sit here, in the suite's lowest layer, so that the datasets, the experiments and the analysis
all use the same ones without an import pointing upward. (``bppsa_core`` is a library of its own
and keeps its own checks, ``bppsa_core.dispatch``.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Data settings or files that cannot give data, said in one line."""


class WriteError(OSError):
    """A file that could not be written, said in one line that names it."""


def is_count(value: Any, minimum: int = 1) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``minimum``: 1 for a positive count."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def require_count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if ``is_count``; else ValueError naming ``name``, the value and what is accepted."""
    if not is_count(value, minimum):
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise DataError(f"{name} must be {what}, got {value!r}")
    return value


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp_path)``, then rename the temporary file onto ``path``.

    A killed writer leaves the previous complete file (or none), never half of one; the temporary
    name (``.<name>.<pid>.tmp`` beside ``path``) is removed when ``write`` fails. Any failure (a
    missing permission, a full disk, which torch.save reports as a bare ``iostream error``) is raised
    as WriteError naming ``path``.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except Exception as exc:
        raise WriteError(f"cannot write {path}: {_why(exc, path)}") from exc
    finally:
        with contextlib.suppress(OSError):  # e.g. its folder could not be made
            tmp.unlink(missing_ok=True)


def _why(exc: Exception, path: Path) -> str:
    """The reason of a failed write, with the free space left where it was written."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0]
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
        reason += f" ({free} bytes free there)"
    return reason
