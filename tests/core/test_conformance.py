"""Conformance with torch.nn: PyTorch's own tests of RNN, GRU and LSTM (from its test_nn.py,
test_modules.py and the module samples of its testing package), rewritten here against our modules.

Each test runs our module beside torch.nn's holding the same ``state_dict`` and asserts the same
results, gradients, exceptions and messages; where PyTorch's test checks a property of one module
(a shape, a dropout statistic), ours must show it too. LSTM projections (``proj_size > 0``) are
refused by ``backward="bppsa"``; that refusal is tested, and PyTorch's projection cases are run
with ``backward="bptt"`` only where they check the module's shared plumbing.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings
from collections.abc import Iterator

import pytest
import torch
from helpers import extended_except, rel_err
from recurrent import CLASSES, F64, KINDS, assert_same, flat, pair, run, state, state_leaves
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from bppsa_core import dispatch
from bppsa_core import layer as layer_mod
from bppsa_core import nn as bnn


@pytest.fixture(autouse=True, params=["compiled", pytest.param("fused", marks=pytest.mark.extended)])
def forward_route(request, monkeypatch) -> Iterator[None]:
    """Every test under each forward of the modules: the compiled CPU forward, where "auto" takes it
    (numba installed), and PyTorch's fused kernel, the one every strategy runs on a GPU."""
    if request.param == "fused":
        monkeypatch.setattr(dispatch, "_compiled_forward_takes", lambda *args: False)
        if dispatch.numba_installed():  # and it is never called
            from bppsa_core import numba_forward

            monkeypatch.setattr(numba_forward, "layer_forward", _not_called)
    layer_mod._taped.cache_clear()  # an LSTM's tape follows the compiled forward: asked afresh
    yield
    layer_mod._taped.cache_clear()


def _not_called(*args, **kwargs):
    raise AssertionError("the compiled forward ran where PyTorch's fused one was asked for")


