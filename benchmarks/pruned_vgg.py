"""Pruned VGG-11 retraining: the sparse Jacobian chain of one input, scanned by BPPSA vs plain BP.

    python -m benchmarks.pruned_vgg --out results/pruned_vgg --ratios 0.9 0.97
    python -m analysis.fig10 results/pruned_vgg        # the paper's fig. 10 analogue

For each pruning ratio: VGG-11 for CIFAR-10 shapes (``analysis.schemes.network.build_vgg11``, the
cost model's VGG-11; ``--width`` scales the channels, ``--image-size`` the input), its conv and linear
weights magnitude-pruned per layer, retrained for ``--steps`` Adam steps on a synthetic image set the
code generates (10 classes of coloured patterns, no download) with the pruning masks kept, then the
chain of CSR transposed Jacobians of one input (``bppsa_core.sparse``). That chain is scanned by the
heterogeneous scan with ``levels`` = 2 (the paper's choice) and the other levels asked for, and
compared with plain back-propagation: total FLOPs, critical-path FLOPs, dependent steps. Each scan's
input gradient is checked against autograd's.

Writes, atomically, into ``--out``: ``summary.csv`` (one row per ratio and method) and
``products.csv`` (every sparse product: ratio, method, level, m, k, n, FLOPs, on the critical path
or not). The full-width network at 32x32 builds Jacobians of tens of millions of entries; start
with ``--width 0.25`` on a small machine.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from analysis.schemes.network import CLASSES, build_vgg11
from benchmarks.common import (
    Progress,
    bounded,
    non_negative_int,
    parser,
    positive_float,
    positive_int,
    run_tool,
)
from bppsa_core import sparse
from experiments.records import write_table
from toolbox.files import output_folder


def synthetic_images(n: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n coloured-pattern images (3, size, size) of 10 classes: class k is a stripe of frequency
    and colour set by k, with noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % CLASSES
    grid = torch.linspace(0, 1, size)
    xx, yy = torch.meshgrid(grid, grid, indexing="ij")
    freq = (1 + labels).view(n, 1, 1, 1).float()
    angle = (labels.float() * math.pi / CLASSES).view(n, 1, 1, 1)
    wave = torch.sin(2 * math.pi * freq * (xx * torch.cos(angle) + yy * torch.sin(angle)))
    colour = torch.stack([torch.cos(labels * 0.6), torch.sin(labels * 0.9), torch.cos(labels * 1.3)], 1)
    images = wave * colour.view(n, 3, 1, 1) + 0.3 * torch.randn(n, 3, size, size, generator=g)
    return images, labels


def prune(model: nn.Module, ratio: float) -> dict[nn.Module, torch.Tensor]:
    """Zero the smallest ``ratio`` of each conv/linear layer's weights; returns the masks."""
    masks = {}
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear) and ratio > 0:
            w = m.weight.detach()
            k = int(ratio * w.numel())
            threshold = w.abs().flatten().kthvalue(k).values if k > 0 else -1.0
            masks[m] = (w.abs() > threshold).to(w.dtype)
            m.weight.data.mul_(masks[m])
    return masks


