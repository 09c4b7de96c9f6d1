"""run.py over several ranks (experiments.ranks): started by run.py itself or by torchrun, the same
training as one process, one writer, and one line on every rank when a launch does not add up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import ROOT, TINY, composed, run_py

from experiments.ranks import RankError, Ranks
from experiments.records import read_table

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# long enough that each rank's slice has steps, short enough for CI
SMALL = [
    "dataset.seq_len=12",
    "dataset.num_samples=64",
    "trainer.epochs=2",
    "trainer.warmup_iters=1",
    "logger=csv",
]


@pytest.mark.extended
def test_a_ranks_sweep_trains_as_one_process_does_and_resumes(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = run_py("-m", *SMALL, "hardware.ranks=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    merged = pd.read_csv(sweep / "records.csv")
    one, two = (merged[merged["ranks"] == r].set_index("epoch") for r in (1, 2))
    assert one.index.tolist() == two.index.tolist() == [1, 2]
    # the gradients agree to float32 rounding, so two epochs of Adam agree closely
    for column in ("loss", "test_loss", "initial_loss"):
        assert (abs(one[column] - two[column]) <= 1e-4 * abs(one[column])).all(), column
    assert (two["backward_s"] > 0).all() and two["model"].tolist() == ["rnn", "rnn"]
    folder = next(p.parent for p in sweep.glob("*/summary.json") if "ranks=2" in p.parent.name)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["hardware"]["ranks"] == 2
    assert sorted(p.name for p in folder.iterdir()) == [
        ".lock",
        "checkpoint.pt",
        "records.csv",
        "run.log",
        "summary.json",
    ]

    # the same parameter names whatever the rank count: a checkpoint loads in either
    checkpoints = {
        "ranks=2" in p.parent.name: torch.load(p, weights_only=False)["model"]
        for p in sweep.glob("*/checkpoint.pt")
    }
    assert list(checkpoints[True]) == list(checkpoints[False]) and "rnn.weight_hh_l0" in checkpoints[True]

    # one epoch on two ranks, resumed to two: the followers start from the leader's checkpoint
    run_dir = tmp_path / "resumed"
    first = run_py(*SMALL, "trainer.epochs=1", "hardware.ranks=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    args = (*SMALL, "trainer.resume=true", "hardware.ranks=2", f"hydra.run.dir={run_dir}")
    second = run_py(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    resumed = pd.read_csv(run_dir / "records.csv").set_index("epoch")
    assert abs(resumed.loc[2, "loss"] - two.loc[2, "loss"]) <= 1e-6 * two.loc[2, "loss"]


@pytest.mark.extended
def test_three_ranks_chained_train_as_one_process_does(tmp_path: Path) -> None:
    """``backward.exchange=chain``: no rank folds, each walks from the next rank's gradient; the
    middle rank's part is what two ranks do not exercise."""
    losses = {}
    for ranks, extra in ((1, []), (3, ["backward.exchange=chain"])):
        run_dir = tmp_path / f"ranks{ranks}"
        done = run_py(*SMALL, f"hardware.ranks={ranks}", *extra, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        losses[ranks] = pd.read_csv(run_dir / "records.csv").set_index("epoch")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["config"]["backward"]["exchange"] == ("chain" if extra else "auto")
    for column in ("loss", "test_loss"):
        assert (abs(losses[1][column] - losses[3][column]) <= 1e-4 * abs(losses[1][column])).all(), column


@pytest.mark.extended
def test_torchrun_launches_one_writer_and_records_the_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            *TORCHRUN,
            "--nproc-per-node",
            "2",
            str(ROOT / "run.py"),
            *TINY,
            "logger=csv",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "ranks=2" in done.stdout and done.stdout.count("epoch 2/2") == 1  # the leader alone speaks
    assert pd.read_csv(run_dir / "records.csv")["ranks"].tolist() == [2, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # the follower wrote nothing


@pytest.mark.extended
def test_slurm_tasks_run_as_ranks_of_one_run(tmp_path: Path) -> None:
    """What submitit's tasks see: SLURM's variables, one command each, one run folder."""
    run_dir = tmp_path / "run"
    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": str(os.getpid()),  # submitit derives the port from it
    }
    tasks = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "run.py"), *TINY, "logger=csv", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT), **slurm, "SLURM_PROCID": r, "SLURM_LOCALID": r},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ("0", "1")
    ]
    (out0, err0), (out1, err1) = (task.communicate(timeout=300) for task in tasks)
    assert [task.returncode for task in tasks] == [0, 0], err0 + err1
    assert "ranks=2" in out0 and "epoch" not in out1
    assert pd.read_csv(run_dir / "records.csv")["ranks"].tolist() == [2, 2]


