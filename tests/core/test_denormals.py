"""Subnormal floats in the CPU scans: flushed to zero in every thread while a scan runs, the mode
restored after it, and the gradients as exact as before. Checked by what the arithmetic produces,
never by timing."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import rel_err

from bppsa_core import denormals
from bppsa_core import nn as bnn
from bppsa_core import scan as scan_mod
from bppsa_core.chain import FactoredChain
from bppsa_core.scan import scan, sequential_scan

pytestmark = pytest.mark.skipif(not denormals.available(), reason="flush-to-zero cannot be set here")
TINY = torch.finfo(torch.float32).tiny


def subnormal(t: torch.Tensor) -> bool:
    return bool(((t != 0) & (t.abs() < TINY)).any())


def makes_subnormals() -> tuple[bool, bool]:
    """Whether the calling thread, and a multi-threaded op, produce subnormal results."""
    one = torch.tensor([1e-30]) * 1e-10
    many = torch.full((1 << 22,), 1e-30) * 1e-10
    return subnormal(one), bool(((many != 0) & (many.abs() < TINY)).all())


def underflowing_chain(n: int = 600, batch: int = 64, hidden: int = 20) -> FactoredChain:
    """An RNN-like chain whose products sink through the subnormal range within a chunk."""
    g = torch.Generator().manual_seed(0)
    scales = torch.rand(n, batch, 1, hidden, generator=g) * 0.3 + 0.2
    weights = torch.randn(1, hidden, hidden, generator=g) / hidden**0.5
    return FactoredChain(scales, weights)


def test_no_subnormal_reaches_the_chunked_scans_products(monkeypatch) -> None:
    chain = underflowing_chain()
    x = torch.randn(chain.batch, chain.hidden)
    seen = []
    real = FactoredChain.rmul

    def watched(self, x, idx, **kwargs):
        out = real(self, x, idx, **kwargs)
        seen.append(subnormal(out))
        return out

    monkeypatch.setattr(FactoredChain, "rmul", watched)
    with monkeypatch.context() as off:  # the control: without the mode, the products do sink into it
        off.setattr(scan_mod, "flush_denormals", lambda device: contextlib.nullcontext())
        scan(chain, x, strategy="chunked", chunk=300)
    assert any(seen)
    seen.clear()
    out = scan(chain, x, strategy="chunked", chunk=300)
    assert seen and not any(seen) and not subnormal(out)


@pytest.mark.parametrize("strategy", ["sequential", "blelloch", "chunked"])
def test_every_strategy_runs_flushed_and_leaves_the_mode_as_it_was(strategy, monkeypatch) -> None:
    assert makes_subnormals() == (True, True)
    inside = []
    real = scan_mod._eager
    monkeypatch.setattr(scan_mod, "_eager", lambda *a: inside.append(makes_subnormals()) or real(*a))
    chain = underflowing_chain(n=50)
    scan(chain, torch.randn(chain.batch, chain.hidden), strategy=strategy)
    assert inside and set(inside) == {(False, False)}  # flushed in the calling thread and the workers
    assert makes_subnormals() == (True, True)  # and put back


def test_a_module_backward_runs_flushed_and_its_gradients_stay_exact(monkeypatch) -> None:
    """Each layer's backward runs flushed beyond its scan: its weight-gradient GEMMs
    (``layer_grads``, outside ``scan``'s own flush) see the mode, in the calling thread and the
    workers; the gradients are torch.nn's and the mode is put back."""
    from bppsa_core import layer as layer_mod

    torch.manual_seed(0)
    ref = torch.nn.GRU(3, 8, num_layers=2)
    ours = bnn.GRU(3, 8, num_layers=2, strategy="chunked")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(400, 4, 3) * 4  # saturating gates: products that underflow
    inside, real = [], layer_mod.layer_grads
    monkeypatch.setattr(
        layer_mod, "layer_grads", lambda *a, **k: inside.append(makes_subnormals()) or real(*a, **k)
    )
    grads = []
    for m in (ref, ours):
        m(x)[1].pow(2).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert inside == [(False, False)] * 2  # one call per layer, each flushed
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-5
    assert makes_subnormals() == (True, True)


@pytest.mark.parametrize("model", ["LSTM", "GRU"])
def test_a_short_layer_backward_leaves_the_mode_as_it_is(model, monkeypatch) -> None:
    """Below ``layer.FLUSH_MIN_STEPS`` steps a layer's backward runs in the mode it finds (the
    switch costs more than so short a chain's subnormals could); from it on, flushed. Both
    routes: an LSTM's from its compiled forward's tape, a GRU's general one."""
    from bppsa_core import layer as layer_mod

    inside, real = [], layer_mod.layer_grads
    monkeypatch.setattr(
        layer_mod, "layer_grads", lambda *a, **k: inside.append(makes_subnormals()) or real(*a, **k)
    )
    torch.manual_seed(0)
    ref = getattr(torch.nn, model)(2, 6)
    ours = getattr(bnn, model)(2, 6)
    ours.load_state_dict(ref.state_dict())
    for steps, flushed in ((layer_mod.FLUSH_MIN_STEPS - 1, False), (layer_mod.FLUSH_MIN_STEPS, True)):
        inside.clear()
        x = torch.randn(steps, 3, 2)
        grads = []
        for m in (ref, ours):
            m.zero_grad()
            m(x)[0].pow(2).sum().backward()
            grads.append([p.grad for p in m.parameters()])
        assert inside == [(not flushed, not flushed)], steps
        for a, b in zip(*grads, strict=True):
            assert rel_err(a, b) < 1e-5
    assert makes_subnormals() == (True, True)


def test_float64_scans_are_unchanged() -> None:
    chain = underflowing_chain(n=300)
    chain = FactoredChain(chain.scales.double(), chain.weights.double())
    x = torch.randn(chain.batch, chain.hidden, dtype=torch.float64)
    ref = sequential_scan(chain, x)  # inside its own flush: float64's range is far from 2^-126
    assert rel_err(ref, scan(chain, x, strategy="chunked", chunk=17)) < 1e-10


def test_a_nested_block_does_not_restore_early() -> None:
    with denormals.flush_denormals():
        with denormals.flush_denormals():
            pass
        assert makes_subnormals() == (False, False)
    assert makes_subnormals() == (True, True)
