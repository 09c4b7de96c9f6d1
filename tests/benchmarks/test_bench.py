"""The backward benchmark: the rows it measures, its suites, one smoke test of what it prints, and its
answers to bad input."""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import extended_except

from benchmarks import backward
from benchmarks.backward import bench, epoch_comparison, format_table, parse_args, suite_sets
from benchmarks.common import markdown_tables
from benchmarks.floors import Floors
from benchmarks.scan import bench_scan

CPU = torch.device("cpu")
FLOORS = Floors(bandwidth_gbs=10.0, launch_us=5.0)
ONCE = {"warmup": 0, "repeats": 1}


@pytest.fixture
def no_jax(monkeypatch):
    """jax made unimportable, whether or not it is installed."""
    monkeypatch.setitem(sys.modules, "jax", None)


@pytest.fixture
def triton_refused(monkeypatch):
    """strategy="triton" refusing the CPU: TRITON_INTERPRET unset. The kernels are imported first,
    under the interpreter: triton.jit decides at import, and later tests need interpreted kernels."""
    with contextlib.suppress(ImportError):
        import bppsa_core.triton  # noqa: F401
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("model", ["rnn", "gru", "lstm"])
def test_a_backward_row_times_bptt_and_every_strategy_and_checks_the_gradients(model) -> None:
    row = bench(model, 9, 2, 3, 2, ["chunked", "blelloch"], CPU, floors=FLOORS, **ONCE)
    assert (row.model, row.steps, row.batch, row.hidden) == (model, 9, 2, 3)
    assert row.bptt_ms > 0 and set(row.bppsa_ms) == {"chunked", "blelloch"}
    assert all(isinstance(v, float) and v > 0 for v in row.bppsa_ms.values())
    assert row.max_rel_err < 1e-4 and row.notes == {}  # the timed code computes autograd's gradients
    assert row.floor_bytes_ms == FLOORS.bytes_ms(9, 2, 3, {"rnn": 1, "gru": 3, "lstm": 4}[model])
    assert row.floor_levels_ms == FLOORS.levels_ms(9)


@pytest.mark.parametrize("model", ["rnn", "gru", "lstm"])
@pytest.mark.parametrize("loss", ["last", "all"])
def test_a_packed_backward_row_gives_autograds_gradients(model, loss) -> None:
    """Both modules take the same packed batch, whose lengths run from T down to about T / 2; the
    loss on every output reads the packed outputs."""
    row = bench(model, 9, 3, 3, 2, ["chunked"], CPU, loss=loss, packed=True, **ONCE)
    assert set(row.bppsa_ms) == {"chunked"} and row.notes == {}
    assert row.max_rel_err < 1e-4


# the GRU's untaped backward compiles the generic scan for float32 (its float64 walk: test_numba.py)
@pytest.mark.parametrize("model", extended_except(["gru", "lstm"], "lstm"))
def test_an_untaped_column_times_numba_keeping_no_tape(monkeypatch, model) -> None:
    """--untaped: a column of "numba" whose forward keeps no tape (its backward recomputes the
    gates), with autograd's gradients; the "numba" column's forward keeps one."""
    from bppsa_core import layer as layer_mod

    kept, real = [], layer_mod.new_tape
    monkeypatch.setattr(layer_mod, "new_tape", lambda *a: kept.append(real(*a)) or kept[-1])
    row = bench(model, 9, 3, 3, 2, ["numba"], CPU, untaped=True, **ONCE)
    assert set(row.bppsa_ms) == {"numba", backward.UNTAPED} and row.notes == {}
    assert row.max_rel_err < 1e-4
    assert len(kept) == 1 and isinstance(kept[0], layer_mod.Tape)  # one round: numba's forward alone
    head = backward.format_table([row], ["numba", backward.UNTAPED]).splitlines()[0]
    assert "| numba untaped ms | numba untaped / BPTT |" in head