def outcome(fn) -> tuple[str, str] | None:
    """(exception type, message) of ``fn()``, or None when it returns."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def assert_same_outcome(ref_fn, our_fn) -> None:
    expected = outcome(ref_fn)
    assert outcome(our_fn) == expected, expected


# --------------------------------------------------------------------------------- construction

CONSTRUCTOR_CASES = [
    ((10, 0, 1), {}),
    ((10, 10, 0), {}),
    ((10, 10, -1), {}),
    ((3, 5), {"bias": 0}),
    ((3, 5), {"bias": 1}),
    ((3, 5), {"bias": "True"}),
    ((3, 5), {"batch_first": 0}),
    ((3, 5), {"batch_first": 1}),
    ((3, 5), {"batch_first": "False"}),
    ((3.0, 5), {}),
    (("10", 5), {}),
    ((0, 5), {}),
    ((-1, 5), {}),
    ((3, 5.0), {}),
    ((3, 5), {"dropout": 1.5}),
    ((3, 5), {"dropout": -0.1}),
    ((3, 5), {"dropout": True}),
    ((3, 5), {"dropout": "0.5"}),
    ((3, 5), {"dropout": "abc"}),
    ((3, 5), {"proj_size": 0}),
    ((3, 5), {"proj_size": -1}),
    ((3, 5), {"proj_size": 5}),
    ((3, 5, 1, "garbage"), {}),
    ((3, 5), {"nonlinearity": "garbage"}),
]


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    [
        (name, args, kwargs)
        for name in CLASSES
        for args, kwargs in CONSTRUCTOR_CASES
        if name == "RNN" or ("nonlinearity" not in kwargs and len(args) <= 3)  # GRU, LSTM: no nonlinearity
    ],
)
def test_constructor_checks_equal_torch_nn(name: str, args: tuple, kwargs: dict) -> None:
    ref_cls, our_cls = CLASSES[name]
    assert_same_outcome(lambda: ref_cls(*args, **kwargs), lambda: our_cls(*args, **kwargs))


@pytest.mark.parametrize("name", CLASSES)
def test_the_single_layer_dropout_warning_equals_torch_nn(name: str) -> None:
    ref_cls, our_cls = CLASSES[name]
    messages = []
    for cls in (ref_cls, our_cls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(3, 5, dropout=0.5)
        messages.append([str(w.message) for w in caught])
    assert messages[0] and messages[0] == messages[1]


def test_nonlinearity_as_keyword_or_fourth_argument() -> None:
    assert bnn.RNN(1, 10).nonlinearity == "tanh"
    assert bnn.RNN(1, 10, nonlinearity="relu").nonlinearity == "relu"
    assert bnn.RNN(2, 3, 1, "relu").nonlinearity == "relu"
    assert bnn.RNN(2, 3, 1, "relu").mode == "RNN_RELU"


def test_lstm_projections_are_refused_clearly_and_run_with_bptt() -> None:
    with pytest.raises(
        ValueError, match=r"proj_size=2 is not supported by backward='bppsa'; accepted: proj_size=0"
    ):
        bnn.LSTM(3, 5, proj_size=2)
    ref = torch.nn.LSTM(3, 5, 2, proj_size=2).double()
    ours = bnn.LSTM(3, 5, 2, proj_size=2, backward="bptt").double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
    assert_same(ref, ours, x, leaves=[x])


# ------------------------------------------------------------------------------- forward checks


def bad_calls(name: str):
    """(what, constructor keywords, input, hx) of the calls torch.nn refuses."""
    lstm = name == "LSTM"

    def hx(*shape, c_shape=None):
        h = torch.zeros(shape, dtype=F64)
        return (h, torch.zeros(c_shape or shape, dtype=F64)) if lstm else h

    good = torch.randn(6, 4, 3, dtype=F64)
    yield "1-D input", {}, torch.randn(3, dtype=F64), None
    yield "4-D input", {}, torch.randn(2, 6, 4, 3, dtype=F64), None
    yield "batched input, 2-D state", {}, good, hx(4, 5)
    yield "unbatched input, 3-D state", {}, torch.randn(6, 3, dtype=F64), hx(2, 1, 5)
    yield "input of another dtype", {}, good.float(), None
    yield "integer input", {}, torch.ones(6, 4, 3, dtype=torch.long), None
    yield "wrong input size", {}, torch.randn(6, 4, 7, dtype=F64), None
    yield "wrong input size, unbatched", {}, torch.randn(6, 7, dtype=F64), None
    yield "state of another batch", {"num_layers": 2}, good, hx(2, 7, 5)
    yield "state of another depth", {"num_layers": 2}, good, hx(7, 4, 5)
    yield "state of another width", {"num_layers": 2}, good, hx(2, 4, 7)
    yield "state of one direction", {"bidirectional": True}, good, hx(1, 4, 5)
    yield "batch_first, state of the time dimension", {"batch_first": True}, good, hx(1, 4, 5)
    yield "no steps", {}, torch.randn(0, 4, 3, dtype=F64), None
    yield "no steps, bidirectional", {"bidirectional": True}, torch.randn(0, 4, 3, dtype=F64), None
    if lstm:
        yield "cell state of another width", {}, good, hx(1, 4, 5, c_shape=(1, 4, 7))
        yield "cell state of another batch", {}, good, hx(1, 4, 5, c_shape=(1, 2, 5))
        yield "2-D cell state", {}, good, (torch.zeros(1, 4, 5, dtype=F64), torch.zeros(4, 5, dtype=F64))
    else:  # torch.nn.LSTM does not check packed input (it lets the kernel fail)
        packed = pack_padded_sequence(torch.randn(5, 3, 3, dtype=F64), [5, 3, 2])
        yield "packed, state of another batch", {}, packed, hx(1, 4, 5)
        yield (
            "packed, wrong input size",
            {},
            pack_padded_sequence(torch.randn(5, 3, 4, dtype=F64), [5, 3, 2]),
            None,
        )


@pytest.mark.parametrize("name", CLASSES)
def test_forward_checks_equal_torch_nn(name: str) -> None:
    ref_cls, our_cls = CLASSES[name]
    for what, kwargs, inp, hx in bad_calls(name):
        torch.manual_seed(0)
        ref = ref_cls(3, 5, **kwargs).double()
        ours = our_cls(3, 5, **kwargs).double()
        expected = outcome(lambda ref=ref, inp=inp, hx=hx: ref(inp, hx))
        assert expected is not None, what
        assert outcome(lambda ours=ours, inp=inp, hx=hx: ours(inp, hx)) == expected, what


# ------------------------------------------------------------------------------- module samples


def sample_configs(kind: str):
    """torch.nn's module samples: bias x batch_first x bidirectional, two layers."""
    for bias, batch_first, bidirectional in itertools.product([False, True], repeat=3):
        yield {"bias": bias, "batch_first": batch_first, "bidirectional": bidirectional, "num_layers": 2}


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_samples_equal_torch_nn_and_a_batch_of_one(kind: str) -> None:
    for kwargs in sample_configs(kind):
        for hidden, steps, with_state in ((2, 3, False), (3, 3, True), (3, 2, False)):
            ref, ours = pair(kind, 2, hidden, **kwargs)
            x = torch.randn(steps, 2, dtype=F64, requires_grad=True)
            hx = state(ours, None) if with_state else None
            assert_same(ref, ours, x, hx, leaves=[x, *state_leaves(hx)])
            batch_dim = 0 if kwargs["batch_first"] else 1
            one = (
                None
                if hx is None
                else tuple(h.unsqueeze(1) for h in hx)
                if kind == "lstm"
                else hx.unsqueeze(1)
            )
            single = run(ours, x.unsqueeze(batch_dim), one)
            unbatched = run(ours, x, hx)
            assert torch.equal(unbatched[0], single[0].squeeze(batch_dim))
            for a, b in zip(unbatched[1:], single[1:], strict=True):
                assert torch.equal(a, b.squeeze(1))


