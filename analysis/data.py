"""Reading result folders, and the speedups computed from them.

Reads only result files (``records.csv`` and ``summary.json`` as ``experiments.records`` writes
them): a sweep folder (or its merged ``records.csv``), a single run folder, or a CSV file.

A sweep is read from its run folders, as a merge of it now would be (``read_sweep``): its merged
table may be stale (a re-run with more values killed before its merge), so the table only stands in
for runs whose folder no longer holds them finished, and a line in ``data.attrs["notes"]`` names
what was added, replaced, kept or skipped. One run is one run folder (``run_path``): the rows of a
run reached twice (a run folder beside its sweep, a sweep and its table) count once.

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
1000 draws, seeded by a fixed seed and the two sides' epoch times), so the same epochs always give
the same interval, whatever else the tables hold and in whatever order; with fewer than
``MIN_INTERVAL_EPOCHS`` epochs on a side there is no interval, and a comparison without timed
iterations has no speedup: each such cell says why.
"""

from __future__ import annotations

import json
import zlib
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
# Columns of an epoch row that measure the epoch or the run, or locate the file; every other column
# (less PROVENANCE) describes the run's configuration or machine.
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
    "other_load",
    "contended",
    "initial_loss",
    "run",
    "run_path",
    "source",
    "name",
    "config_hash",
)
# Columns that name the code a run came from: provenance (``provenance``), not its configuration.
PROVENANCE = ("commit", "dirty", "torch", "python")
# Columns added after runs were recorded, with what those runs did (experiments.records.ADDED_KEYS):
# a row without one reads that value, so it compares and pairs with the rows that have it.
ADDED_COLUMNS = {"capture": False, "flush_denormals": False}
# The columns ``speedups`` adds: results, not what was compared.
SPEEDUP_COLUMNS = (
    *(f"{label}_{part}" for label in ("overall", "backward") for part in ("speedup", "lo", "hi", "note")),
    "epochs_bptt",
    "epochs_bppsa",
)
# Keys a reader looks for first where they tell results apart, before the machine's (threads_used
# follows from workers_used); the rest keep their table's order.
READ_FIRST = ("num_layers", "hidden_size", "lr", "features", "workers_used", "workers")
# Columns of names and hashes: read as text, so that a hash of digits is not taken for a number.
TEXT = ("name", "config_hash", "comparison_key", "commit", "run")
# The backward group's columns: what distinguishes the two sides and the BPPSA variants.
BACKWARD_COLUMNS = ("backward", "strategy", "chunk", "levels", "forward_solver")
BOOTSTRAP_DRAWS = 1000
RECORDS, SUMMARY = "records.csv", "summary.json"
# A note names this many runs of a kind, then says how many more.
NAMED_RUNS = 5
# Fewer epochs than this on a side give a median but no interval: too few to estimate a spread.
MIN_INTERVAL_EPOCHS = 3
BOOTSTRAP_SEED = 0


class AnalysisError(SuiteError, ValueError):
    """Missing or malformed input, said in one line."""


