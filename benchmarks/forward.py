"""Forward benchmark: the sequential forward, compiled or PyTorch's, and the Newton solves.

    python -m benchmarks.forward                       # RNN and GRU, T = 100 ... 100,000
    python -m benchmarks.forward --device cuda          # the same on a GPU
    python -m benchmarks.forward --quick                # seconds on a CPU
    python -m benchmarks.forward --tables compiled --models rnn gru lstm --H 20 64 256 --T 1000
    python -m benchmarks.forward --device cuda --weights init --T 10000 --matmul-precision highest high
    python -m benchmarks.forward --tables newton --sweeps   # and each solver from Picard sweeps
    python -m benchmarks.forward --device cuda --tables newton --T 10000 --walk-warps auto 1

Two tables per model and width. ``compiled`` (CPU, where numba is installed): torch.nn's training
forward against the module's with ``strategy="numba"`` (the recurrence compiled,
``bppsa_core.numba_forward``), their ratio, what ``strategy="auto"`` picks there, and the largest
difference of the outputs. ``newton``: for each weights and sequence length, the native forward's
time (the module's sequential forward: compiled on a CPU where "auto" picks it, else PyTorch's fused
kernel, cuDNN on a GPU) and, per solver (``forward_solver="newton"`` and ``"quasi-newton"``,
``bppsa_core.newton``), the iterations it took, its time, its ratio to the native time, and the
largest difference of its outputs from the native ones. Every method runs the training forward
(``--no-grad``: the inference forward) of the same module weights on the same batch, the methods
take turns (one call each per round), and each cell is the median of ``--repeats`` rounds after
``--warmup``, all in one process.

Models: the paper's RNN (bitstream, one input feature, H = 20), the GRU at the IRMAS setting m's
width (24 features, H = 20) and the LSTM at the GRU's (``--models lstm``). Weights: ``init``
(PyTorch's initialization) and ``trained`` (``--train-steps`` Adam steps of the bitstream task at
T = 100 through BPTT; the extra features are Gaussian noise). Newton's iterations grow as training
makes the recurrence less contractive, which is why both are measured. The input is a batch of the
same task at each T.

``--sweeps`` adds each solver started from Picard sweeps (``newton_guess="sweeps"``) as a method of
its own, taking turns with the rest; its "its" are the sweeps + the iterations.
``--matmul-precision`` times the ``newton`` rows under each of PyTorch's float32 matmul precisions
given: under "high" the scan kernels' products are three TF32 ones
(``bppsa_core.triton.launch.dot_precision``); ``--walk-warps`` under each count of warps given for
the kernels' walks (``bppsa_core.triton.launch.walk_warps``; "auto": their own).

Prints Markdown; progress goes to stderr. Imports nothing beyond torch, so it runs on a bare GPU
machine.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import (
    Progress,
    add_matmul_precision,
    add_walk_warps,
    device_arg,
    fmt_ms,
    machine_line,
    markdown,
    matmul_precision,
    non_negative_int,
    parser,
    positive_int,
    run_tool,
    setting_cells,
    threads_arg,
    walks_on,
)
from bppsa_core import dispatch
from bppsa_core import nn as bnn
from bppsa_core.newton import DEFAULT_MAX_ITERS, SOLVERS
from experiments.timing import time_ms

NEWTON = tuple(s for s in SOLVERS if s != "native")
MODELS = {"rnn": (bnn.RNN, 1), "gru": (bnn.GRU, 24), "lstm": (bnn.LSTM, 24)}  # class, input features
TABLES = ("compiled", "newton")
SWEEPS = " + sweeps"  # a solver's name started from Picard sweeps (--sweeps)
WEIGHTS = ("init", "trained")
CLASSES = 10
TRAIN_T = 100
TRAIN_LR = 3e-3
DEFAULT_T = (100, 1000, 10_000, 100_000)
QUICK = {"T": (30, 300), "B": 4, "H": 8, "train_steps": 20}


@dataclass
class Row:
    model: str
    weights: str
    steps: int
    batch: int
    hidden: int
    features: int
    native_ms: float
    precision: str = "highest"  # torch.get_float32_matmul_precision() while it was measured
    walks: str = "auto"  # the kernels' walk warps (--walk-warps)
    solver_ms: dict[str, float] = field(default_factory=dict)
    iterations: dict[str, int] = field(default_factory=dict)
    sweeps: dict[str, int] = field(default_factory=dict)
    converged: dict[str, bool] = field(default_factory=dict)
    max_diff: dict[str, float] = field(default_factory=dict)


def task_batch(steps: int, batch: int, features: int, device: torch.device, seed: int) -> tuple:
    """A batch of the bitstream task (B, T, features): the bits in feature 0, Gaussian noise in
    the rest; and its labels."""
    from benchmarks.backward import bitstream_batches  # torch-only, like this module

    x, y = bitstream_batches(steps, batch, batch, device, seed)[0]
    if features > 1:
        g = torch.Generator(device=device).manual_seed(seed)
        noise = torch.randn((*x.shape[:2], features - 1), generator=g, device=device)
        x = torch.cat((x, noise), -1)
    return x, y


def trained_state(
    model: str, features: int, hidden: int, batch: int, steps: int, device: torch.device, seed: int = 0
) -> tuple[dict, float, float]:
    """The layer's weights after ``steps`` Adam steps of the task at T = 100 (BPTT), and the first
    and last training losses."""
    from experiments.train import Classifier  # the suite's model (its imports need no hydra)

    cls = MODELS[model][0]
    torch.manual_seed(seed)
    net = Classifier(cls(features, hidden, batch_first=True, backward="bptt"), CLASSES).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=TRAIN_LR)
    losses = []
    for i in range(steps):
        x, y = task_batch(TRAIN_T, batch, features, device, seed + 1 + i)
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return net.rnn.state_dict(), losses[0], sum(losses[-10:]) / len(losses[-10:])


def take_turns(
    modules: dict[str, torch.nn.Module],
    x: Tensor,
    device: torch.device,
    warmup: int,
    repeats: int,
    grad: bool = True,
) -> tuple[dict[str, float], dict[str, Tensor]]:
    """Each module's median time (ms) over ``repeats`` rounds after ``warmup``, one call each per
    round, and its last outputs; ``grad`` False: every call under torch.no_grad (inference)."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    outputs = {}
    with torch.set_grad_enabled(grad):
        for r in range(warmup + repeats):
            for name, m in modules.items():
                ms = time_ms(lambda m=m, name=name: outputs.__setitem__(name, m(x)[0]), device)
                if r >= warmup:
                    times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def bench(
    model: str,
    weights: dict,
    label: str,
    steps: int,
    batch: int,
    hidden: int,
    device: torch.device,
    dtype: torch.dtype,
    solvers: Sequence[str],
    warmup: int,
    repeats: int,
    max_iters: int,
    grad: bool = True,
) -> Row:
    """One row: the native forward and each solver's, taking turns on the same batch (``grad``
    False: under torch.no_grad), under PyTorch's float32 matmul precision as it is set."""
    cls, features = MODELS[model][0], weights["weight_ih_l0"].shape[1]
    x = task_batch(steps, batch, features, device, seed=10_000)[0].to(dtype)
    modules = {}
    for name in ("native", *solvers):
        m = cls(
            features, hidden, batch_first=True, forward_solver=name.removesuffix(SWEEPS),
            newton_iters=max_iters, newton_guess="sweeps" if name.endswith(SWEEPS) else "zeros",
        )  # fmt: skip
        m.load_state_dict(weights)
        modules[name] = m.to(device, dtype)
    times, outputs = take_turns(modules, x, device, warmup, repeats, grad)
    precision = torch.get_float32_matmul_precision()
    row = Row(model, label, steps, batch, hidden, features, times["native"], precision)
    for name in solvers:
        (stats,) = modules[name].solver_stats
        row.solver_ms[name] = times[name]
        row.iterations[name] = stats.iterations
        row.sweeps[name] = stats.sweeps
        row.converged[name] = stats.converged
        row.max_diff[name] = (outputs[name] - outputs["native"]).abs().max().item()
    return row


