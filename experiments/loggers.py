"""Run loggers: Weights & Biases (offline by default), or none; local records are written regardless.

W&B never blocks on the network: ``offline`` (the default) writes the run into the run folder for a
later ``wandb sync``, ``disabled`` turns every call into a no-op, and only ``logger.mode=online``
talks to a server. One W&B run per job, grouped by the sweep's name, with the resolved
configuration; it is always finished, with a non-zero exit code when the job failed.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


class LoggerError(ValueError):
    """A logger setting this machine cannot honour, said in one line."""


class RunLogger:
    """Sends per-epoch rows to W&B (kinds wandb and none); kind csv imports nothing."""

    def __init__(self, settings: dict, run_dir: Path, group: str, name: str, config: dict) -> None:
        self.run = None
        if settings["kind"] == "csv":
            return
        try:
            import wandb
        except ImportError:
            if settings["kind"] == "none":
                return
            raise LoggerError(
                "logger=wandb needs the wandb package, which is not installed here; "
                "accepted: logger=csv or logger=none"
            ) from None
        mode = "disabled" if settings["kind"] == "none" else settings["mode"]
        self.run = wandb.init(
            project=settings["project"],
            entity=settings.get("entity"),
            group=group,
            name=name,
            config=config,
            dir=str(run_dir),
            mode=mode,
            settings=wandb.Settings(silent=True),
        )

    def log(self, row: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=row.get("epoch"))

    def finish(self, failed: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
