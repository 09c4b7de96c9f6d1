"""Backward-pass benchmark: PyTorch's BPTT (autograd over its fused RNN/GRU/LSTM) against BPPSA.

    python -m benchmarks.backward --model rnn --T 100 1000 10000 --B 16 --H 20
    python -m benchmarks.backward --device cuda --suite paper   # all tables, the paper's shapes

Three tables (``--tables``), all timed in one process with one clock (CUDA events on a GPU),
medians of ``--repeats`` runs after ``--warmup``, so every ratio compares like with like:

* ``backward``: the full backward (forward excluded) of BPTT and of BPPSA per scan strategy; both
  modules share weights and inputs, and the last column is the largest relative gradient difference
  between them, a check that the timed code computes the same thing; ``--packed`` feeds both a
  ``PackedSequence`` of B lengths from T down to about T / 2; ``--untaped`` adds a column, "numba"
  with its forward keeping no tape (a GRU's or an LSTM's backward then recomputes what the tape
  holds: what the tape saves, forward and backward together). A strategy that cannot run for
  the shape (it raises ValueError) gets "n/a" cells and a note under the table; a strategy named in
  ``--strategies`` that cannot run on the device at all is refused before anything is timed.
* ``scan``: the scan alone on the identical chain, BPPSA per strategy against the peers
  ``torch._higher_order_ops.associative_scan`` and ``jax.lax.associative_scan``
  (``benchmarks.scan``), each checked against the sequential twin.
* ``epoch``: a training epoch of the paper's bitstream task (10 classes, loss on h_T, Adam; the
  paper's RNN, or ``--model``'s GRU or LSTM) with BPTT and with BPPSA, the median of ``--repeats``
  epochs each, every one from the same weights.

Both timing tables carry the floors of ``benchmarks.floors``: the bytes a backward must move
over the measured copy bandwidth, and the Blelloch scan's 2·ceil(log2 T) levels times the measured
per-launch cost.
``--suite paper`` runs the paper's configurations (RNN T sweep, RNN B sweep, GRU IRMAS shapes) and
the epoch comparison, ``--suite long`` long sequences; ``--quick`` shrinks them to seconds on a CPU.

Prints Markdown; progress goes to stderr. Imports nothing beyond torch at module level (triton, jax
and numpy are imported where used), so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from benchmarks.common import (
    Progress,
    device_arg,
    failure,
    fmt_ms,
    machine_line,
    markdown,
    non_negative_int,
    notes_lines,
    parser,
    positive_int,
    run_tool,
    threads_arg,
)
from benchmarks.floors import Floors, measure_floors
from benchmarks.scan import MODULES, OURS, TERMS, bench_scan, format_scan_table
from bppsa_core import jacobians
from bppsa_core import layer as bppsa_layer
from bppsa_core.denormals import flush_denormals
from bppsa_core.dispatch import STRATEGIES, check_device
from experiments.graphs import Snapshot, capture_step
from experiments.timing import time_ms

MODELS = tuple(MODULES)
TABLES = ("backward", "scan", "epoch")
PEER_NAMES = ("torch", "jax")
SUITES = ("paper", "long")
DEFAULT_CHUNK = "the modules' default (about sqrt(T / 2); numba: its cost model)"
# Strategies timed when --strategies is not given; those not in STRATEGIES (yet) are left out.
DEFAULT_STRATEGIES = {
    "cpu": ("numba", "chunked", "blelloch"),
    "cuda": ("blelloch", "chunked", "graph", "triton", "auto"),
}
# The paper's RNN task: bitstream, 10 classes, Adam at lr 1e-5, 32,000 training samples.
CLASSES = 10
PAPER_LR = 1e-5
TRAIN_SAMPLES = 32_000


@dataclass
class Row:
    model: str
    steps: int
    batch: int
    hidden: int
    bptt_ms: float
    bppsa_ms: dict[str, float | str]  # a time, or the text of a cell that was not timed ("n/a")
    max_rel_err: float
    spread: float = 0.0  # the largest (max - min) / median of a method's timed runs
    floor_bytes_ms: float | None = None
    floor_levels_ms: float | None = None
    notes: dict[str, str] = field(default_factory=dict)
    bptt_flushed_ms: float | None = None  # BPTT with subnormals flushed (``--flush-bptt``)


@dataclass(frozen=True)
class ConfigSet:
    """A titled list of configurations (T, B, H, F) of one model."""

    title: str
    model: str
    configs: tuple[tuple[int, int, int, int], ...]


@dataclass
class EpochRow:
    model: str
    steps: int
    batch: int
    hidden: int
    samples: int
    iterations: int
    strategy: str
    bptt_s: float
    bppsa_s: float
    bptt_loss: float
    bppsa_loss: float
    # the same epoch with the step captured in a CUDA graph (``_captured_epoch``): BPTT's and BPPSA's
    # seconds (or the cell of one that did not run) and mean losses; None where it was not run
    captured_s: tuple[float | str, float | str] | None = None
    captured_loss: tuple[float, float] | None = None
    notes: dict[str, str] = field(default_factory=dict)
    spread: float = 0.0  # the largest (max - min) / median of a side's timed eager epochs
    bptt_flushed_s: float | None = None  # BPTT's epoch with subnormals flushed (``--flush-bptt``)


def default_strategies(device: torch.device) -> list[str]:
    """The strategies timed on this kind of device, among those ``bppsa_core.dispatch`` knows."""
    wanted = DEFAULT_STRATEGIES["cuda" if device.type == "cuda" else "cpu"]
    return [s for s in wanted if s in STRATEGIES]


# -------------------------------------------------------------------------------------- full backward


def packed_input(x: torch.Tensor) -> PackedSequence:
    """x (B, T, F) as B sequences of lengths T down to about T / 2, evenly spaced, longest first:
    a batch of variable lengths, as a packed batch carries."""
    batch, steps = x.shape[:2]
    lengths = torch.linspace(steps, max(1, steps // 2), batch).round().long()
    return pack_padded_sequence(x, lengths, batch_first=True)


UNTAPED = "numba untaped"  # the column of ``--untaped``
FLUSHED = "BPTT flushed"  # the baseline of ``--flush-bptt``


class Untaped(torch.nn.Module):
    """A BPPSA module whose layers keep no tape (``layer.new_tape`` answers None during its
    forward): a GRU's or an LSTM's backward then recomputes the gates instead of reading them."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor | PackedSequence) -> tuple:
        real = bppsa_layer.new_tape
        bppsa_layer.new_tape = lambda *args: None
        try:
            return self.module(x)
        finally:
            bppsa_layer.new_tape = real


