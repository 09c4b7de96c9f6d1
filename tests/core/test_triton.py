"""The Triton scan kernels against their plain-PyTorch twin: under TRITON_INTERPRET=1 on the CPU
(set by conftest when no GPU is present), and on a GPU with the ``gpu`` marker."""

from __future__ import annotations

import collections
from functools import partial

import pytest
import torch
from helpers import extended_except, rel_err
from kernel_cases import CHAIN_ARGS, CHAIN_CASES, chain_case, fused_gru_case, fused_lstm_case, fused_rnn_case
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import matmul_precision

pytest.importorskip("triton")

from bppsa_core import dispatch, jacobians
from bppsa_core import nn as bnn
from bppsa_core import ops as bppsa_ops
from bppsa_core.chain import DenseChain, FactoredChain, LSTMChain
from bppsa_core.scan import chunked_scan, scan


@pytest.fixture(autouse=True)
def nan_filled_empty_tensors(request):
    """On the CPU, every torch.empty filled with NaN, so that a kernel that reads scratch it never
    wrote fails (not on a GPU: deterministic mode refuses cuBLAS without CUBLAS_WORKSPACE_CONFIG)."""
    before = torch.are_deterministic_algorithms_enabled()
    if request.node.get_closest_marker("gpu") is None:
        torch.use_deterministic_algorithms(True)  # with fill_uninitialized_memory, on by default
    yield
    torch.use_deterministic_algorithms(before)


CASES, ARGS = CHAIN_CASES, CHAIN_ARGS


def run(
    device: str,
    n: int,
    batch: int,
    hidden: int,
    chunk: int,
    affine: bool,
    terms: int,
    transposed: bool = False,
    precision: str = "highest",
) -> None:
    """The kernels' scan (under PyTorch's float32 matmul ``precision``) and the twin's in float32 (at
    full precision) against the float64 scan."""
    chain, x, b = chain_case(n, batch, hidden, affine, terms)

    def on(where: str, dtype: torch.dtype | None = None) -> tuple:  # the chain, x and b there
        to = lambda t: None if t is None else t.to(where, dtype)  # noqa: E731
        parts = (to(t) for t in (chain.scales, chain.weights, chain.diagonal))
        return FactoredChain(*parts, transposed=transposed), to(x), to(b)

    twin = chunked_scan(*on(device), chunk=chunk)
    with matmul_precision(precision):
        kernel = scan(*on(device), strategy="triton", chunk=chunk)
    assert kernel.shape == (n + 1, batch, hidden)
    # Both against the float64 scan of the same inputs: the kernel rounds in its own order, so on
    # long growing chains it may differ from the twin by more than either differs from the truth;
    # TF32 products or a wrong step would be off by 1e-3 or more.
    truth = chunked_scan(*on("cpu", torch.float64), chunk=chunk)
    twin_err, kernel_err = rel_err(truth, twin.cpu()), rel_err(truth, kernel.cpu())
    slack = 4 if precision == "highest" else 16  # three TF32 products drop terms of about 2^-22
    assert kernel_err < max(1e-5, slack * twin_err), (kernel_err, twin_err)
    assert precision == "highest" or kernel_err < 1e-4, (kernel_err, twin_err)


@pytest.mark.parametrize(ARGS, extended_except(CASES, *CASES[::9]))
def test_kernels_match_the_chunked_twin_on_the_cpu(n, batch, hidden, chunk, affine, terms) -> None:
    run("cpu", n, batch, hidden, chunk, affine, terms)


# The widest hidden size the kernels take (dispatch.MAX_HIDDEN) and a longer chunk, as the GPU cases
# have them, kept small enough for the interpreter.
WIDE_CASES = [(37, 2, 64, 4, True, 3), (37, 3, 64, 5, False, 1), (200, 2, 64, 22, True, 1)]


@pytest.mark.extended
@pytest.mark.parametrize(ARGS, WIDE_CASES)
@pytest.mark.parametrize("transposed", [False, True])
def test_kernels_match_the_chunked_twin_at_the_widest_hidden_size_on_the_cpu(
    n, batch, hidden, chunk, affine, terms, transposed
) -> None:
    assert hidden == dispatch.MAX_HIDDEN
    run("cpu", n, batch, hidden, chunk, affine, terms, transposed=transposed)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ARGS,
    [
        *CASES,
        (1000, 16, 20, 22, False, 1),
        (1000, 16, 64, 22, True, 1),
        (1034, 64, 20, 23, True, 3),
        (1034, 16, 64, 23, True, 3),
    ],
)
def test_kernels_match_the_chunked_twin_on_a_gpu(n, batch, hidden, chunk, affine, terms) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    run("cuda", n, batch, hidden, chunk, affine, terms)


