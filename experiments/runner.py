"""One job of ``run.py``: check the configuration, train, and record the results in the run folder.

The run folder (Hydra's output directory) receives, all written atomically:

* ``records.csv``: one row per finished epoch (rewritten after each epoch, so a killed run keeps
  what it finished), with the configuration's key values and the device on every row;
* ``summary.json``: resolved configuration and its hash, git commit and dirty flag, versions, device,
  status (``running``, ``completed`` or ``failed`` with its error), totals;
* ``checkpoint.pt``: model, optimizer and records after the last finished epoch, for
  ``trainer.resume=true``.

A job whose folder already holds a completed summary of the same configuration hash is skipped.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from datasets.irmas import IRMASError
from experiments import records
from experiments.config import ConfigError, build, check
from experiments.hardware import HardwareError, check_strategy, describe, limit_workers, resolve_device
from experiments.loggers import LocalLogger, LoggerError
from experiments.train import (
    PHASES,
    Classifier,
    NonFiniteLossError,
    TrainState,
    evaluate,
    load_checkpoint,
    save_checkpoint,
    train_epoch,
)

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
# Problems with what the user asked for: one line, exit status 2, no run folder left behind.
BAD_INPUT = (ConfigError, HardwareError, LoggerError, IRMASError)


@dataclass
class Outcome:
    status: str  # completed | skipped | failed
    error: str | None = None
    bad_input: bool = False


def backward_options(cfg: DictConfig) -> dict:
    """The recurrent layer's keyword arguments of the backward group: ``backward`` and scan options."""
    options = OmegaConf.to_container(cfg.backward)
    return {"backward": options.pop("mode"), **options}


def identity_columns(
    cfg: DictConfig, model: Classifier, data: object, x: torch.Tensor, device: dict, chash: str
) -> dict:
    """What every record row says about its run: the swept keys and the machine."""
    return {
        "name": cfg.name,
        "config_hash": chash,
        "model": type(model.rnn).__name__.lower(),
        "hidden_size": cfg.model.hidden_size,
        "num_layers": cfg.model.num_layers,
        "dataset": data.name,
        "frames": cfg.dataset.get("frames"),
        "seq_len": x.shape[1],
        "features": x.shape[2],
        "batch_size": cfg.trainer.batch_size,
        "backward": cfg.backward.mode,
        "strategy": cfg.backward.get("strategy"),
        "chunk": cfg.backward.get("chunk"),
        "levels": cfg.backward.get("levels"),
        "lr": cfg.optimizer.lr,
        "workers": cfg.hardware.workers,
        **{k: device.get(k) for k in ("device_name", "device_type", "sm_total", "sm_used", "threads_used")},
    }


@dataclass
class Job:
    """What the epoch loop works with."""

    model: Classifier
    optimizer: torch.optim.Optimizer
    train: DataLoader
    test: DataLoader
    device: torch.device
    trainer: DictConfig
    run_dir: Path
    logger: LocalLogger
    columns: dict
    progress: bool