def backward_once(
    module: torch.nn.Module, x: torch.Tensor | PackedSequence, head: torch.Tensor, loss: str
) -> tuple[float, float, list[torch.Tensor]]:
    """One forward and one backward (ms each) of ``loss`` through ``module``, and its gradients."""
    module.zero_grad(set_to_none=True)
    result: list[tuple[torch.Tensor | PackedSequence, torch.Tensor]] = []
    forward_ms = time_ms(lambda: result.append(module(x)), head.device)
    out, state = result[0]
    out = out.data if isinstance(out, PackedSequence) else out  # every sequence's outputs, stacked
    h_n = state[0] if isinstance(state, tuple) else state  # an LSTM's state is (h_n, c_n)
    value = (h_n[-1] @ head).sum() if loss == "last" else (out @ head).sum()
    ms = time_ms(value.backward, head.device)
    return forward_ms, ms, [p.grad.detach().clone() for p in module.parameters()]


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
    floors: Floors | None = None,
    chunk: int | None = None,
    packed: bool = False,
    untaped: bool = False,
    flush_bptt: bool = False,
) -> Row:
    """Time one configuration: BPTT and BPPSA with every scan strategy that runs here (``chunk``:
    the chunked, numba and triton strategies' chunk size; default: the modules'; ``packed``: the
    input a ``PackedSequence``, ``packed_input``; ``untaped``: also "numba" keeping no tape,
    ``Untaped``, in the column ``UNTAPED``; ``flush_bptt``: also BPTT with subnormal numbers
    flushed to zero, as BPPSA's CPU backward runs (``bppsa_core.denormals``), in ``FLUSHED``:
    autograd's own backward in PyTorch's default mode takes a microcode assist per subnormal
    operation on many x86 CPUs, a gradient on h_T reaching that range after a few hundred steps).

    A cell is the backward's median plus what the method's forward takes beyond ``torch.nn``'s
    (median against median, never less than 0): BPPSA is charged for any work it adds to the
    forward, and credited for none.

    The methods take turns, one backward each per round (``warmup`` untimed rounds, then
    ``repeats`` timed ones), so a machine that drifts during the run (a neighbour, a clock) drifts
    for all of them alike; each cell is its method's median, and the row's spread the largest
    (max - min) / median among them. A strategy that refuses the device or shape (ValueError) gets
    an "n/a" cell, any other failure an "error" cell; either way its message goes to the row's notes
    and the other columns go on.
    """
    torch.manual_seed(seed)
    ref_cls, our_cls = MODULES[model], OURS[model]
    ref = ref_cls(features, hidden, batch_first=True).to(device, dtype)
    x = torch.bernoulli(torch.full((batch, steps, features), 0.5, device=device, dtype=dtype))
    x = packed_input(x) if packed else x
    head = torch.randn(hidden, 1, device=device, dtype=dtype)
    modules: dict[str, torch.nn.Module] = {"BPTT": ref}
    cells: dict[str, float | str] = {}
    notes: dict[str, str] = {}
    for strategy in strategies:
        ours = our_cls(features, hidden, batch_first=True, strategy=strategy, chunk=chunk).to(device, dtype)
        ours.load_state_dict(ref.state_dict())
        modules[strategy] = ours
    if untaped:
        ours = our_cls(features, hidden, batch_first=True, strategy="numba", chunk=chunk).to(device, dtype)
        ours.load_state_dict(ref.state_dict())
        modules[UNTAPED] = Untaped(ours)
    if flush_bptt:
        modules[FLUSHED] = ref
    times: dict[str, list[float]] = {name: [] for name in modules}
    forward: dict[str, list[float]] = {name: [] for name in modules}
    grads: dict[str, list[torch.Tensor]] = {}
    for round_ in range(warmup + repeats):
        for name, module in modules.items():
            if name in cells:  # it failed
                continue
            try:
                with flush_denormals(device) if name == FLUSHED else contextlib.nullcontext():
                    forward_ms, ms, grads[name] = backward_once(module, x, head, loss)
            except Exception as exc:  # a strategy that cannot run is reported, not raised
                if name in ("BPTT", FLUSHED):
                    raise
                cells[name], notes[name] = failure(exc)
                continue
            if round_ >= warmup:
                times[name].append(ms)
                forward[name].append(forward_ms)
    err, spread = 0.0, 0.0
    for name, measured in times.items():
        if name in cells:
            continue
        cells[name] = statistics.median(measured)
        spread = max(spread, (max(measured) - min(measured)) / cells[name])
        if name == FLUSHED:  # a baseline, its backward alone as BPTT's; the differences are BPPSA's
            continue
        extra = statistics.median(forward[name]) - statistics.median(forward["BPTT"])
        cells[name] += max(0.0, extra)
        for a, b in zip(grads["BPTT"], grads[name], strict=True):
            err = max(err, ((a - b).norm() / a.norm().clamp_min(1e-30)).item())
    bptt_ms, flushed_ms = cells.pop("BPTT"), cells.pop(FLUSHED, None)
    row = Row(model, steps, batch, hidden, bptt_ms, cells, err, spread=spread, notes=notes)
    row.bptt_flushed_ms = flushed_ms
    if floors is not None:
        row.floor_bytes_ms = floors.bytes_ms(steps, batch, hidden, TERMS[model])
        row.floor_levels_ms = floors.levels_ms(steps)
    return row


