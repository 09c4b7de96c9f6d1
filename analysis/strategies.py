"""Parallel back-propagation strategies side by side: one α–β cost model, one network, one p.

    python -m analysis.strategies --model vgg11 --p 1 2 4 8 16 32 --alpha 5e-6 --beta 1e-10 --out strategies
    python -m analysis.strategies --model rnn --T 1000 --batch 16 --p 1 2 4 8 16 32 --out strategies

Predicts the time of one training iteration (B samples) on p processors, with the busiest
processor's compute, the utilisation, the memory and the bytes sent per processor, for: sequential
BP; a GPipe pipeline (micro-batches, flush every iteration); PipeDream's 1F1B pipeline (delayed
gradients, no flush); LayerPipe (a layer's backward split into its activation- and weight-gradient
tasks, list-scheduled on the p processors); data parallel; model parallel; the best P_r x P_c grid
of Gholami et al. chosen layer by layer; and BPPSA across p devices (the chain of Jacobians cut in
p slices, one all-gather or a log-depth tree of exchanges) beside distributed BPTT (the gradient
going back device by device). Writes ``strategies.csv``, ``strategies.md`` and ``strategies.png``
/ ``.pdf`` (time per iteration against p; the Gantt charts of the pipeline schedules at one p),
byte for byte reproducible. docs/STRATEGIES.md states what is modelled and what is measured.

The model, in one place:
- A processor computes at ``flops`` FLOP/s whatever the size of the work (no efficiency loss for
  small micro-batches or thin slices).
- A message of n bytes takes α + β·n; an all-gather of n bytes in total over p processes takes
  α⌈log2 p⌉ + β(p-1)/p·n and an all-reduce twice that (Gholami et al.); a group of one costs 0.
  Messages do not contend and do not overlap with compute, except in the pipeline schedules, where a
  transfer delays only the task that waits for it.
- A layer keeps its input for the backward; memory counts weights (times the versions a delayed-
  gradient pipeline stashes) and the kept activations, not the optimizer's state.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from analysis.data import (
    AnalysisError,
    finite_at_least_zero,
    read_table,
    require,
    require_rows,
    whole_at_least,
)
from analysis.figures import plt
from toolbox.cli import OneLineParser, non_negative_float, positive_float, positive_int
from toolbox.files import output_folder

STRATEGIES = (
    "sequential",
    "gpipe",
    "pipedream",
    "layerpipe",
    "data",
    "model",
    "grid",
    "bptt-distributed",
    "bppsa-allgather",
    "bppsa-tree",
)
LABELS = {
    "sequential": "sequential BP",
    "gpipe": "GPipe",
    "pipedream": "PipeDream 1F1B",
    "layerpipe": "LayerPipe",
    "data": "data parallel",
    "model": "model parallel",
    "grid": "P_r x P_c grid (Gholami)",
    "bptt-distributed": "distributed BPTT",
    "bppsa-allgather": "BPPSA, all-gather",
    "bppsa-tree": "BPPSA, tree",
}
PIPELINES = ("gpipe", "pipedream", "layerpipe")


# --- the network ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """One layer's costs per sample: FLOPs of its forward, weight gradient and input gradient (0 for
    the first layer, whose input is data), its own parameters, and the sizes that the strategies
    move: elements in and out, output channels (what model parallelism splits), output rows (what
    domain parallelism splits; 1 for none), the input elements one cut of a row split must trade
    with a neighbour (``halo``), how many layers it stands for (``ops``: each has its forward,
    weight-gradient and input-gradient operation, each charged the machine's ``overhead``), and the
    elements per sample it keeps for its backward (``kept``; its inputs unless it stands for several
    layers, which keep all of theirs; ``input_ops`` likewise counts their input-gradient operations),
    and whether it is a time step of a recurrent cell (``step``: a machine with compiled costs,
    ``Machine.walk``, charges it those instead of its operations)."""

    name: str
    forward: float
    weight_grad: float
    input_grad: float
    params: int
    inputs: int
    outputs: int
    channels: int
    rows: int = 1
    halo: int = 0
    ops: int = 1
    kept: int | None = None
    input_ops: int | None = None
    step: bool = False

    def operations(self, part: str) -> int:
        """How many operations ``part`` (forward, weight_grad or input_grad) stands for."""
        if part == "input_grad" and self.input_ops is not None:
            return self.input_ops
        return self.ops if getattr(self, part) > 0 else 0

    @property
    def keeps(self) -> int:
        return self.inputs if self.kept is None else self.kept

    @property
    def backward(self) -> float:
        return self.weight_grad + self.input_grad

    @property
    def work(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class Network:
    """Layers in order, and the parameters every layer uses (a recurrent cell's weights, unrolled over
    time), whose gradient is summed over whoever computed the layers."""

    name: str
    layers: tuple[Layer, ...]
    shared: int = 0

    @property
    def params(self) -> int:
        return self.shared + sum(layer.params for layer in self.layers)

    @property
    def work(self) -> float:
        return sum(layer.work for layer in self.layers)

    def coarsen(self, blocks: int) -> Network:
        """At most ``blocks`` layers, each a run of consecutive layers (costs summed): the pipeline
        schedules of an RNN unrolled over thousands of steps need no finer grain than that."""
        n = len(self.layers)
        if n <= blocks:
            return self
        bounds = [round(i * n / blocks) for i in range(blocks + 1)]
        merged = tuple(_merge(self.layers[a:b]) for a, b in itertools.pairwise(bounds))
        return replace(self, layers=merged)


def _merge(run: Sequence[Layer]) -> Layer:
    first, last = run[0], run[-1]
    return Layer(
        name=first.name if len(run) == 1 else f"{first.name}..{last.name}",
        forward=sum(x.forward for x in run),
        weight_grad=sum(x.weight_grad for x in run),
        input_grad=sum(x.input_grad for x in run),
        params=sum(x.params for x in run),
        inputs=first.inputs,
        outputs=last.outputs,
        channels=min(x.channels for x in run),
        rows=min(x.rows for x in run),
        halo=max(x.halo for x in run),
        ops=sum(x.ops for x in run),
        kept=sum(x.keeps for x in run),
        input_ops=sum(x.operations("input_grad") for x in run),
    )


def profile(model, example_shape: Sequence[int], name: str = "network") -> Network:
    """A ``torch.nn.Sequential`` of Conv2d / Linear layers with ReLU, Tanh, MaxPool2d, AvgPool2d and
    Flatten between them, as layers: the shapes are traced on the meta device (nothing is
    computed), and each parameter-free module joins the weighted layer before it, as the strategies
    split a network at its weighted layers."""
    import torch
    from torch import nn

    weighted = (nn.Conv2d, nn.Linear)
    free = (nn.ReLU, nn.Tanh, nn.MaxPool2d, nn.AvgPool2d, nn.Flatten)
    shapes: list[tuple[object, tuple[int, ...], tuple[int, ...]]] = []
    hooks = []
    for module in model.modules():
        if isinstance(module, weighted + free):
            hooks.append(
                module.register_forward_hook(
                    lambda m, args, out: shapes.append((m, tuple(args[0].shape[1:]), tuple(out.shape[1:])))
                )
            )
        elif not list(module.children()):
            raise ValueError(
                f"cannot profile a {type(module).__name__}; accepted: Conv2d, Linear, ReLU, Tanh, "
                "MaxPool2d, AvgPool2d, Flatten"
            )
    try:
        with torch.no_grad():
            model.to("meta")(torch.empty(1, *example_shape, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    layers: list[Layer] = []
    for module, shape_in, shape_out in shapes:
        n_in, n_out = math.prod(shape_in), math.prod(shape_out)
        if isinstance(module, weighted):
            if isinstance(module, nn.Conv2d):
                c_in, _, w_in = shape_in
                kh, kw = module.kernel_size
                macs = c_in // module.groups * kh * kw * n_out
                kind, channels, rows, halo = "conv", shape_out[0], shape_out[1], (kh // 2) * w_in * c_in
            else:
                macs = module.in_features * module.out_features
                kind, channels, rows, halo = "fc", module.out_features, 1, 0
            bias = n_out if module.bias is not None else 0
            layer = Layer(
                name=f"{kind}{len(layers) + 1}",
                forward=2 * macs + bias,
                weight_grad=2 * macs + bias,
                input_grad=2 * macs if layers else 0,
                params=sum(p.numel() for p in module.parameters()),
                inputs=n_in,
                outputs=n_out,
                channels=channels,
                rows=rows,
                halo=halo,
            )
        elif not layers:
            raise ValueError(f"the network must start with a Conv2d or Linear, not a {type(module).__name__}")
        else:  # parameter-free: one operation per input element, forward and backward
            last = layers.pop()
            ops = 0 if isinstance(module, nn.Flatten) else n_in
            rows = shape_out[1] if len(shape_out) == 3 else 1
            layer = replace(
                last,
                forward=last.forward + ops,
                input_grad=last.input_grad + ops,
                outputs=n_out,
                rows=min(last.rows, rows),
            )
        layers.append(layer)
    return Network(name, tuple(layers))


def recurrent(cell: str, steps: int, inputs: int, hidden: int, classes: int) -> Network:
    """A one-layer tanh RNN or GRU unrolled over ``steps`` time steps (T), one layer per step, and its
    linear head on h_T: the paper's models. Every step uses the cell's weights (``shared``); a step's input
    gradient is the one to h_{t-1} (the one to x_t is not needed), and the first step has none."""
    gates = {"rnn": 1, "gru": 3}[cell]
    matrices = gates * hidden * (inputs + hidden)
    # forward: the GEMMs, the biases and one operation per gate element (a GRU's gates also mix);
    # weight gradient: the same GEMMs; input gradient: the product with W_hh^T and the gates' factors
    forward = 2 * matrices + 2 * gates * hidden + (gates + 2 * (gates - 1)) * hidden
    weight_grad = 2 * matrices + 2 * gates * hidden
    input_grad = 2 * gates * hidden * hidden + (3 * gates - 2) * hidden
    unrolled = tuple(
        Layer(
            name=f"t{t}",
            forward=forward,
            weight_grad=weight_grad,
            input_grad=input_grad if t > 1 else 0,
            params=0,
            inputs=hidden,
            outputs=hidden,
            channels=hidden,
            step=True,
        )
        for t in range(1, steps + 1)
    )
    head = Layer(
        name="head",
        forward=2 * hidden * classes + classes,
        weight_grad=2 * hidden * classes + classes,
        input_grad=2 * hidden * classes,
        params=hidden * classes + classes,
        inputs=hidden,
        outputs=classes,
        channels=classes,
    )
    return Network(f"{cell}-T{steps}-H{hidden}", (*unrolled, head), shared=matrices + 2 * gates * hidden)


# The widest VGG-11 whose sizes count in 64 bits, even on the meta device: its widest conv has 512 x
# width channels in and out, 3 x 3, of 4-byte words.
WIDEST = math.isqrt((2**63 - 1) // (9 * 4)) // 512


def vgg11(width: float = 1.0) -> Network:
    """VGG-11 on CIFAR-10 inputs (3 x 32 x 32), as the pruned VGG-11 study builds it (``width``
    scales its channels), built on the meta device: its weights are never allocated, at any width."""
    import torch

    from benchmarks.pruned_vgg import vgg11 as build

    with torch.device("meta"):
        model = build(width)
    return profile(model, (3, 32, 32), "vgg11" if width == 1 else f"vgg11-width{width:g}")


def _compiled(layers: Sequence[Layer], cost: float) -> tuple[int, list[Layer]]:
    """How many of ``layers`` are recurrent steps that a compiled ``cost`` (when set) covers, and the
    layers left to charge by their operations."""
    if cost <= 0:
        return 0, list(layers)
    return sum(x.step for x in layers), [x for x in layers if not x.step]


# --- the interconnect ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """p identical processors of ``flops`` FLOP/s and ``overhead`` seconds per operation, an α–β
    interconnect, ``word`` bytes per number.

    A device that runs ``bppsa_core.distributed`` on its slice of a recurrent network's steps does not
    pay per operation: its forward is PyTorch's fused one, ``forward_step`` seconds per step whatever
    the batch, and BPPSA's backward of the slice from a given gradient is a compiled scan, ``walk``
    seconds per step and sample; a middle device folds its slice into one affine element per sample,
    ``fold`` seconds per step and sample (``python -m benchmarks.distributed`` measures all
    three on one rank). Each 0 (unset) charges the steps' operations instead. These costs are those of
    the strategies ``bppsa_core.distributed`` runs (sequential BP, distributed BPTT and BPPSA); the
    others schedule operations."""

    flops: float = 1e12
    alpha: float = 5e-6
    beta: float = 1e-10
    word: int = 4
    overhead: float = 0.0
    forward_step: float = 0.0
    walk: float = 0.0
    fold: float = 0.0

    def compute(self, flops: float) -> float:
        return flops / self.flops

    def run(self, layers: Sequence[Layer], part: str, samples: float) -> float:
        """The time of ``part`` (forward, weight_grad, input_grad, backward or work) of ``layers`` for
        ``samples`` samples: its FLOPs at the machine's rate plus ``overhead`` per operation (a
        kernel launch, a step's latency)."""
        parts = {"backward": ("weight_grad", "input_grad"), "work": ("forward", "weight_grad", "input_grad")}
        names = parts.get(part, (part,))
        flops = sum(getattr(x, q) for x in layers for q in names)
        ops = sum(x.operations(q) for x in layers for q in names)
        return self.compute(flops * samples) + self.overhead * ops

    def forward(self, layers: Sequence[Layer], samples: float) -> float:
        """The forward of ``layers`` for ``samples`` samples: ``forward_step`` per recurrent step where
        it is set, operations for the rest."""
        steps, rest = _compiled(layers, self.forward_step)
        return self.forward_step * steps + self.run(rest, "forward", samples)

    def send(self, elements: float) -> float:
        """One point-to-point message; an empty one is not sent."""
        return self.alpha + self.beta * self.word * elements if elements > 0 else 0.0

    def all_gather(self, elements: float, group: int) -> float:
        """An all-gather that leaves ``elements`` numbers in total on each of ``group`` processes."""
        if group <= 1 or elements <= 0:
            return 0.0
        return (
            self.alpha * math.ceil(math.log2(group)) + self.beta * (group - 1) / group * self.word * elements
        )

    def all_reduce(self, elements: float, group: int) -> float:
        """An all-reduce of ``elements`` numbers: a reduce-scatter and an all-gather."""
        return 2 * self.all_gather(elements, group)


# --- estimates and schedules ---------------------------------------------------------------------


@dataclass
class Task:
    """One piece of work on one processor: ``kind`` F (forward), B (backward), A (input gradient) or
    W (weight gradient) of the layers ``first..last`` for one micro-batch of one iteration."""

    kind: str
    first: int
    last: int
    proc: int
    iteration: int
    micro: int
    duration: float
    deps: list[tuple[int, float]] = field(default_factory=list)  # (task, transfer time before it)
    inbound: list[tuple[int, float]] = field(default_factory=list)  # (task, bytes it sends here)
    start: float = math.nan
    end: float = math.nan


@dataclass
class Estimate:
    """A strategy's prediction for one iteration on p processors; ``note`` says why there is none."""

    strategy: str
    p: int
    time: float = math.nan
    compute: float = math.nan
    utilisation: float = math.nan
    memory: float = math.nan
    sent: float = math.nan
    hops: float = math.nan
    detail: str = ""
    note: str = ""
    tasks: list[Task] | None = None

    def row(self) -> dict:
        keep = ("strategy", "p", "time", "compute", "utilisation", "memory", "sent", "hops", "detail", "note")
        return {k: getattr(self, k) for k in keep}


def _none(strategy: str, p: int, why: str) -> Estimate:
    return Estimate(strategy, p, note=why)


def _finish(est: Estimate, net: Network, batch: int, machine: Machine) -> Estimate:
    est.utilisation = machine.compute(net.work * batch) / (est.p * est.time) if est.time > 0 else math.nan
    return est


def sequential(net: Network, batch: int, machine: Machine) -> Estimate:
    """Plain back-propagation on one processor (of the p): the reference every strategy meets at p = 1
    (but BPPSA on a machine with compiled costs, whose backward is its own scan)."""
    time = machine.forward(net.layers, batch) + machine.run(net.layers, "backward", batch)
    memory = machine.word * (net.params + batch * sum(x.keeps for x in net.layers))
    return _finish(
        Estimate("sequential", 1, time, time, memory=memory, sent=0.0, hops=0), net, batch, machine
    )


def data_parallel(net: Network, batch: int, p: int, machine: Machine) -> Estimate:
    """Each processor runs the whole network on ⌈B/p⌉ samples; every layer's weight gradient (and the
    shared weights') is all-reduced once, after the backward."""
    if p > batch:
        return _none("data", p, f"p = {p} exceeds the batch {batch}")
    local = math.ceil(batch / p)
    compute = machine.run(net.layers, "work", local)
    comm = sum(machine.all_reduce(x.params, p) for x in net.layers) + machine.all_reduce(net.shared, p)
    memory = machine.word * (net.params + local * sum(x.keeps for x in net.layers))
    sent = 2 * (p - 1) / p * machine.word * net.params
    return _finish(
        Estimate("data", p, compute + comm, compute, memory=memory, sent=sent), net, batch, machine
    )


def model_parallel(net: Network, batch: int, p: int, machine: Machine) -> Estimate:
    """Every layer's output channels split over the p processors: each computes its share of the
    layer for the whole batch, the outputs are all-gathered in the forward and the input gradients
    all-reduced in the backward; a processor keeps 1/p of the weights."""
    if p > min(x.channels for x in net.layers):
        return _none("model", p, f"p = {p} exceeds a layer's {min(x.channels for x in net.layers)} channels")
    compute = sum(machine.compute(x.work * batch) / p for x in net.layers) + machine.run(
        net.layers, "work", 0
    )
    comm = sum(
        machine.all_gather(x.outputs * batch, p)
        + (machine.all_reduce(x.inputs * batch, p) if x.input_grad else 0)
        for x in net.layers
    )
    memory = machine.word * (net.params / p + batch * sum(x.keeps for x in net.layers))
    sent = (
        machine.word
        * batch
        * sum((p - 1) / p * (x.outputs + (2 * x.inputs if x.input_grad else 0)) for x in net.layers)
    )
    return _finish(
        Estimate("model", p, compute + comm, compute, memory=memory, sent=sent), net, batch, machine
    )


# The grid: a layer runs on P_r x P_c processes, model ("model") or domain ("domain") parallel over
# P_r, batch parallel over P_c. A layout is (P_r, P_c, how).


def _grids(p: int) -> list[tuple[int, int]]:
    return [(r, p // r) for r in range(1, p + 1) if p % r == 0]


def _layer_cost(x: Layer, batch: int, pr: int, pc: int, how: str, machine: Machine) -> float:
    """One layer's compute and communication on a P_r x P_c grid (Gholami et al.'s α–β terms)."""
    local = math.ceil(batch / pc)
    compute = machine.compute(x.work * local) / pr + machine.run([x], "work", 0)
    if how == "model":
        return (
            compute
            + machine.all_gather(x.outputs * local, pr)
            + (machine.all_reduce(x.inputs * local, pr) if x.input_grad else 0)
            + machine.all_reduce(x.params / pr, pc)
        )
    # domain: rows split over P_r, neighbours trade halos forward and backward, weights replicated
    halo = 2 * 2 * machine.send(x.halo * local) if pr > 1 else 0.0
    return compute + halo + machine.all_reduce(x.params, pr * pc)


def _layer_bytes(x: Layer, batch: int, p: int, pr: int, pc: int, how: str, word: int) -> float:
    """The bytes one process sends for a layer on a P_r x P_c grid: the terms of ``_layer_cost``."""
    local = math.ceil(batch / pc)
    if how == "model":
        gathered = (pr - 1) / pr * (x.outputs + (2 * x.inputs if x.input_grad else 0)) * local
        return word * (gathered + 2 * (pc - 1) / pc * x.params / pr)
    return word * ((4 * x.halo * local if pr > 1 else 0) + 2 * (p - 1) / p * x.params)


def _relayout(before: tuple[int, int, str], after: tuple[int, int, str], x: Layer, batch: int) -> float:
    """The elements each process must gather to move a layer's output from its layout to the next
    layer's: none when every process already holds what it needs (a model-parallel output is whole
    on its batch share; a finer batch split of it is a subset), else its share of the next layout
    (an all-gather over all p)."""
    if before == after and before[2] == "domain":
        return 0.0
    if before[2] == "model" and after[1] % before[1] == 0:
        return 0.0
    return x.outputs * math.ceil(batch / after[1])


def _layouts(x: Layer, batch: int, p: int, grids: Sequence[tuple[int, int]]) -> list[tuple[int, int, str]]:
    out = []
    for pr, pc in grids:
        if pc > batch:
            continue
        if pr <= x.channels:
            out.append((pr, pc, "model"))
        if 1 < pr <= x.rows:
            out.append((pr, pc, "domain"))
    return out


def grid(
    net: Network,
    batch: int,
    p: int,
    machine: Machine,
    fixed: tuple[int, int] | None = None,
    hows: Sequence[str] = ("model", "domain"),
) -> Estimate:
    """The cheapest layout per layer (Gholami et al.): for each layer a P_r x P_c grid with
    P_r·P_c = p, model or domain parallel over P_r, batch parallel over P_c, chosen by dynamic
    programming over the layers with the cost of changing layout between them. Shared weights (an
    unrolled RNN) keep one grid for every layer. ``fixed`` pins the grid for every layer, ``hows``
    the ways of splitting over P_r that may be chosen."""
    grids = [fixed] if fixed else _grids(p)
    if net.shared and not fixed:
        best = [grid(net, batch, p, machine, g, hows) for g in grids]
        best = [e for e in best if not math.isnan(e.time)]
        if not best:
            return _none("grid", p, f"no P_r x P_c grid of {p} fits the batch {batch} and the channels")
        return min(best, key=lambda e: e.time)
    # cost[layout]: the least time of the layers so far with the last one in that layout; came[i]
    # [layout]: the layout of layer i - 1 on that way (the path is read back from the end)
    cost: dict[tuple[int, int, str], float] = {}
    came: list[dict[tuple[int, int, str], tuple[int, int, str] | None]] = []
    for i, x in enumerate(net.layers):
        options = [o for o in _layouts(x, batch, p, grids) if o[2] in hows]
        if not options:
            return _none("grid", p, f"no P_r x P_c grid of {p} fits layer {x.name}")
        step: dict[tuple[int, int, str], float] = {}
        back: dict[tuple[int, int, str], tuple[int, int, str] | None] = {}
        for layout in options:
            here = _layer_cost(x, batch, *layout, machine)
            if i == 0:
                step[layout], back[layout] = here, None
                continue
            prev = net.layers[i - 1]
            t, b = min(
                ((t + machine.all_gather(_relayout(b, layout, prev, batch), p), b) for b, t in cost.items()),
                key=lambda c: c[0],
            )
            step[layout], back[layout] = t + here, b
        cost = step
        came.append(back)
    time, last = min(((t, layout) for layout, t in cost.items()), key=lambda c: c[0])
    path = [last]
    for back in reversed(came[1:]):
        path.append(back[path[-1]])
    path.reverse()
    pr_shared, pc_shared = path[-1][:2]
    time += machine.all_reduce(net.shared / pr_shared, pc_shared)
    compute = sum(
        machine.compute(x.work * math.ceil(batch / pc)) / pr
        for x, (pr, pc, _) in zip(net.layers, path, strict=True)
    ) + machine.run(net.layers, "work", 0)
    memory = machine.word * sum(
        (x.params / pr if how == "model" else x.params)
        + x.keeps * math.ceil(batch / pc) / (pr if how == "domain" else 1)
        for x, (pr, pc, how) in zip(net.layers, path, strict=True)
    )
    sent = sum(
        _layer_bytes(x, batch, p, *layout, machine.word) for x, layout in zip(net.layers, path, strict=True)
    )
    sent += sum(
        machine.word * (p - 1) / p * _relayout(a, b, x, batch)
        for x, a, b in zip(net.layers, path, path[1:], strict=False)
    )
    sent += machine.word * 2 * (pc_shared - 1) / pc_shared * net.shared / pr_shared
    chosen = []  # runs of layers with one layout: "conv1..conv3 1x32 model"
    for layout, run in itertools.groupby(zip(net.layers, path, strict=True), key=lambda pair: pair[1]):
        names = [x.name for x, _ in run]
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        chosen.append(f"{span} {layout[0]}x{layout[1]} {layout[2]}")
    memory += machine.word * net.shared / (pr_shared if path[-1][2] == "model" else 1)
    est = Estimate("grid", p, time, compute, memory=memory, sent=sent, detail=", ".join(chosen))
    return _finish(est, net, batch, machine)


# --- the pipelines: a task graph, list-scheduled ----------------------------------------------------


def partition(costs: Sequence[float], p: int) -> list[int]:
    """The stage (0..p-1) of each item: contiguous stages whose largest sum is the smallest possible
    (binary search on that sum, greedy fill); fewer stages when there are fewer items."""
    p = min(p, len(costs))
    lo, hi = max(costs), sum(costs)
    for _ in range(100):
        mid = (lo + hi) / 2
        if _stages_needed(costs, mid) <= p:
            hi = mid
        else:
            lo = mid
    stages, total, stage = [], 0.0, 0
    for i, c in enumerate(costs):
        left = len(costs) - i  # items left, this one included; keep one for each stage still empty
        if stages and (total + c > hi * (1 + 1e-12) or left <= p - 1 - stage) and stage < p - 1:
            stage, total = stage + 1, 0.0
        stages.append(stage)
        total += c
    return stages


def _stages_needed(costs: Sequence[float], cap: float) -> int:
    stages, total = 1, 0.0
    for c in costs:
        if total + c > cap * (1 + 1e-12):
            stages, total = stages + 1, 0.0
        total += c
    return stages


def _runs(owner: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (first, last, proc) of consecutive layers on the same processor."""
    runs: list[tuple[int, int, int]] = []
    for i, proc in enumerate(owner):
        if runs and runs[-1][2] == proc:
            runs[-1] = (runs[-1][0], i, proc)
        else:
            runs.append((i, i, proc))
    return runs


def _assign_layerpipe(net: Network, p: int) -> tuple[list[int], list[int]]:
    """LayerPipe's assignment: the forward and input-gradient work split into k contiguous balanced
    stages (the stage boundary is the inter-layer cut), then each layer's weight-gradient task, which
    no other task of the iteration waits for, placed largest first on the least-loaded of the p
    processors (intra-layer: it may run beside its layer's input gradient, on another processor).
    Of k = 1..p, the one whose busiest processor has the least work (the fewest stages on a tie)."""
    best = None
    for k in range(1, min(p, len(net.layers)) + 1):
        owner = partition([x.forward + x.input_grad for x in net.layers], k)
        load = [0.0] * p
        for x, proc in zip(net.layers, owner, strict=True):
            load[proc] += x.forward + x.input_grad
        weights = list(owner)
        for i in sorted(range(len(net.layers)), key=lambda i: -net.layers[i].weight_grad):
            proc = min(range(p), key=lambda q: (load[q], q != owner[i]))
            weights[i] = proc
            load[proc] += net.layers[i].weight_grad
        if best is None or max(load) < best[0] * (1 - 1e-9):
            best = (max(load), owner, weights)
    return best[1], best[2]


def pipeline_tasks(
    net: Network, batch: int, p: int, micro: int, kind: str, machine: Machine, iterations: int
) -> list[Task]:
    """The task graph of ``iterations`` iterations of ``micro`` micro-batches for a pipeline
    strategy, with each task's processor and its inputs (a transfer delays a task whose input comes
    from another processor by α + β·bytes).

    - gpipe: stages balanced by work; per stage and micro-batch a forward and a backward task; every
      iteration's forwards wait for the weights its stage updated at the end of the last (the flush).
    - pipedream: the same stages and tasks without the flush (delayed gradients, stashed weights);
      1F1B: a stage admits micro-batch m only once micro-batch m - (stages after it + 1) has left
      its backward, so at most that many are in flight.
    - layerpipe: forward (F), input-gradient (A) and weight-gradient (W) tasks on LayerPipe's
      assignment, the same admission rule over each forward stage.
    """
    size = batch / micro
    if kind == "layerpipe":
        owner, weights = _assign_layerpipe(net, p)
    else:
        owner = partition([x.work for x in net.layers], p)
        weights = owner
    stages = max(owner) + 1
    forward_runs, backward_runs = _runs(owner), _runs(owner)
    tasks: list[Task] = []
    for it in range(iterations):
        for m in range(micro):
            f_ids, b_ids, w_ids = {}, {}, {}
            for first, last, proc in forward_runs:
                f_ids[first] = len(tasks)
                tasks.append(
                    Task(
                        "F",
                        first,
                        last,
                        proc,
                        it,
                        m,
                        machine.run(net.layers[first : last + 1], "forward", size),
                    )
                )
            for first, last, proc in reversed(backward_runs):
                part = "input_grad" if kind == "layerpipe" else "backward"
                b_ids[first] = len(tasks)
                tasks.append(
                    Task(
                        "A" if kind == "layerpipe" else "B",
                        first,
                        last,
                        proc,
                        it,
                        m,
                        machine.run(net.layers[first : last + 1], part, size),
                    )
                )
            if kind == "layerpipe":
                for first, last, proc in _runs(weights):
                    w_ids[first] = len(tasks)
                    duration = machine.run(net.layers[first : last + 1], "weight_grad", size)
                    tasks.append(Task("W", first, last, proc, it, m, duration))
            _wire(tasks, net, f_ids, b_ids, w_ids, size, machine)
    _admit(tasks, kind, owner, stages, micro, iterations)
    return tasks


def _wire(
    tasks: list[Task], net: Network, f_ids: dict, b_ids: dict, w_ids: dict, size: float, machine: Machine
) -> None:
    """Inputs within one micro-batch: a forward waits for the forward below it, a backward (or an
    input-gradient task) for its own forward and the backward above it, a weight-gradient task for
    the forwards of its layers (their inputs) and the tasks that give its layers' outputs their
    gradients (the input-gradient tasks of the layers above each, or the top forward)."""
    by_layer_f = _cover(f_ids, tasks)
    by_layer_b = _cover(b_ids, tasks)

    def edge(dst: int, src: int, elements: float) -> None:
        moves = tasks[src].proc != tasks[dst].proc and elements > 0
        tasks[dst].deps.append((src, machine.send(elements * size) if moves else 0.0))
        if moves:
            tasks[dst].inbound.append((src, machine.word * elements * size))

    for first, tid in f_ids.items():
        if first > 0:
            edge(tid, by_layer_f[first - 1], net.layers[first - 1].outputs)
    top = len(net.layers) - 1
    for first, tid in b_ids.items():
        last = tasks[tid].last
        edge(tid, by_layer_f[first], 0)
        if last < top:
            edge(tid, by_layer_b[last + 1], net.layers[last].outputs)
        else:
            edge(tid, by_layer_f[top], 0)
    for first, tid in w_ids.items():
        last = tasks[tid].last
        for f in sorted({by_layer_f[i] for i in range(first, last + 1)}):
            kept = range(max(first, tasks[f].first), min(last, tasks[f].last) + 1)
            edge(tid, f, sum(net.layers[i].keeps for i in kept))
        above: dict[int, float] = {}
        for i in range(first, last + 1):
            src = by_layer_b[i + 1] if i < top else by_layer_f[top]
            above[src] = above.get(src, 0.0) + net.layers[i].outputs
        for src, elements in above.items():
            edge(tid, src, elements)


def _cover(ids: dict, tasks: list[Task]) -> dict[int, int]:
    """layer -> the task of this micro-batch that covers it."""
    return {i: tid for tid in ids.values() for i in range(tasks[tid].first, tasks[tid].last + 1)}


def _admit(
    tasks: list[Task], kind: str, owner: Sequence[int], stages: int, micro: int, iterations: int
) -> None:
    """The dependencies between micro-batches and iterations: GPipe's flush, 1F1B's admission."""
    index = {(t.kind, t.first, t.iteration, t.micro): i for i, t in enumerate(tasks)}
    back = "A" if kind == "layerpipe" else "B"
    for t in tasks:
        if t.kind != "F":
            continue
        stage = owner[t.first]
        if kind == "gpipe":
            if t.iteration > 0:  # the weights of these layers, updated after the last micro-batch
                t.deps.append((index[("B", t.first, t.iteration - 1, micro - 1)], 0.0))
            continue
        order = t.iteration * micro + t.micro - (stages - stage)
        if order >= 0:
            j = index[(back, t.first, order // micro, order % micro)]
            t.deps.append((j, 0.0))


def list_schedule(tasks: list[Task], priority: Callable[[Task], tuple]) -> None:
    """Non-preemptive list scheduling on fixed processors: whenever a processor is free it starts,
    of the tasks on it whose inputs have arrived, the one first by ``priority``; it idles only when
    none has. Events are taken in time order, so no task starts before its inputs exist."""
    waiting = [len(t.deps) for t in tasks]
    users: list[list[int]] = [[] for _ in tasks]
    for i, t in enumerate(tasks):
        for j, _ in t.deps:
            users[j].append(i)
    procs = sorted({t.proc for t in tasks})
    free = dict.fromkeys(procs, 0.0)
    pending: dict[int, list] = {q: [] for q in procs}  # (ready time, i)
    ready: dict[int, list] = {q: [] for q in procs}  # (priority, i)
    for i, t in enumerate(tasks):
        if not t.deps:
            heapq.heappush(pending[t.proc], (0.0, i))
    done = 0
    while done < len(tasks):
        best = None
        for q in procs:
            if ready[q]:
                at = free[q]
            elif pending[q]:
                at = max(free[q], pending[q][0][0])
            else:
                continue
            if best is None or at < best[0]:
                best = (at, q)
        if best is None:
            raise AnalysisError("the task graph has a cycle: some tasks can never start")
        at, q = best
        while pending[q] and pending[q][0][0] <= at:
            _, i = heapq.heappop(pending[q])
            heapq.heappush(ready[q], (priority(tasks[i]), i))
        _, i = heapq.heappop(ready[q])
        t = tasks[i]
        t.start, t.end = at, at + t.duration
        free[q] = t.end
        done += 1
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                arrive = max(tasks[j].end + delay for j, delay in tasks[u].deps)
                heapq.heappush(pending[tasks[u].proc], (arrive, u))


def check_schedule(tasks: Sequence[Task]) -> None:
    """Raises if a task starts before one of its inputs has arrived, or two tasks overlap on one
    processor."""
    for i, t in enumerate(tasks):
        for j, delay in t.deps:
            if t.start < tasks[j].end + delay - 1e-15:
                raise AssertionError(f"task {i} ({t.kind} {t.first}) starts before its input {j} has arrived")
    by_proc: dict[int, list[Task]] = {}
    for t in tasks:
        by_proc.setdefault(t.proc, []).append(t)
    for proc, run in by_proc.items():
        run.sort(key=lambda t: (t.start, t.end))
        for a, b in itertools.pairwise(run):
            if b.start < a.end - 1e-15:
                raise AssertionError(f"two tasks overlap on processor {proc}")


def _priority(kind: str) -> Callable[[Task], tuple]:
    """GPipe runs forwards first, in micro-batch order; 1F1B and LayerPipe a backward before a
    forward (the oldest micro-batch first), a weight gradient when no input gradient waits."""
    if kind == "gpipe":
        return lambda t: (t.iteration, t.kind != "F", t.micro)
    rank = {"A": 0, "B": 0, "W": 1, "F": 2}
    return lambda t: (rank[t.kind], t.iteration, t.micro)


def pipeline(
    net: Network,
    batch: int,
    p: int,
    machine: Machine,
    kind: str,
    micro: int | None = None,
    iterations: int = 4,
) -> Estimate:
    """A pipeline strategy's time per iteration in the steady state: the schedule of ``iterations``
    iterations, the time between the ends of the middle and the last iteration divided by the
    iterations between them, or the busiest processor's work per iteration where that is longer
    (deferred weight-gradient tasks blur where an iteration ends; no period beats the busiest
    processor). ``micro`` micro-batches per iteration (default min(4p, B), GPipe's
    advice of at least four per stage; one on one processor, where there is nothing to overlap)."""
    micro = micro or (1 if p == 1 else min(4 * p, batch))
    if micro > batch:
        return _none(kind, p, f"{micro} micro-batches exceed the batch {batch}")
    if p > len(net.layers):
        return _none(kind, p, f"p = {p} exceeds the {len(net.layers)} layers")
    tasks = pipeline_tasks(net, batch, p, micro, kind, machine, iterations)
    list_schedule(tasks, _priority(kind))
    check_schedule(tasks)  # every schedule the model reports has been checked
    ends = [max(t.end for t in tasks if t.iteration == it) for it in range(iterations)]
    half = iterations // 2
    procs = max(t.proc for t in tasks) + 1
    per_iter = [sum(t.duration for t in tasks if t.proc == q) / iterations for q in range(procs)]
    time = max((ends[-1] - ends[half - 1]) / (iterations - half), max(per_iter))
    time += machine.all_reduce(net.shared, procs)
    sent = _sent(tasks, net, batch / micro, machine, iterations)
    memory = max(pipeline_memory(tasks, net, batch / micro, machine, kind).values())
    est = Estimate(
        kind, p, time, max(per_iter), memory=memory, sent=sent, detail=f"{micro} micro-batches", tasks=tasks
    )
    return _finish(est, net, batch, machine)


def _sent(tasks: Sequence[Task], net: Network, size: float, machine: Machine, iterations: int) -> float:
    """Bytes the busiest processor sends per iteration: activations and gradients between processors,
    a weight gradient computed away from its weights (once per iteration), the shared weights'
    all-reduce."""
    out: dict[int, float] = {}
    for t in tasks:
        for j, moved in t.inbound:
            out[tasks[j].proc] = out.get(tasks[j].proc, 0.0) + moved
    procs = max(t.proc for t in tasks) + 1
    owner = {}
    for t in tasks:
        if t.kind == "F":
            for i in range(t.first, t.last + 1):
                owner[i] = t.proc
    for t in tasks:
        if t.kind == "W" and t.iteration == 0 and t.micro == 0:
            moved = sum(net.layers[i].params for i in range(t.first, t.last + 1) if owner[i] != t.proc)
            out[t.proc] = out.get(t.proc, 0.0) + machine.word * moved * iterations
    shared = 2 * (procs - 1) / procs * machine.word * net.shared
    return max(out.values(), default=0.0) / iterations + shared


def pipeline_memory(
    tasks: Sequence[Task], net: Network, size: float, machine: Machine, kind: str
) -> dict[int, float]:
    """Bytes per processor: its weights, once per iteration in flight on it (stashed versions;
    GPipe keeps one), and the inputs its forwards keep until the last backward task of their
    micro-batch on those layers has ended."""
    versions: dict[int, set] = {}
    events: dict[int, list[tuple[float, float]]] = {}
    finish: dict[tuple, float] = {}
    for t in tasks:
        if t.kind != "F":
            for i in range(t.first, t.last + 1):
                key = (i, t.iteration, t.micro)
                finish[key] = max(finish.get(key, -math.inf), t.end)
    peak_versions: dict[int, int] = {}
    for t in tasks:
        if t.kind != "F":
            continue
        kept = machine.word * size * sum(net.layers[i].keeps for i in range(t.first, t.last + 1))
        released = max(finish[(i, t.iteration, t.micro)] for i in range(t.first, t.last + 1))
        events.setdefault(t.proc, []).extend([(t.end, kept), (released, -kept)])
        versions.setdefault(t.proc, set()).add(t.iteration)
    weights: dict[int, float] = {}
    for t in tasks:
        if t.kind == "F" and t.iteration == 0 and t.micro == 0:
            weights[t.proc] = weights.get(t.proc, 0.0) + machine.word * sum(
                net.layers[i].params for i in range(t.first, t.last + 1)
            )
    peaks = {}
    for proc, ev in events.items():
        level, peak = 0.0, 0.0
        for _, delta in sorted(ev, key=lambda e: (e[0], e[1])):
            level += delta
            peak = max(peak, level)
        peaks[proc] = peak
        peak_versions[proc] = 1 if kind == "gpipe" else _iterations_in_flight(tasks, proc)
    shared = machine.word * net.shared
    return {q: weights.get(q, 0.0) * peak_versions[q] + peaks[q] + shared for q in sorted(peaks)}


def _iterations_in_flight(tasks: Sequence[Task], proc: int) -> int:
    """The most iterations whose forwards on ``proc`` have begun while one before has not ended:
    the weight versions a delayed-gradient pipeline stashes there."""
    spans: dict[int, list[float]] = {}
    for t in tasks:
        if t.proc == proc:
            s = spans.setdefault(t.iteration, [math.inf, -math.inf])
            s[0], s[1] = min(s[0], t.start), max(s[1], t.end)
    events = sorted(
        [(a, 1) for a, _ in spans.values()] + [(b, -1) for _, b in spans.values()], key=lambda e: (e[0], e[1])
    )
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return peak


# --- BPPSA across devices, and BPTT across the same devices --------------------------------------


def _slices(net: Network, p: int) -> list[list[Layer]]:
    owner = partition([x.work for x in net.layers], p)
    out: list[list[Layer]] = [[] for _ in range(max(owner) + 1)]
    for x, r in zip(net.layers, owner, strict=True):
        out[r].append(x)
    return out


def _forward_ends(slices: list[list[Layer]], batch: int, machine: Machine) -> list[float]:
    """When each device's forward ends: the slices run one after another, each sending its last
    output to the next."""
    ends, t = [], 0.0
    for r, part in enumerate(slices):
        if r:
            t += machine.send(slices[r - 1][-1].outputs * batch)
        t += machine.forward(part, batch)
        ends.append(t)
    return ends


def distributed_bptt(net: Network, batch: int, p: int, machine: Machine) -> Estimate:
    """The network cut into p slices of balanced work, one per device (no micro-batches): the forward
    goes up device by device, then the gradient comes back down the same way, p - 1 dependent hops."""
    slices = _slices(net, p)
    t = _forward_ends(slices, batch, machine)[-1]
    for r in reversed(range(len(slices))):
        t += machine.run(slices[r], "backward", batch)
        if r:
            t += machine.send(slices[r - 1][-1].outputs * batch)
    q = len(slices)
    t += machine.all_reduce(net.shared, q)
    compute = max(machine.forward(s, batch) + machine.run(s, "backward", batch) for s in slices)
    memory = max(machine.word * (sum(x.params + batch * x.keeps for x in s) + net.shared) for s in slices)
    sent = max(2 * machine.word * batch * s[-1].outputs for s in slices[:-1]) if q > 1 else 0.0
    est = Estimate("bptt-distributed", p, t, compute, memory=memory, sent=sent, hops=q - 1)
    return _finish(est, net, batch, machine)


def _walk(layers: Sequence[Layer], samples: float, machine: Machine) -> float:
    """BPPSA's backward of a device's slice from the gradient that reaches its end: ``walk`` per step and
    sample where it is set (the compiled scan, weight gradients included), operations for the rest."""
    steps, rest = _compiled(layers, machine.walk)
    return machine.walk * steps * samples + machine.run(rest, "backward", samples)


def _fold(layers: Sequence[Layer], samples: float, machine: Machine) -> float:
    """A middle device's slice folded into one aggregate per sample: ``fold`` per step and sample where
    it is set, else the slice's backward applied to its n_out unit vectors (input gradients only)."""
    if machine.fold > 0 and all(x.step for x in layers):
        return machine.fold * len(layers) * samples
    return machine.run(layers, "input_grad", samples * layers[-1].outputs)


def _groups(batch: int, groups: int) -> list[int]:
    """The sizes of the sample groups ``bppsa_core.distributed`` cuts a batch into (``sample_groups``)."""
    from bppsa_core.distributed import sample_groups

    return [s.stop - s.start for s in sample_groups(batch, groups)]


def bppsa(net: Network, batch: int, p: int, machine: Machine, exchange: str, groups: int = 1) -> Estimate:
    """BPPSA with one device per slice, as ``bppsa_core.distributed`` runs it. The top device runs its
    slice's backward as usual; each middle device, as soon as its own forward is done (while the
    devices above run theirs), folds its slice's transposed Jacobians into one aggregate per sample
    (n_in x n_out); the aggregates meet by one all-gather (each device then applies the ones above it
    to the top's gradient) or by a tree (⌈log2 p⌉ rounds up, composing pairs, ⌈log2 p⌉ rounds down,
    one matrix-vector product each); then every device runs its slice's backward from the gradient it
    got. The bottom device's aggregate is never needed.

    With ``groups`` > 1 (on more than one device) the batch is cut into that many groups of samples
    and the exchange and walks run group after group: the top device goes straight on to the next
    group (it needs nothing back); each device below, its fold done, exchanges, applies and walks one
    group before it takes the next. So devices overlap, a pipeline over the groups, at the cost of
    one exchange per group."""
    slices = _slices(net, p)
    q, top = len(slices), len(slices) - 1
    fwd = _forward_ends(slices, batch, machine)
    width_in = [s[0].inputs for s in slices]
    width_out = [s[-1].outputs for s in slices]
    middle = range(1, top)
    aggregate = max((width_in[r] * width_out[r] + width_in[r] for r in middle), default=0)
    sizes = _groups(batch, groups) if q > 1 else [batch]
    # per group of n samples: the exchange, and what each device below the top applies after it
    if q == 1:
        hops, sent = 0, 0.0

        def exchanged(n: int) -> tuple[float, list[float]]:
            return 0.0, []

    elif exchange == "allgather":
        hops = math.ceil(math.log2(q))
        sent = (q - 1) * machine.word * batch * max(aggregate, width_in[-1])

        def exchanged(n: int) -> tuple[float, list[float]]:
            local = [  # device r applies the aggregates of the middle devices above it
                machine.compute(sum(2 * n * width_in[j] * width_out[j] for j in range(r + 1, top)))
                + machine.overhead * len(range(r + 1, top))
                for r in range(top)
            ]
            return machine.all_gather(q * n * max(aggregate, width_in[-1]), q), local

    else:
        # up: ⌈log2(q-1)⌉ rounds over the devices above the bottom, composing pairs of aggregates;
        # down: ⌈log2 q⌉ rounds handing gradients (vectors) down, one matrix-vector product each
        w = max(width_out[:-1])
        ups, downs = math.ceil(math.log2(q - 1)) if q > 2 else 0, math.ceil(math.log2(q))
        hops, sent = ups + downs, machine.word * batch * (ups * (w * w + w) + downs * w)

        def exchanged(n: int) -> tuple[float, list[float]]:
            up = machine.send(n * (w * w + w)) + machine.compute(2 * n * w**3) + machine.overhead
            down = machine.send(n * w) + machine.compute(2 * n * w * w) + machine.overhead
            if q == 2:  # the top device's gradient goes straight to the bottom one
                down = machine.send(n * w)
            return ups * up + downs * down, [0.0] * top

    top_done = fwd[top]  # the top device's progress; when each device below is free, its folds done
    free = [
        fwd[r] + (sum(_fold(slices[r], n, machine) for n in sizes) if r in middle else 0.0)
        for r in range(top)
    ]
    for n in sizes:
        top_done += _walk(slices[top], n, machine)
        ready = [top_done, *free]
        cost, local = exchanged(n)
        got = max(ready) + cost
        free = [got + local[r] + _walk(slices[r], n, machine) for r in range(top)]
    time = max([top_done, *free]) + machine.all_reduce(net.shared, q)
    compute = max(
        machine.forward(s, batch)
        + _walk(s, batch, machine)
        + (_fold(s, batch, machine) if r in middle else 0.0)
        for r, s in enumerate(slices)
    )
    memory = max(
        machine.word
        * (
            sum(x.params + batch * x.keeps for x in s)
            + net.shared
            + (batch * width_in[r] * width_out[r] if r in middle else 0)
        )
        for r, s in enumerate(slices)
    )
    gathered = machine.word * batch * q * aggregate if exchange == "allgather" else 0.0
    name = f"bppsa-{'allgather' if exchange == 'allgather' else 'tree'}"
    detail = f"{len(sizes)} sample groups" if len(sizes) > 1 else ""
    est = Estimate(name, p, time, compute, memory=memory + gathered, sent=sent, hops=hops, detail=detail)
    return _finish(est, net, batch, machine)


# --- all of them ---------------------------------------------------------------------------------


def estimate(
    strategy: str,
    net: Network,
    batch: int,
    p: int,
    machine: Machine,
    micro: int | None = None,
    groups: int = 1,
) -> Estimate:
    """One strategy on p processors: ``micro`` micro-batches in a pipeline, ``groups`` sample groups
    in BPPSA's backward."""
    if strategy == "sequential":
        est = sequential(net, batch, machine)
        est.p = p
        est.utilisation /= p
        return est
    if strategy in PIPELINES:
        return pipeline(net, batch, p, machine, strategy, micro)
    if strategy == "data":
        return data_parallel(net, batch, p, machine)
    if strategy == "model":
        return model_parallel(net, batch, p, machine)
    if strategy == "grid":
        return grid(net, batch, p, machine)
    if strategy == "bptt-distributed":
        return distributed_bptt(net, batch, p, machine)
    if strategy in ("bppsa-allgather", "bppsa-tree"):
        return bppsa(net, batch, p, machine, strategy.removeprefix("bppsa-"), groups)
    raise ValueError(f"unknown strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")


# --- the table, the figure, the command ----------------------------------------------------------

COLUMNS = ("strategy", "p", "time", "compute", "utilisation", "memory", "sent", "hops", "detail", "note")
MODELS = ("vgg11", "rnn", "gru")
KIND_COLOURS = {"F": "#55A868", "B": "#C44E52", "A": "#C44E52", "W": "#8172B3"}  # the phases' colours
KIND_LABELS = {"F": "forward", "B": "backward", "A": "input gradient", "W": "weight gradient"}


def network(
    model: str, steps: int = 1000, hidden: int = 20, inputs: int = 1, classes: int = 10, width: float = 1.0
) -> Network:
    """A network by name: ``vgg11`` (CIFAR-10 shapes), ``rnn`` or ``gru`` (unrolled over ``steps``)."""
    if model == "vgg11":
        return vgg11(width)
    if model in ("rnn", "gru"):
        return recurrent(model, steps, inputs, hidden, classes)
    raise ValueError(f"unknown model {model!r}; accepted: {', '.join(MODELS)}")


def estimates(
    net: Network,
    batch: int,
    ps: Sequence[int],
    machine: Machine,
    strategies: Sequence[str] = STRATEGIES,
    micro: int | None = None,
    blocks: int = 256,
    groups: int = 1,
    progress: bool = False,
) -> list[Estimate]:
    """Every strategy at every p; the pipelines schedule the network coarsened to ``blocks`` layers.
    ``progress``: a bar on stderr where it is a terminal (an RNN of 10^6 steps takes minutes)."""
    from tqdm import tqdm

    cells = [(strategy, p) for strategy in strategies for p in ps]
    out = []
    for strategy, p in tqdm(cells, desc="estimates", leave=False, disable=None if progress else True):
        used = net.coarsen(blocks) if strategy in PIPELINES else net
        out.append(estimate(strategy, used, batch, p, machine, micro, groups))
    return out


def table(found: Sequence[Estimate]) -> pd.DataFrame:
    return pd.DataFrame([e.row() for e in found], columns=list(COLUMNS))


def versus(
    net: Network,
    batch: int,
    machine: Machine,
    ps: Sequence[int] = tuple(range(2, 10)),
    micro: int | None = None,
    blocks: int = 256,
) -> pd.DataFrame:
    """LayerPipe against PipeDream at each p: both times and LayerPipe's saving, 1 - LayerPipe / PipeDream
    (the LayerPipe paper reports 25 % on average, upwards of 80 % with 7 to 9 processors)."""
    rows = []
    coarse = net.coarsen(blocks)
    for p in ps:
        pd_time = pipeline(coarse, batch, p, machine, "pipedream", micro).time
        lp_time = pipeline(coarse, batch, p, machine, "layerpipe", micro).time
        rows.append({"p": p, "pipedream": pd_time, "layerpipe": lp_time, "saving": 1 - lp_time / pd_time})
    return pd.DataFrame(rows)


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value * 1e3:.3g}" if value * 1e3 < 1000 else f"{value * 1e3:,.0f}"


def markdown(frame: pd.DataFrame, compare: pd.DataFrame | None, header: str) -> str:
    """The table of times per iteration (ms), strategies by p, the reasons for the empty cells, and
    LayerPipe against PipeDream."""
    ps = sorted(frame["p"].unique())
    lines = [header, "", "Time per iteration (ms):", ""]
    lines += ["| strategy | " + " | ".join(f"p = {p}" for p in ps) + " |", "|---|" + "---:|" * len(ps)]
    for strategy, rows in frame.groupby("strategy", sort=False):
        cells = [_ms(rows.loc[rows["p"] == p, "time"].iloc[0]) for p in ps]
        lines.append(f"| {LABELS[strategy]} | " + " | ".join(cells) + " |")
    notes = frame[frame["note"] != ""]
    if not notes.empty:
        lines += ["", "Empty cells:"]
        for strategy, rows in notes.groupby("strategy", sort=False):
            lines.append(f"- {LABELS[strategy]}: " + "; ".join(rows["note"]))
    if compare is not None and not compare.empty:
        lines += ["", "LayerPipe against PipeDream (1F1B), the same micro-batches:", ""]
        lines += ["| p | PipeDream (ms) | LayerPipe (ms) | LayerPipe's saving |", "|---:|---:|---:|---:|"]
        for r in compare.itertuples():
            lines.append(f"| {r.p} | {_ms(r.pipedream)} | {_ms(r.layerpipe)} | {r.saving:.1%} |")
        lines.append(f"\nMean saving: {compare['saving'].mean():.0%}.")
    return "\n".join(lines) + "\n"


def load_measured(path: str | Path) -> pd.DataFrame:
    """Measured iterations to draw beside the model: a CSV with the columns strategy, p and time
    (seconds per iteration), as ``python -m benchmarks.strategies`` writes it."""
    path = Path(path)
    if not path.is_file():
        raise AnalysisError(
            f"no measured table at {str(path)!r}; run python -m benchmarks.strategies first"
        )
    data = read_table(path, ("strategy", "p", "time"), ("p", "time"))
    require_rows(data, path, "the measured iterations of python -m benchmarks.strategies")
    require(data, path, ("p",), whole_at_least(1), "a whole number >= 1")
    require(data, path, ("time",), finite_at_least_zero, "a finite number >= 0")
    require(data, path, ("strategy",), lambda v: v.notna(), "a strategy's name")
    unknown = sorted(set(data["strategy"]) - set(STRATEGIES))
    if unknown:
        raise AnalysisError(
            f"{path} names unknown strategies {', '.join(unknown)}; accepted: {', '.join(STRATEGIES)}"
        )
    return data


# What a calibration.json may set: benchmarks.strategies writes the FLOP rate, α and β;
# benchmarks.distributed a device's compiled costs, BPTT's overhead and BPPSA's sample groups.
CALIBRATION = {
    "flops": "a positive number",
    "alpha": "a number >= 0",
    "beta": "a number >= 0",
    "overhead": "a number >= 0",
    "forward_step": "a number >= 0",
    "walk": "a number >= 0",
    "fold": "a number >= 0",
    "groups": "a positive integer",
}
# What the benchmarks also write there: the measurement's size, which sets nothing.
RECORDED = ("T", "B", "iteration_flops")


def _calibrated(key: str, value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if key == "groups":
        return isinstance(value, int) and value >= 1
    return value > 0 if key == "flops" else value >= 0


def load_calibration(path: str | Path) -> dict[str, float]:
    """The settings a measured ``calibration.json`` holds (``CALIBRATION``: the FLOP rate, α and β of
    ``python -m benchmarks.strategies``, the costs of ``python -m benchmarks.distributed``);
    the keys that record the measurement's size (``RECORDED``) are skipped, any other key is an error."""
    path = Path(path)
    try:
        values = json.loads(path.read_text())
    except OSError as exc:
        if path.exists():  # there, but not readable
            raise AnalysisError(f"cannot read {path}: {exc.strerror or exc}") from None
        raise AnalysisError(
            f"no calibration at {str(path)!r}; run python -m benchmarks.strategies "
            "or python -m benchmarks.distributed first"
        ) from None
    except ValueError as exc:
        raise AnalysisError(f"{path} is not JSON: {exc}") from None
    found = {k: v for k, v in values.items() if k in CALIBRATION} if isinstance(values, dict) else {}
    if not found:
        held = ", ".join(map(str, values)) if isinstance(values, dict) and values else "nothing"
        raise AnalysisError(f"{path} sets none of {', '.join(CALIBRATION)}; it holds {held}")
    for key in values:
        if key not in CALIBRATION and key not in RECORDED:
            raise AnalysisError(
                f"{path}: unknown key {key!r}; accepted: {', '.join(CALIBRATION)}"
                f" (and {', '.join(RECORDED)}, which describe the measurement)"
            )
    for key, value in found.items():
        if not _calibrated(key, value):
            raise AnalysisError(f"{path}: {key} is {value!r}; accepted: {CALIBRATION[key]}")
    return {k: (int(v) if k == "groups" else float(v)) for k, v in found.items()}


def gantt(
    ax, tasks: Sequence[Task] | None, title: str, window: tuple[int, int] = (1, 2), why: str = ""
) -> None:
    """One schedule, processors as rows, the tasks of iterations ``window`` drawn (a lighter shade
    for the second), time from the first of them; ``why`` there is none when ``tasks`` is empty."""
    from analysis.figures import _no_data

    ax.set_title(title, fontsize=10)
    if not tasks:
        _no_data(ax, why.replace(" exceeds", "\nexceeds"))
        return
    shown = [t for t in tasks if window[0] <= t.iteration <= window[1]]
    origin = min(t.start for t in shown)
    for t in shown:
        ax.barh(
            t.proc,
            (t.end - t.start) * 1e3,
            left=(t.start - origin) * 1e3,
            height=0.8,
            color=KIND_COLOURS[t.kind],
            alpha=1.0 if t.iteration == window[0] else 0.5,
            linewidth=0,
        )
    ax.set_yticks(range(max(t.proc for t in shown) + 1))
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("processor")
    ax.grid(axis="y", visible=False)


def figure(
    frame: pd.DataFrame, schedules: Sequence[Estimate], measured: pd.DataFrame | None, title: str
) -> plt.Figure:
    """Time per iteration against p, one line per strategy (measured iterations as crosses), and
    below it the pipelines' ``schedules`` as Gantt charts."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from analysis.figures import MARKERS, _legend_beside, _log_log

    fig = plt.figure(figsize=(14, 9 if schedules else 5.4))
    grid_spec = fig.add_gridspec(2 if schedules else 1, 3, height_ratios=[1.5, 1.0] if schedules else [1.0])
    ax = fig.add_subplot(grid_spec[0, :])
    colours = {s: f"C{i}" for i, s in enumerate(STRATEGIES)}
    top = _ceiling(frame, measured)
    for i, (strategy, rows) in enumerate(frame.groupby("strategy", sort=False)):
        rows = rows.dropna(subset=["time"])
        if rows.empty:
            continue
        label = LABELS[strategy]
        above = rows[rows["time"] > top]
        if not above.empty:
            label += f" (off the chart from p = {above['p'].min()}: {_seconds(above['time'].iloc[0])})"
        ax.plot(
            rows["p"],
            rows["time"],
            marker=MARKERS[i % len(MARKERS)],
            color=colours[strategy],
            linestyle="-" if strategy.startswith("bppsa") else "--",
            label=label,
            markersize=5,
        )
    if measured is not None:
        for strategy, rows in measured.groupby("strategy", sort=True):
            ax.scatter(
                rows["p"],
                rows["time"],
                marker="X",
                s=110,
                color=colours[strategy],
                edgecolors="black",
                zorder=5,
                label=f"measured: {LABELS[strategy]}",
            )
    if top is not None:
        ax.set_yscale("log")
        ax.set_ylim(top=top)  # before the ticks are chosen, which look at the visible range
    _log_log(ax, xbase=2)
    ax.set_xlabel("processors p")
    ax.set_ylabel("time per iteration (s)")
    ax.set_title(textwrap.fill(title, 130), fontsize=10)
    _legend_beside(ax)
    for col, est in enumerate(schedules[:3]):
        label = f"{LABELS[est.strategy]}, p = {est.p}" + (f": {est.detail}" if est.detail else "")
        gantt(fig.add_subplot(grid_spec[1, col]), est.tasks, label, why=est.note)
    if schedules:
        handles = [Patch(color=KIND_COLOURS[k], label=KIND_LABELS[k]) for k in ("F", "B", "W")]
        handles.append(Line2D([], [], color="gray", alpha=0.5, linewidth=6, label="the next iteration"))
        fig.axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def _ceiling(frame: pd.DataFrame, measured: pd.DataFrame | None) -> float | None:
    """The top of the time axis: 20 times sequential BP's time, so that a strategy orders of
    magnitude slower (BPPSA's dense aggregates of a CNN) leaves the chart, named in the legend,
    instead of flattening every other line; None when nothing is that slow."""
    times = pd.concat([frame["time"], measured["time"]] if measured is not None else [frame["time"]]).dropna()
    sequential = frame.loc[frame["strategy"] == "sequential", "time"].dropna()
    if sequential.empty or times.max() <= 20 * sequential.max():
        return None
    return 20 * float(sequential.max())


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 1e4 else f"{value:.2e} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m analysis.strategies", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="vgg11", help="the network")
    parser.add_argument(
        "--batch", type=positive_int, help="samples per iteration (default: 128 for vgg11, 16 else)"
    )
    parser.add_argument("--T", type=positive_int, default=1000, help="sequence length (rnn, gru)")
    parser.add_argument("--hidden", type=positive_int, default=20, help="hidden size (rnn, gru)")
    parser.add_argument("--inputs", type=positive_int, help="input features (default: 1 for rnn, 24 for gru)")
    parser.add_argument("--classes", type=positive_int, help="classes (default: 10, 11 for gru)")
    parser.add_argument(
        "--width", type=positive_float, default=1.0, help=f"VGG-11's channel multiplier, up to {WIDEST}"
    )
    parser.add_argument(
        "--p", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="processor counts"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        metavar="NAME",
        help=f"which to estimate, of {', '.join(STRATEGIES)} (default: all)",
    )
    parser.add_argument(
        "--flops", type=positive_float, help=f"FLOP/s of one processor (default: {Machine.flops:g})"
    )
    parser.add_argument(
        "--alpha", type=non_negative_float, help=f"seconds per message (default: {Machine.alpha:g})"
    )
    parser.add_argument(
        "--beta", type=non_negative_float, help=f"seconds per byte (default: {Machine.beta:g})"
    )
    parser.add_argument(
        "--calibration",
        nargs="+",
        help="calibration.json files of benchmarks.strategies (flops, alpha, beta) or "
        "benchmarks.distributed (overhead, forward_step, walk, fold, groups): they set what the "
        "flags leave unset, a later file winning",
    )
    parser.add_argument(
        "--overhead", type=non_negative_float, help="seconds per layer operation (default: 0)"
    )
    for flag, what in (
        ("--forward-step", "seconds per step of a device's fused forward, whatever the batch"),
        ("--walk", "seconds per step and sample of a device's compiled BPPSA backward of its slice"),
        ("--fold", "seconds per step and sample of a middle device's fold of its slice"),
    ):
        parser.add_argument(flag, type=non_negative_float, help=f"{what} (default: 0, its operations)")
    parser.add_argument(
        "--groups",
        type=positive_int,
        help="sample groups BPPSA's backward pipelines over the devices (default: 1)",
    )
    parser.add_argument("--word", type=positive_int, default=4, help="bytes per number")
    parser.add_argument(
        "--micro-batches", type=positive_int, help="per iteration in the pipelines (default: min(4p, B))"
    )
    parser.add_argument(
        "--blocks", type=positive_int, default=256, help="layers the pipelines schedule at most"
    )
    parser.add_argument("--gantt", type=positive_int, default=4, help="p of the Gantt charts")
    parser.add_argument(
        "--gantt-micro-batches", type=positive_int, help="in the Gantt charts (default: their p)"
    )
    parser.add_argument("--measured", help="a measured.csv to draw beside the model")
    parser.add_argument("--out", type=output_folder, default="strategies", help="output folder")
    args = parser.parse_args(argv)
    args.strategies = args.strategies or list(STRATEGIES)
    batch = args.batch or (128 if args.model == "vgg11" else 16)
    inputs = args.inputs or (24 if args.model == "gru" else 1)
    classes = args.classes or (11 if args.model == "gru" else 10)
    if args.model == "vgg11" and args.width > WIDEST:
        parser.error(
            f"--width {args.width:g} is too wide to count: VGG-11's widest weight would pass 2^63 bytes; "
            f"accepted: up to {WIDEST}"
        )
    for flag in ("micro_batches", "groups"):
        if getattr(args, flag) and getattr(args, flag) > batch:
            name = "--" + flag.replace("_", "-")
            parser.error(f"{name} {getattr(args, flag)} exceeds the batch {batch}; accepted: 1 to {batch}")
    try:
        measured = load_measured(args.measured) if args.measured else None
        calibrated = {k: v for path in args.calibration or [] for k, v in load_calibration(path).items()}
    except AnalysisError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    defaults = {"groups": min(calibrated.get("groups", 1), batch)}
    for key in CALIBRATION:  # a flag given wins, then the calibration, then the default
        value = getattr(args, key)
        fallback = defaults.get(key, getattr(Machine, key, None))
        setattr(args, key, value if value is not None else calibrated.get(key, fallback))
    net = network(args.model, args.T, args.hidden, inputs, classes, args.width)
    machine = Machine(
        args.flops, args.alpha, args.beta, args.word, args.overhead, args.forward_step, args.walk, args.fold
    )
    frame = table(
        estimates(
            net,
            batch,
            sorted(set(args.p)),
            machine,
            args.strategies,
            args.micro_batches,
            args.blocks,
            args.groups,
            progress=True,
        )
    )
    gantt_micro = min(args.gantt_micro_batches or args.gantt, batch)
    schedules = [
        pipeline(net.coarsen(args.blocks), batch, args.gantt, machine, kind, gantt_micro)
        for kind in PIPELINES
        if kind in args.strategies
    ]
    compare = None
    if {"pipedream", "layerpipe"} <= set(args.strategies):
        compare = versus(net, batch, machine, micro=args.micro_batches, blocks=args.blocks)
    header = (
        f"{net.name}, B = {batch}, on p processors of {args.flops:.3g} FLOP/s "
        f"(overhead {args.overhead:g} s per operation), α = {args.alpha:g} s, β = {args.beta:g} s/byte, "
        f"{args.word} bytes per number"
    )
    if args.forward_step or args.walk or args.fold:
        header += (
            f"; a device's compiled steps: forward {args.forward_step:.3g} s per step, walk "
            f"{args.walk:.3g} s and fold {args.fold:.3g} s per step and sample"
        )
    if args.groups > 1:
        header += f"; BPPSA in {args.groups} sample groups"
    # a row with a note has no estimate (data parallel beyond the batch, say): its time is nan by design
    overflow = frame[(frame["note"] == "") & ~frame["time"].map(math.isfinite)]
    if len(overflow):
        row = overflow.iloc[0]
        print(
            f"{parser.prog}: error: {row['strategy']} at p = {row['p']} takes {row['time']} s on this "
            f"machine ({args.flops:g} FLOP/s, α = {args.alpha:g} s, β = {args.beta:g} s/byte); accepted: "
            "settings whose times are finite",
            file=sys.stderr,
        )
        return 2
    from analysis.figures import save

    drawn = figure(frame, schedules, measured, header)
    drawn.canvas.draw()  # a figure that cannot be drawn fails here, before any file is written
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(frame, compare, header)
    frame.to_csv(out / "strategies.csv", index=False)
    (out / "strategies.md").write_text(text)
    paths = save(drawn, out, "strategies")
    print(text)
    for path in [out / "strategies.csv", out / "strategies.md", *paths]:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
