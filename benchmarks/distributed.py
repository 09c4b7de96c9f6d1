"""Sequence parallelism across processes: distributed BPPSA against distributed BPTT.

    python -m benchmarks.distributed --ranks 1 2 4 --T 10000 100000 --B 16 --H 20

For each T and rank count p, spawns p gloo processes of one thread each (``--device cuda``: p NCCL
processes, one GPU each, GPU r for rank r). Each holds the contiguous
time slice of its rank (``bppsa_core.distributed.SequenceParallel``) and runs forward and backward
of the paper's model, a one-layer RNN (or ``--model gru`` / ``lstm``, ``--layers`` stacked) with the
loss on h_T (of the top layer: ``h_n[-1]``). BPPSA and BPTT take turns, ``--warmup`` untimed then
``--repeats`` timed iterations each, the processes meeting at a barrier around every phase. A
phase's time is the slowest rank's.

``--exchange`` is BPPSA's (``SequenceParallel(..., exchange=...)``), by default the module's "auto":
on CPU ranks its slices chained (no fold, each rank walks a group from the gradient the next rank
hands on), on GPUs the scan's all-gather; ``allgather`` or ``chain`` takes one. Its rows are the
model's ``bppsa-allgather`` or ``bppsa-chain``, named by the exchange taken.

As each spawn ends, its times go to stderr in one line, so that a run stopped part-way keeps in its
log what it had measured.

``--rounds R`` spawns every rank count R times, the counts taking turns (``--ranks 1 2``: 1, 2, then
2, 1, then 1, 2, ...), so that a machine whose speed drifts during the run slows both sides of a
ratio alike. The table then shows each time's median over the rounds, and each speedup as the
median of the rounds' own ratios, with their range in brackets.

Prints, per T and p:
- the median forward and backward times, and the backward speedup over BPTT on the same ranks and
  over BPPSA on one rank: the one-rank spawn's, and, on CPUs where ``--ranks`` has 1, also one
  measured in the p ranks' own processes ("same processes"): there, before each p-rank BPPSA
  iteration, rank 0 runs BPPSA over the whole sequence on a process group of its own while the
  other ranks wait, and the speedup is the median of each iteration's pair. The first compares
  spawns a minute or more apart; the second iterations a second apart, which a machine whose speed
  drifts from minute to minute tilts less;
- the bytes each rank hands to the process group per iteration;
- the peak memory per rank: the most any rank's resident set rose within one iteration of the
  mode (BPPSA's first, each after one iteration of its own) above what it held when that
  iteration began. On CPUs it is measured in processes of its own, spawned before the timed ones,
  with malloc returning freed blocks to the system (``benchmarks.memory``), so that it
  follows the live tensors: what the forward keeps for the backward and the backward's working
  memory. The timed processes keep the usual malloc, as a training run does (under that setting
  every large block comes back as fresh pages, and the walk took twice as long). On GPUs, the
  most torch's allocator held above what it held when the iteration began, in the timed processes;
- with ``--timeline``, each rank's BPPSA backward span by span in the last timed iteration of the
  last round (``bppsa_core.distributed.Timeline``): each group's walk and all-gather, the last
  rank's wait for its pending all-gathers, the all-reduce, in milliseconds from the backward's
  start, each walk's length in brackets. It shows where a rank waits and what a group's walk costs
  while the other ranks walk theirs.

``--out`` writes ``measured.csv`` rows (scheme ``bppsa-allgather`` / ``bptt-distributed``, p,
time per iteration) that ``python -m analysis.schemes --measured measured.csv`` draws beside its
model, and, when ``--ranks`` has 1, ``calibration.json`` (else an earlier one there is removed;
``--out`` takes one layer, as the model does): what one rank's kernels cost at the largest T, the
costs the model charges a device that runs ``bppsa_core.distributed`` (``--calibration``):
- ``forward_step``: seconds per step of distributed BPTT's forward (PyTorch's fused one, the whole
  batch at once, keeping autograd's graph);
- ``forward_sample``: seconds per step and sample of BPPSA's forward where it runs compiled (a CPU
  with numba), else 0: BPPSA's forward is then the fused one too;
- ``forward_group``: seconds per step of that compiled forward for each group of samples it runs at
  once, whatever its samples: a group of ``GROUP_SAMPLES`` (as a rank of several runs them)
  is timed against the whole batch in the one rank's process, and the two costs split one rank's
  forward into this and ``forward_sample``;
- ``walk``: seconds per step and sample of BPPSA's backward of a slice from a given gradient;
- ``fold``: seconds per step and sample of a middle rank's fold of its slice into one matrix per
  sample (``slice_fold``, as a middle rank runs it in its forward);
- ``overhead``: seconds per operation of BPTT's backward (autograd's, 2T - 1 operations);
- ``groups``: the BPPSA backward's sample groups on a rank of several (``--micro-batches`` at most,
  ``distributed.backward_groups``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import memory
from benchmarks.common import markdown, non_negative_int, parser, positive_int, run_tool
from bppsa_core.distributed import EXCHANGES, MICRO_BATCHES, backward_groups, exchange_taken, sample_groups
from experiments.timing import median_ms, time_ms
from toolbox.files import output_folder

MODELS = ("rnn", "gru", "lstm")
DEVICES = ("cpu", "cuda")


def _worker(rank: int, size: int, store: str, out: str, settings: dict) -> None:
    from bppsa_core import GRU, LSTM, RNN
    from bppsa_core.distributed import SequenceParallel

    torch.set_num_threads(1)
    device = torch.device(settings["device"], rank if settings["device"] == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend, bound = ("nccl", {"device_id": device}) if device.type == "cuda" else ("gloo", {})
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size, **bound)
    try:
        steps, batch, hidden = settings["T"], settings["B"], settings["H"]
        torch.manual_seed(0)
        cls = {"rnn": RNN, "gru": GRU, "lstm": LSTM}[settings["model"]]
        model = cls(settings["features"], hidden, num_layers=settings["layers"], device=device)
        parts = torch.tensor_split(torch.arange(steps), size)
        x = torch.randn(len(parts[rank]), batch, settings["features"], device=device)

        def meet() -> None:  # every rank's work done, on the device too
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()

        groups = settings["micro_batches"]
        runs = {
            b: SequenceParallel(model, backward=b, micro_batches=groups, exchange=settings["exchange"])
            for b in ("bppsa", "bptt")
        }
        result: dict = {}
        if "memory" in settings["phases"]:
            result["memory"] = _peaks(runs, model, x, device, meet)
        if "times" in settings["phases"]:
            turns: dict = {}
            if settings.get("alongside") and size > 1:  # one rank's BPPSA, in these processes
                solo = dist.new_group([0])  # every rank takes part in making it
                turns["alone"] = None
                if rank == 0:
                    whole = torch.randn(steps, batch, settings["features"], device=device)
                    turns["alone"] = (SequenceParallel(model, solo, backward="bppsa"), whole)
            turns.update({name: (run, x) for name, run in runs.items()})
            result.update(
                _times(turns, model, meet, settings["warmup"], settings["repeats"], settings["timeline"])
            )
            if size == 1 and settings["layers"] == 1:
                result["fold"] = _fold_seconds(model, x, settings["warmup"], settings["repeats"])
                result["compiled_forward"] = _compiled_forward(model, x)
                if result["compiled_forward"]:
                    result["group_share"] = _group_share(model, x, settings["warmup"], settings["repeats"])
        every = [None] * size
        dist.all_gather_object(every, result)
        if rank == 0:
            Path(out).write_text(json.dumps(every))
    finally:
        dist.destroy_process_group()


def _last_h(h_n: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The top layer's h_T, which the loss is on: of h_n, or of an LSTM's (h_n, c_n)."""
    return (h_n[0] if isinstance(h_n, tuple) else h_n)[-1]


