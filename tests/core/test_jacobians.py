"""Folded per-step Jacobians against autograd's, one cell step at a time."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from bppsa_core import jacobians
from bppsa_core.jacobians import (
    BLOCK_BYTES,
    GRUCell,
    LayerWeights,
    LSTMCell,
    PreviousStates,
    RNNCell,
    batch_major,
    block_budget,
    buffer,
    layer_grads,
    reusing_buffers,
)

F64 = torch.float64


def weights(cell_gates: int, features: int, hidden: int, seed: int) -> LayerWeights:
    g = torch.Generator().manual_seed(seed)
    rows = cell_gates * hidden
    return LayerWeights(
        torch.randn(rows, features, generator=g, dtype=F64),
        torch.randn(rows, hidden, generator=g, dtype=F64) * 0.5,
        torch.randn(rows, generator=g, dtype=F64),
        torch.randn(rows, generator=g, dtype=F64),
    )


def step(cell, x: torch.Tensor, h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """One step through PyTorch's own cell functions."""
    if isinstance(cell, GRUCell):
        return torch.gru_cell(x, h, w.w_ih, w.w_hh, w.b_ih, w.b_hh)
    fn = torch.rnn_tanh_cell if cell.nonlinearity == "tanh" else torch.rnn_relu_cell
    return fn(x, h, w.w_ih, w.w_hh, w.b_ih, w.b_hh)


@pytest.mark.parametrize("cell", [RNNCell("tanh"), RNNCell("relu"), GRUCell()], ids=["tanh", "relu", "gru"])
@pytest.mark.parametrize("hidden", [1, 5])
def test_chain_elements_are_the_step_jacobians(cell, hidden: int) -> None:
    steps, batch, features = 4, 3, 2
    w = weights(cell.gates, features, hidden, seed=hidden)
    x = torch.randn(steps, batch, features, dtype=F64)
    h = [torch.randn(batch, hidden, dtype=F64)]
    for t in range(steps):
        h.append(step(cell, x[t], h[-1], w))
    hs = torch.stack(h[1:])
    h_prev = torch.stack(h[:-1])
    elements = cell.chain(cell.factors(x, h_prev, hs, w), w).dense()
    assert elements.shape == (steps, batch, hidden, hidden)
    for t in range(steps):
        for b in range(batch):
            one = x[t, b : b + 1]
            jac = torch.autograd.functional.jacobian(
                lambda hp, one=one: step(cell, one, hp.unsqueeze(0), w)[0], h_prev[t, b]
            )
            assert rel_err(jac, elements[t, b]) < 1e-12, (t, b)


CELLS = {"tanh": RNNCell("tanh"), "relu": RNNCell("relu"), "gru": GRUCell(), "lstm": LSTMCell()}


def run_cell(cell, x, w, h0, c0):
    """States h_1..h_T (and c_1..c_T) through PyTorch's own cell functions."""
    hs, cs, h, c = [], [], h0, c0
    for t in range(x.shape[0]):
        if isinstance(cell, LSTMCell):
            h, c = torch.lstm_cell(x[t], (h, c), w.w_ih, w.w_hh, w.b_ih, w.b_hh)
            cs.append(c)
        else:
            h = step(cell, x[t], h, w)
        hs.append(h)
    return torch.stack(hs), (torch.stack(cs) if cs else None)


