"""Measured iterations of the parallel training schemes that exist in code, for ``analysis.schemes``.

    python -m benchmarks.schemes --out results/schemes
    # then the analysis command it prints: the model with this machine's FLOP rate, α and β, and
    # the measured points on the same axes

VGG-11 (CIFAR-10 shapes), one training iteration's forward and backward on ``--batch`` samples,
timed three ways on this machine: sequential BP on one process of one thread; data parallel on two
processes of one thread each (``DistributedDataParallel`` over gloo, half the batch each); and a
two-stage GPipe pipeline (``torch.distributed.pipelining.ScheduleGPipe``, the network cut after its
``--split``-th weighted layer, ``--micro-batches`` micro-batches). Each time is the median of
``--repeats`` iterations after ``--warmup``, the processes meeting at a barrier before and after
each. The same run measures what the model takes: the FLOP rate of the sequential iteration
(FLOPs counted by ``torch.utils.flop_counter``), and α and β from a ping-pong between the two
processes (one number, then ``--pingpong-mb`` MiB).

Writes ``measured.csv`` (scheme, p, time in seconds, and the settings) and ``calibration.json``.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from analysis.schemes.network import CLASSES, build_vgg11
from benchmarks.common import (
    Progress,
    machine_line,
    non_negative_int,
    parser,
    positive_float,
    positive_int,
    run_tool,
)
from experiments.records import write_table
from toolbox.files import output_folder, write_atomic

RANKS = 2


def _median_time(step: Callable[[], None], warmup: int, repeats: int, barrier: bool) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        step()
        if barrier:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _batch(batch: int, image_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, image_size, image_size, generator=g)
    return images, torch.randint(0, CLASSES, (batch,), generator=g)


def split_at(model: nn.Sequential, weighted: int) -> tuple[nn.Sequential, nn.Sequential]:
    """The model cut after its ``weighted``-th Conv2d / Linear and the parameter-free modules that
    follow it (the layers ``analysis.schemes`` counts)."""
    seen, cut = 0, None
    for i, module in enumerate(model):
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            if seen == weighted:
                cut = i
                break
            seen += 1
    total = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model)
    if cut is None or weighted < 1:
        raise ValueError(f"--split {weighted} does not cut the network; accepted: 1 to {total - 1}")
    return model[:cut], model[cut:]


def sequential(args) -> tuple[float, float]:
    """Seconds per iteration on one thread, and the FLOPs of one iteration."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, loss_fn = build_vgg11(args.width), nn.CrossEntropyLoss()
    x, y = _batch(args.batch, 32)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    with FlopCounterMode(display=False) as counter:
        step()
    return _median_time(step, args.warmup, args.repeats, barrier=False), float(counter.get_total_flops())


def _worker(rank: int, args, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    try:
        results = {"data": _data_parallel(rank, args), "gpipe": _gpipe(rank, args), **_pingpong(rank, args)}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _data_parallel(rank: int, args) -> float:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_vgg11(args.width))
    loss_fn = nn.CrossEntropyLoss()
    x, y = _batch(args.batch, 32)
    share = args.batch // RANKS
    x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    return _median_time(step, args.warmup, args.repeats, barrier=True)


def _gpipe(rank: int, args) -> float:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    parts = split_at(build_vgg11(args.width), args.split)
    stage = PipelineStage(parts[rank], stage_index=rank, num_stages=RANKS, device=torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=args.micro_batches, loss_fn=nn.CrossEntropyLoss())
    x, y = _batch(args.batch, 32)

    def step() -> None:
        parts[rank].zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)

    return _median_time(step, args.warmup, args.repeats, barrier=True)


def _pingpong(rank: int, args) -> dict[str, float]:
    """α: half a round trip of one number; β: the extra half round trip per byte of a large message."""

    def one_way(numbers: int) -> float:
        buffer = torch.zeros(numbers)

        def step() -> None:
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)

        return _median_time(step, args.warmup, max(args.repeats, 5), barrier=False) / 2

    alpha = one_way(1)
    large = int(args.pingpong_mb * 2**20 / 4)
    beta = max(one_way(large) - alpha, 0.0) / (4 * large)
    return {"alpha": alpha, "beta": beta}


