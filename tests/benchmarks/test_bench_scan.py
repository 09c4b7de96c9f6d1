"""The scan-only benchmark's pieces: the affine elements the peers scan, the peers, and the floors."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from helpers import rel_err

from benchmarks import scan as bench_scan
from benchmarks.common import notes_lines
from benchmarks.floors import Floors, dependent_levels, measure_floors, min_bytes
from benchmarks.scan import JAX_PEER, TORCH_PEER, affine_elements, combine, layer_chain
from bppsa_core.scan import sequential_scan

CPU = torch.device("cpu")


@pytest.mark.parametrize("model", ["rnn", "gru", "lstm"])
def test_layer_chain_is_a_plain_chain_of_the_layer(model) -> None:
    chain, x_last = layer_chain(model, 7, 3, 4, 2, CPU)
    state = 8 if model == "lstm" else 4  # an LSTM's state is (h, c)
    assert (chain.length, chain.batch, chain.hidden) == (7, 3, state)
    assert chain.weights.shape[0] == {"rnn": 1, "gru": 3, "lstm": 4}[model]
    assert x_last.shape == (3, state)
    assert not any(t.requires_grad for t in (*chain.tensors(), x_last))  # scan() refuses those


@pytest.mark.parametrize("model", ["rnn", "gru", "lstm"])
def test_folding_the_affine_elements_from_the_end_gives_the_twin(model) -> None:
    chain, x_last = layer_chain(model, 9, 2, 3, 1, CPU)
    a, c = affine_elements(chain, x_last)
    s = chain.hidden
    assert a.shape == (10, 2, s, s) and c.shape == (10, 2, s)
    acc = (a[9], c[9])
    folded = [acc[1]]
    for k in reversed(range(9)):  # the reverse inclusive scan, one element at a time
        acc = combine(acc, (a[k], c[k]))
        folded.append(acc[1])
    got = torch.stack(folded[::-1])
    assert rel_err(sequential_scan(chain, x_last), got) < 1e-6


def test_combine_is_associative_on_stacks() -> None:
    g = torch.Generator().manual_seed(0)
    e = [(torch.randn(4, 2, 3, 3, generator=g), torch.randn(4, 2, 3, generator=g)) for _ in range(3)]
    left = combine(combine(e[0], e[1]), e[2])
    right = combine(e[0], combine(e[1], e[2]))
    for x, y in zip(left, right, strict=True):
        assert rel_err(x, y) < 1e-5


def _torch_peer_or_skip():
    try:
        from torch._higher_order_ops import associative_scan  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no torch._higher_order_ops.associative_scan")


def test_torch_associative_scan_matches_the_twin() -> None:
    _torch_peer_or_skip()
    chain, x_last = layer_chain("gru", 23, 2, 4, 3, CPU)
    got = bench_scan.torch_associative_scan(*affine_elements(chain, x_last))
    assert got.shape == (24, 2, 4)
    assert rel_err(sequential_scan(chain, x_last), got) < 1e-5


def test_jax_peer_matches_the_twin() -> None:
    pytest.importorskip("jax")
    chain, x_last = layer_chain("rnn", 23, 2, 4, 1, CPU)
    peer = bench_scan.jax_peer(*affine_elements(chain, x_last))
    assert not isinstance(peer, str), peer
    run, to_torch = peer
    assert rel_err(sequential_scan(chain, x_last), to_torch(run())) < 1e-5


def test_jax_peer_says_when_jax_is_not_installed(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)
    chain, x_last = layer_chain("rnn", 5, 2, 3, 1, CPU)
    assert bench_scan.jax_peer(*affine_elements(chain, x_last)) == "not installed"


FLOORS = Floors(bandwidth_gbs=10.0, launch_us=5.0)


def test_a_failing_peer_and_a_refusing_strategy_are_reported_not_raised(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)
    with contextlib.suppress(ImportError):  # imported under the interpreter first (triton.jit decides then)
        import bppsa_core.triton  # noqa: F401
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton refuses the CPU

    def broken(a, c):
        raise RuntimeError("associative_scan: not on this device\nmore detail")

    monkeypatch.setattr(bench_scan, "torch_associative_scan", broken)
    row = bench_scan.bench_scan("rnn", 17, 2, 3, 1, ["blelloch", "triton"], CPU, FLOORS, warmup=0, repeats=1)
    assert isinstance(row.cells["blelloch"], float) and row.diffs["blelloch"] < 1e-5
    assert row.cells["triton"] == "n/a" and "triton" in row.notes["triton"]
    assert row.cells[TORCH_PEER] == "n/a (RuntimeError)"
    assert row.notes[TORCH_PEER] == "RuntimeError: associative_scan: not on this device"
    assert row.cells[JAX_PEER] == "not installed"
    table = bench_scan.format_scan_table([row], ["blelloch", "triton"])
    assert "| n/a (RuntimeError) | not installed |" in table
    assert notes_lines([row]) == [
        f"- triton: {row.notes['triton']}",
        "- torch assoc_scan: RuntimeError: associative_scan: not on this device",
    ]


def test_floor_arithmetic() -> None:
    # T·B·H read + H² weights + (T+1)·B·H written, 4 bytes each
    assert min_bytes(1000, 16, 20) == 4 * (1000 * 16 * 20 + 400 + 1001 * 16 * 20)
    assert min_bytes(10, 2, 3, terms=3) == 4 * (60 + 27 + 66)
    assert [dependent_levels(t) for t in (1, 2, 3, 1000, 1024, 1025, 30000)] == [1, 2, 4, 20, 20, 22, 30]
    assert FLOORS.bytes_ms(1000, 16, 20) == pytest.approx(min_bytes(1000, 16, 20) / 1e7)
    assert FLOORS.levels_ms(1000) == pytest.approx(20 * 5e-3)


def test_measured_floors_are_positive() -> None:
    floors = measure_floors(CPU, repeats=1)
    assert 0.05 < floors.bandwidth_gbs < 1e4
    assert 0 < floors.launch_us < 1e4
