"""Every scan strategy against the sequential twin, and the twin against the plain recurrence."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rel_err
from hypothesis import given
from hypothesis import strategies as st

from bppsa_core.chain import DenseChain, FactoredChain, LSTMChain
from bppsa_core.scan import blelloch_scan, chunked_scan, elementwise_recurrence, fold, scan, sequential_scan

F64 = torch.float64


def random_chain(n: int, batch: int, hidden: int, shared: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(hidden)  # keeps long products bounded
    return torch.randn(n, 1 if shared else batch, hidden, hidden, generator=g, dtype=F64) * scale


def random_factored(
    n: int, batch: int, hidden: int, k: int, diagonal: bool, seed: int, transposed: bool = False
) -> FactoredChain:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, batch, k, hidden, generator=g, dtype=F64)
    weights = torch.randn(k, hidden, hidden, generator=g, dtype=F64) / (k * math.sqrt(hidden))
    diag = torch.rand(n, batch, hidden, generator=g, dtype=F64) * 0.5 if diagonal else None
    return FactoredChain(scales, weights, diag, transposed)


def random_lstm(
    n: int, batch: int, hidden: int, past_end: bool, seed: int, transposed: bool = False
) -> LSTMChain:
    g = torch.Generator().manual_seed(seed)
    vectors = [torch.rand(n, batch, 4, hidden, generator=g, dtype=F64) * 0.5 for _ in range(2)]
    weights = torch.randn(4, hidden, hidden, generator=g, dtype=F64) / (4 * math.sqrt(hidden))
    diagonals = [
        torch.rand(n, batch, hidden, generator=g, dtype=F64) * 0.5 for _ in range(3 if past_end else 2)
    ]
    return LSTMChain(*vectors, weights, *diagonals, transposed=transposed)


def plain_recurrence(m: torch.Tensor, x_last: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """docs/DESIGN.md's BPTT in column-vector form, one sample and one step at a time."""
    n, batch = m.shape[0], x_last.shape[0]
    out = torch.empty(n + 1, batch, x_last.shape[1], dtype=x_last.dtype)
    for b in range(batch):
        g = x_last[b]
        out[n, b] = g
        for k in reversed(range(n)):
            jt = m[k, 0 if m.shape[1] == 1 else b].T  # the transposed Jacobian
            g = jt @ g + (0 if offsets is None else offsets[k, b])
            out[k, b] = g
    return out


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_sequential_twin_is_the_plain_recurrence(affine: bool, shared: bool) -> None:
    m = random_chain(9, 3, 4, shared, seed=1)
    x = torch.randn(3, 4, dtype=F64)
    b = torch.randn(9, 3, 4, dtype=F64) if affine else None
    assert rel_err(plain_recurrence(m, x, b), sequential_scan(m, x, b)) < 1e-14


