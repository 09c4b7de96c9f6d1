"""One job of ``run.py``: check the configuration, train, and record the results in the run folder.

The run folder (Hydra's output directory) receives, all written atomically:

* ``records.csv``: one row per finished epoch (rewritten after each epoch, so a killed run keeps
  what it finished), with the configuration's key values and the device on every row;
* ``summary.json``: resolved configuration and its hash, git commit and dirty flag, versions, device,
  status (``running``, ``completed``, ``failed`` with its error, ``interrupted``), totals;
* ``checkpoint.pt``: model, optimizer and records after the last finished epoch, for
  ``trainer.resume=true``.

One process works in a folder at a time (``records.folder_lock``). What the folder already holds
decides what the job does: nothing, a new run; a completed run of the same configuration, a skip;
an unfinished run of the same configuration, a fresh start (or, with ``trainer.resume=true``, a
continuation from its last epoch, also to more epochs than before); a run of another configuration,
a refusal that names the keys that differ and leaves the folder as it was.
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
from omegaconf.errors import OmegaConfBaseException
from torch.utils.data import DataLoader

from datasets.common import DataError, WriteError
from experiments import records
from experiments.config import ConfigError, build, check
from experiments.hardware import (
    HardwareError,
    LoadMeter,
    check_strategy,
    contended,
    describe,
    limit_workers,
    resolve_device,
)
from experiments.loggers import LocalLogger, LoggerError
from experiments.train import (
    PHASES,
    CheckpointError,
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
BAD_INPUT = (ConfigError, HardwareError, LoggerError, DataError, CheckpointError)
# What Hydra leaves in a run folder before the job runs.
HYDRA_FILES = ("run.log", f"{Path(sys.argv[0]).stem}.log")


@dataclass
class Outcome:
    status: str  # completed | skipped | failed | interrupted | busy (another process works in the folder)
    error: str | None = None
    bad_input: bool = False  # refused before it trained: exit status 2


def backward_options(cfg: DictConfig) -> dict:
    """The recurrent layer's keyword arguments of the backward group: ``backward`` and scan options."""
    options = OmegaConf.to_container(cfg.backward)
    return {"backward": options.pop("mode"), **options}