def format_table(rows: Sequence[Row], strategies: Sequence[str]) -> str:
    """Markdown table: times in ms, BPPSA / BPTT ratios, the best speedup (and against BPTT with
    subnormals flushed, where measured) and the floors."""
    with_floors = all(r.floor_bytes_ms is not None for r in rows)
    flushed = any(r.bptt_flushed_ms is not None for r in rows)
    head = ["model", "T", "B", "H", "BPTT ms"]
    for s in strategies:
        head += [f"{s} ms", f"{s} / BPTT"]
    head += ["best BPPSA", "BPTT / best"]
    if flushed:
        head += [f"{FLUSHED} ms", f"{FLUSHED} / best"]
    if with_floors:
        head += ["floor bytes ms", "floor levels ms", "best / floor"]
    head += ["spread", "max rel grad diff"]
    body = []
    for r in rows:
        cells = [r.model, str(r.steps), str(r.batch), str(r.hidden), fmt_ms(r.bptt_ms)]
        timed = {}
        for s in strategies:
            v = r.bppsa_ms.get(s, "n/a")
            cells += [fmt_ms(v), f"{v / r.bptt_ms:.3g}" if isinstance(v, float) else v]
            if isinstance(v, float):
                timed[s] = v
        best = min(timed.items(), key=lambda sv: sv[1]) if timed else None
        cells += [f"{best[0]} {fmt_ms(best[1])}", f"{r.bptt_ms / best[1]:.3g}"] if best else ["n/a", "n/a"]
        if flushed:
            ftz = r.bptt_flushed_ms
            cells += [fmt_ms(ftz) if ftz else "n/a", f"{ftz / best[1]:.3g}" if ftz and best else "n/a"]
        if with_floors:
            floor = max(r.floor_bytes_ms, r.floor_levels_ms)
            cells += [f"{r.floor_bytes_ms:.3g}", f"{r.floor_levels_ms:.3g}"]
            cells.append(f"{best[1] / floor:.3g}" if best else "n/a")
        cells += [f"{100 * r.spread:.0f} %", f"{r.max_rel_err:.1e}"]
        body.append(cells)
    return markdown(head, body)