def _run_folders(folder: Path) -> list[Path]:
    """The folders in ``folder`` that hold a run's records or summary (none: not a sweep)."""
    runs = (p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    return sorted(p for p in runs if (p / RECORDS).is_file() or (p / SUMMARY).is_file())


def _sweep_of(path: Path) -> Path | None:
    """The sweep ``path`` stands for, a sweep folder or its merged table; None for anything else."""
    folder = path.parent if path.is_file() and path.name == RECORDS else path
    if folder.is_dir() and any((p / RECORDS).is_file() for p in _run_folders(folder)):
        return folder
    return None


def _summary(run: Path) -> tuple[str | None, str | None, str]:
    """The status, configuration hash and finishing time a run's summary.json gives; a status of
    None where there is none (results made or copied by hand: nothing says they are unfinished)."""
    try:
        summary = json.loads((run / SUMMARY).read_text())
    except (OSError, ValueError):
        return None, None, ""
    if not isinstance(summary, dict):
        return None, None, ""
    return summary.get("status"), summary.get("config_hash"), str(summary.get("finished") or "")


def _named(runs: Sequence[str]) -> str:
    """'a, b' or 'a, b, c, d, e and 3 more': a note stays one readable line for any sweep."""
    more = len(runs) - NAMED_RUNS
    return ", ".join(runs[:NAMED_RUNS]) + (f" and {more} more" if more > 0 else "")


def _same_rows(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two tables of one run hold the same epochs with the same times and losses."""
    columns = ["epoch", "epoch_s", "backward_s", "loss"]
    key = [c for c in columns if c in a.columns and c in b.columns]
    x, y = (t[key].astype(float).sort_values("epoch").to_numpy() for t in (a, b))
    return x.shape == y.shape and bool(np.array_equal(x, y, equal_nan=True))


def read_sweep(folder: Path) -> tuple[list[tuple[pd.DataFrame, Path]], str | None]:
    """A sweep's epoch rows as its merge would hold them now, as (rows, the table read) pairs, and
    a note (None when the merged table agrees) naming what the merged table did not hold.

    Like ``experiments.records.merge_sweep``: the runs whose summary says completed (and those
    without a summary), one per configuration (the latest finished). Unlike a stale merged table: a
    finished run missing from it is added, and one whose folder holds other rows is replaced. The
    merged table's rows are kept for a run whose folder no longer holds it finished (a re-run under
    way or killed) and for one whose folder is gone; a run never finished is skipped.
    """
    merged_path = folder / RECORDS
    merged = _read_records(merged_path) if merged_path.is_file() else None
    if merged is not None and "run" not in merged.columns:
        merged = None  # a merge that does not name its runs cannot be checked: the folders are read
    listed = set(merged["run"].dropna().astype(str)) if merged is not None else set()
    summaries = {run.name: (run, *_summary(run)) for run in _run_folders(folder)}
    latest: dict[str, tuple[str, str]] = {}  # configuration -> (finished, folder name)
    unfinished: dict[str, str] = {}
    for name, (_, status, chash, finished) in summaries.items():
        if status not in (None, "completed"):
            unfinished[name] = str(status)
            continue
        key = chash or f"folder {name}"  # without a summary a folder is a run of its own
        if key not in latest or finished >= latest[key][0]:
            latest[key] = (finished, name)
    chosen = {name for _, name in latest.values()}
    duplicates = {  # finished, but a later run of the same configuration stands for it
        name: latest[chash][1]
        for name, (_, status, chash, _) in summaries.items()
        if name not in chosen and name not in unfinished
    }
    pieces, added, replaced = [], [], []
    for name in sorted(chosen):
        run = summaries[name][0]
        rows = _read_records(run / RECORDS) if (run / RECORDS).is_file() else None
        if rows is None:
            continue  # completed without rows: nothing to read, as the merge reads nothing
        pieces.append((_runs_named(rows, run / RECORDS), run / RECORDS))
        if merged is None:
            continue  # cut short before its merge: nothing to compare with
        if name not in listed:
            added.append(name)
        elif not _same_rows(rows, merged[merged["run"] == name]):
            replaced.append(name)
    kept = sorted(listed & set(unfinished))
    read = {table.parent.name for _, table in pieces}
    stand_in = sorted(listed - read - set(duplicates))  # unfinished now, or without a folder or rows
    if merged is not None and stand_in:
        pieces.append((merged[merged["run"].isin(stand_in)].reset_index(drop=True), merged_path))
    skipped = [f"{r} ({unfinished[r]})" for r in sorted(set(unfinished) - listed)]
    skipped += [f"{r} (the configuration of {d}, finished later)" for r, d in sorted(duplicates.items())]
    parts = []
    if added or replaced:
        parts.append(f"{merged_path.name} is stale, the run folders are read instead")
        if added:
            parts.append(f"added {len(added)} run(s) it lacks: {_named(added)}")
        if replaced:
            parts.append(f"replaced {len(replaced)} run(s) by their folders' rows: {_named(replaced)}")
    if kept:
        shown = [f"{r} ({unfinished[r]})" for r in kept]
        parts.append(f"kept the merged table's rows of {len(kept)} run(s) unfinished now: {_named(shown)}")
    if skipped:
        parts.append(f"skipped {len(skipped)} run(s): {_named(skipped)}")
    return pieces, (f"{folder}: " + "; ".join(parts)) if parts else None


def _tables_under(path: Path) -> tuple[list[tuple[pd.DataFrame, Path]], str | None]:
    """The epoch rows under ``path`` as (rows, the table read) pairs, and a note on a sweep's reading."""
    sweep = _sweep_of(path)
    if sweep is not None:
        return read_sweep(sweep)
    table = path if path.is_file() else path / RECORDS
    if not table.is_file():
        raise AnalysisError(
            f"no records.csv under {str(path)!r}; expected a sweep folder (multirun/<name>), "
            "a run folder, or a records.csv file"
        )
    rows = _read_records(table)
    return ([] if rows is None else [(_runs_named(rows, table), table)]), None


def _runs_named(frame: pd.DataFrame, table: Path) -> pd.DataFrame:
    """``frame`` with each row's ``run``: where the table names none, the folder the table is in."""
    if "run" not in frame.columns:
        return frame.assign(run=table.parent.name)
    return frame.assign(run=frame["run"].fillna(table.parent.name).astype(str))  # read as text (TEXT)


def _read_records(table: Path) -> pd.DataFrame | None:
    """A records table checked (``_check_records``); None without rows yet."""
    frame = read_table(table, REQUIRED, NUMERIC, "a run's records.csv", rows_later=True)
    if frame is None:
        return None  # written before any epoch finished: no rows yet
    _check_records(frame, table)
    unknown = sorted(set(frame["backward"].dropna().astype(str)) - set(BACKWARDS))
    if unknown:
        raise AnalysisError(f"{table}: unknown backward {unknown[0]!r}; accepted: {', '.join(BACKWARDS)}")
    return frame


def run_paths(frame: pd.DataFrame, table: Path) -> pd.Series:
    """The run each row of ``table`` belongs to, as the path of its run folder: what identifies one run.

    A run's own records.csv names its folder; a merged table names the folder of each row's ``run``
    beside it; a table away from its run folders (a copy) names itself and the ``run``. Not the
    ``config_hash``: two folders may hold one configuration (the same sweep run twice, into
    ``multirun/main/<time>``), and each is a run; nor the ``run`` alone, which two sweeps may share.
    """
    folder = table.resolve().parent

    def where(run: str) -> str:
        if run == folder.name:
            return str(folder)
        if (folder / run).is_dir():
            return str(folder / run)
        return f"{table.resolve()}#{run}"

    return frame["run"].map({run: where(run) for run in frame["run"].unique()})


def _refuse_first(frame: pd.DataFrame, path: Path, column: str, bad: pd.Series, accepted: str) -> None:
    """AnalysisError naming ``path``, ``column``, the first row where ``bad`` holds and its value."""
    if bad.any():
        row = int(bad.to_numpy().argmax())
        value = frame[column].iloc[row]
        if pd.isna(value):
            shown = _cell_text(path, column, row)
        else:
            shown = repr(value.item() if hasattr(value, "item") else value)
        raise AnalysisError(f"{path}: {column} is {shown} in row {row + 1}; accepted: {accepted}")


def _cell_text(path: Path, column: str, row: int) -> str:
    """A cell read as missing, as the file spells it: 'empty', or its text (``nan``, ``NA``), which
    the parsed table no longer tells apart from an empty cell."""
    try:
        text = pd.read_csv(path, usecols=[column], dtype=str, keep_default_na=False)[column].iloc[row]
    except (OSError, ValueError, IndexError):  # changed since it was read: say what the table holds
        return "empty"
    return text.strip() or "empty"


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
    something other than a number in one of ``numeric``. ``rows_later``: a table with the columns
    but no rows yet (a run that has not finished an epoch) is None instead of an error."""
    try:
        frame = pd.read_csv(path, dtype=dict.fromkeys(TEXT, str))
    except pd.errors.EmptyDataError:  # not even a header: no table of any kind
        raise AnalysisError(
            f"{path} is empty; accepted: a table with the columns {', '.join(columns)}"
        ) from None
    except (OSError, ValueError) as exc:
        raise AnalysisError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:  # checked before the rows: a line of text alone reads as a header without rows
        hint = f"; is it {expected}?" if expected else ""
        raise AnalysisError(f"{path} lacks the columns {', '.join(missing)}{hint}")
    if rows_later and frame.empty:
        return None
    _check_numbers(frame, path, numeric)
    return frame


def load_results(paths: Sequence[str | Path], keep_contended: bool = False) -> pd.DataFrame:
    """All epoch rows under ``paths``, one frame; raises AnalysisError naming what is wrong.

    Epochs measured while other work kept the machine busy (``contended``, see
    ``experiments.hardware.LoadMeter``) are left out unless ``keep_contended``; how many were is in
    ``data.attrs["contended_epochs"]``. ``data.attrs["notes"]``: a line per sweep whose run folders
    hold other runs than its merged table (``read_sweep``), for the caller to show.
    """
    if not paths:
        raise AnalysisError(
            "no result paths given; accepted: sweep folders, run folders or records.csv files"
        )
    frames, notes = [], []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise AnalysisError(f"result path {str(path)!r} does not exist")
        try:
            pieces, note = _tables_under(path)
        except OSError as exc:
            raise AnalysisError(f"cannot read {path}: {exc.strerror or exc}") from None
        notes += [note] if note and note not in notes else []
        for frame, table in pieces:
            frame = frame.assign(source=str(path), run_path=run_paths(frame, table), _table=len(frames))
            frame["_away"] = frame["run_path"] != str(table.resolve().parent)  # False (its own) first
            frames.append(frame)
    if not frames:
        raise AnalysisError(
            f"{_named([str(p) for p in paths])}: no epoch rows yet; accepted: results with a finished epoch"
        )
    data = _once(pd.concat(frames, ignore_index=True))
    busy = data["contended"].fillna(False).astype(bool) if "contended" in data.columns else None
    dropped = 0 if busy is None or keep_contended else int(busy.sum())
    if dropped:
        data = data[~busy].reset_index(drop=True)
        if data.empty:
            raise AnalysisError(
                f"all {dropped} epochs were measured while the machine was busy; accepted: --keep-contended"
            )
    data.attrs["contended_epochs"] = dropped
    data.attrs["notes"] = notes
    data["workers_used"] = _workers_used(data)
    data["ranks"] = data["ranks"].fillna(1) if "ranks" in data.columns else 1  # older records: one process
    for col, value in ADDED_COLUMNS.items():
        if col in data.columns:
            data[col] = data[col].where(data[col].notna(), value)
    for col in CONFIG_KEYS:
        if col not in data.columns:
            data[col] = np.nan
    for phase in PHASES:
        data[f"{phase}_per_iter_s"] = data[f"{phase}_s"] / data["timed_iterations"].where(
            data["timed_iterations"] > 0
        )
    return data


def _once(data: pd.DataFrame) -> pd.DataFrame:
    """Each run's rows once (see ``run_paths``): all from its own records.csv where that was read,
    else from the first table read that holds it; and rows equal but for where they were read (a
    copied table beside its original) once."""
    if "contended" in data.columns:  # a table without the column says the same as one of False
        data["contended"] = data["contended"].where(data["contended"].notna(), False)
    ordered = data.sort_values(["_away", "_table"], kind="stable")
    first = ordered.groupby("run_path", sort=False)["_table"].first()  # the table each run is read from
    data = data[data["_table"] == data["run_path"].map(first)]
    located = {"source", "run_path", "_table", "_away"}
    data = data.drop_duplicates(subset=[c for c in data.columns if c not in located])
    return data.drop(columns=["_table", "_away"]).reset_index(drop=True)


def _workers_used(data: pd.DataFrame) -> pd.Series:
    """CPU threads or GPU SMs the run used."""
    used = pd.Series(np.nan, index=data.index)
    for col in ("sm_used", "threads_used"):
        if col in data.columns:
            used = used.fillna(data[col])
    return used


def _bootstrap(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """95 % interval of median(a) / median(b) over resampled epochs, its draws seeded by the epochs
    themselves (sorted): a comparison's interval does not change with the other comparisons read
    beside it, or with the order of its rows."""
    a, b = np.sort(a.astype(np.float64)), np.sort(b.astype(np.float64))
    rng = np.random.default_rng([BOOTSTRAP_SEED, zlib.crc32(a.tobytes()), zlib.crc32(b.tobytes())])
    ra = np.median(rng.choice(a, (BOOTSTRAP_DRAWS, len(a))), axis=1)
    rb = np.median(rng.choice(b, (BOOTSTRAP_DRAWS, len(b))), axis=1)
    lo, hi = np.percentile(ra / rb, [2.5, 97.5])
    return float(lo), float(hi)


def identity_columns(data: pd.DataFrame) -> list[str]:
    """The columns of ``data`` (epoch rows or ``speedups``' table) that describe what a run ran and
    where, READ_FIRST first: every column but the measurements, the backward group, the comparison
    key, the code's provenance and the speedups."""
    skip = {*MEASUREMENTS, *BACKWARD_COLUMNS, *PROVENANCE, *SPEEDUP_COLUMNS, "comparison_key"}
    found = [c for c in data.columns if c not in skip and not c.startswith("_")]
    return sorted(found, key=lambda c: READ_FIRST.index(c) if c in READ_FIRST else len(READ_FIRST))


def telling_apart(frame: pd.DataFrame, given: Sequence[str], candidates: Sequence[str]) -> list[str]:
    """Those of ``candidates`` that tell rows of ``frame`` apart beside ``given``: each that still
    varies among rows equal in ``given`` and in the candidates taken before it. Two rows equal in
    ``given`` and the result are equal in every candidate, and a column that follows from the
    others (a device's type from its name) is left out."""
    taken: list[str] = []
    keyed = frame.assign(_rows=0)  # one group of every row when nothing is given
    for column in candidates:
        if column in given or column not in frame.columns:
            continue
        varies = keyed.groupby(["_rows", *given, *taken], dropna=False)[column].nunique(dropna=False)
        if (varies > 1).any():
            taken.append(column)
    return taken


def comparison_columns(data: pd.DataFrame) -> list[str]:
    """The columns that must agree for a BPTT and a BPPSA run to be compared."""
    if "comparison_key" in data.columns and data["comparison_key"].notna().all():
        return ["comparison_key", "device_name", "workers_used", "ranks"]
    return identity_columns(data)


def speedups(data: pd.DataFrame) -> pd.DataFrame:
    """One row per comparison (configuration, device, BPPSA variant) with both a BPTT and a BPPSA run:
    every column that describes it (``identity_columns``), the names its runs were given, the overall
    and backward speedups and their spreads."""
    keys = comparison_columns(data)
    variant = [c for c in BACKWARD_COLUMNS[1:] if c in data.columns]
    described = [c for c in identity_columns(data) if c not in CONFIG_KEYS]  # lr, num_layers, ...
    shown = [c for c in (*CONFIG_KEYS, *described, *variant) if c in data.columns]
    rows = []
    for _, group in data.groupby(keys, dropna=False, sort=True):
        bptt = group[group["backward"] == "bptt"]
        bppsa_runs = group[group["backward"] == "bppsa"]
        if bptt.empty or bppsa_runs.empty:
            continue
        parts = bppsa_runs.groupby(variant, dropna=False, sort=True) if variant else [(None, bppsa_runs)]
        for _, bppsa in parts:
            row = {k: bppsa[k].iloc[0] for k in shown}
            if "name" in group.columns:  # the sweeps (or runs) it came from, a readable origin
                row["name"] = ", ".join(sorted(group["name"].dropna().astype(str).unique())) or np.nan
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
                row[f"{label}_lo"], row[f"{label}_hi"] = _bootstrap(a, b)
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
