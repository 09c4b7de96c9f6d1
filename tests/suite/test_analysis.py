"""analysis: speedups, figures and the report, from synthetic tables and from a real tiny sweep."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

import analysis.data
from analysis import figures, report
from analysis.data import AnalysisError, load_results, speedups

ROOT = Path(__file__).resolve().parents[2]


def rows(
    backward: str, seq_len: int, batch: int, device: str, epoch_s: float, bwd_iter: float, epochs: int = 4
):
    """Epoch rows of one run as records.csv has them; times vary a little around the given values."""
    out = []
    for e in range(epochs):
        jitter = 1.0 + 0.01 * (e % 2)
        out.append(
            {
                "name": "synthetic",
                "model": "rnn",
                "dataset": "bitstream",
                "frames": None,
                "seq_len": seq_len,
                "features": 1,
                "batch_size": batch,
                "hidden_size": 20,
                "backward": backward,
                "device_name": device,
                "threads_used": 2,
                "epoch": e + 1,
                "iterations": 10,
                "timed_iterations": 10,
                "forward_s": 0.1,
                "backward_s": 10 * bwd_iter * jitter,
                "step_s": 0.01,
                "epoch_s": epoch_s * jitter,
                "wall_s": epoch_s * (e + 1),
                "loss": 2.0 - 0.1 * e,
                "accuracy": 0.1,
                "run": f"{backward}-{seq_len}-{batch}-{device}",
            }
        )
    return out


def write_sweep(folder: Path, table: list[dict], merged: bool = True) -> Path:
    frame = pd.DataFrame(table)
    for run, part in frame.groupby("run"):
        (folder / run).mkdir(parents=True)
        part.to_csv(folder / run / "records.csv", index=False)
    if merged:
        frame.to_csv(folder / "records.csv", index=False)
    return folder


def t_sweep() -> list[dict]:
    table = []
    for t in (10, 100, 1000):
        table += rows("bptt", t, 16, "H100", epoch_s=0.002 * t, bwd_iter=1e-4 * t)
        table += rows("bppsa", t, 16, "H100", epoch_s=0.001 * t, bwd_iter=1e-5 * t)
    return table


def test_speedups_are_ratios_of_medians_per_configuration_and_device() -> None:
    data = load_results_from(t_sweep() + rows("bptt", 10, 16, "A100", 1.0, 1.0))  # A100 has no BPPSA run
    table = speedups(data).sort_values("seq_len")
    assert table["device_name"].unique().tolist() == ["H100"]
    assert table["seq_len"].tolist() == [10, 100, 1000]
    assert table["overall_speedup"].round(6).tolist() == [2.0, 2.0, 2.0]
    assert table["backward_speedup"].round(6).tolist() == [10.0, 10.0, 10.0]
    assert (table["backward_lo"] <= table["backward_speedup"]).all()
    assert (table["backward_hi"] >= table["backward_speedup"]).all()
    assert (table["backward_hi"] - table["backward_lo"] < 0.5).all()


def test_names_and_hashes_are_read_as_text(tmp_path: Path) -> None:
    table = [
        {**r, "config_hash": "50804039871846e7", "comparison_key": "00012345"}
        for r in rows("bptt", 10, 16, "H100", 1.0, 1e-3) + rows("bppsa", 10, 16, "H100", 1.0, 1e-4)
    ]
    data = load_results_from(table, tmp_path)
    assert set(data["config_hash"]) == {"50804039871846e7"} and set(data["comparison_key"]) == {"00012345"}
    assert len(speedups(data)) == 1


def test_the_bootstrap_interval_is_seeded(monkeypatch) -> None:
    table = rows("bptt", 10, 16, "H100", 1.0, 1e-3, epochs=20) + rows(
        "bppsa", 10, 16, "H100", 1.0, 1e-4, epochs=20
    )
    for i, row in enumerate(table):  # twenty distinct times a side, so that draws differ
        row["backward_s"] *= 1 + 0.013 * (i % 20)
    data = load_results_from(table)
    first = speedups(data)
    assert first.equals(speedups(data))  # the same seed, the same interval
    monkeypatch.setattr(analysis.data, "BOOTSTRAP_SEED", 1)
    other = speedups(data)
    assert other["backward_speedup"].equals(first["backward_speedup"])
    assert not other[["backward_lo", "backward_hi"]].equals(first[["backward_lo", "backward_hi"]])


def test_an_interval_depends_on_its_own_epochs_alone() -> None:
    """A comparison's bootstrap interval is the same read alone, beside another comparison (which
    comes first in the table's order), or with its rows shuffled."""

    def side(backward: str, seq_len: int, scale: float) -> list[dict]:
        table = rows(backward, seq_len, 16, "H100", 1.0, 1e-3 if backward == "bptt" else 1e-4, epochs=8)
        for i, row in enumerate(table):  # distinct times, so that draws differ
            row["backward_s"] *= 1 + scale * i
            row["comparison_key"] = f"key-{seq_len}"
        return table

    mine = side("bptt", 100, 0.013) + side("bppsa", 100, 0.021)
    other = side("bptt", 10, 0.05) + side("bppsa", 10, 0.03)
    alone = speedups(load_results_from(mine)).set_index("seq_len")
    beside = speedups(load_results_from(other + mine[::-1])).set_index("seq_len")
    assert len(beside) == 2 and beside.index[0] == 10  # the other comparison is drawn first
    columns = ["backward_speedup", "backward_lo", "backward_hi", "overall_lo", "overall_hi"]
    assert beside.loc[[100], columns].equals(alone.loc[[100], columns])
    assert alone.loc[100, "backward_lo"] < alone.loc[100, "backward_speedup"] < alone.loc[100, "backward_hi"]