def _peaks(runs: dict, model: torch.nn.Module, x: torch.Tensor, device: torch.device, meet) -> dict:
    """Each mode's peak memory (``_peak_since``) in one iteration after one of its own, BPPSA's
    first: BPTT's many small tensors leave the heap in a state that makes a later BPPSA iteration's
    resident set grow by more than it allocates (``python -m benchmarks.distributed --ranks 2``
    prints each mode's peak per rank)."""
    peak: dict[str, int | None] = {}
    for name, run in runs.items():
        for measured in (False, True):
            model.zero_grad(set_to_none=True)
            meet()
            before = _peak_start(device) if measured else None
            top, h_n = run(x)
            _last_h(h_n).sum().backward()
            if measured:
                peak[name] = None if before is None else _peak_since(device, before)
            del top, h_n
    return peak


def _times(turns: dict, model: torch.nn.Module, meet, warmup: int, repeats: int, spans: bool = False) -> dict:
    """Each mode's median forward and backward seconds on this rank, the modes taking turns, and the
    bytes it handed the process group in one iteration; with ``spans``, the BPPSA backward's timeline
    in its last iteration (``bppsa_core.distributed.Timeline``: seconds from the backward's start).

    ``turns``: each mode's module and input. A mode that is None here is another rank's alone (rank
    0's one-rank BPPSA, "alone"): this rank only meets it at its barriers. Where rank 0 runs it, its
    ``alone_speedup`` is the median over iterations of its backward over BPPSA's right after (each
    rank's phase ends at a barrier, so rank 0's BPPSA time is the slowest rank's)."""
    from bppsa_core.distributed import timeline, traffic

    times: dict[str, dict[str, list[float]]] = {n: {"forward": [], "backward": []} for n in turns if turns[n]}
    sent: dict[str, int] = {}
    result: dict = {}
    for i in range(warmup + repeats):
        for name, turn in turns.items():
            if turn is None:  # another rank's turn: its three barriers (around forward and backward)
                for _ in range(3):
                    meet()
                continue
            run, x = turn
            model.zero_grad(set_to_none=True)
            traffic.reset()
            meet()
            start = time.perf_counter()
            top, h_n = run(x)
            meet()
            record = spans and name == "bppsa" and i == warmup + repeats - 1
            if record:
                timeline.reset()
                timeline.on = True
            middle = time.perf_counter()
            _last_h(h_n).sum().backward()
            del top, h_n  # nothing of this iteration outlives it
            meet()
            end = time.perf_counter()
            if record:
                timeline.on = False
                result["timeline"] = [(what, a - middle, b - middle) for what, a, b in timeline.spans]
            if i >= warmup:
                times[name]["forward"].append(middle - start)
                times[name]["backward"].append(end - middle)
                sent[name] = traffic.bytes
    result["times"] = {n: {p: statistics.median(v) for p, v in t.items()} for n, t in times.items()}
    if "alone" in times:
        pairs = zip(times["alone"]["backward"], times["bppsa"]["backward"], strict=True)
        result["alone_speedup"] = statistics.median(alone / parallel for alone, parallel in pairs)
    result["sent"] = sent
    return result


