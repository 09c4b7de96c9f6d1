"""toolbox: every error the suite raises for bad input derives from one base, SuiteError, and from
the built-in error Python or torch.nn raises for the same cause."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from toolbox.errors import SuiteError

PACKAGES = ("toolbox", "datasets", "experiments", "analysis", "benchmarks")


def suite_errors() -> list[type]:
    """Every exception class defined in the suite's packages (not the library's), but the base."""
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            module = importlib.import_module(info.name)
            found += [
                cls
                for _, cls in inspect.getmembers(module, inspect.isclass)
                if issubclass(cls, Exception) and cls is not SuiteError and cls.__module__ == module.__name__
            ]
    return found


ERRORS = suite_errors()


def test_the_suite_defines_errors() -> None:
    assert {"DataError", "WriteError", "ConfigError", "AnalysisError"} <= {e.__name__ for e in ERRORS}


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: f"{e.__module__}.{e.__name__}")
def test_every_error_has_the_one_base_and_a_builtin_one(error: type) -> None:
    assert issubclass(error, SuiteError)
    assert any(issubclass(error, b) for b in (ValueError, OSError, RuntimeError))
