"""Every way PyTorch differentiates, through our modules: double backward, Hessian-vector products,
forward mode, torch.func transforms, in-place ops on the outputs, tracing and compiling."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from helpers import rel_err
from recurrent import F64, KINDS, flat, pair, state, state_leaves
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from bppsa_core import layer as bppsa_layer

KW = {"num_layers": 2, "bidirectional": True}


def inputs(kind: str, packed: bool = False):
    """(input, initial state, leaves) for a (5, 3, 3) batch, padded or packed."""
    torch.manual_seed(3)
    if packed:
        seqs = [torch.randn(n, 3, dtype=F64, requires_grad=True) for n in (5, 2, 4)]
        return pack_sequence(seqs, enforce_sorted=False), seqs
    x = torch.randn(5, 3, 3, dtype=F64, requires_grad=True)
    return x, [x]


def loss_of(module, inp):
    return sum((t**2).sum() for t in flat(module(inp)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("packed", [False, True])
def test_gradient_penalties_equal_torch_nn(kind: str, packed: bool) -> None:
    """d/dθ |dL/dx|²: the first gradient keeps its graph, the second is exact."""
    ref, ours = pair(kind, 3, 4, **KW)
    inp, leaves = inputs(kind, packed)
    results = []
    for m in (ref, ours):
        grads = torch.autograd.grad(loss_of(m, inp), leaves, create_graph=True)
        assert all(g.requires_grad for g in grads)
        penalty = sum((g**2).sum() for g in grads)
        results.append(torch.autograd.grad(penalty, list(m.parameters())))
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_hessian_vector_products_equal_torch_nn(kind: str) -> None:
    ref, ours = pair(kind, 3, 4, **KW)
    x, _ = inputs(kind)
    v = torch.randn_like(x)
    expected = torch.autograd.functional.hvp(lambda x: loss_of(ref, x), x, v)[1]
    got = torch.autograd.functional.hvp(lambda x: loss_of(ours, x), x, v)[1]
    assert expected.abs().sum() > 0 and rel_err(expected, got) < 1e-10
    hessian = torch.func.hessian(lambda x: loss_of(ours, x))(x)
    assert rel_err(torch.autograd.functional.hessian(lambda x: loss_of(ref, x), x), hessian) < 1e-10


def test_the_first_order_backward_is_the_scan_and_a_differentiated_one_is_not(monkeypatch) -> None:
    calls = []
    real = bppsa_layer.bppsa_backward
    monkeypatch.setattr(bppsa_layer, "bppsa_backward", lambda *a: calls.append(1) or real(*a))
    _, ours = pair("gru", 3, 4)
    x, _ = inputs("gru")
    torch.autograd.grad(loss_of(ours, x), x)
    assert len(calls) == 1
    torch.autograd.grad(loss_of(ours, x), x, create_graph=True)
    assert len(calls) == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("packed", [False, True])
def test_forward_mode_tangents_come_from_the_scan_and_equal_torch_nn(
    kind: str, packed: bool, monkeypatch
) -> None:
    ref, ours = pair(kind, 3, 4, **KW)
    inp, _ = inputs(kind, packed)
    hx = state(ours, 3)
    data = inp.data if packed else inp  # PyTorch's packing has no forward mode: the data is the primal
    primals = [data, *state_leaves(hx), *ours.parameters()]
    tangents = [torch.randn_like(t) for t in primals]
    n_h = len(state_leaves(hx))

    def fn(module):
        names = [n for n, _ in module.named_parameters()]

        def f(data, *args):
            h, params = args[:n_h], args[n_h:]
            x = PackedSequence(data, *inp[1:]) if packed else data
            h = tuple(h) if kind == "lstm" else h[0]
            return tuple(
                flat(torch.func.functional_call(module, dict(zip(names, params, strict=True)), (x, h)))
            )

        return f

    detached = tuple(t.detach() for t in primals)
    # torch.nn's packed kernels have no forward mode: its tangents by the double-backward trick
    _, expected = torch.autograd.functional.jvp(fn(ref), detached, tuple(tangents))
    calls = []
    real = bppsa_layer.bppsa_tangent
    monkeypatch.setattr(bppsa_layer, "bppsa_tangent", lambda *a: calls.append(1) or real(*a))
    _, got = torch.func.jvp(fn(ours), detached, tuple(tangents))
    assert len(calls) == 4  # every layer and direction
    for a, b in zip(expected, got, strict=True):
        assert rel_err(a, b) < 1e-10
    with torch.autograd.forward_ad.dual_level():  # the dual-number API gives the same
        duals = [torch.autograd.forward_ad.make_dual(p, t) for p, t in zip(detached, tangents, strict=True)]
        out = fn(ours)(*duals)
        assert rel_err(expected[0], torch.autograd.forward_ad.unpack_dual(out[0]).tangent) < 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_torch_func_grad_jacrev_jacfwd_and_vmap(kind: str) -> None:
    ref, ours = pair(kind, 3, 4, **KW)
    x, _ = inputs(kind)
    for transform in (torch.func.jacrev, torch.func.jacfwd):
        expected = transform(lambda x: ref(x)[0])(x)
        assert rel_err(expected, transform(lambda x: ours(x)[0])(x)) < 1e-10
    assert (
        rel_err(torch.func.grad(lambda x: loss_of(ref, x))(x), torch.func.grad(lambda x: loss_of(ours, x))(x))
        < 1e-10
    )
    many = torch.randn(4, 5, 3, 3, dtype=F64)
    batched = torch.func.vmap(lambda x: ours(x)[0])(many)
    assert rel_err(torch.stack([ref(m)[0] for m in many]), batched) < 1e-12
    # an ensemble: vmap over stacked copies of the parameters
    params = {n: torch.stack([p.detach() * s for s in (1.0, 0.5)]) for n, p in ours.named_parameters()}
    ensemble = torch.func.vmap(lambda p: torch.func.functional_call(ours, p, (x,))[0])(params)
    for i in (0, 1):  # each member as torch.nn computes it with that member's parameters
        one = torch.func.functional_call(ref, {n: p[i] for n, p in params.items()}, (x,))[0]
        assert rel_err(one, ensemble[i]) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_jacobians_by_vmap_over_the_backward(kind: str) -> None:
    ref, ours = pair(kind, 3, 4, **KW)
    x, _ = inputs(kind)
    expected = torch.autograd.functional.jacobian(lambda x: ref(x)[0], x)
    got = torch.autograd.functional.jacobian(lambda x: ours(x)[0], x, vectorize=True)
    assert rel_err(expected, got) < 1e-10


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_in_place_ops_on_the_outputs_behave_as_with_torch_nn(kind: str, bidirectional: bool) -> None:
    ref, ours = pair(kind, 3, 4, num_layers=2, bidirectional=bidirectional, batch_first=True)
    results = []
    for m in (ref, ours):
        x = torch.randn(2, 5, 3, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out, hn = m(x)
        out.mul_(2)
        h = hn[0] if kind == "lstm" else hn
        h.add_(1)
        (torch.nn.ReLU(inplace=True)(out).sum() + h.pow(2).sum()).backward()
        results.append([x.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("kind", ["tanh", "lstm"])
def test_jit_trace_passes_its_checks_and_gives_the_same_gradients(kind: str) -> None:
    ref, ours = pair(kind, 3, 4, **KW)
    x, _ = inputs(kind)
    traced = torch.jit.trace(
        ours, (x.detach(),), check_trace=True, check_inputs=[(torch.randn(7, 2, 3, dtype=F64),)]
    )
    expected = torch.autograd.grad(loss_of(ref, x), [x, *ref.parameters()])
    got = torch.autograd.grad(loss_of(traced, x), [x, *ours.parameters()])
    for a, b in zip(expected, got, strict=True):
        assert rel_err(a, b) < 1e-10


class _Classifier(torch.nn.Module):
    """A model holding a recurrent module: its last output through a linear head."""

    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.rnn, self.head = rnn, torch.nn.Linear(rnn.hidden_size * 2, 2).double()

    def forward(self, x):
        return self.head(self.rnn(x)[0][-1])


@pytest.mark.extended
@pytest.mark.parametrize(
    ("kind", "fullgraph", "backend"),
    [("gru", False, "aot_eager"), ("lstm", True, "aot_eager"), ("gru", True, "inductor")],
)
def test_a_model_compiles_and_gives_torch_nn_gradients(
    monkeypatch, kind: str, fullgraph: bool, backend: str
) -> None:
    """Dynamo and AOTAutograd see each layer's operators as opaque steps; inductor (the default
    backend, which compiles C++ around them on the CPU) needs a C++ compiler. Dynamo refuses to
    trace into a submodule that is a torch.nn RNN, GRU or LSTM (ours are) unless
    ``torch._dynamo.config.allow_rnn``; without it the module's forward is a graph of its own, so
    one graph of the whole model (``fullgraph``) needs it. What Dynamo traces of ours warns of
    nothing (it warns of each cached function it traces into)."""
    if backend == "inductor" and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor needs a C++ compiler on the CPU")
    torch._dynamo.reset()  # no frame compiled by an earlier test stands in for this one's
    # Dynamo warns of a place once a process: its record of those warned of emptied for this test
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    ref, ours = pair(kind, 3, 4, **KW)
    torch.manual_seed(0)
    model_ref = _Classifier(ref)
    model = _Classifier(ours)
    model.head.load_state_dict(model_ref.head.state_dict())
    compiled = torch.compile(model, fullgraph=fullgraph, backend=backend)
    with torch._dynamo.config.patch(allow_rnn=fullgraph), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for steps in (5, 8):  # a second shape: recompiled or dynamic, either way the same gradients
            x = torch.randn(steps, 3, 3, dtype=F64)
            expected = torch.autograd.grad(model_ref(x).pow(2).sum(), list(model_ref.parameters()))
            got = torch.autograd.grad(compiled(x).pow(2).sum(), list(model.parameters()))
            for a, b in zip(expected, got, strict=True):
                assert rel_err(a, b) < 1e-10
    assert not [str(w.message)[:200] for w in warned if "Dynamo" in str(w.message)]