# The transposed chains (SCALES_T: tangents, Newton iterations) at chunk 4, which runs all three kernels.
TRANSPOSED_CASES = [c for c in CASES if c[3] == 4]


@pytest.mark.gpu
@pytest.mark.parametrize(ARGS, [(1000, 16, 20, 22, True, 1), (1034, 16, 64, 23, False, 1)])
@pytest.mark.parametrize("transposed", [False, True])
def test_three_tf32_products_keep_the_kernels_float32_accuracy_on_a_gpu(
    n, batch, hidden, chunk, affine, terms, transposed
) -> None:
    """Under ``torch.set_float32_matmul_precision("high")`` the reduce multiplies in three TF32
    products (``launch.dot_precision``): the scan stays as close to the float64 one as full float32's
    twin (one TF32 product would be off by 1e-3)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    run("cuda", n, batch, hidden, chunk, affine, terms, transposed=transposed, precision="high")


def distance(truths: tuple, got: tuple) -> float:
    """The largest relative distance of a layer backward's outputs from its float64 twin's."""
    return max(rel_err(t, v.double().cpu()) for t, v in zip(truths, got, strict=True))


def fused_layer(kind: str, chunk: int) -> tuple:
    """A fused layer backward's case maker (``kernel_cases``) and the backward, by kind."""
    from bppsa_core import triton as ts

    return {
        "tanh": (partial(fused_rnn_case, "tanh"), lambda *a: ts.rnn_layer_backward(*a, "tanh", chunk)),
        "gru": (fused_gru_case, lambda *a: ts.gru_layer_backward(*a, chunk)),
        "lstm": (fused_lstm_case, lambda *a: ts.lstm_layer_backward(*a, chunk)),
    }[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tanh", "lstm"])  # a GRU's chain keeps full float32 products
@pytest.mark.parametrize(("n", "batch", "hidden", "chunk"), [(1000, 16, 20, 22), (1034, 64, 32, 23)])
def test_three_tf32_products_keep_a_layer_backwards_float32_accuracy_on_a_gpu(
    kind, n, batch, hidden, chunk
) -> None:
    """A fused layer backward with three TF32 products a reduce step (``matmul precision "high"``)
    about as close to the float64 twin's g_0 and deltas as with full float32 products: within 16
    times their distance or 1e-5, and under 1e-4 (one TF32 product is off by 1e-3)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    case, backward = fused_layer(kind, chunk)
    args, truths = case(n, batch, hidden, chunk, True, torch.float64)
    args = [a.float().cuda() for a in args]
    err = {}
    for precision in ("highest", "high"):
        with matmul_precision(precision):
            got = backward(*args)
        err[precision] = distance(truths, got)
    assert err["high"] < min(1e-4, max(1e-5, 16 * err["highest"])), err  # as ``run``'s bound


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [1, 2])
@pytest.mark.parametrize("kind", ["tanh", "gru", "lstm"])
def test_the_walks_on_fewer_warps_keep_a_layer_backwards_float32_accuracy_on_a_gpu(kind, warps) -> None:
    """``launch.walk_warps``: with its walks on 1 or 2 warps, a fused layer backward is as close to
    the float64 twin as on its own warps (within 4 times their distance, or 1e-5)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    from bppsa_core.triton.launch import walk_warps

    case, backward = fused_layer(kind, 22)
    args, truths = case(1000, 16, 20, 22, True, torch.float64)
    args = [a.float().cuda() for a in args]
    own = distance(truths, backward(*args))
    with walk_warps(warps):
        set_ = distance(truths, backward(*args))
    assert set_ < max(1e-5, 4 * own), (set_, own)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tanh", "gru", "lstm"])
def test_direct_launches_give_what_tritons_own_launches_give_on_a_gpu(kind, monkeypatch) -> None:
    """``launch.direct_launches``: a fused layer backward launched straight to its compiled kernels
    (CUDA's launcher takes them: none refused) returns, bit for bit, what it returns with every
    launch through Triton's ``kernel[grid](...)``, also with an input whose pointer is not 16-byte
    aligned (a binary of its own)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    from bppsa_core.triton import launch
    from bppsa_core.triton.launch import direct_launches

    direct_calls = []
    plan_launch = launch._Plan.launch
    monkeypatch.setattr(
        launch._Plan, "launch", lambda self, grid: direct_calls.append(1) or plan_launch(self, grid)
    )

    case, backward = fused_layer(kind, 22)
    args, _ = case(300, 16, 20, 22, True, torch.float32)
    aligned = [a.cuda() for a in args]
    unaligned = [aligned[0].new_empty(aligned[0].numel() + 1)[1:].view_as(aligned[0]).copy_(aligned[0])]
    for inputs in (aligned, unaligned + aligned[1:]):
        with direct_launches(False):
            own = backward(*inputs)
        for _ in range(3):  # the first launch of a binary is Triton's; the later ones are direct
            direct = backward(*inputs)
        for a, b in zip(own, direct, strict=True):
            assert torch.equal(a, b)
    assert direct_calls and launch._refused is None


@pytest.mark.parametrize(ARGS, extended_except(TRANSPOSED_CASES, *TRANSPOSED_CASES[::9]))
def test_kernels_match_the_chunked_twin_on_transposed_chains(n, batch, hidden, chunk, affine, terms) -> None:
    run("cpu", n, batch, hidden, chunk, affine, terms, transposed=True)


@pytest.mark.gpu
@pytest.mark.parametrize(ARGS, [*TRANSPOSED_CASES, (1000, 16, 20, 22, True, 1), (1034, 16, 64, 23, True, 3)])
def test_kernels_match_the_chunked_twin_on_transposed_chains_on_a_gpu(
    n, batch, hidden, chunk, affine, terms
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    run("cuda", n, batch, hidden, chunk, affine, terms, transposed=True)


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["RNN", "GRU"])
def test_newton_iterations_and_tangents_take_the_transposed_kernels(monkeypatch, kind) -> None:
    """With strategy="triton", a Newton forward's solves and a tangent are the SCALES_T kernels."""
    from bppsa_core import triton as ts
    from bppsa_core.triton import newton as newton_kernels

    torch.manual_seed(0)
    ref = getattr(torch.nn, kind)(2, 6)
    ours = getattr(bnn, kind)(2, 6, strategy="triton", chunk=4, forward_solver="newton")
    ours.load_state_dict(ref.state_dict())
    calls = []
    kernel = ts.factored_scan
    for module in (ts, newton_kernels):  # a tangent's scan; a Newton iteration's, in its fused iteration
        monkeypatch.setattr(
            module, "factored_scan", lambda *a, **k: calls.append(a[0].transposed) or kernel(*a, **k)
        )
    x = torch.randn(23, 2, 2, generator=torch.Generator().manual_seed(0))
    assert (ours(x)[0] - ref(x)[0]).abs().max() < 1e-5
    assert calls and all(calls), calls  # every Newton iteration, transposed
    calls.clear()
    dx = torch.randn_like(x)
    expected = torch.func.jvp(lambda x: ref(x)[0], (x,), (dx,))[1]
    with torch.no_grad():
        got = torch.func.jvp(lambda x: ours(x)[0], (x,), (dx,))[1]
    # the forward's Newton iterations again, then the tangent: all transposed
    assert calls == [True] * (ours.solver_stats[0].iterations + 1) and rel_err(expected, got) < 1e-4


LSTM_CASES = [
    (n, batch, hidden, chunk, affine, past_end)
    for n, batch, hidden in ((2, 1, 1), (9, 2, 5), (37, 3, 17), (6, 1, 32))
    for chunk in (1, 4)
    for affine in (False, True)
    for past_end in (False, True)
]


def run_lstm(device: str, n: int, batch: int, hidden: int, chunk: int, affine: bool, past_end: bool) -> None:
    """An LSTM's chain over (h, c); ``past_end``: with h's identity term of shorter sequences."""
    g = torch.Generator().manual_seed(n * 100 + hidden)
    vectors = [torch.rand(n, batch, 4, hidden, generator=g) * 0.5 for _ in range(2)]
    diagonals = [torch.rand(n, batch, hidden, generator=g) for _ in range(3 if past_end else 2)]
    w = torch.randn(4, hidden, hidden, generator=g) / (4 * hidden) ** 0.5
    x = torch.randn(batch, 2 * hidden, generator=g)
    b = torch.randn(n, batch, 2 * hidden, generator=g) if affine else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    chain = LSTMChain(*map(to, vectors), to(w), *map(to, diagonals))
    twin = chunked_scan(chain, to(x), to(b), chunk=chunk)
    kernel = scan(chain, to(x), to(b), strategy="triton", chunk=chunk)
    assert kernel.shape == (n + 1, batch, 2 * hidden)
    assert rel_err(twin.double().cpu(), kernel.double().cpu()) < 1e-5


LSTM_ARGS = ("n", "batch", "hidden", "chunk", "affine", "past_end")


@pytest.mark.parametrize(LSTM_ARGS, extended_except(LSTM_CASES, *LSTM_CASES[::7]))
def test_lstm_kernels_match_the_chunked_twin_on_the_cpu(n, batch, hidden, chunk, affine, past_end) -> None:
    run_lstm("cpu", n, batch, hidden, chunk, affine, past_end)


@pytest.mark.gpu
@pytest.mark.parametrize(
    LSTM_ARGS, [*LSTM_CASES, (1000, 16, 32, 22, True, False), (1034, 64, 20, 23, True, True)]
)
def test_lstm_kernels_match_the_chunked_twin_on_a_gpu(n, batch, hidden, chunk, affine, past_end) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    run_lstm("cuda", n, batch, hidden, chunk, affine, past_end)


@pytest.mark.parametrize(
    ("ref_cls", "our_cls"),
    extended_except([(torch.nn.RNN, bnn.RNN), (torch.nn.GRU, bnn.GRU), (torch.nn.LSTM, bnn.LSTM)], first=1),
)
def test_a_recurrent_net_trains_with_the_triton_backward(ref_cls, our_cls) -> None:
    torch.manual_seed(0)
    ref = ref_cls(2, 7, num_layers=2)
    ours = our_cls(2, 7, num_layers=2, strategy="triton", chunk=3)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(19, 3, 2)
    grads = []
    for m in (ref, ours):
        out, state = m(x)
        states = state if isinstance(state, tuple) else (state,)
        (out.sum() + sum(s.pow(2).sum() for s in states)).backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize(
    ("chain", "why"),
    [
        (FactoredChain(torch.rand(5, 2, 1, 65), torch.randn(1, 65, 65)), "RNN H = 65: Hp = 128"),
        (FactoredChain(torch.rand(5, 2, 3, 65), torch.randn(3, 65, 65)), "GRU H = 65"),
        (FactoredChain(torch.rand(5, 2, 4, 4), torch.randn(4, 4, 4)), "four terms"),
        (FactoredChain(torch.rand(5, 2, 1, 4).double(), torch.randn(1, 4, 4).double()), "float64"),
        (DenseChain(torch.rand(5, 2, 4, 4)), "a dense chain"),
        (
            LSTMChain(
                *[torch.rand(5, 2, 4, 3)] * 2,
                torch.randn(4, 3, 3),
                *[torch.rand(5, 2, 3)] * 2,
                transposed=True,
            ),
            "a transposed LSTM chain",
        ),
        (
            LSTMChain(*[torch.rand(5, 2, 4, 33)] * 2, torch.randn(4, 33, 33), *[torch.rand(5, 2, 33)] * 2),
            "LSTM H = 33",
        ),
    ],
)
def test_chains_the_kernels_do_not_take_are_refused(chain, why) -> None:
    match = "strategy='triton' takes a float32 factored chain of at most 3 terms"
    with pytest.raises(ValueError, match=match):
        scan(chain, torch.zeros(2, chain.hidden, dtype=chain.tensors()[0].dtype), strategy="triton")


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
@pytest.mark.parametrize(
    ("n", "batch", "hidden", "chunk"), extended_except([(37, 3, 5, 4), (9, 1, 20, 2), (7, 2, 3, 8)], first=1)
)
@pytest.mark.parametrize("outside", extended_except([False, True], True))
def test_the_fused_rnn_backward_matches_its_reference(nonlinearity, n, batch, hidden, chunk, outside) -> None:
    """Jacobians built in the kernels from h, offsets read shifted, only g_0 and the deltas written;
    the reference is the layer's twin (``jacobians``' factors scanned by ``chunked_scan``)."""
    from bppsa_core import triton as ts

    args, twins = fused_rnn_case(nonlinearity, n, batch, hidden, chunk, outside, torch.float32)
    refs = ts.rnn_layer_backward_ref(*args, nonlinearity, chunk)
    g0, delta = ts.rnn_layer_backward(*args, nonlinearity, chunk)
    assert g0.shape == (batch, hidden) and delta.shape == (n, batch, hidden)
    for twin, ref, value in zip(twins, refs, (g0, delta), strict=True):
        assert rel_err(twin, ref) < 1e-6 and rel_err(ref, value) < 1e-5


def test_the_fused_relu_backward_passes_the_gradient_through_non_finite_outputs() -> None:
    """A NaN or inf output of a relu layer (an infinite input's) passes its gradient, as autograd's
    ``threshold_backward`` does: g_0 and the deltas stay finite and equal the reference's."""
    from bppsa_core import triton as ts

    args, twins = fused_rnn_case("relu", 9, 2, 5, 4, True, torch.float32, non_finite=True)
    got = ts.rnn_layer_backward(*args, "relu", 4)
    refs = ts.rnn_layer_backward_ref(*args, "relu", 4)
    for twin, ref, value in zip(twins, refs, got, strict=True):
        assert torch.isfinite(value).all() and rel_err(twin, ref) < 1e-6 and rel_err(ref, value) < 1e-5


@pytest.mark.parametrize(
    ("n", "batch", "hidden", "chunk"),
    extended_except([(37, 3, 5, 4), (9, 1, 20, 2), (7, 2, 3, 8), (11, 2, 64, 3)], first=1),
)
@pytest.mark.parametrize("outside", extended_except([False, True], True))
def test_the_fused_gru_backward_matches_its_reference(n, batch, hidden, chunk, outside) -> None:
    """Gates and Jacobians recomputed in the kernels from the two pre-activation GEMMs and h_{t-1};
    g_0 and the input- and hidden-side pre-activation gradients written. The reference recomputes
    them as the kernels do, and gives what the layer's twin (``GRUCell``'s factors) gives."""
    from bppsa_core import triton as ts

    args, twins = fused_gru_case(n, batch, hidden, chunk, outside, torch.float32)
    refs = ts.gru_layer_backward_ref(*args, chunk)
    got = ts.gru_layer_backward(*args, chunk)
    assert got[0].shape == (batch, hidden) and got[1].shape == got[2].shape == (n, batch, 3 * hidden)
    for twin, ref, value in zip(twins, refs, got, strict=True):
        assert rel_err(twin, ref) < 1e-6 and rel_err(ref, value) < 1e-5


@pytest.mark.parametrize(
    ("n", "batch", "hidden", "chunk"),
    extended_except([(37, 3, 5, 4), (9, 1, 20, 2), (7, 2, 3, 8), (11, 2, 32, 3)], first=1),
)
@pytest.mark.parametrize("outside", extended_except([False, True], True))
def test_the_fused_lstm_backward_matches_its_reference(n, batch, hidden, chunk, outside) -> None:
    """Factors formed in the kernels from the activated gates and the cell states; g_0 = (dL/dh_0,
    dL/dc_0) and the gates' pre-activation gradients written. The reference forms them as
    ``LSTMCell`` does, and gives what the layer's twin (its factors from x and h_{t-1}) gives."""
    from bppsa_core import triton as ts

    args, twins = fused_lstm_case(n, batch, hidden, chunk, outside, torch.float32)
    refs = ts.lstm_layer_backward_ref(*args, chunk)
    got = ts.lstm_layer_backward(*args, chunk)
    assert got[0].shape == (batch, 2 * hidden) and got[1].shape == (n, batch, 4 * hidden)
    for twin, ref, value in zip(twins, refs, got, strict=True):
        assert rel_err(twin, ref) < 1e-6 and rel_err(ref, value) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "batch", "hidden", "chunk"), [(1000, 16, 20, 22), (1034, 64, 32, 23)])