def run_job(cfg: DictConfig, run_dir: Path, record_refused: bool = False) -> Outcome:
    """Run one configuration into ``run_dir``; never raises for the job's own failures.

    A run refused for bad input writes nothing, unless ``record_refused`` (a sweep's job, which
    must show up as failed): then its summary says why.
    """
    run_dir = Path(run_dir)
    try:
        check(cfg)
    except ConfigError as exc:
        if record_refused:
            refused = {"config": OmegaConf.to_container(cfg), "status": "failed", "error": str(exc)}
            records.write_json(run_dir / records.SUMMARY, refused)
        return Outcome("failed", str(exc), bad_input=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    chash = records.config_hash(config)
    previous = records.read_json(run_dir / records.SUMMARY)
    if previous and previous.get("status") == "completed" and previous.get("config_hash") == chash:
        log.info("skipping %s: already completed with the same configuration", run_dir)
        return Outcome("skipped")

    summary = {
        "config": config,
        "config_hash": chash,
        "git": records.git_info(REPO),
        "versions": records.versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "running",
        "error": None,
    }
    logger: LocalLogger | None = None
    started = False
    try:
        device = resolve_device(cfg.hardware.device)
        check_strategy(cfg.backward.mode, cfg.backward.get("strategy", "auto"), device)
        torch.manual_seed(cfg.trainer.seed)
        with limit_workers(device, cfg.hardware.workers) as used:
            summary["device"] = info = describe(device, used)
            data = build(cfg.dataset)
            train, test = data.loaders(cfg.trainer.batch_size, cfg.hardware.data_workers)
            x0, _ = next(iter(test if len(test.dataset) else train))
            layer = build(cfg.model, input_size=x0.shape[-1], batch_first=True, **backward_options(cfg))
            model = Classifier(layer, data.classes).to(device)
            optimizer = build(cfg.optimizer, params=model.parameters())
            state, rows = TrainState(), []
            checkpoint = run_dir / records.CHECKPOINT
            if cfg.trainer.resume and checkpoint.is_file() and (previous or {}).get("config_hash") == chash:
                state, rows = load_checkpoint(checkpoint, model, optimizer)
                log.info("resuming %s after epoch %d", run_dir, state.epoch)
            columns = identity_columns(cfg, model, data, x0, info, chash)
            logger = build(cfg.logger, run_dir=run_dir, group=cfg.name, name=run_dir.name, config=config)
            started = True
            records.write_json(run_dir / records.SUMMARY, summary)
            progress = sys.stderr.isatty() if cfg.hardware.progress == "auto" else bool(cfg.hardware.progress)
            job = Job(model, optimizer, train, test, device, cfg.trainer, run_dir, logger, columns, progress)
            _train(job, state, rows)
        summary.update(status="completed", totals=_totals(rows))
        return Outcome("completed")
    except BAD_INPUT as exc:
        summary.update(status="failed", error=str(exc))
        return Outcome("failed", str(exc), bad_input=not started)
    except KeyboardInterrupt:
        summary.update(status="interrupted")
        raise
    except Exception as exc:  # record any failure; the sweep goes on
        if not isinstance(exc, NonFiniteLossError):
            log.exception("run failed")
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        summary.update(status="failed", error=f"{type(exc).__name__}: {message}")
        return Outcome("failed", summary["error"])
    finally:
        summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if started or record_refused:
            records.write_json(run_dir / records.SUMMARY, summary)
        if logger is not None:
            logger.finish(failed=summary["status"] != "completed")


def _train(job: Job, state: TrainState, rows: list[dict]) -> None:
    """The epoch loop: train, evaluate, then record and checkpoint the epoch."""
    from tqdm import tqdm

    trainer = job.trainer
    epochs = range(state.epoch, trainer.epochs)
    for epoch in tqdm(epochs, desc="epochs", disable=not job.progress, file=sys.stderr):
        job.train.generator.manual_seed(trainer.seed * 1_000_003 + epoch)  # same order on resume
        row = train_epoch(
            job.model, job.optimizer, job.train, job.device, state, trainer.warmup_iters, job.progress
        )
        if trainer.eval and len(job.test.dataset):
            row["test_loss"], row["test_accuracy"] = evaluate(job.model, job.test, job.device)
        state.epoch = epoch + 1
        rows.append({**job.columns, **row})
        records.write_table(job.run_dir / records.RECORDS, rows)
        save_checkpoint(job.run_dir / records.CHECKPOINT, job.model, job.optimizer, state, rows)
        job.logger.log(row)


def _totals(rows: list[dict]) -> dict:
    if not rows:
        return {}
    last = rows[-1]
    return {
        "epochs": last["epoch"],
        "wall_s": last["wall_s"],
        "final_loss": last["loss"],
        "final_accuracy": last["accuracy"],
        "final_test_accuracy": last.get("test_accuracy"),
        **{f"{p}_s": sum(r[f"{p}_s"] for r in rows) for p in PHASES},
        "timed_iterations": sum(r["timed_iterations"] for r in rows),
    }


def remove_if_only_hydra(run_dir: Path) -> None:
    """Delete a run folder that holds nothing but Hydra's own files (a run refused at the start)."""
    own = {".hydra", "run.log", f"{Path(sys.argv[0]).stem}.log"}
    if run_dir.is_dir() and all(p.name in own for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
