"""Captured-step benchmark: BPPSA's backward against cuDNN's eager, captured in CUDA graphs, and
against a naive sequential loop, over T and H.

    python -m benchmarks.capture --device cuda           # RNN, GRU, LSTM; H = 20 ... 256; T = 1,000, 10,000
    python -m benchmarks.capture --T 100 --H 20          # the CPU: the eager and naive columns only
    python -m benchmarks.capture --device cuda --models rnn --T 1000 --H 20 --kernels   # and per kernel
    python -m benchmarks.capture --device cuda --T 1000 --H 20 --matmul-precision highest high

For each model, T and H, one ``torch.nn`` module and one ``bppsa_core`` module with the same weights
(strategy ``auto``, or ``graph`` where auto runs the module as ``torch.nn``, so that the table still
shows the scan there) and a loss on h_T, every cell the median of ``--repeats`` after ``--warmup``,
the methods taking turns, all in one process:

* ``eager``: the backward's wall-clock time (the forward excluded), as a training loop sees it;
* ``naive``: the backward of a sequential loop of ``torch.nn``'s cells (``RNNCell``, ``GRUCell``,
  ``LSTMCell``), one autograd node per step: the baseline DEER and ParaRNN quote; run where
  T <= ``--naive-max-T``;
* ``captured``: the GPU time of a whole training step (forward, backward, an SGD step) captured once
  in a CUDA graph (``torch.cuda.graph``, the capture PyTorch documents) and replayed, on both sides:
  what is left once no host work is; CUDA only;
* ``captured bwd``: the GPU time of the backward alone, captured as ``make_graphed_callables`` does
  (the forward in one graph, the backward in another sharing its memory pool), each timed replay
  after an untimed one of the forward: the backward's GPU work, both sides; CUDA only;
* ``peak MiB``: the memory the backward allocates beyond what was allocated before it, on both
  sides; CUDA only;
* with ``--kernels``, where the backward's GPU time goes: per kernel (and copy) its launches and
  GPU time in one eager backward under ``torch.profiler``, the same kernels a captured backward
  replays; the "captured bwd" time above their sum is the graph's gaps between kernels; CUDA only.

``--matmul-precision`` measures every shape under each of PyTorch's float32 matmul precisions given
(``torch.set_float32_matmul_precision``, both sides): under "high" the BPPSA kernels' products are
three TF32 ones (``bppsa_core.triton.launch.dot_precision``), so the rows show what that buys.

A cell a method cannot fill says why under the table. Prints Markdown; progress goes to stderr.
Imports nothing beyond torch, so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from benchmarks.common import (
    Progress,
    add_matmul_precision,
    add_walk_warps,
    device_arg,
    failure,
    fmt_ms,
    machine_line,
    markdown,
    matmul_precision,
    non_negative_int,
    notes_lines,
    on_device,
    parser,
    positive_int,
    profiled_events,
    run_tool,
    setting_cells,
    threads_arg,
    walks_on,
)
from benchmarks.scan import MODULES, module_pair
from experiments.graphs import capture_step, warm_up
from experiments.timing import Interval, time_ms

FEATURES = 1  # the paper's bitstream input
DEFAULT_T = (1000, 10_000)
DEFAULT_H = (20, 64, 128, 256)  # cuDNN's persistent kernels end at H = 256 (RNN), 128 (GRU, LSTM)
Cell = str | float  # a time in ms, or the text of a cell that could not be measured
KERNEL_ROWS = 8  # the kernels listed per side and shape, by GPU time; the rest summed in one row
NAME_CHARS = 80  # a kernel's name in the table, at most
KERNEL_ROUNDS = 3  # profiled backwards per side and shape (their launches and times averaged)
Kernels = dict[str, tuple[float, float]]  # kernel name -> (launches, µs) per backward


@dataclass
class Row:
    model: str
    steps: int
    batch: int
    hidden: int
    precision: str = "highest"  # torch.get_float32_matmul_precision() while it was measured
    walks: str = "auto"  # the kernels' walk warps (--walk-warps)
    cells: dict[str, Cell] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    kernels: dict[str, Kernels] = field(default_factory=dict)  # per side ("cuDNN", "BPPSA"), --kernels


def _loss(module: torch.nn.Module, x: Tensor) -> Tensor:
    """The paper's loss shape: the last state, summed."""
    h_n = module(x)[1]
    return (h_n[0] if isinstance(h_n, tuple) else h_n).sum()


