"""Result records: run summaries, provenance, the run folder's identity and lock, and sweep merges.

A run folder holds ``records.csv`` (one tidy row per epoch, the configuration's key values repeated
on every row so merged tables describe themselves), ``summary.json`` (resolved configuration, its
hash, git commit and dirty flag, versions, device, status, totals, and the error of a failed run)
and ``checkpoint.pt``. Every file is written to a temporary name and renamed into place
(``toolbox.files.write_atomic``), so a killed run leaves the last complete version, never half
of one; one process at a time works in a folder (``folder_lock``).

In a sweep (``multirun/<name>/``) every job has a folder named by its result-changing overrides
(``job_folder``) and reports its outcome to the sweep's ledger (``report_job``), so the merge knows
which jobs this sweep ran, whatever earlier or concurrent sweeps of the same name left there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from filelock import FileLock, Timeout

from toolbox.errors import SuiteError
from toolbox.files import nearest_folder, write_atomic

RECORDS = "records.csv"
SUMMARY = "summary.json"
CHECKPOINT = "checkpoint.pt"
JOBS = "jobs.csv"
LEDGER = ".sweeps"
LOCK = ".lock"

# Keys that do not change what a run computes: they stay out of its identity (the hash, the
# comparison with an earlier run in the same folder) and out of its folder name in a sweep.
NON_RESULT_KEYS = (
    ("name",),
    ("logger",),
    ("trainer", "resume"),
    ("hardware", "progress"),
    ("hardware", "silent_rank_s"),
    ("hardware", "data_workers"),
    ("dataset", "cache_dir"),
)
# Result keys that are not part of a run's identity (config_hash, comparison_key): how many epochs a
# run has is how far it has gone, not what it is.
IDENTITY_FREE = ("trainer.epochs",)
# Result keys added after runs were recorded, with the value that computes what those runs did: at
# that value a key is left out, so a run recorded before the key keeps its identity (a sweep rerun
# skips it, a resume takes it).
ADDED_KEYS = {"trainer.capture": False, "backward.exchange": "allgather", "hardware.flush_denormals": False}
# Result keys that change nothing in one process: left out where the run had one (its resolved
# ``hardware.ranks`` null), so a single-process run's identity does not depend on them.
RANKS_ONLY_KEYS = ("backward.exchange",)
# Overrides that name or place the sweep, not one of its jobs: left out of job folder names.
SWEEP_KEYS = ("name", "experiment", "sweep", "hydra")
# The model's keys of the forward solver (conf/forward/solver.yaml): BPPSA variants, as the backward's are.
SOLVER_KEYS = ("model.forward_solver", "model.newton_")
# The variable that carries the id of the sweep a job belongs to, from run.py to every job.
SWEEP_ID_VARIABLE = "BPPSA_SWEEP_ID"


class FolderBusyError(SuiteError, RuntimeError):
    """Another process works in this run folder."""


# Room a running run's summary keeps at its end (whitespace) for how the run ended (its status, an
# error line, the finish time) to be written in place (``overwrite_json``) once the disk is full.
SUMMARY_ROOM = 4096


def write_json(path: Path, payload: dict, room: int = 0) -> None:
    """``payload`` as JSON, atomically; ``room``: that many spaces after it, disk the file then holds
    for a longer text (``overwrite_json``)."""
    text = json.dumps(payload, indent=2, sort_keys=True, default=str) + ("\n" + " " * room if room else "")
    write_atomic(path, lambda p: p.write_text(text))


def overwrite_json(path: Path, payload: dict) -> bool:
    """Rewrite the JSON file at ``path`` in place, where ``write_json``'s temporary file found no
    room (a full disk): only when the new text takes no more of the disk's blocks than the file
    already holds (a running summary keeps ``SUMMARY_ROOM``), so the write cannot stop half-way.
    Whether it was written."""
    text = json.dumps(payload, indent=2, sort_keys=True, default=str).encode()
    try:
        held = path.stat().st_blocks * 512
        if len(text) > held:
            return False
        with open(path, "r+b") as f:
            f.write(text)
            f.truncate()
        return True
    except OSError:
        return False


def write_table(path: Path, rows: pd.DataFrame | Iterable[dict]) -> None:
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    write_atomic(path, lambda p: frame.to_csv(p, index=False))


def read_json(path: Path) -> dict | None:
    """The JSON object at ``path``, or None if missing or unreadable."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_table(path: Path) -> pd.DataFrame | None:
    """The CSV table at ``path`` as text, or None if missing, empty or unreadable. Text, so that a
    merge writes every cell back as it was: a hash of digits is not read as a number."""
    try:
        return pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return None


# ---------------------------------------------------------------------------------------- identity