def _peak_start(device: torch.device) -> int | None:
    """What this rank holds as an iteration begins, its peak reset to it; None where the system
    cannot reset the resident set's peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return memory.rss_bytes() if memory.reset_peak() else None


def _peak_since(device: torch.device, before: int) -> int:
    """The most this rank held above ``before`` since ``_peak_start``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return memory.peak_bytes() - before


def _fold_seconds(model: torch.nn.RNNBase, x: torch.Tensor, warmup: int, repeats: int) -> float:
    """The median time of a middle rank's fold of the slice ``x`` (``slice_fold``), as
    ``SequenceParallel``'s forward runs it on a middle rank."""
    from bppsa_core.dispatch import ScanOptions
    from bppsa_core.distributed import slice_fold
    from bppsa_core.layer import LayerConfig

    config, weights = LayerConfig(model.mode, options=ScanOptions()), list(model._flat_weights)
    with torch.no_grad():
        out, _ = model(x)
    h0 = x.new_zeros(x.shape[1], model.hidden_size)
    c0 = h0 if model.mode == "LSTM" else None

    def run() -> None:
        with torch.no_grad():  # as in the forward of the ranks (the weights require grad)
            slice_fold(config, x, h0, c0, out, weights)

    return median_ms(run, x.device, warmup, repeats) / 1e3


def _compiled_forward(model: torch.nn.RNNBase, x: torch.Tensor) -> bool:
    """Whether BPPSA's forward of ``x`` runs compiled, as ``SequenceParallel``'s forward asks it."""
    from bppsa_core import dispatch

    with torch.no_grad():
        weights = model._flat_weights
        return dispatch.compiled_forward(model.strategy, model.mode, model.hidden_size, x, *weights)


