"""The paper's fig. 10 analogue from a pruned VGG-11 study: FLOPs of each sparse product.

    python -m analysis.fig10 results/pruned_vgg --out figures

Reads ``products.csv`` written by ``python -m benchmarks.pruned_vgg`` and plots, per pruning ratio,
each product's FLOPs (2 x matching non-zero pairs) against its dense size m·n·k, one colour per
method; products on the critical path (the largest of their parallel level, and every sequential
product) are drawn filled, the others hollow. Log-log axes. PNG and PDF, reproducible byte for
byte.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D

from analysis.data import (
    AnalysisError,
    finite_at_least_zero,
    read_table,
    require,
    require_flags,
    require_rows,
)
from analysis.figures import output_made, plt, print_written, save
from toolbox.cli import OneLineParser
from toolbox.files import output_folder

COLUMNS = ("ratio", "method", "flops", "mnk", "critical")


def load_products(folder: str | Path) -> pd.DataFrame:
    path = Path(folder) / "products.csv" if Path(folder).is_dir() else Path(folder)
    if not path.is_file():
        raise AnalysisError(f"no products.csv at {str(path)!r}; run python -m benchmarks.pruned_vgg first")
    products = read_table(path, COLUMNS, ("ratio", "flops", "mnk"))
    require_rows(products, path, "the products of python -m benchmarks.pruned_vgg")
    require(products, path, ("ratio", "flops", "mnk"), finite_at_least_zero, "a finite number >= 0")
    require(products, path, ("method",), lambda v: v.astype(str).str.strip() != "", "a method's name")
    require_flags(products, path, "critical")
    return products


def merge_identical(products: pd.DataFrame) -> pd.DataFrame:
    """Methods whose points are the same at a ratio (levels=3 and levels=all on a chain of 23
    elements: the same products, the last one only named differently) become one method, named by
    both, so no point hides another."""
    plotted = ["mnk", "flops", "critical"]
    parts = []
    for _, at_ratio in products.groupby("ratio", sort=True):
        names: dict[tuple, list[str]] = {}
        for method, rows in at_ratio.groupby("method", sort=True):
            key = tuple(map(tuple, rows[plotted].sort_values(plotted).to_numpy()))
            names.setdefault(key, []).append(method)
        for methods in names.values():
            rows = at_ratio[at_ratio["method"] == methods[0]]
            parts.append(rows.assign(method=" = ".join(methods)))
    return pd.concat(parts, ignore_index=True)


def fig10(products: pd.DataFrame) -> plt.Figure:
    """Each sparse product's FLOPs against its dense size, one panel per pruning ratio."""
    products = merge_identical(products)
    ratios = sorted(products["ratio"].unique())
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios) + 3, 4.5), squeeze=False)
    colours = {m: f"C{i}" for i, m in enumerate(sorted(products["method"].unique()))}
    for ax, ratio in zip(axes[0], ratios, strict=True):
        part = products[(products["ratio"] == ratio) & (products["flops"] > 0)]
        for method, rows in part.groupby("method"):
            for critical in (True, False):
                sel = rows[rows["critical"] == critical]
                ax.scatter(
                    sel["mnk"],
                    sel["flops"],
                    s=18,
                    facecolors=colours[method] if critical else "none",
                    edgecolors=colours[method],
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("m·n·k of the product")
        ax.set_ylabel("FLOPs (2 x matching non-zero pairs)")
        ax.set_title(f"Fig. 10 analogue: pruning ratio {ratio:g}", fontsize=10)
    handles = [Line2D([], [], marker="o", linestyle="", color=c, label=m) for m, c in colours.items()]
    handles += [
        Line2D([], [], marker="o", linestyle="", color="gray", label="on the critical path"),
        Line2D([], [], marker="o", linestyle="", markerfacecolor="none", color="gray", label="off it"),
    ]
    axes[0, -1].legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, title="method"
    )
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m analysis.fig10",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("path", help="the --out folder of benchmarks.pruned_vgg, or its products.csv")
    parser.add_argument("--out", type=output_folder, default="figures", help="output folder")
    args = parser.parse_args(argv)
    try:
        products = load_products(args.path)
    except AnalysisError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return print_written(
        parser.prog, lambda: save(fig10(products), output_made(parser, Path(args.out)), "fig10")
    )


if __name__ == "__main__":
    raise SystemExit(main())
