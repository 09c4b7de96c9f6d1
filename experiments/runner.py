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

import contextlib
import logging
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.utils.data import DataLoader
from tqdm import tqdm

from bppsa_core.denormals import flush_denormals
from experiments import records
from experiments.config import ConfigError, build, check
from experiments.hardware import (
    HardwareError,
    LoadMeter,
    check_capture,
    check_data_workers,
    check_flush,
    check_sample_count,
    check_strategy,
    contended,
    describe,
    limit_workers,
    memory_cause,
    out_of_memory,
    resolve_device,
)
from experiments.loggers import LocalLogger, LoggerError
from experiments.ranks import Heartbeat, RankError, Ranks, first_line, left_the_run, started
from experiments.train import (
    PHASES,
    CheckpointError,
    Classifier,
    NonFiniteLossError,
    TrainState,
    capture_steps,
    evaluate,
    load_checkpoint,
    prime,
    save_checkpoint,
    train_epoch,
)
from toolbox.cli import Terminated, terminate_as_interrupt
from toolbox.errors import DataError, WriteError

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
    lockstep: bool = True  # every rank ended the job at the same place (else its process group is done)


def backward_options(cfg: DictConfig) -> dict:
    """The recurrent layer's keyword arguments of the backward group: ``backward`` and scan options
    (``exchange`` is the ranks', ``Classifier``'s)."""
    options = OmegaConf.to_container(cfg.backward)
    options.pop("exchange", None)
    return {"backward": options.pop("mode"), **options}


def identity_columns(
    cfg: DictConfig,
    config: dict,
    model: Classifier,
    data: object,
    x: torch.Tensor,
    device: dict,
    ranks: int = 1,
    origin: dict | None = None,
) -> dict:
    """What every record row says about its run: its identity, the swept keys, the machine, and the
    code that made it (``origin``: the summary's ``git`` and ``versions``), so that a table copied
    away from its run folders still names its commit (``analysis.data.provenance``)."""
    git, versions = (origin or {}).get("git") or {}, (origin or {}).get("versions") or {}
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
        "ranks": ranks,
        "capture": cfg.trainer.capture,
        "flush_denormals": cfg.hardware.flush_denormals,
        **{
            k: device.get(k)
            for k in ("device_name", "device_type", "sm_total", "sm_used", "cpu_cores", "threads_used")
        },
        "commit": git.get("commit"),
        "dirty": git.get("dirty"),
        "torch": versions.get("torch"),
        "python": versions.get("python"),
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
    logger: LocalLogger | None  # None on a follower rank, which writes nothing
    columns: dict
    progress: bool
    ranks: Ranks


def run_job(cfg: DictConfig, run_dir: Path, launch: Ranks | None = None) -> Outcome:
    """Run one configuration into ``run_dir``; never raises for the job's own failures.

    A job refused for bad input leaves the folder as it found it (a folder Hydra made for it alone
    is removed). ``launch``: the ranks torchrun or SLURM started, this process leading them
    (``experiments.ranks``); without one, ``hardware.ranks`` > 1 starts the followers here.
    """
    run_dir = Path(run_dir)
    try:
        with records.folder_lock(run_dir), terminate_as_interrupt():
            records.remove_stale_temporaries(run_dir)
            outcome = _run(cfg, run_dir, launch)
            if outcome.bad_input:
                records.leave_as_found(run_dir, (*HYDRA_FILES, records.LOCK))
            return outcome
    except records.FolderBusyError as exc:
        outcome = Outcome("busy", str(exc), bad_input=True)
        if launch is not None:  # the followers wait for the leader's decision
            launch.broadcast({"outcome": vars(outcome)})
        return outcome


SMALLER = "smaller dataset.seq_len, trainer.batch_size or model.hidden_size"  # what memory scales with
TERMINATED = "terminated (SIGTERM)"  # how an Outcome's error begins when SIGTERM stopped the run


