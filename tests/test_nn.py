"""bppsa_core.nn.RNN / GRU: the same module, outputs and gradients as torch.nn's."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from hypothesis import given
from hypothesis import strategies as st

from bppsa_core import nn as bnn

F64 = torch.float64
KINDS = {
    "tanh": (torch.nn.RNN, bnn.RNN, {}),
    "relu": (torch.nn.RNN, bnn.RNN, {"nonlinearity": "relu"}),
    "gru": (torch.nn.GRU, bnn.GRU, {}),
}
LOSSES = ("h_n", "output", "both", "last_output")


def pair(kind: str, features: int, hidden: int, dtype=F64, seed: int = 0, **kwargs):
    """A torch.nn module and ours with the same weights."""
    ref_cls, our_cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    scan_opts = {k: kwargs.pop(k) for k in ("backward", "strategy", "chunk", "levels") if k in kwargs}
    ref = ref_cls(features, hidden, **extra, **kwargs).to(dtype)
    ours = our_cls(features, hidden, **extra, **kwargs, **scan_opts).to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def grads(module, x, h0, loss: str, seed: int = 1):
    """Gradients of a fixed random projection of the outputs w.r.t. input, h0 and parameters."""
    x = x.detach().clone().requires_grad_()
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, h_n = module(x, h0)
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    w_hn = torch.randn(h_n.shape, generator=g, dtype=out.dtype)
    value = {
        "h_n": lambda: (h_n * w_hn).sum(),
        "output": lambda: (out * w_out).sum(),
        "both": lambda: (out * w_out).sum() + (h_n * w_hn).sum(),
        "last_output": lambda: (out.select(1 if module.batch_first else 0, -1) ** 2).sum(),
    }[loss]()
    value.backward()
    named = {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    if h0 is not None:
        named["h0"] = h0.grad
    return out.detach(), h_n.detach(), named


def assert_same(kind, steps, batch, features, hidden, loss, tol, dtype=F64, h0=True, **kwargs):
    ref, ours = pair(kind, features, hidden, dtype=dtype, **kwargs)
    layers = ref.num_layers
    shape = (batch, steps, features) if ref.batch_first else (steps, batch, features)
    x = torch.randn(shape, dtype=dtype)
    hx = torch.randn(layers, batch, hidden, dtype=dtype) if h0 else None
    out_r, hn_r, g_r = grads(ref, x, hx, loss)
    out_o, hn_o, g_o = grads(ours, x, hx, loss)
    assert torch.allclose(out_r, out_o) and torch.allclose(hn_r, hn_o)
    assert g_r.keys() == g_o.keys()
    for name in g_r:
        assert g_o[name] is not None, name
        assert rel_err(g_r[name], g_o[name]) < tol, (name, rel_err(g_r[name], g_o[name]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("steps", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("loss", LOSSES)
def test_gradients_match_autograd_float64(kind: str, steps: int, loss: str) -> None:
    assert_same(kind, steps, batch=3, features=2, hidden=4, loss=loss, tol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("h0", [False, True])
def test_stacked_layers_batch_first_and_default_h0(kind, layers, batch_first, h0) -> None:
    for loss in ("h_n", "output"):
        assert_same(kind, 11, 2, 3, 5, loss, 1e-10, h0=h0, num_layers=layers, batch_first=batch_first)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("batch", "hidden"), [(1, 1), (1, 6), (4, 1)])
def test_degenerate_sizes(kind: str, batch: int, hidden: int) -> None:
    assert_same(kind, 9, batch, 1, hidden, "both", 1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_no_bias(kind: str) -> None:
    assert_same(kind, 10, 2, 3, 4, "both", 1e-10, bias=False, num_layers=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "opts", [{"strategy": "sequential"}, {"strategy": "blelloch", "levels": 2}, {"strategy": "chunked"}]
)
def test_float32_at_moderate_length(kind: str, opts: dict) -> None:
    assert_same(kind, 300, 4, 3, 8, "both", 1e-4, dtype=torch.float32, **opts)


@given(
    kind=st.sampled_from(list(KINDS)),
    steps=st.integers(1, 40),
    batch=st.integers(1, 3),
    hidden=st.integers(1, 6),
    layers=st.integers(1, 3),
    loss=st.sampled_from(LOSSES),
    strategy=st.sampled_from(["auto", "sequential", "blelloch", "chunked"]),
    chunk=st.one_of(st.none(), st.integers(1, 9)),
)
def test_property_any_shape_any_strategy(kind, steps, batch, hidden, layers, loss, strategy, chunk) -> None:
    assert_same(kind, steps, batch, 2, hidden, loss, 1e-10, num_layers=layers, strategy=strategy, chunk=chunk)


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input(kind: str) -> None:
    ref, ours = pair(kind, 2, 3)
    x = torch.randn(6, 2, dtype=F64)
    out_r, hn_r, g_r = grads(ref, x, None, "both")
    out_o, hn_o, g_o = grads(ours, x, None, "both")
    assert out_o.shape == (6, 3) and hn_o.shape == (1, 3)
    assert torch.allclose(out_r, out_o) and torch.allclose(hn_r, hn_o)
    for name in g_r:
        assert rel_err(g_r[name], g_o[name]) < 1e-10, name


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trips_with_torch_nn(kind: str) -> None:
    ref_cls, our_cls, extra = KINDS[kind]
    ref = ref_cls(3, 4, num_layers=2, **extra)
    ours = our_cls(3, 4, num_layers=2, **extra)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ours.named_parameters()]
    ours.load_state_dict(ref.state_dict())
    back = ref_cls(3, 4, num_layers=2, **extra)
    back.load_state_dict(ours.state_dict())
    for a, b in zip(ref.parameters(), back.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_bptt_mode_is_torch_nn(kind: str) -> None:
    assert_same(kind, 8, 2, 3, 4, "both", 1e-13, backward="bptt", num_layers=2)
    _, our_cls, extra = KINDS[kind]
    assert our_cls(
        2, 3, num_layers=2, dropout=0.5, bidirectional=True, backward="bptt", **extra
    ).bidirectional


def test_inference_output_matches_and_builds_no_graph() -> None:
    ref, ours = pair("gru", 2, 3)
    x = torch.randn(5, 2, 2, dtype=F64)
    with torch.no_grad():
        out, _ = ours(x)
    assert out.grad_fn is None
    assert torch.equal(out, ref(x)[0].detach())


def test_training_loop_with_an_optimizer_lowers_the_loss() -> None:
    torch.manual_seed(0)
    rnn, head = bnn.RNN(1, 8, batch_first=True), torch.nn.Linear(8, 2)
    opt = torch.optim.Adam([*rnn.parameters(), *head.parameters()], lr=1e-2)
    x = torch.bernoulli(torch.full((32, 50, 1), 0.5))
    y = (x.mean((1, 2)) > 0.5).long()
    losses = []
    for _ in range(30):
        opt.zero_grad()
        _, h_n = rnn(x)
        loss = torch.nn.functional.cross_entropy(head(h_n[-1]), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bidirectional": True}, "bidirectional=True is not supported by backward='bppsa' yet"),
        ({"num_layers": 2, "dropout": 0.2}, "dropout=0.2 between layers is not supported"),
        ({"backward": "magic"}, "unknown backward 'magic'; accepted: bppsa, bptt"),
        ({"strategy": "magic"}, "unknown scan strategy 'magic'; accepted: auto"),
        ({"chunk": 0}, "chunk must be a positive integer or None, got 0"),
        ({"levels": -2}, "levels must be a non-negative integer or None, got -2"),
    ],
)
@pytest.mark.parametrize("cls", [bnn.RNN, bnn.GRU])
def test_unsupported_options_fail_at_construction(cls, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(2, 3, **kwargs)


def test_packed_sequences_are_rejected() -> None:
    rnn = bnn.RNN(2, 3)
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 2), [4, 2])
    with pytest.raises(ValueError, match="packed sequences are not supported by backward='bppsa'"):
        rnn(packed)


def test_wrong_input_size_is_named() -> None:
    with pytest.raises(
        RuntimeError, match=r"input.size\(-1\) must be equal to input_size. Expected 2, got 5"
    ):
        bnn.RNN(2, 3)(torch.randn(4, 1, 5))


def test_double_backward_is_refused_not_silently_wrong() -> None:
    rnn = bnn.RNN(2, 3).double()
    x = torch.randn(5, 2, 2, dtype=F64, requires_grad=True)
    _, h_n = rnn(x)
    (gx,) = torch.autograd.grad(h_n.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|does not require grad"):
        gx.sum().backward()


@pytest.mark.parametrize("kind", KINDS)
def test_functional_call_and_parametrizations_use_the_current_weights(kind: str) -> None:
    ref, ours = pair(kind, 3, 4)
    x = torch.randn(6, 2, 3, dtype=F64)
    swapped = {n: p.detach() * 2 for n, p in ref.named_parameters()}
    expected = torch.func.functional_call(ref, swapped, (x,))[0]
    assert torch.allclose(torch.func.functional_call(ours, swapped, (x,))[0], expected)
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
    ref, ours = pair(kind, 3, 4, dtype=torch.float32)
    x = torch.randn(20, 2, 3)
    grads_of = []
    for m in (ref, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = m(x)
        out.float().pow(2).sum().backward()
        grads_of.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads_of, strict=True):
        assert b.dtype == torch.float32 and rel_err(a, b) < 3e-2  # both see bfloat16 states
