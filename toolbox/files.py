"""Atomic writes and the output paths the suite's commands take: a killed writer leaves the
previous complete file (or none), and an output that cannot be written is refused before any work."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolbox.errors import WriteError


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
    blocker = _file_above(path)
    if blocker is not None:  # mkdir's "File exists" names neither the file nor the cause
        return f"{blocker} is a file, not a folder"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0]
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
        reason += f" ({free} bytes free there)"
    return reason


def _file_above(path: Path) -> Path | None:
    """The first of ``path``'s parent folders that exists as something other than a folder."""
    return next((p for p in path.parents if p.exists() and not p.is_dir()), None)


def nearest_folder(path: Path) -> Path:
    """``path`` if it is a folder, else the nearest folder above it: where it would be made."""
    return next((p for p in (path, *path.parents) if p.is_dir()), Path("."))


def _unwritable(path: Path) -> Path | None:
    """The folder where ``path`` would be made or written, if this process may not write in it."""
    folder = nearest_folder(path)
    return None if os.access(folder, os.W_OK | os.X_OK) else folder


def _output_path(text: str, accepted: str) -> Path:
    """What output folders and files share: a path that is not empty and can be written."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"an empty path; accepted: {accepted}")
    path = Path(text)
    denied = _unwritable(path)
    if denied is not None:
        raise argparse.ArgumentTypeError(
            f"cannot write in {denied} (permission denied); accepted: {accepted}"
        )
    return path


def output_folder(text: str) -> Path:
    """argparse type of an output folder, made if missing: refused before any work when it is empty,
    cannot be written, or it or a folder above it is a file."""
    path = _output_path(text, "a folder (made if missing)")
    blocker = path if path.exists() and not path.is_dir() else _file_above(path)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{blocker} is a file; accepted: a folder (made if missing)")
    return path


def output_file(text: str) -> Path:
    """argparse type of an output file, its folder made if missing: refused before any work when it
    is empty, cannot be written, is a folder, or a folder above it is a file."""
    path = _output_path(text, "a file name")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; accepted: a file name")
    blocker = _file_above(path)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{blocker} is a file; accepted: a path whose folders are folders")
    return path