def test_a_flushed_bptt_column_times_autograd_with_subnormals_flushed(monkeypatch) -> None:
    """--flush-bptt: BPTT timed again inside ``flush_denormals`` (the mode BPPSA's CPU backward runs
    in), in two columns of its own after the best BPPSA's; the gradient column stays BPPSA's."""
    entered = []
    real = backward.flush_denormals
    monkeypatch.setattr(backward, "flush_denormals", lambda device: entered.append(device) or real(device))
    row = bench("rnn", 9, 3, 3, 1, ["chunked"], CPU, flush_bptt=True, **ONCE)
    assert entered == [CPU] and row.bptt_flushed_ms > 0 and set(row.bppsa_ms) == {"chunked"}
    ((head, (cells,)),) = markdown_tables(backward.format_table([row], ["chunked"]))
    at = dict(zip(head, cells, strict=True))
    assert head.index("BPTT flushed ms") == head.index("BPTT / best") + 1
    assert float(at["BPTT flushed / best"]) == pytest.approx(
        row.bptt_flushed_ms / row.bppsa_ms["chunked"], rel=1e-2
    )
    ((head, _),) = markdown_tables(
        backward.format_table([bench("rnn", 9, 3, 3, 1, ["chunked"], CPU, **ONCE)], [])
    )
    assert "BPTT flushed ms" not in head


def test_the_flushed_bptt_cell_is_its_backward_alone_as_bptts(monkeypatch) -> None:
    """BPPSA's cells are charged what their forward takes beyond BPTT's; the flushed BPTT, a
    baseline, is not: a forward 2 ms slower leaves its 4 ms backward 4 ms."""
    flushing = []

    @contextlib.contextmanager
    def flush(device):
        flushing.append(True)
        yield
        flushing.pop()

    real = backward.backward_once

    def once(module, x, head, loss):
        grads = real(module, x, head, loss)[2]
        return (3.0, 4.0, grads) if flushing else (1.0, 5.0, grads)

    monkeypatch.setattr(backward, "flush_denormals", flush)
    monkeypatch.setattr(backward, "backward_once", once)
    row = bench("rnn", 9, 3, 3, 1, ["chunked"], CPU, flush_bptt=True, **ONCE)
    assert (row.bptt_ms, row.bptt_flushed_ms, row.bppsa_ms["chunked"]) == (5.0, 4.0, 5.0)


def test_a_packed_input_runs_from_t_down_to_half_of_it() -> None:
    x = torch.arange(4 * 9 * 2, dtype=torch.float32).reshape(4, 9, 2)
    packed = backward.packed_input(x)
    lengths = torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first=True)[1]
    assert lengths.tolist() == [9, 7, 6, 4]
    padded = torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first=True)[0]
    assert torch.equal(padded[1, :7], x[1, :7]) and not padded[3, 4:].any()


def test_the_methods_take_turns_and_the_row_gives_their_spread(monkeypatch) -> None:
    """The methods' backwards alternate round by round; the row's spread is the largest
    (max - min) / median of a method's timed runs (the warm-up round's left out), here BPTT's
    (4 - 1) / 2, and the BPTT cell that median. The backward times are set, the runs real."""
    order = []
    real = backward.backward_once
    timed = {  # ms, per round: the warm-up's first
        "BPTT": [99.0, 1.0, 2.0, 4.0],
        "chunked": [99.0, 3.0, 3.0, 3.0],
        "blelloch": [99.0, 5.0, 6.0, 8.0],
    }

    def once(module, *args):
        name = "BPTT" if type(module) is torch.nn.RNN else module.strategy
        order.append(name)
        forward_ms, _, grads = real(module, *args)
        return forward_ms, timed[name][order.count(name) - 1], grads

    monkeypatch.setattr(backward, "backward_once", once)
    row = bench("rnn", 9, 2, 3, 1, ["chunked", "blelloch"], CPU, warmup=1, repeats=3)
    assert order == ["BPTT", "chunked", "blelloch"] * 4  # one round of warm-up, three timed
    assert row.spread == 1.5 and row.bptt_ms == 2.0
    head, rows = markdown_tables(format_table([row], ["chunked", "blelloch"]))[0]
    assert dict(zip(head, rows[0], strict=True))["spread"] == "150 %"


