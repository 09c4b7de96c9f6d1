"""Helpers every layer of the suite shares: atomic file writes, the positive-integer check, the
errors that say in one line what is wrong with the data or with a file, and the command-line parser
whose refusals are one line, with the types of its output paths.

They sit here, in the suite's lowest layer, so that the datasets, the experiments and the analysis
all use the same ones without an import pointing upward. (``bppsa_core`` is a library of its own
and keeps its own checks, ``bppsa_core.dispatch``.)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn


class DataError(ValueError):
    """Data settings or files that cannot give data, said in one line."""


class WriteError(OSError):
    """A file that could not be written, said in one line that names it."""


def is_count(value: Any, minimum: int = 1) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``minimum``: 1 for a positive count."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# Seeds feed torch's and NumPy's generators (NumPy's take 32 bits): run.py's and the tools' alike.
SEEDS = "an integer from 0 to 2^32 - 1"


def is_seed(value: Any) -> bool:
    """Whether ``value`` is a seed every generator of the suite takes (``SEEDS``)."""
    return is_count(value, 0) and value < 2**32


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
    blocker = _file_above(path)
    if blocker is not None:  # mkdir's "File exists" names neither the file nor the cause
        return f"{blocker} is a file, not a folder"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0]
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
        reason += f" ({free} bytes free there)"
    return reason


def bounded(kind: type, accepted: str, positive: bool = True) -> Callable[[str], Any]:
    """argparse type of a finite ``kind`` (int or float) above 0 (``positive``) or at least 0; a
    refusal names the text and ``accepted``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; accepted: {accepted}") from None
        if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
            what = "not finite" if not math.isfinite(value) else "not positive" if positive else "negative"
            raise argparse.ArgumentTypeError(f"{text} is {what}; accepted: {accepted}")
        return value

    return parse


positive_int = bounded(int, "positive integers")
non_negative_int = bounded(int, "non-negative integers", positive=False)
positive_float = bounded(float, "a positive number")
non_negative_float = bounded(float, "a number >= 0", positive=False)


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where it has none (None: the help says how it
    is resolved) or the help already gives it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with one line for a refusal, ``<prog>: error: <what>``, and exit status 2
    (argparse prints its usage block first; ``--help`` still shows it), and each option's default in
    ``--help`` (``DefaultsHelp``)."""

    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] = DefaultsHelp, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


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