@dataclass
class CompiledRow:
    model: str
    steps: int
    batch: int
    hidden: int
    torch_ms: float
    fused_ms: float
    compiled_ms: float
    auto: str
    max_diff: float
    projection: str = ""  # where the compiled forward projects the inputs: "step" or "host"
    other_ms: float | None = None  # the compiled forward with the projection on the other side


class OtherProjection(torch.nn.Module):
    """A module whose compiled forward projects its inputs on the other side of
    ``numba_forward.PROJECT_IN_STEP_MAX_BYTES``: in the kernels' steps where the bound puts them on
    the host as one GEMM a segment, and the reverse (``--other-projection``)."""

    def __init__(self, inner: torch.nn.Module, projection: str) -> None:
        super().__init__()
        self.inner, self.projection = inner, projection

    def forward(self, x: Tensor):
        from bppsa_core import numba_forward

        bound = numba_forward.PROJECT_IN_STEP_MAX_BYTES
        numba_forward.PROJECT_IN_STEP_MAX_BYTES = -1 if self.projection == "step" else 1 << 62
        try:
            return self.inner(x)
        finally:
            numba_forward.PROJECT_IN_STEP_MAX_BYTES = bound


def bench_compiled(
    model: str,
    features: int,
    steps: int,
    batch: int,
    hidden: int,
    dtype: torch.dtype,
    warmup: int,
    repeats: int,
    grad: bool = True,
    other_projection: bool = False,
) -> CompiledRow:
    """One row of the compiled table: torch.nn's training forward, ours with PyTorch's fused kernel
    (``strategy="sequential"``: the kernel under no_grad, what "auto" would run instead) and ours
    with the recurrence compiled (``strategy="numba"``; a GRU's or an LSTM's keeps its gates for the
    backward),
    the same weights and batch, taking turns; ``grad`` False: their inference forwards;
    ``other_projection``: also ours compiled with the inputs' projection on the other side of its
    bound (``OtherProjection``)."""
    cls = MODELS[model][0]
    x = task_batch(steps, batch, features, torch.device("cpu"), seed=10_000)[0].to(dtype)
    torch.manual_seed(0)
    ours = cls(features, hidden, batch_first=True, strategy="numba").to(dtype)
    fused = cls(features, hidden, batch_first=True, strategy="sequential").to(dtype)
    ref = getattr(torch.nn, cls.__name__)(features, hidden, batch_first=True).to(dtype)
    ref.load_state_dict(ours.state_dict())
    fused.load_state_dict(ours.state_dict())
    modules = {"torch": ref, "fused": fused, "compiled": ours}
    from bppsa_core.numba_forward import projects_in_step  # numba: the compiled table's

    projection = "step" if projects_in_step(ours.weight_ih_l0) else "host"
    if other_projection:
        modules["other"] = OtherProjection(ours, projection)
    times, outputs = take_turns(modules, x, torch.device("cpu"), warmup, repeats, grad)
    if dispatch.torch_nn_instead("auto", ours.mode, hidden, x.device, dtype, inference=not grad):
        auto = "torch.nn"
    else:
        compiled = dispatch.compiled_forward("auto", ours.mode, hidden, x, taped=grad)
        auto = "compiled" if compiled else "PyTorch's"
    return CompiledRow(
        model, steps, batch, hidden,
        *(times[name] for name in ("torch", "fused", "compiled")),
        auto, (outputs["torch"] - outputs["compiled"]).abs().max().item(), projection, times.get("other"),
    )  # fmt: skip