def test_the_long_suite_reaches_300000_steps_for_both_cells() -> None:
    sets, epoch = suite_sets("long")
    assert epoch is None and [s.model for s in sets] == ["rnn", "gru"]
    for s in sets:
        assert [c[0] for c in s.configs] == [1000, 30_000, 100_000, 300_000]
        assert {c[1:3] for c in s.configs} == {(16, 20)}
    assert {c[3] for c in sets[1].configs} == {24}


def test_a_strategy_that_cannot_run_here_gets_na_cells_and_a_note(triton_refused, no_jax) -> None:
    row = bench("rnn", 20, 2, 3, 1, ["chunked", "triton"], CPU, **ONCE)
    assert isinstance(row.bppsa_ms["chunked"], float) and row.bppsa_ms["triton"] == "n/a"
    assert "strategy='triton' needs" in row.notes["triton"]
    head, rows = markdown_tables(format_table([row], ["chunked", "triton"]))[0]
    cells = dict(zip(head, rows[0], strict=True))
    assert cells["triton ms"] == cells["triton / BPTT"] == "n/a"
    assert cells["best BPPSA"].startswith("chunked")
    scan_row = bench_scan("rnn", 20, 2, 3, 1, ["chunked", "triton"], CPU, FLOORS, peers=(), **ONCE)
    assert scan_row.cells["triton"] == "n/a" and "triton" in scan_row.notes


def test_the_chunk_option_reaches_every_chunked_scan(monkeypatch, no_jax) -> None:
    from bppsa_core import scan as scan_mod

    seen = []
    real = scan_mod.chunked_scan
    monkeypatch.setattr(
        scan_mod, "chunked_scan", lambda *a, chunk=None: seen.append(chunk) or real(*a, chunk=chunk)
    )
    bench("rnn", 11, 2, 3, 1, ["chunked"], CPU, chunk=3, **ONCE)
    bench_scan("rnn", 11, 2, 3, 1, ["chunked"], CPU, FLOORS, peers=(), chunk=3, **ONCE)
    assert seen == [3, 3, 3]  # the backward's one timed run; the scan's check run and one timed run


@pytest.mark.extended  # the epoch's one-thread builds of the compiled kernels: seconds to compile cold
@pytest.mark.parametrize("model", ["rnn", "gru", "lstm"])
def test_the_epoch_comparison_trains_both_models_alike(model) -> None:
    row = epoch_comparison(model, 20, 4, 5, 12, CPU, warmup=0)
    assert (row.model, row.samples, row.iterations, row.strategy) == (model, 12, 3, "auto")
    assert row.bptt_s > 0 and row.bppsa_s > 0
    # same weights, same batches, same gradients: the two epochs train alike
    assert row.bppsa_loss == pytest.approx(row.bptt_loss, rel=1e-4)


@pytest.mark.extended  # as above
def test_repeated_epochs_each_start_from_the_given_weights() -> None:
    """At a learning rate whose updates show in the loss, the last of three epochs has the first's
    mean loss on both sides: no round trains on from the one before."""
    one, three = (epoch_comparison("rnn", 20, 4, 5, 12, CPU, warmup=0, lr=0.1, repeats=n) for n in (1, 3))
    assert (three.bptt_loss, three.bppsa_loss) == (one.bptt_loss, one.bppsa_loss)


def _stood_in_epochs(monkeypatch, ms: list[float]) -> list[torch.nn.Module]:
    """Epochs whose training is stood in for and whose times are ``ms`` in turn: the models trained,
    in order."""
    trained, times = [], iter(ms)

    def train(model, batches, lr):
        trained.append(model)
        return torch.zeros(())

    def time_ms(fn, device):
        fn()
        return next(times)

    monkeypatch.setattr(backward, "_train", train)
    monkeypatch.setattr(backward, "time_ms", time_ms)
    return trained


