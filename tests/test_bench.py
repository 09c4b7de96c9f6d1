"""The backward benchmark CLI: its tables, the issue's suite, and its answers to bad input."""

from __future__ import annotations

import contextlib
import sys

import pytest

from experiments import bench_backward


def table(out: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The header and data rows of the first Markdown table whose header starts with ``first_header``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return head, rows


def column(head: list[str], rows: list[list[str]], name: str) -> list[str]:
    return [r[head.index(name)] for r in rows]


def tables(out: str, first_header: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every table whose header starts with ``first_header``, in order."""
    found, rest = [], out
    while f"| {first_header} |" in rest:
        rest = rest[rest.index(f"| {first_header} |") :]
        head, rows = table(rest, first_header)
        found.append((head, rows))
        rest = rest[len(rest.splitlines()[0]) :]
    return found


@pytest.fixture
def no_jax(monkeypatch):
    """jax made unimportable, whether or not it is installed."""
    monkeypatch.setitem(sys.modules, "jax", None)


@pytest.fixture
def triton_refused(monkeypatch):
    """strategy="triton" refusing the CPU: TRITON_INTERPRET unset. The kernels are imported first,
    under the interpreter: triton.jit decides at import, and later tests need interpreted kernels."""
    with contextlib.suppress(ImportError):
        import bppsa_core.triton_scan  # noqa: F401
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_prints_a_table_with_a_row_per_length(capsys) -> None:
    code = bench_backward.main(
        [
            "--model",
            "gru",
            "--T",
            "5",
            "9",
            "--B",
            "2",
            "--H",
            "3",
            "--F",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "0",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| gru")]
    assert [line.split("|")[2].strip() for line in lines] == ["5", "9"]
    header = next(line for line in out.splitlines() if line.startswith("| model"))
    assert "chunked / BPTT" in header and "blelloch / BPTT" in header
    assert out.startswith("device: cpu")
    diffs = [float(line.split("|")[-2]) for line in lines]
    assert max(diffs) < 1e-4  # the timed code computes autograd's gradients


def test_backward_table_has_positive_floors_and_a_best_speedup(capsys) -> None:
    argv = ["--T", "8", "33", "--B", "2", "--H", "4", "--repeats", "1", "--warmup", "0"]
    assert bench_backward.main(argv) == 0
    head, rows = table(capsys.readouterr().out, "model")
    assert len(rows) == 2
    for name in ("floor bytes ms", "floor levels ms", "best / floor", "BPTT / best"):
        assert all(float(v) > 0 for v in column(head, rows, name)), name
    assert all(v.split()[0] in ("chunked", "blelloch") for v in column(head, rows, "best BPPSA"))
    # 2·ceil(log2 T) levels: T = 33 has 12, T = 8 has 6, at the same launch cost
    levels = [float(v) for v in column(head, rows, "floor levels ms")]
    assert levels[1] == pytest.approx(2 * levels[0], rel=0.01)


def test_a_strategy_that_cannot_run_here_prints_na_cells_and_a_note(capsys, triton_refused, no_jax) -> None:
    argv = ["--T", "20", "--B", "2", "--H", "3", "--repeats", "1", "--warmup", "0"]
    argv += ["--strategies", "chunked", "triton", "--tables", "backward", "scan", "--peers"]
    assert bench_backward.main(argv) == 0
    out = capsys.readouterr().out
    (bwd_head, bwd_rows), (scan_head, scan_rows) = tables(out, "model")
    assert column(bwd_head, bwd_rows, "triton ms") == ["n/a"]
    assert column(bwd_head, bwd_rows, "triton / BPTT") == ["n/a"]
    assert float(column(bwd_head, bwd_rows, "chunked ms")[0]) > 0
    assert column(bwd_head, bwd_rows, "best BPPSA")[0].startswith("chunked")
    assert column(scan_head, scan_rows, "triton ms") == ["n/a"]
    assert float(column(scan_head, scan_rows, "chunked ms")[0]) > 0
    notes = [line for line in out.splitlines() if line.startswith("- triton: ")]
    assert len(notes) == 2 and all("triton" in n for n in notes)


def test_scan_table_methods_agree_with_the_sequential_twin(capsys, no_jax) -> None:
    argv = ["--tables", "scan", "--T", "12", "40", "--B", "3", "--H", "4", "--repeats", "1", "--warmup", "0"]
    assert bench_backward.main(argv) == 0
    out = capsys.readouterr().out
    head, rows = table(out, "model")
    assert [r[1] for r in rows] == ["12", "40"]
    assert all(float(v) < 1e-5 for v in column(head, rows, "BPPSA max rel diff"))
    assert column(head, rows, "jax assoc_scan ms") == ["not installed"] * 2
    assert column(head, rows, "jax assoc_scan rel diff") == ["n/a"] * 2
    for ms, diff, ratio in zip(
        column(head, rows, "torch assoc_scan ms"),
        column(head, rows, "torch assoc_scan rel diff"),
        column(head, rows, "torch assoc_scan / best"),
        strict=True,
    ):
        if ms.startswith("n/a ("):  # this torch's prototype refused: the reason is printed
            assert "- torch assoc_scan: " in out
        else:
            assert float(ms) > 0 and float(ratio) > 0
            assert float(diff) < 1e-5
    for name in ("floor bytes ms", "floor levels ms", "best / floor"):
        assert all(float(v) > 0 for v in column(head, rows, name)), name


def test_quick_suite_prints_every_table(capsys, no_jax) -> None:
    argv = ["--suite", "paper", "--quick", "--repeats", "1", "--warmup", "0"]
    assert bench_backward.main(argv) == 0
    out = capsys.readouterr().out
    titles = [line[4:] for line in out.splitlines() if line.startswith("### ")]
    sets = ["RNN, T sweep (B = 4, H = 5)", "RNN, B sweep (T = 30, H = 5)", "GRU, IRMAS shapes s/m/l (H = 5)"]
    assert titles == [
        *(f"Full backward: {s}" for s in sets),
        "End-to-end training epoch: bitstream RNN, BPTT vs BPPSA",
        *(f"Scan only, identical chain: {s}" for s in sets),
    ]
    found = tables(out, "model")
    assert [len(rows) for _, rows in found] == [2, 2, 2, 1, 2, 2, 2]
    backward, scans = found[:3], found[4:]
    assert [r[0] for _, rows in backward for r in rows] == ["rnn"] * 4 + ["gru"] * 2
    assert [r[2] for r in backward[1][1]] == ["2", "4"]  # the B sweep
    for head, rows in backward:
        assert all(float(v) < 1e-4 for v in column(head, rows, "max rel grad diff"))
    for head, rows in scans:
        assert all(float(v) < 1e-5 for v in column(head, rows, "BPPSA max rel diff"))


def test_epoch_comparison_prints_two_times_and_their_ratio(capsys) -> None:
    argv = [
        "--tables",
        "epoch",
        "--T",
        "20",
        "--B",
        "4",
        "--H",
        "5",
        "--epoch-samples",
        "12",
        "--warmup",
        "0",
    ]
    assert bench_backward.main(argv) == 0
    head, rows = table(capsys.readouterr().out, "model")
    assert len(rows) == 1
    row = dict(zip(head, rows[0], strict=True))
    assert (row["samples"], row["iterations"]) == ("12", "3")
    bptt, bppsa = float(row["BPTT epoch s"]), float(row["BPPSA (auto) epoch s"])
    assert bptt > 0 and bppsa > 0
    assert float(row["BPTT / BPPSA"]) == pytest.approx(bptt / bppsa, rel=0.01)
    # same weights, same batches, same gradients: the two epochs train alike
    assert float(row["BPPSA mean loss"]) == pytest.approx(float(row["BPTT mean loss"]), rel=1e-4)


def test_default_strategies_are_those_that_exist(monkeypatch) -> None:
    cpu, cuda = bench_backward.torch.device("cpu"), bench_backward.torch.device("cuda")
    assert bench_backward.default_strategies(cpu) == ["chunked", "blelloch"]
    monkeypatch.setattr(bench_backward, "STRATEGIES", ("auto", "blelloch", "chunked", "triton"))
    assert bench_backward.default_strategies(cuda) == ["blelloch", "chunked", "triton", "auto"]
    monkeypatch.setattr(bench_backward, "STRATEGIES", ("auto", "blelloch", "chunked", "graph", "triton"))
    assert bench_backward.default_strategies(cuda) == ["blelloch", "chunked", "graph", "triton", "auto"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--T", "0"], "argument --T: 0 is not positive; accepted: positive integers"),
        (["--B", "-3"], "argument --B: -3 is not positive"),
        (["--H", "ten"], "argument --H: 'ten' is not an integer"),
        (["--model", "lstm"], "argument --model: invalid choice: 'lstm'"),
        (["--device", "tpu"], "unknown device 'tpu'; accepted: cpu, cuda, cuda:N"),
        (["--device", "meta"], "unknown device 'meta'; accepted: cpu, cuda, cuda:N"),
        (["--warmup", "-1"], "argument --warmup: -1 is negative; accepted: non-negative integers"),
        (["--repeats", "0"], "argument --repeats: 0 is not positive"),
        (["--epoch-samples", "0"], "argument --epoch-samples: 0 is not positive"),
        (["--epoch-samples", "40000"], "--epoch-samples: 40000 is more than the 32000 training samples"),
        (["--tables", "forward"], "argument --tables: invalid choice: 'forward'"),
        (["--suite", "issue9"], "argument --suite: invalid choice: 'issue9'"),
        (["--suite", "paper", "--T", "10"], "--suite runs fixed configurations; --T apply without --suite"),
        (["--quick"], "--quick shrinks a suite; accepted: --suite paper --quick"),
        (["--model", "gru", "--tables", "epoch"], "the epoch comparison is the paper's RNN bitstream task"),
        (["--peers", "numpy"], "argument --peers: invalid choice: 'numpy'"),
    ],
)
def test_bad_input_exits_with_one_clear_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_backward.main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: " in last and message in last


def test_cuda_without_a_gpu_is_named(capsys, monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench_backward.main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available here; accepted: cpu" in capsys.readouterr().err


def test_chunk_reaches_every_chunked_scan_of_the_backward_and_scan_tables(
    capsys, monkeypatch, no_jax
) -> None:
    from bppsa_core import scan as scan_mod

    seen = []
    real = scan_mod.chunked_scan
    monkeypatch.setattr(
        scan_mod, "chunked_scan", lambda *a, chunk=None: seen.append(chunk) or real(*a, chunk=chunk)
    )
    argv = ["--T", "11", "--B", "2", "--H", "3", "--strategies", "chunked", "--tables", "backward", "scan"]
    assert bench_backward.main([*argv, "--chunk", "3", "--repeats", "1", "--warmup", "0", "--peers"]) == 0
    out = capsys.readouterr().out
    assert "chunk 3" in out.splitlines()[1]
    assert seen == [3, 3, 3]  # the backward's one timed run; the scan's check run and one timed run


def test_a_non_positive_chunk_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_backward.main(["--chunk", "0"])
    assert exit_info.value.code == 2
    assert "--chunk: 0 is not positive; accepted: positive integers" in capsys.readouterr().err
