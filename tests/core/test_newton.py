"""The Newton forward (``forward_solver="newton"`` / ``"quasi-newton"``): converged states equal
torch.nn's forward (1e-10 in float64, 1e-5 in float32), gradients equal autograd's, the iteration
count is bounded and reported, and a solve that does not converge falls back to the native forward."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import rel_err
from hypothesis import given
from hypothesis import strategies as st
from recurrent import F64, KINDS, flat, pair, run, state, state_leaves
from torch.nn.utils.rnn import pack_sequence

from bppsa_core import newton
from bppsa_core import nn as bnn
from bppsa_core.dispatch import ScanOptions
from bppsa_core.jacobians import GRUCell, LayerWeights, LSTMCell, RNNCell
from bppsa_core.newton import SOLVERS, SolverOptions, solve

NEWTON = [s for s in SOLVERS if s != "native"]
# Largest absolute difference of the outputs and last states from torch.nn's, by dtype.
OUT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def check(kind, solver, steps, batch, features, hidden, dtype=F64, lengths=None, **kwargs):
    """Ours with a Newton forward against torch.nn: outputs, states and every gradient; returns
    ours (its ``solver_stats`` are those of the compared forward)."""
    ref, ours = pair(kind, features, hidden, dtype=dtype, forward_solver=solver, **kwargs)
    hx = state(ours, batch, dtype)
    g = torch.Generator().manual_seed(2)
    if lengths is not None:
        seqs = [torch.randn(n, features, generator=g, dtype=dtype, requires_grad=True) for n in lengths]
        inp, leaves = pack_sequence(seqs, enforce_sorted=False), seqs
    else:
        inp = torch.randn(steps, batch, features, generator=g, dtype=dtype, requires_grad=True)
        leaves = [inp]
    a, b = run(ref, inp, hx), run(ours, inp, hx)
    stats = ours.solver_stats
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= OUT_TOL[dtype]
    cot = [torch.randn(t.shape, generator=g, dtype=dtype) for t in a]
    wrt = [*leaves, *state_leaves(hx)]
    loss_a, loss_b = (sum((t * c).sum() for t, c in zip(r, cot, strict=True)) for r in (a, b))
    ga = torch.autograd.grad(loss_a, [*ref.parameters(), *wrt], retain_graph=True)  # packing is shared
    gb = torch.autograd.grad(loss_b, [*ours.parameters(), *wrt])
    for x, y in zip(ga, gb, strict=True):
        assert rel_err(x, y) < GRAD_TOL[dtype]
    return stats


@given(
    kind=st.sampled_from(sorted(KINDS)),
    solver=st.sampled_from(NEWTON),
    steps=st.integers(1, 60),
    batch=st.integers(1, 4),
    features=st.integers(1, 4),
    hidden=st.integers(1, 12),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
)
def test_converged_forward_equals_torch_nn_float64(
    kind, solver, steps, batch, features, hidden, layers, bidirectional
) -> None:
    stats = check(
        kind, solver, steps, batch, features, hidden, num_layers=layers, bidirectional=bidirectional
    )
    assert len(stats) == layers * (2 if bidirectional else 1)
    # after k iterations the first k states are exact: T + 1 iterations always end it
    assert all(s.converged and 1 <= s.iterations <= steps + 1 for s in stats), stats


@given(
    kind=st.sampled_from(sorted(KINDS)),
    solver=st.sampled_from(NEWTON),
    steps=st.integers(1, 300),
    batch=st.integers(1, 8),
    features=st.integers(1, 4),
    hidden=st.integers(1, 24),
)
def test_converged_forward_equals_torch_nn_float32(kind, solver, steps, batch, features, hidden) -> None:
    stats = check(kind, solver, steps, batch, features, hidden, dtype=torch.float32, num_layers=2)
    assert all(s.converged for s in stats), stats


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("solver", NEWTON)
def test_packed_sequences(kind: str, solver: str) -> None:
    """Past a sequence's end the state is carried and the output is 0, as torch.nn's."""
    stats = check(kind, solver, None, 4, 2, 5, lengths=[9, 3, 14, 1], bidirectional=True)
    assert all(s.converged for s in stats)


@pytest.mark.parametrize(("dtype", "iterations", "close"), [(torch.float32, 3, 1e-6), (F64, 4, 1e-14)])
def test_newton_stops_once_its_change_is_small_against_the_one_before(dtype, iterations, close) -> None:
    """The error estimate reads the rate of the last two changes, so a Newton solve stops at the
    iteration whose change is small against the one before, not one later, when the change itself
    is under the tolerance: an RNN at its initial weights in 3 iterations (float32; 4 by the change
    alone) and 4 (float64; 5), its outputs the native forward's to the dtype's rounding."""
    torch.manual_seed(0)
    ours = bnn.RNN(1, 20, forward_solver="newton").to(dtype)
    native = bnn.RNN(1, 20).to(dtype)
    native.load_state_dict(ours.state_dict())
    x = torch.bernoulli(torch.full((100, 4, 1), 0.5)).to(dtype)
    with torch.no_grad():
        out, expected = ours(x)[0], native(x)[0]
    stats = ours.solver_stats[0]
    assert stats.converged and stats.iterations == iterations, stats
    assert stats.change > SolverOptions("newton").tolerance(dtype)  # stopped before the change alone allows
    assert (out - expected).abs().max() < close


def test_newton_takes_fewer_iterations_than_quasi_newton() -> None:
    """Newton converges quadratically, quasi-Newton linearly: on the same layer Newton takes fewer."""
    counts = {}
    for s in NEWTON:
        _, ours = pair("gru", 3, 16, forward_solver=s)
        ours(torch.randn(200, 4, 3, dtype=F64))
        counts[s] = ours.solver_stats[0].iterations
    assert counts["newton"] < counts["quasi-newton"], counts


def _chaotic(solver: str, iters: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tanh RNN whose recurrent weights are 3 times an orthogonal matrix (chaotic)."""
    ref, ours = pair("tanh", 2, 16, forward_solver=solver, newton_iters=iters)
    w = 3 * torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(0), dtype=F64))[0]
    with torch.no_grad():
        for m in (ref, ours):
            m.weight_hh_l0.copy_(w)
    return ref, ours


