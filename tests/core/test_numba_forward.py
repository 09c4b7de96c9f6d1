"""The compiled CPU forward (numba) against its plain-PyTorch twin, PyTorch's fused kernel, and the
modules that take it."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, extended_except, rel_err, torch_threads
from recurrent import pair

pytest.importorskip("numba")

from bppsa_core import dispatch, numba_forward, numba_math
from bppsa_core import nn as bnn
from bppsa_core.layer import MODES, native_forward

F32, F64 = torch.float32, torch.float64
TOL = {F64: 1e-12, F32: 1e-5}
GATES = {"GRU": 3, "LSTM": 4}


def layer_case(mode: str, steps: int, batch: int, inputs: int, hidden: int, dtype, bias: bool = True):
    """Random (x, h0, c0, weights) of one layer, the weights large enough that the states saturate
    in places and the inputs far enough from 0 that every activation's range is used."""
    rows = GATES.get(mode, 1) * hidden
    w = [torch.randn(rows, inputs, dtype=dtype), torch.randn(rows, hidden, dtype=dtype) / math.sqrt(hidden)]
    if bias:
        w += [torch.randn(rows, dtype=dtype), torch.randn(rows, dtype=dtype)]
    x = 2 * torch.randn(steps, batch, inputs, dtype=dtype)
    h0 = torch.randn(batch, hidden, dtype=dtype)
    c0 = torch.randn(batch, hidden, dtype=dtype) if mode == "LSTM" else None
    return x, h0, c0, w


def compiled(mode, x, h0, c0, w, lengths=None, segment=2048):
    out = x.new_empty((*x.shape[:2], h0.shape[-1]))
    return numba_forward.layer_forward(mode, x, h0, c0, w, lengths, segment, out)


# every (mode, dtype) is a build to compile; the float32 LSTM's only here, so it is extended
CELL_BUILDS = [(mode, dtype) for dtype in (F64, F32) for mode in MODES]


@pytest.mark.parametrize("mode, dtype", extended_except(CELL_BUILDS, *CELL_BUILDS[:-1]))
@pytest.mark.parametrize(
    "lengths, segment, bias, inputs",
    [
        (None, 2048, True, 3), (None, 7, False, 3), ([30, 30, 17, 1, 0], 2048, True, 3),
        ([30, 12, 12, 5, 0], 7, True, 3), (None, 7, True, 1),
    ],
)  # fmt: skip
def test_the_compiled_forward_is_pytorchs(mode, dtype, lengths, segment, bias, inputs) -> None:
    """Outputs, last h and last c equal the fused kernel's to the dtype's rounding: one segment or
    several, with and without biases, packed lengths (a sample ending mid-segment, one of length 0)
    whose outputs are 0 past the end and whose state is the last valid one, and one input feature."""
    torch.manual_seed(0)
    x, h0, c0, w = layer_case(mode, 30, 5, inputs, 6, dtype, bias)
    lengths = None if lengths is None else torch.tensor(lengths)
    expected = native_forward(mode, x, h0, c0, w, lengths, segment)
    got = compiled(mode, x, h0, c0, w, lengths, segment)
    for e, g in zip(expected, got, strict=True):
        assert (e is None) == (g is None)
        if e is not None:
            assert g.dtype == dtype and g.shape == e.shape
            assert rel_err(e, g) < TOL[dtype]
    if lengths is not None:
        for b, n in enumerate(lengths.tolist()):
            assert not got[0][n:, b].any()


@pytest.mark.parametrize("mode", MODES)
def test_wide_inputs_are_projected_on_the_host_with_the_same_results(mode, monkeypatch) -> None:
    """Inputs whose weights take more than ``PROJECT_IN_STEP_MAX_BYTES`` are projected by one GEMM a
    segment on the host, the others in the kernels' steps (no GEMM on the host): the fused kernel's
    results either way, over several segments with packed lengths."""
    torch.manual_seed(0)
    x, h0, c0, w = layer_case(mode, 30, 5, 3, 6, F64)
    lengths = torch.tensor([30, 12, 12, 5, 0])
    expected = native_forward(mode, x, h0, c0, w, lengths, 7)
    gemms, addmm = [], torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: gemms.append(a) or addmm(*a, **k))
    weight_bytes = w[0].numel() * w[0].element_size()
    results = {}
    for bound in (weight_bytes, weight_bytes - 1):
        monkeypatch.setattr(numba_forward, "PROJECT_IN_STEP_MAX_BYTES", bound)
        gemms.clear()
        results[bound] = compiled(mode, x, h0, c0, w, lengths, 7)
        assert len(gemms) == (0 if bound == weight_bytes else 5)  # one a segment of 7 steps
    for got in results.values():
        for e, g in zip(expected, got, strict=True):
            assert (e is None and g is None) or rel_err(e, g) < TOL[F64]