@pytest.mark.extended
@pytest.mark.parametrize(
    ("args", "message", "every_rank"),
    [
        (
            ["dataset.seq_len=1"],
            "a sequence of 1 steps cannot be split over 2 ranks; accepted: hardware.ranks of at most 1",
            False,  # refused before the follower starts
        ),
        (
            ["backward.strategy=chunked"],
            "backward.strategy=chunked is not taken on 2 ranks",
            False,
        ),
        (
            ["model.forward_solver=newton"],
            "model.forward_solver=newton is not taken on 2 ranks",
            False,
        ),
        (["hardware.device=cuda:0"], "hardware.device 'cuda:0' would put every rank on one GPU", True),
    ],
)
def test_a_launch_that_does_not_add_up_fails_in_one_line_on_every_rank(
    tmp_path: Path, args: list[str], message: str, every_rank: bool
) -> None:
    run_dir = tmp_path / "run"
    done = run_py(*TINY, "logger=csv", "hardware.ranks=2", *args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert all(message in line for line in lines), lines
    expected = ["run.py (rank 1 of 2): error: ", "run.py: error: "] if every_rank else ["run.py: error: "]
    assert sorted(line[: line.index("error: ") + 7] for line in lines) == expected
    assert not run_dir.exists()


def test_a_sequence_shorter_than_its_ranks_is_refused_by_the_rank_count() -> None:
    """Where the configuration gives the length, ``rank_count`` refuses it, before ``run_job``
    starts any follower (64 of them would each start, build the data and say the same line)."""
    from experiments import runner

    with pytest.raises(runner.ConfigError, match=r"^a sequence of 10 steps cannot be split over 64 ranks; "):
        runner.rank_count(composed("dataset.seq_len=10", "hardware.ranks=64"), None)
    assert runner.rank_count(composed("dataset.seq_len=10", "hardware.ranks=10"), None) == 10


@pytest.mark.extended
def test_the_rank_count_must_be_a_positive_integer(tmp_path: Path) -> None:
    done = run_py(*TINY, "hardware.ranks=0", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "run.py: error: hardware.ranks must be a positive integer or null, got 0"


def _two_ranks_past_an_epoch(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int, Path]:
    """A two-rank run started by run.py, once its first epoch is recorded: the leader's process,
    the follower's pid and the run folder."""
    run_dir = tmp_path / "run"
    args = ["dataset.seq_len=50", "dataset.num_samples=400", "trainer.epochs=30", "logger=csv"]
    leader = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args, "hardware.ranks=2", *extra, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while read_table(run_dir / "records.csv") is None:
        assert leader.poll() is None, "the run ended before it finished an epoch"
        time.sleep(0.05)
    follower = next(pid for pid in _children(leader.pid) if "spawn_main" in _command(pid))
    return leader, follower, run_dir


def _failed_keeping_the_finished_epochs(run_dir: Path, error: str) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith(error)
    rows = pd.read_csv(run_dir / "records.csv")
    assert 1 <= len(rows) < 30 and rows["epoch"].tolist() == list(range(1, len(rows) + 1))


@pytest.mark.extended
def test_a_rank_that_dies_fails_the_run_in_one_line_and_keeps_the_finished_epochs(tmp_path: Path) -> None:
    leader, follower, run_dir = _two_ranks_past_an_epoch(tmp_path)
    os.kill(follower, signal.SIGKILL)
    _, stderr = leader.communicate(timeout=120)
    assert leader.returncode == 1
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith("run.py: error: a rank left the run (rank 0 of 2 saw: ")
    _failed_keeping_the_finished_epochs(run_dir, "a rank left the run")


@pytest.mark.extended
def test_a_rank_that_stops_fails_the_run_in_one_line_naming_it_and_keeps_the_finished_epochs(
    tmp_path: Path,
) -> None:
    """A follower stopped (SIGSTOP: alive, silent) would hold the leader in a collective until gloo's
    timeout; the heartbeats end the run after hardware.silent_rank_s, naming the rank, with the
    finished epochs kept and the stopped process killed."""
    leader, follower, run_dir = _two_ranks_past_an_epoch(tmp_path, "hardware.silent_rank_s=3")
    os.kill(follower, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, stderr = leader.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower, signal.SIGKILL)
    assert leader.returncode == 1 and time.monotonic() - stopped < 60
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert errors == ["run.py: error: rank 1 of 2 has not answered for 3 s (stopped or frozen); the run ends"]
    _failed_keeping_the_finished_epochs(run_dir, "rank 1 of 2 has not answered")
    gone = not Path(f"/proc/{follower}").exists()
    assert gone or Path(f"/proc/{follower}/stat").read_text().split()[2] == "Z"  # killed, not left stopped


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def _together(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ranks = Ranks(rank, 2)

        def fail() -> None:
            raise ValueError("no such file: data.wav")

        try:
            ranks.together(fail if rank == 1 else None, (ValueError,))
        except RankError as exc:
            Path(out).write_text(json.dumps([str(exc), exc.bad_input]))
        except ValueError as exc:
            assert rank == 1 and str(exc) == "no such file: data.wav"
        assert ranks.broadcast("go" if rank == 0 else None) == "go"
        assert ranks.gather(rank * 10) == [0, 10]
    finally:
        dist.destroy_process_group()


def test_a_failure_on_one_rank_reaches_every_rank_with_its_rank_and_words() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "said.json")
        mp.spawn(_together, args=(os.path.join(tmp, "store"), out), nprocs=2, join=True)
        assert json.loads(Path(out).read_text()) == ["rank 1 of 2: no such file: data.wav", True]