# ---------------------------------------------------------------------------------- end-to-end epoch


def bitstream_batches(
    steps: int, batch: int, samples: int, device: torch.device, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``samples`` shuffled training samples of the bitstream task, in batches, on the device."""
    from datasets.bitstream import BitstreamDataset

    data = BitstreamDataset(steps, split="train", seed=seed)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:samples].tolist()
    out = []
    for i in range(0, len(order), batch):
        x, y = data.__getitems__(order[i : i + batch])
        out.append((x.to(device), y.to(device)))
    return out


def _train(
    model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], lr: float
) -> torch.Tensor:
    """One pass of Adam over the batches; the summed loss stays on the device (no sync per step)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    total = torch.zeros((), device=batches[0][0].device)
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.detach()
    return total


def _captured_epoch(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    warmup: int,
    repeats: int = 1,
) -> tuple[float, float]:
    """Median seconds over ``repeats`` epochs, and the mean loss, of ``_train``'s epoch as the README's
    fast path runs it: one training step (forward, loss, backward, Adam step) captured once in a CUDA
    graph over fixed input tensors, then per batch the batch copied in and the graph replayed, one
    synchronization at the end. The warm-up's updates and each epoch's are undone in place (weights
    and Adam's state), so every epoch starts from the model's weights as given, as ``_train``'s does."""
    x0, y0 = batches[0]
    if any(x.shape != x0.shape or y.shape != y0.shape for x, y in batches):
        raise ValueError("a captured step replays batches of one shape; --epoch-samples a multiple of B")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, capturable=True)
    start = Snapshot(model, optimizer)
    static_x, static_y = x0.clone(), y0.clone()
    total = torch.zeros((), device=x0.device)

    def step() -> None:
        loss = F.cross_entropy(model(static_x), static_y)
        loss.backward()
        optimizer.step()
        total.add_(loss.detach())

    replay = capture_step(step, optimizer, x0.device, warmup)

    def epoch() -> None:
        for x, y in batches:
            static_x.copy_(x)
            static_y.copy_(y)
            replay()

    times = []
    for _ in range(repeats):
        start.restore()
        total.zero_()
        times.append(time_ms(epoch, x0.device))
    return statistics.median(times) / 1e3, total.item() / len(batches)


