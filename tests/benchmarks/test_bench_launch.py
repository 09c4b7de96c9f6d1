"""The launch benchmark: its table from a run without a GPU, and its refusals in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT

pytest.importorskip("triton")

from benchmarks import launch
from benchmarks.common import markdown_tables


def test_a_run_without_a_gpu_records_each_models_launches_and_prints_a_row(tmp_path) -> None:
    """Kernels compiled for sm_90 in a child process (no ``TRITON_INTERPRET``), every launch recorded:
    a row per model and length, with the launches a layer backward (or a Newton iteration) makes and a
    time in each column."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path)}
    argv = ["--models", "rnn", "newton", "--T", "50", "--repeats", "3", "--warmup", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.launch", *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("device: cpu") and "compiled for sm_90, each launch recorded" in done.stdout
    ((head, rows),) = markdown_tables(done.stdout)
    assert head[:6] == ["model", "T", "launches", "Triton path µs", "direct µs", "no launches µs"]
    assert [(r[0], r[1], r[2]) for r in rows] == [("rnn", "50", "3"), ("newton", "50", "6")]
    assert all(float(cell) > 0 for r in rows for cell in r[3:6])


def test_the_interpreter_is_refused_in_one_line(capsys) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest's, where there is no GPU
    assert launch.main(["--models", "rnn"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "python -m benchmarks.launch: error: the kernels were loaded for Triton's interpreter "
        "(TRITON_INTERPRET is set); run without it"
    )
    interpreted = r"loaded for Triton's interpreter \(TRITON_INTERPRET is set\)"
    with pytest.raises(RuntimeError, match=interpreted), launch.recording():
        pass


@pytest.mark.parametrize(("argv", "message"), [(["--T", "0"], "--T"), (["--models", "cnn"], "--models")])
def test_a_bad_argument_is_refused_in_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        launch.parse_args(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line