def retrain(model: nn.Module, masks: dict, images: torch.Tensor, labels: torch.Tensor, steps: int) -> float:
    """A few Adam steps with the masks re-applied after each; returns the last loss."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        idx = torch.randint(len(images), (32,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        opt.step()
        with torch.no_grad():
            for m, mask in masks.items():
                m.weight.mul_(mask)
    return float(loss.detach())


def jacobian_chain(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """CSR transposed Jacobians of every layer at one input x (C, H, W), input side first."""
    chain = []
    h = x
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Conv2d):
                chain.append(
                    sparse.conv2d_jt(
                        h, layer.weight, layer.stride, layer.padding, layer.dilation, layer.groups
                    )
                )
            elif isinstance(layer, nn.ReLU):
                chain.append(sparse.relu_jt(h))
            elif isinstance(layer, nn.MaxPool2d):
                chain.append(sparse.maxpool2d_jt(h, layer.kernel_size, layer.stride, layer.padding))
            elif isinstance(layer, nn.Flatten):
                chain.append(sparse.flatten_jt(h))
            elif isinstance(layer, nn.Linear):
                chain.append(sparse.linear_jt(layer.weight))
            h = layer(h.unsqueeze(0))[0] if not isinstance(layer, nn.Linear) else layer(h)
    return chain


def _critical(cost: sparse.ScanCost) -> list[bool]:
    """Which products lie on the critical path: every sequential one, and the largest of each level."""
    largest: dict[tuple[int, str], int] = {}
    for p in cost.products:
        key = (p["level"], p["kind"])
        largest[key] = max(largest.get(key, 0), p["flops"])
    return [
        p["kind"] == "sequential" or p["flops"] == largest[(p["level"], p["kind"])] for p in cost.products
    ]


def study(
    ratios: Sequence[float],
    levels: Sequence[int | None],
    width: float,
    image_size: int,
    steps: int,
    seed: int = 0,
    progress: Callable[[str], None] = lambda text: None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The summary and products tables for every pruning ratio; ``progress`` hears of each stage."""
    images, labels = synthetic_images(512, image_size, seed)
    summary, products = [], []
    for ratio in ratios:
        progress(f"ratio {ratio:g}: pruning and retraining for {steps} steps ...")
        torch.manual_seed(seed)
        model = build_vgg11(width, image_size)
        masks = prune(model, ratio)
        loss = retrain(model, masks, images, labels, steps)
        x = images[0]
        progress(f"ratio {ratio:g}: building the CSR Jacobian chain ...")
        chain = jacobian_chain(model, x)
        g_y = torch.randn(CLASSES, generator=torch.Generator().manual_seed(seed))
        xr = x.clone().requires_grad_()
        (expected,) = torch.autograd.grad(model(xr.unsqueeze(0))[0], xr, g_y)
        methods = [("BP", sparse.backprop_cost(chain), None)]
        for lv in levels:
            progress(f"ratio {ratio:g}: scanning with levels={'all' if lv is None else lv} ...")
            t0 = time.perf_counter()
            xs, cost = sparse.sparse_scan(chain, g_y, levels=lv)
            err = float((xs[0] - expected.reshape(-1)).norm() / expected.norm())
            methods.append(
                (f"BPPSA levels={'all' if lv is None else lv}", cost, (err, time.perf_counter() - t0))
            )
        for name, cost, check in methods:
            summary.append(
                {
                    "ratio": ratio,
                    "method": name,
                    "total_flops": cost.total_flops,
                    "critical_flops": cost.critical_flops,
                    "steps": cost.steps,
                    "chain_nnz": sum(e._nnz() for e in chain),
                    "retrain_loss": loss,
                    "grad_rel_err": None if check is None else check[0],
                    "scan_s": None if check is None else check[1],
                }
            )
            for p, crit in zip(cost.products, _critical(cost), strict=True):
                products.append(
                    {"ratio": ratio, "method": name, **p, "mnk": p["m"] * p["n"] * p["k"], "critical": crit}
                )
    return pd.DataFrame(summary), pd.DataFrame(products)


RATIOS = "0 <= ratio < 1"


def _ratio(text: str) -> float:
    """argparse type of ``--ratios``: a pruning ratio, the share of each layer's weights zeroed."""
    value = bounded(float, RATIOS, positive=False)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a pruning ratio; accepted: {RATIOS}")
    return value


def _level(text: str) -> int | None:
    """argparse type of ``--levels``: a count of scan levels, or ``all`` (None: the full scan)."""
    return None if text == "all" else bounded(int, "0, 1, 2, ... or all", positive=False)(text)


def full_levels(n: int) -> int:
    """The up/down levels of ``sparse.sparse_scan``'s full scan over a chain of ``n`` elements: each
    level leaves (n - 1) // 2 of them, and the scan ends at none, so more levels change nothing."""
    return 0 if n == 0 else 1 + full_levels((n - 1) // 2)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("benchmarks.pruned_vgg", __doc__)
    p.add_argument("--out", type=output_folder, required=True, help="output folder")
    p.add_argument("--ratios", type=_ratio, nargs="+", default=[0.0, 0.9, 0.97], help="pruning ratios")
    p.add_argument(
        "--levels",
        type=_level,
        nargs="+",
        default=[2, 1, 3, None],
        help="scan levels before a sequential middle, 0 (plain BP) up to the full scan's, or all "
        "(default: 2 1 3 all)",
    )
    p.add_argument("--width", type=positive_float, default=1.0, help="channel multiplier (VGG-11: 1.0)")
    p.add_argument("--image-size", type=positive_int, default=32, help="input side (CIFAR-10: 32)")
    p.add_argument("--steps", type=non_negative_int, default=50, help="retraining steps per ratio")
    args = p.parse_args(argv)
    try:
        length = len(build_vgg11(args.width, args.image_size))  # one Jacobian per layer (jacobian_chain)
    except ValueError as exc:
        p.error(str(exc))
    most = full_levels(length)
    for lv in args.levels:
        if lv is not None and lv > most:  # the same scan as "all": refused rather than labelled otherwise
            p.error(
                f"argument --levels: {lv} is more than the {most} levels of the full scan over VGG-11's "
                f"{length} Jacobians; accepted: 0 to {most} or all"
            )
    progress = Progress("pruned_vgg")
    summary, products = study(
        args.ratios, args.levels, args.width, args.image_size, args.steps, progress=progress
    )
    progress("done")
    out = Path(args.out)
    write_table(out / "summary.csv", summary)
    write_table(out / "products.csv", products)
    print(summary.to_string(index=False))
    print(f"written: {out / 'summary.csv'}, {out / 'products.csv'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.pruned_vgg", main, "smaller --width or --image-size"))