# ------------------------------------------------------------------------------ generic module


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_conversion_factory_keywords_and_repr(kind: str) -> None:
    ref_cls, our_cls, extra = KINDS[kind]
    ours = our_cls(3, 4, 2, **extra, dtype=F64, device="cpu")
    assert all(p.dtype == F64 and p.device.type == "cpu" for p in ours.parameters())
    ref = ref_cls(3, 4, 2, **extra).float()
    ours = ours.float()
    ours.load_state_dict(ref.state_dict())
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    x = torch.randn(5, 2, 3)
    assert torch.allclose(run(ref, x)[0], run(ours, x)[0], atol=1e-6)
    assert repr(ours).startswith(repr(ref)[:-1] + ", backward='bppsa'")
    assert str(ours) == repr(ours)


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_the_module_and_its_state_dict(kind: str, tmp_path) -> None:
    ref, ours = pair(kind, 3, 4, num_layers=2, dropout=0.0)
    x = torch.randn(5, 2, 3, dtype=F64)
    expected = run(ours, x)
    torch.save(ours, tmp_path / "module.pt")
    loaded = torch.load(tmp_path / "module.pt", weights_only=False)
    assert type(loaded) is type(ours) and loaded.backward_mode == "bppsa"
    for a, b in zip(run(loaded, x), expected, strict=True):
        assert torch.equal(a, b)
    torch.save(ours.state_dict(), tmp_path / "weights.pt")
    back = copy.deepcopy(ref)
    back.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    for a, b in zip(run(back, x), expected, strict=True):
        assert rel_err(a, b) < 1e-12
    assert pickle.loads(pickle.dumps(ours)).hidden_size == 4


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (as PyTorch's module tests make them)."""
    out = t.detach().repeat_interleave(2, -1)[..., ::2]
    assert not out.is_contiguous() or t.numel() <= 1
    return out.requires_grad_(t.requires_grad)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_non_contiguous_inputs_states_and_gradients(kind: str, bidirectional: bool) -> None:
    ref, ours = pair(kind, 3, 4, num_layers=2, bidirectional=bidirectional)
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
    hx = state(ours, 2)
    expected = run(ref, x, hx)
    x2 = noncontiguous(x)
    hx2 = tuple(noncontiguous(h) for h in hx) if kind == "lstm" else noncontiguous(hx)
    got = run(ours, x2, hx2)
    cot = [noncontiguous(torch.randn_like(t)) for t in got]
    for a, b in zip(expected, got, strict=True):
        assert rel_err(a, b) < 1e-12
    wrt = [x, *state_leaves(hx)]
    g_ref = torch.autograd.grad(expected, wrt + list(ref.parameters()), [c.contiguous() for c in cot])
    g_ours = torch.autograd.grad(got, [x2, *state_leaves(hx2), *list(ours.parameters())], cot)
    for a, b in zip(g_ref, g_ours, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", extended_except(KINDS, "lstm"))
@pytest.mark.parametrize("bidirectional", extended_except([False, True], False))
def test_gradcheck_and_gradgradcheck_with_batched_gradients(kind: str, bidirectional: bool) -> None:
    _, ours = pair(kind, 2, 2, num_layers=2, bidirectional=bidirectional)
    x = torch.randn(3, 2, 2, dtype=F64, requires_grad=True)
    hx = state(ours, 2)
    names = [n for n, _ in ours.named_parameters()]
    n_state = len(state_leaves(hx))

    def fn(x, *rest):
        h = rest[:n_state]
        params = dict(zip(names, rest[n_state:], strict=True))
        out = torch.func.functional_call(ours, params, (x, tuple(h) if kind == "lstm" else h[0]))
        return tuple(flat(out))

    inputs = (x, *state_leaves(hx), *ours.parameters())
    assert torch.autograd.gradcheck(fn, inputs, check_batched_grad=True)
    assert torch.autograd.gradgradcheck(fn, inputs, check_batched_grad=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [False, True])
def test_results_are_laid_out_as_torch_nn_lays_them(kind: str, batch_first: bool) -> None:
    ref, ours = pair(kind, 3, 4, num_layers=2, batch_first=batch_first)
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
    for a, b in zip(run(ref, x), run(ours, x), strict=True):
        assert a.shape == b.shape and a.is_contiguous() == b.is_contiguous()
    (g_ref,) = torch.autograd.grad(run(ref, x)[0].sum(), x)
    (g,) = torch.autograd.grad(run(ours, x)[0].sum(), x)
    assert g.stride() == g_ref.stride()


@pytest.mark.parametrize("kind", KINDS)
def test_train_and_eval_differ_only_by_dropout(kind: str) -> None:
    _, ours = pair(kind, 3, 4, num_layers=2, dropout=0.5)
    x = torch.randn(5, 2, 3, dtype=F64)
    ours.eval()
    assert torch.equal(run(ours, x, seed=1)[0], run(ours, x, seed=2)[0])
    ours.train()
    assert not torch.equal(run(ours, x, seed=1)[0], run(ours, x, seed=2)[0])
    del ours.training
    with pytest.raises(AttributeError, match="training"):
        ours(x)


@pytest.mark.parametrize("kind", KINDS)
def test_to_to_empty_and_meta_construction(kind: str) -> None:
    _, our_cls, extra = KINDS[kind]
    ours = our_cls(3, 4, 2, **extra)
    ours.to(torch.float16).to(torch.float32)
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in ours.parameters())
    with torch.device("meta"):
        meta = our_cls(3, 4, 2, **extra)
    assert all(p.is_meta for p in meta.parameters())
    real = meta.to_empty(device="cpu")
    real.reset_parameters()
    assert all(p.device.type == "cpu" for p in real.parameters())
    out, _ = real(torch.randn(5, 2, 3))
    assert out.shape == (5, 2, 4) and torch.isfinite(out).all()


# --------------------------------------------------------------------------------- test_nn cases


@pytest.mark.parametrize("kind", KINDS)
def test_a_zero_initial_state_equals_none(kind: str) -> None:
    _, ours = pair(kind, 30, 20, num_layers=2)
    x = torch.randn(10, 32, 30, dtype=F64)
    zeros = torch.zeros(2, 32, 20, dtype=F64)
    hx = (zeros, zeros) if kind == "lstm" else zeros
    for a, b in zip(run(ours, x, hx), run(ours, x), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.0, 0.276, 0.731, 1.0])