def test_the_fused_lstm_backward_and_its_cell_states_match_their_references_on_a_gpu(
    n, batch, hidden, chunk
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    from bppsa_core import triton as ts

    args, _ = fused_lstm_case(n, batch, hidden, chunk, True, torch.float32)
    gates, cells, *rest = (a.cuda() for a in args)
    assert rel_err(ts.lstm_cells_ref(gates, cells[0]), ts.lstm_cells(gates, cells[0])) < 1e-5
    refs = ts.lstm_layer_backward_ref(gates, cells, *rest, chunk)
    for ref, value in zip(refs, ts.lstm_layer_backward(gates, cells, *rest, chunk), strict=True):
        assert rel_err(ref, value) < 1e-4


@pytest.mark.parametrize(
    ("n", "batch", "hidden"), extended_except([(130, 2, 5), (1, 1, 3), (64, 3, 20), (7, 2, 32)], first=1)
)
def test_the_lstm_cell_states_match_their_reference(n, batch, hidden) -> None:
    """c_t = f_t c_{t-1} + i_t g_t from c_0 in tiles of 64 steps, each a scan (several tiles and a
    partial last one; one tile; one step): as ``scan.elementwise_recurrence`` gives them."""
    from bppsa_core import triton as ts

    g = torch.Generator().manual_seed(n)
    gates, c0 = torch.rand(n, batch, 4, hidden, generator=g), torch.randn(batch, hidden, generator=g)
    cells = ts.lstm_cells(gates, c0)
    assert cells.shape == (n + 1, batch, hidden) and torch.equal(cells[0], c0)
    assert rel_err(ts.lstm_cells_ref(gates, c0), cells) < 1e-6


@pytest.mark.parametrize(
    ("n", "batch", "hidden", "bias"),
    extended_except([(300, 4, 20, True), (1, 1, 3, False), (7, 3, 32, True), (2, 2, 1, True)], first=2),
)
def test_the_lstm_gates_are_activated_in_place_as_the_eager_cell_makes_them(n, batch, hidden, bias) -> None:
    """One kernel over the GEMMs' sums (several programs and a partial last one; a single element
    row): b_hh added, the sigmoid, tanh for g, in place, as ``LSTMCell.activations`` makes them
    from the same weights; a strided tensor, which it cannot write in place, is refused."""
    from bppsa_core import triton as ts
    from bppsa_core.jacobians import LayerWeights, LSTMCell

    g = torch.Generator().manual_seed(n)
    x, h_prev = torch.randn(n, batch, 3, generator=g), torch.randn(n, batch, hidden, generator=g)
    w = LayerWeights(
        torch.randn(4 * hidden, 3, generator=g), torch.randn(4 * hidden, hidden, generator=g),
        torch.randn(4 * hidden, generator=g), torch.randn(4 * hidden, generator=g) if bias else None,
    )  # fmt: skip
    pre = LSTMCell().gate_sums(x, h_prev, w)
    ref = ts.lstm_gates_ref(pre, w.b_hh)
    gates = ts.lstm_gates(pre, w.b_hh)
    assert gates.shape == (n, batch, 4, hidden) and gates.data_ptr() == pre.data_ptr()
    assert (gates - ref).abs().max() < 1e-6
    assert (gates - LSTMCell().activations(x, h_prev, w)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="must be contiguous"):
        ts.lstm_gates(torch.zeros(2, 8 * hidden)[:, ::2], None)


@pytest.mark.parametrize(
    ("kind", "fused"),
    [("RNN", "rnn_layer_backward"), ("GRU", "gru_layer_backward"), ("LSTM", "lstm_layer_backward")],
)
def test_a_net_with_the_triton_strategy_takes_the_fused_path(monkeypatch, kind, fused) -> None:
    from bppsa_core import triton as ts

    torch.manual_seed(0)
    kwargs = {"nonlinearity": "relu"} if kind == "RNN" else {}
    ref = getattr(torch.nn, kind)(2, 6, num_layers=2, **kwargs)
    ours = getattr(bnn, kind)(2, 6, num_layers=2, strategy="triton", chunk=4, **kwargs)

    calls = []
    kernel = getattr(ts, fused)
    monkeypatch.setattr(ts, fused, lambda *a: calls.append(1) or kernel(*a))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(23, 2, 2, generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (ref, ours):
        state = m(x)[1]  # loss on h_n (and c_n) only: the top layer's chain is the linear one
        sum(s.pow(2).sum() for s in (state if isinstance(state, tuple) else (state,))).backward()
        grads.append([p.grad for p in m.parameters()])
    assert len(calls) == ours.num_layers
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-4


# What one layer's backward launches on a GPU with strategy "triton" (T = 30, B = 16, H = 20, a
# gradient on every output and none on h_n): Triton kernels and kernel-launching torch ops, as
# docs/DESIGN.md ("Launches of a layer backward") lists them. The test fails above them.
LAYER_LAUNCHES = {"RNN": (3, 6), "GRU": (3, 8), "LSTM": (5, 11)}
# torch ops that launch no kernel: allocations, views and metadata.
NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "t", "transpose",
    "unsqueeze", "squeeze", "select", "slice", "expand", "as_strided", "detach", "alias", "_reshape_alias",
    "_unsafe_view", "permute", "unbind", "split", "narrow", "unflatten", "reshape", "flatten", "lift_fresh",
}  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel-launching torch ops run under it, the layer's operators included from the
    inside (their implementations run under the mode), and nothing Triton's interpreter runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "bppsa":  # ops._backward_op and its kin: counted from the inside
            with self:
                return getattr(bppsa_ops, f"_{name.removeprefix('layer_')}_op")._init_fn(*args, **kwargs)
        if not self.paused and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **kwargs)