def epoch_comparison(
    model: str,
    steps: int,
    batch: int,
    hidden: int,
    samples: int,
    device: torch.device,
    strategy: str = "auto",
    warmup: int = 2,
    seed: int = 0,
    lr: float = PAPER_LR,
    progress: Progress | None = None,
    repeats: int = 1,
    flush_bptt: bool = False,
) -> EpochRow:
    """BPTT's and BPPSA's median epoch of ``model`` (rnn, gru or lstm) over ``repeats`` rounds, the two
    taking turns, every epoch from the same weights over the same batches, same clock;
    ``flush_bptt``: BPTT's also with subnormals flushed (``bench``), taking turns with them.

    The batches are generated beforehand and kept on the device, so the epoch times forward, loss,
    backward and Adam step of every batch, with one synchronization at its end. ``warmup``
    iterations on a copy of each model come first (cuDNN plans, Triton compilation, graph capture).
    On a GPU each side also runs the epoch with its step captured (``_captured_epoch``), from the
    same weights, on a copy of its model.
    """
    say = progress or (lambda text: None)
    say(f"bitstream: {samples} samples, T={steps} ...")
    batches = bitstream_batches(steps, batch, samples, device, seed)
    from experiments.train import Classifier  # the suite's model (its imports need no hydra)

    torch.manual_seed(seed)
    models = {}
    for mode in ("bptt", "bppsa"):
        layer = OURS[model](1, hidden, batch_first=True, backward=mode, strategy=strategy)
        models[mode] = Classifier(layer, CLASSES).to(device)
    models["bppsa"].load_state_dict(models["bptt"].state_dict())
    fresh = {}  # the captured epochs' models: copies before any training, cuDNN's weights flattened
    if device.type == "cuda":
        for name, classifier in models.items():
            fresh[name] = copy.deepcopy(classifier)
            for m in fresh[name].modules():
                if isinstance(m, torch.nn.RNNBase):
                    m.flatten_parameters()
    for name, classifier in models.items():
        say(f"warm-up of {name} ...")
        _train(copy.deepcopy(classifier), batches[:1] * max(1, warmup), lr)
    sides = {**models, FLUSHED: models["bptt"]} if flush_bptt else models
    times: dict[str, list[float]] = {name: [] for name in sides}
    totals = {name: torch.zeros(()) for name in sides}
    for r in range(repeats):
        say(f"epochs, round {r + 1} of {repeats} ...")
        for name, classifier in sides.items():
            trained = copy.deepcopy(classifier)  # every epoch from the same weights
            epoch = lambda m=trained, total=totals[name]: total.copy_(_train(m, batches, lr))  # noqa: E731
            with flush_denormals(device) if name == FLUSHED else contextlib.nullcontext():
                times[name].append(time_ms(epoch, device))
    seconds = [statistics.median(times[name]) / 1e3 for name in models]
    losses = [totals[name].item() / len(batches) for name in models]
    taken = sum(len(y) for _, y in batches)
    row = EpochRow(model, steps, batch, hidden, taken, len(batches), strategy, *seconds, *losses)
    row.spread = max((max(t) - min(t)) / statistics.median(t) for t in times.values())
    if flush_bptt:
        row.bptt_flushed_s = statistics.median(times[FLUSHED]) / 1e3
    if fresh:
        cells, captured_losses = [], []
        for name, classifier in fresh.items():
            say(f"captured epoch with {name} ...")
            try:
                s, loss = _captured_epoch(classifier, batches, lr, warmup, repeats)
            except (ValueError, RuntimeError) as exc:
                cell, row.notes[f"{name.upper()} captured"] = failure(exc)
                s, loss = cell, math.nan
            cells.append(s)
            captured_losses.append(loss)
        row.captured_s, row.captured_loss = (cells[0], cells[1]), (captured_losses[0], captured_losses[1])
    return row


def format_epoch_table(rows: Sequence[EpochRow]) -> str:
    """Markdown table: epoch seconds of BPTT and BPPSA, their ratio, and each epoch's mean loss; the
    same for the captured epochs where any row ran them (a GPU's)."""
    strategy = rows[0].strategy if rows else "auto"
    captured = any(r.captured_s is not None for r in rows)
    flushed = any(r.bptt_flushed_s is not None for r in rows)
    head = ["model", "T", "B", "H", "samples", "iterations", "BPTT epoch s", f"BPPSA ({strategy}) epoch s"]
    head += ["BPTT / BPPSA"]
    if flushed:
        head += [f"{FLUSHED} epoch s", f"{FLUSHED} / BPPSA"]
    head += ["spread", "BPTT mean loss", "BPPSA mean loss"]
    if captured:
        head += ["BPTT captured s", "BPPSA captured s", "captured BPTT / BPPSA"]
        head += ["BPTT captured mean loss", "BPPSA captured mean loss"]
    body = []
    for r in rows:
        cells = [r.model, str(r.steps), str(r.batch), str(r.hidden), str(r.samples), str(r.iterations)]
        cells += [f"{r.bptt_s:.4g}", f"{r.bppsa_s:.4g}", f"{r.bptt_s / r.bppsa_s:.3g}"]
        if flushed:
            ftz = r.bptt_flushed_s
            cells += [f"{ftz:.4g}", f"{ftz / r.bppsa_s:.3g}"] if ftz else ["n/a", "n/a"]
        cells.append(f"{100 * r.spread:.0f} %")
        cells += [f"{r.bptt_loss:.6f}", f"{r.bppsa_loss:.6f}"]
        if captured:
            s, loss = r.captured_s or ("n/a", "n/a"), r.captured_loss or (math.nan, math.nan)
            cells += [c if isinstance(c, str) else f"{c:.4g}" for c in s]
            cells.append(f"{s[0] / s[1]:.3g}" if all(isinstance(c, float) for c in s) else "–")
            cells += ["–" if math.isnan(v) else f"{v:.6f}" for v in loss]
        body.append(cells)
    return markdown(head, body)