def test_runs_that_differ_in_any_configuration_key_are_compared_apart() -> None:
    """Two depths, two learning rates, two BPPSA strategies: one speedup row each, never pooled."""
    table = []
    for key, lr in (("k-lr-a", 1e-3), ("k-lr-b", 1e-2)):
        for r in rows("bptt", 100, 16, "H100", 2.0, 1e-2) + rows("bppsa", 100, 16, "H100", 1.0, 1e-3):
            table.append(
                {
                    **r,
                    "comparison_key": key,
                    "lr": lr,
                    "strategy": "chunked" if r["backward"] == "bppsa" else None,
                    "run": f"{r['run']}-{key}",
                }
            )
    table += [
        {**r, "comparison_key": "k-lr-a", "lr": 1e-3, "strategy": "blelloch", "run": "blelloch"}
        for r in rows("bppsa", 100, 16, "H100", 4.0, 4e-3)
    ]
    data = load_results_from(table)
    found = speedups(data)
    assert len(found) == 3
    assert sorted(found["backward_speedup"].round(6)) == [2.5, 10.0, 10.0]  # blelloch: 1e-2 / 4e-3
    legacy = data.drop(columns=["comparison_key"])  # older records: every describing column counts
    assert len(speedups(legacy)) == 3


def test_a_table_without_rows_yet_is_named(tmp_path: Path) -> None:
    from analysis.data import REQUIRED

    (tmp_path / "records.csv").write_text(",".join(REQUIRED) + "\n")  # a run before its first epoch
    with pytest.raises(
        AnalysisError, match=f"^{re.escape(str(tmp_path / 'records.csv'))}: no epoch rows yet; accepted"
    ):
        load_results([tmp_path / "records.csv"])


def load_results_from(table: list[dict], tmp: Path | None = None) -> pd.DataFrame:
    import tempfile

    folder = Path(tempfile.mkdtemp(dir=tmp)) / "sweep"
    return load_results([write_sweep(folder, table)])


def test_a_sweep_cut_short_is_read_from_its_run_folders(tmp_path: Path) -> None:
    folder = write_sweep(tmp_path / "sweep", t_sweep(), merged=False)
    data = load_results([folder])
    assert len(data) == len(t_sweep()) and data["run"].nunique() == 6


def test_figure_8_has_log_axes_labels_a_1x_line_and_says_what_is_missing() -> None:
    fig = figures.fig8(load_results_from(t_sweep()))
    a, b, c, _, e, _ = fig.axes[:6]
    assert (a.get_xscale(), a.get_yscale()) == ("log", "log")
    assert a.get_xlabel() == "sequence length T" and "BPPSA backward" in a.get_ylabel()
    assert c.get_ylabel() == "backward speedup (BPTT / BPPSA)"
    assert any(line.get_linestyle() == "--" and set(line.get_ydata()) == {1.0} for line in c.get_lines())
    texts = [t.get_text() for t in b.texts]
    assert texts and texts[0].startswith("no data: BPPSA runs at 2+ values of batch size B")
    assert e.get_xscale() == "log" and "time per iteration" in e.get_ylabel()
    plt.close(fig)


@pytest.mark.extended
def test_every_figure_is_written_and_reproducible_byte_for_byte(tmp_path: Path) -> None:
    data = load_results_from(t_sweep(), tmp_path)
    first = figures.make_figures(data, tmp_path / "a")
    second = figures.make_figures(data, tmp_path / "b")
    names = sorted(p.name for p in first)
    assert names == sorted(f"{n}.{ext}" for n in figures.FIGURES for ext in ("png", "pdf"))
    for p, q in zip(first, second, strict=True):
        assert p.read_bytes() == q.read_bytes(), p.name


def test_scaling_figure_plots_backward_time_against_workers(tmp_path: Path) -> None:
    table = []
    for p in (1, 2, 4):
        for mode, t in (("bptt", 1.0), ("bppsa", 2.0 / p)):
            for r in rows(mode, 1000, 16, "CPU", 1.0, t):
                table.append({**r, "threads_used": p, "run": f"{mode}-{p}"})
    fig = figures.scaling(load_results_from(table, tmp_path))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel().startswith("workers p")
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert sorted(lines) == ["BPPSA, CPU", "BPTT, CPU"]
    bppsa, bptt = lines["BPPSA, CPU"], lines["BPTT, CPU"]
    assert list(bppsa.get_xdata()) == list(bptt.get_xdata()) == [1, 2, 4]
    one = bppsa.get_ydata()[0]
    assert [one / y for y in bppsa.get_ydata()] == pytest.approx([1, 2, 4])  # backward time 2/p
    assert bptt.get_ydata() == pytest.approx([one / 2] * 3)  # BPTT's 1 at every p
    plt.close(fig)


