"""Run loggers (``conf/logger/``): Weights & Biases, offline by default, or local records only.

The run folder's records are written regardless (``experiments.records``); a logger only sends the
per-epoch rows elsewhere. W&B never blocks on the network: ``offline`` (the default) writes the run
into the run folder for a later ``wandb sync``, ``disabled`` never imports it, and only
``logger.mode=online`` talks to a server. One W&B run per job, grouped by the sweep's name, with
the resolved configuration; it is always finished, with a non-zero exit code when the job failed.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from toolbox.errors import SuiteError

log = logging.getLogger(__name__)


class LoggerError(SuiteError, ValueError):
    """A logger setting this machine cannot honour, said in one line."""


class LocalLogger:
    """Local records only (``logger=csv``): nothing is sent anywhere."""

    def __init__(self, run_dir: Path, group: str, name: str, config: dict) -> None:
        self.run = None

    def log(self, row: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=row.get("epoch"))

    def finish(self, failed: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


class WandbLogger(LocalLogger):
    """The rows also go to a W&B run in ``mode`` offline, online or disabled (W&B not imported)."""

    def __init__(
        self,
        run_dir: Path,
        group: str,
        name: str,
        config: dict,
        mode: str = "offline",
        project: str = "bppsa",
        entity: str | None = None,
    ) -> None:
        super().__init__(run_dir, group, name, config)
        if mode == "disabled":
            return
        if mode == "online" and not has_api_key():
            raise LoggerError(
                "logger.mode=online needs a W&B API key (WANDB_API_KEY, or `wandb login`), and there is "
                "none here; accepted: logger.mode=offline (sync later with `wandb sync`), logger=csv"
            )
        try:
            import wandb
        except ImportError:
            raise LoggerError(
                "logger=wandb needs the wandb package, which is not installed here; "
                "accepted: logger=csv, logger=none or logger.mode=disabled"
            ) from None
        self.run = wandb.init(
            project=project,
            entity=entity,
            group=group,
            name=name,
            config=config,
            dir=str(run_dir),
            mode=mode,
            settings=wandb.Settings(silent=True),
        )


def has_api_key() -> bool:
    """Whether W&B would find an API key: WANDB_API_KEY, or the netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
