"""The short table a run prints at its end, read back from its records."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.records import RECORDS, SUMMARY, read_json


def summary_table(records: pd.DataFrame) -> str:
    """Per epoch: loss, accuracies, phase times per timed iteration (ms), throughput, and with a
    Newton forward its iterations per layer forward and fallbacks."""
    per_iter = records["timed_iterations"].where(records["timed_iterations"] > 0)
    table = pd.DataFrame(
        {
            "epoch": records["epoch"],
            "loss": records["loss"].map("{:.4f}".format),
            "acc": records["accuracy"].map("{:.3f}".format),
            "test acc": records.get("test_accuracy", pd.Series(dtype=float)).map("{:.3f}".format),
            "fwd ms": (1e3 * records["forward_s"] / per_iter).map("{:.2f}".format),
            "bwd ms": (1e3 * records["backward_s"] / per_iter).map("{:.2f}".format),
            "step ms": (1e3 * records["step_s"] / per_iter).map("{:.2f}".format),
            "samples/s": records["samples_per_s"].map("{:.0f}".format),
        }
    )
    if records.get("forward_solver", pd.Series(["native"])).iloc[0] != "native":
        table["newton its"] = records["newton_iterations"].map("{:.1f}".format)
        table["fallbacks"] = records["newton_fallbacks"]
    return table.to_string(index=False)


def print_summary(run_dir: Path, skipped: bool = False) -> None:
    """Print what the run did: the configuration in one line, the epoch table, where files are."""
    run_dir = Path(run_dir)
    summary = read_json(run_dir / SUMMARY) or {}
    records = pd.read_csv(run_dir / RECORDS)
    first = records.iloc[0]
    print(
        f"{'skipped (already completed): ' if skipped else ''}{first['model']} on {first['dataset']}, "
        f"T={first['seq_len']}, B={first['batch_size']}, backward={first['backward']}, "
        f"forward={first.get('forward_solver', 'native')}, device={first['device_name']}"
        + (f", ranks={first['ranks']}" if first.get("ranks", 1) > 1 else "")
        + (", subnormals flushed" if str(first.get("flush_denormals")) == "True" else "")
    )
    print(summary_table(records))
    print(f"results: {run_dir / RECORDS}, {run_dir / SUMMARY} (status {summary.get('status')})")