def _group_share(model: torch.nn.RNNBase, x: torch.Tensor, warmup: int, repeats: int) -> float:
    """The compiled forward of a group of ``GROUP_SAMPLES`` samples of ``x`` over that of the
    whole batch (medians, taking turns), each into a batch-major output as a rank of several runs
    its groups (``SequenceParallel``'s forward)."""
    from bppsa_core.distributed import GROUP_SAMPLES
    from bppsa_core.layer import sequential_forward
    from bppsa_core.numba_forward import new_outputs

    steps, batch = x.shape[:2]
    if batch <= GROUP_SAMPLES:  # the batch is one group
        return 1.0
    weights, h0 = list(model._flat_weights), x.new_zeros(batch, model.hidden_size)
    c0 = h0 if model.mode == "LSTM" else None
    out = new_outputs(steps, batch, model.hidden_size, x.dtype, batch_major=True)
    sizes: dict[int, list[float]] = {GROUP_SAMPLES: [], batch: []}

    def run(n: int) -> None:
        with torch.no_grad():  # as in the forward of the ranks (the weights require grad)
            sequential_forward(
                model.strategy,
                model.mode,
                x[:, :n],
                h0[:n],
                c0 if c0 is None else c0[:n],
                weights,
                None,
                out=out[:, :n],
            )

    for i in range(warmup + repeats):
        for n, times in sizes.items():
            ms = time_ms(lambda n=n: run(n), x.device)
            if i >= warmup:
                times.append(ms)
    group, whole = (statistics.median(t) for t in sizes.values())
    return group / whole


def forward_split(per_step: float, batch: int, share: float) -> tuple[float, float]:
    """(per sample, per group): a compiled forward's cost per step, ``per_step`` for the whole batch,
    split so that a group of ``GROUP_SAMPLES`` costs ``share`` of it: the straight line
    through the two. A share no line with both parts positive passes (0: none measured) leaves the
    whole cost per sample."""
    from bppsa_core.distributed import GROUP_SAMPLES

    if batch <= GROUP_SAMPLES:
        return per_step / batch, 0.0
    per_sample = per_step * (1 - share) / (batch - GROUP_SAMPLES)
    per_group = per_step - per_sample * batch
    if per_sample <= 0 or per_group < 0:
        return per_step / batch, 0.0
    return per_sample, per_group


def calibration(
    steps: int, batch: int, groups: int, rows: list[dict], fold_s: float, compiled: bool, share: float = 0.0
) -> dict:
    """The model's costs of a device (module docstring) from one rank's rows at ``steps``;
    ``compiled``: BPPSA's forward ran compiled (else it is the fused one, which ``forward_step``
    prices), a group of ``GROUP_SAMPLES`` costing ``share`` of the batch (``_group_share``;
    0: no group's part)."""
    one = {r["backward"]: r for r in rows if r["p"] == 1 and r["T"] == steps}
    per_sample, per_group = 0.0, 0.0
    if compiled:
        per_sample, per_group = forward_split(one["bppsa"]["forward_s"] / steps, batch, share)
    return {
        "forward_step": one["bptt"]["forward_s"] / steps,
        "forward_sample": per_sample,
        "forward_group": per_group,
        "walk": one["bppsa"]["backward_s"] / (steps * batch),
        "fold": fold_s / (steps * batch),
        "overhead": one["bptt"]["backward_s"] / (2 * steps - 1),
        "groups": groups,
        "T": steps,
        "B": batch,
    }


def measure(steps: int, ranks: int, settings: dict) -> list[dict]:
    """Every rank's medians, bytes and memory for ``ranks`` processes at sequence length ``steps``.

    On CPUs the memory is measured in processes of its own, where malloc returns every freed block
    of 64 KiB or more to the system (``memory.MALLOC``), and the times in processes with the usual
    malloc: under that setting each large block comes back as fresh pages, which doubled the walk's
    time. On GPUs (torch's allocator) one set of processes measures both."""
    settings = {**settings, "T": steps}
    if settings.get("device") == "cuda":
        return _spawn(ranks, {**settings, "phases": ("memory", "times")})
    with mock.patch.dict(os.environ, memory.MALLOC):  # read by malloc as each spawned interpreter starts
        peaks = _spawn(ranks, {**settings, "phases": ("memory",)})
    return [{**t, **m} for t, m in zip(_spawn(ranks, {**settings, "phases": ("times",)}), peaks, strict=True)]


