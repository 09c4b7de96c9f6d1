"""What the schemes' estimates become: the table of times (``markdown``), the figure of time per
iteration against p with the pipelines' Gantt charts (``figure``), and the files (``write``:
schemes.csv, schemes.md, schemes.png / .pdf, byte for byte reproducible); ``load_measured`` reads
the measured iterations drawn beside the model."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from analysis.data import (
    AnalysisError,
    finite_at_least_zero,
    read_table,
    require,
    require_rows,
    whole_at_least,
)
from analysis.figures import plt
from analysis.schemes.schedule import Task
from analysis.schemes.schemes import SCHEMES, Estimate

KIND_COLOURS = {"F": "#55A868", "B": "#C44E52", "A": "#C44E52", "W": "#8172B3"}  # the phases' colours
KIND_LABELS = {"F": "forward", "B": "backward", "A": "input gradient", "W": "weight gradient"}


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value * 1e3:.3g}" if value * 1e3 < 1000 else f"{value * 1e3:,.0f}"


def markdown(frame: pd.DataFrame, compare: pd.DataFrame | None, header: str) -> str:
    """The table of times per iteration (ms), schemes by p, the reasons for the empty cells, and
    LayerPipe against PipeDream."""
    ps = sorted(frame["p"].unique())
    lines = [header, "", "Time per iteration (ms):", ""]
    lines += ["| scheme | " + " | ".join(f"p = {p}" for p in ps) + " |", "|---|" + "---:|" * len(ps)]
    for scheme, rows in frame.groupby("scheme", sort=False):
        cells = [_ms(rows.loc[rows["p"] == p, "time"].iloc[0]) for p in ps]
        lines.append(f"| {SCHEMES[scheme].label} | " + " | ".join(cells) + " |")
    notes = frame[frame["note"] != ""]
    if not notes.empty:
        lines += ["", "Empty cells:"]
        for scheme, rows in notes.groupby("scheme", sort=False):
            lines.append(f"- {SCHEMES[scheme].label}: " + "; ".join(rows["note"]))
    if compare is not None and not compare.empty:
        lines += ["", "LayerPipe against PipeDream (1F1B), the same micro-batches:", ""]
        lines += ["| p | PipeDream (ms) | LayerPipe (ms) | LayerPipe's saving |", "|---:|---:|---:|---:|"]
        for r in compare.itertuples():
            lines.append(f"| {r.p} | {_ms(r.pipedream)} | {_ms(r.layerpipe)} | {r.saving:.1%} |")
        lines.append(f"\nMean saving: {compare['saving'].mean():.0%}.")
    return "\n".join(lines) + "\n"


def load_measured(path: str | Path) -> pd.DataFrame:
    """Measured iterations to draw beside the model: a CSV with the columns scheme, p and time
    (seconds per iteration), as ``python -m benchmarks.schemes`` writes it."""
    path = Path(path)
    if not path.is_file():
        raise AnalysisError(f"no measured table at {str(path)!r}; run python -m benchmarks.schemes first")
    data = read_table(path, ("scheme", "p", "time"), ("p", "time"))
    require_rows(data, path, "the measured iterations of python -m benchmarks.schemes")
    require(data, path, ("p",), whole_at_least(1), "a whole number >= 1")
    require(data, path, ("time",), finite_at_least_zero, "a finite number >= 0")
    require(data, path, ("scheme",), lambda v: v.notna(), "a scheme's name")
    unknown = sorted(set(data["scheme"]) - set(SCHEMES))
    if unknown:
        raise AnalysisError(
            f"{path} names unknown schemes {', '.join(unknown)}; accepted: {', '.join(SCHEMES)}"
        )
    return data


def gantt(
    ax, tasks: Sequence[Task] | None, title: str, window: tuple[int, int] = (1, 2), why: str = ""
) -> None:
    """One schedule, processors as rows, the tasks of iterations ``window`` drawn (a lighter shade
    for the second), time from the first of them; ``why`` there is none when ``tasks`` is empty."""
    from analysis.figures import _no_data

    ax.set_title(title, fontsize=10)
    if not tasks:
        _no_data(ax, why.replace(" exceeds", "\nexceeds"))
        return
    shown = [t for t in tasks if window[0] <= t.iteration <= window[1]]
    origin = min(t.start for t in shown)
    for t in shown:
        ax.barh(
            t.proc,
            (t.end - t.start) * 1e3,
            left=(t.start - origin) * 1e3,
            height=0.8,
            color=KIND_COLOURS[t.kind],
            alpha=1.0 if t.iteration == window[0] else 0.5,
            linewidth=0,
        )
    ax.set_yticks(range(max(t.proc for t in shown) + 1))
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("processor")
    ax.grid(axis="y", visible=False)


def figure(
    frame: pd.DataFrame, schedules: Sequence[Estimate], measured: pd.DataFrame | None, title: str
) -> plt.Figure:
    """Time per iteration against p, one line per scheme (measured iterations as crosses), and
    below it the pipelines' ``schedules`` as Gantt charts."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from analysis.figures import MARKERS, _legend_beside, _log_log

    fig = plt.figure(figsize=(14, 9 if schedules else 5.4))
    grid_spec = fig.add_gridspec(2 if schedules else 1, 3, height_ratios=[1.5, 1.0] if schedules else [1.0])
    ax = fig.add_subplot(grid_spec[0, :])
    colours = {s: f"C{i}" for i, s in enumerate(SCHEMES)}
    top = _ceiling(frame, measured)
    for i, (scheme, rows) in enumerate(frame.groupby("scheme", sort=False)):
        rows = rows.dropna(subset=["time"])
        if rows.empty:
            continue
        label = SCHEMES[scheme].label
        above = rows[rows["time"] > top]
        if not above.empty:
            label += f" (off the chart from p = {above['p'].min()}: {_seconds(above['time'].iloc[0])})"
        ax.plot(
            rows["p"],
            rows["time"],
            marker=MARKERS[i % len(MARKERS)],
            color=colours[scheme],
            linestyle="-" if scheme.startswith("bppsa") else "--",
            label=label,
            markersize=5,
        )
    if measured is not None:
        for scheme, rows in measured.groupby("scheme", sort=True):
            ax.scatter(
                rows["p"],
                rows["time"],
                marker="X",
                s=110,
                color=colours[scheme],
                edgecolors="black",
                zorder=5,
                label=f"measured: {SCHEMES[scheme].label}",
            )
    if top is not None:
        ax.set_yscale("log")
        ax.set_ylim(top=top)  # before the ticks are chosen, which look at the visible range
    _log_log(ax, xbase=2)
    ax.set_xlabel("processors p")
    ax.set_ylabel("time per iteration (s)")
    ax.set_title(textwrap.fill(title, 130), fontsize=10)
    _legend_beside(ax)
    for col, est in enumerate(schedules[:3]):
        label = f"{SCHEMES[est.scheme].label}, p = {est.p}" + (f": {est.detail}" if est.detail else "")
        gantt(fig.add_subplot(grid_spec[1, col]), est.tasks, label, why=est.note)
    if schedules:
        handles = [Patch(color=KIND_COLOURS[k], label=KIND_LABELS[k]) for k in ("F", "B", "W")]
        handles.append(Line2D([], [], color="gray", alpha=0.5, linewidth=6, label="the next iteration"))
        fig.axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def _ceiling(frame: pd.DataFrame, measured: pd.DataFrame | None) -> float | None:
    """The top of the time axis: 20 times sequential BP's time, so that a scheme orders of
    magnitude slower (BPPSA's dense aggregates of a CNN) leaves the chart, named in the legend,
    instead of flattening every other line; None when nothing is that slow."""
    times = pd.concat([frame["time"], measured["time"]] if measured is not None else [frame["time"]]).dropna()
    sequential = frame.loc[frame["scheme"] == "sequential", "time"].dropna()
    if sequential.empty or times.max() <= 20 * sequential.max():
        return None
    return 20 * float(sequential.max())


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 1e4 else f"{value:.2e} s"


def write(
    out: Path, frame: pd.DataFrame, compare: pd.DataFrame | None, header: str, drawn: plt.Figure
) -> tuple[str, list[Path]]:
    """The table (schemes.csv), its Markdown (schemes.md) and the figure (schemes.png and .pdf) in
    ``out``: the Markdown's text and the paths written."""
    from analysis.figures import save

    out.mkdir(parents=True, exist_ok=True)
    text = markdown(frame, compare, header)
    frame.to_csv(out / "schemes.csv", index=False)
    (out / "schemes.md").write_text(text)
    return text, [out / "schemes.csv", out / "schemes.md", *save(drawn, out, "schemes")]
