"""Which scan runs where: options, device checks, what "auto" picks, and the one kernel fallback."""

from __future__ import annotations

import math

import pytest
import torch

from bppsa_core import dispatch
from bppsa_core import scan as scan_mod
from bppsa_core.chain import FactoredChain
from bppsa_core.dispatch import ScanOptions, check_device, choose, eager_strategy, kernels_take, resolve
from bppsa_core.scan import scan, sequential_scan

CPU, GPU = torch.device("cpu"), torch.device("cuda")
F32, F64 = torch.float32, torch.float64


def test_auto_choices() -> None:
    assert choose(8, 16, 20, CPU) == "sequential"
    assert choose(1000, 16, 20, CPU) == "chunked"
    assert choose(1000, 16, 1024, CPU) == "sequential"  # H^3 work outweighs the depth
    assert choose(1000, 16, 20, CPU, kernels_fit=True) == "chunked"  # Triton kernels are for GPUs
    assert choose(8, 16, 20, CPU, numba_fit=True) == "numba"  # compiled: no per-op overhead to weigh
    assert choose(1000, 16, 20, GPU, kernels_fit=True, numba_fit=True) == "triton"  # numba: CPU only
    assert choose(1000, 16, 256, GPU, numba_fit=True) == "graph"
    assert choose(1000, 16, 20, GPU, kernels_fit=True) == "triton"
    assert choose(1000, 16, 256, GPU) == "graph"  # the kernels do not take H = 256
    # What the CUDA graph captures: Blelloch, unless its up-sweep would not fit.
    assert eager_strategy(1000, 16, 20, GPU) == "blelloch"
    assert eager_strategy(10_000, 16, 256, GPU) == "chunked"  # a 42 GB up-sweep would not fit


def test_the_default_chunk_takes_the_fewest_dependent_steps() -> None:
    """Against every chunk that could do better (past 3 sqrt(n), 2C alone passes the balanced
    chunk's steps), and fewer steps than the balanced chunk sqrt(n / 2) where its remainder is long:
    T = 1,000 takes chunks of 27 (remainder 1, 91 steps), not 22 (remainder 10, 98)."""
    steps = dispatch.chunked_steps
    assert (dispatch.default_chunk(1000), steps(1000, 22), steps(1000, 27)) == (27, 98, 91)
    for n in [*range(1, 3000), *range(3000, 100_000, 97)]:
        chunks = [*range(1, min(n, 3 * math.isqrt(n) + 3) + 1), n]
        fewest = min(steps(n, c) for c in chunks)
        assert steps(n, dispatch.default_chunk(n)) == fewest, n
    assert dispatch.default_chunk(10_000, 1 << 20) == 10_000 // 24 + 1  # the working-set floor


@pytest.mark.parametrize(
    ("strategy", "mode", "hidden", "device", "dtype", "instead"),
    [
        ("auto", "LSTM", 64, GPU, F32, True),  # above the LSTM kernels' 32, within cuDNN's 128
        ("auto", "LSTM", 128, GPU, F32, True),
        ("auto", "LSTM", 32, GPU, F32, False),  # the Triton kernels take it
        ("auto", "LSTM", 256, GPU, F32, True),  # past cuDNN's persistent kernels, still ahead there
        ("auto", "LSTM", 1024, GPU, F32, True),
        ("auto", "GRU", 64, GPU, F32, False),
        ("auto", "GRU", 128, GPU, F32, True),
        ("auto", "GRU", 129, GPU, F32, False),  # past cuDNN's persistent kernels the GRU's scan leads
        ("auto", "GRU", 256, GPU, F32, False),
        ("auto", "GRU", 257, GPU, F32, True),  # until its H^3 work takes the lead back
        ("auto", "GRU", 1024, GPU, F32, True),
        ("auto", "RNN_TANH", 256, GPU, F32, True),
        ("auto", "RNN_RELU", 65, GPU, F32, True),
        ("auto", "RNN_RELU", 64, GPU, F32, False),
        ("auto", "RNN_TANH", 512, GPU, F32, True),  # wider still: the scan's H^3 work loses more
        ("auto", "GRU", 512, CPU, F32, False),  # its walk over the tape wins up to there
        ("auto", "GRU", 513, CPU, F32, True),  # past the compiled forward: no tape
        ("auto", "RNN_TANH", 1024, CPU, F32, False),  # the RNN's walk is never slower there
        ("auto", "GRU", 256, CPU, F64, False),
        ("auto", "LSTM", 64, GPU, F64, False),
        ("chunked", "LSTM", 64, GPU, F32, False),  # an explicit strategy runs BPPSA
    ],
)
def test_auto_leaves_a_module_to_torch_nn_only_where_its_kernels_win(
    strategy, mode, hidden, device, dtype, instead
) -> None:
    assert dispatch.torch_nn_instead(strategy, mode, hidden, device, dtype) is instead