def format_compiled(rows: Sequence[CompiledRow]) -> str:
    head = ["model", "T", "B", "H", "torch.nn ms", "fused ms", "compiled ms", "compiled / torch.nn",
            "compiled / fused", "auto", "max diff"]  # fmt: skip
    body = [
        [r.model, str(r.steps), str(r.batch), str(r.hidden), fmt_ms(r.torch_ms), fmt_ms(r.fused_ms),
         fmt_ms(r.compiled_ms), f"{r.compiled_ms / r.torch_ms:.3g}", f"{r.compiled_ms / r.fused_ms:.3g}",
         r.auto, f"{r.max_diff:.1e}"]
        for r in rows
    ]  # fmt: skip
    if any(r.other_ms is not None for r in rows):
        head += ["projected", "other side ms", "compiled / other side"]
        for r, cells in zip(rows, body, strict=True):
            other = [fmt_ms(r.other_ms), f"{r.compiled_ms / r.other_ms:.3g}"] if r.other_ms else ["", ""]
            cells += [r.projection, *other]
    return markdown(head, body)


COMPILED_LEGEND = (
    "Training forward of one layer (the module call; torch.nn's records for its backward, ours "
    "records nothing: its backward is BPPSA's, a GRU's or an LSTM's compiled one keeping its gates for it; "
    "with --no-grad every forward is inference, and keeps none); 'fused': ours with PyTorch's fused kernel; "
    "'compiled': ours with the recurrence compiled; a ratio < 1 means the compiled forward is faster; "
    "'auto': the forward strategy='auto' takes there (the compiled one where it beats the fused "
    "kernel; torch.nn where auto leaves the whole module to torch.nn); 'max diff': the largest "
    "absolute difference of the compiled outputs from torch.nn's; with --other-projection, 'projected': "
    "where the compiled forward projects the inputs (in its steps, or on the host as one GEMM a segment: "
    "numba_forward.PROJECT_IN_STEP_MAX_BYTES), 'other side': it with the projection on the other side."
)


