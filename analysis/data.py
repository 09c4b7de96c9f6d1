"""Reading result folders, and the speedups computed from them.

Reads only result files (``records.csv`` and ``summary.json`` as ``experiments.records`` writes
them): a sweep folder's merged table, or its run folders' tables when the sweep was cut short,
or a single run folder, or a CSV file.

Speedups follow the paper. A BPTT run and a BPPSA run are compared when everything but their
backward is the same: the same ``comparison_key`` (a hash of the whole resolved configuration
less the backward group, the forward solver and the keys that do not change results, written by
the runner), device, worker count and rank count; each BPPSA variant (strategy, chunk, levels, forward solver)
gets its own row. Records without a ``comparison_key`` are compared on every column that describes
their run (all but the measurements). Per comparison:

* overall = median epoch time of BPTT / median epoch time of BPPSA;
* backward = median backward time per timed iteration of BPTT / the same of BPPSA (BPPSA's
  Jacobian building happens inside its backward, so it is counted as backward work).

The spread is a 95 % bootstrap interval of the ratio of medians (resampling each side's epochs,
1000 draws, a fixed seed), so the same input always gives the same numbers; with fewer than
``MIN_INTERVAL_EPOCHS`` epochs on a side there is no interval, and a comparison without timed
iterations has no speedup: each such cell says why.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from toolbox.errors import SuiteError

# The columns every records table holds (REQUIRED), those that hold numbers first.
NUMERIC = (
    "seq_len",
    "batch_size",
    "epoch",
    "timed_iterations",
    "forward_s",
    "backward_s",
    "step_s",
    "epoch_s",
    "wall_s",
    "loss",
)
REQUIRED = ("model", "dataset", "backward", "device_name", *NUMERIC)
BACKWARDS = ("bppsa", "bptt")
# What identifies a comparison: the same configuration on the same device, backward aside.
CONFIG_KEYS = (
    "model",
    "dataset",
    "frames",
    "seq_len",
    "features",
    "batch_size",
    "hidden_size",
    "workers_used",
    "ranks",
    "device_name",
)
PHASES = ("forward", "backward", "step")
# Columns of an epoch row that measure the epoch or locate the file; every other column describes
# the run's configuration or machine.
MEASUREMENTS = (
    "epoch",
    "iterations",
    "timed_iterations",
    *(f"{p}_s" for p in PHASES),
    *(f"{p}_per_iter_s" for p in PHASES),
    "epoch_s",
    "wall_s",
    "loss",
    "accuracy",
    "samples_per_s",
    "newton_iterations",
    "newton_fallbacks",
    "test_loss",
    "test_accuracy",
    "run",
    "source",
    "name",
    "config_hash",
)
# Columns of names and hashes: read as text, so that a hash of digits is not taken for a number.
TEXT = ("name", "config_hash", "comparison_key", "commit", "run")
# The backward group's columns: what distinguishes the two sides and the BPPSA variants.
BACKWARD_COLUMNS = ("backward", "strategy", "chunk", "levels", "forward_solver")
BOOTSTRAP_DRAWS = 1000
# Fewer epochs than this on a side give a median but no interval: too few to estimate a spread.
MIN_INTERVAL_EPOCHS = 3
BOOTSTRAP_SEED = 0


class AnalysisError(SuiteError, ValueError):
    """Missing or malformed input, said in one line."""


def _tables_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    merged = path / "records.csv"
    if merged.is_file() and any(p.is_dir() and (p / "records.csv").is_file() for p in path.iterdir()):
        return [merged]  # a finished sweep: its merge holds every run
    if merged.is_file():
        return [merged]  # a single run folder
    return sorted(path.glob("*/records.csv"))  # a sweep cut short before its merge


def _refuse_first(frame: pd.DataFrame, path: Path, column: str, bad: pd.Series, accepted: str) -> None:
    """AnalysisError naming ``path``, ``column``, the first row where ``bad`` holds and its value."""
    if bad.any():
        row = int(bad.to_numpy().argmax())
        value = frame[column].iloc[row]
        shown = "empty" if pd.isna(value) else repr(value.item() if hasattr(value, "item") else value)
        raise AnalysisError(f"{path}: {column} is {shown} in row {row + 1}; accepted: {accepted}")


def _check_numbers(frame: pd.DataFrame, path: Path, columns: Sequence[str]) -> None:
    """Turn ``columns`` of a table read from ``path`` into numbers; AnalysisError naming the file,
    the column, the row and the value where one is not a number."""
    for column in columns:
        values = pd.to_numeric(frame[column], errors="coerce")
        _refuse_first(frame, path, column, values.isna() & frame[column].notna(), "a number")
        frame[column] = values


def require(
    frame: pd.DataFrame,
    path: Path,
    columns: Sequence[str],
    ok: Callable[[pd.Series], pd.Series],
    accepted: str,
) -> None:
    """AnalysisError naming ``path``, the column, the row and the value where a cell of ``columns``
    (numbers, see ``read_table``) fails ``ok``, a test of a whole column; an empty cell always fails."""
    for column in columns:
        bad = ~(ok(frame[column]).fillna(False).astype(bool)) | frame[column].isna()
        _refuse_first(frame, path, column, bad, accepted)


def finite_at_least_zero(values: pd.Series) -> pd.Series:
    return np.isfinite(values) & (values >= 0)


def whole_at_least(minimum: int) -> Callable[[pd.Series], pd.Series]:
    return lambda values: np.isfinite(values) & (values >= minimum) & (values == np.floor(values))


def require_flags(frame: pd.DataFrame, path: Path, column: str) -> None:
    """Turn ``column`` into booleans; AnalysisError naming the first cell that is not True or False."""
    flags = {True: True, False: False, "True": True, "False": False}
    require(frame, path, (column,), lambda v: v.map(flags).notna(), "True or False")
    frame[column] = frame[column].map(flags).astype(bool)


def require_rows(frame: pd.DataFrame, path: Path, what: str) -> None:
    """AnalysisError if the table read from ``path`` has a header and no rows."""
    if frame.empty:
        raise AnalysisError(f"{path} holds no rows; accepted: {what}")


def _check_records(frame: pd.DataFrame, path: Path) -> None:
    """What a run's epoch rows must hold for a speedup to mean anything."""
    require(frame, path, ("seq_len", "batch_size", "epoch"), whole_at_least(1), "a whole number >= 1")
    require(frame, path, ("timed_iterations",), whole_at_least(0), "a whole number >= 0")
    times = [c for c in NUMERIC if c.endswith("_s")]
    require(frame, path, times, finite_at_least_zero, "a finite number >= 0")
    require(frame, path, ("loss",), np.isfinite, "a finite number")
    if "contended" in frame.columns:  # older records lack it (an empty cell: not measured)
        frame["contended"] = frame["contended"].where(frame["contended"].notna(), False)
        require_flags(frame, path, "contended")


