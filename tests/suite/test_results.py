"""No result lost, mixed or mis-grouped: job folders, sweep merges, resume and re-runs, the folder lock,
refusals that leave folders untouched, and failures said in one line."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT, TINY, composed, run_py, write_tree

from analysis.data import load_results, speedups
from experiments import records, runner
from experiments.records import job_folder, sweep_folder
from toolbox.errors import WriteError
from toolbox.files import write_atomic

CSV = ["logger=csv"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` but Hydra's log, by relative path: a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.suffix != ".log" and p.name != records.LOCK
    }


def one_line_error(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.py: error: "), done.stderr
    return lines[0]


# ---------------------------------------------------------------------------------- folder names


def test_job_folder_names_are_flat_safe_readable_and_unique() -> None:
    assert job_folder(["dataset.seq_len=100", "backward=bptt"]) == "run_backward=bptt,dataset.seq_len=100"
    assert job_folder([]) == "run"
    odd = ["dataset.root=/data/IRMAS", "dataset.root=/data IRMAS", "dataset.root=_data_IRMAS", "x=é", "x=e"]
    names = [job_folder([o]) for o in odd]
    assert len(set(names)) == len(names)  # distinct texts, distinct folders
    for name in names:
        assert "/" not in name and " " not in name and name.isascii() and name.startswith("run_")
    assert len(job_folder(["dataset.root=/" + "x" * 500]).encode()) < 120
    # keys that do not change results, and those that name or place the sweep, leave the name alone
    quiet = ["hardware.progress=false", "dataset.cache_dir=/c", "hardware.data_workers=2", "logger=csv"]
    quiet += ["logger.mode=offline", "trainer.resume=true", "name=x", "experiment=rnn_seq_len"]
    assert job_folder([*quiet, "backward=bptt"]) == "run_backward=bptt"


def test_a_named_sweep_has_a_stable_folder_and_an_unnamed_one_its_own() -> None:
    assert sweep_folder("rnn_seq_len", "2026-01-01_00-00-00") == "multirun/rnn_seq_len"
    assert sweep_folder("main", "2026-01-01_00-00-00") == "multirun/main/2026-01-01_00-00-00"
    assert composed("name=x", hydra=True).hydra.sweep.dir == "multirun/x"
    assert composed(hydra=True).hydra.sweep.dir.startswith("multirun/main/")


@pytest.mark.extended
def test_an_irmas_sweep_with_a_path_merges_every_job(tmp_path: Path) -> None:
    """The README's IRMAS sweep: dataset.root is a path, so its '/' must not make folders."""
    tree = write_tree(tmp_path / "IRMAS-TrainingData", per_class=1)
    sweep = tmp_path / "sweep"
    args = ["-m", "model=gru", "dataset=irmas", f"dataset.root={tree}", "dataset.frames=l"]
    args += [f"dataset.cache_dir={tmp_path / 'cache'}", "trainer.epochs=1", "trainer.batch_size=8"]
    done = run_py(*args, "backward=bppsa,bptt", *CSV, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "2 of 2 jobs completed" in done.stdout
    folders = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(folders) == 2 and all((p / "records.csv").is_file() for p in folders)
    merged = pd.read_csv(sweep / "records.csv")
    assert sorted(merged["backward"]) == ["bppsa", "bptt"] and set(merged["frames"]) == {"l"}
    # Both runs' epochs whether or not another test kept the machine busy (then 'contended', left out).
    table = speedups(load_results([sweep], keep_contended=True))
    assert len(table) == 1 and table["frames"].tolist() == ["l"]


@pytest.mark.extended
def test_a_sweep_exits_0_when_its_own_jobs_completed_whatever_else_the_folder_holds(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    stale = sweep / "run_dataset.seq_len=5"  # a failed job of an earlier sweep of the same name
    stale.mkdir(parents=True)
    (stale / "summary.json").write_text(json.dumps({"status": "failed", "error": "earlier", "config": {}}))
    done = run_py("-m", *TINY, *CSV, "backward=bppsa,bptt", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 jobs completed" in done.stdout
    jobs = pd.read_csv(sweep / "jobs.csv").set_index("run")
    assert jobs.loc[stale.name, "status"] == "failed" and pd.isna(jobs.loc[stale.name, "outcome"])
    assert (jobs.drop(stale.name)["outcome"] == "completed").all()


@pytest.mark.extended
def test_a_job_whose_interpolation_does_not_resolve_is_refused_and_the_sweep_merged(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = run_py("-m", *TINY, *CSV, "optimizer.lr=0.001,${oops}", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 1 and "1 of 2 jobs completed" in done.stdout
    assert "optimizer.lr: Interpolation key 'oops' not found" in done.stdout
    assert len(pd.read_csv(sweep / "records.csv")) == 2


@pytest.mark.extended
def test_keys_that_do_not_change_results_keep_the_folders_and_duplicates_are_merged_once(
    tmp_path: Path,
) -> None:
    sweep = tmp_path / "sweep"
    base = ["-m", *TINY, *CSV, "backward=bppsa,bptt", f"hydra.sweep.dir={sweep}"]
    assert run_py(*base, cwd=tmp_path).returncode == 0
    folders = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    again = run_py(*base, "hardware.progress=false", "hardware.data_workers=0", "logger=none", cwd=tmp_path)
    assert again.returncode == 0 and "2 done before, skipped" in again.stdout
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == folders
    # the default optimizer named explicitly: other folders, the same configurations
    same = run_py(*base, "optimizer=adam", cwd=tmp_path)
    assert same.returncode == 0
    merged = pd.read_csv(sweep / "records.csv")
    assert len(merged) == 4 and merged.groupby("config_hash")["run"].nunique().eq(1).all()
    jobs = pd.read_csv(sweep / "jobs.csv")
    assert jobs["duplicate_of"].notna().sum() == 2


def test_a_key_added_later_keeps_the_identity_of_runs_recorded_before_it_at_its_old_value() -> None:
    """``trainer.capture``: false computes what runs did before the key existed, so their hash, the
    comparison key and a resume's check of the configuration stay; true is another run."""
    before = {"model": {"hidden_size": 20}, "trainer": {"epochs": 3, "seed": 0}}
    off, on = ({**before, "trainer": {**before["trainer"], "capture": c}} for c in (False, True))
    assert records.config_hash(off) == records.config_hash(before) != records.config_hash(on)
    assert records.comparison_key(off) == records.comparison_key(before) != records.comparison_key(on)
    assert records.differing_keys(before, off) == {}
    assert records.differing_keys(before, on) == {"trainer.capture": (None, True)}
    # hardware.flush_denormals: false is PyTorch's default mode, which every run before the key ran in
    plain, flushed = ({**before, "hardware": {"flush_denormals": f}} for f in (False, True))
    assert records.config_hash(plain) == records.config_hash(before) != records.config_hash(flushed)
    assert records.comparison_key(plain) == records.comparison_key(before) != records.comparison_key(flushed)
    # backward.exchange: the all-gather is what sequence-parallel runs did before the key
    bppsa = {**before, "backward": {"mode": "bppsa", "strategy": "auto"}, "hardware": {"ranks": 2}}
    gather, chain, auto = (
        {**bppsa, "backward": {**bppsa["backward"], "exchange": e}} for e in ("allgather", "chain", "auto")
    )
    assert records.config_hash(gather) == records.config_hash(bppsa) != records.config_hash(chain)
    assert records.config_hash(auto) not in (records.config_hash(gather), records.config_hash(chain))
    # in one process (ranks null) there is no exchange: every value is the run recorded before the key
    alone = [{**c, "hardware": {"ranks": None}} for c in (bppsa, gather, chain, auto)]
    assert len({records.config_hash(c) for c in alone}) == 1
    assert records.differing_keys(alone[0], alone[2]) == {}


def test_the_merge_writes_every_cell_back_as_it_was(tmp_path: Path) -> None:
    """A hash made of digits (with one 'e') stays that text in the merged table and in the analysis."""
    sweep = tmp_path / "sweep"
    for run, chash in (("a", "50804039871846e7"), ("b", "00012345")):
        records.write_json(sweep / run / "summary.json", {"status": "completed", "config_hash": chash})
        rows = [
            {"config_hash": chash, "comparison_key": chash, "epoch": e, "loss": 0.5, "frames": ""}
            for e in (1, 2)
        ]
        records.write_table(sweep / run / "records.csv", rows)
    merged, jobs = records.merge_sweep(sweep)
    assert len(merged) == 4 and sorted(jobs["config_hash"]) == ["00012345", "50804039871846e7"]
    text = (sweep / "records.csv").read_text()
    assert "50804039871846e7" in text and "00012345" in text and "e+20" not in text
    frame = pd.read_csv(sweep / "records.csv", dtype=str)
    assert sorted(set(frame["config_hash"])) == ["00012345", "50804039871846e7"]


@pytest.mark.extended
def test_a_sweep_and_a_run_never_write_into_each_others_folder(tmp_path: Path) -> None:
    """A sweep's merge would replace a run's records.csv, and a run would replace a sweep's merged
    table: either is refused in one line, and both folders stay as they were."""
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    assert run_py(*TINY, *CSV, f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    assert run_py("-m", *TINY, *CSV, f"hydra.sweep.dir={sweep}", cwd=tmp_path).returncode == 0
    before = snapshot(tmp_path)
    into_run = run_py("-m", *TINY, *CSV, "backward=bptt", f"hydra.sweep.dir={run}", cwd=tmp_path)
    assert into_run.returncode == 2
    assert one_line_error(into_run).endswith(
        f"hydra.sweep.dir={run} holds a single run's results; accepted: a new folder, or the folder of a "
        "sweep"
    )
    into_sweep = run_py(*TINY, *CSV, f"hydra.run.dir={sweep}", cwd=tmp_path)
    assert into_sweep.returncode == 2
    assert "holds a sweep's results; accepted: a new folder, or the folder of a run" in one_line_error(
        into_sweep
    )
    assert snapshot(tmp_path) == before


@pytest.mark.extended
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "name=.."], "name must be a name of letters, digits, '.', '_' and '-', with at least one"),
        (["name=."], "name must be a name of letters, digits"),
        (["-m", "hydra.sweep.dir="], "hydra.sweep.dir is empty; accepted: a folder path"),
        (["hydra.run.dir="], "hydra.run.dir is empty; accepted: a folder path"),
        (["name=${oops}"], "Interpolation key 'oops' not found"),
        (["-m", "name=${oops}"], "Interpolation key 'oops' not found"),
        (
            ["-m", "hydra.sweep.dir=s", "hydra.sweep.subdir="],
            "every job would write into the sweep folder itself",
        ),
        (
            ["-m", "hydra.sweep.dir=s/t", "hydra.sweep.subdir=.."],
            "hydra.sweep.subdir=..: the jobs would write outside the sweep folder; accepted: a folder name",
        ),
        (
            ["-m", "hydra.sweep.dir=s", "hydra.sweep.subdir=../x"],
            "hydra.sweep.subdir=../x: the jobs would write outside the sweep folder",
        ),
    ],
)
def test_an_output_folder_that_would_be_the_current_one_or_above_it_is_refused(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "f").write_text("a file")
    (tmp_path / "records.csv").write_text("the user's own table\n")
    done = run_py(*args, *TINY, *CSV, cwd=tmp_path)  # -m first
    assert done.returncode == 2 and message in one_line_error(done)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "records.csv"]
    assert (tmp_path / "records.csv").read_text() == "the user's own table\n"


# --------------------------------------------------------------------------------- resume, re-run


@pytest.mark.extended
def test_resume_extends_the_epochs_and_another_configuration_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    here = [*TINY, *CSV, f"hydra.run.dir={run_dir}"]
    assert run_py(*here, cwd=tmp_path).returncode == 0
    before = snapshot(run_dir)
    first = pd.read_csv(run_dir / "records.csv")

    more = run_py(*here, "trainer.epochs=3", cwd=tmp_path)
    assert more.returncode == 2
    line = one_line_error(more)
    assert "holds a run of another configuration (trainer.epochs: 2 -> 3)" in line
    assert "trainer.resume=true to continue it" in line
    other = run_py(*here, "optimizer.lr=0.01", "trainer.resume=true", cwd=tmp_path)
    assert other.returncode == 2 and "optimizer.lr: 0.001 -> 0.01" in one_line_error(other)
    assert snapshot(run_dir) == before  # both refusals left the folder as it was

    extended = run_py(*here, "trainer.epochs=3", "trainer.resume=true", cwd=tmp_path)
    assert extended.returncode == 0, extended.stderr
    rows = pd.read_csv(run_dir / "records.csv", dtype={"config_hash": str, "comparison_key": str})
    assert rows["epoch"].tolist() == [1, 2, 3]
    assert rows.loc[:1, "loss"].tolist() == first["loss"].tolist()
    # the same run, extended: one identity for every epoch, the summary's too
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(rows["config_hash"]) == {summary["config_hash"]} and rows["comparison_key"].nunique() == 1
    fewer = run_py(
        *TINY, *CSV, f"hydra.run.dir={run_dir}", "trainer.epochs=1", "trainer.resume=true", cwd=tmp_path
    )
    assert fewer.returncode == 2
    assert "trainer.epochs=1 is below the 3 epochs the run in" in one_line_error(fewer)


@pytest.mark.extended
def test_a_second_run_in_a_busy_folder_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["dataset.seq_len=50", "dataset.num_samples=400", "trainer.epochs=100000", *CSV]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={run_dir}"]
    first = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while (records.read_json(run_dir / "summary.json") or {}).get("status") != "running":
            assert first.poll() is None, "the first run ended before it started training"
            time.sleep(0.1)
        second = run_py(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert second.returncode == 2
        assert f"{run_dir} is in use by another run" in one_line_error(second)
        assert first.poll() is None and records.read_json(run_dir / "summary.json")["status"] == "running"
    finally:
        first.kill()
        first.wait()


@pytest.mark.extended
def test_a_refused_command_leaves_a_completed_folder_untouched(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_py(*TINY, *CSV, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    before = snapshot(run_dir)
    for bad in (["trainer.batch_size=-1"], ["trainer.batch_size=abc"], ["dataset.num_samples=1"]):
        done = run_py(*TINY, *CSV, *bad, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert done.returncode == 2, bad
    assert snapshot(run_dir) == before and not (run_dir / ".hydra").exists()


@pytest.mark.extended
def test_a_corrupt_checkpoint_is_named_and_left_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_py(*TINY, *CSV, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    checkpoint = run_dir / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    before = snapshot(run_dir)
    done = run_py(
        *TINY, *CSV, "trainer.epochs=3", "trainer.resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path
    )
    assert done.returncode == 2
    assert f"cannot resume from {checkpoint}" in one_line_error(done)
    assert snapshot(run_dir) == before


@pytest.mark.extended
@pytest.mark.parametrize("resume", [False, True])
def test_a_completed_run_whose_records_were_deleted_runs_again(tmp_path: Path, resume: bool) -> None:
    run_dir = tmp_path / "run"
    here = [*TINY, *CSV, f"hydra.run.dir={run_dir}", f"trainer.resume={str(resume).lower()}"]
    assert run_py(*here, cwd=tmp_path).returncode == 0
    (run_dir / "records.csv").unlink()
    done = run_py(*here, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert pd.read_csv(run_dir / "records.csv")["epoch"].tolist() == [1, 2]


@pytest.mark.extended
def test_stale_temporaries_of_killed_writers_are_removed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = run_dir / f".records.csv.{dead.stdout.strip()}.tmp"
    stale.write_text("half a table")
    assert run_py(*TINY, *CSV, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    assert not stale.exists()


# ----------------------------------------------------------------------------- failures, one line


@pytest.mark.extended
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["optimizer.lr=${oops}"], "optimizer.lr: Interpolation key 'oops' not found"),
        (
            ["dataset.num_samples=1"],
            "dataset.num_samples=1 with dataset.train_fraction=0.64 leaves the test split",
        ),
        (
            ["dataset.train_fraction=0.999"],
            "dataset.num_samples=80 with dataset.train_fraction=0.999 leaves the test",
        ),
        (["trainer.seed=4294967296"], "trainer.seed must be an integer from 0 to 2^32 - 1, got 4294967296"),
        (["dataset.seed=-1"], "dataset.seed must be an integer from 0 to 2^32 - 1, got -1"),
        (
            ["name=a/b"],
            "name must be a name of letters, digits, '.', '_' and '-', with at least one letter, digit or "
            "'_', got 'a/b'",
        ),
        (["logger=wandb", "logger.mode=online"], "logger.mode=online needs a W&B API key"),
    ],
)
def test_values_that_would_crash_later_are_refused_in_one_line(tmp_path: Path, args, message) -> None:
    run_dir = tmp_path / "run"
    env = {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "no-netrc")}
    done = run_py(*TINY, *CSV, *args, f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    assert done.returncode == 2
    assert message in one_line_error(done)
    assert not run_dir.exists()


@pytest.mark.extended
def test_an_output_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    done = run_py(*TINY, *CSV, f"hydra.run.dir={blocker / 'run'}", cwd=tmp_path)
    assert done.returncode == 2
    assert (
        f"cannot write in {blocker} (it is not a folder); accepted: a folder you may write in"
        in one_line_error(done)
    )
    assert blocker.read_text() == "not a folder"


@pytest.mark.extended
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_a_run_folder_where_no_folder_can_be_made_is_refused_in_one_line(tmp_path: Path) -> None:
    """/proc takes no new folder, even from root, for whom the permission check passes: the folder's
    making then fails, said in the same one line with what is accepted."""
    done = run_py(*TINY, *CSV, "hydra.run.dir=/proc/bppsa-run", cwd=tmp_path)
    assert done.returncode == 2
    line = one_line_error(done)
    assert "/proc" in line and line.endswith("; accepted: a folder you may write in"), line


def test_a_write_that_fails_names_the_file_and_keeps_the_old_one(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "table.csv"
    target.write_text("complete")

    def full(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(WriteError, match=rf"cannot write {target}: No space left on device \(\d+ bytes free"):
        write_atomic(target, full)
    assert target.read_text() == "complete" and list(tmp_path.iterdir()) == [target]
    # torch.save reports a full disk as a bare stream error: the path is added
    monkeypatch.setattr(
        torch, "save", lambda *a: (_ for _ in ()).throw(RuntimeError("basic_ios::clear: iostream error"))
    )
    with pytest.raises(
        WriteError, match=rf"cannot write {tmp_path / 'c.pt'}: basic_ios::clear: iostream error"
    ):
        write_atomic(tmp_path / "c.pt", lambda p: torch.save({}, p))
    # a file where a folder must be: named as the cause, not as mkdir's "File exists"
    inside = target / "cache" / "x.pt"
    with pytest.raises(WriteError, match=rf"cannot write {inside}: {target} is a file, not a folder$"):
        write_atomic(inside, lambda p: p.write_text("x"))
    assert target.read_text() == "complete"


def test_a_run_whose_records_cannot_be_written_fails_naming_the_file(tmp_path: Path, monkeypatch) -> None:
    def no_room(path, rows):
        raise WriteError(f"cannot write {path}: No space left on device (0 bytes free there)")

    monkeypatch.setattr(records, "write_table", no_room)
    outcome = runner.run_job(composed(*TINY, *CSV), tmp_path)
    assert outcome.status == "failed" and not outcome.bad_input
    assert (
        outcome.error
        == f"cannot write {tmp_path / 'records.csv'}: No space left on device (0 bytes free there)"
    )
    assert records.read_json(tmp_path / "summary.json")["error"] == outcome.error


@pytest.mark.extended
def test_a_job_killed_at_any_point_leaves_whole_files(tmp_path: Path) -> None:
    """SIGKILL a run after it starts, several times at different moments, the last as soon as its
    first table is written: every file it leaves is whole (the summary parses; the records table
    holds epochs 1..k with no missing cell), and a resume completes the run."""
    run_dir = tmp_path / "run"
    args = [
        "dataset.seq_len=60",
        "dataset.num_samples=400",
        "trainer.epochs=4",
        *CSV,
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tables = []
    for delay in (0.5, 1.5, 3.0, None):  # None: once records.csv exists
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "run.py"), *args, "trainer.resume=true"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if delay is None:
            deadline = time.monotonic() + 120
            while (
                not (run_dir / "records.csv").exists() and proc.poll() is None and time.monotonic() < deadline
            ):
                time.sleep(0.01)
        else:
            time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if (run_dir / "summary.json").exists():
            assert records.read_json(run_dir / "summary.json") is not None
        if (run_dir / "records.csv").exists():
            table = pd.read_csv(run_dir / "records.csv")
            assert table["epoch"].tolist() == list(range(1, len(table) + 1))
            assert not table[["loss", "accuracy", "epoch_s", "wall_s"]].isna().any().any()
            tables.append(len(table))
    assert tables and tables[-1] >= 1  # a kill landed after the first table was written
    done = run_py(*args, "trainer.resume=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert pd.read_csv(run_dir / "records.csv")["epoch"].tolist() == [1, 2, 3, 4]


def test_a_running_summary_keeps_room_to_say_in_place_how_the_run_ended(tmp_path: Path) -> None:
    """The summary written as a run begins ends in ``SUMMARY_ROOM`` spaces, still one JSON object,
    so that on a full disk (no room for the atomic write's temporary file) how the run ended, with
    an error line and the finish time, is rewritten in place; a text beyond the file's blocks is not."""
    path = tmp_path / "summary.json"
    running = {"config": {"model": {"hidden_size": 20}}, "status": "running", "error": None}
    records.write_json(path, running, room=records.SUMMARY_ROOM)
    assert records.read_json(path) == running
    failed = {**running, "status": "failed", "error": "cannot write " + "x" * 3000, "finished": "now"}
    assert records.overwrite_json(path, failed) and records.read_json(path) == failed
    assert not records.overwrite_json(path, {**failed, "error": "x" * (path.stat().st_blocks * 512)})
    assert records.read_json(path) == failed
