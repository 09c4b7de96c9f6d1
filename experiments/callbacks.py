"""Hydra callbacks: merge a sweep's run tables when the sweep ends."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.records import JOBS, RECORDS, merge_sweep

log = logging.getLogger(__name__)


class MergeResults(Callback):
    """At the end of a multirun: one ``records.csv`` and one ``jobs.csv`` in the sweep folder.

    Failed jobs stay listed as failed in ``jobs.csv``; the others' rows are all kept. When any job
    failed, the process exits with status 1 after the merge.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        merged, jobs = merge_sweep(sweep_dir)
        bad = jobs[~jobs["status"].isin(["completed"])]
        print(
            f"sweep {sweep_dir}: {len(jobs) - len(bad)} of {len(jobs)} jobs completed; "
            f"{len(merged)} epoch rows in {sweep_dir / RECORDS}, job status in {sweep_dir / JOBS}"
        )
        if len(bad):
            for row in bad.itertuples():
                print(f"  {row.run}: {row.status}{': ' + row.error if isinstance(row.error, str) else ''}")
            sys.exit(1)