def read_table(
    path: Path,
    columns: Sequence[str],
    numeric: Sequence[str] = (),
    expected: str = "",
    rows_later: bool = False,
) -> pd.DataFrame | None:
    """A CSV table the analysis draws from: AnalysisError naming ``path`` when it cannot be read,
    lacks one of ``columns`` (asking whether it is the ``expected`` kind of file), or holds
    something other than a number in one of ``numeric``. ``rows_later``: a table without rows yet
    (a run that has not finished an epoch) is None instead of an error."""
    try:
        frame = pd.read_csv(path, dtype=dict.fromkeys(TEXT, str))
    except pd.errors.EmptyDataError:
        if rows_later:
            return None
        raise AnalysisError(
            f"{path} is empty; accepted: a table with the columns {', '.join(columns)}"
        ) from None
    except (OSError, ValueError) as exc:
        raise AnalysisError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    if rows_later and frame.empty:
        return None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        hint = f"; is it {expected}?" if expected else ""
        raise AnalysisError(f"{path} lacks the columns {', '.join(missing)}{hint}")
    _check_numbers(frame, path, numeric)
    return frame


def load_results(paths: Sequence[str | Path], keep_contended: bool = False) -> pd.DataFrame:
    """All epoch rows under ``paths``, one frame; raises AnalysisError naming what is wrong.

    Epochs measured while other work kept the machine busy (``contended``, see
    ``experiments.hardware.LoadMeter``) are left out unless ``keep_contended``; how many were is in
    ``data.attrs["contended_epochs"]``.
    """
    if not paths:
        raise AnalysisError(
            "no result paths given; accepted: sweep folders, run folders or records.csv files"
        )
    frames = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise AnalysisError(f"result path {str(path)!r} does not exist")
        try:
            tables = _tables_under(path)
        except OSError as exc:
            raise AnalysisError(f"cannot read {path}: {exc.strerror or exc}") from None
        if not tables:
            raise AnalysisError(
                f"no records.csv under {str(path)!r}; expected a sweep folder (multirun/<name>), "
                "a run folder, or a records.csv file"
            )
        for table in tables:
            frame = read_table(table, REQUIRED, NUMERIC, "a run's records.csv", rows_later=True)
            if frame is None:
                continue  # written before any epoch finished: no rows yet
            _check_records(frame, table)
            unknown = sorted(set(frame["backward"].dropna().astype(str)) - set(BACKWARDS))
            if unknown:
                raise AnalysisError(
                    f"{table}: unknown backward {unknown[0]!r}; accepted: {', '.join(BACKWARDS)}"
                )
            if "run" not in frame.columns:
                frame["run"] = table.parent.name
            frame["source"] = str(path)
            frames.append(frame)
    if not frames:
        raise AnalysisError("the result files hold no epoch rows yet")
    data = pd.concat(frames, ignore_index=True)
    # The same rows reached twice (a sweep folder and its merged table, a run folder and the sweep
    # that holds it) count once.
    data = data.drop_duplicates(subset=[c for c in data.columns if c != "source"], ignore_index=True)
    busy = data["contended"].fillna(False).astype(bool) if "contended" in data.columns else None
    dropped = 0 if busy is None or keep_contended else int(busy.sum())
    if dropped:
        data = data[~busy].reset_index(drop=True)
        if data.empty:
            raise AnalysisError(
                f"all {dropped} epochs were measured while the machine was busy; accepted: --keep-contended"
            )
    data.attrs["contended_epochs"] = dropped
    data["workers_used"] = _workers_used(data)
    data["ranks"] = data["ranks"].fillna(1) if "ranks" in data.columns else 1  # older records: one process
    for col in CONFIG_KEYS:
        if col not in data.columns:
            data[col] = np.nan
    for phase in PHASES:
        data[f"{phase}_per_iter_s"] = data[f"{phase}_s"] / data["timed_iterations"].where(
            data["timed_iterations"] > 0
        )
    return data


