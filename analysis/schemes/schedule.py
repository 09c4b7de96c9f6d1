"""The pipelines' task graphs and the list scheduler that runs them: GPipe, PipeDream's 1F1B and
LayerPipe become tasks on fixed processors (``pipeline_tasks``), each started as soon as its
processor is free and its inputs have arrived (``list_schedule``), the result checked
(``check_schedule``; ``scheduled`` does all three). ``pipeline_memory`` and ``sent_per_iteration``
read a schedule's memory and bytes; ``partition`` cuts layers into balanced contiguous stages, for the
pipelines and for the schemes that give each device a slice."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from analysis.data import AnalysisError
from analysis.schemes.machine import Machine
from analysis.schemes.network import Network


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
    scheme, with each task's processor and its inputs (a transfer delays a task whose input comes
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


def scheduled(
    net: Network, batch: int, p: int, micro: int, kind: str, machine: Machine, iterations: int
) -> list[Task]:
    """The pipeline's task graph (``pipeline_tasks``), list-scheduled in its order of priority and
    checked: every schedule the model reports has been."""
    tasks = pipeline_tasks(net, batch, p, micro, kind, machine, iterations)
    list_schedule(tasks, _priority(kind))
    check_schedule(tasks)
    return tasks


def sent_per_iteration(
    tasks: Sequence[Task], net: Network, size: float, machine: Machine, iterations: int
) -> float:
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