@pytest.mark.extended  # Triton's interpreter runs the kernels: seconds each
@pytest.mark.parametrize("kind", list(LAYER_LAUNCHES))
def test_a_layer_backward_launches_no_more_than_documented(monkeypatch, kind) -> None:
    from bppsa_core.triton.launch import Launch

    counter, kernels = LaunchCounter(), []
    real = Launch.run

    def run(self, grid, **args):
        kernels.append(grid)
        counter.paused = True  # the interpreter's own tensor work is no launch
        try:
            return real(self, grid, **args)
        finally:
            counter.paused = False

    monkeypatch.setattr(Launch, "run", run)
    # a GPU's weight gradients are row-major GEMMs; the CPU's narrow ones are column-major, then copied
    monkeypatch.setattr(jacobians, "_NARROW", 0)
    torch.manual_seed(0)
    layer = getattr(bnn, kind)(1, 20, strategy="triton")
    out, _ = layer(torch.randn(30, 16, 1))
    grad = torch.randn_like(out)
    with counter:
        torch.autograd.backward(out, grad)
    triton_launches, torch_launches = LAYER_LAUNCHES[kind]
    assert len(kernels) <= triton_launches, kernels
    assert sum(counter.ops.values()) <= torch_launches, str(dict(counter.ops))
    assert layer.weight_hh_l0.grad is not None