@pytest.mark.extended
@pytest.mark.parametrize("model", ["rnn", "gru"])
def test_a_trained_layer_converges_to_the_native_states(model: str) -> None:
    """The benchmark's trained weights (300 Adam steps of the bitstream task; the RNN's recurrence is
    no longer contractive, and unprojected iterations overflowed to NaN on it): the Newton forward
    at T = 1000 in float32 converges, to the native states within 1e-5."""
    from benchmarks.forward import MODELS, task_batch, trained_state

    cpu = torch.device("cpu")
    cls, features = MODELS[model]
    weights = trained_state(model, features, 20, 16, 300, cpu)[0]
    x = task_batch(1000, 16, features, cpu, seed=10_000)[0]
    ref = cls(features, 20, batch_first=True)
    ours = cls(features, 20, batch_first=True, forward_solver="newton")
    ref.load_state_dict(weights)
    ours.load_state_dict(weights)
    out = ours(x)[0]
    (stats,) = ours.solver_stats
    assert stats.converged, stats
    assert (out - ref(x)[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_state_lies_within_the_cells_bounds(kind: str) -> None:
    """``Cell.bounds`` holds for the native states, from initial states inside and outside [-1, 1]."""
    from bppsa_core.layer import cell_of

    _, ours = pair(kind, 3, 6)
    hx = state(ours, 5)
    with torch.no_grad():
        for t in hx if isinstance(hx, tuple) else (hx,):
            t.mul_(3)  # some initial states outside [-1, 1]
        steps = 40
        x = 2 * torch.randn(steps, 5, 3, dtype=F64)
        lstm = kind == "lstm"
        h, c, s0 = x.new_empty((steps, 5, 6)), x.new_empty((steps, 5, 6)), None
        for t in range(steps):  # every state, step by step, from PyTorch's cell functions
            out = ours(x[: t + 1], hx)[1]
            h[t], c[t] = (out[0][0], out[1][0]) if lstm else (out[0], out[0])
        s0 = torch.cat((hx[0][0], hx[1][0]), -1) if lstm else hx[0]
        states = torch.cat((h, c), -1) if lstm else h
        lo, hi = cell_of(ours.mode).bounds(s0, steps)
        assert (states >= lo).all() and (states <= hi).all()


@pytest.mark.parametrize("solver", NEWTON)
def test_a_solve_that_does_not_converge_falls_back_to_the_native_forward(solver: str, caplog) -> None:
    ref, ours = _chaotic(solver, 10)
    x = torch.randn(200, 3, 2, dtype=F64)
    with caplog.at_level(logging.WARNING, logger="bppsa_core.layer"):
        got = flat(ours(x))
    (stats,) = ours.solver_stats
    assert not stats.converged and stats.iterations == 10
    assert f"{solver} forward did not converge in 10 iterations" in caplog.text
    assert "native sequential forward instead" in caplog.text
    ours.forward_solver = "native"
    for a, b in zip(flat(ours(x)), got, strict=True):  # the fallback is the native forward, bit for bit
        assert torch.equal(a, b)
    # torch.nn's differ in their rounding only, which a chaotic recurrence grows: equal at first
    for a, b in zip(flat(ref(x[:5])), flat(ours(x[:5])), strict=True):
        assert (a - b).abs().max().item() <= 1e-12


def test_previous_guess_starts_from_the_last_forward() -> None:
    """With ``newton_guess="previous"`` the same batch again converges in one iteration (the
    guess is the solution; the iteration confirms it), for an LSTM too (its c follows from h)."""
    for kind in ("gru", "lstm"):
        _, ours = pair(kind, 3, 8, forward_solver="newton", newton_guess="previous")
        x = torch.randn(40, 2, 3, dtype=F64)
        ours(x)
        assert ours.solver_stats[0].iterations > 1
        ours(x)
        assert ours.solver_stats[0].iterations == 1
        ours(x[:30])  # another shape: zeros again
        assert ours.solver_stats[0].iterations > 1


@pytest.mark.parametrize("kind", ["tanh", "gru", "lstm"])
def test_picard_sweeps_start_newton_near_its_solution_where_the_recurrence_contracts(kind) -> None:
    """``newton_guess="sweeps"``: at initial weights (a contracting recurrence) Picard sweeps run
    until one hardly shrinks the change, and Newton then needs no more iterations than from zeros
    (the RNN fewer), to the same states (float32, within its rounding of the native forward)."""
    x = torch.bernoulli(torch.full((300, 4, 1), 0.5))
    stats, outs = {}, {}
    for guess in ("zeros", "sweeps"):
        torch.manual_seed(0)
        _, ours = pair(kind, 1, 20, dtype=torch.float32, forward_solver="newton", newton_guess=guess)
        native = type(ours)(1, 20)
        native.load_state_dict(ours.state_dict())
        with torch.no_grad():
            outs[guess], expected = ours(x)[0], native(x)[0]
        (stats[guess],) = ours.solver_stats
        assert stats[guess].converged and (outs[guess] - expected).abs().max() < 1e-5, stats
    assert stats["zeros"].sweeps == 0 and 2 <= stats["sweeps"].sweeps <= newton.MAX_SWEEPS, stats
    fewer = stats["sweeps"].iterations < stats["zeros"].iterations
    assert fewer if kind == "tanh" else stats["sweeps"].iterations <= stats["zeros"].iterations, stats


def test_picard_sweeps_stop_where_the_recurrence_does_not_contract(caplog) -> None:
    """A chaotic RNN: its sweeps' changes do not shrink, so they stop within a few (the rate rule,
    ``newton.SWEEP_RATE``), not at ``newton.MAX_SWEEPS``; its solve does not converge and the layer runs
    the native forward, bit for bit."""
    _, ours = _chaotic("newton", 10)
    ours.newton_guess = "sweeps"
    x = torch.randn(200, 3, 2, dtype=F64)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="bppsa_core.layer"):
        got = ours(x)[0]
    (stats,) = ours.solver_stats
    assert 2 <= stats.sweeps < newton.MAX_SWEEPS and not stats.converged, stats  # the rate stopped them
    ours.forward_solver = "native"
    with torch.no_grad():
        assert torch.equal(ours(x)[0], got)


def test_the_layer_operator_carries_the_sweeps_that_compiled_graphs_call() -> None:
    """``torch.compile`` reaches a layer through ``bppsa::layer_forward``, whose arguments spell out
    the solver's options: the sweeps among them, and the stats in ``SolveStats.as_tensor``'s layout."""
    from bppsa_core.layer import SEGMENT

    torch.manual_seed(0)
    rnn = torch.nn.RNN(1, 20)
    x = torch.bernoulli(torch.full((100, 4, 1), 0.5))
    weights = [p.detach() for p in rnn.parameters()]
    args = (x, torch.zeros(1, 4, 20), None, *weights, None, None, "RNN_TANH", SEGMENT, "newton", None, 100)
    stats = torch.ops.bppsa.layer_forward(*args, newton.MAX_SWEEPS, "auto", None, None)[3]
    assert newton.SolveStats.from_tensor(stats).sweeps >= 2


def test_native_forward_reports_zero_iterations() -> None:
    _, ours = pair("gru", 3, 8, num_layers=3)
    ours(torch.randn(5, 2, 3, dtype=F64))
    assert [(s.iterations, s.converged) for s in ours.solver_stats] == [(0, True)] * 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"forward_solver": "jacobi"},
            "unknown forward_solver 'jacobi'; accepted: native, newton, quasi-newton",
        ),
        (
            {"forward_solver": "newton", "newton_tol": 0},
            "newton_tol must be a number in (0, 1) or None, got 0",
        ),
        ({"forward_solver": "newton", "newton_tol": float("nan")}, "newton_tol must be a number in (0, 1)"),
        ({"forward_solver": "newton", "newton_iters": 0}, "newton_iters must be a positive integer, got 0"),
        ({"newton_guess": "ones"}, "unknown newton_guess 'ones'; accepted: zeros, previous, sweeps"),
        ({"forward_solver": "newton", "backward": "bptt"}, "forward_solver='newton' needs backward='bppsa'"),
    ],
)
def test_bad_options_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        bnn.GRU(3, 4, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "cell",
    [RNNCell("tanh"), RNNCell("relu"), GRUCell(), LSTMCell()],
    ids=["rnn_tanh", "rnn_relu", "gru", "lstm"],
)
def test_step_is_the_cell_and_its_jacobian_diagonal(cell) -> None:
    """``Cell.step`` from given previous states is torch's cell function at every step, and its
    chain's ``diagonals`` are the diagonals of the dense Jacobians."""
    torch.manual_seed(0)
    steps, batch, inp, hidden = 6, 3, 2, 5
    gates = cell.gates
    w = LayerWeights(
        *(
            torch.randn(s, dtype=F64)
            for s in [(gates * hidden, inp), (gates * hidden, hidden), (gates * hidden,), (gates * hidden,)]
        )
    )
    lstm = isinstance(cell, LSTMCell)
    x = torch.randn(steps, batch, inp, dtype=F64)
    prev = torch.randn(steps, batch, 2 * hidden if lstm else hidden, dtype=F64)
    new, factors = cell.step(x, prev, w)
    for t in range(steps):
        if lstm:
            h, c = torch.lstm_cell(x[t], (prev[t, :, :hidden], prev[t, :, hidden:]), *vars(w).values())
            expected = torch.cat((h, c), -1)
        elif isinstance(cell, GRUCell):
            expected = torch.gru_cell(x[t], prev[t], *vars(w).values())
        else:
            fn = torch.rnn_tanh_cell if cell.nonlinearity == "tanh" else torch.rnn_relu_cell
            expected = fn(x[t], prev[t], *vars(w).values())
        assert (new[t] - expected).abs().max() < 1e-12
    chain = cell.chain(factors, w)
    assert torch.allclose(chain.diagonals(), chain.dense().diagonal(dim1=-2, dim2=-1), atol=1e-13)