def _workers_used(data: pd.DataFrame) -> pd.Series:
    """CPU threads or GPU SMs the run used."""
    used = pd.Series(np.nan, index=data.index)
    for col in ("sm_used", "threads_used"):
        if col in data.columns:
            used = used.fillna(data[col])
    return used


def _bootstrap(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95 % interval of median(a) / median(b) over resampled epochs."""
    ra = np.median(rng.choice(a, (BOOTSTRAP_DRAWS, len(a))), axis=1)
    rb = np.median(rng.choice(b, (BOOTSTRAP_DRAWS, len(b))), axis=1)
    lo, hi = np.percentile(ra / rb, [2.5, 97.5])
    return float(lo), float(hi)


def comparison_columns(data: pd.DataFrame) -> list[str]:
    """The columns that must agree for a BPTT and a BPPSA run to be compared."""
    if "comparison_key" in data.columns and data["comparison_key"].notna().all():
        return ["comparison_key", "device_name", "workers_used", "ranks"]
    skip = set(MEASUREMENTS) | set(BACKWARD_COLUMNS) | {"comparison_key"}
    return [c for c in data.columns if c not in skip]


def speedups(data: pd.DataFrame) -> pd.DataFrame:
    """One row per comparison (configuration, device, BPPSA variant) with both a BPTT and a BPPSA run:
    the overall and backward speedups and their spreads."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    keys = comparison_columns(data)
    variant = [c for c in BACKWARD_COLUMNS[1:] if c in data.columns]
    shown = [c for c in (*CONFIG_KEYS, *variant) if c in data.columns]
    rows = []
    for _, group in data.groupby(keys, dropna=False, sort=True):
        bptt = group[group["backward"] == "bptt"]
        bppsa_runs = group[group["backward"] == "bppsa"]
        if bptt.empty or bppsa_runs.empty:
            continue
        parts = bppsa_runs.groupby(variant, dropna=False, sort=True) if variant else [(None, bppsa_runs)]
        for _, bppsa in parts:
            row = {k: bppsa[k].iloc[0] for k in shown}
            if "comparison_key" in group.columns:
                row["comparison_key"] = group["comparison_key"].iloc[0]
            for label, column in (("overall", "epoch_s"), ("backward", "backward_per_iter_s")):
                a, b = bptt[column].dropna().to_numpy(), bppsa[column].dropna().to_numpy()
                row.update({f"{label}_speedup": np.nan, f"{label}_lo": np.nan, f"{label}_hi": np.nan})
                if len(a) == 0 or len(b) == 0:
                    row[f"{label}_note"] = "no timed iteration (every iteration was warm-up)"
                    continue
                row[f"{label}_speedup"] = float(np.median(a) / np.median(b))
                if min(len(a), len(b)) < MIN_INTERVAL_EPOCHS:
                    row[f"{label}_note"] = f"{min(len(a), len(b))} epoch(s) on a side: no interval"
                    continue
                row[f"{label}_lo"], row[f"{label}_hi"] = _bootstrap(a, b, rng)
            row["epochs_bptt"], row["epochs_bppsa"] = len(bptt), len(bppsa)
            rows.append(row)
    table = pd.DataFrame(rows)
    for key in CONFIG_KEYS:  # every key is a column, also those no run set (e.g. frames for bitstream)
        if key not in table.columns:
            table[key] = np.nan
    if not rows:
        return table
    order = [k for k in (*shown, "comparison_key") if k in table.columns]
    return table.sort_values(order, na_position="first", kind="stable").reset_index(drop=True)


def provenance(paths: Iterable[str | Path], data: pd.DataFrame | None = None) -> dict:
    """Git commits, dirty flags and versions named by the summaries under ``paths`` and by the rows of
    ``data`` (``load_results``'s frame: each row carries its run's ``commit``, ``dirty``, ``torch``
    and ``python``, which a merged table copied away from its run folders keeps)."""
    commits, versions = set(), set()

    def add(commit, dirty, torch_version, python) -> None:
        if isinstance(commit, str) and commit:
            commits.add(commit[:12] + (" (dirty)" if dirty in (True, "True") else ""))
        if isinstance(torch_version, str) and torch_version:
            versions.add(f"torch {torch_version}, python {python}")

    for raw in paths:
        path = Path(raw)
        folder = path if path.is_dir() else path.parent  # a records.csv: its folder's summaries
        candidates = [folder / "summary.json", *folder.glob("*/summary.json")]
        for summary_path in candidates:
            try:
                summary = json.loads(summary_path.read_text())
            except (OSError, ValueError):
                continue
            git, v = summary.get("git") or {}, summary.get("versions") or {}
            add(git.get("commit"), git.get("dirty"), v.get("torch"), v.get("python"))
    if data is not None:
        keys = ("commit", "dirty", "torch", "python")
        rows = data.reindex(columns=list(keys)).astype(object).where(lambda f: f.notna(), None)
        for commit, dirty, torch_version, python in rows.drop_duplicates().itertuples(index=False):
            add(commit, dirty, torch_version, python)
    return {"commits": sorted(commits), "versions": sorted(versions)}