@pytest.mark.parametrize(
    ("precision", "dot"),
    [("highest", "ieee"), ("high", "tf32x3"), pytest.param("medium", "tf32x3", marks=pytest.mark.extended)],
)
def test_the_reduce_products_follow_pytorchs_float32_matmul_precision(precision, dot) -> None:
    """``torch.set_float32_matmul_precision`` sets the ``tl.dot`` precision of an RNN's and an LSTM's
    reduce kernel (``launch.dot_precision``): PyTorch's default, "highest", full float32. A GRU's
    three-term chain stays full float32, and no other kernel has a precision."""
    from benchmarks.kernels import launches_recorded
    from bppsa_core import triton as ts

    rnn, _ = fused_rnn_case("tanh", 37, 2, 5, 4, True, torch.float32)
    gru, _ = fused_gru_case(37, 2, 5, 4, True, torch.float32)
    lstm, _ = fused_lstm_case(37, 2, 5, 4, True, torch.float32)
    # recorded, not run: the interpreter would take seconds a kernel, and only the launches are read
    with launches_recorded() as launches, matmul_precision(precision):
        ts.rnn_layer_backward(*rnn, "tanh", 4)
        ts.gru_layer_backward(*gru, 4)
        ts.lstm_layer_backward(*lstm, 4)
    assert torch.get_float32_matmul_precision() == "highest"  # restored
    dots = {}
    for launch, _ in launches:
        dots.setdefault(launch.kernel.__name__, []).append(launch.constexprs.get("DOT"))
    assert dots.pop("_reduce") == [dot, "ieee"] and dots.pop("_lstm_reduce") == [dot], dots
    assert {d for launches in dots.values() for d in launches} == {None}, dots