def _holds_results(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (records.SUMMARY, records.RECORDS, records.CHECKPOINT))


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


def _run(cfg: DictConfig, run_dir: Path, launch: Ranks | None) -> Outcome:
    """The leader's job, inside its folder's lock: decide, tell the other ranks, and work."""
    previous = records.read_json(run_dir / records.SUMMARY)
    outcome: Outcome | None = None
    try:
        check(cfg)
        config = OmegaConf.to_container(cfg, resolve=True)
        size = rank_count(cfg, launch)
        config["hardware"]["ranks"] = size if size > 1 else None  # one process: null, as ever
        plan = _plan(cfg, config, previous, run_dir)
    except OmegaConfBaseException as exc:  # an interpolation that does not resolve
        where = f"{exc.full_key}: " if getattr(exc, "full_key", None) else ""
        outcome = Outcome("failed", f"{where}{str(exc).strip().splitlines()[0]}", bad_input=True)
    except (ConfigError, HardwareError) as exc:
        outcome = Outcome("failed", str(exc), bad_input=True)
    else:
        if plan == "skip":
            log.info("skipping %s: already completed with the same configuration", run_dir)
            outcome = Outcome("skipped")
    if outcome is not None:
        if launch is not None:  # the followers learn that there is nothing to do
            launch.broadcast({"outcome": vars(outcome)})
        return outcome
    if launch is not None:
        joined = contextlib.nullcontext(launch)
    elif size > 1:  # the followers start here, one process each
        joined = started(size, follow_started)
    else:
        joined = contextlib.nullcontext(Ranks())
    with joined as ranks:
        ranks.broadcast({"config": config})
        return _work(cfg, config, plan, run_dir, ranks)


def follow(ranks: Ranks) -> Outcome:
    """A follower rank's share of a job (``experiments.ranks``): the leader's decision and
    configuration, then the same work in lockstep, writing nothing."""
    verdict = ranks.broadcast()
    if "outcome" in verdict:
        return Outcome(**verdict["outcome"])
    return _work(OmegaConf.create(verdict["config"]), verdict["config"], None, None, ranks)


def follow_started(ranks: Ranks) -> None:
    """A follower process that ``run_job`` started: its share of the job, and its failure in one line."""
    say_follower(follow(ranks), ranks)


def say_follower(outcome: Outcome, ranks: Ranks) -> None:
    """A follower's failure, in one line on stderr (the leader says its own)."""
    if outcome.status in ("failed", "busy"):
        print(f"run.py (rank {ranks.rank} of {ranks.size}): error: {outcome.error}", file=sys.stderr)


def rank_count(cfg: DictConfig, launch: Ranks | None) -> int:
    """How many ranks the job runs on: the launch's, or ``hardware.ranks``; refused, in one line,
    where they disagree or where the configuration cannot be split over ranks."""
    asked = cfg.hardware.get("ranks")
    if launch is not None and asked not in (None, launch.size):
        raise HardwareError(
            f"hardware.ranks={asked}, but this run was launched on {launch.size} processes; accepted: "
            f"{launch.size} or null"
        )
    size = launch.size if launch is not None else asked or 1
    steps = cfg.dataset.get("seq_len")
    if steps is not None and steps < size:  # before any rank starts
        raise unsplittable(steps, size)
    if size > 1:
        options = {k: v for k, v in cfg.backward.items() if k not in ("mode", "exchange")}
        fixed = {k: v for k, v in options.items() if v not in (None, "auto")}
        if fixed:
            key, value = next(iter(fixed.items()))
            raise ConfigError(
                f"backward.{key}={value} is not taken on {size} ranks (each rank runs the backward of "
                f"its slice as bppsa_core.distributed chooses); accepted: backward.{key}="
                f"{'auto' if key == 'strategy' else 'null'}, or hardware.ranks=1"
            )
        solver = cfg.model.get("forward_solver", "native")
        if solver != "native":
            raise ConfigError(
                f"model.forward_solver={solver} is not taken on {size} ranks (each rank runs the native "
                "forward of its slice); accepted: model.forward_solver=native, or hardware.ranks=1"
            )
        if cfg.trainer.capture:
            raise ConfigError(
                f"trainer.capture=true is not taken on {size} ranks (the ranks' exchanges are not captured); "
                "accepted: trainer.capture=false, or hardware.ranks=1"
            )
    return size