def format_table(rows: Sequence[Row], solvers: Sequence[str]) -> str:
    """Markdown: native time, and per solver its iterations, time, ratio to native and difference."""
    head = ["model", "weights", "T", "B", "H", "F", *setting_cells(rows)]
    head.append("native ms")
    for s in solvers:
        head += [f"{s} its", f"{s} ms", f"{s} / native", f"{s} max diff"]
    body = []
    for r in rows:
        cells = [r.model, r.weights, str(r.steps), str(r.batch), str(r.hidden), str(r.features)]
        cells += [*setting_cells(rows, r), fmt_ms(r.native_ms)]
        for s in solvers:
            its = (f"{r.sweeps[s]} + " if r.sweeps.get(s) else "") + str(r.iterations[s])
            its += "" if r.converged[s] else " (fallback)"
            ratio = r.solver_ms[s] / r.native_ms
            cells += [its, fmt_ms(r.solver_ms[s]), f"{ratio:.3g}", f"{r.max_diff[s]:.1e}"]
        body.append(cells)
    return markdown(head, body)


LEGEND = (
    "Training forward of one layer (the module call); 'its': Newton iterations to convergence ('S + "
    "N': S Picard sweeps, then N iterations), '(fallback)': not converged within --max-iters, so the "
    "time includes the native forward run after them; '/ native' < 1 means the solver is faster; "
    "'max diff': the largest absolute difference of the outputs from the native forward's."
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad value ends the tool with one line and status 2."""
    p = parser("benchmarks.forward", __doc__)
    p.add_argument("--tables", nargs="+", choices=TABLES, default=None, help="tables (default: the device's)")
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["rnn", "gru"], help="models")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS), help="weights to time")
    p.add_argument("--solvers", nargs="+", choices=NEWTON, default=list(NEWTON), help="solvers to time")
    p.add_argument("--T", type=positive_int, nargs="+", default=None, help=f"lengths (default: {DEFAULT_T})")
    p.add_argument("--B", type=positive_int, default=None, help="batch size (default: 16)")
    p.add_argument("--H", type=positive_int, nargs="+", default=None, help="hidden sizes (default: 20)")
    p.add_argument(
        "--F", type=positive_int, nargs="+", default=None,
        help="input features (default: the model's, 1 for rnn and 24 for gru and lstm)",
    )  # fmt: skip
    p.add_argument("--train-steps", type=positive_int, default=None, help="Adam steps (default: 300)")
    p.add_argument("--max-iters", type=positive_int, default=DEFAULT_MAX_ITERS, help="newton_iters")
    p.add_argument("--quick", action="store_true", help="small shapes, seconds on a CPU")
    p.add_argument("--no-grad", action="store_true", help="time inference: every forward under torch.no_grad")
    p.add_argument(
        "--other-projection", action="store_true",
        help="compiled table: also time the compiled forward with the inputs projected on the other side "
        "of its bound (in the steps or on the host)",
    )  # fmt: skip
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (the median is shown)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed rounds before them")
    p.add_argument(
        "--sweeps", action="store_true",
        help="also each solver started from Picard sweeps (newton_guess='sweeps'), taking turns",
    )  # fmt: skip
    add_matmul_precision(p)
    add_walk_warps(p)
    args = p.parse_args(argv)
    args.methods = [*args.solvers, *(s + SWEEPS for s in args.solvers if args.sweeps)]
    cpu = args.device.type == "cpu"
    compiled = cpu and dispatch.numba_installed()  # the compiled table's forward is numba's
    need_numba = "the numba package (pip install numba)"
    args.left_out = None
    if args.tables is None:
        args.tables = list(TABLES) if compiled else ["newton"]
        if cpu and not compiled:
            args.left_out = f"the compiled table, which needs {need_numba}"
    elif "compiled" in args.tables and not cpu:
        p.error(f"--tables compiled runs on the CPU, not on {args.device}; accepted there: newton")
    elif "compiled" in args.tables and not compiled:
        p.error(f"--tables compiled needs {need_numba}, which is not installed; accepted here: newton")
    size = QUICK if args.quick else {"T": DEFAULT_T, "B": 16, "H": 20, "train_steps": 300}
    args.T = args.T or list(size["T"])
    args.B, args.H = args.B or size["B"], args.H or [size["H"]]
    args.train_steps = size["train_steps"] if args.train_steps is None else args.train_steps
    return args


def newton_table(
    model: str,
    features: int,
    hidden: int,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    progress,
) -> None:
    """The native forward against each Newton solver, per weights and length: one table."""
    cls = MODELS[model][0]
    states = {}
    if "init" in args.weights:
        torch.manual_seed(0)
        states["init"] = cls(features, hidden).state_dict()
    if "trained" in args.weights:
        progress(f"training {model} for {args.train_steps} steps ...")
        state, first, last = trained_state(model, features, hidden, args.B, args.train_steps, device)
        states["trained"] = state
        print(f"\n{model}: training loss {first:.4f} at the first step, {last:.4f} over the last ten")
    rows = []
    timing = (args.warmup, args.repeats, args.max_iters, not args.no_grad)
    for label, state in states.items():
        for t in args.T:
            for precision, walks in itertools.product(args.matmul_precision, args.walk_warps):
                progress(f"{model} {label} T={t} {precision}, walk warps {walks} ...")
                with matmul_precision(precision), walks_on(walks):
                    shape = (t, args.B, hidden, device, dtype)
                    row = bench(model, state, label, *shape, args.methods, *timing)
                row.walks = walks
                rows.append(row)
    title = f"{model.upper()} (F = {features}, B = {args.B}, H = {hidden})"
    print(f"\n### Forward: {title}\n\n{format_table(rows, args.methods)}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Print one table per model, each as soon as it is measured."""
    args = parse_args(argv)
    progress = Progress("forward")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    print(machine_line(device))
    print(
        f"{args.dtype}, median of {args.repeats} after {args.warmup} warm-up rounds; newton_iters "
        f"{args.max_iters}; trained: {args.train_steps} Adam steps (lr {TRAIN_LR:g}) at T = {TRAIN_T}"
    )
    if args.left_out:
        print(f"left out: {args.left_out}")
    if "compiled" in args.tables:
        print(f"\n{COMPILED_LEGEND}")
        for model in args.models:
            for features in args.F or [MODELS[model][1]]:
                rows = []
                for hidden in args.H:
                    for t in args.T:
                        progress(f"{model} compiled F={features} H={hidden} T={t} ...")
                        timing = (dtype, args.warmup, args.repeats, not args.no_grad, args.other_projection)
                        rows.append(bench_compiled(model, features, t, args.B, hidden, *timing))
                print(
                    f"\n### Compiled forward: {model.upper()} (F = {features})\n\n{format_compiled(rows)}",
                    flush=True,
                )
    if "newton" in args.tables:
        print(f"\n{LEGEND}")
        for model in args.models:
            for features in args.F or [MODELS[model][1]]:
                for hidden in args.H:
                    newton_table(model, features, hidden, args, device, dtype, progress)
    progress("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.forward", main))