def test_the_epochs_take_turns_and_the_row_gives_their_medians_and_spread(monkeypatch) -> None:
    """BPTT's and BPPSA's epochs alternate round by round, each on a fresh copy of its model; a cell
    is its side's median and the spread the larger (max - min) / median, here BPPSA's (3 - 1) / 2.
    The epochs' times are set and their training stood in for."""
    trained = _stood_in_epochs(monkeypatch, [4.0, 1.0, 5.0, 2.0, 6.0, 3.0])  # ms: BPTT, BPPSA, BPTT, ...
    row = epoch_comparison("rnn", 20, 4, 5, 8, CPU, warmup=1, repeats=3)
    timed = trained[2:]  # after each side's warm-up
    kinds = [m.rnn.backward_mode for m in timed]
    assert len(timed) == 6 and len({id(m) for m in timed}) == 6  # a fresh copy each epoch
    assert (row.bptt_s, row.bppsa_s, row.spread) == (5e-3, 2e-3, 1.0)
    assert kinds == ["bptt", "bppsa"] * 3
    ((head, (cells,)),) = markdown_tables(backward.format_epoch_table([row]))
    assert dict(zip(head, cells, strict=True))["spread"] == "100 %"


def test_a_flushed_bptt_epoch_takes_its_turn_after_bppsa_inside_the_flush(monkeypatch) -> None:
    """--flush-bptt: BPTT's epoch again, from the same weights, with subnormals flushed, third in
    each round; its median and its ratio to BPPSA's in two columns after BPTT / BPPSA."""
    trained = _stood_in_epochs(monkeypatch, [4.0, 1.0, 3.0, 6.0, 2.0, 5.0])  # BPTT, BPPSA, flushed, ...
    flushed_at = []  # how many models were trained when each flushed block began

    @contextlib.contextmanager
    def flush(device):
        flushed_at.append(len(trained))
        yield

    monkeypatch.setattr(backward, "flush_denormals", flush)
    row = epoch_comparison("rnn", 20, 4, 5, 8, CPU, warmup=0, repeats=2, flush_bptt=True)
    assert [m.rnn.backward_mode for m in trained[2:]] == ["bptt", "bppsa", "bptt"] * 2  # after warm-ups
    assert flushed_at == [4, 7]  # the third epoch of each round
    assert (row.bptt_s, row.bppsa_s, row.bptt_flushed_s) == (5e-3, 1.5e-3, 4e-3)
    ((head, (cells,)),) = markdown_tables(backward.format_epoch_table([row]))
    at = dict(zip(head, cells, strict=True))
    assert head.index("BPTT flushed epoch s") == head.index("BPTT / BPPSA") + 1
    assert (at["BPTT flushed epoch s"], at["BPTT flushed / BPPSA"]) == ("0.004", "2.67")


def _epoch_row(captured_s=None, captured_loss=None) -> backward.EpochRow:
    return backward.EpochRow("rnn", 20, 4, 5, 16, 4, "auto", 2.0, 1.0, 0.5, 0.5, captured_s, captured_loss)


def test_the_epoch_table_shows_captured_epochs_only_where_they_ran() -> None:
    ((head, _),) = markdown_tables(backward.format_epoch_table([_epoch_row()]))
    assert not any("captured" in h for h in head)  # a CPU's: no captured epoch, no columns
    rows = [_epoch_row((3.0, 1.5), (0.25, 0.25)), _epoch_row(("n/a", "error"), (math.nan, math.nan))]
    ((head, (ran, failed)),) = markdown_tables(backward.format_epoch_table(rows))
    cells = dict(zip(head, ran, strict=True))
    assert cells["BPTT / BPPSA"] == "2" and cells["captured BPTT / BPPSA"] == "2"
    assert cells["BPPSA captured s"] == "1.5" and cells["BPPSA captured mean loss"] == "0.250000"
    cells = dict(zip(head, failed, strict=True))
    assert (cells["BPTT captured s"], cells["BPPSA captured s"]) == ("n/a", "error")
    assert cells["captured BPTT / BPPSA"] == cells["BPTT captured mean loss"] == "–"


def test_a_captured_epoch_refuses_batches_of_two_shapes_before_any_capture() -> None:
    batches = backward.bitstream_batches(10, 4, 6, CPU)  # 4 samples, then 2
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="batches of one shape; --epoch-samples a multiple of B"):
        backward._captured_epoch(model, batches, 1e-3, 0)


