"""Result records: atomic files, run summaries, provenance, and the merge of a sweep's tables.

A run folder holds ``records.csv`` (one tidy row per epoch, the configuration's key values repeated
on every row so merged tables describe themselves) and ``summary.json`` (resolved configuration,
its hash, git commit and dirty flag, versions, device, status, totals, and the error of a failed
run). Every file is written to a temporary name and renamed into place, so a killed run leaves the
last complete version, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import torch

from datasets.common import write_atomic

RECORDS = "records.csv"
SUMMARY = "summary.json"
CHECKPOINT = "checkpoint.pt"
JOBS = "jobs.csv"

# Keys that do not change what a run computes: they stay out of its identity hash.
NON_RESULT_KEYS = (("logger",), ("trainer", "resume"), ("hardware", "progress"), ("dataset", "cache_dir"))


def write_json(path: Path, payload: dict) -> None:
    write_atomic(path, lambda p: p.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str)))


def write_table(path: Path, rows: pd.DataFrame | Iterable[dict]) -> None:
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    write_atomic(path, lambda p: frame.to_csv(p, index=False))


def read_json(path: Path) -> dict | None:
    """The JSON object at ``path``, or None if missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def config_hash(config: dict) -> str:
    """Identity of a resolved configuration, less the keys in NON_RESULT_KEYS."""
    trimmed = json.loads(json.dumps(config, default=str))
    for keys in NON_RESULT_KEYS:
        node = trimmed
        for key in keys[:-1]:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(keys[-1], None)
    return hashlib.sha256(json.dumps(trimmed, sort_keys=True).encode()).hexdigest()[:16]


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
    """Versions of what the results depend on."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("hydra", "omegaconf", "pandas", "numpy", "librosa", "wandb"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # missing or broken: record that it was not there
            out[name] = None
    return out


def merge_sweep(sweep_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Merge the run folders under ``sweep_dir``: all epoch rows, and one status row per job.

    Writes ``records.csv`` and ``jobs.csv`` into ``sweep_dir``. Runs without a summary (killed
    before they wrote one) are listed with status "missing"; their finished epochs are kept.
    """
    sweep_dir = Path(sweep_dir)
    frames, jobs = [], []
    for run_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        summary = read_json(run_dir / SUMMARY)
        records = run_dir / RECORDS
        if summary is None and not records.is_file():
            continue
        jobs.append(
            {
                "run": run_dir.name,
                "status": "missing" if summary is None else summary.get("status"),
                "error": None if summary is None else summary.get("error"),
                "config_hash": None if summary is None else summary.get("config_hash"),
            }
        )
        if records.is_file():
            try:
                frames.append(pd.read_csv(records).assign(run=run_dir.name))
            except (OSError, ValueError, pd.errors.EmptyDataError):
                jobs[-1]["status"] = "unreadable records"
    merged = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    job_table = pd.DataFrame(jobs, columns=["run", "status", "error", "config_hash"])
    write_table(sweep_dir / RECORDS, merged)
    write_table(sweep_dir / JOBS, job_table)
    return merged, job_table