@given(
    n=st.integers(1, 70),
    batch=st.integers(1, 4),
    hidden=st.integers(1, 5),
    shared=st.booleans(),
    affine=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parallel_scans_match_sequential_on_dense_chains(n, batch, hidden, shared, affine, seed) -> None:
    m = random_chain(n, batch, hidden, shared, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, hidden, generator=g, dtype=F64)
    b = torch.randn(n, batch, hidden, generator=g, dtype=F64) if affine else None
    ref = sequential_scan(m, x, b)
    assert ref.shape == (n + 1, batch, hidden)
    assert rel_err(ref, blelloch_scan(m, x, b)) < 1e-10
    assert rel_err(ref, chunked_scan(m, x, b)) < 1e-10
    assert rel_err(ref, scan(m, x, b, strategy="auto")) < 1e-10


@given(
    n=st.integers(1, 50),
    batch=st.integers(1, 3),
    hidden=st.integers(1, 4),
    k=st.integers(1, 3),
    diagonal=st.booleans(),
    affine=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parallel_scans_match_sequential_on_factored_chains(n, batch, hidden, k, diagonal, affine, seed):
    chain = random_factored(n, batch, hidden, k, diagonal, seed)
    x = torch.randn(batch, hidden, dtype=F64)
    b = torch.randn(n, batch, hidden, dtype=F64) if affine else None
    ref = sequential_scan(chain.dense(), x, b)
    for strategy in ("sequential", "blelloch", "chunked"):
        assert rel_err(ref, scan(chain, x, b, strategy=strategy)) < 1e-10, strategy


@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 3),
    hidden=st.integers(1, 4),
    lstm=st.booleans(),
    extra_diagonal=st.booleans(),
    transposed=st.booleans(),
    affine=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lstm_and_transposed_chains_scan_like_their_dense_elements(
    n, batch, hidden, lstm, extra_diagonal, transposed, affine, seed
) -> None:
    if lstm:
        chain = random_lstm(n, batch, hidden, extra_diagonal, seed, transposed)
    else:
        chain = random_factored(n, batch, hidden, 3, extra_diagonal, seed, transposed)
    state = chain.hidden
    x = torch.randn(batch, state, dtype=F64)
    b = torch.randn(n, batch, state, dtype=F64) if affine else None
    ref = sequential_scan(chain.dense(), x, b)
    for strategy in ("sequential", "blelloch", "chunked"):
        assert rel_err(ref, scan(chain, x, b, strategy=strategy, chunk=3)) < 1e-10, strategy


def test_an_lstm_element_is_its_definition_and_a_transposed_one_its_transpose() -> None:
    chain = random_lstm(3, 2, 4, True, seed=2)
    s_h, s_c, w = chain.scales_h, chain.scales_c, chain.weights
    h_cols = lambda s: sum(torch.diag_embed(s[:, :, j]) @ w[j] for j in range(4))  # noqa: E731
    expected = torch.cat(
        (
            torch.cat((h_cols(s_h) + torch.diag_embed(chain.diag_hh), torch.diag_embed(chain.diag_hc)), -1),
            torch.cat((h_cols(s_c), torch.diag_embed(chain.diag_cc)), -1),
        ),
        -2,
    )
    assert rel_err(expected, chain.dense()) < 1e-14
    flipped = LSTMChain(*chain.tensors(), transposed=True)
    assert torch.equal(flipped.dense(), expected.transpose(-1, -2))
    rows = torch.randn(3, 2, 5, 8, dtype=F64)
    out, work = torch.empty_like(rows), torch.empty(chain.work_shape(rows), dtype=F64)
    assert rel_err(rows @ expected, chain.rmul(rows, slice(None), out=out, work=work)) < 1e-14
    assert (
        rel_err(rows @ expected.transpose(-1, -2), flipped.rmul(rows, slice(None), out=out, work=work))
        < 1e-14
    )


@pytest.mark.parametrize("n", [1, 2, 5, 17, 200])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_the_elementwise_recurrence_is_the_plain_loop(n: int, chunk: int | None) -> None:
    g = torch.Generator().manual_seed(n)
    a, b = torch.rand(n, 3, 4, generator=g, dtype=F64), torch.randn(n, 3, 4, generator=g, dtype=F64)
    x = x0 = torch.randn(3, 4, generator=g, dtype=F64)
    expected = []
    for t in range(n):
        x = a[t] * x + b[t]
        expected.append(x)
    assert rel_err(torch.stack(expected), elementwise_recurrence(a, b, x0, chunk)) < 1e-14


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 31, 64, 100])
def test_every_levels_value_gives_the_same_result(n: int) -> None:
    m = random_chain(n, 2, 3, False, seed=n)
    x = torch.randn(2, 3, dtype=F64)
    b = torch.randn(n, 2, 3, dtype=F64)
    ref = sequential_scan(m, x, b)
    for levels in range(math.ceil(math.log2(n + 1)) + 2):
        assert rel_err(ref, blelloch_scan(m, x, b, levels=levels)) < 1e-10, levels