def test_the_ranks_figure_plots_backward_time_against_ranks_and_the_workers_figure_one_rank(
    tmp_path: Path,
) -> None:
    table = []
    for ranks in (1, 2):
        for mode, t in (("bptt", 1.0), ("bppsa", 0.6 / ranks)):
            table += [
                {**r, "threads_used": 1, "ranks": ranks, "run": f"{mode}-{ranks}"}
                for r in rows(mode, 1000, 16, "CPU", 1.0, t)
            ]
    data = load_results_from(table, tmp_path)
    fig = figures.ranks(data)
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("ranks p") and tick_labels(ax.xaxis) == ["1", "2"]
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert sorted(lines) == ["BPPSA, CPU, 1 per rank", "BPTT, CPU, 1 per rank"]
    one, two = lines["BPPSA, CPU, 1 per rank"]
    assert one / two == pytest.approx(2) and one < lines["BPTT, CPU, 1 per rank"][0]
    assert ax.get_title() == "Scaling with ranks (T = 1000, B = 16)"
    plt.close(fig)
    fig = figures.scaling(data)  # every run has one worker per rank: no workers curve
    assert "runs at 2+ worker counts" in fig.axes[0].texts[0].get_text()
    plt.close(fig)


def _records_with(folder: Path, **values) -> Path:
    """A one-row records.csv with every required column, ``values`` set over the good ones."""
    from analysis.data import REQUIRED

    row = {c: 1 for c in REQUIRED} | {"model": "rnn", "dataset": "bitstream", "backward": "bppsa"} | values
    path = folder / "records.csv"
    pd.DataFrame([row]).to_csv(path, index=False)
    return path


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p / "nowhere", "does not exist"),
        (lambda p: p, "no records.csv under"),
        (
            lambda p: (p / "afile").write_text("") or p / "afile",
            "afile is empty; accepted: a table with the columns model, dataset, backward",
        ),
        (  # one line of text reads as a header without rows: not a table without rows yet
            lambda p: (p / "records.csv").write_text("hello world, not a csv\n") and p,
            "records.csv lacks the columns model, dataset, backward, device_name, seq_len, batch_size",
        ),
        (
            lambda p: (p / "records.csv").write_text("a,b\n1,2\n") and p / "records.csv",
            "lacks the columns model",
        ),
        (
            lambda p: _records_with(p, forward_s="abc"),
            "records.csv: forward_s is 'abc' in row 1; accepted: a number",
        ),
        (
            lambda p: _records_with(p, backward="scan"),
            "records.csv: unknown backward 'scan'; accepted: bppsa, bptt",
        ),
        (
            lambda p: _records_with(p, seq_len=None),
            "seq_len is empty in row 1; accepted: a whole number >= 1",
        ),
        (lambda p: _records_with(p, epoch=1.5), "epoch is 1.5 in row 1; accepted: a whole number >= 1"),
        (
            lambda p: _records_with(p, backward_s=-1),
            "backward_s is -1 in row 1; accepted: a finite number >= 0",
        ),
        (
            lambda p: _records_with(p, epoch_s="inf"),
            "epoch_s is inf in row 1; accepted: a finite number >= 0",
        ),
        (lambda p: _records_with(p, loss="nan"), "loss is nan in row 1; accepted: a finite number"),
        (lambda p: _records_with(p, loss=None), "loss is empty in row 1; accepted: a finite number"),
        (
            lambda p: _records_with(p, contended="maybe"),
            "contended is 'maybe' in row 1; accepted: True or False",
        ),
        (
            lambda p: (
                (_records_with(p).write_text(_records_with(p).read_text() + "rnn,bitstream,bppsa,1,1\n"))
                and p / "records.csv"
            ),
            "is empty in row 2",  # a row cut short
        ),
    ],
)
def test_missing_or_malformed_input_is_named(tmp_path: Path, setup, message: str, capsys) -> None:
    target = setup(tmp_path)
    with pytest.raises(AnalysisError, match=message):
        load_results([target])
    for tool in (figures, report):  # both through load_results, refused before --out is made
        assert tool.main([str(target), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]
        assert not (tmp_path / "out").exists()


def test_a_folder_that_cannot_be_read_is_named(tmp_path: Path, monkeypatch) -> None:
    sweep = write_sweep(tmp_path / "sweep", t_sweep())
    real = Path.is_file

    def denied(path: Path) -> bool:  # what a folder without read and search permission gives
        if path.parent == sweep:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(Path, "is_file", denied)
    with pytest.raises(AnalysisError, match=f"cannot read {sweep}: Permission denied"):
        load_results([sweep])


def test_rows_reached_twice_count_once(tmp_path: Path) -> None:
    table = t_sweep()
    sweep = write_sweep(tmp_path / "sweep", table)
    once = load_results([sweep])
    twice = load_results([sweep, sweep / "records.csv", *sorted(sweep.glob("*/records.csv"))])
    assert len(twice) == len(once) == len(table)
    assert (
        speedups(twice)
        .drop(columns="source", errors="ignore")
        .equals(speedups(once).drop(columns="source", errors="ignore"))
    )


@pytest.mark.extended  # a real sweep of four jobs, then its report: seconds (the default run's real sweep
# is tests/suite/test_run.py's, its reports drawn from written sweeps here)
def test_report_from_a_real_tiny_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "-m",
            "logger=csv",
            "trainer.epochs=3",
            "trainer.warmup_iters=1",
            "dataset.num_samples=80",
            "dataset.seq_len=6,12",
            "backward=bppsa,bptt",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert report.main([str(sweep), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| rnn | bitstream")]
    assert [line.split("|")[4].strip() for line in table] == ["6", "12"]
    assert [line.split("|")[7].strip() for line in table] == ["auto", "auto"]  # the BPPSA side
    assert "× [" in table[0] and "![fig8](fig8.png)" in text
    assert "Commits: " in text and "torch " in text
    assert (tmp_path / "report" / "fig8.pdf").is_file()


def test_a_report_that_cannot_be_written_ends_in_one_line_leaving_whole_files(tmp_path: Path, capsys) -> None:
    """A file the report cannot write (here a folder has its name; a full disk alike) ends the
    command with status 1 and one line naming it; each file written is whole, no temporary left."""
    sweep = write_sweep(tmp_path / "sweep", t_sweep())
    out = tmp_path / "report"
    (out / "report.md").mkdir(parents=True)
    assert report.main([str(sweep), "--out", str(out)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"python -m analysis.report: error: cannot write {out / 'report.md'}: "), line
    assert (out / "report.md").is_dir() and not list(out.glob(".*"))
    assert (out / "fig8.png").read_bytes().startswith(b"\x89PNG")


def test_gru_figures_split_by_feature_setting(tmp_path: Path) -> None:
    table = []
    for frames, t in (("s", 259), ("m", 517), ("l", 1034)):
        for batch in (16, 32):
            for mode, bwd in (("bptt", 0.02), ("bppsa", 0.01)):
                for r in rows(mode, t, batch, "H100", 1.0, bwd):
                    table.append(
                        {
                            **r,
                            "model": "gru",
                            "dataset": "irmas",
                            "frames": frames,
                            "run": f"{mode}-{frames}-{batch}",
                        }
                    )
    data = load_results_from(table, tmp_path)
    fig9 = figures.fig9(data)
    labels = [t.get_text() for t in fig9.axes[0].get_xticklabels()]
    assert len(labels) == 12 and labels[0] == "s, B=16\nBPPSA" and labels[-1] == "l, B=32\nBPTT"
    low, high = fig9.axes[0].get_xlim()
    bars = [p for p in fig9.axes[0].patches if p.get_height() > 0]
    assert all(low <= b.get_x() and b.get_x() + b.get_width() <= high for b in bars)  # none cut off
    assert fig9.axes[0].get_ylabel() == "time per iteration (s)"
    fig13 = figures.fig13(data)
    assert [ax.get_title()[:12] for ax in fig13.axes[:3]] == ["Fig. 13 (s):", "Fig. 13 (m):", "Fig. 13 (l):"]
    for ax in fig13.axes[:3]:  # one colour per method, the same in every panel
        colours = {line.get_label().split(",")[0]: line.get_color() for line in ax.get_lines()}
        assert colours == {"BPTT": figures.METHOD_COLOURS["bptt"], "BPPSA": figures.METHOD_COLOURS["bppsa"]}
    assert all(ax.get_xlabel() == "wall-clock training time (s)" for ax in fig13.axes[:3])
    table_ = speedups(data)
    assert len(table_) == 6 and set(table_["frames"]) == {"s", "m", "l"}
    assert table_["backward_speedup"].round(6).eq(2.0).all()
    figures.save(fig9, tmp_path / "out", "fig9")
    figures.save(fig13, tmp_path / "out", "fig13")
    for name in ("fig9.png", "fig9.pdf", "fig13.png", "fig13.pdf"):
        assert (tmp_path / "out" / name).stat().st_size > 1000


def tick_labels(axis) -> list[str]:
    """The labels of the major ticks inside the axis's view."""
    axis.figure.canvas.draw()
    low, high = sorted(axis.get_view_interval())
    return [
        t.get_text()
        for t, loc in zip(axis.get_majorticklabels(), axis.get_majorticklocs(), strict=True)
        if t.get_text() and low <= loc <= high
    ]


@pytest.mark.extended
def test_figure_8_says_what_each_panel_holds_fixed_and_reads_plainly() -> None:
    table = t_sweep()
    for b in (4, 8, 32):  # a batch sweep at T = 100 beside the T sweep at B = 16
        table += rows("bptt", 100, b, "H100", 0.2, 1e-2) + rows("bppsa", 100, b, "H100", 0.1, 1e-3)
    fig = figures.fig8(load_results_from(table))
    a, b, c, d, e, f = fig.axes[:6]
    assert "(B = 16)" in a.get_title(loc="left") and "(T = 100)" in b.get_title(loc="left")
    assert e.get_title(loc="left").endswith("(B = 16, H100)") and "H100" not in e.get_ylabel()
    for ax in (a, b, c, d, e, f):
        for axis in (ax.xaxis, ax.yaxis):
            labels = tick_labels(axis)
            assert labels and not any("^" in t or "×" in t or "10^" in t for t in labels), labels
    assert tick_labels(b.xaxis)[:3] == ["4", "8", "16"]
    assert {ax.get_legend().get_title().get_text() for ax in (a, b, c, d)} == {"device"}
    assert e.get_legend().get_title().get_text() == "phase, method"
    for ax in (a, c, e):  # legends beside the data, not on it
        assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1
    plt.close(fig)


def test_loss_curves_start_at_zero_and_tell_configurations_apart() -> None:
    table = []
    for t in (50, 100):
        for mode in ("bptt", "bppsa"):
            table += [
                {**r, "initial_loss": 2.5, "run": f"{mode}-{t}"} for r in rows(mode, t, 16, "CPU", 1.0, 1e-3)
            ]
    fig = figures.fig7(load_results_from(table))
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 4 and all(line.get_xdata()[0] == 0 and line.get_ydata()[0] == 2.5 for line in lines)
    labels = sorted(line.get_label() for line in lines)
    assert labels == [
        "BPPSA, T = 100, B = 16",
        "BPPSA, T = 50, B = 16",
        "BPTT, T = 100, B = 16",
        "BPTT, T = 50, B = 16",
    ]
    styles = {line.get_label(): line.get_linestyle() for line in lines}
    assert styles["BPTT, T = 50, B = 16"] != styles["BPTT, T = 100, B = 16"]
    plt.close(fig)


def test_the_scaling_figure_reads_plainly_and_names_t_and_b(tmp_path: Path) -> None:
    table = []
    for p in (1, 2, 4, 8):
        for mode, t in (("bptt", 1.0), ("bppsa", 2.0 / p)):
            table += [
                {**r, "threads_used": p, "run": f"{mode}-{p}"} for r in rows(mode, 1000, 16, "CPU", 1.0, t)
            ]
    fig = figures.scaling(load_results_from(table, tmp_path))
    ax = fig.axes[0]
    assert tick_labels(ax.xaxis) == ["1", "2", "4", "8"]
    assert ax.get_title() == "Scaling with workers (T = 1000, B = 16)"
    plt.close(fig)


def test_fig10_merges_methods_that_draw_the_same_points(tmp_path: Path) -> None:
    from analysis import fig10

    base = {"ratio": 0.5, "flops": 10, "critical": True}
    products = pd.DataFrame(
        [
            {**base, "method": m, "mnk": mnk, "kind": k}
            for m, k in (("levels=3", "up"), ("levels=all", "down"))
            for mnk in (1, 2)
        ]
        + [{**base, "method": "BP", "mnk": 3, "kind": "seq"}]
    )
    merged = fig10.merge_identical(products)
    assert sorted(merged["method"].unique()) == ["BP", "levels=3 = levels=all"]
    fig = fig10.fig10(products)
    legend = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert legend == ["BP", "levels=3 = levels=all", "on the critical path", "off it"]
    plt.close(fig)


def test_fig10_that_cannot_be_written_ends_in_one_line(tmp_path: Path, capsys) -> None:
    from analysis import fig10

    path = tmp_path / "products.csv"
    row = {"ratio": 0.5, "method": "BP", "flops": 10, "mnk": 3, "kind": "seq", "critical": True}
    pd.DataFrame([row]).to_csv(path, index=False)
    out = tmp_path / "figures"
    (out / "fig10.png").mkdir(parents=True)  # a folder where the figure goes; a full disk alike
    assert fig10.main([str(path), "--out", str(out)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"python -m analysis.fig10: error: cannot write {out / 'fig10.png'}: "), line
    assert not list(out.glob(".*"))


def test_fig10_names_a_products_table_it_cannot_draw(tmp_path: Path, capsys) -> None:
    from analysis import fig10

    path = tmp_path / "products.csv"
    row = {"ratio": 0.5, "method": "BP", "flops": "many", "mnk": 3, "critical": True}
    pd.DataFrame([row]).to_csv(path, index=False)
    assert fig10.main([str(tmp_path), "--out", str(tmp_path / "fig")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("products.csv: flops is 'many' in row 1; accepted: a number")
    path.write_text("")
    assert fig10.main([str(tmp_path), "--out", str(tmp_path / "fig")]) == 2
    assert "products.csv is empty" in capsys.readouterr().err
    for bad, message in (
        ({"critical": "sometimes"}, "critical is 'sometimes' in row 1; accepted: True or False"),
        ({"ratio": float("inf")}, "ratio is inf in row 1; accepted: a finite number >= 0"),
        ({"ratio": None}, "ratio is empty in row 1; accepted: a finite number >= 0"),
        ({"method": None}, "method is empty in row 1; accepted: a method's name"),
    ):
        pd.DataFrame([{**row, "flops": 2, **bad}]).to_csv(path, index=False)
        assert fig10.main([str(tmp_path), "--out", str(tmp_path / "fig")]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.endswith(message), line
    pd.DataFrame(columns=list(row)).to_csv(path, index=False)
    assert fig10.main([str(tmp_path), "--out", str(tmp_path / "fig")]) == 2
    assert "products.csv holds no rows" in capsys.readouterr().err
    assert not (tmp_path / "fig").exists()


def test_cells_without_timings_or_spread_say_why() -> None:
    short = rows("bptt", 100, 16, "CPU", 2.0, 1e-2, epochs=2) + rows(
        "bppsa", 100, 16, "CPU", 1.0, 1e-3, epochs=2
    )
    untimed = [
        {**r, "seq_len": 200, "timed_iterations": 0, "run": r["run"] + "-u"}
        for r in rows("bptt", 200, 16, "CPU", 2.0, 1e-2) + rows("bppsa", 200, 16, "CPU", 1.0, 1e-3)
    ]
    table = speedups(load_results_from(short + untimed)).set_index("seq_len")
    text = report.speedup_markdown(table.reset_index())
    assert "10.00× (2 epoch(s) on a side: no interval)" in text
    assert "n/a: no timed iteration (every iteration was warm-up)" in text
    assert "nan" not in text


def test_contended_epochs_are_left_out_and_counted(tmp_path: Path) -> None:
    table = [{**r, "contended": r["epoch"] == 2} for r in t_sweep()]
    data = load_results_from(table, tmp_path)
    assert data.attrs["contended_epochs"] == 6 and not data["contended"].any()
    kept = load_results([next(tmp_path.iterdir()) / "sweep"], keep_contended=True)
    assert len(kept) == len(table)
    path = report.write_report([next(tmp_path.iterdir()) / "sweep"], tmp_path / "report")
    assert "6 epoch(s) measured while other work kept the machine busy are left out" in path.read_text()


def test_rows_recorded_before_a_column_was_added_read_its_value_then() -> None:
    """``flush_denormals`` and ``capture`` absent from older rows read False, what those runs did:
    a BPTT run recorded before them pairs with a BPPSA run recorded after, where the rows have no
    comparison key (every describing column must agree) as where they have one."""
    newer = {"flush_denormals": False, "capture": False}
    table = [{**r, **(newer if r["backward"] == "bppsa" else {})} for r in t_sweep()]
    data = load_results_from(table)
    assert data["flush_denormals"].tolist() == [False] * len(data) == data["capture"].tolist()
    assert len(speedups(data)) == 3
    keyed = [{**r, "comparison_key": f"key-{r['seq_len']}"} for r in table]
    assert len(speedups(load_results_from(keyed))) == 3


def test_a_setting_every_run_shares_is_said_once(tmp_path: Path) -> None:
    """``hardware.flush_denormals`` and ``trainer.capture``, left out of the table where no row
    differs in them, are said under it where every run had them on; not where one did not."""
    flushed = [{**r, "flush_denormals": True, "capture": r["backward"] == "bppsa"} for r in t_sweep()]
    text = report.write_report([write_sweep(tmp_path / "a", flushed)], tmp_path / "ra").read_text()
    assert report.SHARED_SETTINGS["flush_denormals"] in text and report.SHARED_SETTINGS["capture"] not in text
    mixed = [{**r, "flush_denormals": r["epoch"] == 1} for r in t_sweep()]
    text = report.write_report([write_sweep(tmp_path / "b", mixed)], tmp_path / "rb").read_text()
    assert report.SHARED_SETTINGS["flush_denormals"] not in text


def test_provenance_is_read_beside_a_records_file(tmp_path: Path) -> None:
    from analysis.data import provenance

    (tmp_path / "summary.json").write_text(
        '{"git": {"commit": "abcdef1234567890", "dirty": false}, '
        '"versions": {"torch": "2.13.0", "python": "3.11.7"}}'
    )
    (tmp_path / "records.csv").write_text("x\n")
    assert provenance([tmp_path / "records.csv"]) == {
        "commits": ["abcdef123456"],
        "versions": ["torch 2.13.0, python 3.11.7"],
    }


def test_a_table_copied_away_from_its_runs_still_names_their_commits(tmp_path: Path) -> None:
    """A merged records.csv copied on its own (as docs/reproduction keeps its tables) has no summary
    beside it: the report reads the commits and versions its rows carry."""
    table = [
        {**r, "commit": "0123456789abcdef" if r["backward"] == "bppsa" else "fedcba9876543210",
         "dirty": r["epoch"] == 2, "torch": "2.13.0+cpu", "python": "3.11.7"}
        for r in t_sweep()
    ]  # fmt: skip
    copied = tmp_path / "copied.csv"
    pd.DataFrame(table).to_csv(copied, index=False)
    data = load_results([copied])
    from analysis.data import provenance

    origin = provenance([copied], data)
    assert origin == {
        "commits": ["0123456789ab", "0123456789ab (dirty)", "fedcba987654", "fedcba987654 (dirty)"],
        "versions": ["torch 2.13.0+cpu, python 3.11.7"],
    }
    text = report.write_report([copied], tmp_path / "report").read_text()
    assert "Commits: 0123456789ab, 0123456789ab (dirty), fedcba987654" in text
    assert "Versions: torch 2.13.0+cpu, python 3.11.7" in text
    assert provenance([copied]) == {"commits": [], "versions": []}  # without the rows: nothing beside it


def test_an_axis_over_more_than_three_decades_shows_only_the_powers_of_ten() -> None:
    fig, ax = plt.subplots()
    ax.plot([10, 30000], [1, 2])
    ax.set_xscale("log")
    figures._log_axis(ax.xaxis)
    fig.canvas.draw()
    assert tick_labels(ax.xaxis) == ["10", "100", "1000", "10000"]
    plt.close(fig)


def finished(run: Path, status: str = "completed", config_hash: str | None = None, when: str = "01") -> None:
    """A run folder's summary.json as the runner leaves it: its status, identity and finishing time."""
    summary = {"status": status, "config_hash": config_hash or run.name, "finished": f"2025-01-{when}"}
    (run / "summary.json").write_text(json.dumps(summary))


def test_a_stale_merged_table_gives_way_to_the_finished_run_folders(tmp_path: Path, capsys) -> None:
    """A sweep re-run with more values and killed before its merge: the run folders are read, and
    one line says what the merged table lacked, what replaced it, what it kept and what was skipped."""
    table = t_sweep()
    sweep = write_sweep(tmp_path / "sweep", table, merged=False)
    for run in sweep.iterdir():
        finished(run)
    shortened = [r for r in table if r["run"] == "bptt-10-16-H100" and r["epoch"] > 2]  # merged at 2 of 4
    stale = [r for r in table if r["seq_len"] < 1000 and r not in shortened]
    pd.DataFrame(stale).to_csv(sweep / "records.csv", index=False)
    rerun = sweep / "bppsa-100-16-H100"  # started over after the merge, then killed: 1 epoch
    pd.DataFrame(rows("bppsa", 100, 16, "H100", 9.0, 9.0, epochs=1)).to_csv(rerun / "records.csv")
    finished(rerun, "interrupted")
    later = (("bptt-10000-16-H100", "running", "01"), ("bptt-1000-copy", "completed", "00"))
    for name, status, when in later:
        (sweep / name).mkdir()
        seq_len = 10000 if status == "running" else 1000
        pd.DataFrame(rows("bptt", seq_len, 16, "H100", 5.0, 5.0)).to_csv(sweep / name / "records.csv")
        finished(sweep / name, status, "bptt-1000-16-H100" if name.endswith("copy") else None, when)
    assert report.main([str(sweep), "--out", str(tmp_path / "report")]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"python -m analysis.report: {sweep}: records.csv is stale")
    assert "added 2 run(s) it lacks: bppsa-1000-16-H100, bptt-1000-16-H100" in line
    assert "replaced 1 run(s) by their folders' rows: bptt-10-16-H100" in line
    assert "kept the merged table's rows of 1 run(s) unfinished now: bppsa-100-16-H100 (interrupted)" in line
    assert "bptt-10000-16-H100 (running)" in line
    assert "bptt-1000-copy (the configuration of bptt-1000-16-H100, finished later)" in line
    found = pd.read_csv(tmp_path / "report" / "speedups.csv")
    assert found["seq_len"].tolist() == [10, 100, 1000]
    assert found["epochs_bptt"].tolist() == found["epochs_bppsa"].tolist() == [4, 4, 4]
    assert found["backward_speedup"].round(6).tolist() == [10.0, 10.0, 10.0]  # no rows of the re-run
    assert f"Read: {sweep}: records.csv is stale" in (tmp_path / "report" / "report.md").read_text()
    (sweep / "records.csv").unlink()  # cut short before any merge: the same runs, only the skips said
    data = load_results([sweep])
    assert sorted(data["run"].unique()) == sorted({r["run"] for r in table} - {"bppsa-100-16-H100"})
    assert data.attrs["notes"] == [
        f"{sweep}: skipped 3 run(s): bppsa-100-16-H100 (interrupted), bptt-10000-16-H100 (running), "
        "bptt-1000-copy (the configuration of bptt-1000-16-H100, finished later)"
    ]


def layered(layers: tuple[int, ...] = (1, 2)) -> list[dict]:
    """A T sweep per layer count (each its own comparison_key), BPPSA twice as slow with two layers."""
    table = []
    for n in layers:
        for r in t_sweep():
            slower = 2.0 if n == 2 and r["backward"] == "bppsa" else 1.0
            table.append(
                {
                    **r,
                    "num_layers": n,
                    "lr": 1e-3,
                    "comparison_key": f"{r['seq_len']}-{n}",
                    "backward_s": r["backward_s"] * slower,
                    "run": f"{r['run']}-{n}",
                }
            )
    return table


@pytest.mark.extended
def test_the_report_shows_every_key_that_tells_its_rows_apart(tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path / "sweep", layered())
    text = report.write_report([sweep], tmp_path / "report").read_text()
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:6] == ["model", "dataset", "frames", "T", "B", "num layers"] and "lr" not in head
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    assert [(c[3], c[5]) for c in cells] == [(t, n) for t in ("10", "100", "1000") for n in ("1", "2")]
    assert len({tuple(c[:8]) for c in cells}) == len(cells)  # no two rows read alike
    assert pd.read_csv(tmp_path / "report" / "speedups.csv")["num_layers"].tolist() == [1, 2] * 3
    hidden = [  # two configurations no column names (e.g. dataset.num_samples): the comparison key says
        {**r, "comparison_key": f"{r['comparison_key']}-{k}", "run": f"{r['run']}-{k}"}
        for k in ("a", "b")
        for r in layered((1,))
    ]
    table = speedups(load_results_from(hidden, tmp_path))
    assert report.distinguishing(table) == ["comparison_key"]
    assert "| comparison key |" in report.speedup_markdown(table)


def test_figure_8_draws_one_line_per_configuration() -> None:
    fig = figures.fig8(load_results_from(layered()))
    runtime, speedup, breakdown = fig.axes[0], fig.axes[2], fig.axes[4]
    lines = {line.get_label(): list(line.get_ydata()) for line in runtime.get_lines()}
    assert sorted(lines) == ["H100, num_layers = 1", "H100, num_layers = 2"]
    assert [b / a for a, b in zip(*lines.values(), strict=True)] == pytest.approx([2, 2, 2])  # not pooled
    assert runtime.get_legend().get_title().get_text() == "device, configuration"
    found = {t.get_text(): t for t in speedup.get_legend().get_texts()}
    assert sorted(found) == ["H100, num_layers = 1", "H100, num_layers = 2"]
    assert breakdown.get_title(loc="left").endswith("(B = 16, H100, num_layers = 1)")  # one configuration
    plt.close(fig)


def test_a_run_reached_twice_counts_once_and_two_sweeps_of_one_configuration_count_twice(
    tmp_path: Path,
) -> None:
    """One run is one run folder: reached through its sweep, its merged table and itself, once; the
    same configuration measured in two sweep folders (same config_hash, same folder names), twice."""
    table = [{**r, "config_hash": r["run"]} for r in t_sweep()]
    first = write_sweep(tmp_path / "main" / "1", table)
    for run in (p for p in first.iterdir() if p.is_dir()):
        finished(run)
    run = first / "bptt-10-16-H100"
    earlier = [{**r, "epoch_s": 3 * r["epoch_s"]} if r["run"] == run.name else r for r in table]
    pd.DataFrame(earlier).to_csv(first / "records.csv", index=False)  # merged before it started over
    once = load_results([first, run, tmp_path / "main" / "1" / "." / run.name, first / "records.csv"])
    assert len(once) == len(table) and once["run_path"].nunique() == 6
    ours = once[once["run"] == run.name]
    assert ours["epoch_s"].tolist() == [r["epoch_s"] for r in table if r["run"] == run.name]
    again = [{**r, "config_hash": r["run"], "epoch_s": r["epoch_s"] * 1.1} for r in t_sweep()]
    second = write_sweep(tmp_path / "main" / "2", again)
    both = load_results([first, second, run])
    assert len(both) == 2 * len(t_sweep()) and both["run_path"].nunique() == 12
    assert speedups(both)["epochs_bptt"].tolist() == [8, 8, 8]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc and /sys")
@pytest.mark.parametrize(("tool", "out"), [(report, "/proc/nope/out"), (figures, "/sys/nope")])
def test_an_output_folder_that_cannot_be_made_is_refused_in_one_line(
    tmp_path: Path, tool, out: str, capsys
) -> None:
    """Refused like any bad argument (a superuser passes the permission check there, so the folder is
    made first), before anything is written."""
    sweep = write_sweep(tmp_path / "sweep", t_sweep())
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        tool.main([str(sweep), "--out", out])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"python -m {tool.__name__}: error: argument --out: ")
    assert out.split("/")[1] in line and "accepted: a folder (made if missing)" in line
    assert sorted(tmp_path.rglob("*")) == before and not Path(out).exists()
