"""The paper's figures from result folders, as PNG and PDF.

    python -m analysis.figures multirun/rnn_seq_len multirun/rnn_batch --out figures/

Figures: 7 (RNN loss vs wall-clock), 8a-f (BPPSA backward runtime, backward speedup and runtime
breakdown against T and against B), 9 (GRU runtime breakdown, s/m/l x batch), 13 (GRU loss vs
wall-clock for s/m/l), and the scaling figures (backward runtime against the workers of a process,
and against ranks, the processes a sequence is split over; per device). Each
is drawn from whatever data is present; a panel without data says so. Runtimes are medians over
epochs of the per-iteration phase times.

One look throughout: BPTT and BPPSA keep one colour each in every figure (``METHOD_COLOURS``), the
phases one colour each, and a method is told apart by line style where colour means a phase;
every panel says what it holds fixed (B, T, the device), log axes read as plain numbers, and
legends sit beside the data, not on it (the loss curves' in their upper right corner, which the
falling curves leave empty). The loss curves start at t = 0, from each run's loss
before its first step.

Output is byte-for-byte reproducible from the same input: the Agg backend, no timestamps in the
PDF metadata, no software stamp in the PNGs, and a fixed bootstrap seed for the speedup intervals.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from analysis.data import (
    BACKWARD_COLUMNS,
    PHASES,
    AnalysisError,
    identity_columns,
    load_results,
    speedups,
    telling_apart,
)
from toolbox.cli import OneLineParser
from toolbox.errors import WriteError
from toolbox.files import nearest_folder, output_folder, write_atomic

sns.set_theme(style="whitegrid")  # every figure of the suite, fig. 10 included, in one style
plt.rcParams.update({"svg.hashsalt": "bppsa", "pdf.compression": 6})

PHASE_COLUMNS = {p: f"{p}_per_iter_s" for p in PHASES}  # the columns load_results adds
FIGURES = ("fig7", "fig8", "fig9", "fig13", "scaling", "ranks")
METHODS = ("bptt", "bppsa")
METHOD_LABELS = {"bptt": "BPTT", "bppsa": "BPPSA"}
METHOD_COLOURS = {"bptt": "#4C72B0", "bppsa": "#DD8452"}
METHOD_STYLES = {"bptt": "--", "bppsa": "-"}
PHASE_COLOURS = {"forward": "#55A868", "backward": "#C44E52", "step": "#8172B3"}
LINE_STYLES = ("-", "--", ":", "-.")
VARIANT = BACKWARD_COLUMNS[1:]  # a BPPSA run's strategy, chunk, levels and forward solver
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


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


def _configurations(rows: pd.DataFrame, given: Sequence[str]) -> list[str]:
    """The keys beside ``given`` that tell the runs of ``rows`` apart (their configuration's and
    BPPSA's variant, ``analysis.data.telling_apart``): a panel draws one line per their values, so
    no median is taken over two configurations."""
    return telling_apart(rows, given, [*identity_columns(rows), *VARIANT])


def key_text(value: object) -> str:
    """A key's value as plain as it reads (0.001, 2, chunked); '-' where the run did not set it."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "-"
    return _number(value) if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def _line_label(lines: Sequence[str], key: object) -> str:
    """A line's legend entry: its device, then its other keys ('H100, num_layers = 2')."""
    values = key if isinstance(key, tuple) else (key,)
    return ", ".join(p for p in (str(values[0]), _keys_text(lines[1:], values[1:])) if p)


def _keys_text(columns: Sequence[str], values: Sequence[object]) -> str:
    """'num_layers = 2, lr = 0.01' for a line's keys."""
    return ", ".join(f"{c} = {key_text(v)}" for c, v in zip(columns, values, strict=True))


def _matching(rows: pd.DataFrame, columns: Sequence[str], values: Sequence[object]) -> pd.Series:
    """Which rows hold ``values`` in ``columns``, an empty cell matching an empty value."""
    match = pd.Series(True, index=rows.index)
    for column, value in zip(columns, values, strict=True):
        match &= rows[column].isna() if pd.isna(value) else rows[column] == value
    return match


def _most_runs(rows: pd.DataFrame, given: Sequence[str]) -> tuple[pd.DataFrame, str]:
    """The rows of one configuration where ``rows`` hold several beside ``given``: the one with the
    most epoch rows (and of BPPSA's variants, the one with the most BPPSA rows; BPTT has none), for
    a figure that draws one; and its keys as text ('' where there was one)."""
    keys = _configurations(rows, given)
    config = [c for c in keys if c not in VARIANT]
    variant = [c for c in keys if c in VARIANT]
    picked: list[object] = []
    for columns, side in ((config, rows.index), (variant, rows.index[rows["backward"] == "bppsa"])):
        if not columns or side.empty:
            continue
        values = rows.loc[side].groupby(columns, dropna=False).size().idxmax()
        values = values if isinstance(values, tuple) else (values,)
        chosen = _matching(rows, columns, values)
        rows = rows[chosen | (~rows.index.isin(side))]  # a variant leaves BPTT's rows as they are
        picked += zip(columns, values, strict=True)
    return rows, _keys_text([c for c, _ in picked], [v for _, v in picked])


def _number(value: float, _pos: object = None) -> str:
    """A tick label as a plain number: 8, 0.001, 2000; never 8×10⁰."""
    return f"{value:g}"


_FINE = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)