@pytest.mark.parametrize("n", [1, 7, 30, 61])
def test_every_chunk_size_gives_the_same_result(n: int) -> None:
    m = random_chain(n, 3, 2, True, seed=n)
    x = torch.randn(3, 2, dtype=F64)
    b = torch.randn(n, 3, 2, dtype=F64)
    ref = sequential_scan(m, x, b)
    for chunk in range(1, n + 2):
        assert rel_err(ref, chunked_scan(m, x, b, chunk=chunk)) < 1e-10, chunk


@pytest.mark.parametrize("strategy", ["sequential", "blelloch", "chunked"])
def test_scan_leaves_its_inputs_untouched(strategy: str) -> None:
    m = random_chain(40, 2, 3, False, seed=3)
    x = torch.randn(2, 3, dtype=F64)
    b = torch.randn(40, 2, 3, dtype=F64)
    copies = [t.clone() for t in (m, x, b)]
    scan(m, x, b, strategy=strategy, chunk=4)
    for before, after in zip(copies, (m, x, b), strict=True):
        assert torch.equal(before, after)


def test_factored_chain_folds_like_its_definition() -> None:
    chain = random_factored(4, 2, 3, 2, True, seed=5)
    s, w, d = chain.scales, chain.weights, chain.diagonal
    expected = torch.einsum("nbki,kij->nbij", s, w) + torch.diag_embed(d)
    manual = sum(torch.diag_embed(s[:, :, j]) @ w[j] for j in range(2)) + torch.diag_embed(d)
    assert rel_err(manual, expected) < 1e-14
    assert rel_err(expected, chain.dense()) < 1e-14
    rows = torch.randn(4, 2, 5, 3, dtype=F64)
    assert rel_err(rows @ expected, chain.rmul(rows, slice(None))) < 1e-14
    assert rel_err(rows[1] @ expected[1], chain.rmul(rows[1], 1)) < 1e-14


def test_float32_scans_stay_close_to_float64() -> None:
    m = random_chain(3000, 4, 8, False, seed=7)
    x = torch.randn(4, 8, dtype=F64)
    ref = sequential_scan(m, x)
    for strategy in ("blelloch", "chunked"):
        assert rel_err(ref, scan(m.float(), x.float(), strategy=strategy).double()) < 1e-4


def test_scan_and_fold_refuse_inputs_that_require_grad() -> None:
    m = random_chain(5, 2, 3, False, 0).requires_grad_()
    with pytest.raises(ValueError, match="scan\\(\\) builds no autograd graph"):
        scan(m, torch.zeros(2, 3, dtype=F64))
    with pytest.raises(ValueError, match="fold\\(\\) builds no autograd graph"):
        fold(m)
    with torch.no_grad():
        assert scan(m, torch.zeros(2, 3, dtype=F64)).shape == (6, 2, 3)
        assert fold(m)[0].shape == (2, 3, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "magic"}, "unknown scan strategy 'magic'; accepted: auto, sequential"),
        ({"chunk": 0}, "chunk must be a positive integer or None, got 0"),
        ({"levels": -1}, "levels must be a non-negative integer or None, got -1"),
    ],
)
def test_bad_options_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        scan(random_chain(4, 2, 3, False, 0), torch.zeros(2, 3, dtype=F64), **kwargs)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"x_last must have shape \(B, 3\), got \(2, 4\)"):
        scan(random_chain(4, 2, 3, False, 0), torch.zeros(2, 4, dtype=F64))
    with pytest.raises(ValueError, match="chain elements have batch size 2; accepted: 1"):
        scan(random_chain(4, 2, 3, False, 0), torch.zeros(5, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"offsets must have shape \(4, 2, 3\)"):
        scan(random_chain(4, 2, 3, False, 0), torch.zeros(2, 3, dtype=F64), torch.zeros(3, 2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"dense chain elements must have shape \(n, B or 1, H, H\)"):
        DenseChain(torch.zeros(4, 3, 3))
