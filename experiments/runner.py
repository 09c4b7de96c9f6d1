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

from bppsa_core import GRU, RNN
from datasets.bitstream import NUM_CLASSES, bitstream_loaders
from datasets.irmas import CLASSES, IRMASError, irmas_loaders
from experiments import records
from experiments.config import ConfigError, validate
from experiments.hardware import HardwareError, check_strategy, describe, limit_workers, resolve_device
from experiments.loggers import LoggerError, RunLogger
from experiments.train import (
    PHASES,
    Classifier,
    NonFiniteLossError,
    TrainState,
    evaluate,
    load_checkpoint,
    make_optimizer,
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


def make_loaders(cfg: DictConfig, batch_size: int, workers: int):
    """Train and test loaders of the configured dataset, and its class count."""
    d = cfg.dataset
    if d.kind == "bitstream":
        loaders = bitstream_loaders(d.seq_len, batch_size, d.num_samples, d.seed, d.train_fraction, workers)
        return (*loaders, NUM_CLASSES)
    loaders = irmas_loaders(d.root, d.frames, batch_size, d.cache_dir, None, d.train_fraction, d.seed)
    return (*loaders, len(CLASSES))


def make_layer(cfg: DictConfig, features: int) -> torch.nn.Module:
    """The configured recurrent layer (batch first) with the configured backward."""
    m, b = cfg.model, cfg.backward
    cls = GRU if m.kind == "gru" else RNN
    extra = {} if m.kind == "gru" else {"nonlinearity": m.nonlinearity}
    scan = {"strategy": b.strategy, "chunk": b.chunk, "levels": b.levels}
    return cls(
        features, m.hidden_size, num_layers=m.num_layers, batch_first=True, backward=b.mode, **scan, **extra
    )


def identity_columns(cfg: DictConfig, x: torch.Tensor, device_info: dict, chash: str) -> dict:
    """What every record row says about its run: the swept keys and the machine."""
    return {
        "name": cfg.name,
        "config_hash": chash,
        "model": cfg.model.kind,
        "hidden_size": cfg.model.hidden_size,
        "num_layers": cfg.model.num_layers,
        "dataset": cfg.dataset.kind,
        "frames": cfg.dataset.get("frames"),
        "seq_len": x.shape[1],
        "features": x.shape[2],
        "batch_size": cfg.trainer.batch_size,
        "backward": cfg.backward.mode,
        "strategy": cfg.backward.strategy if cfg.backward.mode == "bppsa" else None,
        "chunk": cfg.backward.chunk,
        "levels": cfg.backward.levels,
        "lr": cfg.trainer.lr,
        "workers": cfg.hardware.workers,
        **{
            k: device_info.get(k)
            for k in ("device_name", "device_type", "sm_total", "sm_used", "threads_used")
        },
    }


def run_job(cfg: DictConfig, run_dir: Path, record_refused: bool = False) -> Outcome:
    """Run one configuration into ``run_dir``; never raises for the job's own failures.

    A run refused for bad input writes nothing, unless ``record_refused`` (a sweep's job, which
    must show up as failed): then its summary says why.
    """
    run_dir = Path(run_dir)
    try:
        validate(cfg)
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
    logger: RunLogger | None = None
    started = False
    try:
        device = resolve_device(cfg.hardware.device)
        check_strategy(cfg.backward.mode, cfg.backward.strategy, device)
        torch.manual_seed(cfg.trainer.seed)
        with limit_workers(device, cfg.hardware.workers) as used:
            summary["device"] = info = describe(device, used)
            train, test, classes = make_loaders(cfg, cfg.trainer.batch_size, cfg.hardware.data_workers)
            x0, _ = next(iter(test if len(test.dataset) else train))
            model = Classifier(make_layer(cfg, x0.shape[-1]), classes).to(device)
            optimizer = make_optimizer(cfg.trainer.optimizer, model.parameters(), cfg.trainer.lr)
            state, rows = TrainState(), []
            checkpoint = run_dir / records.CHECKPOINT
            if cfg.trainer.resume and checkpoint.is_file() and (previous or {}).get("config_hash") == chash:
                state, rows = load_checkpoint(checkpoint, model, optimizer)
                log.info("resuming %s after epoch %d", run_dir, state.epoch)
            columns = identity_columns(cfg, x0, info, chash)
            logger = RunLogger(dict(cfg.logger), run_dir, cfg.name, run_dir.name, config)
            started = True
            records.write_json(run_dir / records.SUMMARY, summary)
            progress = sys.stderr.isatty() if cfg.hardware.progress == "auto" else bool(cfg.hardware.progress)
            _train(
                cfg, model, optimizer, train, test, device, state, rows, columns, run_dir, logger, progress
            )
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


def _train(
    cfg, model, optimizer, train, test, device, state, rows, columns, run_dir, logger, progress
) -> None:
    """The epoch loop: train, evaluate, then record and checkpoint the epoch."""
    from tqdm import tqdm

    epochs = range(state.epoch, cfg.trainer.epochs)
    for epoch in tqdm(epochs, desc="epochs", disable=not progress, file=sys.stderr):
        train.generator.manual_seed(cfg.trainer.seed * 1_000_003 + epoch)  # same order on resume
        row = train_epoch(model, optimizer, train, device, state, cfg.trainer.warmup_iters, progress)
        if cfg.trainer.eval and len(test.dataset):
            row["test_loss"], row["test_accuracy"] = evaluate(model, test, device)
        state.epoch = epoch + 1
        rows.append({**columns, **row})
        records.write_table(run_dir / records.RECORDS, rows)
        save_checkpoint(run_dir / records.CHECKPOINT, model, optimizer, state, rows)
        logger.log(row)


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