def unsplittable(steps: int, size: int) -> ConfigError:
    """The refusal of a sequence shorter than the ranks it would be split over."""
    return ConfigError(
        f"a sequence of {steps} steps cannot be split over {size} ranks; accepted: hardware.ranks of at "
        f"most {steps}, or longer sequences"
    )


def _work(cfg: DictConfig, config: dict, plan: str | None, run_dir: Path | None, ranks: Ranks) -> Outcome:
    """Build, train and record one job on every rank; only the leader (``run_dir``) writes.
    Never raises for the job's own failures."""
    lead = ranks.leader
    summary = {
        "config": config,
        "config_hash": records.config_hash(config),
        "git": records.git_info(REPO) if lead else None,
        "versions": records.versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "running",
        "error": None,
    }
    logger: LocalLogger | None = None
    started_run = False
    outcome = Outcome("failed")
    state = TrainState()

    def silent(message: str) -> None:
        """Another rank stopped answering (``Heartbeat``): say so, record the run failed (its
        finished epochs are written already) and end this process now, as the main thread may be
        waiting in a collective that only gloo's timeout would end; started followers are killed."""
        who = "run.py" if lead else f"run.py (rank {ranks.rank} of {ranks.size})"
        print(f"{who}: error: {message}", file=sys.stderr, flush=True)
        if lead and started_run:
            summary.update(status="failed", error=message, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            with contextlib.suppress(Exception):
                records.write_json(run_dir / records.SUMMARY, summary)
        for process in ranks.processes:
            process.kill()
        os._exit(1)

    token = ranks.broadcast(secrets.token_hex(8) if lead else None)
    heartbeat = Heartbeat(ranks, token, cfg.hardware.silent_rank_s, silent)
    heartbeat.start()
    try:
        device = resolve_device(cfg.hardware.device, local_rank=ranks.local_rank if ranks.size > 1 else None)
        check_strategy(cfg.backward.mode, cfg.backward.get("strategy", "auto"), device)
        check_capture(cfg.trainer.capture, device, cfg.hardware.device)
        check_flush(cfg.hardware.flush_denormals, device)
        check_data_workers(cfg.hardware.data_workers)
        check_sample_count(cfg.dataset.get("num_samples"), cfg.dataset.get("train_fraction", 1.0))
        torch.manual_seed(cfg.trainer.seed)
        with limit_workers(device, cfg.hardware.workers) as used:
            summary["device"] = info = describe(device, used)
            data = ranks.together((lambda: build(cfg.dataset)) if lead else None, BAD_INPUT)
            if ranks.size > 1:  # the followers build theirs after the leader, from any cache it wrote
                built = ranks.together(None if lead else (lambda: build(cfg.dataset)), BAD_INPUT)
                data = data if lead else built
            train, test = data.loaders(cfg.trainer.batch_size, cfg.hardware.data_workers)
            x0, _ = next(iter(test if len(test.dataset) else train))
            layer = build(cfg.model, input_size=x0.shape[-1], batch_first=True, **backward_options(cfg))
            if x0.shape[1] < ranks.size:  # a length the configuration does not give (IRMAS frames)
                raise unsplittable(x0.shape[1], ranks.size)
            split = (ranks.rank, ranks.size) if ranks.size > 1 else None
            exchange = cfg.backward.get("exchange", "auto")
            model = Classifier(layer, data.classes, split, exchange).to(device)
            optimizer = build(cfg.optimizer, params=model.parameters())
            for group in optimizer.param_groups if cfg.trainer.capture else ():
                if "capturable" in group:  # Adam's: its step count on the device, read there
                    group["capturable"] = True
            rows: list[dict] = []
            resume = (lambda: _resume(cfg, config, run_dir, model, optimizer)) if plan == "resume" else None
            resumed = ranks.together(resume, BAD_INPUT)
            if resumed:
                state, rows = resumed
            if ranks.size > 1:  # every rank starts from the leader's weights, optimizer and counters
                shared = ranks.broadcast(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": vars(state)}
                    if lead
                    else None
                )
                if not lead:
                    model.load_state_dict(shared["model"])
                    optimizer.load_state_dict(shared["optimizer"])
                    state = TrainState(**shared["state"])
            columns = identity_columns(cfg, config, model, data, x0, info, ranks.size, summary)
            logger = ranks.together(
                (lambda: _begin(cfg, config, run_dir, summary)) if lead else None, BAD_INPUT
            )
            started_run = True
            progress = sys.stderr.isatty() if cfg.hardware.progress == "auto" else bool(cfg.hardware.progress)
            progress = progress and lead
            job = Job(
                model, optimizer, train, test, device, cfg.trainer, run_dir, logger, columns, progress, ranks
            )
            with flush_denormals(device) if cfg.hardware.flush_denormals else contextlib.nullcontext():
                _train(job, state, rows)
        summary.update(status="completed", totals=_totals(rows))
        outcome = Outcome("completed")
    except BAD_INPUT as exc:
        summary.update(status="failed", error=str(exc))
        outcome = Outcome("failed", str(exc), bad_input=not started_run)
    except RankError as exc:  # agreed by every rank
        summary.update(status="failed", error=str(exc))
        outcome = Outcome("failed", str(exc), bad_input=exc.bad_input and not started_run)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: finished epochs kept; the caller says what next
        summary.update(status="interrupted")
        how = TERMINATED if isinstance(exc, Terminated) else "interrupted"
        outcome = Outcome("interrupted", f"{how} after epoch {state.epoch} of {cfg.trainer.epochs}")
    except Exception as exc:  # record any failure; the sweep goes on
        left = left_the_run(exc, ranks)
        if not isinstance(exc, NonFiniteLossError | WriteError) and left is None and not out_of_memory(exc):
            log.exception("run failed")
        message = first_line(exc)
        if left is not None:
            message = str(left)
        elif out_of_memory(exc):  # sizes too large for this machine, not a bug
            message = f"out of memory: {memory_cause(exc)}; accepted: {SMALLER}"
        elif not isinstance(exc, WriteError):
            message = f"{type(exc).__name__}: {message}"
        summary.update(status="failed", error=message)
        # a loss that is not finite is the same on every rank; after any other failure the ranks
        # may be at different places, so the process group is done with
        outcome = Outcome("failed", message, lockstep=ranks.size == 1 or isinstance(exc, NonFiniteLossError))
    finally:
        heartbeat.stop()
        summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if logger is not None:
            logger.finish(failed=summary["status"] != "completed")
        # a run that failed before it began (out of memory building the model) is recorded as well,
        # in a folder of its own; an earlier run's summary in the folder is left as it was
        failed_early = plan == "new" and summary["status"] == "failed" and not outcome.bad_input
        if lead and (started_run or failed_early):
            try:
                records.write_json(run_dir / records.SUMMARY, summary)
            except WriteError as exc:
                outcome = Outcome("failed", str(exc))
                if summary["status"] != "running":  # a full disk: still say how the run ended, if it fits
                    records.overwrite_json(run_dir / records.SUMMARY, summary)
    return outcome


def _resume(
    cfg: DictConfig, config: dict, run_dir: Path, model: Classifier, optimizer
) -> tuple[TrainState, list[dict]]:
    """The state and records of the run in ``run_dir``, loaded into the model and optimizer; its
    rows keyed by ``config``'s identity (a run extended to more epochs is the same run: rows written
    under an identity that still counted the epochs take the one without)."""
    state, rows = load_checkpoint(run_dir / records.CHECKPOINT, model, optimizer)
    identity = {"config_hash": records.config_hash(config), "comparison_key": records.comparison_key(config)}
    rows = [{**row, **{k: v for k, v in identity.items() if k in row}} for row in rows]
    if state.epoch > cfg.trainer.epochs:
        raise ConfigError(
            f"trainer.epochs={cfg.trainer.epochs} is below the {state.epoch} epochs the run in "
            f"{run_dir} already finished; accepted: {state.epoch} or more"
        )
    log.info("resuming %s after epoch %d", run_dir, state.epoch)
    records.write_table(run_dir / records.RECORDS, rows)  # what it holds, should the table be lost
    return state, rows


def _begin(cfg: DictConfig, config: dict, run_dir: Path, summary: dict) -> LocalLogger:
    """The run's logger, and its summary written as running."""
    logger = build(cfg.logger, run_dir=run_dir, group=cfg.name, name=run_dir.name, config=config)
    records.write_json(run_dir / records.SUMMARY, summary, room=records.SUMMARY_ROOM)
    return logger


def _train(job: Job, state: TrainState, rows: list[dict]) -> None:
    """The epoch loop: train, evaluate, then record and checkpoint the epoch; one line per epoch."""
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
    captured = None
    if state.epoch < trainer.epochs and len(job.train):
        prime(job.model, job.train, job.device)
        if trainer.capture:
            captured = capture_steps(job.model, job.optimizer, job.train, job.device)
    # the other ranks on this machine are this run's work, not other work
    threads = (job.columns.get("threads_used") or 0) * job.ranks.local_size
    cores = job.columns.get("cpu_cores")
    for epoch in tqdm(
        range(state.epoch, trainer.epochs), desc="epochs", disable=not job.progress, file=sys.stderr
    ):
        job.train.generator.manual_seed(trainer.seed * 1_000_003 + epoch)  # same order on resume
        meter = LoadMeter()
        row = train_epoch(
            job.model, job.optimizer, job.train, job.device, state, trainer.warmup_iters, job.progress,
            captured,
        )  # fmt: skip
        row["other_load"] = meter.other_cores(job.ranks.siblings_seconds(meter.own_seconds()))
        row["contended"] = bool(threads and cores and contended(row["other_load"], threads, cores))
        row["initial_loss"] = state.initial_loss
        if trainer.eval and len(job.test.dataset):
            row["test_loss"], row["test_accuracy"] = evaluate(job.model, job.test, job.device)
            if not math.isfinite(row["test_loss"]):  # no result: the run fails before recording the epoch
                raise NonFiniteLossError(
                    f"test loss became {row['test_loss']} at epoch {epoch + 1}: the test data or the model "
                    "holds values that are not finite; the run stops"
                )
        state.epoch = epoch + 1
        rows.append({**job.columns, **row})
        job.ranks.together((lambda: _record(job, state, rows)) if job.ranks.leader else None)


def _record(job: Job, state: TrainState, rows: list[dict]) -> None:
    """The leader's work after an epoch: its records, checkpoint, log and line."""
    row = rows[-1]
    records.write_table(job.run_dir / records.RECORDS, rows)
    save_checkpoint(job.run_dir / records.CHECKPOINT, job.model, job.optimizer, state, rows)
    job.logger.log(row)
    tqdm.write(epoch_line(row, job.trainer.epochs, job.trainer.warmup_iters), file=sys.stdout)
    if row["contended"]:
        log.warning(
            "epoch %d: other work kept %.1f of the %d cores busy while this run's ranks used %d threads; "
            "its timings are suspect (analysis leaves such epochs out)",
            row["epoch"],
            row["other_load"],
            job.columns.get("cpu_cores"),
            job.columns.get("threads_used") * job.ranks.local_size,
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
