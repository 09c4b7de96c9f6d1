"""The compiled CPU kernels (numba) against their plain-PyTorch twin, and the modules that run them."""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import ROOT, extended_except, rel_err, torch_threads
from kernel_cases import CHAIN_ARGS, CHAIN_CASES, chain_case
from recurrent import assert_same, pair
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

pytest.importorskip("numba")

from bppsa_core import dispatch, jacobians, numba_math, numba_scan
from bppsa_core import layer as layer_mod
from bppsa_core import nn as bnn
from bppsa_core.chain import DenseChain, FactoredChain, LSTMChain
from bppsa_core.jacobians import LayerWeights, RNNCell
from bppsa_core.scan import chunked_scan, scan

F32, F64 = torch.float32, torch.float64
TOL = {F64: 1e-12, F32: 1e-5}


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize(CHAIN_ARGS, [*CHAIN_CASES, (1, 2, 3, 1, True, 3), (40, 3, 4, None, True, 1)])
def test_kernels_match_the_chunked_twin(n, batch, hidden, chunk, affine, terms, dtype) -> None:
    chain, x, b = chain_case(n, batch, hidden, affine, terms, dtype)
    twin = chunked_scan(chain, x, b, chunk=chunk)
    out = scan(chain, x, b, strategy="numba", chunk=chunk)
    assert out.shape == (n + 1, batch, hidden) and out.dtype == dtype
    assert rel_err(twin, out) < TOL[dtype]


