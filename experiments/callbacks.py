"""Hydra callbacks: refuse a sweep before it writes anything (a launcher that cannot run here, an
IRMAS root every job would find missing or empty, a job whose configuration fails its checks), note
the folders Hydra is about to make or write into (so that a refusal leaves them as they were), merge
a sweep's run tables when the sweep ends, and say how its jobs went."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from experiments.config import ConfigError, check, one_line
from experiments.ranks import launched_follower
from experiments.records import (
    JOBS,
    LEDGER,
    RECORDS,
    SUMMARY,
    SWEEP_ID_VARIABLE,
    found_before,
    leave_as_found,
    ledger,
    merge_sweep,
    note_folder,
)
from experiments.schema import CONF, NAME

log = logging.getLogger(__name__)


# Hydra's record of a sweep's configuration, in the sweep folder.
MULTIRUN_FILE = "multirun.yaml"


class NoteFolders(Callback):
    """Before Hydra makes the run's or the sweep's folder: refuse one that cannot hold it (empty,
    not writable, or holding the other kind of results), and note what stands there
    (``records.note_folder``), so that a refusal can leave it as it was.

    A refusal exits here, with one line and status 2: Hydra turns a callback's exceptions into
    warnings and goes on.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        with _refusing():
            folder = _output_folder(
                config, "hydra.run.dir", (JOBS, LEDGER, MULTIRUN_FILE), "a sweep", "a run"
            )
        note_folder(folder)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with _refusing():
            _check_launcher(config)
            _check_irmas_root(config)
            _check_jobs(config)
            folder = _output_folder(config, "hydra.sweep.dir", (SUMMARY,), "a single run", "a sweep")
            try:
                subdir = str(config.hydra.sweep.subdir)
            except OmegaConfBaseException:  # it may need a job's overrides: those are checked per job
                subdir = "job"
            accepted = "accepted: a folder name per job (by default, the job's overrides name it)"
            if Path(subdir) == Path("."):
                raise HydraException(
                    f"hydra.sweep.subdir is {subdir!r}: every job would write into the sweep folder "
                    f"itself; {accepted}"
                )
            if Path(subdir).is_absolute() or ".." in Path(subdir).parts:
                raise HydraException(
                    f"hydra.sweep.subdir={subdir}: the jobs would write outside the sweep folder; "
                    f"{accepted} inside it"
                )
        note_folder(folder)


@contextlib.contextmanager
def _refusing() -> Iterator[None]:
    """A HydraException, or an interpolation that does not resolve, in the body ends the program:
    one line on stderr, status 2."""
    try:
        yield
    except (HydraException, OmegaConfBaseException) as exc:
        where = f"{exc.full_key}: " if getattr(exc, "full_key", None) else ""
        print(f"{Path(sys.argv[0]).name}: error: {where}{str(exc).strip().splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def _output_folder(config: DictConfig, key: str, others: tuple[str, ...], other: str, this: str) -> Path:
    """The folder ``key`` names for ``this`` (a run or a sweep); HydraException, in one line, if it
    is empty, cannot be written, or holds ``other``'s results (one of the files ``others``), which
    this one's records or merge would overwrite. The name is checked first: the default folders
    are named by it."""
    name = config.get("name")
    if not NAME.ok(name):
        raise HydraException(f"name must be {NAME.what}, got {name!r}")
    text = str(OmegaConf.select(config, key))
    if not text.strip():
        raise HydraException(f"{key} is empty; accepted: a folder path")
    folder = Path(text)
    root = folder
    while not root.exists() and root != root.parent:
        root = root.parent
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        why = "it is not a folder" if not root.is_dir() else "permission denied"
        raise HydraException(
            f"{key}={text}: cannot write in {root} ({why}); accepted: a folder you may write in"
        )
    if folder.is_dir() and any((folder / name).exists() for name in others):
        raise HydraException(
            f"{key}={text} holds {other}'s results; accepted: a new folder, or the folder of {this}"
        )
    return folder


def _check_launcher(config: DictConfig) -> None:
    """The SLURM launcher submits with SLURM's tools: without ``srun`` on the PATH (submitit's own
    test) it would fail inside the launcher with a traceback, after the sweep folder is made."""
    if _slurm(config) and shutil.which("srun") is None:
        raise HydraException(
            "hydra/launcher=slurm submits to a SLURM cluster, but srun is not on the PATH here; accepted: "
            "a machine of the cluster (its login node), or no hydra/launcher to run the sweep on this machine"
        )


def _slurm(config: DictConfig) -> bool:
    """Whether the sweep's jobs go to SLURM (``hydra/launcher=slurm``), not to this machine."""
    return str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "").endswith(
        ".SlurmLauncher"
    )


def _check_irmas_root(config: DictConfig) -> None:
    """A sweep whose every job reads the same IRMAS root, missing or without clips, would fail job by
    job with the same line: it is refused once, before any job, with that line. A sweep over the
    dataset or its root is left to its jobs (the others may run), and so is one sent to SLURM (its
    jobs may see folders this machine does not)."""
    irmas = OmegaConf.select(config, "dataset._target_", default=None) == "datasets.irmas.IRMAS"
    if not irmas or _slurm(config) or OmegaConf.is_missing(config.dataset, "root"):
        return  # a root not given is refused with every job's other checks (``_check_jobs``)
    root = config.dataset.root
    if root is None or _swept(config, {"dataset", "dataset.root"}):
        return
    from datasets.irmas import IRMASError, find_clips

    try:
        find_clips(root)
    except IRMASError as exc:
        raise HydraException(str(exc)) from exc


def _check_jobs(config: DictConfig) -> None:
    """Every job composed and its values in range (``experiments.config.check``) before the sweep
    writes anything (Hydra's sweeper composes them too, but after it has written the sweep's
    ``multirun.yaml``): a job that fails refuses the whole sweep with a single run's line."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    arguments = [f"{k}={v}" for k, v in params.items()]  # resolved, as the sweeper reads them
    arguments += _task(config)
    loader = GlobalHydra.instance().config_loader()
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    for batch in BasicSweeper.split_arguments(overrides, None):
        for job in batch:
            try:
                check(loader.load_sweep_config(master_config=config, sweep_overrides=list(job)))
            except InterpolationResolutionError:  # the job's to resolve, and to report if it cannot
                continue
            except (ConfigError, HydraException, OmegaConfBaseException) as exc:
                raise HydraException(one_line(exc, CONF)) from exc


def _task(config: DictConfig) -> list[str]:
    """The command line's overrides as typed (an interpolation in one is the job's to resolve)."""
    task = OmegaConf.select(config, "hydra.overrides.task", default=None)
    return list(OmegaConf.to_container(task, resolve=False)) if task else []


def _swept(config: DictConfig, keys: set[str]) -> bool:
    """Whether the sweep varies any of ``keys``: on the command line (``key=a,b``) or in a preset's
    ``hydra.sweeper.params``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    task = _task(config)
    varied = {
        o.get_key_element() for o in OverridesParser.create().parse_overrides(task) if o.is_sweep_override()
    }
    varied |= set(OmegaConf.select(config, "hydra.sweeper.params", default=None) or {})
    return bool(varied & keys)


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
        leave_as_found(folder, [MULTIRUN_FILE])
