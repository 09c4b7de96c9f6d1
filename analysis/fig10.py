"""The paper's fig. 10 analogue from a pruned VGG-11 study: FLOPs of each sparse product.

    python -m analysis.fig10 results/pruned_vgg --out figures

Reads ``products.csv`` written by ``python -m experiments.bench.pruned_vgg`` and plots, per pruning ratio,
each product's FLOPs (2 x matching non-zero pairs) against its dense size m·n·k, one colour per
method; products on the critical path (the largest of their parallel level, and every sequential
product) are drawn filled, the others hollow. Log-log axes. PNG and PDF, reproducible byte for
byte.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from analysis.data import AnalysisError
from analysis.figures import plt, save

COLUMNS = ("ratio", "method", "flops", "mnk", "critical")


def load_products(folder: str | Path) -> pd.DataFrame:
    path = Path(folder) / "products.csv" if Path(folder).is_dir() else Path(folder)
    if not path.is_file():
        raise AnalysisError(
            f"no products.csv at {str(path)!r}; run python -m experiments.bench.pruned_vgg first"
        )
    data = pd.read_csv(path)
    missing = [c for c in COLUMNS if c not in data.columns]
    if missing:
        raise AnalysisError(f"{path} lacks the columns {', '.join(missing)}")
    return data


def fig10(products: pd.DataFrame) -> plt.Figure:
    ratios = sorted(products["ratio"].unique())
    fig, axes = plt.subplots(1, len(ratios), figsize=(5.5 * len(ratios), 4.5), squeeze=False)
    colours = {m: f"C{i}" for i, m in enumerate(sorted(products["method"].unique()))}
    for ax, ratio in zip(axes[0], ratios, strict=True):
        part = products[(products["ratio"] == ratio) & (products["flops"] > 0)]
        for method, rows in part.groupby("method"):
            for critical, style in ((True, "full"), (False, "none")):
                sel = rows[rows["critical"] == critical]
                ax.scatter(
                    sel["mnk"],
                    sel["flops"],
                    s=18,
                    facecolors=colours[method] if style == "full" else "none",
                    edgecolors=colours[method],
                    label=f"{method}{' (critical path)' if critical else ''}",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("m·n·k of the product")
        ax.set_ylabel("FLOPs (2 x matching non-zero pairs)")
        ax.set_title(f"Fig. 10 analogue: pruning ratio {ratio:g}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.fig10", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the --out folder of experiments.bench.pruned_vgg, or its products.csv")
    parser.add_argument("--out", default="figures")
    args = parser.parse_args(argv)
    try:
        products = load_products(args.path)
    except AnalysisError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    for path in save(fig10(products), Path(args.out), "fig10"):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
