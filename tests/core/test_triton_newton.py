"""A Newton iteration in Triton kernels (``bppsa_core.triton.newton``) against its plain-PyTorch twin,
under TRITON_INTERPRET=1 on the CPU (set by conftest when no GPU is present): the projected update
and the stopping rule, a whole RNN or GRU iteration, and modules whose forward takes them."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import extended_except, rel_err
from recurrent import pair

pytest.importorskip("triton")

from bppsa_core import newton
from bppsa_core.jacobians import GRUCell, LayerWeights, RNNCell
from bppsa_core.triton import diagonal
from bppsa_core.triton import newton as kernels


def record(tol: float = 1e-6, last: float = math.inf, stopped: bool = False) -> torch.Tensor:
    """A stopping rule's record as ``newton._Watch`` starts it (or one already stopped)."""
    return torch.tensor([float(stopped), 3.0, 0.0, math.nan, 2.0, last, tol], dtype=torch.float64)


def iterate_case(steps: int, batch: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    """States s (T, B, S), corrections d (T + 1, B, S, a scan's rows) with a NaN, infinities and a
    huge value among them, and bounds lo, hi (B, S), one of them infinite."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(steps, batch, width, generator=g) * 2 - 1
    d = torch.randn(steps + 1, batch, width, generator=g)
    flat = d.view(-1)
    flat[0], flat[5 % flat.numel()], flat[-2], flat[-1] = math.nan, math.inf, -math.inf, 3e38
    lo = -torch.ones(batch, width) - torch.rand(batch, width, generator=g)
    hi = torch.ones(batch, width)
    hi[0, 0] = math.inf
    return s, d, lo, hi


@pytest.mark.parametrize("reversed_", [False, True])
@pytest.mark.parametrize("quasi", [False, True])
# 70 x 3 x 7 = 1470 states: two programs
@pytest.mark.parametrize(("steps", "batch", "width"), [(1, 1, 1), (7, 3, 5), (70, 3, 7)])
def test_the_update_and_the_stopping_rule_match_their_twin(reversed_, quasi, steps, batch, width) -> None:
    s, d, lo, hi = iterate_case(steps, batch, width, steps * 31 + width)
    if not reversed_:
        d = d[:steps].contiguous()
    s_ref, rec_ref, rec = s.clone(), record(last=2.0), record(last=2.0)
    kernels.newton_update_ref(s_ref, d, lo, hi, rec_ref, quasi, reversed_)
    kernels.newton_update(s, d, lo, hi, rec, quasi, reversed_)
    assert torch.equal(s, s_ref)
    assert torch.equal(rec, rec_ref), (rec, rec_ref)
    assert rec[newton.ITERATIONS] == 4 and rec[newton.CHANGE] > 0


def test_a_stopped_record_leaves_the_states_and_itself_as_they_were() -> None:
    s, d, lo, hi = iterate_case(9, 2, 3, 0)
    before, rec = s.clone(), record(stopped=True)
    kept = rec.clone()
    kernels.newton_update(s, d, lo, hi, rec, False, True)
    assert torch.equal(s, before)
    assert torch.equal(rec.nan_to_num(), kept.nan_to_num())


@pytest.mark.parametrize("rule", ["newton", "quasi-newton", "sweep"])
@pytest.mark.parametrize(
    ("change", "size", "last"),
    [
        (1e-7, 0.5, 1.0),  # converged
        (2e-6, 3.0, 1.0),  # converged at tol * max |s| only
        (5e-7, 0.5, 6e-7),  # Newton converged; quasi-Newton not, at rate 0.83 (error 2.5e-6)
        (5e-7, 0.5, 4e-7),  # quasi-Newton diverging (rate above 1): not converged, not stopped
        (1e-3, 1.0, 2e-3),
        (1.9e-5, 0.5, 1.5e-2),  # Newton converged at its rate (error 2.4e-8); quasi-Newton not
        (3.2e-3, 1.0, 0.19),  # converging, not yet (Newton's error 5.5e-5)
        (5e-6, 0.5, math.inf),  # a first iteration: the change itself, not yet
        (0.0, 0.5, 0.0),  # no change: converged
        (math.inf, 1.0, 1.0),  # stopped, not converged
        (8e-3, 1.0, 1e-2),  # sweeps stop at rate 0.8, not converged; quasi-Newton goes on
        (5e-3, 1.0, 1e-2),  # sweeps go on at rate 0.5
    ],
)
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # inf / inf: the rate is NaN
def test_the_decision_over_many_partials_is_the_rule(rule, change, size, last) -> None:
    """``_decide`` alone over 2,500 partial pairs (three blocks of its loop): the rule (``newton.judge``)
    on their largest change and |state|: converged or not, by the tolerance scaled by max(1, |s|) and,
    for quasi-Newton and Picard sweeps, by the rate of the last two changes; sweeps also stop once
    that rate is above ``newton.SWEEP_RATE``. The sweeps' count is left as it was."""
    quasi, sweep = rule == "quasi-newton", rule == "sweep"
    g = torch.Generator().manual_seed(1)
    pairs = 2500
    partial = torch.rand(pairs, 2, generator=g) * torch.tensor([change, size]) * 0.5
    partial[1777] = torch.tensor([change, size])  # the largest of each, in the last block
    rec, rec_ref = record(last=last), record(last=last)
    decide = kernels.update_launches(quasi, False, sweep)[1]
    decide.run((1,), partial_ptr=partial.view(-1), record_ptr=rec, P=pairs)
    newton.judge(rec_ref, torch.tensor(change, dtype=torch.float32), torch.tensor(size), quasi, sweep)
    assert torch.equal(rec, rec_ref), (rec, rec_ref)
    assert rec[newton.SWEPT] == 2.0


CELLS = {"tanh": RNNCell("tanh"), "relu": RNNCell("relu"), "gru": GRUCell()}
ITERATION_CASES = [(1, 1, 1, None), (23, 3, 5, 4), (40, 2, 20, None)]  # steps, batch, hidden, chunk


def check_fused_iteration(
    device: str, kind: str, steps: int, batch: int, hidden: int, chunk, sweep: bool = False
) -> None:
    """One ``FusedIteration`` (``sweep``: one Picard sweep) from random states against its twin:
    states, record."""
    cell = CELLS[kind]
    g = torch.Generator().manual_seed(steps + hidden)
    rows = cell.gates * hidden
    w = LayerWeights(
        *(
            (torch.randn(s, generator=g) / hidden**0.5).to(device)
            for s in [(rows, 3), (rows, hidden), (rows,), (rows,)]
        )
    )
    x = torch.randn(steps, batch, 3, generator=g).to(device)
    states = (torch.rand(steps + 1, batch, hidden, generator=g) * 2 - 1).to(device)
    lo, hi = cell.bounds(states[0], steps)
    twin_states, twin_record, rec = states.clone(), record().to(device), record().to(device)
    fused = kernels.FusedIteration(cell, x, w, states, lo, hi, rec, chunk)
    if sweep:
        newton.sweep(cell, x, twin_states, w, None, lo, hi, twin_record)
        fused.sweep(rec)
    else:
        kernels.fused_iteration_ref(cell, x, w, twin_states, lo, hi, twin_record)
        fused()
    assert rel_err(states.cpu(), twin_states.cpu()) < 1e-5
    assert torch.equal(rec[:3], twin_record[:3])  # stopped, iterations, converged
    assert rel_err(rec[newton.CHANGE].cpu(), twin_record[newton.CHANGE].cpu()) < 1e-4


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize(("steps", "batch", "hidden", "chunk"), extended_except(ITERATION_CASES, first=2))
def test_a_fused_iteration_matches_its_twin(kind, steps, batch, hidden, chunk) -> None:
    check_fused_iteration("cpu", kind, steps, batch, hidden, chunk)


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize(("steps", "batch", "hidden"), extended_except([(23, 3, 5), (40, 2, 20)], first=1))
def test_a_fused_sweep_matches_its_twin(kind, steps, batch, hidden) -> None:
    """``FusedIteration.sweep``: the cell at every step from the last states, no scan, and the
    sweeps' rule into their record, as ``newton.sweep``."""
    check_fused_iteration("cpu", kind, steps, batch, hidden, None, sweep=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize(("steps", "batch", "hidden", "chunk"), [*ITERATION_CASES, (3000, 16, 64, None)])
@pytest.mark.parametrize("sweep", [False, True])
def test_a_fused_iteration_matches_its_twin_on_a_gpu(kind, steps, batch, hidden, chunk, sweep) -> None:
    check_fused_iteration("cuda", kind, steps, batch, hidden, chunk, sweep)


@pytest.mark.parametrize("kind", extended_except(["tanh", "gru"], "tanh"))
@pytest.mark.parametrize("solver", ["newton", "quasi-newton"])
def test_a_module_solves_its_forward_in_the_kernels(monkeypatch, kind, solver) -> None:
    """strategy="triton": a Newton forward runs whole in ``FusedIteration`` (quasi-Newton: its
    correction, update and rule in the kernels) and gives torch.nn's outputs and gradients."""
    calls = {"fused": 0, "update": 0, "diagonal": 0}
    fused, update = kernels.FusedIteration.__call__, kernels.newton_update
    recurrence = diagonal.diagonal_recurrence

    def counted(name, real):
        def call(*a, **k):
            calls[name] += 1
            return real(*a, **k)

        return call

    monkeypatch.setattr(kernels.FusedIteration, "__call__", counted("fused", fused))
    monkeypatch.setattr(kernels, "newton_update", counted("update", update))
    monkeypatch.setattr(diagonal, "diagonal_recurrence", counted("diagonal", recurrence))
    ref, ours = pair(kind, 2, 6, dtype=torch.float32, strategy="triton", chunk=4, forward_solver=solver)
    x = torch.randn(23, 2, 2, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out, got = ref(x)[0], ours(x)[0]
    (stats,) = ours.solver_stats
    assert stats.converged and (out - got).abs().max() < 1e-5
    assert calls["update"] == stats.iterations
    assert calls["fused"] == (stats.iterations if solver == "newton" else 0)
    assert calls["diagonal"] == (stats.iterations if solver == "quasi-newton" else 0)
    g = torch.randn_like(out)
    assert rel_err(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(got, x, g)[0]) < 1e-4


@pytest.mark.parametrize("kind", extended_except(["tanh", "gru"], "tanh"))
def test_the_kernels_freeze_the_iterate_past_the_stop(monkeypatch, kind) -> None:
    """As on a GPU, the host reads the flag two iterations late: the kernels leave the states as the
    stop found them, so they and the stats are those of a check after every iteration, bit for bit."""
    _, ours = pair(kind, 2, 6, dtype=torch.float32, strategy="triton", forward_solver="newton")
    x = torch.randn(16, 2, 2, generator=torch.Generator().manual_seed(3))
    same_read_early_or_late(monkeypatch, ours, x, "cpu", 2)


def same_read_early_or_late(monkeypatch, module, x: torch.Tensor, device: str, late: int) -> torch.Tensor:
    """``module``'s output when the host reads the stopping flag ``late`` iterations late and when
    it reads it at once: bit for bit the same, with the same stats, converged; returns the first."""
    results = []
    for lookahead in (late, 0):
        monkeypatch.setitem(newton.LOOKAHEAD, device, lookahead)
        results.append((module(x)[0], module.solver_stats[0]))
    (a, stats_a), (b, stats_b) = results
    assert stats_a.converged and stats_a == stats_b and torch.equal(a, b)
    return a


@pytest.mark.parametrize("terms", extended_except([1, 3], 1))
def test_the_scan_reads_the_record_and_does_nothing_once_it_says_stopped(terms) -> None:
    """The transposed scan of a fused iteration: while the record says running, the scan itself;
    once it says stopped, no program writes (the result keeps the NaN torch.empty filled it with)."""
    from kernel_cases import chain_case

    from bppsa_core.chain import FactoredChain
    from bppsa_core.triton.chunk_scan import factored_scan, factored_scan_ref

    torch.use_deterministic_algorithms(True)  # torch.empty filled with NaN
    try:
        chain, x, b = chain_case(37, 3, 5, True, terms)
        chain = FactoredChain(chain.scales, chain.weights, chain.diagonal, transposed=True)
        running = factored_scan(chain, x, b, 4, stop=record())
        assert rel_err(running, factored_scan_ref(chain, x, b, 4)) < 1e-5
        assert factored_scan(chain, x, b, 4, stop=record(stopped=True)).isnan().all()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tanh", "relu", "gru", "lstm"])
@pytest.mark.parametrize("solver", ["newton", "quasi-newton"])
def test_a_newton_forward_on_a_gpu_gives_cudnns_outputs_and_gradients(monkeypatch, kind, solver) -> None:
    """strategy="auto" on a GPU: an RNN's or GRU's Newton iterations run whole in the kernels, any
    other's end in them; the outputs and gradients are cuDNN's in full float32 (not TF32, which cuDNN
    may use otherwise), and reading the stopping flag one iteration late (the GPU's default) changes
    neither them nor the stats."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    calls = []
    fused = kernels.FusedIteration.__call__
    monkeypatch.setattr(kernels.FusedIteration, "__call__", lambda self: calls.append(1) or fused(self))
    ref, ours = pair(kind, 3, 20, dtype=torch.float32, forward_solver=solver)
    ref, ours = ref.cuda(), ours.cuda()
    x = torch.randn(500, 16, 3, generator=torch.Generator().manual_seed(0)).cuda().requires_grad_()
    out = ref(x)[0]
    got = same_read_early_or_late(monkeypatch, ours, x, "cuda", 1)
    stats = ours.solver_stats[0]
    assert (out - got).abs().max() < 1e-5
    assert len(calls) == (2 * stats.iterations + 1 if solver == "newton" and kind != "lstm" else 0)
    g = torch.randn_like(out)
    assert rel_err(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(got, x, g)[0]) < 1e-4


@pytest.mark.parametrize(
    ("steps", "shape", "chunk"),
    # one step; shorter than a tile; chunks of one tile; a chunk not a multiple of a tile (rounded
    # up); a broadcast a; several tiles a chunk and channels past a block; more chunks than a tile
    extended_except(
        [(1, (1,), None), (5, (3, 5), None), (200, (2, 20), 64), (777, (3, 7), 100), (130, (2, 40), None),
         (1000, (4, 33), 256), (5000, (2, 3), 64)],
        first=5,
    ),
)  # fmt: skip
def test_the_diagonal_recurrence_matches_its_twin(steps, shape, chunk) -> None:
    g = torch.Generator().manual_seed(steps)
    a = torch.rand(steps, *shape, generator=g) * 1.9 - 0.95
    if steps == 130:
        a = a[:, :1]  # shared by the batch, as a quasi-Newton chain's diagonal may be
    b = torch.randn(steps, *shape, generator=g)
    x0 = torch.randn(*shape, generator=g)
    got = diagonal.diagonal_recurrence(a, b, x0, chunk)
    assert got.shape == b.shape and rel_err(got, diagonal.diagonal_recurrence_ref(a, b, x0)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [3000, 100_000])
def test_the_diagonal_recurrence_matches_its_twin_on_a_gpu(steps) -> None:
    g = torch.Generator().manual_seed(steps)
    a = (torch.rand(steps, 16, 20, generator=g) * 1.9 - 0.95).cuda()
    b, x0 = torch.randn(steps, 16, 20, generator=g).cuda(), torch.randn(16, 20, generator=g).cuda()
    got = diagonal.diagonal_recurrence(a, b, x0)
    assert rel_err(got, diagonal.diagonal_recurrence_ref(a.double(), b.double(), x0.double())) < 1e-6


def test_the_diagonal_recurrence_reads_the_record_and_does_nothing_once_it_says_stopped() -> None:
    torch.use_deterministic_algorithms(True)  # torch.empty filled with NaN
    try:
        g = torch.Generator().manual_seed(0)
        a, b, x0 = torch.rand(300, 2, 5, generator=g), torch.randn(300, 2, 5, generator=g), torch.zeros(2, 5)
        running = diagonal.diagonal_recurrence(a, b, x0, 64, stop=record())
        assert rel_err(running, diagonal.diagonal_recurrence_ref(a, b, x0)) < 1e-6
        assert diagonal.diagonal_recurrence(a, b, x0, 64, stop=record(stopped=True)).isnan().all()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize("converged", [False, True])
def test_the_fallback_walk_matches_its_twin_and_runs_only_where_the_solve_did_not_converge(kind, converged):
    cell = CELLS[kind]
    steps, batch, hidden = 17, 3, 6
    g = torch.Generator().manual_seed(7)
    rows = cell.gates * hidden
    w = LayerWeights(*(torch.randn(s, generator=g) for s in [(rows, 2), (rows, hidden), (rows,), (rows,)]))
    x = torch.randn(steps, batch, 2, generator=g)
    states = torch.rand(steps + 1, batch, hidden, generator=g) * 2 - 1
    rec = record()
    rec[newton.CONVERGED] = float(converged)
    walked, twin = states.clone(), states.clone()
    lo, hi = cell.bounds(states[0], steps)
    kernels.FusedIteration(cell, x, w, walked, lo, hi, rec, None).fall_back()
    kernels.fall_back_ref(cell, x, w, twin, rec)
    if converged:
        assert torch.equal(walked, states) and torch.equal(twin, states)
    else:
        assert torch.equal(walked[0], states[0]) and rel_err(walked, twin) < 1e-5


@pytest.mark.parametrize("kind", extended_except(["tanh", "gru"], "tanh"))
@pytest.mark.parametrize("iters", [1, 10])  # 10: converged (in 4 or 5), and every one queued
@pytest.mark.parametrize("sweeps", extended_except([0, newton.MAX_SWEEPS], 0))
def test_a_captured_solve_reads_nothing_on_the_host_and_falls_back_on_the_device(
    monkeypatch, kind, iters, sweeps
):
    """The solve as a CUDA graph captures it (``captured``): every iteration (and Picard sweep)
    queued, none read on the host; converged, the same states and stats as the eager solve; not
    converged in ``iters``, the native states from the device's fallback (not the last iterate) and
    stats that say so."""
    from bppsa_core.dispatch import ScanOptions
    from bppsa_core.layer import cell_of

    ref, ours = pair(kind, 2, 8, dtype=torch.float32)
    x = torch.randn(16, 2, 2, generator=torch.Generator().manual_seed(5))
    cell = cell_of(ours.mode)
    w = LayerWeights(*(p.detach() for p in ours._flat_weights[:4]))
    s0 = torch.zeros(2, 8)
    options = newton.SolverOptions("newton", max_iters=iters, sweeps=sweeps)
    scan_options = ScanOptions("triton")
    monkeypatch.setattr(newton._Watch, "stopped", lambda self: pytest.fail("read on the host"))
    captured, stats = newton._solve(cell, x, s0, w, None, options, scan_options, None, True, captured=True)
    monkeypatch.undo()
    eager, eager_stats = newton.solve(cell, x, s0, w, None, options, scan_options)
    assert isinstance(stats, torch.Tensor) and newton.SolveStats.from_tensor(stats) == eager_stats
    assert eager_stats.converged == (iters == 10) and (eager_stats.sweeps > 1) == (sweeps > 0)
    if eager_stats.converged:
        assert torch.equal(captured, eager)
    else:
        native = ref(x, s0.unsqueeze(0))[0].detach()
        assert eager_stats.iterations == iters and rel_err(captured, native) < 1e-5
        last_iterate = newton.solve(cell, x, s0, w, None, options, ScanOptions("chunked"))[0]
        assert sweeps or rel_err(last_iterate, native) > 1e-3  # what the fallback replaced (from zeros)
