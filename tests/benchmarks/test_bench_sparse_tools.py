"""The sparse-Jacobian and schemes tools' answers: pruned_vgg's refused ratios and levels, the rows
jacobian_table says it sampled, and schemes' one line when a spawned process runs out of memory."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from analysis.schemes.network import build_vgg11
from benchmarks import jacobian_table, pruned_vgg
from bppsa_core import sparse

# A study of seconds, should a refusal be missed.
SMALL = ["--width", "0.05", "--steps", "0", "--ratios", "0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ratios", "abc"], "argument --ratios: 'abc' is not a number; accepted: 0 <= ratio < 1"),
        (["--ratios", "nan"], "argument --ratios: nan is not finite; accepted: 0 <= ratio < 1"),
        (["--ratios", "-0.5"], "argument --ratios: -0.5 is negative; accepted: 0 <= ratio < 1"),
        (["--ratios", "1"], "argument --ratios: 1 is not a pruning ratio; accepted: 0 <= ratio < 1"),
        (["--levels", "two"], "argument --levels: 'two' is not an integer; accepted: 0, 1, 2, ... or all"),
        (["--levels", "-1"], "argument --levels: -1 is negative; accepted: 0, 1, 2, ... or all"),
        (
            ["--levels", "2", "100"],
            "argument --levels: 100 is more than the 4 levels of the full scan over VGG-11's 23 Jacobians; "
            "accepted: 0 to 4 or all",
        ),
        (["--levels", "5", "--width", "0.1"], "argument --levels: 5 is more than the 4 levels"),
    ],
)
def test_pruned_vgg_refuses_ratios_and_levels_with_what_it_accepts(argv, message, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        pruned_vgg.main(["--out", str(out), *SMALL, *argv])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"python -m benchmarks.pruned_vgg: error: {message}"), line
    assert "_ratio" not in line and "_level" not in line  # no function name of the code
    assert not out.exists()


def test_the_full_scans_levels_are_the_most_that_change_the_scan() -> None:
    def products(n: int, levels: int | None) -> list[dict]:
        chain = [sparse.linear_jt(torch.eye(2)) for _ in range(n)]  # quiet CSR
        return sparse.sparse_scan(chain, torch.ones(2), levels=levels)[1].products

    for n in range(30):
        most = pruned_vgg.full_levels(n)
        assert products(n, most) == products(n, None) == products(n, most + 1), n
        if n:
            assert products(n, most - 1) != products(n, None), n
    model = build_vgg11(0.05)  # the levels pruned_vgg accepts count one Jacobian per layer
    assert len(pruned_vgg.jacobian_chain(model, torch.randn(3, 32, 32))) == len(model) == 23


def test_autograd_samples_at_most_the_rows_j_has() -> None:
    per_row, sampled = jacobian_table.autograd_rows_time(torch.relu, torch.randn(2, 3), 10**8, seed=0)
    assert sampled == 6 and per_row > 0
    assert jacobian_table.autograd_rows_time(torch.relu, torch.randn(2, 3), 4, seed=0)[1] == 4


def test_the_command_prints_the_rows_autograd_sampled(monkeypatch, capsys) -> None:
    def sampled(fn, x: torch.Tensor, rows: int, seed: int) -> tuple[float, int]:
        return 1e-4, 7  # as if J had 7 rows: all of them, fewer than asked for

    monkeypatch.setattr(jacobian_table, "autograd_rows_time", sampled)
    assert jacobian_table.main(["--rows", "100000000", "--repeats", "1", "--warmup", "0"]) == 0
    note = "Autograd time: 7 sampled rows (all of J's rows where --rows 100000000 is more), scaled to all "
    note += "rows of J."
    assert capsys.readouterr().out.splitlines()[-1] == note


def _result(layer: str, rows: int) -> dict:
    """A row of ``jacobian_table.table`` with made-up times."""
    return {
        "layer": layer,
        "shape": "1 x 1",
        "sparsity": 0.5,
        "csr_s": 1e-3,
        "autograd_s": 1.0,
        "per_row_s": 1e-4,
        "rows": rows,
        "speedup": 1e3,
    }


@pytest.mark.parametrize(
    ("asked", "sampled", "note"),
    [
        (256, (256, 256, 256), "Autograd time: 256 sampled rows, scaled to all rows of J."),
        (
            10**8,
            (65536, 65536, 16384),
            "Autograd time: sampled rows Conv2d 65536, ReLU 65536, MaxPool2d 16384 "
            "(all of J's rows where --rows 100000000 is more), scaled to all rows of J.",
        ),
        (
            20000,
            (20000, 20000, 16384),
            "Autograd time: sampled rows Conv2d 20000, ReLU 20000, MaxPool2d 16384 "
            "(all of J's rows where --rows 20000 is more), scaled to all rows of J.",
        ),
    ],
)
def test_the_table_says_the_rows_actually_sampled(asked, sampled, note) -> None:
    results = [_result(layer, n) for layer, n in zip(("Conv2d", "ReLU", "MaxPool2d"), sampled, strict=True)]
    assert jacobian_table.format_table(results, asked).splitlines()[-1] == note


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_schemes_out_of_memory_in_a_spawned_process_names_the_cause_and_the_sizes(
    tmp_path, monkeypatch, capsys
) -> None:
    import runpy

    cause = (
        "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 104857600000 bytes."
    )

    def spawn(*args, **kwargs) -> None:  # what torch.multiprocessing.spawn raises when a rank runs out
        trace = 'Traceback (most recent call last):\n  File "schemes.py", line 1, in _pingpong\n'
        raise ProcessRaisedException(
            f"\n\n-- Process 0 terminated with the following error:\n{trace}{cause}\n", 0, 1
        )

    monkeypatch.setattr("torch.multiprocessing.spawn", spawn)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--width", "0.05", "--batch", "2", "--micro-batches", "2", "--split", "1"]
    monkeypatch.setattr(sys, "argv", ["schemes", *argv, "--repeats", "1", "--warmup", "0"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("benchmarks.schemes", run_name="__main__")
    assert exc.value.code == 1
    (line,) = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("[schemes")]
    assert line == (
        f"python -m benchmarks.schemes: error: out of memory: {cause}; "
        "accepted: smaller --pingpong-mb, --batch or --width"
    )
    assert not out.exists()
