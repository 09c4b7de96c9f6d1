"""The paper's Table 1: building VGG-11's first transposed Jacobians in CSR vs autograd row by row.

    python -m benchmarks.jacobian_table [--device cuda]

For VGG-11's first Conv2d (3 -> 64, 3x3, padding 1), the ReLU after it and the MaxPool2d (2x2)
after that, on one 3x32x32 input: the shape of J^T, its sparsity (1 - stored entries / size), the
median time to build it with ``bppsa_core.sparse`` (``--repeats`` builds after ``--warmup`` untimed
ones; the first two page in fresh memory for the entries, 20 MB for the conv), and the autograd
baseline, which builds J one row at a time (a vector-Jacobian product with a one-hot vector per
output, then the row's non-zeros). The baseline is timed on ``--rows`` randomly sampled
rows and scaled to all rows, as the output says. Both run on ``--device`` (cpu, cuda, cuda:N or auto;
timed with CUDA events on a GPU, as the other benchmarks are). Paper: sparsity 0.99157 / 0.99998 /
0.99994; speedups 8.3e3 / 1.2e6 / 1.5e5.

Imports nothing beyond torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from benchmarks.common import (
    device_arg,
    markdown,
    non_negative_int,
    parser,
    positive_int,
    run_tool,
    seed_arg,
)
from bppsa_core import sparse
from experiments.timing import median_ms, time_ms

PAPER = {"Conv2d": (0.99157, 8.3e3), "ReLU": (0.99998, 1.2e6), "MaxPool2d": (0.99994, 1.5e5)}


def autograd_rows_time(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int, seed: int
) -> tuple[float, int]:
    """Seconds per row of building J with autograd (one VJP per output, then its non-zeros), and
    the rows it sampled: ``rows``, or all of J's where it has fewer."""
    x = x.detach().requires_grad_()
    y = fn(x).reshape(-1)
    picks = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(seed))[:rows]

    def rows() -> None:
        for r in picks.tolist():
            (row,) = torch.autograd.grad(y[r], x, retain_graph=True)
            row.reshape(-1).nonzero()

    return time_ms(rows, x.device) / 1e3 / len(picks), len(picks)


def table(
    rows: int = 256, repeats: int = 20, seed: int = 0, device: str | torch.device = "cpu", warmup: int = 3
) -> list[dict]:
    """Measure the three layers on ``device``; one dict per layer."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 32, 32, generator=g).to(device)
    with torch.random.fork_rng(devices=[]):  # the weights from the seed, the caller's stream untouched
        torch.manual_seed(seed)
        conv = torch.nn.Conv2d(3, 64, 3, padding=1).to(device)
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
        csr_s = median_ms(build, device, warmup, repeats) / 1e3
        per_row, sampled = autograd_rows_time(fn, inp, rows, seed)
        baseline = per_row * n_out  # J has one row per output
        out.append(
            {
                "layer": name,
                "shape": f"{n_in} x {n_out}",
                "sparsity": 1 - jt._nnz() / (n_in * n_out),
                "csr_s": csr_s,
                "autograd_s": baseline,
                "per_row_s": per_row,
                "rows": sampled,
                "speedup": baseline / csr_s,
            }
        )
    return out


def format_table(results: list[dict], rows: int, repeats: int = 20, warmup: int = 3) -> str:
    """Markdown table, with the build time that would give the paper's speedup against this baseline."""
    head = ["layer", "J^T shape", "sparsity (paper)", "CSR build", "autograd, row by row"]
    head += ["speedup (paper)", "build for the paper's speedup"]
    body = []
    for r in results:
        paper_sparsity, paper_speedup = PAPER[r["layer"]]
        body.append(
            [
                r["layer"],
                r["shape"],
                f"{r['sparsity']:.5f} ({paper_sparsity})",
                _ms(r["csr_s"]),
                f"{r['autograd_s']:.1f} s ({r['per_row_s'] * 1e6:.0f} µs/row)",
                f"{r['speedup']:.2e} ({paper_speedup:.1e})",
                _ms(r["autograd_s"] / paper_speedup),
            ]
        )
    sampled = {r["rows"] for r in results}
    what = (
        f"{sampled.pop()} sampled rows"
        if len(sampled) == 1
        else "sampled rows " + ", ".join(f"{r['layer']} {r['rows']}" for r in results)
    )
    if any(r["rows"] < rows for r in results):  # a J with fewer rows than asked for: all of its rows
        what += f" (all of J's rows where --rows {rows} is more)"
    notes = [
        f"CSR build: median of {repeats} builds after {warmup} untimed ones.",
        f"Autograd time: {what}, scaled to all rows of J.",
    ]
    return "\n".join([markdown(head, body), "", *notes])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def header(device: torch.device) -> str:
    """What the table was measured on."""
    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    )
    return f"torch {torch.__version__}, device {device} ({where}), one 3x32x32 input"


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("benchmarks.jacobian_table", __doc__)
    p.add_argument("--rows", type=positive_int, default=256, help="autograd rows sampled per layer")
    p.add_argument("--repeats", type=positive_int, default=20, help="timed CSR builds per layer")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed CSR builds before them")
    p.add_argument(
        "--seed", type=seed_arg, default=0, help="seed of the input, the weights and the sampled rows"
    )
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda, cuda:N or auto")
    args = p.parse_args(argv)
    print(header(args.device))
    results = table(args.rows, args.repeats, args.seed, args.device, args.warmup)
    print(format_table(results, args.rows, args.repeats, args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.jacobian_table", main))
