"""Hydra callbacks: note the folders Hydra is about to make or write into (so that a refusal leaves
them as they were), merge a sweep's run tables when the sweep ends, and say how its jobs went."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.ranks import launched_follower
from experiments.records import (
    JOBS,
    RECORDS,
    SWEEP_ID_VARIABLE,
    found_before,
    leave_as_found,
    ledger,
    merge_sweep,
    note_folder,
)

log = logging.getLogger(__name__)


class NoteFolders(Callback):
    """Before Hydra makes the run's or the sweep's folder: note what stands there
    (``records.note_folder``), so that a refusal can leave it as it was."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        note_folder(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        note_folder(Path(config.hydra.sweep.dir))


class MergeResults(Callback):
    """At the end of a multirun: one ``records.csv`` and one ``jobs.csv`` in the sweep folder.

    The status line counts this sweep's jobs (the ledger they reported to), whatever other sweeps of
    the same name left in the folder; the command exits with status 0 only when every one of them
    completed (or had completed before and was skipped), else 1, naming the others.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if launched_follower():  # the leader's sweep is the one that writes
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_id = os.environ.get(SWEEP_ID_VARIABLE, "")
        jobs = ledger(sweep_dir, sweep_id) if sweep_dir.is_dir() else []
        if not jobs:
            print(f"sweep {sweep_dir}: no job of this sweep reported an outcome; nothing merged")
            sys.exit(1)
        merged, _ = merge_sweep(sweep_dir, sweep_id)
        done = [j for j in jobs if j["status"] in ("completed", "skipped")]
        skipped = sum(j["status"] == "skipped" for j in jobs)
        runs = merged["run"].nunique() if len(merged) else 0
        print(
            f"sweep {sweep_dir}: {len(done)} of {len(jobs)} jobs completed"
            f"{f' ({skipped} done before, skipped)' if skipped else ''}; {len(merged)} epoch rows of "
            f"{runs} runs in {sweep_dir / RECORDS if runs else '(no merged table)'}, job status in "
            f"{sweep_dir / JOBS}"
        )
        for job in jobs:
            if job not in done:
                print(f"  {job['run']}: {job['status']}{': ' + job['error'] if job.get('error') else ''}")
        if len(done) < len(jobs):
            sys.exit(1)


def remove_refused_sweep() -> None:
    """A sweep whose jobs do not compose is refused whole, after Hydra has written its folder's
    multirun.yaml: the folder is left as it was found (``records.leave_as_found``)."""
    for folder in list(found_before):
        leave_as_found(folder, ["multirun.yaml"])
