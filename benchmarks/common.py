"""What the benchmark tools share: argument types, the device, tables, progress and the machine line.

Imports nothing beyond torch (and the suite's torch-only modules), so the tools run on a bare GPU
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from bppsa_core.dispatch import WALK_WARPS, triton_installed
from experiments.hardware import HardwareError, cpu_name, memory_cause, out_of_memory, resolve_device
from toolbox.cli import (  # noqa: F401  (the count and number types: the tools import them from here)
    SEEDS,
    OneLineParser,
    bounded,
    cpu_cores,
    is_seed,
    non_negative_int,
    positive_float,
    positive_int,
)
from toolbox.errors import SuiteError


def seed_arg(text: str) -> int:
    """argparse type of ``--seed``: the seeds run.py takes (``toolbox.cli.SEEDS``)."""
    seed = bounded(int, SEEDS, positive=False)(text)
    if not is_seed(seed):
        raise argparse.ArgumentTypeError(f"{text} is too large; accepted: {SEEDS}")
    return seed


def run_tool(module: str, main: Callable[[], int], sizes: str = "smaller sizes") -> int:
    """A tool's ``main()`` as its command runs it, with one line on stderr instead of a traceback:
    Ctrl-C ends it with status 130, and memory that runs out (sizes too large for this machine) with
    status 1, the line naming ``sizes``, what the tool takes smaller; so does a suite error (a result
    file that cannot be written: a full disk), in its own line. Either way it has written nothing
    partial, as every tool writes its files at the end, each whole or not at all."""
    try:
        return main()
    except KeyboardInterrupt:  # asked for, not a failure: no traceback (128 + SIGINT, as a shell says)
        print(f"python -m {module}: interrupted", file=sys.stderr)
        return 130
    except SuiteError as exc:
        print(f"python -m {module}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        print(
            f"python -m {module}: error: out of memory: {memory_cause(exc)}; accepted: {sizes}",
            file=sys.stderr,
        )
        return 1


def threads_arg(text: str) -> int:
    """argparse type of ``--threads``: a positive integer no larger than the CPU cores this process
    may use (more threads than cores measure their contention, not the method)."""
    threads, cores = positive_int(text), cpu_cores()
    if threads > cores:
        raise argparse.ArgumentTypeError(
            f"{threads} is more than the {cores} CPU cores this process may use; accepted: 1 to {cores}"
        )
    return threads


def device_arg(text: str) -> torch.device:
    """argparse type of ``--device``: ``experiments.hardware.resolve_device``, its refusal one line."""
    try:
        return resolve_device(text, what="device")
    except HardwareError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's


@contextlib.contextmanager
def matmul_precision(name: str) -> Iterator[None]:
    """PyTorch's float32 matmul precision ``name`` inside (cuBLAS's products and the BPPSA kernels',
    ``bppsa_core.triton.launch.dot_precision``), the one before restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(name)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def add_matmul_precision(p: argparse.ArgumentParser) -> None:
    """A tool's ``--matmul-precision``: the rows measured under each of PyTorch's float32 matmul
    precisions given, in turn (``matmul_precision``)."""
    p.add_argument(
        "--matmul-precision", nargs="+", choices=MATMUL_PRECISIONS, default=["highest"],
        help="torch.set_float32_matmul_precision for the rows, each in turn: 'highest' full float32, "
        "'high' the BPPSA kernels' products as three TF32 ones (tf32x3) and cuBLAS's in TF32",
    )  # fmt: skip


WALK_CHOICES = ("auto", *map(str, WALK_WARPS))  # "auto": each launch's own warps


@contextlib.contextmanager
def walks_on(warps: str) -> Iterator[None]:
    """The kernels' walks on ``warps`` warps inside (``bppsa_core.triton.launch.walk_warps``; "auto":
    each launch's own). Nothing is set where Triton is not installed: no kernel runs there."""
    if warps == "auto" or not triton_installed():
        yield
        return
    from bppsa_core.triton.launch import walk_warps

    with walk_warps(int(warps)):
        yield