def _log_axis(axis, base: int = 10) -> None:
    """A log axis whose ticks read as plain numbers: powers of ``base``, and for 10 the 2s and 5s
    between (the powers alone where the axis spans more than three decades, so labels do not
    collide), or finer steps where it spans less than a decade."""
    low, high = sorted(axis.get_view_interval())
    ratio = high / low if low > 0 else float("inf")
    subs = (1.0, 2.0, 5.0) if ratio >= 10 else (1.0, 2.0, 3.0, 5.0, 7.0) if ratio >= 3 else _FINE
    subs = (1.0,) if ratio > 1e3 else subs
    subs = (1.0,) if base == 2 else subs
    axis.set_major_locator(LogLocator(base=base, subs=subs))
    axis.set_major_formatter(FuncFormatter(_number))
    axis.set_minor_formatter(NullFormatter())


def _log_log(ax: plt.Axes, xbase: int = 10) -> None:
    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    _log_axis(ax.xaxis, xbase)
    _log_axis(ax.yaxis)


def _legend_beside(ax: plt.Axes, **kwargs) -> None:
    """The axes' legend to the right of the plot, clear of the data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, **kwargs)


def _one_value(rows: pd.DataFrame, column: str) -> str | None:
    """The column's value when the rows share one, for a title; else None."""
    values = rows[column].dropna().unique() if column in rows.columns else []
    return _number(values[0]) if len(values) == 1 and not isinstance(values[0], str) else None


def _fixed(rows: pd.DataFrame, *columns: tuple[str, str]) -> str:
    """'T = 1000, B = 16' for the (column, symbol) pairs the rows hold fixed."""
    parts = [f"{symbol} = {v}" for column, symbol in columns if (v := _one_value(rows, column)) is not None]
    return ", ".join(parts)


def _devices(rows: pd.DataFrame) -> str:
    names = sorted(rows["device_name"].dropna().astype(str).unique())
    return ", ".join(names) if names else "unknown device"