def identity_columns(
    cfg: DictConfig, config: dict, model: Classifier, data: object, x: torch.Tensor, device: dict
) -> dict:
    """What every record row says about its run: its identity, the swept keys and the machine."""
    return {
        "name": cfg.name,
        "config_hash": records.config_hash(config),
        "comparison_key": records.comparison_key(config),
        "model": type(model.rnn).__name__.lower(),
        "hidden_size": cfg.model.hidden_size,
        "num_layers": cfg.model.num_layers,
        "dataset": data.name,
        "frames": cfg.dataset.get("frames"),
        "seq_len": x.shape[1],
        "features": x.shape[2],
        "batch_size": cfg.trainer.batch_size,
        "backward": cfg.backward.mode,
        "forward_solver": cfg.model.get("forward_solver", "native"),
        "strategy": cfg.backward.get("strategy"),
        "chunk": cfg.backward.get("chunk"),
        "levels": cfg.backward.get("levels"),
        "lr": cfg.optimizer.lr,
        "workers": cfg.hardware.workers,
        **{
            k: device.get(k)
            for k in ("device_name", "device_type", "sm_total", "sm_used", "cpu_cores", "threads_used")
        },
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


def run_job(cfg: DictConfig, run_dir: Path) -> Outcome:
    """Run one configuration into ``run_dir``; never raises for the job's own failures.

    A job refused for bad input leaves the folder as it found it (a folder Hydra made for it alone
    is removed).
    """
    run_dir = Path(run_dir)
    try:
        with records.folder_lock(run_dir):
            records.remove_stale_temporaries(run_dir)
            had_results = _holds_results(run_dir)
            outcome = _run(cfg, run_dir)
            if outcome.bad_input and not had_results:
                _remove_if_only_hydra(run_dir)
            return outcome
    except records.FolderBusyError as exc:
        return Outcome("busy", str(exc), bad_input=True)


def _holds_results(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (records.SUMMARY, records.RECORDS, records.CHECKPOINT))


def _remove_if_only_hydra(run_dir: Path) -> None:
    """Delete a run folder that holds nothing but Hydra's log and the folder lock."""
    if run_dir.is_dir() and all(p.name in (*HYDRA_FILES, records.LOCK) for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)


def _plan(cfg: DictConfig, config: dict, previous: dict | None, run_dir: Path) -> str:
    """What to do with what ``run_dir`` holds: "new", "skip", "restart" or "resume".

    Raises ConfigError, naming the keys that differ, when it holds a run of another configuration.
    """
    if previous is None:
        if _holds_results(run_dir):
            raise ConfigError(
                f"{run_dir} holds results without a {records.SUMMARY}, so their configuration is unknown; "
                "accepted: another folder (name=..., hydra.run.dir=...)"
            )
        return "new"
    resume = cfg.trainer.resume and (run_dir / records.CHECKPOINT).is_file()
    diff = records.differing_keys(previous.get("config") or {}, config)
    if not diff:
        if (
            previous.get("status") == "completed"
            and records.read_table(run_dir / records.RECORDS) is not None
        ):
            return "skip"
        return "resume" if resume else "restart"
    if set(diff) == {"trainer.epochs"} and resume:
        return "resume"
    changes = "; ".join(f"{key}: {a!r} -> {b!r}" for key, (a, b) in list(diff.items())[:6])
    changes += f"; and {len(diff) - 6} more" if len(diff) > 6 else ""
    hint = ", or trainer.resume=true to continue it" if set(diff) == {"trainer.epochs"} else ""
    raise ConfigError(
        f"{run_dir} holds a run of another configuration ({changes}); accepted: the same "
        f"configuration{hint}, or another folder (name=..., hydra.run.dir=...)"
    )


def _run(cfg: DictConfig, run_dir: Path) -> Outcome:
    """The job, inside its folder's lock."""
    previous = records.read_json(run_dir / records.SUMMARY)
    try:
        check(cfg)
        config = OmegaConf.to_container(cfg, resolve=True)
        plan = _plan(cfg, config, previous, run_dir)
    except OmegaConfBaseException as exc:  # an interpolation that does not resolve
        where = f"{exc.full_key}: " if getattr(exc, "full_key", None) else ""
        return Outcome("failed", f"{where}{str(exc).strip().splitlines()[0]}", bad_input=True)
    except ConfigError as exc:
        return Outcome("failed", str(exc), bad_input=True)
    if plan == "skip":
        log.info("skipping %s: already completed with the same configuration", run_dir)
        return Outcome("skipped")

    summary = {
        "config": config,
        "config_hash": records.config_hash(config),
        "git": records.git_info(REPO),
        "versions": records.versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "running",
        "error": None,
    }
    logger: LocalLogger | None = None
    started = False
    outcome = Outcome("failed")
    state = TrainState()
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
            rows: list[dict] = []
            if plan == "resume":
                state, rows = load_checkpoint(run_dir / records.CHECKPOINT, model, optimizer)
                if state.epoch > cfg.trainer.epochs:
                    raise ConfigError(
                        f"trainer.epochs={cfg.trainer.epochs} is below the {state.epoch} epochs the run in "
                        f"{run_dir} already finished; accepted: {state.epoch} or more"
                    )
                log.info("resuming %s after epoch %d", run_dir, state.epoch)
                records.write_table(
                    run_dir / records.RECORDS, rows
                )  # what it holds, should the table be lost
            columns = identity_columns(cfg, config, model, data, x0, info)
            logger = build(cfg.logger, run_dir=run_dir, group=cfg.name, name=run_dir.name, config=config)
            started = True
            records.write_json(run_dir / records.SUMMARY, summary)
            progress = sys.stderr.isatty() if cfg.hardware.progress == "auto" else bool(cfg.hardware.progress)
            job = Job(model, optimizer, train, test, device, cfg.trainer, run_dir, logger, columns, progress)
            _train(job, state, rows)
        summary.update(status="completed", totals=_totals(rows))
        outcome = Outcome("completed")
    except BAD_INPUT as exc:
        summary.update(status="failed", error=str(exc))
        outcome = Outcome("failed", str(exc), bad_input=not started)
    except KeyboardInterrupt:  # Ctrl-C: the finished epochs are kept, and the caller says how to go on
        summary.update(status="interrupted")
        outcome = Outcome("interrupted", f"interrupted after epoch {state.epoch} of {cfg.trainer.epochs}")
    except Exception as exc:  # record any failure; the sweep goes on
        if not isinstance(exc, NonFiniteLossError | WriteError):
            log.exception("run failed")
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        summary.update(
            status="failed",
            error=message if isinstance(exc, WriteError) else f"{type(exc).__name__}: {message}",
        )
        outcome = Outcome("failed", summary["error"])
    finally:
        summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if logger is not None:
            logger.finish(failed=summary["status"] != "completed")
        if started:
            try:
                records.write_json(run_dir / records.SUMMARY, summary)
            except WriteError as exc:
                outcome = Outcome("failed", str(exc))
    return outcome


def _train(job: Job, state: TrainState, rows: list[dict]) -> None:
    """The epoch loop: train, evaluate, then record and checkpoint the epoch; one line per epoch."""
    from tqdm import tqdm

    trainer = job.trainer
    if state.epoch == 0 and state.initial_loss is None:  # the loss curves' t = 0 (not timed)
        job.train.generator.manual_seed(trainer.seed * 1_000_003)
        state.initial_loss = evaluate(job.model, job.train, job.device)[0]
    if state.iteration == 0 and trainer.warmup_iters >= len(job.train):
        log.warning(
            "trainer.warmup_iters=%d covers all %d iterations of the first epoch: it has no timings",
            trainer.warmup_iters,
            len(job.train),
        )
    threads, cores = job.columns.get("threads_used"), job.columns.get("cpu_cores")
    for epoch in tqdm(
        range(state.epoch, trainer.epochs), desc="epochs", disable=not job.progress, file=sys.stderr
    ):
        job.train.generator.manual_seed(trainer.seed * 1_000_003 + epoch)  # same order on resume
        meter = LoadMeter()
        row = train_epoch(
            job.model, job.optimizer, job.train, job.device, state, trainer.warmup_iters, job.progress
        )
        row["other_load"] = meter.other_cores()
        row["contended"] = bool(threads and cores and contended(row["other_load"], threads, cores))
        row["initial_loss"] = state.initial_loss
        if trainer.eval and len(job.test.dataset):
            row["test_loss"], row["test_accuracy"] = evaluate(job.model, job.test, job.device)
        state.epoch = epoch + 1
        rows.append({**job.columns, **row})
        records.write_table(job.run_dir / records.RECORDS, rows)
        save_checkpoint(job.run_dir / records.CHECKPOINT, job.model, job.optimizer, state, rows)
        job.logger.log(row)
        tqdm.write(epoch_line(row, trainer.epochs, trainer.warmup_iters), file=sys.stdout)
        if row["contended"]:
            log.warning(
                "epoch %d: other work kept %.1f of the %d cores busy while this run used %d threads; "
                "its timings are suspect (analysis leaves such epochs out)",
                row["epoch"],
                row["other_load"],
                cores,
                threads,
            )


def epoch_line(row: dict, epochs: int, warmup_iters: int) -> str:
    """One line about a finished epoch: loss, accuracies, time, and the phases per timed iteration."""
    test = f", test accuracy {row['test_accuracy']:.3f}" if "test_accuracy" in row else ""
    line = f"epoch {row['epoch']}/{epochs}: loss {row['loss']:.4f}, accuracy {row['accuracy']:.3f}{test}"
    line += f"; {row['epoch_s']:.1f} s"
    timed = row["timed_iterations"]
    if timed:
        phases = ", ".join(f"{p} {1e3 * row[f'{p}_s'] / timed:.2f} ms" for p in PHASES)
        line += f"; per iteration {phases}"
    else:
        warmup = f"all {row['iterations']} were warm-up, trainer.warmup_iters={warmup_iters}"
        line += f"; no timed iteration ({warmup})"
    if row.get("newton_iterations"):
        its, fallbacks = row["newton_iterations"], row["newton_fallbacks"]
        line += f"; Newton {its:.1f} iterations per layer, {fallbacks} fallbacks"
    return line + ("; timings suspect: the machine was busy" if row.get("contended") else "")


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
