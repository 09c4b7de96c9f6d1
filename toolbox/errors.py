"""The suite's errors: each says in one line what is wrong, and every entry point shows that line
and exits non-zero with no partial result files."""

from __future__ import annotations


class SuiteError(Exception):
    """The base of the suite's errors: a message of one line naming the bad value and what is accepted.

    Each subclass also derives from the built-in error ``torch.nn`` or Python would raise for the
    same cause (``ValueError``, ``OSError``, ``RuntimeError``), so callers may catch either.
    """


class DataError(SuiteError, ValueError):
    """Data settings or files that cannot give data, said in one line."""


class WriteError(SuiteError, OSError):
    """A file that could not be written, said in one line that names it."""