def test_a_wide_grus_inference_runs_compiled_where_its_training_is_torch_nns(monkeypatch) -> None:
    """A float32 GRU at H = 192 where "auto" leaves its training to torch.nn (above H = 128 here: no
    layer call), while its inference runs the compiled forward in its layers, with torch.nn's
    outputs."""
    monkeypatch.setitem(dispatch._TORCH_NN_HIDDEN["cpu"], "GRU", ((128, math.inf),))
    ran = _recording(monkeypatch)
    ref, ours = pair("gru", 3, 192, num_layers=2, dtype=F32)
    x = torch.randn(6, 2, 3)
    ours(x)
    assert ran == []
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    assert ran == ["GRU", "GRU"]
    torch.testing.assert_close(out[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.extended  # each mode a parallel build to compile, as every threads test of the kernels
@pytest.mark.parametrize("mode", MODES)
def test_two_threads_give_the_one_thread_result_bit_for_bit(mode) -> None:
    """Samples run in groups, one a thread; each sample's arithmetic is the same in any group."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here (NUMBA_NUM_THREADS)")
    torch.manual_seed(1)
    case = layer_case(mode, 20, 5, 3, 6, F32)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(compiled(mode, *case))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_hidden_product_in_vector_tiles_is_its_plain_loop_bit_for_bit(dtype) -> None:
    """``numba_math.add_hidden`` (rows in tiles of eight, four and one, blocks of columns two
    at a time, and of one row eight at a time; a ragged last block) against
    ``add_hidden_reference``: the same bits for rows of every count, columns narrower than a
    vector, and every count of blocks up to 17 with and
    without a ragged one (so every count left over after the pairs and the eights, and the window
    joining a whole group), so that the threads' groups of samples change nothing; and with w_t's
    rows longer than acc's (``numba_math.padded``), whose columns past acc's are never read."""
    import numba

    @numba.njit(error_model="numpy")
    def tiled(acc, h, w_t):
        numba_math.add_hidden(acc, h, w_t)

    @numba.njit(error_model="numpy")
    def plain(acc, h, w_t):
        numba_math.add_hidden_reference(acc, h, w_t)

    pad = numba.njit(lambda w: numba_math.padded(w))
    rng = np.random.default_rng(0)
    shapes = [
        (16, 20, 80), (16, 80, 20), (5, 7, 9), (3, 3, 3), (1, 1, 8), (7, 4, 17), (6, 33, 64), (9, 5, 24),
        (4, 6, 28), (5, 3, 13), (4, 2, 60),
        *((rows, 3, cols) for rows in (1, 6, 13) for cols in range(8, 17 * numba_math.LANES_MIN + 13)),
    ]  # fmt: skip
    differs = []
    draw = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    for rows, inner, cols in shapes:
        h, w_t, start = draw(rows, inner), draw(inner, cols), draw(rows, cols)
        got, expected = start.copy(), start.copy()
        tiled(got, h, w_t)
        plain(expected, h, w_t)
        np.testing.assert_array_equal(got, expected)
        exact = start.astype(np.float64) + h.astype(np.float64) @ w_t.astype(np.float64)
        np.testing.assert_allclose(got, exact, rtol=0, atol=inner * 8 * np.finfo(dtype).eps)
        unfused = start.copy()  # each product rounded, then each sum: NumPy's elementwise ops
        for k in range(inner):
            unfused += h[:, k : k + 1] * w_t[k]
        differs.append(not np.array_equal(got, unfused))
    assert any(differs) == numba_math.FMA  # fused where the target has FMA, else each op rounded
    for rows, inner, cols in ((16, 20, 1024 // dtype().itemsize), (5, 9, 2048 // dtype().itemsize)):
        h, w_t, start = draw(rows, inner), draw(inner, cols), draw(rows, cols)
        wide = np.full((inner, cols + 3), np.nan, dtype)  # rows longer than acc's: never read past R
        wide[:, :cols] = w_t
        expected, got, got_padded = start.copy(), start.copy(), start.copy()
        plain(expected, h, w_t)
        tiled(got, h, wide)
        tiled(got_padded, h, pad(w_t.T.copy().T))
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(got_padded, expected)


def test_padded_rows_are_the_weights_with_a_cache_line_after_rows_of_a_power_of_two_from_1_kb() -> None:
    import numba

    pad = numba.njit(lambda w: numba_math.padded(w))
    for dtype, cols, width in (
        (np.float32, 256, 272),
        (np.float64, 128, 136),
        (np.float32, 80, 80),
        (np.float32, 768, 768),  # 3 KB: not a power of two
        (np.float64, 64, 64),
    ):
        w = np.arange(3 * cols, dtype=dtype).reshape(cols, 3).T  # F-ordered, as w_hh.T
        got = pad(w)
        assert got.shape == (3, width) and got.flags.c_contiguous
        np.testing.assert_array_equal(got[:, :cols], w)


# x86 targets numba may compile for, by their LLVM features: (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES,
# what numba_math must make of them)
_AVX2 = "+avx,+avx2,+fma,+sse4.2,+popcnt,+f16c,+bmi,+bmi2,+lzcnt,+movbe,+cx16"
_TARGETS = {
    "generic": ("generic", None, "not numba_math.FMA and not numba_math.WIDE"),
    "avx2": ("haswell", _AVX2, "numba_math.FMA and not numba_math.WIDE and numba_math.LANES_MIN == 8"),
}


@pytest.mark.extended  # a fresh interpreter compiles the kernels for another target: seconds
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 targets")
@pytest.mark.parametrize("target", sorted(_TARGETS))
def test_other_targets_keep_the_plain_loops_bits(target) -> None:
    """Where the CPU numba compiles for has no fused multiply-add (numba's "generic" target) the
    products are a multiply and an add; where it has AVX2 but not AVX-512, the vectors are of 256
    bits and the tiles of four rows: either way the tiles, and the LSTM's and GRU's walk rows, still
    give their plain twins' bits."""
    tests = [
        f"{__file__}::test_the_hidden_product_in_vector_tiles_is_its_plain_loop_bit_for_bit",
        f"{Path(__file__).parent / 'test_numba.py'}::test_an_lstm_walks_rows_in_vectors_as_its_scalar_loop",
        f"{Path(__file__).parent / 'test_numba.py'}::test_a_gru_walks_rows_in_vectors_as_its_scalar_loop",
    ]
    name, features, expected = _TARGETS[target]
    from llvmlite import binding

    host = binding.get_host_cpu_features()
    if features and not all(host.get(f.lstrip("+"), False) for f in features.split(",")):
        pytest.skip(f"this CPU cannot run code compiled for {name} ({features})")
    env = {**os.environ, "NUMBA_CPU_NAME": name, "PYTHONPATH": str(ROOT)}
    if features:
        env["NUMBA_CPU_FEATURES"] = features
    check = f"from bppsa_core import numba_math; assert {expected}"
    assert subprocess.run([sys.executable, "-c", check], env=env, timeout=120).returncode == 0
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_activations_are_accurate_to_a_few_ulps(dtype) -> None:
    """tanh, sigmoid and expm1, and ``gate`` as each of tanh and sigmoid, against float64 references
    (math's, or float128's where there is one): at most 4 ulps of the dtype, over the whole range,
    with NaN and infinities as PyTorch's."""
    import numba

    expm1, tanh, sigmoid, gate = numba_math.ACTIVATIONS[dtype]

    @numba.njit(error_model="numpy")
    def apply(f, a, out):
        for i in range(a.size):
            out[i] = f(a[i])

    @numba.njit(error_model="numpy")
    def apply_gate(a, scale, p, q, out):
        for i in range(a.size):
            out[i] = gate(a[i], scale, p, q)

    def gated(constants):
        scale, p, q = (dtype(v) for v in constants)
        return lambda x, out: apply_gate(x, scale, p, q, out)

    runs = {
        "tanh": lambda x, out: apply(tanh, x, out),
        "sigmoid": lambda x, out: apply(sigmoid, x, out),
        "gate as tanh": gated(numba_math.GATE_TANH),
        "gate as sigmoid": gated(numba_math.GATE_SIGMOID),
        "expm1": lambda x, out: apply(expm1, x, out),
    }
    grid = np.concatenate([np.linspace(-50, 50, 20001), np.geomspace(1e-30, 30, 4001)])
    grid = np.concatenate([grid, -grid]).astype(dtype)
    wide = grid.astype(np.longdouble)
    tanh_ref, sigmoid_ref = np.tanh(wide), 1 / (1 + np.exp(-wide))
    references = {
        "tanh": tanh_ref,
        "sigmoid": sigmoid_ref,
        "gate as tanh": tanh_ref,
        "gate as sigmoid": sigmoid_ref,
        "expm1": np.expm1(np.clip(wide, -20, 80)),
    }
    for name, ref in references.items():
        x = np.clip(grid, -20, 80).astype(dtype) if name == "expm1" else grid
        out = np.empty_like(x)
        runs[name](x, out)
        ulp = np.spacing(np.abs(ref.astype(dtype)))
        normal = np.abs(ref) > np.finfo(dtype).tiny
        assert (np.abs(out - ref)[normal] / ulp[normal]).max() <= 4, name
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype)
    like_torch = {
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "gate as tanh": torch.tanh,
        "gate as sigmoid": torch.sigmoid,
    }
    for name, torch_f in like_torch.items():
        out = np.empty_like(special)
        runs[name](special, out)
        np.testing.assert_array_equal(out, torch_f(torch.from_numpy(special)).numpy())


def test_a_nan_input_reaches_the_outputs_from_its_step_on() -> None:
    torch.manual_seed(2)
    x, h0, c0, w = layer_case("GRU", 10, 2, 3, 4, F32)
    x[4, 0, 1] = float("nan")
    out, h, _ = compiled("GRU", x, h0, c0, w)
    assert not out[:4].isnan().any() and out[4:, 0].isnan().all() and not out[:, 1].isnan().any()
    assert h[0].isnan().all()


def _recording(monkeypatch) -> list[str]:
    """The modes whose layers run the compiled forward from now on."""
    ran: list[str] = []
    real = numba_forward.layer_forward
    monkeypatch.setattr(numba_forward, "layer_forward", lambda mode, *a: ran.append(mode) or real(mode, *a))
    return ran


@pytest.mark.parametrize(
    "kind, strategy, hidden, takes",
    [
        ("tanh", "auto", 8, True),
        ("relu", "auto", 8, True),
        ("gru", "auto", 8, True),
        ("tanh", "auto", 1025, False),  # wider than it was measured to win at: PyTorch's GEMMs
        ("lstm", "auto", 8, True),  # a gradient is wanted: the taped forward (layer.Tape)
        ("lstm", "auto", 392, False),  # wider than the taped forward wins at (128; 384 with AVX-512)
        ("lstm", "numba", 8, True),
        ("tanh", "sequential", 8, False),  # the plain-PyTorch strategies keep PyTorch's forward
    ],
)
def test_the_modules_take_it_where_auto_says_and_keep_autograds_gradients(
    kind, strategy, hidden, takes, monkeypatch
) -> None:
    ref, ours = pair(kind, 3, hidden, num_layers=2, bidirectional=True, strategy=strategy)
    ran = _recording(monkeypatch)
    x = torch.randn(9, 4, 3, dtype=F64, requires_grad=True)
    out, _ = ours(x)
    assert bool(ran) == takes and len(ran) in (0, 4)
    expected, _ = ref(x)
    assert rel_err(expected, out) < 1e-12
    (g,) = torch.autograd.grad(out.square().sum(), x)
    (e,) = torch.autograd.grad(expected.square().sum(), x)
    assert rel_err(e, g) < 1e-10


def test_a_forward_autograd_records_or_autocast_runs_is_pytorchs(monkeypatch) -> None:
    """BPTT (autograd records the forward) and CPU autocast (bfloat16 GEMMs) keep PyTorch's kernel;
    so does an LSTM's inference under "auto" on one thread from H = 32 (where PyTorch's LSTM kernel
    is the faster untaped); below, the compiled loop runs it."""
    ran = _recording(monkeypatch)
    x = torch.randn(5, 2, 3)
    bnn.RNN(3, 4, backward="bptt")(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bnn.RNN(3, 4)(x)
    with torch.no_grad():
        bnn.LSTM(3, 32)(x)
    assert ran == []
    with torch.no_grad():
        bnn.LSTM(3, 31)(x)
    assert ran == ["LSTM"]
    assert dispatch.compiled_forward("auto", "RNN_TANH", 4, x) and not dispatch.compiled_forward(
        "auto", "RNN_TANH", 4, x.requires_grad_()
    )


@pytest.mark.extended  # a strided build of the kernels to compile
@pytest.mark.parametrize("mode", ["RNN_TANH", "LSTM"])
def test_batch_major_outputs_are_the_time_major_ones(mode) -> None:
    """``sequential_forward(batch_major=True)`` (a sequence-parallel rank's forward on a CPU):
    a (T, B, H) view of (B, T, H) memory, written in place by the compiled loop, bit for bit."""
    from bppsa_core.layer import sequential_forward

    torch.manual_seed(4)
    x, h0, c0, w = layer_case(mode, 12, 3, 2, 5, F32)
    expected = sequential_forward("numba", mode, x, h0, c0, w, None, 5)
    got = sequential_forward("numba", mode, x, h0, c0, w, None, 5, batch_major=True)
    assert got[0].transpose(0, 1).is_contiguous()
    for e, g in zip(expected, got, strict=True):
        assert (e is None and g is None) or torch.equal(e, g)


def test_auto_takes_the_compiled_rnn_forward_up_to_h_1024_and_the_grus_up_to_512() -> None:
    """The widths where the compiled forward beats PyTorch's fused kernel
    (``dispatch._COMPILED_FORWARD_MAX_HIDDEN``); strategy "numba" takes every width."""
    takes = dispatch.compiled_forward_takes
    for mode, widest in (("RNN_TANH", 1024), ("RNN_RELU", 1024), ("GRU", 512)):
        assert [takes("auto", mode, h, "cpu", (F32,), False) for h in (20, widest, widest + 1)] == [
            True, True, False,
        ]  # fmt: skip
        assert takes("numba", mode, widest + 1, "cpu", (F32,), False)


def test_auto_takes_the_compiled_lstm_forward_below_h_32_and_on_more_threads_up_to_112() -> None:
    """Below H = 32 the compiled loop beats PyTorch's fused LSTM on one thread
    (``dispatch._COMPILED_FORWARD_MAX_HIDDEN``); on more it shares its samples among them and wins
    up to H = 112 (``dispatch._PARALLEL_LSTM_MAX_HIDDEN``). The taped forward (kept for a backward)
    and strategy "numba" do not depend on the threads."""
    takes = dispatch.compiled_forward_takes
    widths = (1, 20, 31, 32, 64, 112, 113)
    for threads, widest in ((1, 31), (2, 112)):
        with torch_threads(threads):
            assert [takes("auto", "LSTM", h, "cpu", (F32,), False) for h in widths] == [
                h <= widest for h in widths
            ]
            assert takes("auto", "LSTM", 128, "cpu", (F32,), True)  # taped
            assert takes("numba", "LSTM", 256, "cpu", (F32,), False)
            assert not takes("sequential", "LSTM", 20, "cpu", (F32,), False)


@pytest.mark.extended  # the LSTM's parallel build to compile
def test_an_lstm_in_inference_on_two_threads_runs_compiled_and_gives_torch_nns_outputs(monkeypatch) -> None:
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here (NUMBA_NUM_THREADS)")
    calls = []
    real = numba_forward.layer_forward
    monkeypatch.setattr(numba_forward, "layer_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, ours = pair("lstm", 3, 20, num_layers=2, dtype=F32)
    x = torch.randn(30, 5, 3)
    with torch_threads(2), torch.no_grad():
        out, expected = ours(x), ref(x)
    assert len(calls) == 2  # both layers compiled, not torch.nn's forward
    torch.testing.assert_close(out[0], expected[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(out[1], expected[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
