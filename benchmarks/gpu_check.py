"""One command on a GPU: every GPU check and table of the suite, written to one Markdown report.

    python -m benchmarks.gpu_check [--out gpu_report.md]

Needs torch (>= 2.11) and triton (pytest and hypothesis for the ``tests`` step); not Hydra, not
librosa; jax is used where installed. Steps, each a section of the report with its command, its time
and its output (or why it failed, or was skipped):

1. ``tests``: the ``gpu`` tests (the Triton kernels, the graph scan and every module path against
   cuDNN; the Newton iteration's kernels and a Newton forward against cuDNN's outputs; a whole
   training step captured in a CUDA graph; the sparse Jacobians; sequence parallel
   over NCCL, a rank per GPU);
2. ``capture``: BPPSA's backward against cuDNN's, eager (wall-clock), as captured training steps
   and as captured backwards alone (GPU time), and against a naive loop of ``torch.nn``'s cells,
   with the backward's peak memory: RNN, GRU and LSTM, H = 20, 64, 128, 256, T = 1,000 and 10,000
   (``benchmarks.capture``); then the RNN at H = 20 in processes of its own, at T = 10,000 and
   100,000, and at T = 10,000 with ``--capture-error-mode thread_local`` (``LONG_CAPTURE``);
3. ``host``: short layers (T = 10, 100, 1,000) against ``torch.nn``'s, the host path
   (``benchmarks.host``), a profile of where BPPSA's step at T = 10 spends its host time, and what
   handing the backward to autograd's device thread costs; then a layer backward's launches through
   Triton's path against the direct one (``benchmarks.launch``);
4. ``backward``: the paper's backward tables, cuDNN's BPTT against every BPPSA strategy (PyTorch
   picks cuDNN's persistent small-hidden algorithm for these shapes: the baseline to beat);
5. ``epoch``: one training epoch of the bitstream RNN, BPTT against BPPSA, eager and with the
   training step captured in a CUDA graph (the README's fast path);
6. ``scan``: the scan alone against ``torch``'s and ``jax``'s ``associative_scan``;
7. ``chunk``: the Triton kernels' chunk-size sweep at T = 1000 and 30,000, then captured at
   T = 1,000 with each backward's GPU time per kernel (``benchmarks.capture --kernels``);
8. ``precision``: the reduce kernels' products in full float32 against three TF32 ones (PyTorch's
   float32 matmul precision "highest" against "high", ``bppsa_core.triton.launch.dot_precision``):
   the captured backward per kernel (RNN, GRU, LSTM; H = 20; T = 1,000 and 10,000) and the Newton
   forward at initialization (RNN, GRU; T = 10,000 and 100,000), from zeros and from Picard sweeps;
9. ``walks``: the kernels' walks (spine, expand) on each launch's own warps against 1 and 2
   (``--walk-warps``, ``bppsa_core.triton.launch.walk_warps``): the captured backward per kernel
   (RNN, GRU, LSTM; H = 20; T = 1,000 and 10,000) and the Newton forward at initialization (RNN,
   GRU; T = 10,000 and 100,000);
10. ``blocks``: the BPPSA backward's blocks of time steps (``--block-mib`` 8, 32 and 256: a CPU's
    budget, and larger ones that take fewer launches) at T = 1,000, 30,000 and 100,000, which sets
    the GPU's own (``bppsa_core.jacobians.BLOCK_BYTES``);
11. ``workers``: BPPSA's and cuDNN's backward confined to 1, 2, 4, ... SMs (CUDA green contexts);
12. ``forward``: the Newton forwards (``forward_solver="newton"``, ``"quasi-newton"``) against cuDNN's
    sequential forward, T = 100 ... 100,000, H = 20 and 64, at initialization and trained
    (``benchmarks.forward``);
13. ``kernels``: registers, spills and the static cycle estimate (labelled as such) of the compiled
    kernels at H = 1, 20, 32 and 64, for this GPU's architecture, to set beside the measured times
    of steps 4, 7, 8 and 9;
14. ``ranks``: the sequence split over 1 to 4 processes on this machine's CPU cores, one gloo rank
    of one thread per core (``benchmarks.distributed`` at T = 100,000): the measured 3- and
    4-rank points of docs/SCHEMES.md, which a 2-core machine cannot give: BPPSA's all-gather
    (``--exchange allgather``), its ``measured.csv`` and ``calibration.json`` to the folder
    ``<report>-ranks`` beside the report; its slices chained (``--exchange chain``, what CPU ranks
    take by default) to ``<report>-ranks-chain``. Then the same
    over NCCL ranks of one GPU each, 1 to 4 as there are GPUs (one GPU: the NCCL path on one rank);
    with two GPUs or more, once for each sample-group count of the BPPSA backward (``--micro-batches``
    1 to 16), which sets the GPU ranks' own.
    Both print each rank's BPPSA backward span by span (``--timeline``): where a rank waits.
15. ``reproduction``: the paper's RNN experiments (figs. 7 and 8) trained on this GPU by
    ``docs/reproduction/run.sh --device cuda --only`` ``REPRODUCTION_ONLY``, BPTT on cuDNN against
    BPPSA: their tables, figures and report.md go to docs/reproduction/cuda/, and the step shows the
    speedup table; then the same with every training step captured in CUDA graphs on both sides
    (``--capture``, into docs/reproduction/cuda-captured/). It needs Hydra (``run.py``); where
    Hydra is missing it is skipped, saying so.

The report opens with its headline ratios, "At a glance": BPPSA against cuDNN at the paper's shapes
(the RNN's backward eager and captured, the GRU's and LSTM's, the RNN over T, the GRU at the IRMAS
shapes, the training epoch, a short layer's forward and step, the peak memory), read from the
tables of the ``capture``, ``backward``, ``epoch`` and ``host`` steps; ``--glance REPORT ...``
prints that table of reports written before, a column each, so that GPUs compare at a look.

``--dry`` runs the same steps on the CPU at small shapes, to check the command where there is no
GPU: what needs CUDA (the tests, the graph and Triton strategies, green contexts) is reported as
skipped, everything else runs. ``--steps`` sets which run, in its order. The report so far is
rewritten whole after every step into ``<report>.partial`` (never half a file), which becomes the
report when the last step ends: a run stopped part-way (its time limit, Ctrl-C, SIGTERM) keeps the
steps it finished there and leaves an earlier report as it was. A step's command runs in a process
group of its own, stopped whole with the step (a benchmark's ranks, ``run.sh``'s runs), in this
run's session, so that what ends the session (a job killed at its limit) ends the step too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import (
    Progress,
    markdown,
    markdown_tables,
    non_negative_int,
    positive_float,
    positive_int,
    run_tool,
    version,
)
from bppsa_core.dispatch import runs_on
from experiments.timing import time_ms
from toolbox.cli import OneLineParser, Terminated, terminate_as_interrupt
from toolbox.files import output_file, write_atomic

PROG = "python -m benchmarks.gpu_check"
STEPS = (
    "tests", "capture", "host", "backward", "epoch", "scan", "chunk", "precision", "walks", "blocks",
    "workers", "forward", "kernels", "ranks", "reproduction",
)  # fmt: skip
CHUNKS = (8, 16, 32, 64, 128)
# The chunk sweep's captured rows: where the eager backward is host work (T = 1,000), only the GPU
# time of a captured one shows what the chunk size does (T = 1,000 alone: the step's time is bounded)
CHUNK_CAPTURE = ["--models", "rnn", "gru", "--T", "1000", "--H", "20", "--naive-max-T", "0", "--kernels"]
# The precision step: "highest" (full float32 products, the default) against "high" (three TF32 ones)
PRECISIONS = ["--matmul-precision", "highest", "high"]
PRECISION_CAPTURE = ["--T", "1000", "10000", "--H", "20", "--naive-max-T", "0", "--kernels", *PRECISIONS]
# and the Newton forward's other lever, its first iterate from Picard sweeps (--sweeps)
PRECISION_NEWTON = ["--tables", "newton", "--weights", "init", "--T", "10000", "100000", "--sweeps"]
# The walks step: the walks on each launch's own warps (4 at H = 20) against 1 and 2, per kernel,
# and in the Newton forward, whose iterations are transposed scans
WALKS = ["--walk-warps", "auto", "1", "2"]
WALK_CAPTURE = ["--T", "1000", "10000", "--H", "20", "--naive-max-T", "0", "--kernels", *WALKS]
WALK_NEWTON = ["--tables", "newton", "--weights", "init", "--T", "10000", "100000", "--solvers", "newton"]
WALK_NEWTON += WALKS
BLOCK_MIBS = (8, 32, 256)  # the BPPSA backward's blocks of time steps (``--block-mib``)
GPU_TEST_FILES = (
    "tests/core/test_triton.py",
    "tests/core/test_triton_newton.py",
    "tests/core/test_capture.py",
    "tests/benchmarks/test_bench_capture.py",
    "tests/core/test_sparse.py",
    "tests/core/test_distributed.py",
    "tests/core/test_nn.py",
    "tests/benchmarks/test_bench.py",
    "tests/suite/test_train.py",
)
TITLES = {
    "tests": "GPU tests",
    "capture": "Backward against cuDNN: eager, captured, naive loop; over T and H",
    "host": "Host path: short layers against torch.nn",
    "backward": "Full backward against cuDNN",
    "epoch": "End-to-end training epoch",
    "scan": "Scan only, against associative_scan",
    "chunk": "Triton chunk-size sweep",
    "precision": "The reduce kernels' products: full float32 against three TF32",
    "walks": "The kernels' walks on fewer warps",
    "blocks": "Blocks of time steps of the BPPSA backward",
    "workers": "Backward against SMs (green contexts)",
    "forward": "Newton forward against cuDNN's",
    "kernels": "Compiled kernels: resources and static estimate",
    "ranks": "Sequence parallel over ranks (gloo on CPU cores, NCCL on GPUs)",
    "reproduction": "The paper's RNN experiments on this GPU (docs/reproduction/run.sh)",
}
# The capture step's own processes after its grid: the paper's RNN at the longest targets, each
# row the first of its process (a capture failure there is not an earlier row's), and at T = 10,000
# with only the capturing thread's unsafe calls failing the capture.
LONG_CAPTURE = (
    ["--T", "10000", "100000", "--H", "20"],
    ["--T", "10000", "--H", "20", "--capture-error-mode", "thread_local"],
)
# The Newton forward's two processes: at initialization over T and the paper's and the kernels'
# widest H; trained (slow to converge, many iterations a row) at the paper's H and shorter T, so the
# step ends in a few minutes
NEWTON_RUNS = (
    ["--weights", "init", "--T", "1000", "10000", "100000", "--H", "20", "64"],
    ["--weights", "trained", "--T", "1000", "10000", "--H", "20"],
)
RANKS_T = 100_000  # the sequence-parallel benchmark's length (docs/SCHEMES.md)
RANKS_REPEATS = 3  # BPTT takes seconds an iteration there
GPU_MICRO_BATCHES = (1, 2, 4, 8, 16)  # the NCCL ranks' sample-group counts, with two GPUs or more
ROOT = Path(__file__).resolve().parents[1]
# The reproduction step's sweeps (run.sh --only): figs. 7 and 8, the paper's own setting on a GPU
REPRODUCTION_ONLY = "rnn_seq_len,rnn_batch,rnn_curve"


@dataclass
class Section:
    """One step's part of the report."""

    title: str
    commands: list[str] = field(default_factory=list)
    status: str = "ok"  # ok | failed | skipped
    seconds: float = 0.0
    body: str = ""


