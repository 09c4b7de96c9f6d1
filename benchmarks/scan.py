"""Scan-only benchmark: BPPSA's scans and their peers on the identical chain.

    python -m benchmarks.backward --tables scan --T 100 1000 10000 --B 16 --H 20

The chain is a real recurrent layer's: PyTorch's RNN (or GRU) runs forward on random bits, and
``bppsa_core.jacobians`` turns its states into the factored Jacobians (tanh RNN: f'(z_t) of shape
(T, B, 1, H) and the shared W_hh); x_last is a random gradient on h_T. Every method computes all of
x_0..x_T from them:

* BPPSA: ``bppsa_core.scan.scan`` per strategy, on the factored chain, as the backward uses it;
* the peers, ``torch._higher_order_ops.associative_scan`` (generic mode) and
  ``jax.lax.associative_scan``, on the affine elements (A_k, c_k): A_k is M_k made dense (T, B, H, H)
  and c_k = 0, followed by one element (0, x_last). The map x -> x @ A + c applied first as (A1, c1)
  and then as (A2, c2) is (A1 @ A2, c1 @ A2 + c2); a reverse inclusive scan with that combine leaves
  x_k in c at position k. Building the dense elements is left out of the peers' times.

Every result is checked against ``sequential_scan`` run in float64 (norm-wise relative difference),
and every row carries the floors of ``benchmarks.floors``. This module imports nothing
beyond torch; numpy and jax are imported when used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from benchmarks.common import failure, fmt_ms, markdown
from benchmarks.floors import Floors
from bppsa_core import nn as bnn
from bppsa_core.chain import Chain
from bppsa_core.jacobians import LayerWeights
from bppsa_core.layer import cell_of
from bppsa_core.scan import scan, sequential_scan
from experiments.timing import median_ms

TORCH_PEER = "torch assoc_scan"
JAX_PEER = "jax assoc_scan"
PEERS = (TORCH_PEER, JAX_PEER)

# ----------------------------------------------------------------------------------------------- chain


def layer_chain(
    model: str,
    steps: int,
    batch: int,
    hidden: int,
    features: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Chain, Tensor]:
    """The factored Jacobian chain of one RNN, GRU or LSTM layer run on random bits, and a random x_last."""
    torch.manual_seed(seed)
    layer = MODULES[model](features, hidden).to(device, dtype)
    x = torch.bernoulli(torch.full((steps, batch, features), 0.5, device=device, dtype=dtype))
    with torch.no_grad():
        h, _ = layer(x)
        params = (layer.weight_ih_l0, layer.weight_hh_l0, layer.bias_ih_l0, layer.bias_hh_l0)
        w = LayerWeights(*(p.detach() for p in params))
        h_prev = torch.cat((torch.zeros_like(h[:1]), h[:-1]))
        cell = cell_of(layer.mode)
        c0 = torch.zeros_like(h[0]) if model == "lstm" else None
        chain = cell.chain(cell.factors(x, h_prev, h, w, c0), w)
    x_last = torch.randn(batch, chain.hidden, device=device, dtype=dtype)
    return chain, x_last


# The benchmarks' models: torch.nn's modules by name (the weight terms of their chains: ``TERMS``).
MODULES = {"rnn": torch.nn.RNN, "gru": torch.nn.GRU, "lstm": torch.nn.LSTM}
OURS = {name: getattr(bnn, cls.__name__) for name, cls in MODULES.items()}  # bppsa_core's of each
TERMS = {"rnn": 1, "gru": 3, "lstm": 4}


def module_pair(
    model: str,
    features: int,
    hidden: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    **options: object,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """torch.nn's one-layer module of ``model`` and ``bppsa_core``'s with the same weights (from the
    seed set now); ``options``: the BPPSA module's (``strategy``, say)."""
    ref = MODULES[model](features, hidden).to(device, dtype)
    ours = OURS[model](features, hidden, **options).to(device, dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _as_double(chain: Chain) -> Chain:
    return chain.with_tensors([t.double() for t in chain.tensors()])


def rel_diff(out: Tensor, ref: Tensor) -> float:
    """Norm-wise relative difference of ``out`` from the reference."""
    out = out.to(ref.device, ref.dtype)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------------------------- peers


def affine_elements(chain: Chain, x_last: Tensor) -> tuple[Tensor, Tensor]:
    """The chain as affine elements for a generic scan: A (n+1, B, H, H), c (n+1, B, H).

    Elements 0..n-1 are (M_k, 0); element n is (0, x_last), so the reverse scan's c at k is x_k.
    """
    n, h, b = chain.length, chain.hidden, x_last.shape[0]
    a = x_last.new_zeros((n + 1, b, h, h))
    a[:n] = chain.dense()
    c = x_last.new_zeros((n + 1, b, h))
    c[n] = x_last
    return a, c


def combine(first: tuple[Tensor, Tensor], then: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Compose two affine maps x -> x @ A + c, ``first`` applied first: (A1 @ A2, c1 @ A2 + c2).

    Works on single elements ((B, H, H), (B, H)) and on stacks of them (a leading dimension).
    """
    (a1, c1), (a2, c2) = first, then
    return a1 @ a2, (c1.unsqueeze(-2) @ a2).squeeze(-2) + c2


def torch_associative_scan(a: Tensor, c: Tensor) -> Tensor:
    """x_0..x_n by PyTorch's prototype ``associative_scan`` in generic mode, reversed over time."""
    from torch._higher_order_ops import associative_scan

    return associative_scan(combine, (a, c), dim=0, reverse=True, combine_mode="generic")[1]


def jax_peer(a: Tensor, c: Tensor) -> tuple[Callable[[], object], Callable[[object], Tensor]] | str:
    """A jitted ``jax.lax.associative_scan`` over (A, c) on A's device, and a converter of its result
    to a torch tensor; or the text of the cell when it cannot run ("not installed", "n/a (...)").

    Matrix products run at full float32 precision (``Precision.HIGHEST``; jax's default on a GPU
    is TF32), as torch's do. XLA is asked not to preallocate GPU memory, which torch shares.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except ImportError:
        return "not installed"
    platform = "gpu" if a.device.type == "cuda" else "cpu"
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        return f"n/a (jax has no {platform} backend)"
    dev = devices[min(a.device.index or 0, len(devices) - 1)]
    highest = jax.lax.Precision.HIGHEST

    def jcombine(first, then):
        (a1, c1), (a2, c2) = first, then
        return jnp.matmul(a1, a2, precision=highest), (
            jnp.matmul(c1[..., None, :], a2, precision=highest)[..., 0, :] + c2
        )

    fn = jax.jit(lambda a, c: jax.lax.associative_scan(jcombine, (a, c), reverse=True, axis=0)[1])
    args = (jax.device_put(a.cpu().numpy(), dev), jax.device_put(c.cpu().numpy(), dev))

    def run() -> object:
        return fn(*args).block_until_ready()

    return run, lambda out: torch.from_numpy(np.array(out))


# ----------------------------------------------------------------------------------------------- table


@dataclass
class ScanRow:
    """One configuration: per method its time (ms) or the text of its cell, and its difference."""

    model: str
    steps: int
    batch: int
    hidden: int
    cells: dict[str, float | str]
    diffs: dict[str, float]
    floor_bytes_ms: float
    floor_levels_ms: float
    notes: dict[str, str] = field(default_factory=dict)

    def best(self, methods: Sequence[str]) -> tuple[str, float] | None:
        timed = [(m, v) for m in methods if isinstance(v := self.cells.get(m), float)]
        return min(timed, key=lambda mv: mv[1]) if timed else None


def bench_scan(
    model: str,
    steps: int,
    batch: int,
    hidden: int,
    features: int,
    strategies: Sequence[str],
    device: torch.device,
    floors: Floors,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    peers: Sequence[str] = ("torch", "jax"),
    chunk: int | None = None,
) -> ScanRow:
    """Time every strategy and peer ("torch", "jax") on one layer's chain; check each against the
    float64 twin. ``chunk``: the chunked and triton strategies' chunk size (default: scan's)."""
    chain, x_last = layer_chain(model, steps, batch, hidden, features, device, seed=seed)
    twin = sequential_scan(_as_double(chain), x_last.double())
    cells: dict[str, float | str] = {}
    diffs: dict[str, float] = {}
    notes: dict[str, str] = {}
    for s in strategies:

        def run(s: str = s) -> Tensor:
            return scan(chain, x_last, strategy=s, chunk=chunk)

        try:
            diffs[s] = rel_diff(run(), twin)  # also a first warm-up
            cells[s] = median_ms(run, device, warmup, repeats)
        except Exception as exc:  # a strategy that cannot run is reported, not raised
            cells[s], notes[s] = failure(exc)
    if peers:
        a, c = affine_elements(chain, x_last)
        if "torch" in peers:
            try:
                diffs[TORCH_PEER] = rel_diff(torch_associative_scan(a, c), twin)
                cells[TORCH_PEER] = median_ms(lambda: torch_associative_scan(a, c), device, warmup, repeats)
            except Exception as exc:  # a prototype: any failure is reported, not raised
                cells[TORCH_PEER] = f"n/a ({type(exc).__name__})"
                notes[TORCH_PEER] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if "jax" in peers:
            cells[JAX_PEER] = _run_jax(a, c, twin, diffs, notes, warmup, repeats)
        del a, c
    return ScanRow(
        model,
        steps,
        batch,
        hidden,
        cells,
        diffs,
        floors.bytes_ms(steps, batch, hidden, TERMS[model]),
        floors.levels_ms(steps),
        notes,
    )


def _run_jax(
    a: Tensor,
    c: Tensor,
    twin: Tensor,
    diffs: dict[str, float],
    notes: dict[str, str],
    warmup: int,
    repeats: int,
) -> float | str:
    """The jax peer's median ms (wall clock around a blocking call; compilation excluded) or its cell."""
    try:
        peer = jax_peer(a, c)
        if isinstance(peer, str):
            return peer
        run, to_torch = peer
        diffs[JAX_PEER] = rel_diff(to_torch(run()), twin)  # compiles
        return median_ms(run, torch.device("cpu"), warmup, repeats)
    except Exception as exc:  # an optional peer: any failure is reported, not raised
        notes[JAX_PEER] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return f"n/a ({type(exc).__name__})"


def format_scan_table(rows: Sequence[ScanRow], strategies: Sequence[str]) -> str:
    """Markdown table: ms per method, each peer's time over the best BPPSA time, floors, checks."""
    peers = [p for p in PEERS if any(p in r.cells for r in rows)]
    head = ["model", "T", "B", "H", *(f"{m} ms" for m in (*strategies, *peers)), "best BPPSA"]
    head += [f"{p} / best" for p in peers]
    head += ["floor bytes ms", "floor levels ms", "best / floor", "BPPSA max rel diff"]
    head += [f"{p} rel diff" for p in peers]
    body = []
    for r in rows:
        cells = [r.model, str(r.steps), str(r.batch), str(r.hidden)]
        cells += [fmt_ms(r.cells.get(m, "n/a")) for m in (*strategies, *peers)]
        best = r.best(strategies)
        cells.append("n/a" if best is None else f"{best[0]} {fmt_ms(best[1])}")
        for p in peers:
            v = r.cells.get(p)
            cells.append(f"{v / best[1]:.3g}" if best and isinstance(v, float) else "n/a")
        floor = max(r.floor_bytes_ms, r.floor_levels_ms)
        cells += [f"{r.floor_bytes_ms:.3g}", f"{r.floor_levels_ms:.3g}"]
        cells.append("n/a" if best is None else f"{best[1] / floor:.3g}")
        ours = [r.diffs[s] for s in strategies if s in r.diffs]
        cells.append(f"{max(ours):.1e}" if ours else "n/a")
        cells += [f"{r.diffs[p]:.1e}" if p in r.diffs else "n/a" for p in peers]
        body.append(cells)
    return markdown(head, body)