def _naive(cell: torch.nn.Module, x: Tensor, hidden: int) -> Tensor:
    """The sequential loop of ``torch.nn``'s cell over x (T, B, F): one autograd node per step."""
    h = x.new_zeros((x.shape[1], hidden))
    state = (h, h.clone()) if isinstance(cell, torch.nn.LSTMCell) else h
    for t in range(x.shape[0]):
        state = cell(x[t], state)
    return (state[0] if isinstance(state, tuple) else state).sum()


def _cell_from(module: torch.nn.Module) -> torch.nn.Module:
    """The one-layer module's weights in torch.nn's cell of its kind (``RNNCell``, ``GRUCell``,
    ``LSTMCell``)."""
    cell_cls = getattr(torch.nn, f"{type(module).__name__}Cell")
    kwargs = {"nonlinearity": module.nonlinearity} if isinstance(module, torch.nn.RNN) else {}
    cell = cell_cls(module.input_size, module.hidden_size, **kwargs).to(module.weight_hh_l0)
    cell.load_state_dict({k.removesuffix("_l0"): v for k, v in module.state_dict().items()})
    return cell


def _eager_backward_ms(forward: Callable[[], Tensor], device: torch.device) -> float:
    """Wall-clock ms of the backward of ``forward()``'s loss. The loss dies here: a graph kept alive
    keeps its parameters' gradient accumulators on the stream that made them, and a later capture's
    backward would then wait on that stream (PyTorch warns that this breaks a capture)."""
    loss = forward()
    return time_ms(loss.backward, device)


def _replay_ms(
    replay: Callable[[], object], warmup: int, repeats: int, device: torch.device,
    before: Callable[[], object] | None = None,
) -> float:  # fmt: skip
    """The median GPU ms of ``repeats`` calls of ``replay`` (a graph's) after ``warmup``, each after
    an untimed call of ``before`` (the replay of the graph that makes its inputs) where one is given."""
    times = []
    for r in range(max(warmup, 1) + repeats):
        if before is not None:
            before()
        with Interval(device) as it:
            replay()
        if r >= max(warmup, 1):
            times.append(it.seconds * 1e3)
    return statistics.median(times)


def _sgd_step(module: torch.nn.Module, x: Tensor) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """A training step of the loss on h_T over ``x`` with a tiny SGD step, and its optimizer."""
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-6)

    def step() -> None:
        _loss(module, x).backward()
        optimizer.step()

    return step, optimizer


def captured_step_ms(
    module: torch.nn.Module, x: Tensor, warmup: int, repeats: int, error_mode: str = "global"
) -> float:
    """GPU ms of one training step (forward, backward, SGD step) captured once in a CUDA graph
    (``capture_step``; ``error_mode`` there) and replayed: the median of ``repeats`` timed replays."""
    step, optimizer = _sgd_step(module, x.clone())
    return _replay_ms(capture_step(step, optimizer, x.device, warmup, error_mode), warmup, repeats, x.device)


def captured_backward_ms(
    module: torch.nn.Module, x: Tensor, warmup: int, repeats: int, error_mode: str = "global"
) -> float:
    """GPU ms of the backward alone, captured as ``make_graphed_callables`` does: the forward in one
    graph, the backward in a second graph sharing its memory pool (so the saved tensors it reads stay
    where the forward's replay writes them); each timed replay of the backward follows an untimed one
    of the forward. ``error_mode`` as in ``capture_step``."""
    static_x = x.clone()
    warm_up(*_sgd_step(module, static_x), x.device, warmup)
    pool = torch.cuda.graph_pool_handle()
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward, pool=pool, capture_error_mode=error_mode):
        loss = _loss(module, static_x)
    with torch.cuda.graph(backward, pool=pool, capture_error_mode=error_mode):
        loss.backward()
    return _replay_ms(backward.replay, warmup, repeats, x.device, before=forward.replay)