def test_a_captured_epoch_starts_from_the_given_weights_and_sums_every_batch(monkeypatch) -> None:
    """The captured epoch on a CPU, its capture stood in for: warmed up as ``capture_step`` does,
    its "replay" the step from unset gradients (what a replay of a step captured so computes: its
    gradients are written, not added), and Adam without ``capturable`` (CPU tensors). At a large
    learning rate the warm-up's three updates would show in the loss: undone, the epoch trains
    exactly as the eager one from the same weights."""
    from experiments.train import Classifier

    def stand_in(step, optimizer, device, rounds, error_mode="global"):
        def fresh():
            optimizer.zero_grad(set_to_none=True)
            step()

        for _ in range(max(rounds, 3)):
            fresh()
        optimizer.zero_grad(set_to_none=True)
        return fresh

    adam = torch.optim.Adam
    monkeypatch.setattr(backward, "capture_step", stand_in)
    monkeypatch.setattr(torch.optim, "Adam", lambda params, **kw: adam(params, **{**kw, "capturable": False}))
    torch.manual_seed(0)
    model = Classifier(torch.nn.RNN(1, 5, batch_first=True), backward.CLASSES)
    batches = backward.bitstream_batches(12, 4, 16, CPU)
    eager = backward._train(copy.deepcopy(model), batches, 1e-2).item() / len(batches)
    seconds, loss = backward._captured_epoch(model, batches, 1e-2, 1, repeats=2)  # each from the weights
    assert seconds > 0 and loss == pytest.approx(eager, rel=1e-6)


