"""The paper's Table 1: building VGG-11's first transposed Jacobians in CSR vs autograd row by row.

    python -m experiments.jacobian_table

For VGG-11's first Conv2d (3 -> 64, 3x3, padding 1), the ReLU after it and the MaxPool2d (2x2)
after that, on one 3x32x32 input: the shape of J^T, its sparsity (1 - stored entries / size), the
median time to build it with ``bppsa_core.sparse`` (``--repeats`` after one warm-up), and the
autograd baseline, which builds J one row at a time (a vector-Jacobian product with a one-hot
vector per output, then the row's non-zeros). The baseline is timed on ``--rows`` randomly sampled
rows and scaled to all rows, as the output says. Paper: sparsity 0.99157 / 0.99998 / 0.99994;
speedups 8.3e3 / 1.2e6 / 1.5e5.

Imports nothing beyond torch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bppsa_core import sparse

PAPER = {"Conv2d": (0.99157, 8.3e3), "ReLU": (0.99998, 1.2e6), "MaxPool2d": (0.99994, 1.5e5)}


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def autograd_rows_time(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int, seed: int
) -> float:
    """Seconds per row of building J with autograd: one VJP per output, then its non-zeros."""
    x = x.detach().requires_grad_()
    y = fn(x).reshape(-1)
    picks = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(seed))[:rows]
    t0 = time.perf_counter()
    for r in picks.tolist():
        (row,) = torch.autograd.grad(y[r], x, retain_graph=True)
        row.reshape(-1).nonzero()
    return (time.perf_counter() - t0) / len(picks)


def table(rows: int = 256, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Measure the three layers; one dict per layer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 32, 32, generator=g)
    conv = torch.nn.Conv2d(3, 64, 3, padding=1)
    with torch.no_grad():
        a = conv(x.unsqueeze(0))[0]
        r = torch.relu(a)
    layers = [
        (
            "Conv2d",
            x,
            lambda t: conv(t.unsqueeze(0))[0],
            lambda: sparse.conv2d_jt(x, conv.weight.detach(), 1, 1),
        ),
        ("ReLU", a, torch.relu, lambda: sparse.relu_jt(a)),
        ("MaxPool2d", r, lambda t: F.max_pool2d(t.unsqueeze(0), 2)[0], lambda: sparse.maxpool2d_jt(r, 2)),
    ]
    out = []
    for name, inp, fn, build in layers:
        jt = build()
        n_in, n_out = jt.shape
        csr_s = _median_time(build, repeats)
        per_row = autograd_rows_time(fn, inp, rows, seed)
        baseline = per_row * n_out  # J has one row per output
        out.append(
            {
                "layer": name,
                "shape": f"{n_in} x {n_out}",
                "sparsity": 1 - jt._nnz() / (n_in * n_out),
                "csr_s": csr_s,
                "autograd_s": baseline,
                "speedup": baseline / csr_s,
            }
        )
    return out


def format_table(results: list[dict], rows: int) -> str:
    lines = [
        "| layer | J^T shape | sparsity (paper) | CSR build | autograd, row by row | speedup (paper) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        paper_sparsity, paper_speedup = PAPER[r["layer"]]
        lines.append(
            f"| {r['layer']} | {r['shape']} | {r['sparsity']:.5f} ({paper_sparsity}) "
            f"| {r['csr_s'] * 1e3:.2f} ms | {r['autograd_s']:.1f} s "
            f"| {r['speedup']:.2e} ({paper_speedup:.1e}) |"
        )
    lines.append(f"\nAutograd time: {rows} sampled rows, scaled to all rows of J.")
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.jacobian_table", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=_positive, default=256, help="autograd rows sampled per layer")
    parser.add_argument("--repeats", type=_positive, default=5, help="timed CSR builds per layer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, one 3x32x32 input")
    print(format_table(table(args.rows, args.repeats, args.seed), args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
