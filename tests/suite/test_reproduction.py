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
# Each committed table and the experiment preset its runs come from (the ranks table is the workers
# preset over processes).
TABLES = {
    "rnn_seq_len": "rnn_seq_len",
    "rnn_batch": "rnn_batch",
    "rnn_curve": "rnn_curve",
    "workers": "workers",
    "ranks": "workers",
    "gru_irmas": "gru_irmas",
    "gru_curves": "gru_curves",
}
# What run.sh --draw writes: text, compared with the committed files byte for byte, and figures.
TEXT = ("report.md", "speedups.csv")
FIGURES = ("fig7", "fig8", "fig9", "fig10", "fig13", "scaling", "ranks")


@pytest.mark.parametrize("flushed", [False, True])
@pytest.mark.parametrize(("table", "preset"), TABLES.items())
def test_each_committed_table_holds_completed_runs_of_both_methods(table: str, preset: str, flushed) -> None:
    """The default mode's tables, and run.sh --flush's (every step flushed, in ``flushed/``)."""
    frame = pd.read_csv((HERE / "flushed" if flushed else HERE) / f"{table}.csv")
    assert set(frame["name"]) == {preset}
    assert set(frame["backward"]) == {"bppsa", "bptt"}
    runs = frame.groupby("run")["epoch"].max()
    assert (runs >= 3).all() and len(runs) % 2 == 0
    assert not frame["contended"].any()
    assert set(frame["flush_denormals"]) == {flushed}


@pytest.mark.extended
def test_the_committed_report_and_figures_are_drawn_from_the_committed_tables(
    tmp_path: Path, monkeypatch
) -> None:
    """run.sh --draw's two commands, twice: the same bytes each time, and the report's text equal to
    the committed one (a table changed without redrawing fails here). The committed figures are
    only required to exist: their bytes also depend on the matplotlib release that drew them."""
    monkeypatch.chdir(ROOT)  # the report names its sources as run.sh gives them
    here = HERE.relative_to(ROOT)
    tables = [str(here / f"{t}.csv") for t in sorted(TABLES) if t.startswith("rnn_")]
    tables += [str(here / "workers.csv"), str(here / "ranks.csv")]
    tables += [str(here / f"{t}.csv") for t in sorted(TABLES) if t.startswith("gru_")]
    for out in ("a", "b"):
        assert report.main([*tables, "--out", str(tmp_path / out)]) == 0
        assert fig10.main([str(here / "fig10_products.csv"), "--out", str(tmp_path / out)]) == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted([*TEXT, *(f"{f}.{ext}" for f in FIGURES for ext in ("png", "pdf"))])
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert (HERE / name).is_file(), f"{name} is drawn but not committed"
    for name in TEXT:
        assert (tmp_path / "a" / name).read_text() == (HERE / name).read_text(), f"{name} is stale"
    flushed = [t.replace(str(here), str(here / "flushed"), 1) for t in tables]
    assert report.main([*flushed, "--out", str(tmp_path / "flushed")]) == 0
    for name in TEXT:
        assert (tmp_path / "flushed" / name).read_text() == (HERE / "flushed" / name).read_text(), name


def test_every_file_the_report_shows_or_names_exists() -> None:
    text = (ROOT / "docs" / "REPRODUCTION.md").read_text()
    shown = re.findall(r"\]\((reproduction/[^)]+)\)", text)
    assert len(shown) >= 7
    for path in shown:
        assert (ROOT / "docs" / path).is_file(), path


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--fast"],
            "run.sh: unknown argument --fast; accepted: --draw, --device cpu|cuda, --only TABLE[,TABLE...], "
            "--capture, --flush",
        ),
        (
            ["--device", "cuda", "--flush"],
            "run.sh: --flush sets a CPU's floating-point mode, and a GPU takes subnormals at full speed; "
            "accepted: --flush with --device cpu (the default)",
        ),
        (
            ["--capture"],
            "run.sh: --capture needs --device cuda (CUDA graphs); accepted: --device cuda --capture, or no "
            "--capture",
        ),
        (
            ["--device", "cuda", "--capture", "--only", "rnn_curve,ranks"],
            "run.sh: --only rnn_curve,ranks: the ranks sweep splits a step over processes, which --capture "
            "does not; accepted with --capture: every other table",
        ),
        (
            ["--only", "rnn_curve,fig7"],
            "run.sh: --only rnn_curve,fig7: unknown table fig7; accepted: rnn_batch rnn_curve rnn_seq_len "
            "workers ranks gru_curves gru_irmas",
        ),
    ],
    ids=["argument", "flush on a GPU", "capture on a CPU", "ranks captured", "table"],
)
def test_the_script_refuses_bad_input_in_one_line_before_any_work(args: list[str], said: str) -> None:
    done = subprocess.run(
        ["bash", str(HERE / "run.sh"), *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == said and not done.stdout


# Stands in for the interpreter run.sh calls ($PYTHON): logs each call's arguments, and for a sweep
# prints its summary line and writes its merged table, as run.py -m does; for the report, its file;
# for the GPU count, one.
STAND_IN = """#!/usr/bin/env bash
echo "$*" >> calls.log
if [[ $1 == run.py ]]; then
    for arg in "$@"; do [[ $arg == hydra.sweep.dir=* ]] && dir=${arg#hydra.sweep.dir=}; done
    mkdir -p "$dir" && echo "model,backward" > "$dir/records.csv" && echo "sweep $dir: done"
elif [[ $1 == -c ]]; then
    echo 1  # the GPUs (the ranks sweep's count on a GPU)
elif [[ $2 == analysis.report ]]; then
    printf '## Speedups\n## Figures\n' > "${@: -1}/report.md"
fi
"""


@pytest.mark.parametrize(
    ("args", "overrides", "folder"),
    [
        (["--flush"], ["hardware.flush_denormals=true", "hardware.device=cpu"], "flushed"),
        (["--device", "cuda", "--capture"], ["trainer.capture=true", "hardware.device=cuda"], "cuda-captured"),  # noqa: E501
        ([], ["hardware.device=cpu"], ""),
    ],
    ids=["flush", "capture", "plain"],
)  # fmt: skip
def test_the_script_runs_each_sweep_in_its_mode_into_its_folder(
    tmp_path: Path, args: list[str], overrides: list[str], folder: str
) -> None:
    """run.sh's options reach every sweep as overrides, and its tables, copied from the sweeps, and
    the report drawn from them go to the mode's folder (a copy of the script in an empty tree)."""
    script = tmp_path / "docs" / "reproduction" / "run.sh"
    script.parent.mkdir(parents=True)
    script.write_text((HERE / "run.sh").read_text())
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    done = subprocess.run(
        ["bash", str(script), *args, "--only", "rnn_seq_len,rnn_curve"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(python)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    sweeps = [c.split() for c in calls if c.startswith("run.py")]
    assert [s[2] for s in sweeps] == ["experiment=rnn_seq_len", "experiment=rnn_curve"]
    for sweep in sweeps:
        assert set(overrides) <= set(sweep)
        assert ("hardware.flush_denormals=true" in sweep) == ("--flush" in args)
        assert ("trainer.capture=true" in sweep) == ("--capture" in args)
    tables = f"docs/reproduction/{folder}".rstrip("/")
    assert sorted(p.name for p in (tmp_path / tables).glob("*.csv")) == ["rnn_curve.csv", "rnn_seq_len.csv"]
    drawn = [c for c in calls if c.startswith("-m analysis.report")]
    assert drawn == [f"-m analysis.report {tables}/rnn_curve.csv {tables}/rnn_seq_len.csv --out {tables}"]