@pytest.mark.gpu
def test_the_captured_epoch_trains_as_the_eager_one_does() -> None:
    """On a GPU the epoch also runs with its step captured in a CUDA graph, from the same weights:
    each side's captured epoch gets its eager epoch's mean loss."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    row = epoch_comparison("rnn", 20, 4, 5, 16, torch.device("cuda"), warmup=1)
    assert row.captured_s is not None and row.captured_loss is not None, row.notes
    assert all(isinstance(s, float) and s > 0 for s in row.captured_s), row.notes
    for eager, captured in zip((row.bptt_loss, row.bppsa_loss), row.captured_loss, strict=True):
        assert captured == pytest.approx(eager, rel=1e-4)


def test_the_block_option_sets_the_blocks_the_bppsa_backward_takes(monkeypatch, capsys) -> None:
    """``--block-mib 1`` cuts the BPPSA backward into blocks of 1 MiB (a process-wide setting,
    restored here after the run): 8,192 steps here, where the default takes the 20,000 in one."""
    from bppsa_core import jacobians
    from bppsa_core import layer as layer_mod

    monkeypatch.setitem(jacobians.BLOCK_BYTES, "cpu", jacobians.BLOCK_BYTES["cpu"])
    lengths, real = [], layer_mod.layer_grads

    def spied(deltas, *args, **kwargs):
        return real(lambda t: lengths.append(len(range(20_000)[t])) or deltas(t), *args, **kwargs)

    monkeypatch.setattr(layer_mod, "layer_grads", spied)
    argv = [
        "--T",
        "20000",
        "--B",
        "2",
        "--H",
        "3",
        "--strategies",
        "chunked",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]
    assert backward.main(argv) == 0
    assert set(lengths) == {20_000}
    lengths.clear()
    assert backward.main([*argv, "--block-mib", "1"]) == 0
    per_step = 2 * (4 * 3 + 1 + 3) * 4  # what layer_grads counts per step (float32, B = 2, H = 3)
    assert max(lengths) == (1 << 20) // per_step == 8192 and sum(lengths) == 20_000
    assert "blocks of 1 MiB" in capsys.readouterr().out


def test_the_paper_suite_has_the_papers_shapes() -> None:
    sets, epoch = suite_sets("paper")
    t_sweep, b_sweep, gru = sets
    assert [c[0] for c in t_sweep.configs] == [10, 30, 100, 300, 1000, 3000, 10000, 30000]
    assert {c[1:] for c in t_sweep.configs} == {(16, 20, 1)}
    assert [c[1] for c in b_sweep.configs] == [2, 4, 8, 16, 32, 64, 128, 256]
    assert {(c[0], c[3]) for c in gru.configs} == {(259, 38), (517, 24), (1034, 12)}
    assert {c[1] for c in gru.configs} == {16, 32, 64} and gru.model == "gru"
    assert epoch == (1000, 16, 20, 32_000)


def test_the_quick_suite_prints_every_table_in_order(capsys, no_jax) -> None:
    """The one smoke test of the printed output: headings, tables and their row counts."""
    assert backward.main(["--suite", "paper", "--quick", "--repeats", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device: cpu")
    titles = [line[4:] for line in out.splitlines() if line.startswith("### ")]
    sets = ["RNN, T sweep (B = 4, H = 5)", "RNN, B sweep (T = 30, H = 5)", "GRU, IRMAS shapes s/m/l (H = 5)"]
    assert titles == [
        *(f"Full backward: {s}" for s in sets),
        "End-to-end training epoch: the bitstream task, BPTT vs BPPSA",
        *(f"Scan only, identical chain: {s}" for s in sets),
    ]
    found = markdown_tables(out)
    assert [len(rows) for _, rows in found] == [2, 2, 2, 1, 2, 2, 2]
    head, rows = found[0]
    assert head[:5] == ["model", "T", "B", "H", "BPTT ms"] and "chunked / BPTT" in head
    assert all(float(r[-1]) < 1e-4 for r in rows)  # max rel grad diff


def test_default_strategies_are_those_that_exist(monkeypatch) -> None:
    assert backward.default_strategies(CPU) == ["numba", "chunked", "blelloch"]
    cuda = torch.device("cuda")
    monkeypatch.setattr(backward, "STRATEGIES", ("auto", "blelloch", "chunked", "triton"))
    assert backward.default_strategies(cuda) == ["blelloch", "chunked", "triton", "auto"]
    monkeypatch.setattr(backward, "STRATEGIES", ("auto", "blelloch", "chunked", "graph", "triton"))
    assert backward.default_strategies(cuda) == ["blelloch", "chunked", "graph", "triton", "auto"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--T", "0"], "argument --T: 0 is not positive; accepted: positive integers"),
        (["--B", "-3"], "argument --B: -3 is not positive"),
        (["--H", "ten"], "argument --H: 'ten' is not an integer"),
        (["--model", "elman"], "argument --model: invalid choice: 'elman'"),
        (["--device", "tpu"], "argument --device: unknown device 'tpu'; accepted: auto, cpu, cuda, cuda:N"),
        (["--device", "meta"], "unknown device 'meta'; accepted: auto, cpu, cuda, cuda:N"),
        (["--warmup", "-1"], "argument --warmup: -1 is negative; accepted: non-negative integers"),
        (["--threads", "999"], "argument --threads: 999 is more than the "),
        (["--repeats", "0"], "argument --repeats: 0 is not positive"),
        (["--chunk", "0"], "argument --chunk: 0 is not positive; accepted: positive integers"),
        (["--epoch-samples", "0"], "argument --epoch-samples: 0 is not positive"),
        (["--epoch-samples", "40000"], "--epoch-samples: 40000 is more than the 32000 training samples"),
        (["--tables", "forward"], "argument --tables: invalid choice: 'forward'"),
        (["--suite", "nightly"], "argument --suite: invalid choice: 'nightly'"),
        (["--suite", "paper", "--T", "10"], "--suite runs fixed configurations; --T apply without --suite"),
        (["--quick"], "--quick shrinks a suite; accepted: --suite paper --quick"),
        (["--peers", "numpy"], "argument --peers: invalid choice: 'numpy'"),
        (
            ["--packed", "--tables", "scan"],
            "--packed times the backward table only, not scan; accepted: --tables",
        ),
        (["--packed", "--suite", "paper"], "--packed times the backward table only, not backward scan epoch"),
        (["--untaped", "--tables", "epoch"], "--untaped times the backward table only, not epoch; accepted"),
        (
            ["--flush-bptt", "--tables", "scan"],
            "--flush-bptt times BPTT in the backward and epoch tables, not",
        ),
    ],
)
def test_bad_input_exits_with_one_clear_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, no usage block
    assert line.startswith("python -m benchmarks.backward: error: ") and message in line


def test_a_named_strategy_that_cannot_run_on_the_device_is_refused_before_any_timing(
    triton_refused, capsys
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--strategies", "chunked", "triton"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m benchmarks.backward: error: --strategies: strategy='triton' needs")
    assert "and this device is cpu; accepted here: auto, sequential, blelloch, chunked" in line
    assert parse_args(["--strategies", "chunked"]).strategies == ["chunked"]


def test_the_epoch_trains_the_model_asked_for_and_a_suites_the_papers_rnn() -> None:
    """``--model`` names the epoch's model as it names the backward table's; a suite's epoch is the
    paper's RNN."""
    _, epochs = backward.plan(parse_args(["--model", "lstm", "--tables", "epoch", "--T", "20", "30"]))
    assert epochs == [("lstm", 20, 16, 20, 32000), ("lstm", 30, 16, 20, 32000)]
    _, epochs = backward.plan(parse_args(["--suite", "paper", "--epoch-samples", "64"]))
    assert [e[0] for e in epochs] == ["rnn"] and epochs[0][-1] == 64