def _loss_curves(ax: plt.Axes, rows: pd.DataFrame) -> None:
    """Training loss against cumulative training time, one line per run, from t = 0 (figs. 7, 13).

    Colour: the method (BPTT, BPPSA); line style and marker: the configuration (T, B, and any other
    key that tells runs apart), so runs of different lengths or batch sizes read apart; the legend
    names both.
    """
    keys = ["seq_len", "batch_size", *_configurations(rows, ["backward", "seq_len", "batch_size"])]
    style = rows.groupby(keys, dropna=False, sort=True).ngroup()  # one per configuration
    run = "run_path" if "run_path" in rows.columns else "run"  # one line per run folder
    for _, part in rows.sort_values("epoch").groupby(run, sort=True):
        method = part["backward"].iloc[0]
        config = tuple(part[keys].iloc[0])
        k = int(style[part.index[0]])
        wall, loss = part["wall_s"].tolist(), part["loss"].tolist()
        if "initial_loss" in part.columns and pd.notna(part["initial_loss"].iloc[0]):
            wall, loss = [0.0, *wall], [float(part["initial_loss"].iloc[0]), *loss]
        label = f"{METHOD_LABELS.get(method, method)}, T = {_number(config[0])}, B = {_number(config[1])}"
        label += f", {_keys_text(keys[2:], config[2:])}" if len(keys) > 2 else ""
        ax.plot(
            wall,
            loss,
            color=METHOD_COLOURS.get(method, "gray"),
            linestyle=LINE_STYLES[k % len(LINE_STYLES)],
            marker=MARKERS[k % len(MARKERS)],
            markersize=3,
            label=label,
        )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))  # one entry per (method, configuration)
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
    ax.set_xlim(left=0)
    ax.set_xlabel("wall-clock training time (s)")
    ax.set_ylabel("training loss")


def fig7(data: pd.DataFrame) -> plt.Figure:
    """Training loss against wall-clock time, RNN, BPTT vs BPPSA."""
    rnn = _pick(data[data["model"] == "rnn"], "rnn_curve")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if rnn.empty:
        _no_data(ax, "no RNN runs (experiment=rnn_curve)")
        ax.set_title("Fig. 7: RNN training loss vs wall-clock time")
    else:
        _loss_curves(ax, rnn)
        ax.set_title(f"Fig. 7: RNN training loss vs wall-clock time ({_devices(rnn)})", fontsize=10)
    fig.tight_layout()
    return fig


def _runtime_panel(ax: plt.Axes, rows: pd.DataFrame, x: str, label: str) -> None:
    bppsa = rows[rows["backward"] == "bppsa"]
    if bppsa[x].nunique() < 2:
        _no_data(ax, f"BPPSA runs at 2+ values of {label}")
        return
    lines = ["device_name", *_configurations(bppsa, [x, "device_name"])]
    med = _medians(bppsa, [x, *lines])
    for k, (key, part) in enumerate(med.sort_values(x).groupby(lines, sort=True, dropna=False)):
        ax.plot(
            part[x],
            part["backward_per_iter_s"],
            color=METHOD_COLOURS["bppsa"],
            linestyle=LINE_STYLES[k % len(LINE_STYLES)],
            marker=MARKERS[k % len(MARKERS)],
            label=_line_label(lines, key),
        )
    _log_log(ax, 2 if x == "batch_size" else 10)
    ax.set_xlabel(label)
    ax.set_ylabel("BPPSA backward per iteration (s)")
    _legend_beside(ax, title="device" + (", configuration" if len(lines) > 1 else ""))


def _speedup_panel(ax: plt.Axes, rows: pd.DataFrame, x: str, label: str) -> None:
    table = speedups(rows) if not rows.empty else pd.DataFrame()
    if table.empty or table[x].nunique() < 2:
        _no_data(ax, f"BPTT and BPPSA runs at 2+ values of {label}")
        return
    lines = ["device_name", *_configurations(table, [x, "device_name"])]
    for k, (key, part) in enumerate(table.sort_values(x).groupby(lines, sort=True, dropna=False)):
        spread = part[["backward_lo", "backward_hi"]].notna().all(axis=1)
        low = (part["backward_speedup"] - part["backward_lo"]).where(spread, 0.0)
        high = (part["backward_hi"] - part["backward_speedup"]).where(spread, 0.0)
        ax.errorbar(
            part[x],
            part["backward_speedup"],
            yerr=[low, high],
            color=METHOD_COLOURS["bppsa"],
            linestyle=LINE_STYLES[k % len(LINE_STYLES)],
            marker=MARKERS[k % len(MARKERS)],
            capsize=3,
            label=_line_label(lines, key),
        )
    ax.axhline(1.0, linestyle="--", color="gray", linewidth=1)
    _log_log(ax, 2 if x == "batch_size" else 10)
    ax.set_xlabel(label)
    ax.set_ylabel("backward speedup (BPTT / BPPSA)")
    _legend_beside(ax, title="device" + (", configuration" if len(lines) > 1 else ""))


