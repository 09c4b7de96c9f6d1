"""A whole training step with BPPSA modules, compiled or captured: the fast path on a GPU.

On the CPU: ``torch.compile(model, mode="reduce-overhead")`` (Dynamo sees each layer's operators as
opaque steps, AOTAutograd compiles the backward around them) trains as the eager model does. With
the ``gpu`` marker: forward, backward and an optimizer step captured once in a CUDA graph
(``torch.cuda.graph``) and replayed, and ``make_graphed_callables``, against the same steps run
eagerly: nothing in them needs the host.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import rel_err

from bppsa_core import nn as bnn

MODULES = {"rnn": bnn.RNN, "gru": bnn.GRU, "lstm": bnn.LSTM}


class Net(torch.nn.Module):
    """Two recurrent layers and a linear head on h_T: the paper's classifier."""

    def __init__(self, kind: str, hidden: int = 8, **kwargs) -> None:
        super().__init__()
        self.rnn = MODULES[kind](3, hidden, num_layers=2, **kwargs)
        self.head = torch.nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][-1])


def _train(net: torch.nn.Module, step_fn, batches) -> list[torch.Tensor]:
    """The parameters after each step of ``step_fn`` over ``batches``."""
    after = []
    for x, y in batches:
        step_fn(x, y)
        after.append(torch.cat([p.detach().flatten().clone() for p in net.parameters()]))
    return after


def _batches(device: str, n: int = 3, steps: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(steps, 5, 3, generator=g).to(device), torch.randint(0, 4, (5,), generator=g).to(device))
        for _ in range(n)
    ]


@pytest.mark.extended  # inductor compiles C++ on the CPU: half a minute with a cold cache
@pytest.mark.parametrize("kind", list(MODULES))
def test_a_compiled_model_trains_as_the_eager_one(kind) -> None:
    """``mode="reduce-overhead"`` on the CPU (inductor; CUDA graphs only on a GPU): three SGD steps
    give the eager model's parameters."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor needs a C++ compiler on the CPU")
    check_compiled_training(kind, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(MODULES))
def test_a_compiled_model_trains_in_cuda_graphs_on_a_gpu(kind) -> None:
    """``mode="reduce-overhead"`` on a GPU: the eager model's parameters, and inductor ran its CUDA
    graphs (it skips them, and says so in this counter, for a graph it finds unsafe to capture)."""
    from torch._dynamo.utils import counters

    counters.clear()
    check_compiled_training(kind, "cuda")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def check_compiled_training(kind: str, device: str) -> None:
    """Three SGD steps of ``Net(kind)`` compiled with ``mode="reduce-overhead"`` against eager ones."""
    torch.manual_seed(0)
    eager, compiled_net = Net(kind).to(device), Net(kind).to(device)
    compiled_net.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_net, mode="reduce-overhead")
    results = []
    for net, model in ((eager, eager), (compiled_net, compiled)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x, y, model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        results.append(_train(net, step, _batches(device)))
    tol = 1e-5 if device == "cpu" else 1e-4  # as the captured steps': a GPU's fusions round differently
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("strategy", ["auto", "triton", "graph", "chunked"])
def test_a_whole_step_is_captured_in_a_cuda_graph(kind, strategy) -> None:
    """Forward, backward and an Adam step captured once (PyTorch's whole-network recipe: warm-up on
    a side stream, gradients allocated in the graph's pool) and replayed over new batches copied
    into the static input: the eager steps' parameters. The ``graph`` strategy's own graphs cannot
    nest in the capture: its scan is captured as eager ops instead."""
    check_captured_step(kind, strategy=strategy)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("iters", [100, 2])
def test_a_whole_step_with_a_newton_forward_is_captured(kind, iters) -> None:
    """A Newton forward captured with the rest: its iterations, its stopping rule and, where it has
    not converged in ``newton_iters`` (2: never), its native fallback all on the device; the eager
    steps' parameters, and stats the replays rewrite."""
    net = check_captured_step(kind, forward_solver="newton", newton_iters=iters)
    stats = net.rnn.solver_stats
    assert len(stats) == 2 and all(s.converged == (iters == 100) for s in stats), stats


def check_captured_step(kind: str, **options) -> torch.nn.Module:
    """A whole step of ``Net(kind, **options)`` captured and replayed against the eager steps; the
    captured net."""
    device = "cuda"
    torch.manual_seed(0)
    eager, captured = Net(kind, **options).to(device), Net(kind, **options).to(device)
    captured.load_state_dict(eager.state_dict())
    batches = _batches(device, n=4)
    opt_eager = torch.optim.Adam(eager.parameters(), lr=1e-2, capturable=True)
    opt_captured = torch.optim.Adam(captured.parameters(), lr=1e-2, capturable=True)

    def eager_step(x, y) -> None:
        opt_eager.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(eager(x), y).backward()
        opt_eager.step()

    static_x, static_y = (t.clone() for t in batches[0])

    def captured_body() -> None:
        torch.nn.functional.cross_entropy(captured(static_x), static_y).backward()
        opt_captured.step()

    # warm-up on a side stream: the first step of each side is the same eager step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt_captured.zero_grad(set_to_none=True)
        captured_body()
    torch.cuda.current_stream().wait_stream(side)
    eager_step(*batches[0])
    graph = torch.cuda.CUDAGraph()
    opt_captured.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        captured_body()

    def replay(x, y) -> None:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()  # its gradients are written, not accumulated: set to None before the capture

    expected = _train(eager, eager_step, batches[1:])
    got = _train(captured, replay, batches[1:])
    for a, b in zip(expected, got, strict=True):
        assert rel_err(a, b) < 1e-4
    return captured


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(MODULES))
def test_make_graphed_callables_takes_a_bppsa_model(kind) -> None:
    """``torch.cuda.make_graphed_callables``: the forward and the backward each one graph."""
    device = "cuda"
    torch.manual_seed(0)
    eager, net = Net(kind).to(device), Net(kind).to(device)
    net.load_state_dict(eager.state_dict())
    batches = _batches(device)
    graphed = torch.cuda.make_graphed_callables(net, (batches[0][0].clone(),))
    results = []
    for model, params in ((eager, eager.parameters()), (graphed, net.parameters())):
        optimizer = torch.optim.SGD(params, lr=0.1)

        def step(x, y, model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        results.append(_train(eager if model is eager else net, step, batches))
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "solver"), [("lstm", "newton"), ("gru", "quasi-newton")])
def test_a_newton_forward_the_device_cannot_finish_refuses_capture_in_one_line(kind, solver) -> None:
    """An LSTM's Newton forward, or quasi-Newton's, needs the host to fall back: the capture is
    refused by name, not broken mid-way."""
    net = Net(kind, forward_solver=solver).to("cuda")
    x = _batches("cuda", n=1)[0][0]
    net(x)  # eagerly it runs
    refused = f"forward_solver='{solver}' is captured in a CUDA graph only for a tanh/relu RNN or a GRU"
    with pytest.raises(RuntimeError, match=refused), torch.cuda.graph(torch.cuda.CUDAGraph()):
        net(x)