@pytest.mark.parametrize("wide, widest", [(False, 192), (True, 384)])
def test_a_cpu_lstm_is_left_to_torch_nn_past_where_its_vectors_win(monkeypatch, wide, widest) -> None:
    """The CPU's compiled LSTM is faster up to H = 192, or 384 in AVX-512's vectors
    (``dispatch.wide_vectors``), under which its taped forward runs to there."""
    monkeypatch.setattr(dispatch, "wide_vectors", lambda: wide)
    dispatch._compiled_forward_takes.cache_clear()
    try:
        assert [dispatch.torch_nn_instead("auto", "LSTM", h, CPU, F32) for h in (20, widest, widest + 1)] == [
            False, False, True,
        ]  # fmt: skip
        taped = 384 if wide else 128
        takes = dispatch.compiled_forward_takes
        assert [takes("auto", "LSTM", h, "cpu", (F32,), True) for h in (taped, taped + 1)] == [True, False]
    finally:
        dispatch._compiled_forward_takes.cache_clear()


def test_inference_that_the_compiled_forward_takes_is_not_left_to_torch_nn(monkeypatch) -> None:
    """A CPU GRU left to torch.nn for training above some H (128 here) still runs the compiled
    forward in inference up to H = 512, where that beats PyTorch's
    (``dispatch._COMPILED_FORWARD_MAX_HIDDEN``)."""
    monkeypatch.setitem(dispatch._TORCH_NN_HIDDEN["cpu"], "GRU", ((128, math.inf),))
    assert dispatch.torch_nn_instead("auto", "GRU", 192, CPU, F32)
    assert not dispatch.torch_nn_instead("auto", "GRU", 192, CPU, F32, inference=True)
    assert not dispatch.torch_nn_instead("auto", "GRU", 512, CPU, F32, inference=True)
    assert dispatch.torch_nn_instead("auto", "GRU", 513, CPU, F32, inference=True)
    assert dispatch.torch_nn_instead("auto", "LSTM", 512, CPU, F32, inference=True)
    assert dispatch.torch_nn_instead("auto", "GRU", 1024, GPU, F32, inference=True)


def test_auto_keeps_bppsa_when_cudnn_is_off(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "enabled", False)
    assert not dispatch.torch_nn_instead("auto", "LSTM", 64, GPU, F32)


def test_resolve_keeps_an_explicit_strategy_and_takes_kernels_only_where_they_work(monkeypatch) -> None:
    assert resolve("blelloch", 1000, 16, 20, GPU, kernels_fit=True) == "blelloch"
    monkeypatch.setattr(dispatch, "_BROKEN_KERNELS", set())
    assert resolve("auto", 1000, 16, 20, GPU, kernels_fit=True) == "triton"
    assert resolve("auto", 1000, 16, 20, GPU, kernels_fit=False) == "graph"
    dispatch._BROKEN_KERNELS.add(None)  # torch.device("cuda") has no index
    assert resolve("auto", 1000, 16, 20, GPU, kernels_fit=True) == "graph"


@pytest.mark.parametrize(
    ("terms", "hidden", "dtypes", "taken"),
    [
        (1, 20, (F32,), True),
        (3, 64, (F32, F32), True),
        (1, 65, (F32,), False),
        (4, 8, (F32,), False),
        (1, 8, (F32, F64), False),
    ],
)
def test_kernels_take_float32_chains_of_up_to_three_terms_and_h_64(terms, hidden, dtypes, taken) -> None:
    pytest.importorskip("triton")
    assert kernels_take(terms, hidden, *dtypes) is taken


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "magic"}, "unknown scan strategy 'magic'; accepted: auto, sequential, blelloch"),
        ({"chunk": 0}, "chunk must be a positive integer or None, got 0"),
        ({"chunk": 2.5}, "chunk must be a positive integer or None, got 2.5"),
        ({"levels": -1}, "levels must be a non-negative integer or None, got -1"),
        ({"levels": True}, "levels must be a non-negative integer or None, got True"),
    ],
)
def test_bad_options_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScanOptions(**kwargs)