@pytest.mark.parametrize("train", [True, False])
def test_dropout_between_layers_scales_as_torch_nn(p: float, train: bool) -> None:
    rnn = bnn.RNN(10, 1000, 2, bias=False, dropout=p, nonlinearity="relu").double()
    with torch.no_grad():
        for w in rnn.parameters():
            w.fill_(1)
    rnn.train(train)
    out, h_n = rnn(torch.ones(1, 1, 10, dtype=F64), torch.zeros(2, 1, 1000, dtype=F64))
    assert out.min() == out.max() and h_n[0].min() == h_n[0].max() and h_n[1].min() == h_n[1].max()
    v = out[0, 0, 0].item()
    assert h_n[0, 0, 0] == 10 and h_n[1, 0, 0] == v
    if p == 0 or not train:
        assert v == 10000
    elif p == 1:
        assert v == 0
    else:
        assert 8000 < v < 12000
        rem = (v * (1 - p)) % 10
        assert min(rem, 10 - rem) < 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_changing_dropout_after_construction_takes_effect(kind: str) -> None:
    ref, ours = pair(kind, 10, 10, num_layers=2)
    x = torch.randn(3, 2, 10, dtype=F64)
    for train in (True, False):
        ours.train(train)
        ref.train(train)
        previous = None
        for p in (0, 0.5, 0, 0.7, 0.2, 1, 0.2, 0):
            ours.dropout = ref.dropout = p
            first, second = run(ours, x, seed=1), run(ours, x, seed=2)
            assert (torch.equal(first[0], second[0])) == (p in (0, 1) or not train)
            for a, b in zip(first, run(ref, x, seed=1), strict=True):  # torch.nn's masks, seed for seed
                assert rel_err(a, b) < 1e-12
            if previous is not None:  # each new p gives new outputs in training, the same in eval
                assert torch.equal(first[0], previous) == (not train)
            previous = first[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [0.0, 0.1234])