def _result_keys(config: dict) -> dict[str, Any]:
    """The configuration as dotted keys, less NON_RESULT_KEYS, ADDED_KEYS at their old values and,
    in one process, RANKS_ONLY_KEYS."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if any(prefix[: len(k)] == k for k in NON_RESULT_KEYS):
            return
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, (*prefix, str(key)))
        else:
            flat[".".join(prefix)] = node

    walk(json.loads(json.dumps(config, default=str)), ())
    unused = RANKS_ONLY_KEYS if flat.get("hardware.ranks") is None else ()
    return {k: v for k, v in flat.items() if (k not in ADDED_KEYS or v != ADDED_KEYS[k]) and k not in unused}


def _identity_keys(config: dict) -> dict[str, Any]:
    """The keys that make a run's identity: its result keys less ``IDENTITY_FREE``. An epoch's
    results do not depend on how many epochs follow it (each epoch's order is seeded by its index),
    so a run extended to more epochs (``trainer.resume=true``) stays one run."""
    return {k: v for k, v in _result_keys(config).items() if k not in IDENTITY_FREE}


def config_hash(config: dict) -> str:
    """Identity of a resolved configuration, less the keys in NON_RESULT_KEYS and IDENTITY_FREE."""
    return hashlib.sha256(json.dumps(_identity_keys(config), sort_keys=True).encode()).hexdigest()[:16]


def comparison_key(config: dict) -> str:
    """What a BPTT and a BPPSA run must share to be compared: the configuration's identity less its
    backward group and the forward solver, which only a BPPSA run may change (``analysis.data.speedups``
    pairs runs by it)."""
    keys = {k: v for k, v in _identity_keys(config).items() if not k.startswith(("backward.", *SOLVER_KEYS))}
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def differing_keys(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    """The result-changing keys whose values differ between two configurations: key -> (before, after)."""
    a, b = _result_keys(before), _result_keys(after)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _is_sweep_key(key: str) -> bool:
    parts = tuple(re.split(r"[./]", key.lstrip("+~")))
    return parts[0] in SWEEP_KEYS or any(parts[: len(k)] == k for k in NON_RESULT_KEYS)


def job_folder(overrides: Sequence[str]) -> str:
    """A sweep job's folder name: its result-changing overrides, safe and unique for any value.

    Overrides in letters, digits and ``. _ = , + -`` make the name as they are (sorted, comma
    separated: ``run_backward=bptt,dataset.seq_len=100``); any other character (a ``/`` in a path, a
    space) is replaced and a hash of the exact text is appended, so two jobs never share a folder
    and no override value makes folders inside folders.
    """
    text = ",".join(sorted(o for o in overrides if not _is_sweep_key(o.split("=", 1)[0])))
    if not text:
        return "run"
    if re.fullmatch(r"[\w.=,+-]{1,120}", text, re.ASCII):
        return f"run_{text}"
    readable = re.sub(r"[^\w.=,+-]+", "_", text, flags=re.ASCII)[:80].strip("_")
    return f"run_{readable}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def sweep_folder(name: str, time: str) -> str:
    """A sweep's folder: ``multirun/<name>``, stable so a re-run skips finished jobs; or, for the
    default name ``main``, a folder of its own, ``multirun/main/<time>``."""
    safe = re.sub(r"[^\w.-]+", "_", str(name), flags=re.ASCII)
    return f"multirun/{safe}" if safe != "main" else f"multirun/main/{time}"


# ----------------------------------------------------------------------------------- folder upkeep


@contextlib.contextmanager
def folder_lock(folder: Path, wait: float = 0) -> Iterator[None]:
    """Hold ``folder``'s lock while the body runs; FolderBusyError if another process holds it for longer
    than ``wait`` seconds.

    The lock is an OS file lock (``filelock``): the system releases it when its process dies, so a
    killed run never leaves the folder locked.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / LOCK, timeout=wait)
    try:
        lock.acquire()
    except Timeout:
        raise FolderBusyError(
            f"{folder} is in use by another run; wait for it or use another folder"
        ) from None
    try:
        yield
    finally:
        lock.release()


@dataclass(frozen=True)
class Found:
    """What stood at a folder's path before Hydra made it or wrote into it (``note_folder``)."""

    held: frozenset[str] | None  # the names it held; None: it did not exist
    root: Path  # its deepest ancestor that existed (the folder itself when it existed)


# Folders noted before Hydra wrote into them, by resolved path.
found_before: dict[Path, Found] = {}


def note_folder(folder: Path) -> None:
    """Note what ``folder`` holds, or which of its ancestors exist, before Hydra makes or writes into
    it, so that a refused job or sweep can leave the disk as it was (``leave_as_found``)."""
    folder = Path(folder).resolve()
    root = nearest_folder(folder)
    held = frozenset(p.name for p in folder.iterdir()) if folder.is_dir() else None
    found_before[folder] = Found(held, root)