def _breakdown_panel(ax: plt.Axes, rows: pd.DataFrame, x: str, label: str) -> str | None:
    """Per-iteration time of each phase (colour) for each method (line style), on the device with
    the most runs and of its configuration with the most (``_most_runs``); returns their names."""
    if rows[x].nunique() < 2:
        _no_data(ax, f"runs at 2+ values of {label}")
        return None
    device = rows["device_name"].value_counts().idxmax()
    on, config = _most_runs(rows[rows["device_name"] == device], [x, "backward"])
    med = _medians(on, [x, "backward"]).sort_values(x)
    for phase, column in PHASE_COLUMNS.items():
        for method in METHODS:
            part = med[med["backward"] == method]
            if not part.empty:
                ax.plot(
                    part[x],
                    part[column],
                    color=PHASE_COLOURS[phase],
                    linestyle=METHOD_STYLES[method],
                    marker="o",
                    markersize=3,
                    label=f"{phase}, {METHOD_LABELS[method]}",
                )
    _log_log(ax, 2 if x == "batch_size" else 10)
    ax.set_xlabel(label)
    ax.set_ylabel("time per iteration (s)")
    _legend_beside(ax, title="phase, method")
    return ", ".join(p for p in (str(device), config) if p)


def fig8(data: pd.DataFrame) -> plt.Figure:
    """Panels a-f: BPPSA backward runtime, backward speedup, runtime breakdown; against T and B."""
    rnn = data[data["model"] == "rnn"]
    by_t = _sweep(_pick(rnn, "rnn_seq_len"), "seq_len", "batch_size")
    by_b = _sweep(_pick(rnn, "rnn_batch"), "batch_size", "seq_len")
    fig, axes = plt.subplots(3, 2, figsize=(13, 12))
    titles = {
        0: "BPPSA backward per iteration",
        1: "backward speedup of BPPSA over BPTT",
        2: "runtime breakdown",
    }
    for col, (rows, x, label, fixed) in enumerate(
        (
            (by_t, "seq_len", "sequence length T", ("batch_size", "B")),
            (by_b, "batch_size", "batch size B", ("seq_len", "T")),
        )
    ):
        _runtime_panel(axes[0, col], rows, x, label)
        _speedup_panel(axes[1, col], rows, x, label)
        device = _breakdown_panel(axes[2, col], rows, x, label)
        held = _fixed(rows, fixed) if not rows.empty else ""
        for row in range(3):
            letter = "abcdef"[2 * row + col]
            where = ", ".join(p for p in (held, device if row == 2 else None) if p)
            axes[row, col].set_title(
                f"Fig. 8{letter}: {titles[row]}" + (f" ({where})" if where else ""), loc="left", fontsize=10
            )
    fig.tight_layout()
    return fig