def test_the_walks_run_on_the_warps_a_program_sets_where_the_weights_fit(monkeypatch) -> None:
    """``launch.walk_warps`` sets the spine's and the expand's warps at HP <= 32 (an LSTM's at least 2
    at HP = 32), not the reduce's, and leaves them at HP = 64; restored after; the results stay the
    same. A count it does not take is refused, naming it."""
    from bppsa_core import triton as ts
    from bppsa_core.triton.launch import Launch, walk_warps

    launched, real = [], Launch.run

    def run(self, grid, **args):
        launched.append((self.kernel.__name__, self.constexprs["HP"], self.num_warps))
        return real(self, grid, **args)

    monkeypatch.setattr(Launch, "run", run)
    rnn, _ = fused_rnn_case("tanh", 37, 2, 20, 4, True, torch.float32)
    gru, _ = fused_gru_case(11, 2, 64, 3, True, torch.float32)
    lstm, _ = fused_lstm_case(9, 1, 20, 2, True, torch.float32)
    backwards = (
        lambda: ts.rnn_layer_backward(*rnn, "tanh", 4),
        lambda: ts.gru_layer_backward(*gru, 3),
        lambda: ts.lstm_layer_backward(*lstm, 2),
    )
    own = [f() for f in backwards]
    warps = {(k, hp): w for k, hp, w in launched if k != "_lstm_cells"}
    reducing = ts.chunk_scan.reduce_warps(ts.GRU.value, 3, 64)  # 8 under Triton 3.6
    assert warps == {
        ("_reduce", 32): 4, ("_spine", 32): 4, ("_expand", 32): 4,
        ("_reduce", 64): reducing, ("_spine", 64): 8, ("_expand", 64): 8,
        ("_lstm_reduce", 32): 8, ("_lstm_spine", 32): 8, ("_lstm_expand", 32): 8,
    }  # fmt: skip
    launched.clear()
    with walk_warps(1):
        set_ = [f() for f in backwards]
    walks = {("_spine", 32): 1, ("_expand", 32): 1, ("_lstm_spine", 32): 2, ("_lstm_expand", 32): 2}
    assert {(k, hp): w for k, hp, w in launched if k != "_lstm_cells"} == warps | walks
    for a, b in zip(own, set_, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    launched.clear()
    ts.rnn_layer_backward(*rnn, "tanh", 4)
    assert {w for k, _, w in launched} == {4}  # restored
    refused = r"^walk warps must be one of 1, 2, 4 or None, got 3$"
    with pytest.raises(ValueError, match=refused), walk_warps(3):
        pass


def test_a_gru_too_wide_for_the_kernels_is_refused_by_the_triton_strategy() -> None:
    gru = bnn.GRU(2, 65, strategy="triton")
    with pytest.raises(ValueError, match=r"strategy='triton' takes a float32 factored chain .* H <= 64"):
        gru(torch.randn(5, 2, 2))[0].sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["auto", "triton", "graph", "blelloch", "chunked"])