def test_dropout_masks_are_fresh_per_call_and_after_reloading(kind: str, p: float, tmp_path) -> None:
    _, ours = pair(kind, 100, 100, num_layers=2, bias=False, dropout=p)
    x = torch.rand(1, 1, 100, dtype=F64)
    o1, o2 = ours(x)[0], ours(x)[0]
    torch.save(ours, tmp_path / "m.pt")
    again = torch.load(tmp_path / "m.pt", weights_only=False)
    again.flatten_parameters()
    o3 = again(x)[0]
    if p == 0:
        assert torch.equal(o1, o2) and torch.equal(o1, o3)
    else:
        assert not torch.equal(o1, o2) and not torch.equal(o1, o3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_an_empty_batch_runs_forward_and_backward(kind: str, bidirectional: bool) -> None:
    ref, ours = pair(kind, 3, 4, bidirectional=bidirectional)
    x = torch.zeros(5, 0, 3, dtype=F64, requires_grad=True)
    out = run(ours, x)
    assert [t.shape for t in out] == [t.shape for t in run(ref, x)]
    out[0].sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("kind", KINDS)
def test_retained_graph_gives_the_same_gradients_each_time(kind: str) -> None:
    _, ours = pair(kind, 10, 20, num_layers=2)
    x = torch.randn(5, 6, 10, dtype=F64, requires_grad=True)
    out = ours(x)[0]
    first = None
    for _ in range(5):
        ours.zero_grad()
        x.grad = None
        out[0].sum().backward(retain_graph=True)
        grads = [x.grad.clone()] + [p.grad.clone() for p in ours.parameters()]
        if first is None:
            first = grads
        for a, b in zip(first, grads, strict=True):
            assert torch.equal(a, b)


def test_a_twenty_layer_lstm_differentiates_its_input_gradient_as_torch_nn() -> None:
    ref, ours = pair("lstm", 3, 3, num_layers=20, batch_first=True)
    results = []
    for m in (ref, ours):
        x = torch.rand(10, 12, 3, dtype=F64, requires_grad=True)
        x.data = torch.linspace(0, 1, 360, dtype=F64).reshape(10, 12, 3)
        (gx,) = torch.autograd.grad(m(x)[0].sum(), x, create_graph=True)
        gx.sum().backward()
        results.append((gx.detach(), x.grad))
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("lengths", "enforce_sorted"),
    [
        ([5], True),
        ([5], False),
        ([10, 10, 6, 2, 2, 1, 1], True),
        ([10, 10, 6, 2, 2, 1, 1], False),
        ([2, 1, 3, 2, 10, 5, 3], False),
    ],
)
@pytest.mark.parametrize("given_state", [False, True])
def test_variable_sequences_equal_each_sequence_run_alone(kind, lengths, enforce_sorted, given_state) -> None:
    ref, ours = pair(kind, 3, 4, num_layers=2, bidirectional=True)
    batch, longest = len(lengths), max(lengths)
    x = torch.randn(longest, batch, 3, dtype=F64, requires_grad=True)
    hx = state(ours, batch) if given_state else None
    packed = pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
    assert_same(ref, ours, packed, hx, leaves=[x, *state_leaves(hx)])
    out, last = ours(packed, hx)
    padded, out_lengths = pad_packed_sequence(out)
    assert out_lengths.tolist() == lengths
    last = last if kind == "lstm" else (last,)
    for i, n in enumerate(lengths):  # each sequence alone, with its own slice of the state
        h_i = None if hx is None else tuple(h[:, i : i + 1] for h in state_leaves(hx))
        alone_out, alone_last = ours(x[:n, i : i + 1], h_i if kind == "lstm" or h_i is None else h_i[0])
        assert rel_err(padded[:n, i : i + 1], alone_out) < 1e-12 and not padded[n:, i].any()
        alone_last = alone_last if kind == "lstm" else (alone_last,)
        for a, b in zip(last, alone_last, strict=True):
            assert rel_err(a[:, i : i + 1], b) < 1e-12


