"""Backward-pass benchmark: PyTorch's BPTT (autograd over its fused RNN/GRU) against BPPSA.

    python -m experiments.bench_backward --model rnn --T 100 1000 10000 --B 16 --H 20

For every configuration both modules share weights and inputs; each backward is timed on its own
(forward excluded) as the median of ``--repeats`` runs after ``--warmup`` runs, all in one process,
so the ratio BPPSA / BPTT compares like with like. The last column is the largest relative gradient
difference between the two, a check that the timed code computes the same thing.

Prints a Markdown table. Imports nothing beyond torch, so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bppsa_core import nn as bnn
from bppsa_core.scan import STRATEGIES

MODELS = ("rnn", "gru")


@dataclass
class Row:
    model: str
    steps: int
    batch: int
    hidden: int
    bptt_ms: float
    bppsa_ms: dict[str, float]
    max_rel_err: float


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; accepted: positive integers") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive; accepted: positive integers")
    return value


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Milliseconds of one call: CUDA events on a GPU, synchronized wall clock elsewhere."""
    if device.type == "cuda":

        def cuda_time(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end)

        return cuda_time

    def wall_time(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return wall_time


def time_backward(
    module: torch.nn.Module,
    x: torch.Tensor,
    head: torch.Tensor,
    loss: str,
    warmup: int,
    repeats: int,
) -> tuple[float, list[torch.Tensor]]:
    """Median backward time (ms) of ``loss`` through ``module``, and the gradients of the last run."""
    clock = _timer(x.device)
    times = []
    for i in range(warmup + repeats):
        module.zero_grad(set_to_none=True)
        out, h_n = module(x)
        value = (h_n[-1] @ head).sum() if loss == "last" else (out @ head).sum()
        ms = clock(value.backward)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times), [p.grad.detach().clone() for p in module.parameters()]


def bench(
    model: str,
    steps: int,
    batch: int,
    hidden: int,
    features: int,
    strategies: Sequence[str],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    loss: str = "last",
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> Row:
    """Time one configuration: BPTT, then BPPSA with every scan strategy."""
    torch.manual_seed(seed)
    ref_cls, our_cls = (torch.nn.RNN, bnn.RNN) if model == "rnn" else (torch.nn.GRU, bnn.GRU)
    ref = ref_cls(features, hidden, batch_first=True).to(device, dtype)
    x = torch.bernoulli(torch.full((batch, steps, features), 0.5, device=device, dtype=dtype))
    head = torch.randn(hidden, 1, device=device, dtype=dtype)
    bptt_ms, ref_grads = time_backward(ref, x, head, loss, warmup, repeats)
    times, err = {}, 0.0
    for strategy in strategies:
        ours = our_cls(features, hidden, batch_first=True, strategy=strategy).to(device, dtype)
        ours.load_state_dict(ref.state_dict())
        times[strategy], grads = time_backward(ours, x, head, loss, warmup, repeats)
        for a, b in zip(ref_grads, grads, strict=True):
            err = max(err, ((a - b).norm() / a.norm().clamp_min(1e-30)).item())
    return Row(model, steps, batch, hidden, bptt_ms, times, err)


def format_table(rows: Sequence[Row], strategies: Sequence[str]) -> str:
    """Markdown table: times in ms and BPPSA / BPTT ratios."""
    head = ["model", "T", "B", "H", "BPTT ms"]
    for s in strategies:
        head += [f"{s} ms", f"{s} / BPTT"]
    head.append("max rel grad diff")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.model, str(r.steps), str(r.batch), str(r.hidden), f"{r.bptt_ms:.2f}"]
        for s in strategies:
            cells += [f"{r.bppsa_ms[s]:.2f}", f"{r.bppsa_ms[s] / r.bptt_ms:.3f}"]
        cells.append(f"{r.max_rel_err:.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_line(device: torch.device) -> str:
    """What the numbers were measured on."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"device: {device.type} ({where}); torch {torch.__version__}; python {platform.python_version()}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="rnn")
    parser.add_argument("--T", type=_positive, nargs="+", default=[100, 1000, 10000], help="sequence lengths")
    parser.add_argument("--B", type=_positive, default=16, help="batch size")
    parser.add_argument("--H", type=_positive, default=20, help="hidden size")
    parser.add_argument("--F", type=_positive, default=1, help="input features")
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["chunked", "blelloch"],
        choices=STRATEGIES,
        help="BPPSA scan strategies to time",
    )
    parser.add_argument("--loss", choices=("last", "all"), default="last", help="loss on h_T or every output")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--threads", type=_positive, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=_positive, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"unknown device {args.device!r}; accepted: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"device {args.device!r} asked for, but CUDA is not available here; accepted: cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    for steps in args.T:
        print(f"[bench] {args.model} T={steps} B={args.B} H={args.H} ...", file=sys.stderr, flush=True)
        rows.append(
            bench(
                args.model,
                steps,
                args.B,
                args.H,
                args.F,
                args.strategies,
                device,
                dtype,
                args.loss,
                args.warmup,
                args.repeats,
            )
        )
    print(machine_line(device))
    print(
        f"loss on {'h_T' if args.loss == 'last' else 'every output'}, {args.dtype}, median of {args.repeats}"
    )
    print(format_table(rows, args.strategies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
