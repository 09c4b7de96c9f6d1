"""The Triton scan kernels against their plain-PyTorch twin: under TRITON_INTERPRET=1 on the CPU
(set by conftest when no GPU is present), and on a GPU with the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

pytest.importorskip("triton")

from bppsa_core import nn as bnn
from bppsa_core.chain import FactoredChain
from bppsa_core.scan import chunked_scan, scan

CASES = [
    (n, batch, hidden, chunk, affine)
    for n in (2, 5, 37)
    for batch, hidden in ((1, 1), (3, 5), (2, 20))
    for chunk in (1, 4)
    for affine in (False, True)
]


def run(device: str, n: int, batch: int, hidden: int, chunk: int, affine: bool) -> None:
    g = torch.Generator().manual_seed(n * 100 + hidden)
    s = torch.rand(n, batch, 1, hidden, generator=g)
    w = torch.randn(1, hidden, hidden, generator=g) / hidden**0.5
    x = torch.randn(batch, hidden, generator=g)
    b = torch.randn(n, batch, hidden, generator=g) if affine else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    chain = FactoredChain(to(s), to(w))
    twin = chunked_scan(chain, to(x), to(b), chunk=chunk)
    kernel = scan(chain, to(x), to(b), strategy="triton", chunk=chunk)
    assert kernel.shape == (n + 1, batch, hidden)
    assert rel_err(twin.double().cpu(), kernel.double().cpu()) < 1e-5


@pytest.mark.parametrize(("n", "batch", "hidden", "chunk", "affine"), CASES)
def test_kernels_match_the_chunked_twin_on_the_cpu(n, batch, hidden, chunk, affine) -> None:
    run("cpu", n, batch, hidden, chunk, affine)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "batch", "hidden", "chunk", "affine"), [*CASES, (1000, 16, 20, 22, False)])
def test_kernels_match_the_chunked_twin_on_a_gpu(n, batch, hidden, chunk, affine) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    run("cuda", n, batch, hidden, chunk, affine)


def test_an_rnn_trains_with_the_triton_backward() -> None:
    torch.manual_seed(0)
    ref = torch.nn.RNN(2, 7, num_layers=2)
    ours = bnn.RNN(2, 7, num_layers=2, strategy="triton", chunk=3)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(19, 3, 2)
    grads = []
    for m in (ref, ours):
        out, h_n = m(x)
        (out.sum() + h_n.pow(2).sum()).backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-4


def test_chains_the_kernels_do_not_take_are_refused() -> None:
    gru_like = FactoredChain(torch.rand(5, 2, 3, 4), torch.randn(3, 4, 4), torch.rand(5, 2, 4))
    with pytest.raises(ValueError, match="strategy='triton' takes a float32 RNN chain"):
        scan(gru_like, torch.zeros(2, 4), strategy="triton")