def fig9(data: pd.DataFrame) -> plt.Figure:
    """GRU runtime breakdown per iteration, feature setting x batch size, BPTT and BPPSA."""
    gru = _pick(data[data["model"] == "gru"], "gru_irmas")
    if gru.empty:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        _no_data(ax, "no GRU runs (experiment=gru_irmas)")
        ax.set_title("Fig. 9: GRU runtime breakdown")
        return fig
    device = gru["device_name"].value_counts().idxmax()
    gru = gru[gru["device_name"] == device].assign(frames=gru["frames"].fillna("?"))
    gru, config = _most_runs(gru, ["frames", "batch_size", "backward"])  # one configuration's bars
    med = _medians(gru, ["frames", "batch_size", "backward"])
    med["order"] = med["frames"].map({"s": 0, "m": 1, "l": 2})  # the paper's order, not the alphabet's
    med = med.sort_values(["order", "batch_size", "backward"]).reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(med) + 2.5), 5))
    positions, previous, x = [], None, 0.0
    for r in med.itertuples():  # a gap between the (setting, batch) groups
        group = (r.frames, r.batch_size)
        x += 1.0 if previous in (None, group) else 1.6
        positions.append(x)
        previous = group
    labels = [
        f"{r.frames}, B={r.batch_size}\n{METHOD_LABELS.get(r.backward, r.backward)}" for r in med.itertuples()
    ]
    bottom = pd.Series(0.0, index=med.index)
    for phase, column in PHASE_COLUMNS.items():
        ax.bar(positions, med[column], bottom=bottom, width=0.8, color=PHASE_COLOURS[phase], label=phase)
        bottom = bottom + med[column].fillna(0)
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_xlim(positions[0] - 0.8, positions[-1] + 0.8)
    ax.set_ylabel("time per iteration (s)")
    ax.set_xlabel("feature setting, batch size, method")
    _legend_beside(ax, title="phase")
    where = ", ".join(p for p in (str(device), config) if p)
    ax.set_title(f"Fig. 9: GRU runtime breakdown per iteration ({where})", fontsize=10)
    fig.tight_layout()
    return fig


def fig13(data: pd.DataFrame) -> plt.Figure:
    """GRU training loss against wall-clock time, one panel per feature setting."""
    gru = _pick(data[data["model"] == "gru"], "gru_curves")
    settings = [s for s in ("s", "m", "l") if (gru["frames"] == s).any()] or ["s", "m", "l"]
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4.5), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        rows = gru[gru["frames"] == setting]
        if rows.empty:
            _no_data(ax, f"no GRU runs with frames={setting}")
        else:
            _loss_curves(ax, rows)
        ax.set_title(f"Fig. 13 ({setting})" + (f": {_devices(rows)}" if not rows.empty else ""), fontsize=10)
    fig.tight_layout()
    return fig


def scaling(data: pd.DataFrame) -> plt.Figure:
    """BPTT and BPPSA backward per iteration against the number of workers of one process, per device."""
    rows = _pick(data, "workers").dropna(subset=["workers_used"])
    return _backward_against(
        _sweep(rows[rows["ranks"] == 1], "workers_used", "seq_len"),
        "workers_used",
        "workers p (CPU threads or GPU SMs)",
        "Scaling with workers",
        "runs at 2+ worker counts (experiment=workers)",
    )


def ranks(data: pd.DataFrame) -> plt.Figure:
    """BPTT and BPPSA backward per iteration against the number of ranks (processes, each holding
    a time slice of the sequence: the paper's p devices), per device and workers per rank."""
    return _backward_against(
        _sweep(_pick(data, "workers"), "ranks", "seq_len"),
        "ranks",
        "ranks p (processes, one time slice each)",
        "Scaling with ranks",
        "runs at 2+ rank counts (experiment=workers hardware.ranks=1,2)",
        per_rank=True,
    )


