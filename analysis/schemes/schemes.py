"""The parallel training schemes, each a function from a network, a batch, p processors and a
machine to an ``Estimate`` of one iteration: sequential BP, data and model parallelism, Gholami et
al.'s P_r x P_c grid, the GPipe, PipeDream and LayerPipe pipelines (list-scheduled), distributed BPTT
and BPPSA across devices. ``SCHEMES`` names them all; ``estimates`` runs a set of them at every p."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd

from analysis.schemes.machine import Machine, compiled_steps
from analysis.schemes.network import Layer, Network
from analysis.schemes.schedule import Task, partition, pipeline_memory, scheduled, sent_per_iteration

# The table's columns: an Estimate's fields but its schedule.
COLUMNS = ("scheme", "p", "time", "compute", "utilisation", "memory", "sent", "hops", "detail", "note")


@dataclass
class Estimate:
    """A scheme's prediction for one iteration on p processors; ``note`` says why there is none."""

    scheme: str
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
        return {k: getattr(self, k) for k in COLUMNS}


def _none(scheme: str, p: int, why: str) -> Estimate:
    return Estimate(scheme, p, note=why)


def _finish(est: Estimate, net: Network, batch: int, machine: Machine) -> Estimate:
    est.utilisation = machine.compute(net.work * batch) / (est.p * est.time) if est.time > 0 else math.nan
    return est


def sequential(net: Network, batch: int, machine: Machine) -> Estimate:
    """Plain back-propagation on one processor (of the p): the reference every scheme meets at p = 1
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


def pipeline(
    net: Network,
    batch: int,
    p: int,
    machine: Machine,
    kind: str,
    micro: int | None = None,
    iterations: int = 4,
) -> Estimate:
    """A pipeline scheme's time per iteration in the steady state: the schedule of ``iterations``
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
    tasks = scheduled(net, batch, p, micro, kind, machine, iterations)
    ends = [max(t.end for t in tasks if t.iteration == it) for it in range(iterations)]
    half = iterations // 2
    procs = max(t.proc for t in tasks) + 1
    per_iter = [sum(t.duration for t in tasks if t.proc == q) / iterations for q in range(procs)]
    time = max((ends[-1] - ends[half - 1]) / (iterations - half), max(per_iter))
    time += machine.all_reduce(net.shared, procs)
    sent = sent_per_iteration(tasks, net, batch / micro, machine, iterations)
    memory = max(pipeline_memory(tasks, net, batch / micro, machine, kind).values())
    est = Estimate(
        kind, p, time, max(per_iter), memory=memory, sent=sent, detail=f"{micro} micro-batches", tasks=tasks
    )
    return _finish(est, net, batch, machine)


# --- BPPSA across devices, and BPTT across the same devices --------------------------------------


def _slices(net: Network, p: int) -> list[list[Layer]]:
    owner = partition([x.work for x in net.layers], p)
    out: list[list[Layer]] = [[] for _ in range(max(owner) + 1)]
    for x, r in zip(net.layers, owner, strict=True):
        out[r].append(x)
    return out


def _forward_ends(
    slices: list[list[Layer]], batch: int, machine: Machine, compiled: bool = False, groups: int = 1
) -> list[float]:
    """When each device's forward ends: the slices run one after another, each sending its last
    output to the next. In ``groups`` of samples, a device sends each group's last output on as soon
    as it has it and runs the next group while the device after it runs that one. ``compiled``:
    BPPSA's forward (``Machine.forward``)."""
    sizes = _groups(batch, groups)
    ends: list[float] = []
    arrived = [0.0] * len(sizes)  # when each group's input is there
    for r, part in enumerate(slices):
        t = 0.0
        for i, n in enumerate(sizes):
            if r:
                arrived[i] += machine.send(slices[r - 1][-1].outputs * n)
            t = max(t, arrived[i]) + machine.forward(part, n, compiled)
            arrived[i] = t
        ends.append(t)
    return ends