def test_lstm_state_from_before_projections_still_loads() -> None:
    ours = bnn.LSTM(2, 3)
    x = torch.randn(32, 5, 2)
    expected = ours(x)[0]
    old = {k: v for k, v in ours.__dict__.items() if k != "proj_size"}
    again = bnn.LSTM(2, 3)
    again.__setstate__(old)
    assert torch.equal(again(x)[0], expected)


def test_weight_norm_on_the_flat_weights() -> None:
    ref, ours = pair("lstm", 32, 32)
    for m in (ref, ours):
        with warnings.catch_warnings():  # the old weight_norm: the one that edits _flat_weights
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(m, "weight_ih_l0")
    assert sum(isinstance(w, torch.nn.Parameter) for w in ours._flat_weights) == 3
    x = torch.randn(4, 2, 32, dtype=F64, requires_grad=True)
    assert_same(ref, ours, x, leaves=[x])
    torch.nn.utils.remove_weight_norm(ours, "weight_ih_l0")
    assert sum(isinstance(w, torch.nn.Parameter) for w in ours._flat_weights) == 4
    assert "weight_ih_l0" in dict(ours.named_parameters()) and "weight_ih_l0_v" not in dict(
        ours.named_parameters()
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_deleted_and_reassigned_weight_is_used(kind: str) -> None:
    ref, ours = pair(kind, 10, 6, num_layers=2)
    x = torch.randn(3, 2, 10, dtype=F64, requires_grad=True)
    before = run(ours, x)[0]
    for m in (ref, ours):
        doubled = m.weight_hh_l0.detach() * 2
        del m.weight_hh_l0
        assert not hasattr(m, "weight_hh_l0")
        m.weight_hh_l0 = torch.nn.Parameter(doubled)
    assert rel_err(before, run(ours, x)[0]) > 1e-3  # the new weight is used, not a stale copy
    assert_same(ref, ours, x, leaves=[x])  # as torch.nn uses it, its gradient included


@pytest.mark.parametrize("kind", KINDS)
def test_tied_weights_train_as_torch_nn(kind: str) -> None:
    ref, ours = pair(kind, 10, 20, bidirectional=True, batch_first=True)
    for m in (ref, ours):
        m.bias_ih_l0_reverse = m.bias_ih_l0
    x = torch.randn(5, 4, 10, dtype=F64, requires_grad=True)
    assert_same(ref, ours, x, leaves=[x])
    results = []
    for m in (ref, ours):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        run(m, x)[0].sum().backward()
        opt.step()
        results.append(run(m, x)[0])
    assert rel_err(*results) < 1e-12
    assert ours.bias_ih_l0_reverse is ours.bias_ih_l0