def leave_as_found(folder: Path, made: Iterable[str]) -> None:
    """After a refusal: a folder that existed loses the ``made`` files it did not hold before; one
    that did not (or was not noted) is removed if it holds nothing but ``made`` files, and so are the
    parents made for it that are left empty."""
    folder, made = Path(folder).resolve(), set(made)
    found = found_before.get(folder)
    if found is not None and found.held is not None:
        for name in made - found.held:
            (folder / name).unlink(missing_ok=True)
        return
    if not folder.is_dir() or not all(p.name in made for p in folder.iterdir()):
        return
    shutil.rmtree(folder, ignore_errors=True)
    parent = folder.parent
    while found is not None and parent != found.root and parent.is_relative_to(found.root):
        if any(parent.iterdir()):
            break
        parent.rmdir()
        parent = parent.parent


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files (``.<name>.<pid>.tmp``) that killed writers left in ``folder``."""
    removed = []
    for tmp in Path(folder).glob(".*.*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -------------------------------------------------------------------------------------- provenance


def git_info(repo: Path) -> dict:
    """Commit and dirty flag of the code that ran; nulls outside a git checkout."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def versions() -> dict:
    """Versions of what the results depend on, from the installed distributions: nothing is
    imported for it (a run with logger=csv never imports W&B)."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name, dist in (("hydra", "hydra-core"), ("omegaconf", "omegaconf"), ("pandas", "pandas"),
                       ("numpy", "numpy"), ("librosa", "librosa"), ("wandb", "wandb")):  # fmt: skip
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:  # not installed: record that it was not there
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------ sweeps


def report_job(sweep_dir: Path, sweep_id: str, run: str, status: str, error: str | None) -> None:
    """Put one job's outcome into the sweep's ledger (``.sweeps/<sweep id>/<run>.json``)."""
    write_json(
        Path(sweep_dir) / LEDGER / sweep_id / f"{run}.json", {"run": run, "status": status, "error": error}
    )


def ledger(sweep_dir: Path, sweep_id: str) -> list[dict]:
    """The outcomes this sweep's jobs reported, by folder name."""
    entries = [read_json(p) for p in sorted((Path(sweep_dir) / LEDGER / sweep_id).glob("*.json"))]
    return [e for e in entries if e is not None]


def merge_sweep(sweep_dir: Path, sweep_id: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Merge the completed runs under ``sweep_dir``; list every job folder and every job of this sweep.

    Writes ``records.csv`` (the epoch rows of every completed run, one run per configuration: the
    latest, should two folders hold the same configuration) and ``jobs.csv``: per folder the status
    of the run it holds, and for this sweep's jobs (``sweep_id``'s ledger) the outcome each reported
    (a refused job has no folder), its error, the configuration hash and a duplicate's original. A
    folder without completed results contributes no rows; with no completed run at all, no merged
    table is written (and a stale one is removed).
    """
    sweep_dir = Path(sweep_dir)
    reported = {e["run"]: e for e in ledger(sweep_dir, sweep_id)} if sweep_id else {}
    with folder_lock(sweep_dir, wait=600):  # a concurrent merge of the same sweep is short
        jobs, frames, latest = {}, {}, {}
        folders = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        for run_dir in folders:
            summary = read_json(run_dir / SUMMARY)
            table = read_table(run_dir / RECORDS)
            if summary is None and table is None:
                continue
            status = "missing summary" if summary is None else summary.get("status")
            if status == "completed" and table is None:
                status = "completed, records unreadable"
            chash = None if summary is None else summary.get("config_hash")
            error = None if summary is None else summary.get("error")
            jobs[run_dir.name] = {"run": run_dir.name, "status": status, "error": error, "config_hash": chash}
            if status == "completed":
                frames[run_dir.name] = table.assign(run=run_dir.name)
                finished = summary.get("finished") or ""
                if chash not in latest or finished >= latest[chash][0]:
                    latest[chash] = (finished, run_dir.name)
        for run, entry in reported.items():
            job = jobs.setdefault(run, {"run": run, "status": None, "error": None, "config_hash": None})
            job["outcome"] = entry["status"]
            job["error"] = entry.get("error") or job["error"]
        keep = {run for _, run in latest.values()}
        for job in jobs.values():
            if job["run"] in frames and job["run"] not in keep:
                job["duplicate_of"] = latest[job["config_hash"]][1]
        merged = pd.concat([frames[r] for r in sorted(keep)], ignore_index=True) if keep else pd.DataFrame()
        columns = ["run", "status", "outcome", "error", "config_hash", "duplicate_of"]
        job_table = pd.DataFrame([jobs[r] for r in sorted(jobs)], columns=columns)
        if keep:
            write_table(sweep_dir / RECORDS, merged)
        else:
            (sweep_dir / RECORDS).unlink(missing_ok=True)
        write_table(sweep_dir / JOBS, job_table)
    return merged, job_table