def _spawn(ranks: int, settings: dict) -> list[dict]:
    """Every rank's results (``_worker``) from ``ranks`` spawned processes."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        try:
            mp.spawn(_worker, args=(ranks, store, out, settings), nprocs=ranks, join=True)
        except mp.ProcessExitedException as exc:
            # Rank 0 writes every rank's results once all have finished measuring. A rank that
            # then dies on a signal, leaving the process group or the interpreter (gloo's
            # teardown has aborted once in many runs: "terminate called without an active
            # exception"), has lost nothing measured.
            every = _results(out, ranks)
            if every is None:
                raise
            print(f"[distributed] {exc} after every rank's results were in; kept", file=sys.stderr)
            return every
        return json.loads(Path(out).read_text())


def _results(out: str, ranks: int) -> list[dict] | None:
    """Every rank's results as rank 0 wrote them to ``out``; None where it is missing or incomplete."""
    try:
        every = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        return None
    return every if isinstance(every, list) and len(every) == ranks and all(every) else None


def rows_of(steps: int, ranks: int, per_rank: list[dict], exchange: str) -> list[dict]:
    """One row per backward mode: the slowest rank's phase times, the most bytes and memory of a rank;
    BPPSA's also its speedup over one rank in the same processes, where measured (``_times``). Each
    row's scheme is the model's name for it (``analysis.schemes``), BPPSA's by the ``exchange`` its
    ranks took (``exchange_taken``)."""
    rows = []
    for name in ("bppsa", "bptt"):
        forward = max(r["times"][name]["forward"] for r in per_rank)
        backward = max(r["times"][name]["backward"] for r in per_rank)
        rows.append(
            {
                "scheme": f"bppsa-{exchange}" if name == "bppsa" else "bptt-distributed",
                "backward": name,
                "p": ranks,
                "T": steps,
                "forward_s": forward,
                "backward_s": backward,
                "time": forward + backward,
                "bytes_per_rank": max(r["sent"][name] for r in per_rank),
                "memory_per_rank": _most(r["memory"][name] for r in per_rank),
                "speedup_same_processes": per_rank[0].get("alone_speedup") if name == "bppsa" else None,
            }
        )
    return rows


def spawn_line(rows: list[dict]) -> str:
    """One spawn's rows (``rows_of``) in a line, printed as the spawn ends: a run stopped part-way
    (a time limit, a lost machine) keeps in its log the times it had measured."""
    first = rows[0]
    parts = [
        f"{r['backward']} forward {r['forward_s'] * 1e3:.1f} ms, backward {r['backward_s'] * 1e3:.1f} ms"
        for r in rows
    ]
    alone = first.get("speedup_same_processes")
    same = "" if alone is None else f"; BPPSA {alone:.2f}× one rank in the same processes"
    return f"T = {first['T']}, {first['p']} rank(s): " + "; ".join(parts) + same


def merged(rounds: list[list[dict]]) -> list[dict]:
    """The rows of several rounds (``rows_of`` each) as one, in the first round's order: each time,
    byte count and peak the median over the rounds."""
    keyed: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for r in rows:
            keyed.setdefault((r["T"], r["p"], r["backward"]), []).append(r)
    out = []
    for same in keyed.values():
        row = dict(same[0])
        for field in ("forward_s", "backward_s", "bytes_per_rank"):
            row[field] = statistics.median(r[field] for r in same)
        row["time"] = row["forward_s"] + row["backward_s"]
        for field in ("memory_per_rank", "speedup_same_processes"):
            values = [r.get(field) for r in same]
            row[field] = None if None in values else statistics.median(values)
        out.append(row)
    return out


def _most(values) -> int | None:
    """The largest, or None where a rank could not measure (no /proc/self/clear_refs)."""
    values = list(values)
    return None if None in values else max(values)


def timeline_text(per_rank: list[list]) -> str:
    """One line per rank of its spans (``Timeline``: what, start and end in seconds) in milliseconds,
    in the order they began, with each walk's length: where a rank waited, and how long its groups
    took while the others ran theirs."""
    lines = []
    for rank, spans in enumerate(per_rank):
        parts = []
        for what, start, end in sorted(spans, key=lambda s: s[1]):
            length = f" ({(end - start) * 1e3:.1f})" if what == "walk" else ""
            parts.append(f"{what} {start * 1e3:.1f}-{end * 1e3:.1f}{length}")
        lines.append(f"rank {rank}: " + ", ".join(parts))
    return "\n".join(lines)


