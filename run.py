"""The suite's entry point: train a recurrent classifier with a BPPSA or BPTT backward.

    python run.py                                  # the main job: bitstream RNN, CPU-sized
    python run.py model=gru dataset=irmas dataset.root=/data/IRMAS-TrainingData
    python run.py -m experiment=rnn_seq_len         # a paper sweep (both backward modes)
    python run.py -m experiment=rnn_seq_len hydra/launcher=slurm hydra.launcher.partition=gpu

Configuration lives in conf/ (Hydra). Every run writes records.csv and summary.json into its
folder (outputs/<name>/<time>, or multirun/<name>/run_<overrides> in a sweep), and prints a
summary table. Bad input ends with one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments import ranks, records, schema  # noqa: F401  (schema: registers what the config files use)
from experiments.config import refusing_in_one_line
from experiments.runner import TERMINATED, follow, run_job, say_follower
from experiments.summary import print_summary

CONF = Path(__file__).resolve().parent / "conf"


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweeping = hc.mode == RunMode.MULTIRUN
    launch = ranks.launched()  # torchrun's or SLURM's processes, if they started this one
    if launch is not None and not launch.leader:  # a follower: the leader decides, writes and reports
        outcome = follow(launch)
        say_follower(outcome, launch)
        if outcome.status == "interrupted":
            sys.exit(130)
        if not outcome.lockstep or (outcome.status in ("failed", "busy") and not sweeping):
            sys.exit(2 if outcome.bad_input else 1)
        return
    outcome = run_job(cfg, run_dir, launch)
    line = f"{outcome.status}{': ' + outcome.error if outcome.error else ''}"
    if sweeping:  # the sweep goes on; its merge reports at the end
        sweep_id = os.environ.get(records.SWEEP_ID_VARIABLE, "unknown")
        records.report_job(Path(hc.sweep.dir), sweep_id, run_dir.name, outcome.status, outcome.error)
        print(f"job {run_dir.name}: {line}", flush=True)
    if outcome.status == "interrupted":
        print(f"run.py: {outcome.error}; {continuation(hc, run_dir, sweeping)}", file=sys.stderr)
        sys.exit(143 if outcome.error.startswith(TERMINATED) else 130)  # as a shell reports SIGTERM, SIGINT
    if not outcome.lockstep:  # the ranks parted at different places: the launch is over
        print(f"run.py: error: {outcome.error}", file=sys.stderr)
        sys.exit(1)
    if sweeping:
        return
    if outcome.status in ("failed", "busy"):
        print(f"run.py: error: {outcome.error}", file=sys.stderr)
        sys.exit(2 if outcome.bad_input else 1)
    print_summary(run_dir, skipped=outcome.status == "skipped")


def continuation(hc, run_dir: Path, sweeping: bool) -> str:
    """What was kept, and the command that goes on from it."""
    if sweeping:
        return (
            f"its finished epochs are kept in {run_dir}; run the same command again to go on (completed "
            "jobs are skipped; add trainer.resume=true to continue the interrupted ones where they stopped)"
        )
    kept = [p.name for p in (run_dir / n for n in (records.RECORDS, records.CHECKPOINT)) if p.exists()]
    overrides = [o for o in hc.overrides.task if not o.startswith("trainer.resume=")]
    command = " ".join(["python run.py", *overrides, "trainer.resume=true", f"hydra.run.dir={run_dir}"])
    return f"kept in {run_dir}: {', '.join(kept) or 'nothing yet'}; to continue: {command}"


def follower_arguments(argv: list[str]) -> list[str]:
    """A follower rank of torchrun writes and logs nothing: Hydra's folders go to a temporary
    folder, removed at exit, and its logging is off (the leader logs; a follower's failure is its
    one line on stderr)."""
    import atexit
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix="bppsa-follower-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    ours = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra/job_logging=", "hydra/hydra_logging=")
    kept = [a for a in argv if not a.startswith(ours)]
    return [
        *kept,
        f"hydra.run.dir={scratch}/run",
        f"hydra.sweep.dir={scratch}/sweep",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]


if __name__ == "__main__":
    os.environ[records.SWEEP_ID_VARIABLE] = uuid.uuid4().hex[:12]  # every job of a sweep reports to it
    if ranks.launched_follower():
        sys.argv = follower_arguments(sys.argv)
    with refusing_in_one_line("run.py", CONF):
        main()
