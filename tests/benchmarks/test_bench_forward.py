"""The forward benchmark: what a row measures, one smoke test of what it prints, its bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import walk_warps_seen

from benchmarks import forward
from benchmarks.common import markdown_tables
from benchmarks.forward import bench, parse_args, trained_state

CPU = torch.device("cpu")


@pytest.mark.extended  # the solvers' own convergence is the default set's (tests/core/test_newton.py)
def test_a_row_times_every_solver_against_the_native_forward() -> None:
    torch.manual_seed(0)
    weights = torch.nn.GRU(24, 6).state_dict()
    row = bench("gru", weights, "init", 40, 3, 6, CPU, torch.float64, forward.NEWTON, 0, 1, 100)
    assert row.native_ms > 0 and set(row.solver_ms) == set(forward.NEWTON)
    assert all(row.converged.values()) and all(1 <= n <= 41 for n in row.iterations.values())
    assert max(row.max_diff.values()) < 1e-10  # float64: the converged states are the native ones


def test_a_row_marks_a_fallback() -> None:
    torch.manual_seed(0)
    weights = torch.nn.RNN(1, 6).state_dict()
    row = bench("rnn", weights, "init", 50, 2, 6, CPU, torch.float64, ["quasi-newton"], 0, 1, 2)
    assert row.iterations == {"quasi-newton": 2} and row.converged == {"quasi-newton": False}
    assert row.max_diff["quasi-newton"] == 0.0  # the native forward ran instead
    assert "2 (fallback)" in forward.format_table([row], ["quasi-newton"])


def test_training_lowers_the_loss() -> None:
    _, first, last = trained_state("rnn", 1, 20, 16, 100, CPU)
    assert last < first


def test_a_compiled_row_times_torch_nn_against_the_compiled_forward() -> None:
    row = forward.bench_compiled("gru", 24, 40, 3, 6, torch.float64, 0, 1)
    assert min(row.torch_ms, row.fused_ms, row.compiled_ms) > 0 and row.auto == "compiled"
    assert row.max_diff < 1e-12
    # an LSTM's training forward at H = 32 runs compiled, keeping its gates; its inference on one thread not
    assert forward.bench_compiled("lstm", 24, 5, 2, 32, torch.float64, 0, 1).auto == "compiled"
    assert forward.bench_compiled("lstm", 24, 5, 2, 32, torch.float64, 0, 1, grad=False).auto == "PyTorch's"
    # a GRU wider than its compiled forward (so keeping no tape) is torch.nn's
    assert forward.bench_compiled("gru", 24, 3, 2, 513, torch.float32, 0, 1).auto == "torch.nn"


def test_input_features_make_a_table_each_and_the_other_projection_a_column(capsys, monkeypatch) -> None:
    """--F: a table per input width; --other-projection: where the compiled forward projects the
    inputs (in its steps up to the bound, on the host past it) and its time with the other."""
    from bppsa_core import numba_forward

    monkeypatch.setattr(numba_forward, "PROJECT_IN_STEP_MAX_BYTES", 5 * 100 * 4)  # F = 100 at H = 5, float32
    argv = ["--tables", "compiled", "--models", "rnn", "--F", "100", "101", "--T", "7", "--H", "5"]
    assert forward.main([*argv, "--B", "2", "--repeats", "1", "--warmup", "0", "--other-projection"]) == 0
    assert numba_forward.PROJECT_IN_STEP_MAX_BYTES == 5 * 100 * 4  # restored
    out = capsys.readouterr().out
    titles = [line[4:] for line in out.splitlines() if line.startswith("### ")]
    assert titles == ["Compiled forward: RNN (F = 100)", "Compiled forward: RNN (F = 101)"]
    tables = markdown_tables(out)
    for (head, rows), projected in zip(tables, ("step", "host"), strict=True):
        assert head[-3:] == ["projected", "other side ms", "compiled / other side"]
        assert rows[0][-3] == projected and float(rows[0][-2]) > 0
        assert float(rows[0][head.index("max diff")]) <= 1e-5


def test_each_matmul_precision_given_makes_a_newton_row_of_its_own(capsys) -> None:
    argv = ["--tables", "newton", "--models", "rnn", "--weights", "init", "--T", "12", "--B", "2"]
    argv += ["--H", "3", "--solvers", "newton", "--repeats", "1", "--warmup", "0"]
    assert forward.main([*argv, "--matmul-precision", "highest", "high"]) == 0
    (head, rows), *_ = markdown_tables(capsys.readouterr().out)
    assert head[6:8] == ["matmul precision", "native ms"] and [r[6] for r in rows] == ["highest", "high"]
    assert torch.get_float32_matmul_precision() == "highest"  # restored


def test_each_walk_warps_given_makes_a_newton_row_of_its_own_with_the_walks_set(monkeypatch, capsys) -> None:
    from bppsa_core.triton import launch

    seen = walk_warps_seen(monkeypatch, forward)
    argv = ["--tables", "newton", "--models", "rnn", "--weights", "init", "--T", "12", "--B", "2"]
    argv += ["--H", "3", "--solvers", "newton", "--repeats", "1", "--warmup", "0"]
    assert forward.main([*argv, "--matmul-precision", "highest", "high", "--walk-warps", "auto", "1"]) == 0
    (head, rows), *_ = markdown_tables(capsys.readouterr().out)
    assert head[6:9] == ["matmul precision", "walk warps", "native ms"]
    assert [r[6:8] for r in rows] == [["highest", "auto"], ["highest", "1"], ["high", "auto"], ["high", "1"]]
    assert seen == [None, 1, None, 1] and launch.walk_warps_set() is None  # restored


def test_sweeps_add_each_solver_from_picard_sweeps_as_a_method_of_its_own(capsys) -> None:
    argv = ["--tables", "newton", "--models", "rnn", "--weights", "init", "--T", "40", "--B", "2"]
    assert forward.main([*argv, "--H", "6", "--solvers", "newton", "--repeats", "1", "--sweeps"]) == 0
    (head, rows), *_ = markdown_tables(capsys.readouterr().out)
    assert head[head.index("newton its") :: 4] == ["newton its", "newton + sweeps its"]
    its = rows[0][head.index("newton + sweeps its")]
    sweeps, iterations = (int(n) for n in its.split(" + "))  # "S + N": sweeps, then iterations
    assert sweeps >= 2 and iterations >= 1 and float(rows[0][head.index("newton + sweeps max diff")]) < 1e-5


def test_the_quick_run_prints_a_table_per_model(capsys) -> None:
    assert forward.main(["--quick", "--repeats", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device: cpu")
    titles = [line[4:] for line in out.splitlines() if line.startswith("### ")]
    assert titles == [
        "Compiled forward: RNN (F = 1)",
        "Compiled forward: GRU (F = 24)",
        "Forward: RNN (F = 1, B = 4, H = 8)",
        "Forward: GRU (F = 24, B = 4, H = 8)",
    ]
    tables = markdown_tables(out)
    for head, rows in tables[:2]:
        assert head[:4] == ["model", "T", "B", "H"] and "compiled / torch.nn" in head
        assert [(r[1], r[3], r[9]) for r in rows] == [("30", "8", "compiled"), ("300", "8", "compiled")]
        assert max(float(r[-1]) for r in rows) <= 1e-5
    for head, rows in tables[2:]:
        assert head[:7] == ["model", "weights", "T", "B", "H", "F", "native ms"]
        assert "newton / native" in head and "quasi-newton its" in head
        assert [(r[1], r[2]) for r in rows] == [
            ("init", "30"),
            ("init", "300"),
            ("trained", "30"),
            ("trained", "300"),
        ]
        diffs = [float(r[i]) for r in rows for i, h in enumerate(head) if h.endswith("max diff")]
        assert max(diffs) <= 1e-5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--T", "0"], "argument --T: 0 is not positive; accepted: positive integers"),
        (["--models", "cnn"], "argument --models: invalid choice: 'cnn'"),
        (["--tables", "scan"], "argument --tables: invalid choice: 'scan'"),
        (["--solvers", "native"], "argument --solvers: invalid choice: 'native'"),
        (["--weights", "random"], "argument --weights: invalid choice: 'random'"),
        (["--max-iters", "0"], "argument --max-iters: 0 is not positive"),
        (["--F", "0"], "argument --F: 0 is not positive"),
        (["--train-steps", "0"], "argument --train-steps: 0 is not positive"),
        (["--device", "tpu"], "argument --device: unknown device 'tpu'; accepted: auto, cpu, cuda, cuda:N"),
    ],
)
def test_bad_input_exits_with_one_clear_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m benchmarks.forward: error: ") and message in last


def test_without_numba_a_cpu_run_leaves_the_compiled_table_out_and_refuses_it_by_name(
    monkeypatch, capsys
) -> None:
    monkeypatch.setattr(forward.dispatch, "numba_installed", lambda: False)
    args = parse_args([])
    assert (
        args.tables == ["newton"]
        and args.left_out == "the compiled table, which needs the numba package (pip install numba)"
    )
    assert parse_args(["--tables", "newton"]).left_out is None
    with pytest.raises(SystemExit) as exc:
        parse_args(["--tables", "compiled"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        "python -m benchmarks.forward: error: --tables compiled needs the numba package (pip install numba), "
        "which is not installed; accepted here: newton"
    )


def test_the_other_projection_moves_the_inputs_projection_across_its_bound(monkeypatch) -> None:
    """Inputs projected in the steps go to the host (one GEMM a call here) and the reverse."""
    gemms, addmm = [], torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: gemms.append(1) or addmm(*a, **k))
    module, x = forward.MODELS["rnn"][0](3, 5, strategy="numba"), torch.randn(4, 2, 3)
    with torch.no_grad():
        for projection, host_gemms in (("step", 1), ("host", 0)):
            gemms.clear()
            forward.OtherProjection(module, projection)(x)
            assert len(gemms) == host_gemms
        gemms.clear()
        module(x)
    assert not gemms  # the bound is back: 3 inputs go in the steps
