"""The host-path benchmark: what a row measures, what it prints, its bad input."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import extended_except

from benchmarks import host
from benchmarks.common import markdown_tables
from benchmarks.scan import MODULES
from bppsa_core import layer as layer_mod

CPU = torch.device("cpu")


@pytest.mark.parametrize("model", extended_except(list(MODULES), first=1))
def test_a_row_times_both_modules_and_checks_their_gradients(model) -> None:
    row = host.bench(model, 6, 3, 5, CPU, torch.float64, 1, 2)
    assert (row.model, row.steps, row.batch, row.hidden) == (model, 6, 3, 5)
    assert min(*row.forward_ms, *row.inference_ms, *row.step_ms) > 0
    assert row.grad_diff < 1e-10  # float64: the two modules' gradients are the same
    assert min(row.ops) > 3 and row.kernels is None  # a step: forward, loss, backward; no GPU here


def test_a_strategy_reaches_the_bppsa_module(monkeypatch) -> None:
    """The "sequential" strategy keeps PyTorch's fused forward inside BPPSA's layer (``layer.native_forward``;
    torch.nn's module calls its kernel directly), and the gradients still agree."""
    calls = []
    real = layer_mod.native_forward
    monkeypatch.setattr(layer_mod, "native_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    row = host.bench("rnn", 6, 3, 5, CPU, torch.float64, 0, 1, strategy="sequential")
    assert calls and row.grad_diff < 1e-10


def test_dispatched_counts_each_operator_call_once() -> None:
    x = torch.randn(4, 3)
    # add, then sum, whose own internal calls are not counted again; a view is a call too
    assert host.dispatched(lambda: (x + 1).sum(), CPU) == (2, None)
    assert host.dispatched(lambda: x.t(), CPU) == (1, None)


@pytest.mark.extended
def test_the_run_prints_one_row_per_model_and_length(capsys) -> None:
    argv = ["--models", "rnn", "lstm", "--T", "3", "5", "--B", "2", "--H", "4", "--dtype", "float64"]
    argv += ["--repeats", "2", "--warmup", "0", "--threads", "2"]
    threads = torch.get_num_threads()
    try:
        assert host.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the tool's one thread, not the tests' after it
    out = capsys.readouterr().out
    assert out.startswith("device: cpu") and ", 2 threads)" in out.splitlines()[0]
    ((head, rows),) = markdown_tables(out)
    assert head[:5] == ["model", "T", "B", "H", "nn forward ms"]
    assert head[-4:] == ["step ratio", "nn ops", "BPPSA ops", "grad rel. diff"]
    assert [(r[0], r[1]) for r in rows] == [("rnn", "3"), ("rnn", "5"), ("lstm", "3"), ("lstm", "5")]
    assert max(float(r[-1]) for r in rows) < 1e-10  # float64


def test_the_profile_shows_where_a_bppsa_step_spends_its_host_time(monkeypatch, capsys) -> None:
    threads = []  # whether autograd may hand the backward to a device thread, at each step's start
    step = host._step
    record = torch._C._is_multithreading_enabled
    monkeypatch.setattr(host, "_step", lambda *a: (threads.append(record()), step(*a)))
    argv = ["--models", "gru", "--T", "4", "9", "--B", "2", "--H", "4", "--repeats", "1", "--warmup", "0"]
    assert host.main([*argv, "--profile", "3"]) == 0
    out = capsys.readouterr().out
    head, profile = out.split("Where a step's host time goes (T = 4;")
    ((_, rows),) = markdown_tables(head)
    assert len(rows) == 2  # the timing table as without the profile
    # the profiled steps (3 warm-up and 3 profiled a module) keep the backward on the profiled thread,
    # then the timed rounds (3 warm-up and 3) take turns: both modules with device threads, then both
    # without, so that each step follows the other module's, not its own (whose caches it would find warm)
    profile_steps, timed_steps = threads[-36:-24], threads[-24:]
    assert not any(profile_steps) and timed_steps == [True, True, False, False] * 6
    line, timed = profile.split("\n\n")[1:3]
    assert line.startswith("gru: a step under the profiler, 3 steps, the backward on the calling thread: ")
    assert re.fullmatch(r".*: torch\.nn \d+ µs, BPPSA \d+ µs", line), line
    assert re.fullmatch(
        r"gru: a step unprofiled, median of 3, the backward on autograd's device threads / on the calling "
        r"thread: torch\.nn [\d.e-]+ / [\d.e-]+ ms, BPPSA [\d.e-]+ / [\d.e-]+ ms",
        timed,
    ), timed
    ((names, functions),) = markdown_tables(profile)
    assert names == ["BPPSA function", "calls a step", "own µs", "with callees µs"]
    assert 0 < len(functions) <= 15
    assert any("bppsa_core/" in f[0] for f in functions)  # the layer's own code, by file and line
    own = [float(f[2]) for f in functions]
    assert own == sorted(own, reverse=True) and all(float(f[3]) >= float(f[2]) for f in functions)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--T", "0"], "argument --T: 0 is not positive; accepted: positive integers"),
        (["--models", "transformer"], "argument --models: invalid choice: 'transformer'"),
        (["--threads", "100000"], "argument --threads: 100000 is more than the"),
        (["--strategy", "fastest"], "argument --strategy: invalid choice: 'fastest'"),
        (["--strategy", "graph"], "--strategy: strategy='graph' needs a CUDA device, and this device is cpu"),
        (["--profile", "0"], "argument --profile: 0 is not positive; accepted: positive integers"),
    ],
)
def test_bad_arguments_end_it_in_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        host.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
