"""bppsa_core.nn.RNN / GRU / LSTM: the same outputs and gradients as torch.nn's, for every layout,
option and scan strategy (PyTorch's own tests, rewritten, are in test_conformance.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent import F64, KINDS, assert_same, pair, run, state, state_leaves
from torch.autograd import forward_ad
from torch.nn.utils.rnn import pack_sequence

from benchmarks.common import profiled_events
from bppsa_core import nn as bnn
from bppsa_core import ops as bppsa_ops

# Indices into recurrent.flat's list: output, h_n (and an LSTM's c_n).
LOSSES = {"h_n": [1], "output": [0], "all": None}


def check(
    kind, steps, batch, features, hidden, loss="all", tol=1e-10, dtype=F64, h0=True, lengths=None, **kwargs
):
    """Ours equals torch.nn on a random (padded or, given ``lengths``, packed) batch."""
    ref, ours = pair(kind, features, hidden, dtype=dtype, **kwargs)
    hx = state(ours, batch, dtype) if h0 else None
    if lengths is not None:
        seqs = [torch.randn(n, features, dtype=dtype, requires_grad=True) for n in lengths]
        inp, leaves = pack_sequence(seqs, enforce_sorted=False), seqs
    else:
        shape = (batch, steps, features) if ours.batch_first else (steps, batch, features)
        inp = torch.randn(shape, dtype=dtype, requires_grad=True)
        leaves = [inp]
    assert_same(ref, ours, inp, hx, [*leaves, *state_leaves(hx)], tol, LOSSES[loss])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("steps", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("loss", LOSSES)
def test_gradients_match_autograd_float64(kind: str, steps: int, loss: str) -> None:
    check(kind, steps, 3, 2, 4, loss)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("h0", [False, True])
def test_stacked_layers_batch_first_and_default_h0(kind, layers, batch_first, h0) -> None:
    for loss in LOSSES:
        check(kind, 11, 2, 3, 5, loss, h0=h0, num_layers=layers, batch_first=batch_first)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("batch", "hidden"), [(1, 1), (1, 6), (4, 1)])
def test_degenerate_sizes(kind: str, batch: int, hidden: int) -> None:
    check(kind, 9, batch, 1, hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_no_bias(kind: str) -> None:
    check(kind, 10, 2, 3, 4, bias=False, num_layers=2, bidirectional=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "opts", [{"strategy": "sequential"}, {"strategy": "blelloch", "levels": 2}, {"strategy": "chunked"}]
)
def test_float32_at_moderate_length(kind: str, opts: dict) -> None:
    check(kind, 300, 4, 3, 8, tol=1e-4, dtype=torch.float32, **opts)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layers", [1, 3])
def test_bidirectional_dropout_and_packed_sequences(kind: str, layers: int) -> None:
    for lengths in (None, [5, 1, 7, 3]):
        for dropout in (0.0, 0.5) if layers > 1 else (0.0,):
            check(kind, 7, 4, 3, 5, lengths=lengths, num_layers=layers, bidirectional=True, dropout=dropout)


@given(
    kind=st.sampled_from(list(KINDS)),
    steps=st.integers(1, 30),
    batch=st.integers(1, 3),
    hidden=st.integers(1, 6),
    layers=st.integers(1, 3),
    bidirectional=st.booleans(),
    dropout=st.sampled_from([0.0, 0.4]),
    packed=st.booleans(),
    batch_first=st.booleans(),
    loss=st.sampled_from(list(LOSSES)),
    strategy=st.sampled_from(["auto", "sequential", "blelloch", "chunked"]),
    chunk=st.one_of(st.none(), st.integers(1, 9)),
    data=st.data(),
)
def test_property_any_shape_any_layout_any_strategy(
    kind,
    steps,
    batch,
    hidden,
    layers,
    bidirectional,
    dropout,
    packed,
    batch_first,
    loss,
    strategy,
    chunk,
    data,
) -> None:
    lengths = data.draw(st.lists(st.integers(1, steps), min_size=batch, max_size=batch)) if packed else None
    check(
        kind, steps, batch, 2, hidden, loss, lengths=lengths, num_layers=layers, bidirectional=bidirectional,
        dropout=dropout if layers > 1 else 0.0, batch_first=batch_first, strategy=strategy, chunk=chunk,
    )  # fmt: skip


@pytest.mark.extended  # the Triton kernels' own tests run by default; these examples take seconds
@settings(max_examples=12)  # Triton's interpreter runs every program in Python
@given(
    kind=st.sampled_from(list(KINDS)),
    steps=st.integers(1, 16),
    batch=st.integers(1, 2),
    hidden=st.integers(1, 20),
    bidirectional=st.booleans(),
    packed=st.booleans(),
    chunk=st.one_of(st.none(), st.integers(1, 7)),
    data=st.data(),
)
def test_property_the_triton_kernels_in_float32(
    kind, steps, batch, hidden, bidirectional, packed, chunk, data
) -> None:
    lengths = data.draw(st.lists(st.integers(1, steps), min_size=batch, max_size=batch)) if packed else None
    check(
        kind, steps, batch, 2, hidden, tol=1e-4, dtype=torch.float32, lengths=lengths,
        bidirectional=bidirectional, strategy="triton", chunk=chunk,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", ["auto", "sequential", "chunked", "blelloch"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_a_relu_rnn_with_an_infinite_input_gets_torch_nns_gradients(strategy: str, value: float) -> None:
    """An infinite input makes later outputs inf or NaN; autograd's relu backward passes the
    gradient wherever an output is not <= 0 (NaN included), so the bias gradients stay finite. Ours
    are torch.nn's: the same non-finite entries, the finite ones equal, every sample."""
    torch.manual_seed(0)
    ref = torch.nn.RNN(3, 4, nonlinearity="relu").double()
    ours = bnn.RNN(3, 4, nonlinearity="relu", strategy=strategy).double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 2, 3, dtype=F64)
    x[2, 1, 0] = value
    grads = []
    for m in (ref, ours):
        out, _ = m(x)
        out.sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert torch.isfinite(grads[0][2]).all()  # the case: finite bias gradients from non-finite outputs
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input(kind: str) -> None:
    ref, ours = pair(kind, 2, 3)
    x = torch.randn(6, 2, dtype=F64, requires_grad=True)
    assert [t.shape for t in run(ours, x)][:2] == [(6, 3), (1, 3)]
    assert_same(ref, ours, x, leaves=[x])


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trips_with_torch_nn(kind: str) -> None:
    ref_cls, our_cls, extra = KINDS[kind]
    ref = ref_cls(3, 4, num_layers=2, bidirectional=True, **extra)
    ours = our_cls(3, 4, num_layers=2, bidirectional=True, **extra)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ours.named_parameters()]
    ours.load_state_dict(ref.state_dict())
    back = ref_cls(3, 4, num_layers=2, bidirectional=True, **extra)
    back.load_state_dict(ours.state_dict())
    for a, b in zip(ref.parameters(), back.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_bptt_mode_is_torch_nn(kind: str) -> None:
    check(kind, 8, 2, 3, 4, tol=1e-13, backward="bptt", num_layers=2, bidirectional=True)


@pytest.mark.parametrize("kind", KINDS)
def test_inference_output_matches_and_builds_no_graph(kind: str, monkeypatch) -> None:
    """Under no_grad the outputs are torch.nn's (to float64 rounding: the compiled CPU forward sums
    in another order) and no graph is built: the layers run, and make no autograd Function call at
    all. Forward-mode tangents still reach the outputs under no_grad, through the Function's jvp.
    Strategy "numba": the layers' compiled forward for every kind ("auto" leaves a wide LSTM's
    inference to torch.nn's forward on one thread, where no layer would run at all)."""
    from bppsa_core import layer as layer_mod

    ref, ours = pair(kind, 2, 3, num_layers=2, strategy="numba")
    x, tangent = torch.randn(5, 2, 2, dtype=F64), torch.randn(5, 2, 2, dtype=F64)
    calls, forwards = [], []
    real = bppsa_ops._EagerLayer.apply
    monkeypatch.setattr(bppsa_ops._EagerLayer, "apply", lambda *a: calls.append(1) or real(*a))
    real_forward = layer_mod.solved_forward
    monkeypatch.setattr(layer_mod, "solved_forward", lambda *a: forwards.append(1) or real_forward(*a))
    with torch.no_grad():
        out = run(ours, x)
    assert len(forwards) == 2 and not calls  # both layers ran, neither through a Function
    for a, b in zip(out, run(ref, x), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)
    tangents = []
    for module in (ref, ours):
        with torch.no_grad(), forward_ad.dual_level():
            outputs = run(module, forward_ad.make_dual(x, tangent))
            tangents.append(forward_ad.unpack_dual(outputs[0]).tangent)
    assert len(calls) == 2 and rel_err(tangents[0], tangents[1]) < 1e-10  # two layers


@pytest.mark.parametrize("kind", KINDS)
def test_inference_on_pytorchs_kernel_is_torch_nns_forward(kind: str, monkeypatch) -> None:
    """Under no_grad, a module whose layers would each run PyTorch's fused kernel ("sequential")
    runs torch.nn's forward instead: no layer call, torch.nn's outputs, every layer's stats native.
    One whose layers run the compiled CPU forward (strategy "numba") keeps its layers."""
    from bppsa_core import layer as layer_mod
    from bppsa_core.newton import NATIVE

    calls = []
    real = layer_mod.solved_forward
    monkeypatch.setattr(layer_mod, "solved_forward", lambda *a: calls.append(1) or real(*a))
    ref, ours = pair(kind, 2, 3, num_layers=2, bidirectional=True, strategy="sequential")
    x = torch.randn(5, 2, 2, dtype=F64)
    with torch.no_grad():
        out = run(ours, x)
        expected = run(ref, x)
    assert not calls and ours.solver_stats == [NATIVE] * 4
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ours.strategy = "numba"
    with torch.no_grad():
        out = run(ours, x)
    assert len(calls) == 4
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [bnn.RNN, bnn.LSTM])
def test_training_loop_with_an_optimizer_lowers_the_loss(cls) -> None:
    torch.manual_seed(0)
    rnn, head = cls(1, 8, batch_first=True), torch.nn.Linear(8, 2)
    opt = torch.optim.Adam([*rnn.parameters(), *head.parameters()], lr=1e-2)
    x = torch.bernoulli(torch.full((32, 50, 1), 0.5))
    y = (x.mean((1, 2)) > 0.5).long()
    losses = []
    for _ in range(30):
        opt.zero_grad()
        out, _ = rnn(x)
        loss = torch.nn.functional.cross_entropy(head(out[:, -1]), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backward": "magic"}, "unknown backward 'magic'; accepted: bppsa, bptt"),
        ({"strategy": "magic"}, "unknown scan strategy 'magic'; accepted: auto"),
        ({"chunk": 0}, "chunk must be a positive integer or None, got 0"),
        ({"levels": -2}, "levels must be a non-negative integer or None, got -2"),
        ({"segment": 0}, "segment must be a positive integer, got 0"),
    ],
)
@pytest.mark.parametrize("cls", [bnn.RNN, bnn.GRU, bnn.LSTM])
def test_bad_options_fail_at_construction(cls, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(2, 3, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_functional_call_and_parametrizations_use_the_current_weights(kind: str) -> None:
    ref, ours = pair(kind, 3, 4)
    x = torch.randn(6, 2, 3, dtype=F64)
    swapped = {n: p.detach() * 2 for n, p in ref.named_parameters()}
    expected = torch.func.functional_call(ref, swapped, (x,))[0]
    assert rel_err(expected, torch.func.functional_call(ours, swapped, (x,))[0]) < 1e-12
    grads_of = []
    for m in (ref, ours):
        torch.nn.utils.parametrizations.weight_norm(m, "weight_hh_l0")
        out, _ = m(x)
        out.pow(2).sum().backward()
        grads_of.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads_of, strict=True):
        assert b is not None and rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_autocast_trains_like_torch_nn(kind: str) -> None:
    """Under bfloat16 autocast the gradients match torch.nn's; where torch.nn's forward itself
    fails (oneDNN has no bfloat16 LSTM on a CPU without AVX-512), ours fails with the same error."""
    ref, ours = pair(kind, 3, 4, dtype=torch.float32)
    x = torch.randn(20, 2, 3)
    outcomes: list[list[torch.Tensor] | str] = []
    for m in (ref, ours):
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = m(x)
        except RuntimeError as exc:
            outcomes.append(str(exc))
            continue
        out.float().pow(2).sum().backward()
        outcomes.append([p.grad for p in m.parameters()])
    expected, got = outcomes
    if isinstance(expected, str):
        assert got == expected
        return
    assert not isinstance(got, str), got
    for a, b in zip(expected, got, strict=True):
        assert b.dtype == torch.float32 and rel_err(a, b) < 3e-2  # both see bfloat16 states


# ----------------------------------------------------------------------------------- long sequences


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("segment", [1, 3, 7])
def test_the_forward_in_segments_gives_the_same_results(kind: str, segment: int) -> None:
    for lengths in (None, [9, 4, 6]):
        check(kind, 9, 3, 2, 4, lengths=lengths, num_layers=2, bidirectional=True, segment=segment)


def _kernel_calls(monkeypatch) -> list[int]:
    """The steps of each call of PyTorch's fused kernel that a module's own layers make, from now on."""
    from bppsa_core import layer as layer_mod

    calls: list[int] = []
    real = layer_mod._native_call

    def counted(mode, x, batch_sizes, *rest):
        calls.append(x.shape[0] if batch_sizes is None else len(batch_sizes))
        return real(mode, x, batch_sizes, *rest)

    monkeypatch.setattr(layer_mod, "_native_call", counted)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_a_sequence_longer_than_one_kernel_call_takes_runs_in_the_modules_own_segments(kind, monkeypatch):
    """Where PyTorch's kernel takes at most ``layer.ONE_CALL_STEPS`` steps a call (cuDNN's 65,535;
    here the CPU's made 4), a call the module would hand to torch.nn's forward (inference on the
    kernel) runs in its own layers when the sequence is longer, in segments no longer than that even
    where ``segment`` is, with torch.nn's outputs; one that fits is still torch.nn's."""
    from bppsa_core import layer as layer_mod

    monkeypatch.setitem(layer_mod.ONE_CALL_STEPS, "cpu", 4)
    calls = _kernel_calls(monkeypatch)
    ref, ours = pair(kind, 2, 3, num_layers=2, batch_first=True, strategy="sequential", segment=100)
    for steps in (4, 9):
        x = torch.randn(2, steps, 2, dtype=F64)
        packed = pack_sequence([x[0], x[1, : steps - 1]])
        for inp in (x, packed):
            calls.clear()
            with torch.no_grad():
                out, expected = run(ours, inp), run(ref, inp)
            assert calls == ([] if steps == 4 else [4, 4, 1] * 2), (steps, calls)
            for a, b in zip(out, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_long_sequence_of_a_module_auto_leaves_to_torch_nn_trains_in_its_own_layers(monkeypatch) -> None:
    """The same for a module that "auto" leaves to torch.nn (a GRU wider than the CPU's compiled
    forward, which keeps the tape its walk needs, runs): past the kernel's limit it trains in its
    own layers, with torch.nn's gradients; a sequence that fits is still torch.nn's."""
    from bppsa_core import layer as layer_mod

    monkeypatch.setitem(layer_mod.ONE_CALL_STEPS, "cpu", 4)
    calls = []
    real = layer_mod.solved_forward
    monkeypatch.setattr(layer_mod, "solved_forward", lambda *a: calls.append(1) or real(*a))
    ref, ours = pair("gru", 2, 513, dtype=torch.float32)  # "auto" leaves float32 alone to torch.nn
    for steps in (4, 9):
        calls.clear()
        x = torch.randn(steps, 2, 2)
        grads = []
        for module in (ref, ours):
            module.zero_grad()
            run(module, x)[0].sum().backward()
            grads.append([p.grad for p in module.parameters()])
        assert len(calls) == (0 if steps == 4 else 1)
        for a, b in zip(*grads, strict=True):
            assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("mode", ["RNN_TANH", "GRU", "LSTM"])
def test_a_batch_major_forward_gives_the_same_outputs_in_batch_major_memory(mode: str) -> None:
    """``native_forward(batch_major=True)``: the outputs and last states of the time-major forward, bit
    for bit, as a (T, B, H) view of (B, T, H) memory; in one segment, in several, and where every
    sequence ends before the last segment (its outputs 0)."""
    from bppsa_core.layer import native_forward

    torch.manual_seed(0)
    module = {"GRU": torch.nn.GRU, "LSTM": torch.nn.LSTM}.get(mode, torch.nn.RNN)(2, 4, dtype=F64)
    weights = [p.detach() for p in module._flat_weights]
    x, h0 = torch.randn(10, 3, 2, dtype=F64), torch.randn(3, 4, dtype=F64)
    c0 = torch.randn(3, 4, dtype=F64) if mode == "LSTM" else None
    for segment, lengths in ((16, None), (3, None), (3, torch.tensor([5, 4, 2]))):
        expected = native_forward(mode, x, h0, c0, weights, lengths, segment)
        got = native_forward(mode, x, h0, c0, weights, lengths, segment, batch_major=True)
        assert got[0].shape == (10, 3, 4) and got[0].stride() == (4, 40, 1), (segment, lengths)
        for a, b in zip(got, expected, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), (segment, lengths)


def test_a_sequence_longer_than_a_segment_runs_in_segments(monkeypatch) -> None:
    from bppsa_core import layer

    calls = []
    real = layer._native_call

    def counted(mode, x, *args):
        calls.append(x.shape[0])
        return real(mode, x, *args)

    monkeypatch.setattr(layer, "_native_call", counted)
    rnn = bnn.GRU(1, 2, strategy="sequential")  # PyTorch's forward (on the CPU "auto" compiles it)
    out, _ = rnn(torch.randn(2 * layer.SEGMENT + 5, 1, 1))
    assert calls == [layer.SEGMENT, layer.SEGMENT, 5] and out.shape == (2 * layer.SEGMENT + 5, 1, 2)


@pytest.mark.parametrize("mode", ["RNN_TANH", "GRU", "LSTM"])
def test_the_native_forward_runs_in_training_mode_only_where_autograd_records(monkeypatch, mode) -> None:
    """cuDNN keeps what its backward needs only in training mode and refuses the backward without
    it (distributed BPTT differentiates this forward); the layer's own forward, under no_grad, keeps
    nothing. The flag after the dropout probability is PyTorch's ``train``."""
    from bppsa_core import layer

    seen = []
    real = layer._NATIVE[mode]
    monkeypatch.setitem(layer._NATIVE, mode, lambda *a: seen.append(a[-3]) or real(*a))
    gates = {"RNN_TANH": 1, "GRU": 3, "LSTM": 4}[mode]
    weights = [torch.randn(gates * 2, n, requires_grad=True) for n in (1, 2)]
    x, h0 = torch.randn(4, 3, 1), torch.zeros(3, 2)
    c0 = torch.zeros(3, 2) if mode == "LSTM" else None
    with torch.no_grad():
        layer.native_forward(mode, x, h0, c0, weights, None)
    out, _, _ = layer.native_forward(mode, x, h0, c0, weights, None)
    out.sum().backward()
    assert seen == [False, True] and weights[1].grad is not None
    # the module's PyTorch forward: no_grad inside
    bnn.GRU(1, 2, strategy="sequential")(torch.randn(4, 3, 1))[0].sum().backward()
    assert seen[2:] == [False] * (mode == "GRU")


# --------------------------------------------------------------------------------------- bad input


def _error(module: torch.nn.Module, *args) -> tuple[type, str]:
    with pytest.raises(Exception) as caught:
        module(*args)
    return caught.type, str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("packed", [False, True])
def test_tensors_on_another_device_than_the_weights_are_refused_as_torch_nn_does(kind, packed) -> None:
    """Meta input with CPU weights, or a meta initial state with CPU input: torch.nn's error, word
    for word (the meta device stands in for any other; the layers' operators let meta through);
    packed, torch.nn's class (its words come from its packed kernel)."""
    ref, ours = pair(kind, 3, 4)
    x = torch.randn(5, 2, 3, dtype=F64)
    meta_h = torch.zeros(1, 2, 4, dtype=F64, device="meta")
    meta_hx = (meta_h, meta_h) if kind == "lstm" else meta_h
    inputs = [(x.to("meta"),), (x, meta_hx)]
    if packed:
        inputs = [(pack_sequence([t.to("meta") for t in (x[:, 0], x[:3, 1])]),)]
    for args in inputs:
        got, expected = _error(ours, *args), _error(ref, *args)
        assert got[0] is expected[0] and (packed or got[1] == expected[1]), (got, expected)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "state", ["bare", "empty", "one", "three", "three in a list", "a float", "None in it"]
)
def test_an_lstm_state_that_is_not_a_pair_is_refused_naming_it(layers, packed, state) -> None:
    """torch.nn's class for each malformed state (whatever its fused kernel or its indexing happens
    to raise), or TypeError where that is an accident of its code (an attribute of None)."""
    ref, ours = pair("lstm", 3, 4, num_layers=layers)
    h = torch.zeros(layers, 2, 4, dtype=F64)
    hx = {
        "bare": h, "empty": (), "one": (h,), "three": (h, h, h), "three in a list": [h, h, h],
        "a float": 1.0, "None in it": (h, None),
    }[state]  # fmt: skip
    x = torch.randn(5, 2, 3, dtype=F64)
    inp = pack_sequence([x[:, 0], x[:3, 1]]) if packed else x
    kind, message = _error(ours, inp, hx)
    expected = TypeError if state == "None in it" else _error(ref, inp, hx)[0]
    assert kind is expected, (kind, message)
    assert message.startswith("LSTM: hx must be a tuple (h_0, c_0) of two tensors, got ")


@pytest.mark.parametrize("packed", [False, True])
def test_an_lstm_state_given_as_a_list_is_taken_as_torch_nn_takes_it(packed) -> None:
    ref, ours = pair("lstm", 3, 4, num_layers=2)
    x = torch.randn(5, 2, 3, dtype=F64)
    inp = pack_sequence([x[:, 0], x[:3, 1]]) if packed else x
    hx = list(state(ref, 2))
    assert_same(ref, ours, inp, hx, leaves=hx)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", [("bidirectional", 1), ("bidirectional", "yes"), ("num_layers", True)])
def test_flags_torch_nn_takes_but_its_kernel_refuses_are_refused_by_name(kind, flag) -> None:
    """torch.nn's constructor keeps a non-bool ``bidirectional`` or a bool ``num_layers`` and its
    fused kernel then raises TypeError; so does the BPPSA forward, naming the flag."""
    name, value = flag
    ref, ours = pair(kind, 3, 4, **{name: value})
    x = torch.randn(5, 2, 3, dtype=F64)
    assert _error(ref, x)[0] is TypeError
    got, message = _error(ours, x)
    wanted = "a bool" if name == "bidirectional" else "an int"
    assert got is TypeError and message.endswith(f"{name} must be {wanted}, got {value!r}")


@pytest.mark.parametrize("batch_sizes", [[2, 3], [3, 2]])
def test_a_packed_sequence_that_does_not_describe_its_data_is_refused(batch_sizes) -> None:
    """Hand-built PackedSequences: batch sizes that grow (torch.nn's kernel raises RuntimeError) or
    that count fewer rows than the data holds (torch.nn's reads past them)."""
    from torch.nn.utils.rnn import PackedSequence

    _, ours = pair("gru", 3, 4)
    packed = PackedSequence(torch.randn(6, 3, dtype=F64), torch.tensor(batch_sizes))
    kind, message = _error(ours, packed)
    assert kind is RuntimeError and message.startswith("PackedSequence: batch_sizes ")
    assert str(batch_sizes) in message


def _layer_calls(monkeypatch) -> list[int]:
    """The BPPSA layer calls the modules make from now on, one entry each."""
    calls: list[int] = []
    real = bnn.layer
    monkeypatch.setattr(bnn, "layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("instead", [False, True])
def test_a_module_auto_leaves_to_torch_nn_is_its_own(monkeypatch, kind: str, instead: bool) -> None:
    """Where ``dispatch.torch_nn_instead`` says so (here the answer is forced), the module is
    ``torch.nn``'s forward and backward, bit for bit, and makes no BPPSA layer call; elsewhere it
    runs its layers."""
    monkeypatch.setattr(bnn, "torch_nn_instead", lambda *args: instead)
    calls = _layer_calls(monkeypatch)
    ref, ours = pair(kind, 3, 5, dtype=F64, num_layers=2)
    x = torch.randn(7, 2, 3, dtype=F64)
    outs = [model(x)[0] for model in (ref, ours)]
    grads = [
        torch.autograd.grad(o.sum(), list(m.parameters())) for o, m in zip(outs, (ref, ours), strict=True)
    ]
    assert len(calls) == (0 if instead else 2)
    if instead:
        assert torch.equal(outs[0], outs[1])
        assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    else:
        assert all(rel_err(a, b) < 1e-10 for a, b in zip(*grads, strict=True))


def test_the_module_asks_with_its_options_and_parameters(monkeypatch) -> None:
    """``torch_nn_instead`` gets the module's strategy, mode, H, its parameters' device and dtype
    and whether the call is inference, and a Newton forward is never left to cuDNN."""
    asked = []
    monkeypatch.setattr(bnn, "torch_nn_instead", lambda *args: asked.append(args) or False)
    gru = bnn.GRU(3, 6, strategy="chunked")
    gru(torch.randn(4, 2, 3))
    with torch.no_grad():
        gru(torch.randn(4, 2, 3))
    assert asked == [
        ("chunked", "GRU", 6, torch.device("cpu"), torch.float32, inference) for inference in (False, True)
    ]
    bnn.LSTM(3, 6, forward_solver="newton")(torch.randn(4, 2, 3))
    assert len(asked) == 2


def test_auto_runs_torch_nn_on_a_cpu_at_a_width_where_it_wins(monkeypatch) -> None:
    """On the CPU, "auto" runs a GRU of H = 513 (wider than its compiled forward) as torch.nn; an
    explicit strategy runs BPPSA."""
    calls = _layer_calls(monkeypatch)
    x = torch.randn(3, 2, 4)
    for strategy, made in (("auto", 0), ("sequential", 1)):
        out, _ = bnn.GRU(4, 513, strategy=strategy)(x)
        out.sum().backward()
        assert len(calls) == made
        calls.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_on_a_gpu_outputs_changed_in_place_fail_the_backward_on_both_sides(kind: str) -> None:
    """cuDNN's module keeps its outputs for its backward, so changing them in place before it is an
    error; BPPSA's module hands over the outputs its backward reads (no copy) and fails alike."""
    ref_cls, cls, options = KINDS[kind]
    x = torch.randn(20, 4, 3, device="cuda")
    assert bnn._outputs_kept_by_torch_nn(x)
    for module in (ref_cls(3, 5, **options), cls(3, 5, strategy="triton", **options)):
        out, _ = module.cuda()(x)
        out.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("cls", "hidden"),
    [(bnn.LSTM, 64), (bnn.GRU, 128), (bnn.RNN, 128), (bnn.LSTM, 256), (bnn.GRU, 512), (bnn.RNN, 512)],
)
def test_auto_runs_cudnn_on_a_gpu_where_it_wins(monkeypatch, cls, hidden) -> None:
    """On a GPU, "auto" runs these widths as torch.nn (cuDNN's backward); an explicit strategy runs
    BPPSA there."""
    calls = _layer_calls(monkeypatch)
    x = torch.randn(50, 4, 8, device="cuda")
    for strategy, made in (("auto", 0), ("chunked", 1)):
        model = cls(8, hidden, strategy=strategy).cuda()
        out, _ = model(x)
        out.sum().backward()
        assert len(calls) == made
        calls.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_an_initial_state_that_needs_no_gradient_gets_none_computed(kind: str) -> None:
    """The backward copies out dL/dh_0 (and an LSTM's dL/dc_0) only for a state that asks for it:
    with the default zero state one copy fewer per layer; with a state that requires grad it gets
    torch.nn's gradient."""

    def clones(hx) -> int:
        _, cls, options = KINDS[kind]
        model = cls(3, 5, num_layers=2, strategy="sequential", **options)
        out, _ = model(torch.randn(6, 2, 3), hx)
        events = profiled_events(out.sum().backward, torch.device("cpu"))
        return sum(e.name == "aten::clone" for e in events)

    lstm = kind == "lstm"
    zeros = torch.zeros(2, 2, 5)
    leaf = zeros.clone().requires_grad_()
    assert clones((leaf, zeros) if lstm else leaf) - clones(None) == (4 if lstm else 2)
    check(kind, 6, 2, 3, 5, h0=True, num_layers=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kept", [False, True])
def test_a_one_layer_forward_on_pytorchs_kernel_makes_no_view_or_copy_of_its_states(
    monkeypatch, kind: str, kept: bool
) -> None:
    """A layer call takes and gives its states as (1, B, H), the shape of PyTorch's kernel and of the
    module's states, so a one-layer training forward on that kernel (a GPU's) issues torch.nn's
    operator calls, and one more, the copy of the outputs the caller may change in place, unless
    torch.nn's module keeps its outputs (``kept``: cuDNN's, stood in for): no select, unsqueeze or
    stack of the states (the host path of a short forward). Its last states are the layer's own
    tensors, not views."""

    def top_level_ops(module: torch.nn.Module) -> tuple[list[str], object]:
        module(x)
        states = []
        events = profiled_events(lambda: states.append(module(x)[1]), torch.device("cpu"))
        top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        return [e.name for e in top if e.name.startswith("aten::")], states[0]

    monkeypatch.setattr(bnn, "_outputs_kept_by_torch_nn", lambda x: kept)
    ref_cls, cls, options = KINDS[kind]
    x = torch.randn(6, 2, 3)
    nn_ops, _ = top_level_ops(ref_cls(3, 5, **options))
    ops, h_n = top_level_ops(cls(3, 5, strategy="chunked", **options))
    copies = 0 if kept else 1
    assert len(ops) == len(nn_ops) + copies and ops.count("aten::clone") == copies, (nn_ops, ops)
    assert not any(s._is_view() for s in (h_n if isinstance(h_n, tuple) else (h_n,)))