@pytest.mark.parametrize("name", CELLS)
def test_elements_with_keep_are_the_step_jacobians_or_identities(name: str) -> None:
    """Every element against autograd's Jacobian of one step of the state (h, or (h, c)); steps
    past a sequence's end (keep = 0) are identities; the tangent chain holds the transposes, reversed."""
    cell = CELLS[name]
    steps, batch, features, hidden = 5, 3, 2, 4
    w = weights(cell.gates, features, hidden, seed=7)
    x = torch.randn(steps, batch, features, dtype=F64)
    h0, c0 = torch.randn(batch, hidden, dtype=F64), torch.randn(batch, hidden, dtype=F64)
    lstm = isinstance(cell, LSTMCell)
    hs, cs = run_cell(cell, x, w, h0, c0 if lstm else None)
    h_prev = torch.cat((h0.unsqueeze(0), hs[:-1]))
    keep = (torch.arange(1, steps + 1).unsqueeze(1) <= torch.tensor([5, 2, 4])).to(F64).unsqueeze(-1)
    factors = cell.factors(x, h_prev, hs * keep, w, c0 if lstm else None, keep)
    elements = cell.chain(factors, w).dense()
    tangent = cell.tangent_chain(factors, w).dense()
    size = 2 * hidden if lstm else hidden
    assert elements.shape == (steps, batch, size, size)
    c_prev = torch.cat((c0.unsqueeze(0), cs[:-1])) if lstm else None
    for t in range(steps):
        assert torch.equal(tangent[steps - 1 - t], elements[t].transpose(-1, -2))
        for b in range(batch):
            if keep[t, b] == 0:
                assert torch.equal(elements[t, b], torch.eye(size, dtype=F64)), (t, b)
                continue
            one = x[t, b : b + 1]
            if lstm:

                def f(s, one=one):
                    h, c = torch.lstm_cell(
                        one, (s[:hidden][None], s[hidden:][None]), w.w_ih, w.w_hh, w.b_ih, w.b_hh
                    )
                    return torch.cat((h[0], c[0]))

                point = torch.cat((h_prev[t, b], c_prev[t, b]))
            else:

                def f(s, one=one):
                    return step(cell, one, s.unsqueeze(0), w)[0]

                point = h_prev[t, b]
            jac = torch.autograd.functional.jacobian(f, point)
            assert rel_err(jac, elements[t, b]) < 1e-12, (t, b)


@pytest.mark.parametrize("name", CELLS)
def test_the_direct_tangent_is_the_adjoint_of_the_preactivation_gradients(name: str) -> None:
    """<delta_in(g), e_in> + <delta_hid(g), e_hid> = <g, c(e_in, e_hid)> for every g, e."""
    cell = CELLS[name]
    steps, batch, hidden = 4, 2, 3
    w = weights(cell.gates, 2, hidden, seed=1)
    lstm = isinstance(cell, LSTMCell)
    x = torch.randn(steps, batch, 2, dtype=F64)
    h_prev = torch.randn(steps, batch, hidden, dtype=F64)
    h = torch.rand(steps, batch, hidden, dtype=F64)
    factors = cell.factors(x, h_prev, h, w, torch.randn(batch, hidden, dtype=F64) if lstm else None)
    g = torch.randn(steps, batch, 2 * hidden if lstm else hidden, dtype=F64)
    rows = cell.gates * hidden
    e_in, e_hid = torch.randn(steps, batch, rows, dtype=F64), torch.randn(steps, batch, rows, dtype=F64)
    d_in, d_hid = cell.preactivation_grads(g.clone(), factors)
    lhs = (d_in * e_in).sum() + (d_hid * e_hid).sum() if d_in is not d_hid else (d_in * (e_in + e_hid)).sum()
    rhs = (g * cell.direct_tangent(e_in, e_hid, factors)).sum()
    assert abs(lhs - rhs) < 1e-12 * abs(lhs)


def test_unknown_nonlinearity_is_named() -> None:
    with pytest.raises(ValueError, match="unknown nonlinearity 'sigmoid'; accepted: tanh, relu"):
        RNNCell("sigmoid")


def test_layer_grads_consume_the_deltas_block_by_block_and_sum_them_exactly() -> None:
    from bppsa_core.jacobians import layer_grads

    g = torch.Generator().manual_seed(0)
    steps, batch, features, hidden = 5000, 4, 3, 5
    w = weights(3, features, hidden, seed=3)
    x = torch.randn(steps, batch, features, generator=g, dtype=F64)
    h_prev = torch.randn(steps, batch, hidden, generator=g, dtype=F64)
    gi = torch.randn(steps, batch, 3 * hidden, generator=g, dtype=F64)
    gh = torch.randn(steps, batch, 3 * hidden, generator=g, dtype=F64)
    asked = []

    def deltas(t: slice):
        asked.append(t)
        return gi[t], gh[t]

    dx, dw = layer_grads(deltas, x, h_prev, w)
    assert len(asked) > 1 and sum(len(range(steps)[t]) for t in asked) == steps  # blocks, each step once
    flat = lambda t: t.flatten(0, -2)  # noqa: E731
    assert rel_err(flat(gi).t() @ flat(x), dw.w_ih) < 1e-12
    assert rel_err(flat(gh).t() @ flat(h_prev), dw.w_hh) < 1e-12
    assert rel_err(flat(gi).sum(0), dw.b_ih) < 1e-12 and rel_err(flat(gh).sum(0), dw.b_hh) < 1e-12
    assert rel_err(gi @ w.w_ih, dx) < 1e-12