def spread(values: list[float | None]) -> str:
    """Ratios, one per round, as "median× (least–most)", the range only where there are several;
    "-" where one is missing."""
    if not values or None in values:
        return "-"
    extent = f" ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}×{extent}"


def table(rounds: list[list[dict]]) -> str:
    """The Markdown table: per T and p, both modes (``merged`` over the rounds), with the speedups
    each round measured in its own runs: their median, and their range where there are rounds."""
    keyed = [{(r["T"], r["p"], r["backward"]): r for r in rows} for rows in rounds]

    def ratio(row: dict, ranks: int, backward: str, field: str, inverse: bool = False) -> str:
        """Each round's ``field`` of the row at (``ranks``, ``backward``) over the row's own, or the
        row's over it (``inverse``): the median over rounds and their range; "-" where one is missing."""
        values = []
        for rows in keyed:
            ref, own = rows.get((row["T"], ranks, backward)), rows[(row["T"], row["p"], row["backward"])]
            top, bottom = (own, ref) if inverse else (ref, own)
            bad = top is None or bottom is None or top[field] is None or not bottom[field]
            values.append(None if bad else top[field] / bottom[field])
        return spread(values)

    head = [
        "T",
        "ranks",
        "backward",
        "forward (ms)",
        "backward (ms)",
        "vs BPTT, same ranks",
        "vs 1 rank",
        "vs 1 rank, same processes",
        "bytes per rank",
        "peak memory per rank (MiB)",
        "memory vs 1 rank",
    ]
    body = []
    for r in merged(rounds):
        mem = r["memory_per_rank"]
        body.append(
            [
                str(r["T"]),
                str(r["p"]),
                r["backward"],
                f"{r['forward_s'] * 1e3:.1f}",
                f"{r['backward_s'] * 1e3:.1f}",
                ratio(r, r["p"], "bptt", "backward_s"),
                ratio(r, 1, r["backward"], "backward_s"),
                spread([rows[(r["T"], r["p"], r["backward"])]["speedup_same_processes"] for rows in keyed]),
                f"{r['bytes_per_rank']:,.0f}",
                "-" if mem is None else f"{mem / 2**20:.0f}",
                ratio(r, 1, r["backward"], "memory_per_rank", inverse=True),
            ]
        )
    return markdown(head, body)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("benchmarks.distributed", __doc__)
    p.add_argument("--ranks", type=positive_int, nargs="+", default=[1, 2], help="process counts")
    p.add_argument("--T", type=positive_int, nargs="+", default=[10_000], help="sequence lengths")
    p.add_argument("--B", type=positive_int, default=16, help="batch size")
    p.add_argument("--H", type=positive_int, default=20, help="hidden size")
    p.add_argument("--model", choices=MODELS, default="rnn", help="the cell")
    p.add_argument("--features", type=positive_int, default=1, help="input features")
    p.add_argument("--layers", type=positive_int, default=1, help="stacked recurrent layers")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu: gloo ranks of one thread each; cuda: NCCL ranks of one GPU each",
    )
    p.add_argument(
        "--micro-batches",
        type=positive_int,
        default=MICRO_BATCHES,
        help="the most sample groups the BPPSA backward pipelines over the ranks, on CPU ranks of 4 samples "
        "at least (and the most its compiled forward does)",
    )
    p.add_argument(
        "--exchange",
        choices=EXCHANGES,
        default="auto",
        help="how BPPSA's ranks hand the gradient on: the scan's all-gather, a chain of walks, or the "
        "module's choice (auto: the chain on CPU ranks, the all-gather on GPUs)",
    )
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed iterations per mode")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed iterations per mode (median)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="spawns of every rank count, the counts taking turns (medians over the rounds)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print each rank's BPPSA backward, span by span, in the last timed iteration of the last round",
    )
    p.add_argument("--out", type=output_folder, help="folder for measured.csv")
    args = p.parse_args(argv)
    for steps in args.T:
        if steps < max(args.ranks):
            p.error(
                f"--T {steps} is shorter than {max(args.ranks)} ranks; accepted: at least one step per rank"
            )
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and not gpus:
        p.error("--device cuda: no CUDA GPU is visible; accepted: --device cpu")
    if args.device == "cuda" and max(args.ranks) > gpus:
        p.error(
            f"--ranks {max(args.ranks)} with --device cuda needs a GPU per rank and {gpus} are visible; "
            f"accepted: at most {gpus} ranks, or --device cpu"
        )
    if args.out and args.layers > 1:
        p.error(
            f"--layers {args.layers} with --out: the cost model (analysis.schemes) prices one recurrent "
            "layer; accepted: --layers 1 with --out"
        )
    args.exchange = exchange_taken(args.exchange, torch.device(args.device))  # named as taken
    shape = ("B", "H", "model", "features", "layers", "device", "micro_batches", "exchange")
    settings = {k: getattr(args, k) for k in (*shape, "warmup", "repeats", "timeline")}
    # one rank's BPPSA also in each p-rank spawn: on CPUs, whose speed drifts (a GPU rank's would need
    # a one-rank NCCL group beside the p-rank one)
    settings["alongside"] = 1 in args.ranks and args.device == "cpu"
    rounds, folds, shares, timelines, compiled = [], {}, {}, {}, False
    for turn in range(args.rounds):
        rows = []
        for steps in args.T:
            for ranks in args.ranks if turn % 2 == 0 else args.ranks[::-1]:
                where = f"round {turn + 1} of {args.rounds}, " if args.rounds > 1 else ""
                print(f"[distributed] {where}T = {steps}, {ranks} rank(s) ...", file=sys.stderr, flush=True)
                per_rank = measure(steps, ranks, settings)
                spawned = rows_of(steps, ranks, per_rank, args.exchange)
                rows += spawned
                print(f"[distributed] {spawn_line(spawned)}", file=sys.stderr, flush=True)
                if args.timeline:  # the last round's is kept
                    timelines[steps, ranks] = [r["timeline"] for r in per_rank]
                if "fold" in per_rank[0]:  # one rank of one layer: what the model's device costs
                    folds.setdefault(steps, []).append(per_rank[0]["fold"])
                    compiled = per_rank[0]["compiled_forward"]
                    if "group_share" in per_rank[0]:
                        shares.setdefault(steps, []).append(per_rank[0]["group_share"])
        rounds.append(rows)
    per_rank = "nccl, one GPU" if args.device == "cuda" else "gloo, one thread"
    over = f", then over {args.rounds} rounds taking turns" if args.rounds > 1 else ""
    print(
        f"{args.model}, {args.layers} layer(s), B = {args.B}, H = {args.H}, loss on h_T, {per_rank} "
        f"per rank, BPPSA's exchange {args.exchange}; medians of {args.repeats} after {args.warmup} "
        f"warm-up{over}"
    )
    print(table(rounds))
    for (steps, ranks), spans in timelines.items():
        print(f"\nBPPSA backward, T = {steps}, {ranks} rank(s): each rank's spans (ms from its start)")
        print(timeline_text(spans))
    rows, costs = merged(rounds), None
    if folds:
        steps = max(folds)
        device = torch.device(args.device)  # the groups of a rank of several
        groups = len(sample_groups(args.B, backward_groups(args.B, args.micro_batches, 2, device)))
        share = statistics.median(shares[steps]) if steps in shares else 0.0
        costs = calibration(steps, args.B, groups, rows, statistics.median(folds[steps]), compiled, share)
        bppsa_forward = "BPPSA's fused"
        if compiled:
            bppsa_forward = (
                f"BPPSA's compiled {costs['forward_sample']:.3g} s per step and sample and "
                f"{costs['forward_group']:.3g} s per step and group"
            )
        print(
            f"\none rank at T = {steps}: forward BPTT's {costs['forward_step']:.3g} s per step, "
            f"{bppsa_forward}; BPPSA walk {costs['walk']:.3g} s and fold {costs['fold']:.3g} s per step "
            f"and sample, BPTT {costs['overhead']:.3g} s per backward operation"
        )
    if args.out:
        from experiments.records import write_json, write_table

        write_table(Path(args.out) / "measured.csv", rows)
        if costs:
            write_json(Path(args.out) / "calibration.json", costs)
        else:  # an earlier run's calibration does not belong beside these rows
            (Path(args.out) / "calibration.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.distributed", main))