def measure(args, progress: Callable[[str], None]) -> tuple[list[dict], dict]:
    """The measured rows and the calibration (FLOP rate, α, β)."""
    torch.set_num_threads(1)
    progress("sequential, 1 process")
    seq_time, flops = sequential(args)
    progress(f"data parallel and GPipe, {RANKS} processes of 1 thread")
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        # Its warning that it ends the other process after one fails: the failure's own line says it.
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        mp.spawn(_worker, args=(args, store, out), nprocs=RANKS, join=True)
        two = json.loads(Path(out).read_text())
    settings = {"model": "vgg11", "batch": args.batch, "width": args.width, "threads_per_process": 1}
    rows = [
        {"scheme": "sequential", "p": 1, "time": seq_time, "micro_batches": 1, **settings},
        {"scheme": "data", "p": RANKS, "time": two["data"], "micro_batches": 1, **settings},
        {
            "scheme": "gpipe",
            "p": RANKS,
            "time": two["gpipe"],
            "micro_batches": args.micro_batches,
            **settings,
        },
    ]
    calibration = {
        "flops": flops / seq_time,
        "alpha": two["alpha"],
        "beta": two["beta"],
        "iteration_flops": flops,
    }
    return rows, calibration


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("benchmarks.schemes", __doc__)
    p.add_argument("--out", type=output_folder, required=True, help="output folder")
    p.add_argument("--batch", type=positive_int, default=32, help="samples per iteration")
    p.add_argument("--width", type=positive_float, default=1.0, help="VGG-11's channel multiplier")
    p.add_argument(
        "--split", type=positive_int, default=4, help="weighted layers on the first pipeline stage"
    )
    p.add_argument("--micro-batches", type=positive_int, default=8, help="GPipe's micro-batches")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed iterations first")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed iterations (median)")
    p.add_argument(
        "--pingpong-mb", type=positive_float, default=16.0, help="the large ping-pong message, MiB"
    )
    args = p.parse_args(argv)
    if args.batch % args.micro_batches:
        p.error(
            f"--batch {args.batch} does not split into {args.micro_batches} micro-batches; "
            f"accepted: a multiple of --micro-batches"
        )
    if args.batch % RANKS:
        p.error(
            f"--batch {args.batch} does not split over {RANKS} processes; accepted: a multiple of {RANKS}"
        )
    try:
        split_at(build_vgg11(args.width), args.split)
    except ValueError as exc:
        p.error(str(exc))
    progress = Progress("schemes")
    rows, calibration = measure(args, progress)
    out = Path(args.out)
    write_table(out / "measured.csv", rows)
    write_atomic(
        out / "calibration.json", lambda path: path.write_text(json.dumps(calibration, indent=2) + "\n")
    )
    print(machine_line(torch.device("cpu")))
    for r in rows:
        print(f"{r['scheme']:>10}  p = {r['p']}  {r['time'] * 1e3:8.1f} ms per iteration")
    print(
        f"FLOP rate {calibration['flops']:.3g} FLOP/s (one thread), α {calibration['alpha']:.3g} s, "
        f"β {calibration['beta']:.3g} s/byte"
    )
    command = ["python -m analysis.schemes --model vgg11", f"--batch {args.batch}", "--p 1 2 4 8"]
    command += [f"--width {args.width:g}"] if args.width != 1 else []
    command += [f"--micro-batches {args.micro_batches}", f"--calibration {out / 'calibration.json'}"]
    command += [f"--measured {out / 'measured.csv'}", f"--out {out}"]
    print("\nthe model beside these points:\n" + " ".join(command))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.schemes", main, "smaller --pingpong-mb, --batch or --width"))