@pytest.mark.parametrize(
    ("ref_cls", "our_cls"), [(torch.nn.RNN, bnn.RNN), (torch.nn.GRU, bnn.GRU), (torch.nn.LSTM, bnn.LSTM)]
)
@pytest.mark.parametrize("layout", ["plain", "bidirectional, packed"])
def test_every_gpu_path_gives_cudnn_gradients(strategy, ref_cls, our_cls, layout) -> None:
    """Each GPU path, twice (the graph path replays its capture), against cuDNN's BPTT. cuDNN may run
    its fp32 forward in TF32 (``torch.backends.cudnn.allow_tf32``), hence the looser tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    torch.manual_seed(0)
    two_way = layout != "plain"
    ref = ref_cls(3, 20, batch_first=True, num_layers=2, bidirectional=two_way).cuda()
    ours = our_cls(3, 20, batch_first=True, num_layers=2, bidirectional=two_way, strategy=strategy).cuda()
    ours.load_state_dict(ref.state_dict())
    for seed in (1, 2):
        x = torch.randn(16, 517, 3, generator=torch.Generator().manual_seed(seed)).cuda()
        if two_way:
            lengths = torch.randint(1, 518, (16,), generator=torch.Generator().manual_seed(seed))
            x = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        grads = []
        for m in (ref, ours):
            m.zero_grad()
            out, state = m(x)
            out = out.data if two_way else out
            states = state if isinstance(state, tuple) else (state,)
            (out.mean() + sum(s.pow(2).sum() for s in states)).backward()
            grads.append([p.grad for p in m.parameters()])
        for a, b in zip(*grads, strict=True):
            assert rel_err(a, b) < 2e-3