def _bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.backward", *args]


def plan(
    dry: bool, repeats: int, warmup: int, out: Path = Path("gpu_report.md")
) -> dict[str, list[list[str]] | str]:
    """Each step's commands (argv lists), or the reason it is skipped; ``out``: the report's path."""
    device = ["--device", "cpu" if dry else "cuda", "--repeats", str(repeats), "--warmup", str(warmup)]
    suite = ["--suite", "paper", *(["--quick"] if dry else [])]
    gpu_only = "needs a CUDA device"
    capture = [sys.executable, "-m", "benchmarks.capture", *device]
    forward = [sys.executable, "-m", "benchmarks.forward", *device]
    if dry:
        compiled = ["numba"] if runs_on("numba", torch.device("cpu")) else []  # where it is installed
        chunk_shape = ["--T", "30", "60", "--B", "4", "--H", "5", "--strategies", "chunked", *compiled]
        block_shape = ["--T", "30", "60", "--B", "4", "--H", "5", "--strategies", *(compiled or ["chunked"])]
    else:
        chunk_shape = ["--T", "1000", "30000", "--strategies", "triton"]
        block_shape = ["--T", "1000", "30000", "100000", "--strategies", "triton", "auto"]
    return {
        "tests": gpu_only if dry else [[sys.executable, "-m", "pytest", "-q", "-m", "gpu", *GPU_TEST_FILES]],
        "capture": (
            [[*capture, "--T", "30", "--H", "8", "20", "--naive-max-T", "30"]]
            if dry
            else [capture, *([*capture, "--models", "rnn", *shape] for shape in LONG_CAPTURE)]
        ),
        "host": [
            [
                sys.executable,
                "-m",
                "benchmarks.host",
                *device,
                "--T",
                "10",
                "100",
                "1000",
                "--profile",
                "300",
            ],
            *([] if dry else [[sys.executable, "-m", "benchmarks.launch", "--device", "cuda"]]),
        ],
        "backward": [_bench(*suite, "--tables", "backward", *device)],
        "epoch": [_bench(*suite, "--tables", "epoch", "--epoch-samples", "64" if dry else "3200", *device)],
        "scan": [_bench(*suite, "--tables", "scan", "--peers", "torch", "jax", *device)],
        "chunk": [
            *(_bench(*chunk_shape, "--chunk", str(c), "--tables", "backward", *device) for c in CHUNKS),
            *([] if dry else ([*capture, *CHUNK_CAPTURE, "--chunk", str(c)] for c in CHUNKS)),
        ],
        "precision": (
            [[*capture, "--T", "30", "--H", "8", *PRECISIONS], [*forward, "--quick", *PRECISIONS]]
            if dry
            else [
                [*capture, *PRECISION_CAPTURE],
                [*forward, *PRECISION_NEWTON, "--solvers", "newton", *PRECISIONS],
            ]
        ),
        "walks": (
            [[*capture, "--T", "30", "--H", "8", *WALKS], [*forward, "--quick", *WALKS]]
            if dry
            else [[*capture, *WALK_CAPTURE], [*forward, *WALK_NEWTON]]
        ),
        "blocks": [
            _bench(*block_shape, "--block-mib", str(b), "--tables", "backward", *device) for b in BLOCK_MIBS
        ],
        "workers": "in process",
        "forward": [[*forward, *run] for run in ((["--quick"],) if dry else NEWTON_RUNS)],
        "kernels": [
            [
                sys.executable,
                "-m",
                "benchmarks.kernels",
                "--summary",
                "--configs",
                "representative" if dry else "listed",
                "--arch",
                *architectures(dry),
            ]
        ],
        "ranks": [
            *(
                _distributed(rank_counts(dry), 2000 if dry else RANKS_T, repeats, warmup, *extra)
                for extra in (
                    ["--exchange", "allgather", "--out", str(ranks_folder(out))],
                    ["--exchange", "chain", "--out", str(ranks_folder(out, "chain"))],
                )
            ),
            # then NCCL, a rank per GPU up to 4; its tables only (the cost model's points are the CPU ranks')
            *([] if dry else gpu_rank_runs(repeats, warmup)),
        ],
        "reproduction": gpu_only if dry else reproduction_plan(),
    }


