"""The captured-step benchmark: what a row measures on the CPU, what it prints, its bad input."""

from __future__ import annotations

import contextlib
import weakref
from types import SimpleNamespace

import pytest
import torch
from helpers import extended_except, walk_warps_seen

from benchmarks import capture
from benchmarks.common import markdown_tables
from benchmarks.scan import MODULES

CPU = torch.device("cpu")


@pytest.mark.parametrize("model", extended_except(list(MODULES), first=1))
def test_a_row_on_the_cpu_times_the_eager_and_naive_backwards(model) -> None:
    row = capture.bench(model, 12, 3, 5, CPU, 0, 2, naive_max_t=12)
    assert all(isinstance(row.cells[k], float) and row.cells[k] > 0 for k in capture.COLUMNS[:3])
    assert all(row.cells[k] == "n/a" for k in capture.COLUMNS[3:])
    for what in ("captured", "captured bwd", "peak MiB"):
        assert row.notes[what] == "needs a CUDA device"


def test_no_eager_loss_outlives_its_backward(monkeypatch) -> None:
    """When the eager rounds end (their medians taken, the captures next) every loss they made is
    gone: a graph kept alive keeps its parameters' gradient accumulators, and a capture's backward
    would wait on the stream that made them."""
    losses, alive = [], []
    loss, median = capture._loss, capture.statistics.median

    def kept(module, x):
        out = loss(module, x)
        losses.append(weakref.ref(out))
        return out

    def checked(values):
        alive.append(sum(ref() is not None for ref in losses))
        return median(values)

    monkeypatch.setattr(capture, "_loss", kept)
    monkeypatch.setattr(capture.statistics, "median", checked)
    capture.bench("rnn", 12, 2, 4, CPU, 0, 2, naive_max_t=0)
    assert len(losses) == 4 and alive == [0, 0]


def test_where_auto_runs_torch_nn_the_row_times_the_graph_scan(monkeypatch) -> None:
    """A module that "auto" leaves to cuDNN is timed with the scan auto would otherwise run (the
    graph strategy), so the table still shows BPPSA there: on the CPU that strategy is refused."""
    from bppsa_core import nn as bnn

    monkeypatch.setattr(bnn, "torch_nn_instead", lambda strategy, *rest: strategy == "auto")
    row = capture.bench("lstm", 12, 3, 5, CPU, 0, 1, naive_max_t=0)
    assert row.cells["BPPSA eager"] == "n/a"
    assert "graph" in row.notes["BPPSA eager"] and "CUDA" in row.notes["BPPSA eager"]
    assert isinstance(row.cells["cuDNN eager"], float)


def test_the_capture_glue_runs_end_to_end_with_cuda_stood_in_for(monkeypatch) -> None:
    """The captured measurements' host code on a CPU: streams, graphs and pools stood in for (a
    "capture" runs its body once, a "replay" nothing), so that what only a GPU runs is still called
    with the arguments it takes. Each warm-up unsets the gradients before its steps and after them."""
    steps = []

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            steps.append("replay")

    @contextlib.contextmanager
    def context(*args, **kwargs):
        yield

    for name, value in {
        "Stream": Stream, "current_stream": Stream, "stream": context, "CUDAGraph": Graph, "graph": context,
        "graph_pool_handle": lambda: None,
    }.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    loss = capture._loss
    module = torch.nn.RNN(1, 5)

    def counted(m, x):  # a step, and whether it started from unset gradients
        steps.append("step" if all(p.grad is None for p in module.parameters()) else "step on grads")
        return loss(m, x)

    monkeypatch.setattr(capture, "_loss", counted)
    x = torch.randn(4, 2, 1)
    assert capture.captured_step_ms(module, x, 0, 2) >= 0
    assert steps == ["step"] * 4 + ["replay"] * 3  # 3 warm-up steps, the capture, 1 + 2 replays
    steps.clear()
    assert capture.captured_backward_ms(module, x, 1, 1) >= 0
    assert steps == ["step"] * 4 + ["replay"] * 4  # the forward's and the backward's, twice each