def _backward_against(
    rows: pd.DataFrame, x: str, xlabel: str, title: str, missing: str, per_rank: bool = False
) -> plt.Figure:
    """Backward per iteration against ``x``: one line per method and device (and workers per rank)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if rows[x].nunique() < 2:
        _no_data(ax, missing)
    else:
        lines = ["backward", "device_name", *(["workers_used"] if per_rank else [])]
        extra = _configurations(rows, [x, *lines])
        med = _medians(rows, [x, *lines, *extra]).sort_values(x)
        for k, (key, part) in enumerate(med.groupby([*lines, *extra], sort=True, dropna=False)):
            method, device = key[0], key[1]
            label = f"{METHOD_LABELS.get(method, method)}, {device}"
            label += f", {key[2]:g} per rank" if per_rank else ""
            label += f", {_keys_text(extra, key[len(lines) :])}" if extra else ""
            ax.plot(
                part[x],
                part["backward_per_iter_s"],
                color=METHOD_COLOURS.get(method, "gray"),
                linestyle=METHOD_STYLES.get(method, "-"),
                marker=MARKERS[k % len(MARKERS)],
                label=label,
            )
        _log_log(ax, 2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("backward per iteration (s)")
        keys = ["method, device", *(["workers"] if per_rank else []), *(["configuration"] if extra else [])]
        _legend_beside(ax, title=", ".join(keys))
        held = _fixed(rows, ("seq_len", "T"), ("batch_size", "B"))
        title += f" ({held})" if held else ""
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


# Each figure's formats and their savefig options: no timestamp or version stamp in either.
SAVED = {
    "png": {"dpi": 150, "metadata": {"Software": None}},
    "pdf": {"metadata": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None}},
}


def save(fig: plt.Figure, out: Path, name: str) -> list[Path]:
    """PNG and PDF, without timestamps or version stamps, so equal input gives equal bytes; each
    written whole or not at all (``write_atomic``: a killed run leaves no truncated figure)."""
    paths = []
    try:
        for kind, options in SAVED.items():
            paths.append(out / f"{name}.{kind}")
            write_atomic(
                paths[-1], lambda tmp, k=kind, o=options: fig.savefig(tmp, format=k, bbox_inches="tight", **o)
            )
    finally:
        plt.close(fig)
    return paths


def make_figures(data: pd.DataFrame, out: Path) -> list[Path]:
    """Every figure from ``data`` into ``out``; returns the files written."""
    written = []
    for name in FIGURES:
        written += save(globals()[name](data), out, name)
    return written


def made_folder(out: Path) -> Path:
    """``out``, made if missing; AnalysisError naming it where it cannot be. ``output_folder`` asks
    for write permission, which a superuser has also where no folder can be made (/proc, /sys)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AnalysisError(
            f"cannot make {out} in {nearest_folder(out)} ({exc.strerror or exc}); "
            "accepted: a folder (made if missing) where files can be written"
        ) from None
    return out


def output_made(parser: OneLineParser, out: Path) -> Path:
    """``out`` made (``made_folder``) before anything is written in it, or the parser's one-line
    refusal of ``--out`` (exit status 2), as for any other bad argument."""
    try:
        return made_folder(out)
    except AnalysisError as exc:
        parser.error(f"argument --out: {exc}")


def tell_notes(prog: str, data: pd.DataFrame) -> None:
    """Each note of ``load_results`` (what a sweep's reading added, replaced or skipped) as a line on
    stderr, so that nothing is left out unseen."""
    for note in data.attrs.get("notes", []):
        print(f"{prog}: {note}", file=sys.stderr)


def results_main(
    prog: str,
    description: str,
    default_out: str,
    make: Callable[[list[str], Path, pd.DataFrame], Iterable[Path]],
    argv: Sequence[str] | None,
) -> int:
    """The command line of a tool that reads sweeps' results and writes into ``--out``: the results
    read (an unreadable one refused in one line, exit status 2, before ``--out`` is made), their
    notes told, then ``make(paths, out, data)``'s files printed one a line."""
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument("paths", nargs="+", help="sweep folders, run folders or records.csv files")
    parser.add_argument("--out", type=output_folder, default=default_out, help="output folder")
    parser.add_argument(
        "--keep-contended", action="store_true", help="keep epochs measured while the machine was busy"
    )
    args = parser.parse_args(argv)
    try:
        data = load_results(args.paths, args.keep_contended)
    except AnalysisError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    out = output_made(parser, Path(args.out))
    tell_notes(parser.prog, data)
    return print_written(parser.prog, lambda: make(args.paths, out, data))


def print_written(prog: str, write: Callable[[], Iterable[Path]]) -> int:
    """``write()``'s files printed one a line (status 0), or the one line of a write that failed
    (status 1: a full disk, say; each file is whole or absent)."""
    try:
        written = write()
    except WriteError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return results_main(
        "python -m analysis.figures",
        __doc__.split("\n\n")[0],
        "figures",
        lambda _paths, out, data: make_figures(data, out),
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
