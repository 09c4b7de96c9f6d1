"""A Markdown report of a set of results: the speedup table, the figures, and their provenance.

    python -m analysis.report multirun/rnn_seq_len multirun/rnn_batch --out report/

Writes ``report.md``, ``speedups.csv`` (its table) and the figures beside them: per (configuration,
device), the overall and the backward speedup of BPPSA over BPTT as medians with a 95 % bootstrap
interval (see ``analysis.data``), then every figure, then the git commits and versions the results came from.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from analysis.data import AnalysisError, load_results, provenance, speedups
from analysis.figures import FIGURES, make_figures
from toolbox.cli import OneLineParser
from toolbox.files import output_folder


def speedup_markdown(table: pd.DataFrame) -> str:
    """The speedup table as Markdown: one row per configuration and device."""
    if table.empty:
        return "_No configuration has both a BPTT and a BPPSA run yet._"
    head = ["model", "dataset", "frames", "T", "B", "device (ranks)", "BPPSA"]
    head += ["overall speedup", "backward speedup", "epochs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.itertuples():
        frames = r.frames if isinstance(r.frames, str) else "-"
        cells = [
            r.model,
            r.dataset,
            frames,
            str(int(r.seq_len)),
            str(int(r.batch_size)),
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


def write_report(paths: Sequence[str | Path], out: Path, keep_contended: bool = False) -> Path:
    data = load_results(paths, keep_contended)
    out.mkdir(parents=True, exist_ok=True)
    make_figures(data, out)
    table = speedups(data)
    origin = provenance(paths, data)
    parts = [
        "# BPPSA results",
        "Sources: " + ", ".join(f"`{p}`" for p in paths),
        "## Speedups of BPPSA over BPTT",
        "Median over epochs, 95 % bootstrap interval in brackets; overall = epoch time, backward = "
        "backward time per iteration (BPPSA's Jacobian building included); epochs = BPTT / BPPSA.",
        speedup_markdown(table),
        *_contention_note(data),
        "## Figures",
        *[f"![{name}]({name}.png) ([PDF]({name}.pdf))" for name in FIGURES],
        "## Provenance",
        "Commits: " + (", ".join(origin["commits"]) or "unknown"),
        "Versions: " + ("; ".join(origin["versions"]) or "unknown"),
    ]
    report = out / "report.md"
    report.write_text("\n\n".join(parts) + "\n")
    table.to_csv(out / "speedups.csv", index=False)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m analysis.report",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("paths", nargs="+", help="sweep folders, run folders or records.csv files")
    parser.add_argument("--out", type=output_folder, default="report", help="output folder")
    parser.add_argument(
        "--keep-contended", action="store_true", help="keep epochs measured while the machine was busy"
    )
    args = parser.parse_args(argv)
    try:
        report = write_report(args.paths, Path(args.out), args.keep_contended)
    except AnalysisError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
