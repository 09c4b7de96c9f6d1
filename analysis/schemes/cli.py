"""The command: ``python -m analysis.schemes`` (its flags are ``parser``'s)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from analysis.data import AnalysisError
from analysis.schemes import __doc__ as PACKAGE_DOC
from analysis.schemes.machine import CALIBRATION, Machine, load_calibration
from analysis.schemes.network import MODELS, WIDEST, network
from analysis.schemes.report import figure, load_measured, write
from analysis.schemes.schemes import PIPELINES, SCHEMES, estimates, pipeline, table, versus
from toolbox.cli import OneLineParser, non_negative_float, positive_float, positive_int
from toolbox.files import output_folder


def parser() -> OneLineParser:
    """The command's flags; those left unset (None) are resolved in ``main``."""
    p = OneLineParser(prog="python -m analysis.schemes", description=PACKAGE_DOC.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="vgg11", help="the network")
    p.add_argument(
        "--batch", type=positive_int, help="samples per iteration (default: 128 for vgg11, 16 else)"
    )
    p.add_argument("--T", type=positive_int, default=1000, help="sequence length (rnn, gru)")
    p.add_argument("--hidden", type=positive_int, default=20, help="hidden size (rnn, gru)")
    p.add_argument("--inputs", type=positive_int, help="input features (default: 1 for rnn, 24 for gru)")
    p.add_argument("--classes", type=positive_int, help="classes (default: 10, 11 for gru)")
    p.add_argument(
        "--width", type=positive_float, default=1.0, help=f"VGG-11's channel multiplier, up to {WIDEST}"
    )
    p.add_argument("--p", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="processor counts")
    p.add_argument(
        "--schemes",
        nargs="+",
        choices=SCHEMES,
        metavar="NAME",
        help=f"which to estimate, of {', '.join(SCHEMES)} (default: all)",
    )
    p.add_argument(
        "--flops", type=positive_float, help=f"FLOP/s of one processor (default: {Machine.flops:g})"
    )
    p.add_argument(
        "--alpha", type=non_negative_float, help=f"seconds per message (default: {Machine.alpha:g})"
    )
    p.add_argument("--beta", type=non_negative_float, help=f"seconds per byte (default: {Machine.beta:g})")
    p.add_argument(
        "--calibration",
        nargs="+",
        help="calibration.json files of benchmarks.schemes (flops, alpha, beta) or "
        "benchmarks.distributed (overhead, forward_step, forward_sample, forward_group, walk, fold, groups): "
        "they set what the flags leave unset, a later file winning",
    )
    p.add_argument("--overhead", type=non_negative_float, help="seconds per layer operation (default: 0)")
    for flag, what in (
        ("--forward-step", "seconds per step of a device's fused forward, whatever the batch"),
        ("--forward-sample", "seconds per step and sample of a device's compiled BPPSA forward"),
        ("--forward-group", "seconds per step and group of samples of a device's compiled BPPSA forward"),
        ("--walk", "seconds per step and sample of a device's compiled BPPSA backward of its slice"),
        ("--fold", "seconds per step and sample of a middle device's fold of its slice"),
    ):
        p.add_argument(flag, type=non_negative_float, help=f"{what} (default: 0, its operations)")
    p.add_argument(
        "--groups",
        type=positive_int,
        help="sample groups BPPSA's backward pipelines over the devices (default: 1)",
    )
    p.add_argument("--word", type=positive_int, default=4, help="bytes per number")
    p.add_argument(
        "--micro-batches", type=positive_int, help="per iteration in the pipelines (default: min(4p, B))"
    )
    p.add_argument("--blocks", type=positive_int, default=256, help="layers the pipelines schedule at most")
    p.add_argument("--gantt", type=positive_int, default=4, help="p of the Gantt charts")
    p.add_argument("--gantt-micro-batches", type=positive_int, help="in the Gantt charts (default: their p)")
    p.add_argument("--measured", help="a measured.csv to draw beside the model")
    p.add_argument("--out", type=output_folder, default="schemes", help="output folder")
    return p


