"""What the suite's commands take: counts, seeds and cores, the bounded number types, the parser
whose refusals are one line, and SIGTERM taken as Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from toolbox.errors import DataError


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


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM and most schedulers send first), taken as Ctrl-C is: a command stops
    after keeping what it finished."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` in the main thread, so whatever handles Ctrl-C
    (recording a run's finished epochs, stopping a child process) handles it too; elsewhere (a
    thread, a platform without signals) the block runs unchanged. The previous handler comes back
    after."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