def backward_peak_mib(module: torch.nn.Module, x: Tensor) -> float:
    """MiB the backward allocates on the GPU beyond what is allocated when it starts."""
    module.zero_grad(set_to_none=True)
    loss = _loss(module, x)
    torch.cuda.synchronize(x.device)
    before = torch.cuda.memory_allocated(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    loss.backward()
    torch.cuda.synchronize(x.device)
    return (torch.cuda.max_memory_allocated(x.device) - before) / 2**20


def kernel_name(name: str) -> str:
    """A GPU kernel's name without its return type and parameter list, its template arguments kept
    (they tell a GEMM's tile, an elementwise kernel's operation) up to ``NAME_CHARS`` in all; a
    copy's ("Memset (Device)") as it is."""
    name = name.removeprefix("void ")
    depth = 0
    for i, char in enumerate(name):
        depth += (char == "<") - (char == ">")
        if char == "(" and depth == 0 and i and name[i - 1] != " ":
            name = name[:i]
            break
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def kernel_times(events: Sequence[object], rounds: int) -> Kernels:
    """The GPU kernels and copies among ``events`` (``rounds`` backwards' profiles), by name: their
    launches and µs per backward, the most time first."""
    total: dict[str, list[float]] = {}
    for e in events:
        if on_device(e):
            launches_us = total.setdefault(kernel_name(e.name), [0.0, 0.0])
            launches_us[0] += 1
            launches_us[1] += e.time_range.elapsed_us()
    per = {name: (n / rounds, us / rounds) for name, (n, us) in total.items()}
    return dict(sorted(per.items(), key=lambda kv: -kv[1][1]))


def backward_kernels(module: torch.nn.Module, x: Tensor, rounds: int = KERNEL_ROUNDS) -> Kernels:
    """Per kernel, its launches and GPU µs in one backward of the loss on h_T: ``rounds`` eager
    backwards profiled, each from the gradients unset, as a training step's."""
    events: list[object] = []
    for _ in range(rounds):
        module.zero_grad(set_to_none=True)
        loss = _loss(module, x)
        events += profiled_events(loss.backward, x.device)
        del loss  # as ``_eager_backward_ms``: no graph outlives its backward
    module.zero_grad(set_to_none=True)
    return kernel_times(events, rounds)


def bench(
    model: str,
    steps: int,
    batch: int,
    hidden: int,
    device: torch.device,
    warmup: int,
    repeats: int,
    naive_max_t: int,
    error_mode: str = "global",
    chunk: int | None = None,
    kernels: bool = False,
) -> Row:
    """One row: every method of the module docstring that runs here, on the same weights and input,
    under PyTorch's float32 matmul precision as it is set; ``chunk``: the BPPSA module's (None: its
    default); ``kernels``: the backward per kernel too."""
    torch.manual_seed(0)
    ref, ours = module_pair(model, FEATURES, hidden, device, chunk=chunk)
    x = torch.bernoulli(torch.full((steps, batch, FEATURES), 0.5)).to(device)
    row = Row(model, steps, batch, hidden, torch.get_float32_matmul_precision())
    if ours._torch_nn_instead():  # auto runs torch.nn here; time the scan it would run otherwise
        ours.strategy = "graph"
        row.notes["BPPSA eager"] = (
            "strategy graph; auto runs this module as torch.nn (dispatch.torch_nn_instead)"
        )
    eager: dict[str, Callable[[], Tensor]] = {
        "cuDNN eager": lambda: _loss(ref, x),
        "BPPSA eager": lambda: _loss(ours, x),
    }
    if steps <= naive_max_t:
        cell = _cell_from(ref)
        eager["naive eager"] = lambda: _naive(cell, x, hidden)
    else:
        row.notes["naive eager"] = f"run where T <= {naive_max_t} (--naive-max-T)"
    times: dict[str, list[float]] = {name: [] for name in eager}
    for r in range(warmup + repeats):
        for name, forward in list(eager.items()):
            try:
                ms = _eager_backward_ms(forward, device)
            except (ValueError, RuntimeError) as exc:
                row.cells[name], row.notes[name] = failure(exc)
                del eager[name]
                continue
            if r >= warmup:
                times[name].append(ms)
    for name in eager:
        row.cells[name] = statistics.median(times[name])
    for side, module in (("cuDNN", ref), ("BPPSA", ours)):
        for what, measure in (
            ("captured", lambda m=module: captured_step_ms(m, x, warmup, repeats, error_mode)),
            ("captured bwd", lambda m=module: captured_backward_ms(m, x, warmup, repeats, error_mode)),
            ("peak MiB", lambda m=module: backward_peak_mib(m, x)),
        ):
            name = f"{side} {what}"
            if device.type != "cuda":
                row.cells[name], row.notes[what] = "n/a", "needs a CUDA device"
                continue
            try:
                row.cells[name] = measure()
            except (ValueError, RuntimeError) as exc:
                row.cells[name], row.notes[name] = failure(exc)
        if kernels and device.type != "cuda":
            row.notes["kernels"] = "needs a CUDA device"
        elif kernels:
            try:
                row.kernels[side] = backward_kernels(module, x)
            except (ValueError, RuntimeError) as exc:
                row.notes[f"{side} kernels"] = failure(exc)[1]
    return row


COLUMNS = (
    "cuDNN eager", "BPPSA eager", "naive eager", "cuDNN captured", "BPPSA captured", "cuDNN captured bwd",
    "BPPSA captured bwd", "cuDNN peak MiB", "BPPSA peak MiB",
)  # fmt: skip
TIMES = 7  # COLUMNS[:TIMES] are in ms


def _ratio(a: Cell | None, b: Cell | None) -> str:
    return f"{a / b:.3g}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "–"


def format_table(rows: Sequence[Row], device: torch.device) -> str:
    """Markdown: per row the times, and BPPSA's speedup over cuDNN and over the naive loop."""
    baseline = "cuDNN" if device.type == "cuda" else "torch.nn"
    settings = setting_cells(rows)
    head = ["model", "T", "B", "H", *settings]
    head += [c.replace("cuDNN", baseline) + " ms" for c in COLUMNS[:TIMES]]
    head += [f"{baseline} / BPPSA eager", "naive / BPPSA eager", f"{baseline} / BPPSA captured"]
    head += [f"{baseline} / BPPSA captured bwd"]
    head += [c.replace("cuDNN", baseline) for c in COLUMNS[TIMES:]]
    body = []
    for r in rows:
        c = r.cells
        cells = [r.model, str(r.steps), str(r.batch), str(r.hidden), *setting_cells(rows, r)]
        cells += [fmt_ms(c.get(k, "–")) for k in COLUMNS[:TIMES]]
        cells += [
            _ratio(c.get("cuDNN eager"), c.get("BPPSA eager")),
            _ratio(c.get("naive eager"), c.get("BPPSA eager")),
            _ratio(c.get("cuDNN captured"), c.get("BPPSA captured")),
            _ratio(c.get("cuDNN captured bwd"), c.get("BPPSA captured bwd")),
        ]
        cells += [f"{v:.3g}" if isinstance(v, float) else v for v in (c.get(k, "–") for k in COLUMNS[TIMES:])]
        body.append(cells)
    return markdown(head, body)


def format_kernels(rows: Sequence[Row]) -> str:
    """Markdown: per shape and side the ``KERNEL_ROWS`` kernels with the most GPU time in a backward,
    the others in one row, and all of them; "" where no row was profiled."""
    body = []
    for r in rows:
        for side, kernels in r.kernels.items():
            total = sum(us for _, us in kernels.values()) or 1.0
            listed = [(f"`{name}`", times) for name, times in list(kernels.items())[:KERNEL_ROWS]]
            rest = list(kernels.values())[KERNEL_ROWS:]
            if rest:
                listed.append((f"{len(rest)} others", (sum(n for n, _ in rest), sum(us for _, us in rest))))
            listed.append(("all", (sum(n for n, _ in kernels.values()), total)))
            shape = [str(r.steps), str(r.hidden), *setting_cells(rows, r), side]
            body += [[*shape, name, f"{n:.3g}", f"{us:.4g}", f"{us / total:.0%}"] for name, (n, us) in listed]
    if not body:
        return ""
    head = ["T", "H", *setting_cells(rows), "side"]
    return markdown([*head, "kernel", "launches", "µs", "share"], body)


LEGEND = (
    "'eager': the backward's wall-clock time (forward excluded); 'naive': the backward of a loop of "
    "torch.nn's cells; 'captured': GPU time of a whole training step (forward, backward, SGD step) "
    "replayed from a CUDA graph; 'captured bwd': GPU time of the backward alone, its graph replayed "
    "after the forward's; a ratio above 1 means BPPSA is faster; 'peak MiB': what the backward "
    "allocates beyond what was allocated before it."
)


KERNEL_LEGEND = (
    f"Each side's kernels and copies in one eager backward ({KERNEL_ROUNDS} profiled, averaged; "
    "the loss's own included), the most GPU time first: 'launches' per backward, 'µs' their GPU time, "
    "'share' of the side's; a captured backward replays the same kernels, its time above their sum "
    "the graph's gaps between them."
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad value ends the tool with one line and status 2."""
    p = parser("benchmarks.capture", __doc__)
    p.add_argument("--models", nargs="+", choices=tuple(MODULES), default=list(MODULES), help="models")
    p.add_argument("--T", type=positive_int, nargs="+", default=list(DEFAULT_T), help="sequence lengths")
    p.add_argument("--H", type=positive_int, nargs="+", default=list(DEFAULT_H), help="hidden sizes")
    p.add_argument("--B", type=positive_int, default=16, help="batch size")
    p.add_argument(
        "--naive-max-T", type=non_negative_int, default=1000, help="the longest T the naive loop runs"
    )
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed rounds (the median is shown)")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed rounds before them")
    p.add_argument(
        "--chunk", type=positive_int, default=None, help="the BPPSA modules' chunk (default: theirs)"
    )
    p.add_argument(
        "--kernels", action="store_true", help="also each backward's GPU time per kernel (CUDA only)"
    )
    p.add_argument(
        "--capture-error-mode",
        choices=("global", "thread_local", "relaxed"),
        default="global",
        help="torch.cuda.graph's capture_error_mode: which threads' unsafe CUDA calls fail a capture",
    )
    add_matmul_precision(p)
    add_walk_warps(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Print one table per model, each as soon as it is measured."""
    args = parse_args(argv)
    progress = Progress("capture")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(args.device))
    chunk = f"chunk {args.chunk}" if args.chunk else "the modules' chunk"
    timed = f"median of {args.repeats} after {args.warmup} warm-up rounds"
    print(f"float32, {timed}; loss on h_T; {chunk}\n\n{LEGEND}")
    for model in args.models:
        rows = []
        for hidden in args.H:
            for steps in args.T:
                for precision, walks in itertools.product(args.matmul_precision, args.walk_warps):
                    progress(f"{model} T={steps} H={hidden} {precision}, walk warps {walks} ...")
                    timing = (args.warmup, args.repeats, args.naive_max_T, args.capture_error_mode)
                    with matmul_precision(precision), walks_on(walks):
                        row = bench(
                            model, steps, args.B, hidden, args.device, *timing, chunk=args.chunk,
                            kernels=args.kernels,
                        )  # fmt: skip
                    row.walks = walks
                    rows.append(row)
        notes = notes_lines(rows)
        print(f"\n### {model.upper()}\n\n{format_table(rows, args.device)}", flush=True)
        if notes:
            print("\n" + "\n".join(notes), flush=True)
        kernels = format_kernels(rows)
        if kernels:
            head = f"#### {model.upper()}: where the backward's GPU time goes, per kernel"
            print(f"\n{head}\n\n{KERNEL_LEGEND}\n\n{kernels}", flush=True)
    progress("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.capture", main))