@pytest.mark.parametrize("strategy", ["graph", "triton"])
def test_an_epoch_strategy_that_cannot_run_on_the_device_is_refused_before_the_epoch(
    strategy, triton_refused, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(backward, "epoch_comparison", lambda *a, **k: pytest.fail("the epoch ran"))
    with pytest.raises(SystemExit) as exc:
        backward.main(["--tables", "epoch", "--T", "10", "--epoch-strategy", strategy])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(
        f"python -m benchmarks.backward: error: --epoch-strategy: strategy='{strategy}' needs"
    )
    assert "and this device is cpu; accepted here: auto, sequential, blelloch, chunked" in line
    assert captured.out == ""
    assert parse_args(["--epoch-strategy", "chunked"]).epoch_strategy == "chunked"
    assert parse_args([]).epoch_strategy == "auto"


# Every tool that writes files: its output option, a path that option refuses ({file}: a file,
# {folder}: a folder) and the other arguments it needs.
OUTPUT_TOOLS = {
    "benchmarks.distributed": ("--out", "{file}", []),
    "benchmarks.schemes": ("--out", "{file}/sub", []),
    "benchmarks.pruned_vgg": ("--out", "{file}", []),
    "benchmarks.kernels": ("--json", "{folder}", []),
    "benchmarks.gpu_check": ("--out", "{folder}", ["--dry"]),
    "analysis.figures": ("--out", "{file}", ["results"]),
    "analysis.report": ("--out", "{file}", ["results"]),
    "analysis.fig10": ("--out", "{file}", ["results"]),
    "analysis.schemes": ("--out", "{file}", []),
    "datasets.synthetic_irmas": ("--out", "{file}", ["--per-class", "1"]),
}


@pytest.mark.parametrize(
    ("module", "argv"), [(m, [flag, path, *rest]) for m, (flag, path, rest) in OUTPUT_TOOLS.items()]
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    module: str, argv: list[str], tmp_path, capsys
) -> None:
    import importlib

    (tmp_path / "file").write_text("mine")
    args = [a.format(file=tmp_path / "file", folder=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(args)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    expected = (
        f"{tmp_path} is a folder; accepted: a file name"
        if "{folder}" in argv
        else f"{tmp_path / 'file'} is a file; accepted: a folder (made if missing)"
    )
    assert line.startswith(f"python -m {module}: error: argument --") and line.endswith(expected)
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("module", OUTPUT_TOOLS)
@pytest.mark.parametrize("case", ["empty", "denied"])
def test_an_empty_or_unwritable_output_path_is_refused_before_any_work(
    module: str, case: str, tmp_path, capsys, monkeypatch
) -> None:
    import importlib

    flag, _, rest = OUTPUT_TOOLS[module]
    if case == "denied":  # what a read-only folder gives, whoever runs the test
        monkeypatch.setattr("toolbox.files.os.access", lambda path, mode: Path(path) != tmp_path)
    value = "" if case == "empty" else str(tmp_path / "new")
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main([flag, value, *rest])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    expected = (
        "an empty path; accepted: " if case == "empty" else f"cannot write in {tmp_path} (permission denied)"
    )
    assert line.startswith(f"python -m {module}: error: argument {flag}: {expected}"), line
    assert not any(tmp_path.iterdir())


def test_memory_that_runs_out_ends_a_tool_in_one_line(capsys) -> None:
    from benchmarks.common import run_tool

    def too_large() -> int:
        raise RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: 4000000000000 bytes")

    assert run_tool("benchmarks.backward", too_large) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m benchmarks.backward: error: out of memory: [enforce fail]")
    assert line.endswith("; accepted: smaller sizes")
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        run_tool("benchmarks.backward", lambda: (_ for _ in ()).throw(RuntimeError("a bug")))
    assert run_tool("benchmarks.backward", lambda: 0) == 0


def test_a_result_that_cannot_be_written_at_the_end_is_said_in_one_line(tmp_path: Path, capsys) -> None:
    """A write that fails after the work (the disk filled meanwhile; here its folder became a file)
    ends the tool with status 1 and one line naming the file, no traceback and no file."""
    from benchmarks.common import run_tool
    from toolbox.files import write_atomic

    (tmp_path / "out").write_text("a file where the folder was")
    target = tmp_path / "out" / "measured.csv"

    def late_write() -> int:
        write_atomic(target, lambda tmp: tmp.write_text("p,seconds\n"))
        return 0

    assert run_tool("benchmarks.distributed", late_write) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    why = f"{tmp_path / 'out'} is a file, not a folder"
    assert line == f"python -m benchmarks.distributed: error: cannot write {target}: {why}"
    assert not target.exists()


def test_memory_that_runs_out_in_a_spawned_process_is_said_with_its_cause_and_sizes(capsys) -> None:
    from torch.multiprocessing import ProcessRaisedException

    from benchmarks.common import run_tool

    cause = (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
        "can't allocate memory: you tried to allocate 104857600000 bytes."
    )
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1, in _pingpong\n    torch.zeros(n)\n'
    message = f"\n\n-- Process 0 terminated with the following error:\n{trace}{cause}\n"

    def spawned() -> int:
        raise ProcessRaisedException(message, 0, 1234)  # as torch.multiprocessing.spawn raises it

    assert run_tool("benchmarks.schemes", spawned, "smaller --pingpong-mb or --batch") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    prefix = "python -m benchmarks.schemes: error: out of memory: "
    assert line == f"{prefix}{cause}; accepted: smaller --pingpong-mb or --batch"


def test_ctrl_c_ends_a_tool_in_one_line_with_status_130(capsys) -> None:
    from benchmarks.common import run_tool

    def interrupted() -> int:
        print("a table so far")
        raise KeyboardInterrupt

    try:
        assert run_tool("benchmarks.pruned_vgg", interrupted) == 130
    except KeyboardInterrupt:  # caught here, as pytest would end the whole session on it
        pytest.fail("Ctrl-C left run_tool as a traceback")
    captured = capsys.readouterr()
    assert captured.err == "python -m benchmarks.pruned_vgg: interrupted\n"
    assert captured.out == "a table so far\n"  # what was printed before stays


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_ctrl_c_in_the_command_itself_gives_its_one_line(monkeypatch, capsys) -> None:
    import runpy

    def interrupted(device: torch.device) -> Floors:
        raise KeyboardInterrupt  # what Ctrl-C raises wherever the tool is

    monkeypatch.setattr("benchmarks.floors.measure_floors", interrupted)
    monkeypatch.setattr(sys, "argv", ["backward", "--T", "10"])
    with pytest.raises(SystemExit) as exc:
        try:
            runpy.run_module("benchmarks.backward", run_name="__main__")
        except KeyboardInterrupt:  # caught here, as pytest would end the whole session on it
            pytest.fail("Ctrl-C left the command as a traceback")
    assert exc.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == ["python -m benchmarks.backward: interrupted"]


def test_cuda_without_a_gpu_is_named(capsys, monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--device", "cuda"])
    assert exc.value.code == 2
    assert "device 'cuda' asked for, but CUDA is not available here; accepted: cpu" in capsys.readouterr().err


def test_help_names_the_module_and_every_default(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m benchmarks.backward")
    assert "(default: 5)" in out and "(default: 2)" in out  # --repeats, --warmup
