"""The Triton scan kernels against their plain-PyTorch twin: under TRITON_INTERPRET=1 on the CPU
(set by conftest when no GPU is present), and on a GPU with the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

pytest.importorskip("triton")

from bppsa_core import nn as bnn
from bppsa_core.chain import DenseChain, FactoredChain
from bppsa_core.scan import chunked_scan, scan

CASES = [
    (n, batch, hidden, chunk, affine, terms)
    for n in (2, 5, 37)
    for batch, hidden in ((1, 1), (3, 5), (2, 20))
    for chunk in (1, 4)
    for affine in (False, True)
    for terms in (1, 3)
]


def run(device: str, n: int, batch: int, hidden: int, chunk: int, affine: bool, terms: int) -> None:
    """terms=1: an RNN's chain; terms=3: a GRU's (three weights and a diagonal). Elements of odd
    n are shared by the batch (batch dimension 1), to check the kernels' broadcast reads."""
    g = torch.Generator().manual_seed(n * 100 + hidden + terms)
    shared = n % 2 == 1 and batch > 1
    bm = 1 if shared else batch
    s = torch.rand(n, bm, terms, hidden, generator=g)
    w = torch.randn(terms, hidden, hidden, generator=g) / (terms * hidden) ** 0.5
    e = torch.rand(n, bm, hidden, generator=g) if terms > 1 else None
    x = torch.randn(batch, hidden, generator=g)
    b = torch.randn(n, batch, hidden, generator=g) if affine else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    chain = FactoredChain(to(s), to(w), to(e))
    twin = chunked_scan(chain, to(x), to(b), chunk=chunk)
    kernel = scan(chain, to(x), to(b), strategy="triton", chunk=chunk)
    assert kernel.shape == (n + 1, batch, hidden)
    assert rel_err(twin.double().cpu(), kernel.double().cpu()) < 1e-5


ARGS = ("n", "batch", "hidden", "chunk", "affine", "terms")


@pytest.mark.parametrize(ARGS, CASES)
def test_kernels_match_the_chunked_twin_on_the_cpu(n, batch, hidden, chunk, affine, terms) -> None:
    run("cpu", n, batch, hidden, chunk, affine, terms)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ARGS, [*CASES, (1000, 16, 20, 22, False, 1), (1000, 16, 64, 22, True, 1), (1034, 64, 20, 23, True, 3)]
)
def test_kernels_match_the_chunked_twin_on_a_gpu(n, batch, hidden, chunk, affine, terms) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    run("cuda", n, batch, hidden, chunk, affine, terms)


@pytest.mark.parametrize(("ref_cls", "our_cls"), [(torch.nn.RNN, bnn.RNN), (torch.nn.GRU, bnn.GRU)])
def test_a_recurrent_net_trains_with_the_triton_backward(ref_cls, our_cls) -> None:
    torch.manual_seed(0)
    ref = ref_cls(2, 7, num_layers=2)
    ours = our_cls(2, 7, num_layers=2, strategy="triton", chunk=3)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(19, 3, 2)
    grads = []
    for m in (ref, ours):
        out, h_n = m(x)
        (out.sum() + h_n.pow(2).sum()).backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize(
    ("chain", "why"),
    [
        (FactoredChain(torch.rand(5, 2, 1, 65), torch.randn(1, 65, 65)), "RNN H = 65: Hp = 128"),
        (FactoredChain(torch.rand(5, 2, 3, 33), torch.randn(3, 33, 33)), "GRU H = 33: 3 * 64^2 > 4096"),
        (FactoredChain(torch.rand(5, 2, 4, 4), torch.randn(4, 4, 4)), "four terms"),
        (FactoredChain(torch.rand(5, 2, 1, 4).double(), torch.randn(1, 4, 4).double()), "float64"),
        (DenseChain(torch.rand(5, 2, 4, 4)), "a dense chain"),
    ],
)
def test_chains_the_kernels_do_not_take_are_refused(chain, why) -> None:
    match = "strategy='triton' takes a float32 factored chain of at most 3 terms"
    with pytest.raises(ValueError, match=match):
        scan(chain, torch.zeros(2, chain.hidden, dtype=chain.tensors()[0].dtype), strategy="triton")
