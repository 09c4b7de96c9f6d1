"""Fault injection (``-m extended``): kills at random moments, concurrent writers, a full disk, damaged
caches. Whatever happens, finished results stay whole and a resumed run ends where an
uninterrupted one does."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT, run_py, write_tree

from datasets.irmas import extract
from experiments import records

pytestmark = pytest.mark.extended

RUN = ["dataset.seq_len=40", "dataset.num_samples=480", "trainer.epochs=5", "logger=csv"]
MEASURED = [
    "forward_s",
    "backward_s",
    "step_s",
    "epoch_s",
    "wall_s",
    "samples_per_s",
    "other_load",
    "contended",
]


def start(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "run.py"), *args]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_kills_at_random_moments_then_resume_give_the_uninterrupted_records(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert run_py(*RUN, f"hydra.run.dir={reference}", cwd=tmp_path).returncode == 0
    theirs = pd.read_csv(reference / "records.csv").drop(columns=MEASURED)
    run_dir = tmp_path / "killed"
    rng = random.Random(0)
    for _ in range(8):
        proc = start(*RUN, "trainer.resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        time.sleep(rng.uniform(0.3, 4.0))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if (run_dir / "summary.json").exists():
            assert records.read_json(run_dir / "summary.json") is not None, "summary.json is not whole"
        if (run_dir / "records.csv").exists():  # whole rows: the uninterrupted run's first epochs
            kept = pd.read_csv(run_dir / "records.csv").drop(columns=MEASURED)
            pd.testing.assert_frame_equal(kept, theirs.iloc[: len(kept)])
    done = run_py(*RUN, "trainer.resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ours = pd.read_csv(run_dir / "records.csv").drop(columns=MEASURED)
    pd.testing.assert_frame_equal(ours, theirs)  # losses and accuracies bit for bit


def test_concurrent_writers_train_each_run_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    procs = [start(*RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path) for _ in range(3)]
    outs = [p.communicate() for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes.count(0) >= 1 and set(codes) <= {0, 2}
    for (_, err), proc in zip(outs, procs, strict=True):
        if proc.returncode == 2:
            assert "is in use by another run" in err
    # one trained; a writer that came after it found the run completed and skipped it
    finished = [out for (out, _), p in zip(outs, procs, strict=True) if p.returncode == 0]
    assert sum("skipped (already completed)" not in out for out in finished) == 1, outs
    assert pd.read_csv(run_dir / "records.csv")["epoch"].tolist() == [1, 2, 3, 4, 5]
    assert records.read_json(run_dir / "summary.json")["status"] == "completed"
    # two identical sweeps at once: every job trains once, in one of them
    sweep = tmp_path / "sweep"
    args = ["-m", *RUN, "trainer.epochs=2", "backward=bppsa,bptt", f"hydra.sweep.dir={sweep}"]
    sweeps = [start(*args, cwd=tmp_path) for _ in range(2)]
    for proc in sweeps:
        proc.communicate()
    outcomes = [
        e["status"] for d in (sweep / records.LEDGER).iterdir() for e in records.ledger(sweep, d.name)
    ]
    assert outcomes.count("completed") == 2 and set(outcomes) <= {"completed", "skipped", "busy"}
    assert len(pd.read_csv(sweep / "records.csv")) == 4


def test_a_full_disk_ends_the_run_in_one_line_naming_the_file(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("this machine does not let the tests mount a small tmpfs")
    try:
        done = run_py(*RUN, f"hydra.run.dir={disk / 'run'}", cwd=tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode in (1, 2) and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"run.py: error: cannot write {disk}")
        summary = disk / "run" / "summary.json"
        if summary.exists():  # written as running when the run began: it says how the run ended
            assert json.loads(summary.read_text())["status"] == "failed"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_damaged_caches_never_give_other_features(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", per_class=1)
    cache = tmp_path / "cache"
    reference = extract(tree, "l", cache, workers=1, progress=False)
    path = Path(reference.cache_path)
    whole = path.read_bytes()
    rng = random.Random(1)
    for _ in range(12):
        raw = bytearray(whole)
        if rng.random() < 0.25:
            raw = raw[: rng.randrange(len(raw))]  # truncated
        else:
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        data = extract(tree, "l", cache, workers=1, progress=False)
        assert torch.equal(data.features, reference.features) and data.files == reference.files