# --------------------------------------------------------------------------------------------- suites


def suite_sets(name: str, quick: bool = False) -> tuple[list[ConfigSet], tuple[int, int, int, int] | None]:
    """The configuration sets of a suite and its epoch comparison (T, B, H, samples), if it has one.

    paper: the paper's RNN sweeps (T at B = 16; B = 2, 4, ..., 256 in powers of two at T = 1000;
    H = 20, one input feature) and its GRU IRMAS shapes (settings s/m/l: T 259/517/1034 with
    38/24/12 features, each at B 16/32/64; H = 20 as conf/model/gru.yaml), and the epoch.
    long: RNN and GRU (24 features) at T = 1000, 30,000, 100,000 and 300,000, B = 16, H = 20, to
    show that the backward's time grows linearly with T. ``quick``: the same tables on shapes small
    enough for seconds on a CPU.
    """
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; accepted: {', '.join(SUITES)}")
    if name == "long":
        lengths, hidden = ((30, 60) if quick else (1000, 30_000, 100_000, 300_000)), 5 if quick else 20
        return [
            ConfigSet(
                f"RNN, long sequences (B = 16, H = {hidden})",
                "rnn",
                tuple((t, 16, hidden, 1) for t in lengths),
            ),
            ConfigSet(
                f"GRU, long sequences (B = 16, H = {hidden})",
                "gru",
                tuple((t, 16, hidden, 24) for t in lengths),
            ),
        ], None
    if quick:
        lengths, t_batch, batches, b_len, hidden = (10, 30), 4, (2, 4), 30, 5
        gru_shapes, gru_batches, epoch = ((13, 4), (26, 3)), (2,), (30, 8, 20, 32)
    else:
        lengths, t_batch, b_len, hidden = (10, 30, 100, 300, 1000, 3000, 10000, 30000), 16, 1000, 20
        batches = tuple(2**k for k in range(1, 9))
        gru_shapes, gru_batches = ((259, 38), (517, 24), (1034, 12)), (16, 32, 64)
        epoch = (1000, 16, 20, TRAIN_SAMPLES)
    sets = [
        ConfigSet(
            f"RNN, T sweep (B = {t_batch}, H = {hidden})",
            "rnn",
            tuple((t, t_batch, hidden, 1) for t in lengths),
        ),
        ConfigSet(
            f"RNN, B sweep (T = {b_len}, H = {hidden})", "rnn", tuple((b_len, b, hidden, 1) for b in batches)
        ),
        ConfigSet(
            f"GRU, IRMAS shapes s/m/l (H = {hidden})",
            "gru",
            tuple((t, b, hidden, f) for t, f in gru_shapes for b in gru_batches),
        ),
    ]
    return sets, epoch


# ----------------------------------------------------------------------------------------------- main