def test_check_device_names_what_runs_here(monkeypatch) -> None:
    check_device("graph", GPU)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "numba_installed", lambda: True)
    with pytest.raises(ValueError, match=r"strategy='graph' needs a CUDA device, and this device is cpu; "
                       r"accepted here: auto, sequential, blelloch, chunked, numba$"):  # fmt: skip
        check_device("graph", CPU)
    with pytest.raises(ValueError, match=r"strategy='numba' needs a CPU device, and this device is cuda; "
                       r"accepted here: auto, sequential, blelloch, chunked, triton, graph$"):  # fmt: skip
        check_device("numba", GPU)
    monkeypatch.setattr(dispatch, "numba_installed", lambda: False)
    missing = r"needs the {0} package \(pip install {0}\), which is not installed; accepted here: "
    with pytest.raises(ValueError, match=r"strategy='numba' " + missing.format("numba") + "auto, sequential, "
                       r"blelloch, chunked$"):  # fmt: skip
        check_device("numba", CPU)
    with monkeypatch.context() as without_triton:
        without_triton.setattr(dispatch, "triton_installed", lambda: False)
        with pytest.raises(ValueError, match=r"strategy='triton' " + missing.format("triton") + "auto, "
                           r"sequential, blelloch, chunked, graph$"):  # fmt: skip
            check_device("triton", GPU)
    if dispatch.triton_installed():
        with pytest.raises(ValueError, match=r"strategy='triton' needs a CUDA device \(or TRITON_INTERPRET"):
            check_device("triton", CPU)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        check_device("triton", CPU)
        with pytest.raises(ValueError, match=r"accepted here: auto, sequential, blelloch, chunked, triton$"):
            check_device("graph", CPU)


def test_graph_needs_a_gpu() -> None:
    m = torch.randn(5, 2, 3, 3, dtype=F64)
    with pytest.raises(ValueError, match="strategy='graph' needs a CUDA device"):
        scan(m, torch.zeros(2, 3, dtype=F64), strategy="graph")


def test_auto_falls_back_to_the_graph_scan_when_kernels_fail(monkeypatch, caplog) -> None:
    """On a GPU the kernels cannot compile for, "auto" logs it, uses the graph scan, and stops trying."""
    triton_errors = pytest.importorskip("triton.runtime.errors")
    chain = FactoredChain(torch.rand(40, 2, 1, 3), torch.randn(1, 3, 3))
    x = torch.randn(2, 3)
    calls = []

    def broken(*args):
        calls.append("triton")
        raise triton_errors.OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(dispatch, "choose", lambda *a: "triton")
    monkeypatch.setattr(dispatch, "check_device", lambda *a: None)
    monkeypatch.setattr(scan_mod, "_triton", broken)
    monkeypatch.setattr(
        scan_mod, "_graphed", lambda chain, x, *a: calls.append("graph") or sequential_scan(chain, x)
    )
    monkeypatch.setattr(dispatch, "_BROKEN_KERNELS", set())
    with caplog.at_level("WARNING", logger="bppsa_core.dispatch"):
        out = scan(chain, x)
    assert calls == ["triton", "graph"]
    assert torch.equal(out, sequential_scan(chain, x))
    assert "Triton scan kernels failed on cpu" in caplog.text and "using the graph scan" in caplog.text
    assert None in dispatch._BROKEN_KERNELS  # the CPU device has no index
    # "auto" chooses them no more on that device (an index-less one here), and still on the others
    assert not dispatch.kernels_usable(torch.device("cuda")) and dispatch.kernels_usable(
        torch.device("cuda", 1)
    )
    with pytest.raises(triton_errors.OutOfResources):  # an explicit "triton" is not second-guessed
        scan(chain, x, strategy="triton")
