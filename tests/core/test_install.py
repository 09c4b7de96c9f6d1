"""`pip install .` gives the library alone, importable and working from outside the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


def readme_module_snippet() -> str:
    """The README's first Python example: the drop-in modules."""
    return re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


@pytest.mark.extended
def test_pip_install_gives_the_library_and_the_readme_example_runs_outside_the_tree(tmp_path: Path) -> None:
    # Built without isolation (no download), so with this environment's setuptools: from 70.1 on it
    # builds a wheel without the separate wheel package (Python 3.11's venv ships 65.5).
    pytest.importorskip("setuptools", minversion="70.1")
    source, target = tmp_path / "source", tmp_path / "site"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "bppsa_core", source / "bppsa_core", ignore=shutil.ignore_patterns("__pycache__"))
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*install, "--target", str(target), str(source)], check=True, capture_output=True)
    assert (target / "bppsa_core" / "scan.py").is_file()
    assert (target / "bppsa_core" / "triton" / "chunk_scan.py").is_file()  # the subpackage too
    assert not any((target / name).exists() for name in ("experiments", "datasets", "analysis", "tests"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}

    def outside(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )

    run = outside("import bppsa_core; print(bppsa_core.__file__); import experiments")
    assert run.stdout.startswith(str(target / "bppsa_core"))  # the installed copy, not the checkout
    assert "No module named 'experiments'" in run.stderr  # the suite is not part of the library
    run = outside(readme_module_snippet() + "print(rnn.weight_hh_l0.grad.shape)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "torch.Size([20, 20])"


def test_what_the_tools_write_by_default_is_not_tracked() -> None:
    ignored = (ROOT / ".gitignore").read_text().split()
    for folder in ("outputs/", "multirun/", "figures/", "report/", "results/"):
        assert folder in ignored, folder