LEGEND = (
    "Full backward: forward excluded; 's / BPTT' < 1 and 'BPTT / best' > 1 mean BPPSA is faster; the "
    "last column is the largest relative gradient difference from autograd's; the methods take turns, "
    "one backward each per round, and spread is the largest (max - min) / median among them. Scan only: "
    "x_0..x_T of "
    "one layer's chain from x_T in float32; the peers take the dense (T, B, H, H) elements (their "
    "building not timed); 'peer / best' > 1: BPPSA's best strategy is that many times faster; rel diff: "
    "norm-wise, against the sequential scan in float64; the jax peer is timed by the wall clock around a "
    "blocking call, after jit compilation."
)
NOT_TIMED = "Not timed (n/a: the method refused this device or shape; error: it failed):"
EPOCH_NOTE = (
    "Each side's median epoch over the repeats, BPTT and BPPSA taking turns (spread: the larger (max - "
    "min) / median of the two sides' epochs), every epoch from the same weights over the same shuffled "
    f"batches (Adam, lr {PAPER_LR:g}, loss on h_T), batches generated on the device beforehand; forward, "
    "loss, backward and step of every batch, one synchronization at the end. Mean losses agreeing shows "
    "the same training. 'captured' (a GPU): the same epoch from the same weights with the step (Adam "
    "capturable) captured once in a CUDA graph, each batch copied into its inputs and the graph replayed."
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad value ends the tool with one line and status 2."""
    p = parser("benchmarks.backward", __doc__)
    p.add_argument(
        "--suite",
        choices=SUITES,
        default=None,
        help="paper: the paper's configurations; long: T up to 300,000",
    )
    p.add_argument("--quick", action="store_true", help="the suite on small shapes (seconds, CPU)")
    p.add_argument(
        "--tables",
        nargs="+",
        choices=TABLES,
        default=None,
        help="tables to print (default: backward; --suite: all)",
    )
    p.add_argument("--model", choices=MODELS, default=None, help="rnn, gru or lstm (default: rnn)")
    p.add_argument(
        "--T", type=positive_int, nargs="+", default=None, help="sequence lengths (default: 100 1000 10000)"
    )
    p.add_argument("--B", type=positive_int, default=None, help="batch size (default: 16)")
    p.add_argument("--H", type=positive_int, default=None, help="hidden size (default: 20)")
    p.add_argument("--F", type=positive_int, default=None, help="input features (default: 1)")
    p.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        choices=STRATEGIES,
        help="BPPSA scan strategies to time (default: numba chunked blelloch on a CPU; "
        "blelloch chunked graph triton auto on a GPU)",
    )
    p.add_argument(
        "--chunk",
        type=positive_int,
        default=None,
        help="chunk size of the chunked, numba and triton strategies (default: the modules'); to tune it",
    )
    p.add_argument(
        "--block-mib",
        type=positive_int,
        default=None,
        help="MiB of temporaries per block of time steps of the BPPSA backward (default: "
        "bppsa_core.jacobians.BLOCK_BYTES, 8 on a CPU, 256 on a GPU); to tune it",
    )
    p.add_argument("--loss", choices=("last", "all"), default="last", help="loss on h_T or on every output")
    p.add_argument(
        "--packed",
        action="store_true",
        help="backward table: the input a PackedSequence of lengths T down to T / 2",
    )
    p.add_argument(
        "--untaped",
        action="store_true",
        help=f"backward table: also numba with its forward keeping no tape, the column '{UNTAPED}'",
    )
    p.add_argument(
        "--flush-bptt",
        action="store_true",
        help=f"backward and epoch tables: also BPTT with subnormals flushed to zero, as BPPSA's CPU "
        f"backward runs, the column '{FLUSHED}'",
    )
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per cell (the median is shown)"
    )
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed runs before them")
    p.add_argument(
        "--epoch-samples",
        type=positive_int,
        default=None,
        help=f"training samples in the epoch comparison (default: {TRAIN_SAMPLES}, the paper's)",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        choices=PEER_NAMES,
        default=list(PEER_NAMES),
        help="peer scans in the scan table (none with an empty list)",
    )
    p.add_argument("--epoch-strategy", choices=STRATEGIES, default="auto", help="BPPSA strategy of the epoch")
    args = p.parse_args(argv)
    fixed = [f"--{k}" for k in ("model", "T", "B", "H", "F") if getattr(args, k) is not None]
    if args.suite and fixed:
        p.error(f"--suite runs fixed configurations; {', '.join(fixed)} apply without --suite")
    if args.quick and not args.suite:
        p.error("--quick shrinks a suite; accepted: --suite paper --quick or --suite long --quick")
    if args.epoch_samples is not None and args.epoch_samples > TRAIN_SAMPLES:
        p.error(f"--epoch-samples: {args.epoch_samples} is more than the {TRAIN_SAMPLES} training samples")
    named = [("--strategies", s) for s in args.strategies or ()] + [("--epoch-strategy", args.epoch_strategy)]
    for flag, strategy in named:  # asked for by name: one that cannot run here is an error
        try:
            check_device(strategy, args.device)
        except ValueError as exc:
            p.error(f"{flag}: {exc}")
    args.tables = args.tables or (list(TABLES) if args.suite else ["backward"])
    args.model = args.model or "rnn"
    for flag in ("packed", "untaped"):
        if getattr(args, flag) and args.tables != ["backward"]:
            p.error(
                f"--{flag} times the backward table only, not {' '.join(args.tables)}; "
                "accepted: --tables backward"
            )
    if args.flush_bptt and not {"backward", "epoch"} & set(args.tables):
        p.error(
            f"--flush-bptt times BPTT in the backward and epoch tables, not {' '.join(args.tables)}; "
            "accepted: --tables backward, epoch"
        )
    return args


def plan(args: argparse.Namespace) -> tuple[list[ConfigSet], list[tuple[str, int, int, int, int]]]:
    """The configuration sets and the epoch comparisons (model, T, B, H, samples) the arguments ask
    for; a suite's epoch is the paper's RNN."""
    if args.suite:
        sets, epoch = suite_sets(args.suite, args.quick)
        if epoch is None:
            return sets, []
        t, b, h, n = epoch
        return sets, [("rnn", t, b, h, args.epoch_samples or n)]
    b, h, f = args.B or 16, args.H or 20, args.F or 1
    lengths = args.T or [100, 1000, 10000]
    sets = [ConfigSet(args.model.upper(), args.model, tuple((t, b, h, f) for t in lengths))]
    return sets, [(args.model, t, b, h, args.epoch_samples or TRAIN_SAMPLES) for t in lengths]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the asked-for tables, each as soon as it is measured."""
    args = parse_args(argv)
    progress = Progress("bench")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    if args.block_mib:  # a process-wide setting: it reaches the backward on the device's own thread too
        jacobians.BLOCK_BYTES[jacobians.block_kind(device)] = args.block_mib << 20
    strategies = args.strategies or default_strategies(device)
    sets, epochs = plan(args)
    heading = bool(args.suite) or len(args.tables) > 1

    def table(title: str, text: str, rows: Sequence[object] = ()) -> None:
        print(f"\n### {title}\n" if heading else "", flush=True)
        print(text, flush=True)
        if notes := notes_lines(rows):
            print("\n" + "\n".join([NOT_TIMED, *notes]), flush=True)

    print(machine_line(device))
    print(
        f"loss on {'h_T' if args.loss == 'last' else 'every output'}"
        f"{', packed sequences of lengths T down to T / 2' if args.packed else ''}"
        f", {args.dtype}, median of {args.repeats}"
        f" after {args.warmup} warm-up runs; strategies: {' '.join(strategies)}"
        f"; chunk {args.chunk or DEFAULT_CHUNK}; blocks of {jacobians.default_block_bytes(device) >> 20} MiB"
    )
    floors = measure_floors(device)
    print(f"measured: copy bandwidth {floors.bandwidth_gbs:.1f} GB/s, {floors.launch_us:.2f} µs per launch")
    print(f"\n{floors.note()}\n\n{LEGEND}")
    if args.suite:
        print(f"\n## Suite {args.suite}{' (quick shapes)' if args.quick else ''}")
    timing = {"warmup": args.warmup, "repeats": args.repeats, "floors": floors, "chunk": args.chunk}
    # The backward tables and the epoch come first, the prototype and optional peers last.
    if "backward" in args.tables:
        for cs in sets:
            rows = []
            for t, b, h, f in cs.configs:
                progress(f"backward {cs.model} T={t} B={b} H={h} F={f} ...")
                config = (cs.model, t, b, h, f, strategies, device, dtype, args.loss)
                variants = {"packed": args.packed, "untaped": args.untaped, "flush_bptt": args.flush_bptt}
                rows.append(bench(*config, **variants, **timing))
            columns = [*strategies, UNTAPED] if args.untaped else strategies
            table(f"Full backward: {cs.title}", format_table(rows, columns), rows)
    if "epoch" in args.tables and epochs:
        rows, failed = [], []
        for model, t, b, h, n in epochs:
            try:
                rows.append(
                    epoch_comparison(
                        model,
                        t,
                        b,
                        h,
                        n,
                        device,
                        args.epoch_strategy,
                        args.warmup,
                        progress=progress,
                        repeats=args.repeats,
                        flush_bptt=args.flush_bptt,
                    )
                )
            except Exception as exc:  # reported, so that the tables after it still run
                failed.append(f"- T={t}: {type(exc).__name__}: {exc}".splitlines()[0])
        text = format_epoch_table(rows) + ("\n\nFailed:\n" + "\n".join(failed) if failed else "")
        table("End-to-end training epoch: the bitstream task, BPTT vs BPPSA", f"{text}\n\n{EPOCH_NOTE}", rows)
    if "scan" in args.tables:
        if dtype != torch.float32:
            progress("the scan table runs in float32 (the peers and Triton take float32)")
        for cs in sets:
            rows = []
            for t, b, h, f in cs.configs:
                progress(f"scan {cs.model} T={t} B={b} H={h} ...")
                rows.append(bench_scan(cs.model, t, b, h, f, strategies, device, peers=args.peers, **timing))
            table(f"Scan only, identical chain: {cs.title}", format_scan_table(rows, strategies), rows)
    progress("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.backward", main, "smaller --T, --B, --H, --F or --block-mib"))
