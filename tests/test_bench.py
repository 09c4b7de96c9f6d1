"""The backward benchmark CLI: its table, and its answers to bad input."""

from __future__ import annotations

import pytest

from experiments import bench_backward


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--T", "0"], "argument --T: 0 is not positive; accepted: positive integers"),
        (["--B", "-3"], "argument --B: -3 is not positive"),
        (["--H", "ten"], "argument --H: 'ten' is not an integer"),
        (["--model", "lstm"], "argument --model: invalid choice: 'lstm'"),
        (["--device", "tpu"], "unknown device 'tpu'; accepted: cpu, cuda, cuda:N"),
    ],
)
def test_bad_input_exits_with_one_clear_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_backward.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_named(capsys, monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench_backward.main(["--device", "cuda"])
    assert "CUDA is not available here; accepted: cpu" in capsys.readouterr().err