def test_the_naive_loop_gives_the_modules_gradients() -> None:
    """The baseline computes what the modules do: a loop of cells with their weights."""
    for model, ref_cls in MODULES.items():
        torch.manual_seed(0)
        ref = ref_cls(1, 4).double()
        cell = capture._cell_from(ref)
        x = torch.randn(7, 3, 1, dtype=torch.float64)
        expected = torch.autograd.grad(capture._loss(ref, x), list(ref.parameters()))
        got = torch.autograd.grad(capture._naive(cell, x, 4), list(cell.parameters()))
        for a, b in zip(expected, got, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), model


def test_the_chunk_given_is_the_bppsa_modules(monkeypatch) -> None:
    made = []
    real = capture.module_pair

    def pair(*args, **options):
        ref, ours = real(*args, **options)
        made.append(ours)
        return ref, ours

    monkeypatch.setattr(capture, "module_pair", pair)
    assert capture.parse_args(["--chunk", "3"]).chunk == 3 and capture.parse_args([]).chunk is None
    capture.bench("rnn", 12, 2, 4, CPU, 0, 1, naive_max_t=0, chunk=3)
    capture.bench("rnn", 12, 2, 4, CPU, 0, 1, naive_max_t=0)
    assert [m.chunk for m in made] == [3, None]


def test_a_length_past_the_naive_limit_says_so() -> None:
    row = capture.bench("rnn", 12, 2, 4, CPU, 0, 1, naive_max_t=5)
    assert "naive eager" not in row.cells and "T <= 5" in row.notes["naive eager"]


@pytest.mark.extended
def test_the_run_prints_a_table_per_model_and_the_reasons(capsys) -> None:
    argv = ["--models", "rnn", "gru", "--T", "8", "--H", "4", "6", "--B", "2"]
    argv += ["--repeats", "1", "--warmup", "0"]
    assert capture.main(argv) == 0
    out = capsys.readouterr().out
    titles = [line[4:] for line in out.splitlines() if line.startswith("### ")]
    assert titles == ["RNN", "GRU"]
    tables = markdown_tables(out)
    for head, rows in tables:
        assert head[:5] == ["model", "T", "B", "H", "torch.nn eager ms"] and "naive / BPPSA eager" in head
        assert "torch.nn captured bwd ms" in head and "torch.nn / BPPSA captured bwd" in head
        assert all(len(r) == len(head) for r in rows)
        assert [(r[1], r[3]) for r in rows] == [("8", "4"), ("8", "6")]
    assert "- captured: needs a CUDA device" in out and "- captured bwd: needs a CUDA device" in out


def test_each_matmul_precision_given_makes_a_row_of_its_own_named_in_a_column(capsys) -> None:
    argv = ["--models", "rnn", "--T", "8", "--H", "4", "--B", "2", "--repeats", "1", "--warmup", "0"]
    assert capture.main([*argv, "--matmul-precision", "highest", "high"]) == 0
    (head, rows), *_ = markdown_tables(capsys.readouterr().out)
    assert head[:6] == ["model", "T", "B", "H", "matmul precision", "torch.nn eager ms"]
    assert [r[4] for r in rows] == ["highest", "high"]  # as each row was measured
    assert torch.get_float32_matmul_precision() == "highest"  # restored
    assert capture.main(argv) == 0  # PyTorch's default alone: no such column
    assert "matmul precision" not in markdown_tables(capsys.readouterr().out)[0][0]


def test_each_walk_warps_given_makes_a_row_of_its_own_with_the_kernels_walks_set(monkeypatch, capsys) -> None:
    from bppsa_core.triton import launch

    seen = walk_warps_seen(monkeypatch, capture)
    argv = ["--models", "rnn", "--T", "8", "--H", "4", "--B", "2", "--repeats", "1", "--warmup", "0"]
    assert capture.main([*argv, "--walk-warps", "auto", "1", "2"]) == 0
    (head, rows), *_ = markdown_tables(capsys.readouterr().out)
    assert head[:6] == ["model", "T", "B", "H", "walk warps", "torch.nn eager ms"]
    assert [r[4] for r in rows] == ["auto", "1", "2"] and seen == [None, 1, 2]
    assert launch.walk_warps_set() is None  # restored