@pytest.mark.parametrize(
    "block", [slice(0, 4), slice(3, 7), slice(5, 40), slice(0, 1), slice(4, 4), slice(None)]
)
def test_previous_states_are_h0_then_the_outputs_and_a_view_after_the_first_step(block) -> None:
    h0, h = torch.randn(3, 5), torch.randn(9, 3, 5)
    prev = PreviousStates(h0, h)
    assert prev.shape == h.shape
    torch.testing.assert_close(prev[block], torch.cat((h0.unsqueeze(0), h[:-1]))[block], rtol=0, atol=0)
    if (block.start or 0) > 0:  # no copy: the outputs' own memory
        assert (
            prev[block].numel() == 0
            or prev[block].untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
        )
    torch.testing.assert_close(prev.whole(), torch.cat((h0.unsqueeze(0), h[:-1])), rtol=0, atol=0)
    with pytest.raises(IndexError, match="contiguous blocks of steps, got step 2"):
        prev[::2]


def test_a_strided_group_of_samples_is_copied_a_block_at_a_time_into_one_buffer() -> None:
    """Samples 1..3 of 5 viewed out of the batch (a sequence-parallel rank's group): each block's
    previous states and outputs are the right steps, contiguous, views of one buffer that the next
    block reuses; the whole sequence is a fresh copy."""
    h0, h = torch.randn(5, 4), torch.randn(20, 5, 4)
    group, h0g = h[:, 1:4], h0[1:4]
    prev = PreviousStates(h0g, group)
    joined = torch.cat((h0g.unsqueeze(0), group[:-1]))
    buffers = set()
    for lo, hi in ((12, 20), (4, 12), (0, 4)):  # from the end down, as a walk takes them
        states, outputs = prev[lo:hi], prev.outputs(lo, hi)
        assert states.is_contiguous() and outputs.is_contiguous()
        torch.testing.assert_close(states, joined[lo:hi], rtol=0, atol=0)
        torch.testing.assert_close(outputs, group[lo:hi], rtol=0, atol=0)
        assert prev[lo:hi].data_ptr() == states.data_ptr()  # the same block again: no new copy
        buffers.add(states.untyped_storage().data_ptr())
    assert len(buffers) == 1
    whole = prev.whole()
    assert whole.untyped_storage().data_ptr() not in buffers
    torch.testing.assert_close(whole, joined, rtol=0, atol=0)
    assert prev[3:3].numel() == 0 and prev.outputs(3, 3).numel() == 0


def test_a_group_of_samples_in_batch_major_memory_is_taken_in_views() -> None:
    """Samples 1..3 of 5 in batch-major memory (a CPU rank's outputs): every block after the first is
    a view of the outputs, the first joined to h0, and the products read them sample by sample: the
    same weight gradient as the contiguous copy's."""
    h0, h = torch.randn(5, 4, dtype=F64), torch.randn(5, 20, 4, dtype=F64).transpose(0, 1)
    group, h0g = h[:, 1:4], h0[1:4]
    assert batch_major(group) and not batch_major(group.contiguous()) and not batch_major(h0g)
    prev = PreviousStates(h0g, group)
    joined = torch.cat((h0g.unsqueeze(0), group[:-1]))
    for lo, hi in ((12, 20), (4, 12), (0, 4)):
        states, outputs = prev[lo:hi], prev.outputs(lo, hi)
        torch.testing.assert_close(states, joined[lo:hi], rtol=0, atol=0)
        torch.testing.assert_close(outputs, group[lo:hi], rtol=0, atol=0)
        assert _storage(outputs) == _storage(h) and (lo == 0) != (_storage(states) == _storage(h))
    d = torch.randn(8, 3, 16, dtype=F64)
    wide = torch.randn(3, 20, 16, dtype=F64).transpose(0, 1)[4:12]  # as wide as _SAMPLE_WISE
    got = jacobians._add_product(None, d, wide)
    torch.testing.assert_close(got, d.flatten(0, 1).t() @ wide.flatten(0, 1), rtol=1e-12, atol=1e-12)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.fixture
