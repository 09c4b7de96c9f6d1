"""A Markdown report of a set of results: the speedup table, the figures, and their provenance.

    python -m analysis.report multirun/rnn_seq_len multirun/rnn_batch --out report/

Writes ``report.md``, ``speedups.csv`` (its table) and the figures beside them: per (configuration,
device), the overall and the backward speedup of BPPSA over BPTT as medians with a 95 % bootstrap
interval (see ``analysis.data``), then every figure, then the git commits and versions the results came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from analysis.data import (
    BACKWARD_COLUMNS,
    identity_columns,
    load_results,
    provenance,
    speedups,
    telling_apart,
)
from analysis.figures import FIGURES, key_text, made_folder, make_figures, results_main
from toolbox.files import write_atomic

# What every row of the table shows: its configuration's main keys, its device and its BPPSA variant.
ALWAYS = ("model", "dataset", "frames", "seq_len", "batch_size", "device_name", "ranks")
VARIANT = BACKWARD_COLUMNS[1:]


def distinguishing(table: pd.DataFrame) -> list[str]:
    """The columns beside the always shown ones that ``table``'s rows need to be told apart: every
    key that varies among rows alike in what is shown (``analysis.data.telling_apart``); then the
    name of the sweep a row came from, and last its comparison key: a difference no column names."""
    candidates = [*identity_columns(table), "name", "comparison_key"]
    return telling_apart(table, [c for c in (*ALWAYS, *VARIANT) if c in table.columns], candidates)


def speedup_markdown(table: pd.DataFrame) -> str:
    """The speedup table as Markdown: one row per configuration and device, with a column for
    every key that tells two rows apart (``distinguishing``), so no two rows read alike."""
    if table.empty:
        return "_No configuration has both a BPTT and a BPPSA run yet._"
    extra = distinguishing(table)
    head = ["model", "dataset", "frames", "T", "B", *(c.replace("_", " ") for c in extra)]
    head += ["device (ranks)", "BPPSA", "overall speedup", "backward speedup", "epochs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.itertuples():
        frames = r.frames if isinstance(r.frames, str) else "-"
        cells = [
            r.model,
            r.dataset,
            frames,
            str(int(r.seq_len)),
            str(int(r.batch_size)),
            *(key_text(getattr(r, c)) for c in extra),
            str(r.device_name) + (f", {int(r.ranks)} ranks" if getattr(r, "ranks", 1) > 1 else ""),
            _variant(r),
            _speedup_cell(r, "overall"),
            _speedup_cell(r, "backward"),
            f"{r.epochs_bptt} / {r.epochs_bppsa}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _contention_note(data: pd.DataFrame) -> list[str]:
    """A line saying how many epochs were left out because the machine was busy, if any were."""
    dropped = data.attrs.get("contended_epochs", 0)
    if not dropped:
        return []
    return [
        f"{dropped} epoch(s) measured while other work kept the machine busy are left out of the table "
        "and the figures (`--keep-contended` keeps them)."
    ]


# Settings of how a run ran (not what): said once where every run shares them, since a column that
# does not vary is left out of the table.
SHARED_SETTINGS = {
    "flush_denormals": "Every run trained with subnormal numbers flushed to zero, BPTT's autograd included "
    "(`hardware.flush_denormals=true`).",
    "capture": "Every run's training steps were captured in CUDA graphs and replayed "
    "(`trainer.capture=true`).",
}


def _shared_settings_note(data: pd.DataFrame) -> list[str]:
    """A line for each of ``SHARED_SETTINGS`` that every run of ``data`` had on."""
    return [
        line
        for column, line in SHARED_SETTINGS.items()
        if column in data.columns and len(data) and data[column].astype(str).eq("True").all()
    ]


def _speedup_cell(row, label: str) -> str:
    """A speedup with its interval; or the speedup and why there is no interval; or why there is none."""
    speedup, note = getattr(row, f"{label}_speedup"), getattr(row, f"{label}_note", None)
    if pd.isna(speedup):
        return f"n/a: {note}"
    lo, hi = getattr(row, f"{label}_lo"), getattr(row, f"{label}_hi")
    if pd.isna(lo):
        return f"{speedup:.2f}× ({note})"
    return f"{speedup:.2f}× [{lo:.2f}, {hi:.2f}]"


def _variant(row) -> str:
    """The BPPSA side of a comparison: its strategy, chunk and levels where set, and a forward
    solver other than the native one."""
    parts = [str(getattr(row, "strategy", "")) if pd.notna(getattr(row, "strategy", None)) else "-"]
    for key in ("chunk", "levels"):
        value = getattr(row, key, None)
        if value is not None and pd.notna(value):
            parts.append(f"{key} {int(value)}")
    solver = getattr(row, "forward_solver", None)
    if isinstance(solver, str) and solver != "native":
        parts.append(f"{solver} forward")
    return ", ".join(parts)


def write_report(
    paths: Sequence[str | Path], out: Path, keep_contended: bool = False, data: pd.DataFrame | None = None
) -> Path:
    """``report.md``, ``speedups.csv`` and the figures of the results under ``paths``, into ``out``;
    ``data``: those results, where ``load_results`` has read them already."""
    data = load_results(paths, keep_contended) if data is None else data
    made_folder(out)
    make_figures(data, out)
    table = speedups(data)
    origin = provenance(paths, data)
    parts = [
        "# BPPSA results",
        "Sources: " + ", ".join(f"`{p}`" for p in paths),
        *[f"Read: {note}." for note in data.attrs.get("notes", [])],
        "## Speedups of BPPSA over BPTT",
        "Median over epochs, 95 % bootstrap interval in brackets; overall = epoch time, backward = "
        "backward time per iteration (BPPSA's Jacobian building included); epochs = BPTT / BPPSA.",
        speedup_markdown(table),
        *_shared_settings_note(data),
        *_contention_note(data),
        "## Figures",
        *[f"![{name}]({name}.png) ([PDF]({name}.pdf))" for name in FIGURES],
        "## Provenance",
        "Commits: " + (", ".join(origin["commits"]) or "unknown"),
        "Versions: " + ("; ".join(origin["versions"]) or "unknown"),
    ]
    report = out / "report.md"
    write_atomic(out / "speedups.csv", lambda tmp: table.to_csv(tmp, index=False))
    write_atomic(report, lambda tmp: tmp.write_text("\n\n".join(parts) + "\n"))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    return results_main(
        "python -m analysis.report",
        __doc__.split("\n\n")[0],
        "report",
        lambda paths, out, data: [write_report(paths, out, data=data)],
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