def _at_one_and_two_threads(monkeypatch, builds: tuple[str, str], run) -> list:
    """``run()``'s results at one thread and at two, checking that the serial and then the parallel
    build of ``builds`` ran."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here (NUMBA_NUM_THREADS)")
    ran = []
    for build in builds:
        kernel = getattr(numba_scan, build)
        monkeypatch.setattr(numba_scan, build, lambda *a, k=kernel, n=build: ran.append(n) or k(*a))
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            results.append(run())
    assert ran == list(builds)
    return results


@pytest.mark.parametrize("dtype", [F32, F64])
def test_a_gru_walks_rows_in_vectors_as_its_scalar_loop(dtype) -> None:
    """The fused GRU backward's gate gradients in vectors (``numba_scan._gru_row``) against the same
    kernel built with its scalar loop at every H: the same bits, for H a multiple of the vector,
    ragged (its window half a vector or whole) and below a vector, with the outputs' gradients
    injected and without (an unused placeholder then), and walked in blocks of steps from the end;
    one sample ends early (packed sequences)."""
    scalar = numba_math.build(numba_scan._gru_layer, False, scalar_rows=True)
    one, tiny = numba_scan._SCALARS[dtype]
    for steps, batch, hidden in [(7, 3, 16), (6, 5, 9), (5, 2, 20), (4, 3, 40), (4, 2, 35), (3, 2, 29)]:
        gates = torch.rand(steps, batch, 4 * hidden, dtype=dtype)
        h = torch.randn(steps + 1, batch, hidden, dtype=dtype)
        w_hh, u = torch.randn(3 * hidden, hidden, dtype=dtype), torch.randn(steps, batch, hidden, dtype=dtype)
        g_h = torch.randn(batch, hidden, dtype=dtype)
        ends = torch.full((batch,), steps)
        ends[-1] = 2
        for has_u in (True, False):
            outside = u if has_u else torch.from_numpy(numba_math.UNUSED[dtype])
            results = []
            for kernel in (numba_scan._gru_layer_serial, scalar):
                g, d_in, d_hid = (
                    g_h.clone(),
                    *(torch.empty(steps, batch, 3 * hidden, dtype=dtype) for _ in "ih"),
                )
                arrays = [t.numpy() for t in (gates, h, w_hh, outside, ends, g, g, d_in, d_hid)]
                kernel(has_u, one, tiny, 1, 0, steps, *arrays)
                results.append(torch.cat((g.flatten(), d_in.flatten(), d_hid.flatten())))
            g, blocks = g_h.clone(), []
            for first, last in ((3, steps), (1, 3), (0, 1)):
                blocks.insert(0, [torch.empty(last - first, batch, 3 * hidden, dtype=dtype) for _ in "ih"])
                arrays = [t.numpy() for t in (gates, h, w_hh, outside, ends, g, g, *blocks[0])]
                numba_scan._gru_layer_serial(has_u, one, tiny, 1, first, last, *arrays)
            sides = [torch.cat([b[n] for b in blocks]).flatten() for n in (0, 1)]
            results.append(torch.cat((g.flatten(), *sides)))
            assert all(torch.equal(results[0], r) for r in results[1:]), (hidden, has_u)


@pytest.mark.extended  # the parallel scan's build to compile, a dozen seconds
def test_threads_change_nothing(monkeypatch) -> None:
    """Every task of a phase is independent, so 2 threads give the 1-thread result bit for bit, with
    all three phases running (chunk 3 of 37 elements: reduce, spine and expand), and the walk's
    products of a group of 6 samples (a tile of four and two rows) as of two groups of 3 (rows)."""
    chain, x, b = chain_case(37, 6, 9, True, 3, F32)
    run = lambda: scan(chain, x, b, strategy="numba", chunk=3)  # noqa: E731
    one, two = _at_one_and_two_threads(monkeypatch, ("_scan_serial", "_scan_parallel"), run)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_an_lstm_walks_rows_in_vectors_as_its_scalar_loop(dtype) -> None:
    """The fused LSTM backward's gate gradients in vectors (``numba_scan._lstm_row``) against the
    same kernel built with its scalar loop at every H: the same bits, for H a multiple of the
    vector (8 or 16 lanes), ragged (its window half a vector or whole), and wider than two
    vectors, with an output gate of 0 and flushed dc; each written over its gates as the untaped
    backward does; and walked in blocks of steps from the end, as the taped backward is; one
    sample ends early (packed sequences)."""
    scalar = numba_math.build(numba_scan._lstm_layer, False, scalar_rows=True)
    for steps, batch, hidden in [(7, 3, 16), (6, 5, 9), (5, 2, 20), (4, 3, 40), (4, 2, 35), (3, 2, 29)]:
        gates = torch.rand(steps, batch, 4, hidden, dtype=dtype)
        gates[2, 1, 3, 4] = 0  # o = 0: tanh(c) taken as 0
        h, c = (
            torch.rand(steps, batch, hidden, dtype=dtype),
            torch.randn(steps + 1, batch, hidden, dtype=dtype),
        )
        w_hh, u = torch.randn(4 * hidden, hidden, dtype=dtype), torch.randn(steps, batch, hidden, dtype=dtype)
        g_h, g_c = torch.randn(batch, hidden, dtype=dtype), torch.randn(batch, hidden, dtype=dtype) * 1e-38
        one, tiny = numba_scan._SCALARS[dtype]
        ends = torch.full((batch,), steps)
        ends[-1] = 2
        results = []
        for kernel, in_place in itertools.product((numba_scan._lstm_layer_serial, scalar), (False, True)):
            read = gates.clone().view(steps, batch, -1)  # in place: the gradients written over it
            g = torch.stack((g_h, g_c))  # in, and out in place
            delta = read if in_place else torch.empty(steps, batch, 4 * hidden, dtype=dtype)
            arrays = [t.numpy() for t in (read, h, c, w_hh, u, ends, g, g, delta)]
            kernel(True, True, one, tiny, 1, 0, steps, *arrays)
            results.append(torch.cat((g.flatten(), delta.flatten())))
        # block by block from the end, each block's deltas in a buffer of its own
        g, blocks = torch.stack((g_h, g_c)), []
        for first, last in ((3, steps), (1, 3), (0, 1)):
            blocks.insert(0, torch.empty(last - first, batch, 4 * hidden, dtype=dtype))
            arrays = [t.numpy() for t in (gates.view(steps, batch, -1), h, c, w_hh, u, ends, g, g, blocks[0])]
            numba_scan._lstm_layer_serial(True, True, one, tiny, 1, first, last, *arrays)
        results.append(torch.cat((g.flatten(), torch.cat(blocks).flatten())))
        assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.extended  # a serial float64 build of its own to compile
def test_threads_change_nothing_in_an_lstm_layer(monkeypatch) -> None:
    """The fused LSTM backward's samples are independent tasks: its serial and parallel builds agree
    bit for bit."""
    gates, h = torch.rand(9, 3, 4, 5, dtype=F64), torch.rand(9, 3, 5, dtype=F64)
    c0, g_h, g_c = (torch.randn(3, 5, dtype=F64) for _ in range(3))
    w_hh, u = torch.randn(20, 5, dtype=F64), torch.randn(9, 3, 5, dtype=F64)
    builds = ("_lstm_layer_serial", "_lstm_layer_parallel")
    results = _at_one_and_two_threads(
        monkeypatch, builds, lambda: numba_scan.lstm_layer_backward(gates.clone(), h, c0, w_hh, g_h, g_c, u)
    )
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("kind", ["RNN", "GRU"])
@pytest.mark.parametrize(
    ("strategy", "chunk", "block", "walked"),
    [("numba", None, None, True), ("auto", None, 4, True), ("numba", 5, None, False)],
)
def test_a_net_on_the_cpu_runs_the_kernels_and_gives_autograds_gradients(
    monkeypatch, kind, strategy, chunk, block, walked
) -> None:
    """float64, two layers, loss on every output and on h_n: exact to 1e-10. One chunk (the default
    here, "auto" too): each layer walked block by block (blocks of 4 steps: the walk carries the
    gradient across them, its blocks' scratch reused), an RNN's from its outputs in one kernel
    (``numba_scan.RNNWalk``); chunk 5: the stored chain's chunked scan in the kernels. A GRU's
    forward keeps no tape here (as a Newton solver's or PyTorch's forward), so its backward makes its
    factors and scans them: the tape's walk is ``test_a_gru_or_an_lstm_walks_its_tape...``."""
    torch.manual_seed(0)
    monkeypatch.setattr(layer_mod, "new_tape", lambda *a: None)
    kwargs = {"nonlinearity": "relu"} if kind == "RNN" else {}
    ref = getattr(torch.nn, kind)(2, 6, num_layers=2, batch_first=True, **kwargs).double()
    ours = getattr(bnn, kind)(2, 6, num_layers=2, batch_first=True, strategy=strategy, chunk=chunk, **kwargs)
    ours.double().load_state_dict(ref.state_dict())
    walks, scans = [], []
    real_walked, real_scan, real_rnn = layer_mod._walked, numba_scan.chunked_scan, numba_scan.RNNWalk
    monkeypatch.setattr(layer_mod, "_walked", lambda *a: walks.append(1) or real_walked(*a))
    monkeypatch.setattr(numba_scan, "RNNWalk", lambda *a, **k: walks.append(1) or real_rnn(*a, **k))
    # each scan's output held, so that a freed buffer's address cannot come back as a new one
    monkeypatch.setattr(
        numba_scan, "chunked_scan", lambda *a, **k: scans.append(k.get("out")) or real_scan(*a, **k)
    )
    if block:
        monkeypatch.setattr(jacobians, "_block_steps", lambda *a: block)
        monkeypatch.setattr(jacobians, "SCRATCH_MIN_BYTES", 0)  # these tiny blocks' scratch named too
    x = torch.randn(3, 23, 2, dtype=F64, requires_grad=True)
    assert_same(ref, ours, x, None, [x])
    assert len(walks) == (ours.num_layers if walked else 0)
    if walked and kind == "RNN":  # no factors, no chain: the walk reads the outputs
        assert not scans
        return
    assert len(scans) == ours.num_layers * (-(-23 // block) if block else 1)
    if walked and block:  # a walk's blocks share its scratch: the short last block's, then one grown
        assert len({s.untyped_storage().data_ptr() for s in scans}) <= 2 * ours.num_layers


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.parametrize("block", [None, 4])
def test_a_gru_or_an_lstm_walks_its_tape_block_by_block_and_gives_autograds_gradients(
    monkeypatch, kind, block
) -> None:
    """The taped backward walks the kept gates in blocks of steps from the end as ``layer_grads``
    takes them (4 here: the walk carries dL/dh (an LSTM's and dL/dc) across them, the blocks' deltas
    in buffers reused); float64, two layers, loss on every output and the last states: exact to
    1e-10."""
    torch.manual_seed(0)
    ref = getattr(torch.nn, kind)(2, 6, num_layers=2, batch_first=True).double()
    ours = getattr(bnn, kind)(2, 6, num_layers=2, batch_first=True, strategy="numba").double()
    ours.load_state_dict(ref.state_dict())
    walk = getattr(numba_scan, f"{kind}Walk")
    buffers, real = [], walk.__call__
    monkeypatch.setattr(walk, "__call__", lambda w, *a: buffers.append(a[-1]) or real(w, *a))
    if block:
        monkeypatch.setattr(jacobians, "_block_steps", lambda *a: block)
        monkeypatch.setattr(jacobians, "SCRATCH_MIN_BYTES", 0)  # these tiny blocks' scratch named too
    x = torch.randn(3, 23, 2, dtype=F64, requires_grad=True)
    assert_same(ref, ours, x, None, [x])
    assert len(buffers) == ours.num_layers * (-(-23 // block) if block else 1)
    if block:  # the short last block's buffer, then one grown: per layer
        assert len({d.untyped_storage().data_ptr() for d in buffers}) <= 2 * ours.num_layers


def test_a_walk_takes_its_blocks_from_the_end() -> None:
    cell, steps = RNNCell("tanh"), 6
    w = LayerWeights(torch.randn(4, 2), torch.randn(4, 4), None, None)
    h = torch.rand(steps, 1, 4)
    h_prev = jacobians.PreviousStates(torch.rand(1, 4), h)
    deltas, first = layer_mod._walked(
        cell, torch.randn(steps, 1, 2), h_prev, w, None, torch.randn(1, 4), None
    )
    with pytest.raises(RuntimeError, match="g_0 is known once every block has been walked"):
        first()
    deltas(slice(3, 6))
    with pytest.raises(RuntimeError, match=r"steps 0\.\.2 asked for; a walk from the end needs \.\.3"):
        deltas(slice(0, 2))
    deltas(slice(0, 3))
    assert first().shape == (1, 4)
    # g_0 holds its own 4 numbers, not the first block's walk: a result kept (a group's, in
    # bppsa_core.distributed) would otherwise keep a block of every sample's gradients alive
    assert first().untyped_storage().nbytes() == 4 * first().element_size()


def _walks_as_its_copy(config, weights, views, grad_hn, tol: float) -> None:
    """A group's layer backward from ``views`` (x, h0, its outputs and their gradients, viewed out of
    the batch) gives its contiguous copy's gradients within ``tol``, with the outputs' gradients and
    without."""
    copies = [t.contiguous() for t in views]
    for every in (None, True):
        got = [
            layer_mod.bppsa_backward(
                config, a, b, None, weights, None, c, d if every else None, grad_hn, None
            )
            for a, b, c, d in (views, copies)
        ]
        for g, e in zip(got[0][:2] + tuple(got[0][3]), got[1][:2] + tuple(got[1][3]), strict=True):
            torch.testing.assert_close(g, e, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["RNN_TANH", "GRU"])
def test_a_group_of_samples_viewed_out_of_the_batch_walks_as_its_copy(mode, monkeypatch) -> None:
    """A sequence-parallel rank walks its sample groups as strided views (each block copied side by
    side as the walk goes, an RNN's outputs and their gradients for its walk too, the inputs'
    products made from a contiguous copy): the gradients of the group copied whole first, bit for
    bit, in blocks small enough that there are several."""
    monkeypatch.setitem(jacobians.BLOCK_BYTES, "cpu", 4096)
    torch.manual_seed(0)
    module = (torch.nn.GRU if mode == "GRU" else torch.nn.RNN)(3, 4, dtype=F64)
    weights = [p.detach() for p in module._flat_weights]
    x, h0 = torch.randn(50, 6, 3, dtype=F64), torch.randn(6, 4, dtype=F64)
    with torch.no_grad():
        out, _ = module(x, h0.unsqueeze(0))
    grad_out, grad_hn = torch.randn_like(out), torch.randn(6, 4, dtype=F64)
    # one chunk: the layer walked block by block (the path a one-thread rank takes)
    config = layer_mod.LayerConfig(mode, options=dispatch.ScanOptions(strategy="numba", chunk=50))
    copied, walked = [], []
    real, real_block = jacobians.PreviousStates._side_by_side, numba_scan.RNNWalk._h_block
    monkeypatch.setattr(
        jacobians.PreviousStates,
        "_side_by_side",
        lambda self, lo, hi: copied.append(lo) or real(self, lo, hi),
    )
    monkeypatch.setattr(
        numba_scan.RNNWalk, "_h_block", lambda self, lo, hi: walked.append(lo) or real_block(self, lo, hi)
    )
    s = slice(2, 5)
    views = (x[:, s], h0[s], out[:, s], grad_out[:, s])
    _walks_as_its_copy(config, weights, views, grad_hn[s], tol=0)
    assert len(set(copied)) > 2 and 0 in copied  # several blocks, each copied, the views' only
    assert len(set(walked)) > 2 if mode == "RNN_TANH" else not walked


@pytest.mark.parametrize("mode", ["RNN_TANH", "RNN_RELU", "GRU"])
def test_a_group_of_samples_in_batch_major_memory_is_walked_where_it_lies(mode, monkeypatch) -> None:
    """A CPU rank of several keeps its outputs batch-major (``bppsa_core.distributed``): a group of
    its samples is walked with no block of them copied (an RNN's by the kernel's batch-major build),
    an RNN's weight products made sample by sample, and gives the gradients of its contiguous copy,
    in blocks small enough that there are several."""
    monkeypatch.setitem(jacobians.BLOCK_BYTES, "cpu", 16384)
    torch.manual_seed(0)
    features, hidden = 16, 16  # as wide as products read sample by sample (jacobians._SAMPLE_WISE)
    module = (
        torch.nn.GRU(features, hidden, dtype=F64)
        if mode == "GRU"
        else torch.nn.RNN(features, hidden, nonlinearity=mode[4:].lower(), dtype=F64)
    )
    weights = [p.detach() for p in module._flat_weights]
    x, h0 = torch.randn(6, 50, features, dtype=F64).transpose(0, 1), torch.randn(6, hidden, dtype=F64)
    with torch.no_grad():
        out = module(x, h0.unsqueeze(0))[0].transpose(0, 1).contiguous().transpose(0, 1)  # batch-major
    grad_out, grad_hn = torch.randn_like(out), torch.randn(6, hidden, dtype=F64)
    config = layer_mod.LayerConfig(mode, options=dispatch.ScanOptions(strategy="numba", chunk=50))
    copied, majors, sample_wise = [], [], []
    real_copy, real_major = jacobians.PreviousStates._side_by_side, numba_scan._rnn_layer_major_serial
    monkeypatch.setattr(
        jacobians.PreviousStates,
        "_side_by_side",
        lambda self, lo, hi: copied.append(lo) or real_copy(self, lo, hi),
    )
    monkeypatch.setattr(
        numba_scan, "_rnn_layer_major_serial", lambda *a: majors.append(a[5]) or real_major(*a)
    )
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: sample_wise.append(1) or real_bmm(*a))
    s = slice(2, 5)
    views = (x[:, s], h0[s], out[:, s], grad_out[:, s])
    assert jacobians.batch_major(views[0]) and jacobians.batch_major(views[2])
    _walks_as_its_copy(config, weights, views, grad_hn[s], tol=1e-12)
    assert not copied
    assert len(set(majors)) > 2 if mode != "GRU" else not majors  # several blocks, each read in place
    assert bool(sample_wise) == (mode != "GRU")  # a GRU's 3H rows take the column-major GEMM (_NARROW)


@pytest.mark.parametrize("kind", ["RNN", "GRU"])
def test_packed_sequences_walk_in_the_kernels(monkeypatch, kind) -> None:
    """Variable lengths take the compiled walk block by block (an RNN's ``numba_scan.RNNWalk``, a
    GRU's ``layer._walked``, blocks of 3 steps here), the identity past each end, and give autograd's
    gradients (float64, 1e-10); a GRU's forward keeping no tape (its taped packed backward:
    ``test_an_lstm_or_a_gru_backward_from...``)."""
    torch.manual_seed(1)
    monkeypatch.setattr(layer_mod, "new_tape", lambda *a: None)
    ref = getattr(torch.nn, kind)(3, 5).double()
    ours = getattr(bnn, kind)(3, 5, strategy="numba").double()
    ours.load_state_dict(ref.state_dict())
    walks, real_walked, real_rnn = [], layer_mod._walked, numba_scan.RNNWalk
    # whether the walk knows the ends: the GRU's from ``keep``, the RNN's from the lengths
    monkeypatch.setattr(layer_mod, "_walked", lambda *a: walks.append(a[-1] is not None) or real_walked(*a))
    monkeypatch.setattr(
        numba_scan, "RNNWalk", lambda *a, **k: walks.append(a[4] is not None) or real_rnn(*a, **k)
    )
    monkeypatch.setattr(jacobians, "_block_steps", lambda *a: 3)
    seqs = [torch.randn(t, 3, dtype=F64) for t in (10, 4, 4, 1)]
    grads = []
    for m in (ref, ours):
        xs = [s.clone().requires_grad_() for s in seqs]
        out, h_n = m(torch.nn.utils.rnn.pack_sequence(xs))
        (out.data.cos().sum() + h_n.sum()).backward()
        grads.append([*(x.grad for x in xs), *(p.grad for p in m.parameters())])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-10
    assert walks == [True]


@pytest.mark.parametrize(
    "chain",
    [
        DenseChain(torch.randn(4, 2, 3, 3)),
        FactoredChain(torch.rand(4, 2, 1, 3), torch.randn(1, 3, 3), transposed=True),
        FactoredChain(torch.rand(4, 2, 4, 3), torch.randn(4, 3, 3)),
        LSTMChain(
            *(torch.rand(4, 2, 4, 3) for _ in range(2)),
            torch.randn(4, 3, 3),
            *(torch.rand(4, 2, 3) for _ in range(2)),
            transposed=True,
        ),
    ],
    ids=["dense", "transposed", "four terms", "transposed lstm"],
)
def test_chains_the_kernels_do_not_take_are_refused(chain) -> None:
    with pytest.raises(ValueError, match=r"^strategy='numba' takes a factored chain of at most 3 terms"):
        scan(chain, torch.zeros(2, chain.hidden, dtype=chain.tensors()[0].dtype), strategy="numba")


def _lstm_chain(n: int, batch: int, hidden: int, dtype: torch.dtype, past_end: bool) -> LSTMChain:
    g = torch.Generator().manual_seed(n)
    scales = [torch.rand(n, batch, 4, hidden, generator=g, dtype=dtype) * 0.5 for _ in range(2)]
    diags = [torch.rand(n, batch, hidden, generator=g, dtype=dtype) for _ in range(3 if past_end else 2)]
    return LSTMChain(*scales, torch.randn(4, hidden, hidden, generator=g, dtype=dtype) * 0.3, *diags)


@pytest.mark.parametrize("dtype", extended_except([F64, F32], first=1))  # a build per dtype to compile
@pytest.mark.parametrize(("past_end", "offsets"), [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize(("batch", "hidden"), [(3, 5), (6, 20)], ids=["plain rows", "tiles"])
def test_an_lstm_chain_walked_in_the_kernels_matches_the_sequential_twin(
    dtype, past_end, offsets, batch, hidden
) -> None:
    """The LSTM's chain over (h, c), with h's identity past a sequence's end (diag_hh) and offsets;
    rows narrower than a vector, and six samples wide enough for the products' tiles (one of four
    samples, then two single rows)."""
    chain = _lstm_chain(23, batch, hidden, dtype, past_end)
    x = torch.randn(batch, 2 * hidden, dtype=dtype)
    b = torch.randn(23, batch, 2 * hidden, dtype=dtype) if offsets else None
    out = scan(chain, x, b, strategy="numba")
    assert out.shape == (24, batch, 2 * hidden) and out.dtype == dtype
    assert rel_err(scan(chain, x, b, strategy="sequential"), out) < TOL[dtype]


@pytest.mark.extended  # the parallel build to compile
def test_threads_change_nothing_in_an_lstm_chain(monkeypatch) -> None:
    """The LSTM chain's groups of samples are independent tasks whose products keep each element's
    order: one group of 6 samples (a tile of four and two rows) on one thread gives two groups of 3
    on two, bit for bit."""
    chain, x, b = _lstm_chain(17, 6, 20, F32, True), torch.randn(6, 40), torch.randn(17, 6, 40)
    run = lambda: scan(chain, x, b, strategy="numba")  # noqa: E731
    one, two = _at_one_and_two_threads(monkeypatch, ("_lstm_scan_serial", "_lstm_scan_parallel"), run)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", extended_except([F64, F32], first=1))  # a build per dtype to compile
@pytest.mark.parametrize("outputs", [False, True])
def test_the_fused_lstm_layer_backward_matches_the_generic_path(dtype, outputs) -> None:
    """``numba_scan.lstm_layer_backward`` (cell states, factors and walk in two compiled calls)
    against its plain-PyTorch twin: ``LSTMCell.factors``, the ``LSTMChain`` scanned sequentially and
    ``preactivation_grads``."""
    torch.manual_seed(3)
    steps, batch, hidden, features = 17, 3, 5, 2
    cell = jacobians.LSTMCell()
    shapes = ((20, features), (20, hidden), (20,), (20,))
    w = LayerWeights(*(torch.randn(s, dtype=dtype) * 0.4 for s in shapes))
    x = torch.randn(steps, batch, features, dtype=dtype)
    h0, c0 = torch.randn(batch, hidden, dtype=dtype), torch.randn(batch, hidden, dtype=dtype)
    out = layer_mod.native_forward("LSTM", x, h0, c0, [w.w_ih, w.w_hh, w.b_ih, w.b_hh], None)[0]
    h_prev = torch.cat((h0.unsqueeze(0), out[:-1]))
    g_h, g_c = torch.randn(batch, hidden, dtype=dtype), torch.randn(batch, hidden, dtype=dtype)
    u = torch.randn(steps, batch, hidden, dtype=dtype) if outputs else None

    factors = cell.factors(x, h_prev, out, w, c0)
    offsets = None if u is None else torch.cat((torch.zeros_like(u[:1]), u[:-1]))
    offsets = None if offsets is None else torch.cat((offsets, torch.zeros_like(offsets)), -1)
    g = scan(cell.chain(factors, w), torch.cat((g_h, g_c), -1), offsets, strategy="sequential")
    twin, _ = cell.preactivation_grads(g[1:], factors)

    delta, g0 = numba_scan.lstm_layer_backward(cell.activations(x, h_prev, w), out, c0, w.w_hh, g_h, g_c, u)
    assert delta.shape == (steps, batch, 20) and g0.shape == (batch, 2 * hidden)
    assert rel_err(twin, delta) < TOL[dtype]
    assert rel_err(g[0], g0) < TOL[dtype]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 2, "bidirectional": True},
        {"num_layers": 2, "dropout": 0.0, "batch_first": True},
    ],
    ids=["bidirectional", "two layers"],
)
@pytest.mark.parametrize("strategy", ["numba", "auto"])
def test_an_lstm_on_the_cpu_takes_the_fused_kernels_and_gives_autograds_gradients(
    monkeypatch, strategy, kwargs
) -> None:
    """float64, loss on every output, on h_n and on c_n: exact to 1e-10, through the fused layer
    backward for every layer and direction, packed input too (with its lengths: the identity past
    each end), and never the stored chain's scan."""
    torch.manual_seed(0)
    ref = torch.nn.LSTM(3, 4, **kwargs).double()
    ours = bnn.LSTM(3, 4, strategy=strategy, **kwargs).double()
    ours.load_state_dict(ref.state_dict())
    fused, walks = [], []
    real_fused, real_walk = numba_scan.LSTMWalk, numba_scan.lstm_scan
    monkeypatch.setattr(
        numba_scan, "LSTMWalk", lambda *a, **k: fused.append(a[5] is not None) or real_fused(*a, **k)
    )
    monkeypatch.setattr(numba_scan, "lstm_scan", lambda *a: walks.append(1) or real_walk(*a))
    shape = (2, 6, 3) if kwargs.get("batch_first") else (6, 2, 3)
    seqs = [torch.randn(t, 3, dtype=F64) for t in (7, 5, 2)]
    grads = []
    for m in (ref, ours):
        x = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out, (h_n, c_n) = m(x)
        (out.sin().sum() + h_n.pow(2).sum() + c_n.cos().sum()).backward()
        packed_out, (ph, pc) = m(torch.nn.utils.rnn.pack_sequence(seqs))
        (packed_out.data.sum() + ph.sum() + pc.sum()).backward()
        grads.append([x.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-10
    calls = kwargs["num_layers"] * (2 if kwargs.get("bidirectional") else 1)
    assert fused == [False] * calls + [True] * calls and walks == []


@pytest.mark.parametrize(("kind", "sums"), [("RNN", 1), ("GRU", 2), ("LSTM", 1)])
def test_a_layer_backward_sums_a_shared_pre_activation_once(monkeypatch, kind, sums) -> None:
    """An RNN's or an LSTM's two biases take the same pre-activation gradient: it is summed once over
    the steps and copied (a GRU's hidden side has its own), and the two gradients share no memory."""
    m = getattr(bnn, kind)(3, 5, strategy="numba").double()
    out, _ = m(torch.randn(7, 2, 3, dtype=F64))
    loss, summed, real = out.sum(), [], torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: summed.append(t.shape) or real(t, *a, **k))
    loss.backward()
    assert len(summed) == sums, summed
    if kind != "GRU":
        assert torch.equal(m.bias_ih_l0.grad, m.bias_hh_l0.grad)
        assert m.bias_ih_l0.grad.data_ptr() != m.bias_hh_l0.grad.data_ptr()


# float32: two builds of the compiled forward to compile, for the extended run
@pytest.mark.parametrize("dtype", [F64, pytest.param(torch.float32, marks=pytest.mark.extended)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_a_backward_from_its_forwards_tape_is_the_one_that_recomputes_it(
    monkeypatch, kind, dtype, packed
) -> None:
    """A GRU's or an LSTM's compiled forward keeps its gates and states (``layer.Tape``; an LSTM's
    cell states too) where a gradient is wanted, the backward takes them instead of recomputing;
    gradients equal the recomputing backward's and autograd's (float64 1e-10, float32 1e-5), a
    second backward over the kept graph (retain_graph) too: the kept gates are not overwritten.
    Nothing is kept under no_grad. Packed sequences too: the tape holds zeros past each end, as the
    outputs do."""
    torch.manual_seed(0)
    ref = getattr(torch.nn, kind)(3, 5, num_layers=2).to(dtype)
    ours = getattr(bnn, kind)(3, 5, num_layers=2, strategy="numba").to(dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(40, 4, 3, dtype=dtype)
    kept, taken = [], []  # taken: per layer backward, whether it walked a tape
    real_tape = layer_mod.new_tape
    monkeypatch.setattr(layer_mod, "new_tape", lambda *a: kept.append(real_tape(*a)) or kept[-1])
    if kind == "LSTM":  # the recomputing backward makes the cell states in its walk
        real_walk = numba_scan.LSTMWalk
        monkeypatch.setattr(
            numba_scan, "LSTMWalk", lambda *a, **k: taken.append(k.get("has_c", True)) or real_walk(*a, **k)
        )
    else:  # the recomputing backward makes the factors (``_walked``)
        real_gru, real_walked = numba_scan.GRUWalk, layer_mod._walked
        monkeypatch.setattr(numba_scan, "GRUWalk", lambda *a, **k: taken.append(True) or real_gru(*a, **k))
        monkeypatch.setattr(layer_mod, "_walked", lambda *a: taken.append(False) or real_walked(*a))
    lengths = [40, 31, 31, 5]

    def run(m: torch.nn.Module, xx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out, state = m(pack_padded_sequence(xx, lengths) if packed else xx)
        h_n, c_n = state if kind == "LSTM" else (state, None)
        return pad_packed_sequence(out)[0] if packed else out, h_n, c_n

    def grads(m: torch.nn.Module, retain: bool = False) -> list[torch.Tensor]:
        xx = x.clone().requires_grad_()
        out, h_n, c_n = run(m, xx)
        loss = out.sin().sum() + h_n.pow(2).sum() + (0 if c_n is None else c_n.cos().sum())
        first = torch.autograd.grad(loss, [xx, *m.parameters()], retain_graph=retain)
        return list(torch.autograd.grad(loss, [xx, *m.parameters()])) if retain else list(first)

    expected = grads(ref)
    taped = grads(ours)
    assert taken == [True, True] and all(isinstance(t, layer_mod.Tape) for t in kept)
    kept.clear()  # the top layer's tape: h_0..h_T (and c_0..c_T), a copy of the outputs, not them
    out, _, c_n = run(ours, x.clone().requires_grad_())
    top = kept[-1]
    assert torch.equal(top.hidden[1:], out) and not top.hidden[0].any()
    ends = lengths if packed else [x.shape[0]] * 4
    assert not top.gates[ends[-1] :, -1].any()  # past the last sample's end
    if kind == "LSTM":  # c_n: each sample's c at its end
        assert torch.equal(torch.from_numpy(top.cells[ends]).diagonal().T, c_n[-1]) and not top.cells[0].any()
        assert not top.cells[ends[-1] + 1 :, -1].any()
    else:
        assert top.cells is None
    assert out.untyped_storage().data_ptr() != top.hidden.untyped_storage().data_ptr()
    twice = grads(ours, retain=True)
    taken.clear()
    monkeypatch.setattr(layer_mod, "new_tape", lambda *a: None)
    recomputed = grads(ours)
    assert taken == [False, False]
    tol = 1e-10 if dtype == F64 else 1e-5
    for e, a, b, c in zip(expected, taped, twice, recomputed, strict=True):
        assert rel_err(e, a) < tol and rel_err(e, b) < tol and rel_err(e, c) < tol
    monkeypatch.setattr(layer_mod, "new_tape", lambda *a: kept.append(real_tape(*a)) or kept[-1])
    kept.clear()
    with torch.no_grad():
        ours(x)
    assert kept == []


def _tape_bytes(kind: str, steps: int, batch: int, hidden: int) -> int:
    """A float64 tape's bytes (``layer.Tape``): gates, an LSTM's cell states, the states."""
    return 8 * batch * hidden * (4 * steps + (steps + 1) * (2 if kind == "LSTM" else 1))


@pytest.fixture
def tape_memory(monkeypatch):
    """A ``TapeMemory`` of the test's own in place of the process's, keeping tapes from 64 KiB
    (``KEEP_MIN_BYTES``) so that short ones show it."""
    from bppsa_core import numba_forward

    memory = numba_forward.TapeMemory()
    monkeypatch.setattr(numba_forward, "TAPES", memory)
    monkeypatch.setattr(numba_forward, "KEEP_MIN_BYTES", 64 << 10)
    return memory


@pytest.mark.parametrize("steps", [20, 300])  # a tape under KEEP_MIN_BYTES (new arrays), and a kept one
@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_a_tape_is_freed_once_its_backward_has_run_unless_the_graph_is_retained(
    monkeypatch, tape_memory, kind, retain, steps
) -> None:
    """A tape, the most a GRU or LSTM step keeps, goes when its backward has run, as what autograd
    saves goes, though the outputs live on (a training loop's names hold them into the next step's
    forward, which would then hold two tapes); a retained graph keeps it for its next backward. A
    long one's memory is kept, free (``numba_forward.TapeMemory``), and the next step's tapes take it."""
    import gc
    import weakref

    alive, pointers, real_tape = [], [], layer_mod.new_tape

    def taped(*args):
        tape = real_tape(*args)
        alive.extend(weakref.ref(a) for a in (tape.gates, tape.cells, tape.states) if a is not None)
        pointers.append(tape.gates.ctypes.data)
        return tape

    monkeypatch.setattr(layer_mod, "new_tape", taped)
    torch.manual_seed(0)
    model = getattr(bnn, kind)(3, 5, num_layers=2, strategy="numba", dtype=F64)
    x = torch.randn(steps, 4, 3, dtype=F64)
    out, state = model(x)
    h_n = state[0] if kind == "LSTM" else state
    loss = out.sin().sum() + h_n.pow(2).sum()
    assert len(alive) == 2 * (3 if kind == "LSTM" else 2) and all(r() is not None for r in alive)
    kept = 2 * _tape_bytes(kind, steps, 4, 5) if steps == 300 else 0
    assert tape_memory.kept_bytes() == (kept, 0)
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=retain)
    gc.collect()
    assert [r() is not None for r in alive] == [retain] * len(alive), "the tapes after the backward"
    assert tape_memory.kept_bytes() == ((kept, 0) if retain else (0, kept))
    if retain:  # the retained graph's second backward reads them again: the same gradients
        for a, b in zip(first, torch.autograd.grad(loss, list(model.parameters())), strict=True):
            assert torch.equal(a, b)
        return
    if kept:  # the next step's tapes in the kept memory
        model(x)[0].sum().backward()
        assert sorted(pointers[2:]) == sorted(pointers[:2])


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_a_tape_written_over_the_last_ones_memory_gives_autograds_gradients(
    monkeypatch, tape_memory, kind
) -> None:
    """A kept tape's memory holds what the last tape left: every element a backward reads is written
    by its forward. With that memory poisoned (NaN), a step of a stacked bidirectional layer over
    packed sequences, from given states, gives autograd's gradients (float64, 1e-10)."""
    taken, real_tape = [], layer_mod.new_tape
    monkeypatch.setattr(layer_mod, "new_tape", lambda *a: taken.append(real_tape(*a)) or taken[-1])
    torch.manual_seed(0)
    ref = getattr(torch.nn, kind)(3, 6, num_layers=2, bidirectional=True, dtype=F64)
    ours = getattr(bnn, kind)(3, 6, num_layers=2, bidirectional=True, strategy="numba", dtype=F64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(300, 5, 3, dtype=F64)
    lengths = [300, 251, 251, 40, 1]
    h0 = torch.randn(4, 5, 6, dtype=F64)
    state = (h0, torch.randn_like(h0)) if kind == "LSTM" else h0

    def grads(m: torch.nn.Module) -> list[torch.Tensor]:
        xx = x.clone().requires_grad_()
        hh = (
            tuple(s.clone().requires_grad_() for s in state)
            if kind == "LSTM"
            else state.clone().requires_grad_()
        )
        out, last = m(pack_padded_sequence(xx, lengths), hh)
        ends = torch.cat(last) if kind == "LSTM" else last
        loss = pad_packed_sequence(out)[0].sin().sum() + ends.pow(2).sum()
        inputs = [xx, *(hh if kind == "LSTM" else (hh,)), *m.parameters()]
        return list(torch.autograd.grad(loss, inputs))

    expected = grads(ref)
    grads(ours)
    poisoned = [tape.gates.ctypes.data for tape in taken]
    for a in (a for tape in taken for a in (tape.gates, tape.cells, tape.states) if a is not None):
        a.fill(np.nan)
    del a
    taken.clear()
    assert tape_memory.kept_bytes() == (0, 4 * _tape_bytes(kind, 300, 5, 6))
    got = grads(ours)
    assert sorted(t.gates.ctypes.data for t in taken) == sorted(poisoned)
    for e, g in zip(expected, got, strict=True):
        assert rel_err(e, g) < 1e-10


def test_the_kept_tape_memory_follows_the_longest_step_and_is_let_go_on_request(tape_memory) -> None:
    """Steps of changing lengths: a step's tapes take the free buffers that hold them, a longer step
    lets the shorter buffers go for its own, so what is kept is what the longest step held at once
    (two layers' tapes); ``bppsa_core.release_tapes`` and the memory benchmark's ``reset_peak`` let
    it go."""
    import bppsa_core
    from benchmarks.memory import reset_peak

    torch.manual_seed(0)
    model = bnn.GRU(3, 5, num_layers=2, strategy="numba", dtype=F64)
    longest = 0
    for steps in (200, 400, 100, 400, 300):
        model(torch.randn(steps, 4, 3, dtype=F64))[0].sum().backward()
        longest = max(longest, steps)
        assert tape_memory.kept_bytes() == (0, 2 * _tape_bytes("GRU", longest, 4, 5)), steps
    bppsa_core.release_tapes()
    assert tape_memory.kept_bytes() == (0, 0)
    model(torch.randn(200, 4, 3, dtype=F64))[0].sum().backward()
    assert tape_memory.kept_bytes() == (0, 2 * _tape_bytes("GRU", 200, 4, 5))
    reset_peak()
    assert tape_memory.kept_bytes() == (0, 0)


@pytest.mark.parametrize("dtype", extended_except([F64, F32], first=1))  # a build per dtype to compile
def test_the_gru_walk_over_a_tape_matches_the_generic_path(dtype) -> None:
    """``numba_scan.GRUWalk`` over the tape of the compiled forward (``numba_forward.layer_forward``)
    against its plain-PyTorch twin: ``GRUCell.factors``, its chain scanned sequentially and
    ``preactivation_grads``, with the outputs' gradients injected and one sample ending early
    (``keep``, the identity past its end); walked in two blocks from the end."""
    from bppsa_core import numba_forward

    torch.manual_seed(3)
    steps, batch, hidden, features = 17, 3, 5, 2
    cell = jacobians.GRUCell()
    shapes = ((15, features), (15, hidden), (15,), (15,))
    w = LayerWeights(*(torch.randn(s, dtype=dtype) * 0.4 for s in shapes))
    x, h0 = torch.randn(steps, batch, features, dtype=dtype), torch.randn(batch, hidden, dtype=dtype)
    lengths = torch.tensor([steps, steps, 6])
    gates, cells, states = numba_forward.tape_arrays(steps, batch, hidden, dtype, False)
    weights = [w.w_ih, w.w_hh, w.b_ih, w.b_hh]
    out = numba_forward.layer_forward("GRU", x, h0, None, weights, lengths, 64, None, (gates, cells, states))[
        0
    ]
    keep = layer_mod._keep(lengths, steps, out)
    g_h, u = torch.randn(batch, hidden, dtype=dtype), torch.randn(steps, batch, hidden, dtype=dtype) * keep

    h_prev = torch.cat((h0.unsqueeze(0), out[:-1]))
    factors = cell.factors(x, h_prev, out, w, keep=keep)
    offsets = torch.cat((torch.zeros_like(u[:1]), u[:-1]))
    g = scan(cell.chain(factors, w), g_h + u[-1], offsets, strategy="sequential")
    twin = cell.preactivation_grads(g[1:], factors)

    walk = numba_scan.GRUWalk(gates, states, w.w_hh, u, lengths)
    d_in, d_hid = (torch.empty(steps, batch, 3 * hidden, dtype=dtype) for _ in range(2))
    g0 = g_h + u[-1]
    for lo, hi in ((9, steps), (0, 9)):
        walk(lo, hi, g0, g0, d_in[lo:hi], d_hid[lo:hi])
    for a, b in zip((*twin, g[0]), (d_in, d_hid, g0), strict=True):
        assert rel_err(a, b) < TOL[dtype]


@pytest.mark.parametrize("dtype", extended_except([F64, F32], first=1))  # a build per dtype to compile
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_the_rnn_walk_over_its_outputs_is_the_factored_walk_bit_for_bit(dtype, nonlinearity) -> None:
    """``numba_scan.RNNWalk`` (f' read off the outputs inside the kernel) against the path it
    replaced, ``layer._walked`` (the cell's factors, their chain walked by ``chunked_scan``, then
    ``preactivation_grads``): the same deltas and g_0 bit for bit, with the outputs' gradients, a
    sample ending early (the identity past its end) and relu's zero outputs, in blocks from the end."""
    torch.manual_seed(5)
    steps, batch, hidden = 13, 4, 20
    cell = RNNCell(nonlinearity)
    w = LayerWeights(
        torch.randn(hidden, 3, dtype=dtype), torch.randn(hidden, hidden, dtype=dtype) * 0.3, None, None
    )
    lengths = torch.tensor([steps, steps, 5, steps])
    h = torch.rand(steps, batch, hidden, dtype=dtype) * 2 - 1
    keep = layer_mod._keep(lengths, steps, h)
    h = (h.relu() if nonlinearity == "relu" else h) * keep  # outputs are 0 past each end
    u = torch.randn(steps, batch, hidden, dtype=dtype) * keep
    g_last = torch.randn(batch, hidden, dtype=dtype)
    h_prev = jacobians.PreviousStates(torch.randn(batch, hidden, dtype=dtype), h)
    x = torch.randn(steps, batch, 3, dtype=dtype)
    walk = numba_scan.RNNWalk(h, w.w_hh, nonlinearity == "relu", u, lengths)
    results = []
    for deltas, first in (
        layer_mod._walked(cell, x, h_prev, w, u, g_last, keep),
        layer_mod._walked_tape(walk, steps, g_last, (1,)),
    ):
        blocks = [deltas(slice(lo, hi)) for lo, hi in ((8, steps), (3, 8), (0, 3))]
        assert all(d_in is d_hid for d_in, d_hid in blocks)  # one pre-activation: the biases summed once
        results.append([*(d.clone() for d, _ in blocks), first().clone()])
    for new, old in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    assert (results[1][0] != 0).any() and (results[1][-1] != 0).all()


@pytest.mark.parametrize("kind", ["tanh", "gru", "lstm"])
def test_gradients_autograd_expanded_compile_no_second_walk(kind) -> None:
    """A loss summing h_n gives the backward its gradient expanded (strides 0); the walks' kernels
    still see C-contiguous arrays only, so such a loss compiles no second build (each costs
    seconds), and the gradients are torch.nn's."""
    kernels = {"tanh": "_rnn_layer_serial", "gru": "_gru_layer_serial", "lstm": "_lstm_layer_serial"}
    ref, ours = pair(kind, 3, 20)
    x = torch.randn(7, 2, 3, dtype=F64, requires_grad=True)
    grads = []
    for module in (ref, ours):
        _, h_n = module(x)
        h_n = h_n[0] if kind == "lstm" else h_n
        grads.append(torch.autograd.grad(h_n.sum(), [x, *module.parameters()]))
    for got, expected in zip(grads[1], grads[0], strict=True):
        assert rel_err(got, expected) < 1e-10
    signatures = getattr(numba_scan, kernels[kind]).signatures
    layouts = {t.layout for sig in signatures for t in sig if hasattr(t, "layout")}
    assert signatures and layouts == {"C"}, signatures


@pytest.mark.extended  # a parallel float64 build of its own to compile
def test_threads_change_nothing_in_an_rnn_walk(monkeypatch) -> None:
    """The RNN walk's samples are independent tasks: its serial and parallel builds agree bit for bit."""
    h, w_hh = torch.rand(9, 3, 5, dtype=F64), torch.randn(5, 5, dtype=F64)
    u, g_h = torch.randn(9, 3, 5, dtype=F64), torch.randn(3, 5, dtype=F64)

    def run() -> list[torch.Tensor]:
        g, delta = g_h.clone(), torch.empty(9, 3, 5, dtype=F64)
        numba_scan.RNNWalk(h, w_hh, False, u)(0, 9, g, g, delta)
        return [g, delta]

    results = _at_one_and_two_threads(monkeypatch, ("_rnn_layer_serial", "_rnn_layer_parallel"), run)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.extended  # a parallel float64 build of its own to compile
def test_threads_change_nothing_in_a_gru_walk(monkeypatch) -> None:
    """The GRU walk's samples are independent tasks: its serial and parallel builds agree bit for bit."""
    gates, states = np.random.rand(9, 3, 20), np.random.rand(10, 3, 5)
    w_hh, u, g_h = (
        torch.randn(15, 5, dtype=F64),
        torch.randn(9, 3, 5, dtype=F64),
        torch.randn(3, 5, dtype=F64),
    )

    def run() -> list[torch.Tensor]:
        g, d_in, d_hid = g_h.clone(), torch.empty(9, 3, 15, dtype=F64), torch.empty(9, 3, 15, dtype=F64)
        numba_scan.GRUWalk(gates, states, w_hh, u)(0, 9, g, g, d_in, d_hid)
        return [g, d_in, d_hid]

    results = _at_one_and_two_threads(monkeypatch, ("_gru_layer_serial", "_gru_layer_parallel"), run)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_the_chunk_follows_the_threads() -> None:
    """One chunk (every sample walked, in parallel) when samples keep the threads busy; chunks only
    where threads outnumber samples and the walk is long enough to pay for the aggregates."""
    assert dispatch.numba_chunk(1000, 16, 20, 1, threads=2) == 1000
    assert dispatch.numba_chunk(1000, 1, 20, 1, threads=1) == 1000
    chunk = dispatch.numba_chunk(100_000, 1, 20, 1, threads=64)
    assert 1 < chunk < 100_000 // 30  # dozens of chunks for 64 threads
    assert dispatch.numba_chunk(50, 1, 20, 1, threads=64) == 50  # H = 20 times the walk: not worth it
    for n in (1, 2, 7, 1000):
        assert 1 <= dispatch.numba_chunk(n, 2, 3, 3, threads=8) <= n


def test_subnormal_results_are_flushed_to_zero() -> None:
    """An RNN-like chain whose products sink below float32's smallest normal number: without the
    flush the kernels produce subnormals (numba's workers ignore the caller's FTZ mode), with it none."""
    g = torch.Generator().manual_seed(0)
    scales = torch.rand(600, 8, 1, 20, generator=g) * 0.3 + 0.2
    w = torch.randn(1, 20, 20, generator=g) / 20**0.5
    x = torch.randn(8, 20, generator=g)
    tiny = torch.finfo(F32).tiny

    def subnormal(t: torch.Tensor) -> bool:
        return bool(((t != 0) & (t.abs() < tiny)).any())

    for chunk in (600, 50):
        raw = numba_scan.chunked_scan(scales, w, x, None, chunk, flush=False)
        flushed = numba_scan.chunked_scan(scales, w, x, None, chunk)
        assert subnormal(raw) and not subnormal(flushed)
        assert (flushed - raw).abs().max() < 4 * tiny  # differences of the order of 2^-126 only
        assert torch.equal(flushed[-50:], raw[-50:])  # and none before the products sink


def test_a_scan_given_its_output_writes_it_there() -> None:
    torch.manual_seed(0)
    scales, weights = torch.randn(9, 2, 1, 3, dtype=F64), torch.randn(1, 3, 3, dtype=F64)
    x_last, offsets = torch.randn(2, 3, dtype=F64), torch.randn(9, 2, 3, dtype=F64)
    fresh = numba_scan.chunked_scan(scales, weights, x_last, offsets, 9)
    out = torch.full((10, 2, 3), float("nan"), dtype=F64)
    given = numba_scan.chunked_scan(scales, weights, x_last, offsets, 9, out=out)
    assert given.data_ptr() == out.data_ptr()
    torch.testing.assert_close(given, fresh, rtol=0, atol=0)


def test_a_kernel_call_leaves_the_interpreter_to_other_threads(monkeypatch) -> None:
    """The builds release the GIL while they run (nogil): a thread (a sequence-parallel run's
    heartbeat) keeps going through a long call instead of waiting for its end. One thread: the
    serial build, run in the calling thread (a parallel one's pool would release it anyway)."""
    import threading
    import time

    monkeypatch.setattr(numba_scan, "threads", lambda: 1)

    steps, batch, hidden = 100_000, 4, 20
    gates, h = torch.rand(steps, batch, 4, hidden), torch.rand(steps, batch, hidden)
    c0, w_hh = torch.zeros(batch, hidden), torch.randn(4 * hidden, hidden) / 10
    g_h, g_c = torch.ones(batch, hidden), torch.zeros(batch, hidden)
    numba_scan.lstm_layer_backward(gates[:2].clone(), h[:2], c0, w_hh, g_h, g_c, None)  # compiled first
    ticks, done = [], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.01)
    start = time.monotonic()
    numba_scan.lstm_layer_backward(gates, h, c0, w_hh, g_h, g_c, None)
    end = time.monotonic()
    done.set()
    thread.join()
    during = [t for t in ticks if start < t < end]
    # holding the GIL, the call would let the thread tick at most twice (once each side of it);
    # released, it ticks every millisecond of a call of tens of milliseconds
    assert len(during) >= 5, (end - start, len(during))


def test_flush_to_zero_reaches_torchs_pool_beside_numbas(monkeypatch) -> None:
    """With numba's OpenMP pool loaded beside PyTorch's, ``flush_denormals`` still sets the mode in
    the threads PyTorch's ops run on: a two-thread product makes no subnormal inside the block."""
    from bppsa_core import denormals

    if not denormals.available():
        pytest.skip("flush-to-zero cannot be set here")
    try:
        with torch_threads(2):
            numba_math.threads()  # numba's pool started, its OpenMP runtime loaded
            denormals._runtime.cache_clear()
            many = torch.full((1 << 22,), 1e-30)
            with denormals.flush_denormals():
                product = many * 1e-10
        assert not ((product != 0) & (product.abs() < torch.finfo(F32).tiny)).any()
    finally:
        denormals._runtime.cache_clear()


def test_the_runtime_is_torchs_libgomp_where_two_are_loaded() -> None:
    from bppsa_core import denormals

    maps = "\n".join(
        f"7f00{i}000-7f00{i}fff r-xp 00000000 08:01 {i} {path}"
        for i, path in enumerate(
            ["/usr/lib/libgomp.so.1.0.0", "/env/torch/lib/libgomp.so.1", "/env/torch.libs/libgomp-a3.so.1"]
        )
    )
    assert denormals._loaded("libgomp", prefer="/env/torch", maps=maps) == "/env/torch/lib/libgomp.so.1"
    assert denormals._loaded("libgomp", prefer="/opt/torch", maps=maps) == "/usr/lib/libgomp.so.1.0.0"
    assert denormals._loaded("libiomp", maps=maps) is None


# Two processes compile two specializations (float32, float64) of one build at once; numba's index
# and data writes are slowed so that both read the index before either writes it, and the first to
# write it writes its code last: the interleaving that, unserialized, leaves float64's entry naming
# float32's code.
_RACER = """
import sys, time
import numpy as np
import numba.core.caching as caching
from bppsa_core import numba_math
from kernel_of_two import total

dtype, start = np.dtype(sys.argv[1]).type, float(sys.argv[2])
first = dtype is np.float32
save_index, save_data = caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data

def slow_index(self, overloads):
    time.sleep(1.0 if first else 1.5)
    save_index(self, overloads)

def slow_data(self, name, data):
    time.sleep(2.0 if first else 0.0)
    save_data(self, name, data)

caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data = slow_index, slow_data
kernel = numba_math.build(total, False)
while time.time() < start:
    time.sleep(0.01)
print(kernel(np.array([0.5, 1.5, 2.5, 3.5], dtype)))
"""
_READER = """
import numpy as np
from bppsa_core import numba_math
from kernel_of_two import total

kernel = numba_math.build(total, False)
print(*(kernel(np.array([0.5, 1.5, 2.5, 3.5], d)) for d in (np.float64, np.float32)))
"""


@pytest.mark.extended  # three fresh processes, two of them slowed while they write
def test_two_processes_compiling_one_build_leave_its_cache_whole(tmp_path) -> None:
    """A float32 and a float64 build compiled at once by two processes (ranks, test workers, a
    sweep's jobs) leave an on-disk cache from which a third process loads each, correct: numba
    numbers a new entry's data file from the index it read, so unserialized the index could name
    float64 with float32's code, and every later float64 call would fail."""
    (tmp_path / "kernel_of_two.py").write_text("def total(x):\n    return x.sum()\n")
    env = {
        **os.environ,
        "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(map(str, (tmp_path, ROOT))),
    }
    run = functools.partial(subprocess.Popen, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = str(time.time() + 6)  # both started, numba imported, before either compiles
    racers = [run([sys.executable, "-c", _RACER, d, start], env=env) for d in ("float32", "float64")]
    outs = [r.communicate(timeout=120) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], outs
    read = subprocess.run(
        [sys.executable, "-c", _READER], env=env, capture_output=True, text=True, timeout=120
    )
    assert read.returncode == 0, read.stderr[-2000:]
    assert read.stdout.split() == ["8.0", "8.0"]


def test_a_cache_folder_without_locks_is_written_as_numba_writes_it(tmp_path, monkeypatch) -> None:
    """Where the filesystem refuses locks (some network ones) or the folder cannot be opened, the
    cache is written unserialized, as numba's own, rather than the compile failing."""

    def refused(fd: int, operation: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(numba_math.fcntl, "flock", refused)
    ran = []
    for folder in (tmp_path, tmp_path / "missing"):
        with numba_math._locked(str(folder)):
            ran.append(folder)
    assert ran == [tmp_path, tmp_path / "missing"]