def any_size_buffers(monkeypatch):
    """Named buffers for scratch of any size, so that small tensors show how they are kept."""
    from bppsa_core import jacobians

    monkeypatch.setattr(jacobians, "SCRATCH_MIN_BYTES", 0)


def test_scratch_under_the_bound_is_a_new_tensor_in_a_scope_too() -> None:
    from bppsa_core.jacobians import SCRATCH_MIN_BYTES

    like = torch.zeros(1)
    with reusing_buffers():
        small = [buffer("a", (SCRATCH_MIN_BYTES // 4 - 1,), like) for _ in range(2)]
        large = [buffer("b", (SCRATCH_MIN_BYTES // 4,), like) for _ in range(2)]
        assert _storage(small[0]) != _storage(small[1]) and _storage(large[0]) == _storage(large[1])


@pytest.mark.usefixtures("any_size_buffers")
def test_buffers_are_kept_by_name_within_a_scope_and_fresh_outside() -> None:
    like = torch.zeros(1, dtype=torch.float64)
    held = [buffer("a", (2, 3), like), buffer("a", (2, 3), like)]  # kept alive: no address reused
    assert _storage(held[0]) != _storage(held[1])
    with reusing_buffers():
        a = buffer("a", (2, 3), like)
        assert a.shape == (2, 3) and a.dtype == torch.float64 and a.is_contiguous()
        assert _storage(buffer("a", (3, 2), like)) == _storage(a)  # same size: the same buffer
        assert _storage(buffer("a", (5,), like)) == _storage(a)  # smaller: a view of it
        assert _storage(buffer("b", (2, 3), like)) != _storage(a)  # another name, another buffer
        grown = buffer("a", (4, 3), like)  # larger: grown, and kept from then on
        assert _storage(grown) != _storage(a) and _storage(buffer("a", (2, 3), like)) == _storage(grown)
        single = buffer("a", (2, 3), like.float())  # another dtype: replaced
        assert single.dtype == torch.float32 and _storage(single) != _storage(grown)
        with reusing_buffers():  # a scope inside a scope is the same scope
            assert _storage(buffer("a", (2, 3), like.float())) == _storage(single)
        assert _storage(buffer("a", (2, 3), like.float())) == _storage(single)
    outside = buffer("a", (2, 3), like.float())  # the scope's buffers are gone with it
    assert _storage(outside) != _storage(single)


@pytest.mark.usefixtures("any_size_buffers")
def test_a_thread_keeps_a_cpu_scopes_buffers_for_its_next_scope_up_to_the_bound(monkeypatch) -> None:
    """The next scope starts with the last one's CPU buffers, the smallest first while their bytes
    fit ``KEEP_BYTES``; a larger one, and any other device's, is made afresh."""
    from bppsa_core import jacobians

    like = torch.zeros(1)
    monkeypatch.setattr(jacobians, "KEEP_BYTES", 0)
    with reusing_buffers():  # what earlier scopes of this thread left is dropped
        pass
    monkeypatch.setattr(jacobians, "KEEP_BYTES", 4 * (4 + 8))
    with reusing_buffers():
        small, middle, large = (buffer(n, (k,), like) for n, k in (("s", 4), ("m", 8), ("l", 9)))
        buffer("meta", (2,), torch.empty(0, device="meta"))
    assert set(jacobians._scope.spare) == {"s", "m"}  # 48 bytes of 48; the 36 more and meta's not
    with reusing_buffers():
        assert _storage(buffer("s", (4,), like)) == _storage(small)
        assert _storage(buffer("m", (2, 4), like)) == _storage(middle)
        assert _storage(buffer("l", (9,), like)) != _storage(large)
    monkeypatch.setattr(jacobians, "KEEP_BYTES", 0)
    with reusing_buffers():  # none kept
        kept = buffer("s", (4,), like)
    with reusing_buffers():
        assert _storage(buffer("s", (4,), like)) != _storage(kept)


@pytest.mark.usefixtures("any_size_buffers")
def test_walks_one_after_another_in_a_scope_share_the_buffer_and_read_their_own_states() -> None:
    """Two groups of samples walked in turn in one scope: the second group's blocks are its own
    steps, copied afresh into the buffer the first group left, not the first group's stale block."""
    h0, h = torch.randn(4, 3), torch.randn(12, 4, 3)
    storages = set()
    with reusing_buffers():
        for s in (slice(0, 2), slice(2, 4)):
            prev = PreviousStates(h0[s], h[:, s])
            joined = torch.cat((h0[s].unsqueeze(0), h[:-1, s]))
            for lo, hi in ((6, 12), (0, 6)):
                torch.testing.assert_close(prev[lo:hi], joined[lo:hi], rtol=0, atol=0)
                torch.testing.assert_close(prev.outputs(lo, hi), h[lo:hi, s], rtol=0, atol=0)
                storages.add(_storage(prev[lo:hi]))
    assert len(storages) == 1


def test_a_block_budget_sets_the_steps_per_block_within_its_scope_only() -> None:
    """``layer_grads`` takes its deltas in blocks of as many steps as the scope's budget holds (None
    keeps the budget), the same gradients whatever the blocks, and the default once the scope ends."""
    steps, batch, hidden = 40, 2, 3
    w = weights(1, 1, hidden, 0)
    x, h_prev = torch.randn(steps, batch, 1, dtype=F64), torch.randn(steps, batch, hidden, dtype=F64)
    g = torch.randn(steps, batch, hidden, dtype=F64)
    starts = []

    def deltas(t: slice) -> tuple[torch.Tensor, torch.Tensor]:
        starts.append(t.start)
        return g[t], g[t]

    per_step = batch * (4 * hidden + 1 + hidden) * 8  # what layer_grads counts per step (float64)
    whole = layer_grads(deltas, x, h_prev, w)
    assert starts == [0]
    starts.clear()
    with block_budget(7 * per_step), block_budget(None):
        blocked = layer_grads(deltas, x, h_prev, w)
    assert starts == [35, 28, 21, 14, 7, 0]  # blocks of 7 steps, the last one first
    starts.clear()
    layer_grads(deltas, x, h_prev, w)
    assert starts == [0]
    torch.testing.assert_close(blocked[0], whole[0], rtol=1e-12, atol=0)
    for name, grad in vars(blocked[1]).items():
        torch.testing.assert_close(grad, getattr(whole[1], name), rtol=1e-12, atol=1e-14)


def test_blocks_off_the_cpu_take_the_gpu_budget() -> None:
    """Outside a scope, ``layer_grads`` on a CPU takes blocks of ``BLOCK_BYTES["cpu"]``, on any other
    device of ``BLOCK_BYTES["gpu"]``: a sequence a GPU takes in one block is several blocks on a CPU.
    (The meta device stands in for a GPU: only the device's type is read, and no numbers are made.)"""
    batch, hidden = 4, 3
    per_step = batch * (4 * hidden + 1 + hidden) * 4  # what layer_grads counts per step (float32)
    steps = BLOCK_BYTES["gpu"] // per_step  # the most a GPU's block takes
    cpu_block = BLOCK_BYTES["cpu"] // per_step
    assert cpu_block < steps
    for device, expected in (("meta", [0]), ("cpu", list(range(0, steps, cpu_block))[::-1])):
        w = LayerWeights(*(t.float().to(device) for t in vars(weights(1, 1, hidden, 0)).values()))
        x, h_prev = (
            torch.zeros(steps, batch, 1, device=device),
            torch.zeros(steps, batch, hidden, device=device),
        )
        g = torch.zeros(steps, batch, hidden, device=device)
        starts = []

        def deltas(t: slice, g=g, starts=starts) -> tuple[torch.Tensor, torch.Tensor]:
            starts.append(t.start)
            return g[t], g[t]

        layer_grads(deltas, x, h_prev, w, need_input=False)
        assert starts == expected, device