def _header(name: str, batch: int, args: argparse.Namespace) -> str:
    """The first line of the table and the figure's title: the network and the machine."""
    header = (
        f"{name}, B = {batch}, on p processors of {args.flops:.3g} FLOP/s "
        f"(overhead {args.overhead:g} s per operation), α = {args.alpha:g} s, β = {args.beta:g} s/byte, "
        f"{args.word} bytes per number"
    )
    if args.forward_step or args.forward_sample or args.walk or args.fold:
        header += (
            f"; a device's compiled steps: forward {args.forward_step:.3g} s per step"
            + (
                f" (BPPSA's {args.forward_sample:.3g} s per step and sample, {args.forward_group:.3g} s per "
                "step and group)"
                if args.forward_sample
                else ""
            )
            + f", walk {args.walk:.3g} s and fold {args.fold:.3g} s per step and sample"
        )
    if args.groups > 1:
        header += f"; BPPSA in {args.groups} sample groups"
    return header


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.schemes = args.schemes or list(SCHEMES)
    batch = args.batch or (128 if args.model == "vgg11" else 16)
    inputs = args.inputs or (24 if args.model == "gru" else 1)
    classes = args.classes or (11 if args.model == "gru" else 10)
    if args.model == "vgg11" and args.width > WIDEST:
        p.error(
            f"--width {args.width:g} is too wide to count: VGG-11's widest weight would pass 2^63 bytes; "
            f"accepted: up to {WIDEST}"
        )
    for flag in ("micro_batches", "groups"):
        if getattr(args, flag) and getattr(args, flag) > batch:
            name = "--" + flag.replace("_", "-")
            p.error(f"{name} {getattr(args, flag)} exceeds the batch {batch}; accepted: 1 to {batch}")
    try:
        measured = load_measured(args.measured) if args.measured else None
        calibrated = {k: v for path in args.calibration or [] for k, v in load_calibration(path).items()}
    except AnalysisError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    defaults = {"groups": min(calibrated.get("groups", 1), batch)}
    for key in CALIBRATION:  # a flag given wins, then the calibration, then the default
        value = getattr(args, key)
        fallback = defaults.get(key, getattr(Machine, key, None))
        setattr(args, key, value if value is not None else calibrated.get(key, fallback))
    net = network(args.model, args.T, args.hidden, inputs, classes, args.width)
    machine = Machine(
        args.flops,
        args.alpha,
        args.beta,
        args.word,
        args.overhead,
        args.forward_step,
        args.walk,
        args.fold,
        args.forward_sample,
        args.forward_group,
    )
    found = estimates(
        net,
        batch,
        sorted(set(args.p)),
        machine,
        args.schemes,
        args.micro_batches,
        args.blocks,
        args.groups,
        True,
    )
    frame = table(found)
    # a row with a note has no estimate (data parallel beyond the batch, say): its time is nan by design
    overflow = frame[(frame["note"] == "") & ~frame["time"].map(math.isfinite)]
    if len(overflow):
        row = overflow.iloc[0]
        print(
            f"{p.prog}: error: {row['scheme']} at p = {row['p']} takes {row['time']} s on this "
            f"machine ({args.flops:g} FLOP/s, α = {args.alpha:g} s, β = {args.beta:g} s/byte); accepted: "
            "settings whose times are finite",
            file=sys.stderr,
        )
        return 2
    gantt_micro = min(args.gantt_micro_batches or args.gantt, batch)
    schedules = [
        pipeline(net.coarsen(args.blocks), batch, args.gantt, machine, kind, gantt_micro)
        for kind in PIPELINES
        if kind in args.schemes
    ]
    compare = None
    if {"pipedream", "layerpipe"} <= set(args.schemes):
        compare = versus(net, batch, machine, micro=args.micro_batches, blocks=args.blocks)
    header = _header(net.name, batch, args)
    drawn = figure(frame, schedules, measured, header)
    drawn.canvas.draw()  # a figure that cannot be drawn fails here, before any file is written
    text, paths = write(Path(args.out), frame, compare, header, drawn)
    print(text)
    for path in paths:
        print(path)
    return 0
