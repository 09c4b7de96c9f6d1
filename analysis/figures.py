"""The paper's figures from result folders, as PNG and PDF.

    python -m analysis.figures multirun/rnn_seq_len multirun/rnn_batch --out figures/

Figures: 7 (RNN loss vs wall-clock), 8a-f (BPPSA backward runtime, backward speedup and runtime
breakdown against T and against B), 9 (GRU runtime breakdown, s/m/l x batch), 13 (GRU loss vs
wall-clock for s/m/l), and the scaling figure (backward runtime against workers, per device). Each
is drawn from whatever data is present; a panel without data says so. Runtimes are medians over
epochs of the per-iteration phase times; one hue or line style per device name.

Output is byte-for-byte reproducible from the same input: the Agg backend, no timestamps in the
PDF metadata, no software stamp in the PNGs, and a fixed bootstrap seed for the speedup intervals.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from analysis.data import PHASES, AnalysisError, load_results, speedups

sns.set_theme(style="whitegrid")  # every figure of the suite, fig. 10 included, in one style
plt.rcParams.update({"svg.hashsalt": "bppsa", "pdf.compression": 6})

PHASE_COLUMNS = {p: f"{p}_per_iter_s" for p in PHASES}  # the columns load_results adds
FIGURES = ("fig7", "fig8", "fig9", "fig13", "scaling")


def _no_data(ax: plt.Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _pick(data: pd.DataFrame, name: str) -> pd.DataFrame:
    """Rows of the preset ``name`` where present, else all rows given."""
    if "name" in data.columns and (data["name"] == name).any():
        return data[data["name"] == name]
    return data


def _sweep(data: pd.DataFrame, x: str, fixed: str) -> pd.DataFrame:
    """The rows of the ``fixed`` value that covers the most distinct ``x`` values (a 1-D sweep)."""
    if data.empty:
        return data
    counts = data.groupby(fixed)[x].nunique()
    return data[data[fixed] == counts.idxmax()]


def _medians(data: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return data.groupby(keys, dropna=False)[[*list(PHASE_COLUMNS.values()), "epoch_s"]].median().reset_index()


def _loss_curves(ax: plt.Axes, rows: pd.DataFrame) -> None:
    """Training loss against cumulative training time, one line per run (figs. 7 and 13)."""
    sns.lineplot(
        data=rows,
        x="wall_s",
        y="loss",
        hue="backward",
        style="device_name",
        units="run",
        estimator=None,
        ax=ax,
    )
    ax.set_xlabel("wall-clock training time (s)")
    ax.set_ylabel("training loss")


def fig7(data: pd.DataFrame) -> plt.Figure:
    """Training loss against wall-clock time, RNN, BPTT vs BPPSA."""
    rnn = _pick(data[data["model"] == "rnn"], "rnn_curve")
    fig, ax = plt.subplots(figsize=(6, 4))
    if rnn.empty:
        _no_data(ax, "no RNN runs (experiment=rnn_curve)")
    else:
        _loss_curves(ax, rnn)
    ax.set_title("Fig. 7: RNN training loss vs wall-clock time")
    fig.tight_layout()
    return fig


def _runtime_panel(ax: plt.Axes, rows: pd.DataFrame, x: str, label: str) -> None:
    bppsa = rows[rows["backward"] == "bppsa"]
    if bppsa[x].nunique() < 2:
        _no_data(ax, f"BPPSA runs at 2+ values of {label}")
        return
    med = _medians(bppsa, [x, "device_name"])
    sns.lineplot(data=med, x=x, y="backward_per_iter_s", hue="device_name", marker="o", ax=ax)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("BPPSA backward per iteration (s)")


def _speedup_panel(ax: plt.Axes, rows: pd.DataFrame, x: str, label: str) -> None:
    table = speedups(rows) if not rows.empty else pd.DataFrame()
    if table.empty or table[x].nunique() < 2:
        _no_data(ax, f"BPTT and BPPSA runs at 2+ values of {label}")
        return
    for device, part in table.sort_values(x).groupby("device_name"):
        ax.errorbar(
            part[x],
            part["backward_speedup"],
            yerr=[
                part["backward_speedup"] - part["backward_lo"],
                part["backward_hi"] - part["backward_speedup"],
            ],
            marker="o",
            capsize=3,
            label=device,
        )
    ax.axhline(1.0, linestyle="--", color="gray", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("backward speedup (BPTT / BPPSA)")
    ax.legend(title="device")


def _breakdown_panel(ax: plt.Axes, rows: pd.DataFrame, x: str, label: str) -> None:
    if rows[x].nunique() < 2:
        _no_data(ax, f"runs at 2+ values of {label}")
        return
    device = rows["device_name"].value_counts().idxmax()
    med = _medians(rows[rows["device_name"] == device], [x, "backward"])
    long = med.melt(
        id_vars=[x, "backward"], value_vars=list(PHASE_COLUMNS.values()), var_name="phase", value_name="s"
    )
    long["phase"] = long["phase"].map({v: k for k, v in PHASE_COLUMNS.items()})
    sns.lineplot(data=long, x=x, y="s", hue="phase", style="backward", marker="o", ax=ax)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel(f"time per iteration (s), {device}")


def fig8(data: pd.DataFrame) -> plt.Figure:
    """Panels a-f: BPPSA backward runtime, backward speedup, runtime breakdown; against T and B."""
    rnn = data[data["model"] == "rnn"]
    by_t = _sweep(_pick(rnn, "rnn_seq_len"), "seq_len", "batch_size")
    by_b = _sweep(_pick(rnn, "rnn_batch"), "batch_size", "seq_len")
    fig, axes = plt.subplots(3, 2, figsize=(11, 12))
    for col, (rows, x, label) in enumerate(
        ((by_t, "seq_len", "sequence length T"), (by_b, "batch_size", "batch size B"))
    ):
        _runtime_panel(axes[0, col], rows, x, label)
        _speedup_panel(axes[1, col], rows, x, label)
        _breakdown_panel(axes[2, col], rows, x, label)
    for ax, letter in zip(axes.flat, "abcdef", strict=True):
        ax.set_title(f"Fig. 8{letter}", loc="left")
    fig.tight_layout()
    return fig


def fig9(data: pd.DataFrame) -> plt.Figure:
    """GRU runtime breakdown per iteration, feature setting x batch size, BPTT and BPPSA."""
    gru = _pick(data[data["model"] == "gru"], "gru_irmas")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if gru.empty:
        _no_data(ax, "no GRU runs (experiment=gru_irmas)")
        ax.set_title("Fig. 9: GRU runtime breakdown")
        return fig
    device = gru["device_name"].value_counts().idxmax()
    gru = gru[gru["device_name"] == device].assign(frames=gru["frames"].fillna("?"))
    med = _medians(gru, ["frames", "batch_size", "backward"])
    med["order"] = med["frames"].map({"s": 0, "m": 1, "l": 2})  # the paper's order, not the alphabet's
    med = med.sort_values(["order", "batch_size", "backward"]).reset_index(drop=True)
    labels = [f"{r.frames} B={r.batch_size}\n{r.backward}" for r in med.itertuples()]
    bottom = pd.Series(0.0, index=med.index)
    for phase, column in PHASE_COLUMNS.items():
        ax.bar(labels, med[column], bottom=bottom, label=phase)
        bottom = bottom + med[column].fillna(0)
    ax.set_ylabel("time per iteration (s)")
    ax.set_xlabel("feature setting, batch size, backward")
    ax.legend(title="phase")
    ax.set_title(f"Fig. 9: GRU runtime breakdown ({device})")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    return fig


def fig13(data: pd.DataFrame) -> plt.Figure:
    """GRU training loss against wall-clock time, one panel per feature setting."""
    gru = _pick(data[data["model"] == "gru"], "gru_curves")
    settings = [s for s in ("s", "m", "l") if (gru["frames"] == s).any()] or ["s", "m", "l"]
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        rows = gru[gru["frames"] == setting]
        if rows.empty:
            _no_data(ax, f"no GRU runs with frames={setting}")
        else:
            _loss_curves(ax, rows)
        ax.set_title(f"Fig. 13 ({setting})")
    fig.tight_layout()
    return fig


def scaling(data: pd.DataFrame) -> plt.Figure:
    """BPTT and BPPSA backward per iteration against the number of workers, per device."""
    rows = _pick(data, "workers").dropna(subset=["workers_used"])
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows["workers_used"].nunique() < 2:
        _no_data(ax, "runs at 2+ worker counts (experiment=workers)")
    else:
        med = _medians(rows, ["workers_used", "backward", "device_name"])
        sns.lineplot(
            data=med,
            x="workers_used",
            y="backward_per_iter_s",
            hue="backward",
            style="device_name",
            marker="o",
            ax=ax,
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers p (CPU threads or GPU SMs)")
        ax.set_ylabel("backward per iteration (s)")
    ax.set_title("Scaling with workers")
    fig.tight_layout()
    return fig


def save(fig: plt.Figure, out: Path, name: str) -> list[Path]:
    """PNG and PDF, without timestamps or version stamps, so equal input gives equal bytes."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, metadata={"Software": None})
    fig.savefig(paths[1], metadata={"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None})
    plt.close(fig)
    return paths


def make_figures(data: pd.DataFrame, out: Path) -> list[Path]:
    """Every figure from ``data`` into ``out``; returns the files written."""
    written = []
    for name in FIGURES:
        written += save(globals()[name](data), out, name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="sweep folders, run folders or records.csv files")
    parser.add_argument("--out", default="figures", help="output folder (default: figures)")
    args = parser.parse_args(argv)
    try:
        data = load_results(args.paths)
    except AnalysisError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    for path in make_figures(data, Path(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