def _forward_groups(slices: list[list[Layer]], batch: int, machine: Machine, groups: int) -> int:
    """The groups of samples BPPSA's forward hands on (``bppsa_core.distributed.forward_groups``,
    ``groups`` standing for its micro-batches, a step's forward FLOPs for twice its multiply-adds):
    on more than one device whose forward is compiled (``forward_sample`` set), else 1."""
    from bppsa_core.distributed import forward_groups

    if len(slices) == 1 or machine.forward_sample <= 0:
        return 1
    work = next((x.forward / 2 for x in slices[0] if x.step), 0.0)
    return forward_groups(batch, min(sum(x.step for x in s) for s in slices), groups, len(slices), work)


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
    steps, rest = compiled_steps(layers, machine.walk)
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
    one exchange per group. A compiled forward (``forward_sample``) likewise hands the batch on in
    groups of samples where ``bppsa_core.distributed`` does (``_forward_groups``)."""
    slices = _slices(net, p)
    q, top = len(slices), len(slices) - 1
    fwd = _forward_ends(slices, batch, machine, True, _forward_groups(slices, batch, machine, groups))
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
        machine.forward(s, batch, True)
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


def bppsa_chain(net: Network, batch: int, p: int, machine: Machine, groups: int = 1) -> Estimate:
    """BPPSA's slices chained, as ``bppsa_core.distributed`` runs them with ``exchange="chain"``: the
    forward as in ``bppsa``, no fold; in the backward each device walks a group of samples from the
    gradient the device after it hands on for that group (the top device from the loss's) and hands
    the gradient of its first state to the device before. Over ``groups`` groups the devices
    overlap as a pipeline, about (m + q - 1) / m of one slice's walk for m groups over q devices,
    with q - 1 dependent hops per group; each device's walk costs H² per step and sample where a
    fold costs H³."""
    slices = _slices(net, p)
    q, top = len(slices), len(slices) - 1
    fwd = _forward_ends(slices, batch, machine, True, _forward_groups(slices, batch, machine, groups))
    width_in = [s[0].inputs for s in slices]
    sizes = _groups(batch, groups) if q > 1 else [batch]
    done = list(fwd)  # each device's progress
    for n in sizes:
        arrived = 0.0  # when the gradient of this group reaches the device below
        for r in reversed(range(q)):
            start = done[r] if r == top else max(done[r], arrived)
            done[r] = start + _walk(slices[r], n, machine)
            arrived = done[r] + machine.send(n * width_in[r])
    time = max(done) + machine.all_reduce(net.shared, q)
    compute = max(machine.forward(s, batch, True) + _walk(s, batch, machine) for s in slices)
    memory = max(machine.word * (sum(x.params + batch * x.keeps for x in s) + net.shared) for s in slices)
    sent = machine.word * batch * max(width_in[1:]) if q > 1 else 0.0
    detail = f"{len(sizes)} sample groups" if len(sizes) > 1 else ""
    est = Estimate("bppsa-chain", p, time, compute, memory=memory, sent=sent, hops=q - 1, detail=detail)
    return _finish(est, net, batch, machine)


# A scheme's run: (network, batch, p, machine, micro-batches of a pipeline or None for its default,
# sample groups of BPPSA's backward) -> its estimate.
Run = Callable[[Network, int, int, Machine, int | None, int], Estimate]


def _sequential_on(
    net: Network, batch: int, p: int, machine: Machine, micro: int | None, groups: int
) -> Estimate:
    """Sequential BP on one of the p processors, the others idle."""
    est = sequential(net, batch, machine)
    est.p = p
    est.utilisation /= p
    return est


def _pipelined(kind: str) -> Run:
    return lambda net, batch, p, machine, micro, groups: pipeline(net, batch, p, machine, kind, micro)


def _bppsa_by(exchange: str) -> Run:
    return lambda net, batch, p, machine, micro, groups: bppsa(net, batch, p, machine, exchange, groups)


def _without(run: Callable[[Network, int, int, Machine], Estimate]) -> Run:
    """A scheme that takes neither micro-batches nor sample groups."""
    return lambda net, batch, p, machine, micro, groups: run(net, batch, p, machine)


@dataclass(frozen=True)
class Scheme:
    """A scheme's label in tables and figures, how it runs, and whether it is a pipeline (scheduled on
    the network coarsened to ``--blocks`` layers)."""

    label: str
    run: Run
    pipeline: bool = False


# Every scheme by name, in the order of the tables and the figure's colours.
SCHEMES: dict[str, Scheme] = {
    "sequential": Scheme("sequential BP", _sequential_on),
    "gpipe": Scheme("GPipe", _pipelined("gpipe"), pipeline=True),
    "pipedream": Scheme("PipeDream 1F1B", _pipelined("pipedream"), pipeline=True),
    "layerpipe": Scheme("LayerPipe", _pipelined("layerpipe"), pipeline=True),
    "data": Scheme("data parallel", _without(data_parallel)),
    "model": Scheme("model parallel", _without(model_parallel)),
    "grid": Scheme("P_r x P_c grid (Gholami)", _without(grid)),
    "bptt-distributed": Scheme("distributed BPTT", _without(distributed_bptt)),
    "bppsa-allgather": Scheme("BPPSA, all-gather", _bppsa_by("allgather")),
    "bppsa-tree": Scheme("BPPSA, tree", _bppsa_by("tree")),
    "bppsa-chain": Scheme(
        "BPPSA, chained",
        lambda net, batch, p, machine, micro, groups: bppsa_chain(net, batch, p, machine, groups),
    ),
}
PIPELINES = tuple(name for name, scheme in SCHEMES.items() if scheme.pipeline)


def estimate(
    scheme: str,
    net: Network,
    batch: int,
    p: int,
    machine: Machine,
    micro: int | None = None,
    groups: int = 1,
) -> Estimate:
    """One scheme on p processors: ``micro`` micro-batches in a pipeline, ``groups`` sample groups
    in BPPSA's backward."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; accepted: {', '.join(SCHEMES)}")
    return SCHEMES[scheme].run(net, batch, p, machine, micro, groups)


def estimates(
    net: Network,
    batch: int,
    ps: Sequence[int],
    machine: Machine,
    schemes: Sequence[str] = tuple(SCHEMES),
    micro: int | None = None,
    blocks: int = 256,
    groups: int = 1,
    progress: bool = False,
) -> list[Estimate]:
    """Every scheme at every p; the pipelines schedule the network coarsened to ``blocks`` layers.
    ``progress``: a bar on stderr where it is a terminal (an RNN of 10^6 steps takes minutes)."""
    from tqdm import tqdm

    cells = [(scheme, p) for scheme in schemes for p in ps]
    out = []
    for scheme, p in tqdm(cells, desc="estimates", leave=False, disable=None if progress else True):
        used = net.coarsen(blocks) if SCHEMES[scheme].pipeline else net
        out.append(estimate(scheme, used, batch, p, machine, micro, groups))
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
