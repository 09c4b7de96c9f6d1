"""Host-path benchmark: one short layer's forward and backward, BPPSA's modules against torch.nn's.

    python -m benchmarks.host                          # RNN, GRU, LSTM at T = 10, B = 16, H = 20
    python -m benchmarks.host --device cuda            # the same on a GPU, eager wall-clock
    python -m benchmarks.host --strategy sequential    # BPPSA's layer around PyTorch's fused forward
    python -m benchmarks.host --profile 300            # and where a BPPSA step's host time goes

At T = 10, B = 16, H = 20 a layer's arithmetic is a few microseconds, so what is timed is the work
around it that does not grow with T: Python, dispatch, allocations and launches. For each model one
torch.nn module and one ``bppsa_core`` module with the same weights run, taking turns, the training
forward (``forward``) and the forward with the backward of a loss on h_T (``step``), then, in rounds
of its own, the forward under ``torch.no_grad`` (``inference``); each cell is
the median of ``--repeats`` rounds after ``--warmup``, all in one process, with ``--threads`` CPU
threads (default one: the host path, not the parallel work, is what is measured). The last column
is the largest relative difference of the two modules' gradients, a check that both computed the
same thing. ``--strategy``: the BPPSA module's (default "auto"); on a CPU "sequential" keeps
PyTorch's fused forward inside BPPSA's layer, as a GPU's eager forward does, so the forward ratio
is then the cost of BPPSA's layer call around the same kernel. ``--profile CALLS``: then, per model
at the first T, CALLS training steps of each module under ``cProfile``, and the functions that take
most of BPPSA's step by their own time (the host's time: on a GPU the launches, not the kernels), so
that a GPU machine's host path can be read and cut where no GPU is.

Prints Markdown; progress goes to stderr. Imports nothing beyond torch, so it runs on a bare GPU
machine.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from benchmarks.common import (
    Progress,
    device_arg,
    fmt_ms,
    machine_line,
    markdown,
    non_negative_int,
    on_device,
    parser,
    positive_int,
    profiled_events,
    run_tool,
    threads_arg,
)
from benchmarks.scan import MODULES, module_pair
from bppsa_core.dispatch import STRATEGIES, check_device
from experiments.timing import time_ms

FEATURES = 1  # the paper's bitstream input


@dataclass
class Row:
    model: str
    steps: int
    batch: int
    hidden: int
    forward_ms: tuple[float, float]  # torch.nn's, BPPSA's
    step_ms: tuple[float, float]
    inference_ms: tuple[float, float]
    grad_diff: float
    ops: tuple[int, int] = (0, 0)  # a step's ATen operator calls, torch.nn's and BPPSA's
    kernels: tuple[int, int] | None = None  # a step's GPU kernels and copies (CUDA only)


def _inference(module: torch.nn.Module, x: Tensor) -> None:
    with torch.no_grad():
        module(x)


def _step(module: torch.nn.Module, x: Tensor) -> None:
    out, _ = module(x)
    out[-1].sum().backward()


def dispatched(fn: Callable[[], object], device: torch.device) -> tuple[int, int | None]:
    """The ATen operator calls one call of ``fn`` makes (those no other operator made: the host's
    dispatches, views included) and, on a GPU, the kernels and copies it runs there; one call
    under ``torch.profiler``."""
    events = profiled_events(fn, device)
    aten = [e for e in events if e.name.startswith("aten::")]
    ops = sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    return ops, (sum(1 for e in events if on_device(e)) if device.type == "cuda" else None)


def _medians(
    work: dict[str, Callable[[], object]],
    modules: Sequence[torch.nn.Module],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> dict[str, float]:
    """The median time of each of ``work``'s calls, taking turns in ``warmup + repeats`` rounds, each
    round from the ``modules``' gradients unset (its step's gradients are its own)."""
    times: dict[str, list[float]] = {name: [] for name in work}
    for r in range(warmup + repeats):
        for m in modules:
            m.zero_grad(set_to_none=True)
        for name, fn in work.items():
            ms = time_ms(fn, device)
            if r >= warmup:
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def _modules_and_input(
    model: str, steps: int, batch: int, hidden: int, device: torch.device, dtype: torch.dtype, strategy: str
) -> tuple[torch.nn.Module, torch.nn.Module, Tensor]:
    """torch.nn's module and BPPSA's with the same weights (``strategy`` BPPSA's), and an input
    (T, B, FEATURES): the same for every table and profile of a shape."""
    torch.manual_seed(0)
    ref, ours = module_pair(model, FEATURES, hidden, device, dtype, strategy=strategy)
    x = torch.randn(steps, batch, FEATURES, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    return ref, ours, x


def bench(
    model: str,
    steps: int,
    batch: int,
    hidden: int,
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    repeats: int,
    strategy: str = "auto",
) -> Row:
    """One row: both modules' forward and step, taking turns on the same input, then their
    inference, taking turns in rounds of its own (so that it leaves the others' caches as they
    were); ``strategy``: the BPPSA module's."""
    ref, ours, x = _modules_and_input(model, steps, batch, hidden, device, dtype, strategy)
    training: dict[str, Callable[[], object]] = {
        "nn forward": lambda: ref(x),
        "bppsa forward": lambda: ours(x),
        "nn step": lambda: _step(ref, x),
        "bppsa step": lambda: _step(ours, x),
    }
    inference = {"nn inference": lambda: _inference(ref, x), "bppsa inference": lambda: _inference(ours, x)}
    med = _medians(training, (ref, ours), device, warmup, repeats)
    diff = max(
        ((a.grad - b.grad).norm() / b.grad.norm().clamp_min(1e-30)).item()
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True)
    )
    med |= _medians(inference, (), device, warmup, repeats)
    (nn_ops, nn_kernels), (our_ops, our_kernels) = (
        dispatched(training[f"{m} step"], device) for m in ("nn", "bppsa")
    )
    return Row(
        model, steps, batch, hidden,
        (med["nn forward"], med["bppsa forward"]), (med["nn step"], med["bppsa step"]),
        (med["nn inference"], med["bppsa inference"]), diff,
        (nn_ops, our_ops), None if nn_kernels is None else (nn_kernels, our_kernels),
    )  # fmt: skip