def reproduction_plan() -> list[list[str]] | str:
    """The reproduction step's commands (``REPRODUCTION_ONLY``'s sweeps of ``run.sh`` on the GPU,
    into docs/reproduction/cuda/, then with every step captured, into cuda-captured/), or why it is
    skipped: ``run.py`` needs Hydra."""
    missing = [m for m in ("hydra", "omegaconf") if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs {' and '.join(missing)} (the suite's requirements: run.py composes its configs)"
    eager = ["bash", "docs/reproduction/run.sh", "--device", "cuda", "--only", REPRODUCTION_ONLY]
    return [eager, [*eager, "--capture"]]


def _distributed(ranks: Sequence[int], steps: int, repeats: int, warmup: int, *extra: str) -> list[str]:
    """One run of the sequence-parallel benchmark (``benchmarks.distributed``) for the ``ranks``
    step, at most ``RANKS_REPEATS`` repeats after at most one warm-up (BPTT takes seconds an iteration),
    with each rank's timeline."""
    return [
        sys.executable,
        "-m",
        "benchmarks.distributed",
        "--ranks",
        *map(str, ranks),
        "--T",
        str(steps),
        "--repeats",
        str(min(repeats, RANKS_REPEATS)),
        "--warmup",
        str(min(warmup, 1)),
        "--timeline",
        *extra,
    ]


def gpu_rank_runs(repeats: int, warmup: int) -> list[list[str]]:
    """The NCCL runs of the ``ranks`` step. With two GPUs or more, one per sample-group count of
    ``GPU_MICRO_BATCHES``: the default (``bppsa_core.distributed.MICRO_BATCHES``) is two CPU ranks'
    tuning, and a GPU group's launches may cost what the whole batch's do. One GPU: one rank, which
    keeps the batch whole, so one run."""
    counts = gpu_rank_counts()
    cuda = ["--device", "cuda"]
    if len(counts) == 1:
        return [_distributed(counts, RANKS_T, repeats, warmup, *cuda)]
    return [
        _distributed(counts, RANKS_T, repeats, warmup, *cuda, "--micro-batches", str(m))
        for m in GPU_MICRO_BATCHES
    ]


def gpu_rank_counts() -> list[int]:
    """The NCCL process counts of the ``ranks`` step: 1 to 4, one GPU each (one where none is seen)."""
    return list(range(1, min(4, max(1, torch.cuda.device_count())) + 1))


def rank_counts(dry: bool) -> list[int]:
    """The process counts of the ``ranks`` step: 1 to 4, one core each (ranks sharing a core would
    measure the sharing); dry, 1 and 2."""
    return [1, 2] if dry else list(range(1, min(4, os.cpu_count() or 1) + 1))


def ranks_folder(out: Path, exchange: str = "") -> Path:
    """Where the ``ranks`` step writes ``measured.csv`` and ``calibration.json``: beside the report
    (an absolute path: the steps run from the repository's root, the report is written from here);
    the chained exchange's run beside it, ``exchange`` appended."""
    return out.resolve().with_name(f"{out.stem}-ranks" + (f"-{exchange}" if exchange else ""))


def architectures(dry: bool) -> list[str]:
    """This GPU's compute capability (e.g. 90), or, dry, the two the CI compile test covers."""
    if dry or not torch.cuda.is_available():
        return ["80", "90"]
    major, minor = torch.cuda.get_device_capability()
    return [f"{major}{minor}"]


def _shown(argv: Sequence[str]) -> list[str]:
    """A command as the report shows it: this interpreter as ``python``."""
    return ["python", *argv[1:]] if argv[0] == sys.executable else list(argv)


def run_command(argv: Sequence[str], timeout: float) -> tuple[bool, str]:
    """Run one tool; (succeeded, its stdout, and when it failed or was stopped, the tail of its
    stderr: a stopped benchmark's progress lines keep what it had measured). Never under Triton's
    interpreter: the report is about compiled kernels."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": path}
    env["PYTHON"] = sys.executable  # the interpreter run.sh takes (the reproduction step)
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": ROOT, "env": env}
    # a group of its own, to be stopped whole, in this session: a runner or scheduler that ends
    # this session's processes (a killed job) ends the step's too, where a new session would outlive it
    with subprocess.Popen(argv, process_group=0, **kwargs) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(process)
            out, err = process.communicate()
            return False, f"{out}\n\nstopped after {timeout:.0f} s (--step-timeout):\n\n    {_tail(err)}"
        except BaseException:  # Ctrl-C, SIGTERM: the step's processes end with this one
            _stop_group(process)
            raise
    if process.returncode != 0:
        return False, f"{out}\n\nexit status {process.returncode}:\n\n    {_tail(err)}"
    return True, out


def _stop_group(process: subprocess.Popen) -> None:
    """Kill a step's process group: the tool and whatever it started (ranks, run.sh's runs)."""
    with contextlib.suppress(ProcessLookupError):  # it has ended, and its group with it
        os.killpg(process.pid, signal.SIGKILL)


def _tail(err: str) -> str:
    """The last 20 lines of a tool's stderr, indented as a Markdown code block's body."""
    return "\n".join(err.strip().splitlines()[-20:]).replace("\n", "\n    ")


def worker_scaling(dry: bool, repeats: int, warmup: int) -> str:
    """Backward ms of cuDNN's BPTT and BPPSA ("auto") on the paper's RNN (T = 1000, B = 16, H = 20)
    confined to 1, 2, 4, ... SMs (CPU threads when dry), as a Markdown table."""
    from bppsa_core import nn as bnn
    from experiments.hardware import cpu_cores, limit_workers, sm_count

    device = torch.device("cpu" if dry else "cuda")
    total = cpu_cores() if dry else sm_count(device)
    counts = sorted({*(2**k for k in range(total.bit_length()) if 2**k <= total), total})
    steps = 30 if dry else 1000
    torch.manual_seed(0)
    ref = torch.nn.RNN(1, 20, batch_first=True).to(device)
    ours = bnn.RNN(1, 20, batch_first=True).to(device)
    ours.load_state_dict(ref.state_dict())
    x = torch.bernoulli(torch.full((16, steps, 1), 0.5, device=device))
    rows = []
    for workers in counts:
        try:
            with limit_workers(device, workers):
                times = {}
                for name, module in (("BPTT", ref), ("BPPSA", ours)):
                    samples = []
                    for i in range(warmup + repeats):
                        h_n = module(x)[1]
                        ms = time_ms(h_n.sum().backward, device)
                        if i >= warmup:
                            samples.append(ms)
                    times[name] = statistics.median(samples)
            rows.append([str(workers), f"{times['BPTT']:.4g}", f"{times['BPPSA']:.4g}",
                         f"{times['BPTT'] / times['BPPSA']:.3g}"])  # fmt: skip
        except Exception as exc:  # a count the driver refuses is a row, not the end of the table
            rows.append([str(workers), "n/a", "n/a", str(exc).splitlines()[0]])
    unit = "CPU threads" if dry else "SMs"
    head = [unit, "BPTT ms", "BPPSA ms", "BPTT / BPPSA"]
    return f"RNN, T = {steps}, B = 16, H = 20, loss on h_T; BPPSA strategy auto\n\n" + markdown(head, rows)


def environment(dry: bool, argv: Sequence[str]) -> str:
    """The lines that say what the numbers were measured on."""
    lines = [
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `python -m benchmarks.gpu_check {shlex.join(argv)}`",
        f"- Python {platform.python_version()}, torch {torch.__version__}, triton {version('triton')}, "
        f"jax {version('jax')}, numba {version('numba')}",
    ]
    if dry:
        lines.append(f"- dry run on the CPU ({platform.processor() or platform.machine()}): no GPU figures")
    else:
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"- GPU: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
            f"compute capability {props.major}.{props.minor}; CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}"
        )
    return "\n".join(lines)


def _rows(body: str) -> list[dict[str, str]]:
    """Every row of every table in a step's output, by its header's cells."""
    return [dict(zip(head, row, strict=False)) for head, rows in markdown_tables(body) for row in rows]


def _find(rows: Sequence[dict[str, str]], **cells: str) -> dict[str, str]:
    """The first row with these cells ({} if none): the capture step repeats some shapes in
    processes of their own, after its grid."""
    return next((r for r in rows if all(r.get(k) == v for k, v in cells.items())), {})


def _times(value: str) -> str:
    """A ratio cell as "n×", or "–" where the table has none."""
    return f"{value}×" if value not in ("", "–") else "–"


def _number(cell: str) -> float | None:
    """A table cell's number, or None (a "–", an "error")."""
    try:
        return float(cell)
    except ValueError:
        return None


def _span(values: Sequence[str]) -> str:
    """The range of ratio cells, "lo–hi×", or "–" where none is a number."""
    numbers = [n for n in map(_number, values) if n is not None]
    if not numbers:
        return "–"
    lo, hi = min(numbers), max(numbers)
    return f"{lo:.3g}×" if lo == hi else f"{lo:.3g}–{hi:.3g}×"


def _extent(name: str, cells: Sequence[str]) -> str:
    """The values a column of whole numbers spans: "T = 10–30,000", or "T = 10" for one."""
    values = sorted({int(float(c)) for c in cells})
    return f"{name} = {values[0]:,}" + (f"–{values[-1]:,}" if len(values) > 1 else "")


GLANCE_HEAD = "measure (H = 20, B = 16; above 1: BPPSA faster)"


def glance_lines(bodies: dict[str, str]) -> list[tuple[str, str, str]]:
    """A report's headline ratios, read from its steps' tables (``bodies``: a step's name to its
    output), as (measure, step, value): BPPSA against cuDNN at the paper's shapes (H = 20, B = 16
    unless a value's range says), above 1 where BPPSA is faster (the host step's BPPSA / torch.nn
    turned over), "–" where the step did not run or has no such row; none where none of the
    capture, backward, epoch and host steps has a table. The measures are the same for every report,
    and no table, however cut short (a step stopped part-way), makes it fail: the report is drawn
    after every step."""
    capture = _rows(bodies.get("capture", ""))
    backward = _rows(bodies.get("backward", ""))
    epoch = _rows(bodies.get("epoch", ""))
    host = _rows(bodies.get("host", ""))
    if not (capture or backward or epoch or host):
        return []

    def ratios(column: str, model: str, *steps: int) -> str:
        cells = []
        for t in steps:
            row = _find(capture, model=model, T=str(t), B="16", H="20")
            if row.get("cuDNN eager ms") == "error" and "eager" in column:
                cells.append(f"cuDNN refuses, BPPSA {row.get('BPPSA eager ms', '–')} ms")
            else:
                cells.append(_times(row.get(column, "")))
        return " / ".join(cells)

    def best(model: str, batch: str | None) -> str:
        """BPPSA's best against BPTT over a model's rows of the backward step, and the shapes they span."""
        rows = [r for r in backward if r.get("model") == model and r.get("H") == "20"]
        rows = [r for r in rows if batch is None or r.get("B") == batch]
        rows = [r for r in rows if _number(r.get("T", "")) and _number(r.get("B", ""))]  # whole rows
        if not rows:
            return "–"
        where = _extent("T", [r["T"] for r in rows]) + (
            "" if batch else ", " + _extent("B", [r["B"] for r in rows])
        )
        return f"{_span([r.get('BPTT / best', '') for r in rows])} ({where})"

    def inverse(column: str) -> str:
        """The host step's BPPSA / torch.nn at T = 10, the RNN's, GRU's and LSTM's, turned over."""
        ratios = [_number(_find(host, model=m, T="10").get(column, "")) for m in ("rnn", "gru", "lstm")]
        return " / ".join(f"{1 / r:.3g}×" if r else "–" for r in ratios)

    memory = _find(capture, model="rnn", T="1000", B="16", H="20")
    trained = epoch[0] if epoch else {}
    return [
        ("RNN backward, eager, T = 1,000 / 10,000 / 100,000", "capture",
         ratios("cuDNN / BPPSA eager", "rnn", 1000, 10_000, 100_000)),
        ("RNN backward captured in a CUDA graph, GPU time, T = 1,000 / 10,000", "capture",
         ratios("cuDNN / BPPSA captured bwd", "rnn", 1000, 10_000)),
        ("RNN training step captured, GPU time, T = 1,000 / 10,000", "capture",
         ratios("cuDNN / BPPSA captured", "rnn", 1000, 10_000)),
        ("GRU / LSTM backward, eager, T = 1,000", "capture",
         f"{ratios('cuDNN / BPPSA eager', 'gru', 1000)} / {ratios('cuDNN / BPPSA eager', 'lstm', 1000)}"),
        ("GRU / LSTM backward captured, GPU time, T = 1,000", "capture",
         f"{ratios('cuDNN / BPPSA captured bwd', 'gru', 1000)} / "
         f"{ratios('cuDNN / BPPSA captured bwd', 'lstm', 1000)}"),
        ("RNN backward over T, BPPSA's best strategy", "backward", best("rnn", "16")),
        ("GRU backward at the paper's IRMAS shapes, best strategy", "backward", best("gru", None)),
        ("Training epoch, bitstream RNN, T = 1,000: eager / steps captured", "epoch",
         f"{_times(trained.get('BPTT / BPPSA', ''))} / {_times(trained.get('captured BPTT / BPPSA', ''))}"),
        ("Layer forward, eager, T = 10: RNN / GRU / LSTM", "host", inverse("forward ratio")),
        ("Training step of a layer, eager, T = 10: RNN / GRU / LSTM", "host", inverse("step ratio")),
        ("RNN backward's peak memory, T = 1,000: cuDNN / BPPSA", "capture",
         f"{memory.get('cuDNN peak MiB', '–')} / {memory.get('BPPSA peak MiB', '–')} MiB" if memory else "–"),
    ]  # fmt: skip


def glance(bodies: dict[str, str]) -> str:
    """``glance_lines`` as a Markdown table, "" where there are none: the figures of the report's
    sections in one place."""
    return compare([("BPPSA against cuDNN", bodies)])


def compare(reports: Sequence[tuple[str, dict[str, str]]]) -> str:
    """Several reports' ``glance_lines`` side by side, a column each (``reports``: a name and its
    steps), "" where none has a table this reads: GPUs compared at a look (``--glance``)."""
    columns = [(name, glance_lines(bodies)) for name, bodies in reports]
    if not any(lines for _, lines in columns):
        return ""
    measures = next(lines for _, lines in columns if lines)
    rows = [
        [measure, step, *((lines[i][2] if lines else "–") for _, lines in columns)]
        for i, (measure, step, _) in enumerate(measures)
    ]
    return markdown([GLANCE_HEAD, "step", *(name for name, _ in columns)], rows)


def report_name(text: str, path: Path) -> str:
    """What a written report measured on, for its column: its GPU's name (``environment``'s line),
    else the file's name."""
    found = re.search(r"^- GPU: ([^,\n]+)", text, flags=re.MULTILINE)
    return found.group(1) if found else path.name


def report_steps(text: str) -> dict[str, str]:
    """A written report's steps: each step's name to what follows its ``Step `name`:`` line (its
    commands and output), as ``render`` lays them out."""
    parts = re.split(r"^Step `(\w+)`:", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def render(sections: dict[str, Section], dry: bool, argv: Sequence[str]) -> str:
    """The whole report: the environment, the headline ratios against cuDNN (``glance``; not in a
    dry run, whose baseline is PyTorch's CPU kernel), then each step."""
    parts = [f"# GPU check{' (dry run)' if dry else ''}", "", environment(dry, argv), ""]
    headline = "" if dry else glance({name: s.body for name, s in sections.items()})
    if headline:
        parts += ["## At a glance", "", headline, ""]
    for name, s in sections.items():
        took = f", {s.seconds:.0f} s" if s.seconds else ""
        parts += [f"## {s.title}", "", f"Step `{name}`: {s.status}{took}"]
        parts += [""] + [f"    {c}" for c in s.commands] + ([""] if s.commands else [])
        parts += [s.body.strip(), ""]
    return "\n".join(parts)


def parse_args(argv: Sequence[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=output_file, default=Path("gpu_report.md"), help="where the report is written"
    )
    p.add_argument("--dry", action="store_true", help="run on the CPU at small shapes; CUDA steps skipped")
    p.add_argument(
        "--glance",
        type=Path,
        nargs="+",
        metavar="REPORT",
        help="print written reports' headline ratios ('At a glance'), a column each, and run nothing",
    )
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps to run")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed repeats of every measurement")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed warm-up runs before them")
    p.add_argument(
        "--step-timeout", type=positive_float, default=300.0, help="seconds before a step is stopped"
    )
    args = p.parse_args(argv)
    if args.glance is not None:
        for report in args.glance:
            if not report.is_file():
                p.error(f"--glance {report}: no such file; accepted: a report this command wrote")
        return args
    if not args.dry and not torch.cuda.is_available():
        p.error("no CUDA device here; accepted: a machine with a GPU, or --dry to check the command on a CPU")
    if not args.out.parent.is_dir():
        p.error(f"--out {args.out}: its folder does not exist; accepted: a file in an existing folder")
    return args


def run_step(name: str, todo: list[list[str]] | str, args: argparse.Namespace) -> Section:
    """One step of the plan: its commands run one after another (a failure is reported, the rest
    still run), or the reason it is skipped."""
    section = Section(TITLES[name])
    if isinstance(todo, str) and todo != "in process":
        section.status, section.body = "skipped", f"Skipped: {todo}."
        return section
    t0 = time.perf_counter()
    if name == "workers":
        work: list[Callable[[], tuple[bool, str]]] = [
            lambda: (True, worker_scaling(args.dry, args.repeats, args.warmup))
        ]
    else:
        section.commands = [shlex.join(_shown(argv_)) for argv_ in todo]
        work = [lambda a=argv_: run_command(a, args.step_timeout) for argv_ in todo]
    outputs = []
    for job in work:
        try:
            ok, text = job()
        except Exception as exc:  # one failed step is reported; the others still run
            ok, text = False, f"{type(exc).__name__}: {exc}"
        outputs.append(text)
        if not ok:
            section.status = "failed"
    section.seconds = time.perf_counter() - t0
    section.body = "\n\n".join(outputs)
    return section


def partial(out: Path) -> Path:
    """Where the report stands while its steps run."""
    return out.with_name(out.name + ".partial")


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the steps, write the report; exit status 1 if any step failed, 130 (143) if Ctrl-C
    (SIGTERM) stopped it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    if args.glance is not None:
        texts = [(path, path.read_text(encoding="utf-8", errors="replace")) for path in args.glance]
        table = compare([(report_name(text, path), report_steps(text)) for path, text in texts])
        if not table:
            no_table = (
                "no capture, backward, epoch or host table in them; accepted: reports this command wrote"
            )
            print(f"{prog}: error: --glance {' '.join(map(str, args.glance))}: {no_table}", file=sys.stderr)
            return 2
        print(table)
        return 0
    progress = Progress("gpu_check")
    steps = plan(args.dry, args.repeats, args.warmup, args.out)
    sections: dict[str, Section] = {}
    so_far, name = partial(args.out), args.steps[0]
    try:
        with terminate_as_interrupt():
            for name in args.steps:
                progress(f"{name} ...")
                sections[name] = run_step(name, steps[name], args)
                report = render(sections, args.dry, argv)  # after every step: a stopped run keeps it
                write_atomic(so_far, lambda tmp, text=report: tmp.write_text(text))
    except KeyboardInterrupt as exc:
        kept = f"the finished steps are in {so_far}" if sections else "no step had finished"
        print(f"{prog}: stopped in step {name}; {kept}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130  # as a shell reports SIGTERM, SIGINT
    os.replace(so_far, args.out)
    failed = [n for n, s in sections.items() if s.status == "failed"]
    progress(f"report written to {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.gpu_check", main))