def _event(name: str, us: float, device: str = "cuda") -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_kernel_times_are_per_backward_by_kernel_the_busiest_first() -> None:
    cudnn = "void cudnn::rnn::RNN_blockPersist_bp_ht<float, float, float>(cudnn::rnn::RNN_bp_params)"
    events = [_event("_spine", 4.0), _event(cudnn, 30.0), _event("aten::mm", 99.0, "cpu")]
    events += [_event("_spine", 6.0), _event(cudnn, 10.0), _event("Memset (Device)", 1.0)]
    times = capture.kernel_times(events, rounds=2)
    busiest = "cudnn::rnn::RNN_blockPersist_bp_ht<float, float, float>"
    assert times == {busiest: (1, 20), "_spine": (1, 5), "Memset (Device)": (0.5, 0.5)}
    assert list(times) == [busiest, "_spine", "Memset (Device)"]


def test_a_kernel_name_loses_its_return_type_and_parameters_and_keeps_its_template() -> None:
    gemm = "void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>(cutlass_80_simt::Params)"
    assert capture.kernel_name(gemm) == "cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>"
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    fill += "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
    short = capture.kernel_name(fill)
    assert len(short) == capture.NAME_CHARS and short.endswith("…") and "FillFunctor" in short
    assert capture.kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
    assert capture.kernel_name("_spine") == "_spine"


def test_the_kernel_table_lists_the_busiest_then_the_others_and_all() -> None:
    row = capture.Row("rnn", 1000, 16, 20)
    row.kernels["BPPSA"] = {f"k{i}": (1.0, 10.0 - i) for i in range(capture.KERNEL_ROWS + 2)}
    head, rows = markdown_tables(capture.format_kernels([row]))[0]
    assert head == ["T", "H", "side", "kernel", "launches", "µs", "share"]
    assert [r[3] for r in rows] == [*(f"`k{i}`" for i in range(capture.KERNEL_ROWS)), "2 others", "all"]
    assert rows[-2][4:] == ["2", "3", "5%"] and rows[-1][4:] == ["10", "55", "100%"]
    assert rows[0][:3] == ["1000", "20", "BPPSA"] and rows[0][5:] == ["10", "18%"]
    assert capture.format_kernels([capture.Row("rnn", 10, 2, 4)]) == ""


def test_kernels_on_the_cpu_are_a_note_and_leave_no_gradient() -> None:
    row = capture.bench("rnn", 12, 2, 4, CPU, 0, 1, naive_max_t=0, kernels=True)
    assert row.kernels == {} and row.notes["kernels"] == "needs a CUDA device"
    module = capture.module_pair("rnn", 1, 4, CPU)[1]
    assert capture.backward_kernels(module, torch.ones(5, 2, 1)) == {}  # no GPU events on a CPU
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.gpu
def test_a_gpu_backward_is_listed_by_its_kernels() -> None:
    """BPPSA's layer backward at T = 1,000 is the chunked scan's three Triton kernels among others;
    cuDNN's is its own kernels: each side's table names them, with their time."""
    row = capture.bench("rnn", 1000, 16, 20, torch.device("cuda"), 1, 1, naive_max_t=0, kernels=True)
    assert {"_reduce", "_spine", "_expand"} <= set(row.kernels["BPPSA"]), row.kernels["BPPSA"]
    assert not {"_reduce", "_spine", "_expand"} & set(row.kernels["cuDNN"]), row.kernels["cuDNN"]
    for kernels in row.kernels.values():
        assert all(n > 0 and us > 0 for n, us in kernels.values()), kernels


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--H", "0"], "argument --H: 0 is not positive; accepted: positive integers"),
        (["--models", "transformer"], "argument --models: invalid choice: 'transformer'"),
        (["--naive-max-T", "-1"], "argument --naive-max-T: -1 is negative"),
        (["--capture-error-mode", "local"], "argument --capture-error-mode: invalid choice: 'local'"),
        (["--chunk", "0"], "argument --chunk: 0 is not positive; accepted: positive integers"),
        (["--walk-warps", "3"], "--walk-warps: invalid choice: '3' (choose from 'auto', '1', '2', '4')"),
    ],
)
def test_bad_arguments_end_it_in_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        capture.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