def profiled(
    model: str,
    steps: int,
    batch: int,
    hidden: int,
    device: torch.device,
    dtype: torch.dtype,
    strategy: str,
    calls: int,
) -> tuple[pstats.Stats, pstats.Stats, dict[str, float]]:
    """torch.nn's and BPPSA's ``calls`` training steps (forward, and backward of a loss on h_T) under
    ``cProfile``, each module warmed up first; on a GPU the host's time up to the last launch. The
    backward runs on the profiled thread: a GPU's runs on autograd's device thread otherwise, which
    cProfile does not see. Then, unprofiled, the median step of each module (``calls`` rounds) with
    the backward on autograd's device threads ("on") and on the calling thread ("off"), taking
    turns: what the hand-over to the device thread costs (on a CPU nothing: its backward runs on
    the calling thread either way)."""
    ref, ours, x = _modules_and_input(model, steps, batch, hidden, device, dtype, strategy)
    stats = []
    with torch.autograd.set_multithreading_enabled(False):
        for m in (ref, ours):
            for _ in range(3):
                _step(m, x)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(calls):
                _step(m, x)
            profile.disable()
            stats.append(pstats.Stats(profile))
    work: dict[str, Callable[[], object]] = {}
    for mode, run in (("on", _step), ("off", _on_calling_thread)):  # each call after the other module's
        for name, m in (("nn", ref), ("bppsa", ours)):
            work[f"{name} {mode}"] = functools.partial(run, m, x)
    return stats[0], stats[1], _medians(work, (ref, ours), device, 3, calls)


def _on_calling_thread(module: torch.nn.Module, x: Tensor) -> None:
    with torch.autograd.set_multithreading_enabled(False):
        _step(module, x)


def _where(func: tuple[str, int, str]) -> str:
    """A profiled function as ``name (file:line)``, the file its last two path parts; a builtin's name."""
    path, line, name = func
    if path == "~":
        return name
    return f"{name} ({'/'.join(Path(path).parts[-2:])}:{line})"


