"""docs/REPRODUCTION.md: its tables are complete runs of both methods, its figures are drawn from
them reproducibly, and every file it shows exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from helpers import ROOT

from analysis import fig10, report

HERE = ROOT / "docs" / "reproduction"
PRESETS = ("rnn_seq_len", "rnn_batch", "rnn_curve", "workers", "gru_irmas", "gru_curves")


@pytest.mark.parametrize("preset", PRESETS)
def test_each_committed_table_holds_completed_runs_of_both_methods(preset: str) -> None:
    table = pd.read_csv(HERE / f"{preset}.csv")
    assert set(table["name"]) == {preset}
    assert set(table["backward"]) == {"bppsa", "bptt"}
    runs = table.groupby("run")["epoch"].max()
    assert (runs >= 3).all() and len(runs) % 2 == 0
    assert not table["contended"].any()


def test_the_figures_are_drawn_from_the_committed_tables_byte_for_byte(tmp_path: Path) -> None:
    tables = [str(HERE / f"{p}.csv") for p in PRESETS]
    for out in ("a", "b"):
        assert report.main([*tables, "--out", str(tmp_path / out)]) == 0
        assert fig10.main([str(HERE / "fig10_products.csv"), "--out", str(tmp_path / out)]) == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    expected = {"fig7.png", "fig8.png", "fig9.png", "fig10.png", "fig13.png", "scaling.png", "report.md"}
    assert expected <= set(names)
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert (HERE / name).is_file(), f"{name} is drawn but not committed"


def test_every_file_the_report_shows_or_names_exists() -> None:
    text = (ROOT / "docs" / "REPRODUCTION.md").read_text()
    shown = re.findall(r"\]\((reproduction/[^)]+)\)", text)
    assert len(shown) >= 7
    for path in shown:
        assert (ROOT / "docs" / path).is_file(), path


def test_the_script_refuses_an_unknown_argument_in_one_line() -> None:
    done = subprocess.run(
        ["bash", str(HERE / "run.sh"), "--fast"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "run.sh: unknown argument --fast; accepted: --draw, --device cpu|cuda"