def add_walk_warps(p: argparse.ArgumentParser) -> None:
    """A tool's ``--walk-warps``: the rows measured with the kernels' walks on each count given."""
    p.add_argument(
        "--walk-warps", nargs="+", choices=WALK_CHOICES, default=["auto"],
        help="warps of the Triton kernels' walks (spine, expand) for the rows, each in turn: 'auto' each "
        "launch's own; 1 keeps a step's reduction within a warp (bppsa_core.triton.launch.walk_warps)",
    )  # fmt: skip


# The settings a row may be measured under: (column head, the row's attribute, the default)
ROW_SETTINGS = (("matmul precision", "precision", "highest"), ("walk warps", "walks", "auto"))


def setting_cells(rows: Sequence[object], row: object | None = None) -> list[str]:
    """The settings a table names (``ROW_SETTINGS``: each where some row has one not the default),
    as column heads, or as ``row``'s cells."""
    named = [
        (head, attr) for head, attr, unset in ROW_SETTINGS if any(getattr(r, attr) != unset for r in rows)
    ]
    return [head if row is None else getattr(row, attr) for head, attr in named]


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A tool's parser: usage names ``python -m <module>``, help shows every option's default."""
    return OneLineParser(
        prog=f"python -m {module}",
        description=doc.split("\n\n")[0],
    )


def markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table in ``text``, in order: its header cells and its rows of cells
    (``markdown``'s tables read back, from a report among other lines)."""
    tables, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            head = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            tables.append((head, rows))
        else:
            i += 1
    return tables


def fmt_ms(value: float | str) -> str:
    """A time in ms with four significant digits, or a cell's text."""
    if isinstance(value, str):
        return value
    return f"{value:.4g}" if value < 1000 else f"{value:.0f}"


def failure(exc: Exception) -> tuple[str, str]:
    """The cell and the note of a method that did not run: "n/a" when it refuses the device or shape
    (ValueError, as ``bppsa_core`` does), "error" when anything else went wrong."""
    if isinstance(exc, ValueError):
        return "n/a", str(exc).splitlines()[0]
    return "error", f"{type(exc).__name__}: {exc}".splitlines()[0]


def notes_lines(rows: Sequence[object]) -> list[str]:
    """One line per method that did not run somewhere, with the first reason it gave."""
    seen: dict[str, str] = {}
    for r in rows:
        for method, why in getattr(r, "notes", {}).items():
            seen.setdefault(method, why)
    return [f"- {method}: {why}" for method, why in seen.items()]


def version(package: str) -> str:
    """An installed package's version, read without importing it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_line(device: torch.device) -> str:
    """What the numbers were measured on."""
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, cuDNN {torch.backends.cudnn.version()}"
    else:
        threads = torch.get_num_threads()
        where = f"{cpu_name()}, {threads} thread{'' if threads == 1 else 's'}"
    line = f"device: {device.type} ({where}); torch {torch.__version__}; python {platform.python_version()}"
    return line + "; " + "; ".join(f"{p} {version(p)}" for p in ("triton", "jax", "jaxlib"))


def profiled_events(fn: Callable[[], object], device: torch.device) -> list:
    """The events of one call of ``fn`` under ``torch.profiler``: the host's operator calls and, on a
    GPU, the kernels and copies it ran there (the device synchronized before the profile ends)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    # One cycle, so accumulating changes nothing; torch 2.11 warns at every profile without it.
    with profile(activities=activities, acc_events=True) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return list(prof.events())


def on_device(event: object) -> bool:
    """Whether a profiler event is a kernel or copy run on a GPU (not a host call)."""
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


class Progress:
    """Progress lines on stderr, each with the seconds since the tool started."""

    def __init__(self, tool: str) -> None:
        self.tool = tool
        self.started = time.perf_counter()

    def __call__(self, text: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"[{self.tool} {elapsed:7.1f} s] {text}", file=sys.stderr, flush=True)