def format_profile(
    model: str,
    nn_stats: pstats.Stats,
    stats: pstats.Stats,
    steps: dict[str, float],
    calls: int,
    top: int = 15,
) -> str:
    """Markdown: the ``top`` functions of BPPSA's profiled step by own time, per step, under a line
    with both modules' whole step as the profiler saw it and one with their unprofiled medians
    (``profiled``'s ``steps``)."""
    us = 1e6 / calls
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    body = [
        [f"`{_where(f)}`", f"{nc / calls:g}", f"{tt * us:.1f}", f"{ct * us:.1f}"]
        for f, (_, nc, tt, ct, _) in rows
    ]
    line = (
        f"{model}: a step under the profiler, {calls} steps, the backward on the calling thread: "
        f"torch.nn {nn_stats.total_tt * us:.0f} µs, BPPSA {stats.total_tt * us:.0f} µs"
    )
    timed = (
        f"{model}: a step unprofiled, median of {calls}, the backward on autograd's device threads / on "
        f"the calling thread: torch.nn {fmt_ms(steps['nn on'])} / {fmt_ms(steps['nn off'])} ms, "
        f"BPPSA {fmt_ms(steps['bppsa on'])} / {fmt_ms(steps['bppsa off'])} ms"
    )
    return f"{line}\n\n{timed}\n\n" + markdown(
        ["BPPSA function", "calls a step", "own µs", "with callees µs"], body
    )


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: per model, each module's forward, inference and step time and BPPSA's ratio to
    torch.nn's."""
    on_gpu = any(r.kernels is not None for r in rows)
    head = ["model", "T", "B", "H", "nn forward ms", "BPPSA forward ms", "forward ratio"]
    head += ["nn inference ms", "BPPSA inference ms", "inference ratio"]
    head += ["nn step ms", "BPPSA step ms", "step ratio", "nn ops", "BPPSA ops"]
    head += ["nn kernels", "BPPSA kernels"] if on_gpu else []
    body = []
    for r in rows:
        cells = [r.model, str(r.steps), str(r.batch), str(r.hidden)]
        for nn_ms, ours_ms in (r.forward_ms, r.inference_ms, r.step_ms):
            cells += [fmt_ms(nn_ms), fmt_ms(ours_ms), f"{ours_ms / nn_ms:.2f}"]
        cells += [str(n) for n in r.ops]
        if on_gpu:
            cells += ["–", "–"] if r.kernels is None else [str(n) for n in r.kernels]
        body.append([*cells, f"{r.grad_diff:.1e}"])
    return markdown([*head, "grad rel. diff"], body)


LEGEND = (
    "'forward': the training forward of one layer; 'inference': the forward under torch.no_grad; "
    "'step': the training forward and the backward of a loss on h_T; 'ratio': BPPSA's time over "
    "torch.nn's (below 1: BPPSA is faster); 'ops': the ATen operator calls of one step, views "
    "included, each a dispatch on the host; 'kernels' (GPU): the kernels and copies one step runs on "
    "the device; 'grad rel. diff': the largest relative difference of the parameter gradients between "
    "the two modules."
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad value ends the tool with one line and status 2."""
    p = parser("benchmarks.host", __doc__)
    p.add_argument("--models", nargs="+", choices=tuple(MODULES), default=list(MODULES), help="models")
    p.add_argument("--T", type=positive_int, nargs="+", default=[10], help="sequence lengths")
    p.add_argument("--B", type=positive_int, default=16, help="batch size")
    p.add_argument("--H", type=positive_int, default=20, help="hidden size")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--strategy", choices=STRATEGIES, default="auto", help="the BPPSA module's strategy")
    p.add_argument("--threads", type=threads_arg, default=1, help="CPU threads")
    p.add_argument("--repeats", type=positive_int, default=200, help="timed rounds (the median is shown)")
    p.add_argument("--warmup", type=non_negative_int, default=20, help="untimed rounds before them")
    p.add_argument(
        "--profile", type=positive_int, default=None, metavar="CALLS", help="profile CALLS steps a model"
    )
    args = p.parse_args(argv)
    try:  # one that cannot run on the device is refused before anything is timed
        check_device(args.strategy, args.device)
    except ValueError as exc:
        p.error(f"--strategy: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table once every model is measured."""
    args = parse_args(argv)
    progress = Progress("host")
    torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    print(machine_line(device))
    print(
        f"{args.dtype}, BPPSA strategy {args.strategy}, median of {args.repeats} after {args.warmup} "
        "warm-up rounds, taking turns"
    )
    rows = []
    for model in args.models:
        for t in args.T:
            progress(f"{model} T={t} ...")
            row = bench(model, t, args.B, args.H, device, dtype, args.warmup, args.repeats, args.strategy)
            rows.append(row)
    print(f"\n{LEGEND}\n\n{format_table(rows)}", flush=True)
    if args.profile:
        print(f"\nWhere a step's host time goes (T = {args.T[0]}; cProfile's own overhead included):")
        for model in args.models:
            progress(f"{model} profile ...")
            stats = profiled(model, args.T[0], args.B, args.H, device, dtype, args.strategy, args.profile)
            print(f"\n{format_profile(model, *stats, args.profile)}", flush=True)
    progress("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.host", main))