def test_solve_refuses_the_native_method() -> None:
    with pytest.raises(ValueError, match="solve\\(\\) runs the Newton methods; got forward_solver 'native'"):
        x = torch.zeros(3, 1, 1, dtype=F64)
        w = LayerWeights(torch.zeros(1, 1, dtype=F64), torch.zeros(1, 1, dtype=F64))
        solve(RNNCell(), x, torch.zeros(1, 1, dtype=F64), w, None, SolverOptions(), ScanOptions())


@pytest.mark.parametrize("solver", NEWTON)
@pytest.mark.parametrize("lookahead", [1, 3])
def test_reading_the_stopping_flag_late_changes_nothing_but_the_iterations_queued(
    solver: str, lookahead: int, monkeypatch
) -> None:
    """As on a GPU, the host reads the flag ``lookahead`` iterations late: the iterations queued past
    the stop leave the iterate as it was, so states and stats are those of a check after every
    iteration, bit for bit, and exactly ``lookahead`` more cell evaluations ran (fewer at the cap)."""
    from bppsa_core import newton

    cell = GRUCell()
    g = torch.Generator().manual_seed(4)
    steps, batch, inp, hidden = 50, 3, 2, 6
    w = LayerWeights(
        *(torch.randn(s, generator=g, dtype=F64) * 0.4 for s in [(18, inp), (18, hidden), (18,), (18,)])
    )
    x = torch.randn(steps, batch, inp, generator=g, dtype=F64)
    s0 = torch.randn(batch, hidden, generator=g, dtype=F64)
    steps_run = []
    real_step = GRUCell.step
    monkeypatch.setattr(GRUCell, "step", lambda *a, **k: steps_run.append(1) or real_step(*a, **k))

    def run(late: int, cap: int = 100) -> tuple[torch.Tensor, newton.SolveStats, int]:
        monkeypatch.setitem(newton.LOOKAHEAD, "cpu", late)
        steps_run.clear()
        s, stats = solve(cell, x, s0, w, None, SolverOptions(solver, max_iters=cap), ScanOptions())
        return s, stats, len(steps_run)

    s, stats, evaluations = run(0)
    assert stats.converged and evaluations == stats.iterations > 2
    s_late, stats_late, evaluations_late = run(lookahead)
    assert torch.equal(s, s_late) and stats_late == stats
    assert evaluations_late == evaluations + lookahead
    cap = stats.iterations - 1  # stops at the cap, not converged: nothing queued past it
    capped = run(0, cap)[1:]
    assert run(lookahead, cap)[1:] == capped and capped[0].iterations == capped[1] == cap
    assert not capped[0].converged


def test_the_solves_device_records_are_made_by_fills_not_host_copies() -> None:
    """The stopping rule's record and the native forward's stats on a device are made by fills
    there: a Python number set into a device tensor is a host copy, which a CUDA graph capture
    refuses. Made on the meta device, where such a copy shows as ``scalar_tensor`` + ``copy_``."""
    import math

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    meta = torch.device("meta")
    with Ops() as ops:
        watch = newton._Watch(1e-6, meta)
        stats = newton.NATIVE.as_tensor(meta)
    assert ops.names == {"zeros", "select", "fill_"}
    assert watch.record.shape == (7,) and stats.shape == (4,) and stats.device == meta
    values = newton.on_device((0.0, 1.0, math.nan, math.inf, -2.5), torch.device("cpu"))
    assert values[[0, 1, 3, 4]].tolist() == [0.0, 1.0, math.inf, -2.5] and values[2].isnan()
