"""A recurrent layer's forward solved parallel in time: Newton's method on the recurrence.

The forward ``h_t = f(x_t, h_{t-1})`` is T dependent steps. Taken as one system of T equations in
the states h_1..h_T, it is solved by Newton's method (DEER: Lim et al., ICLR 2024). From a guess of
every state, the cell runs at every step at once (one large GEMM, ``Cell.step``), giving the
residual ``r_t = f(x_t, h_{t-1}) - h_t``, and the linearised system is solved for the correction:

    d_t = J_t d_{t-1} + r_t,   d_0 = 0,   J_t = df/dh_{t-1} at the guess,

the affine recurrence the backward scans, run forward in time (``scan.forward_scan`` over the cell's
factored, transposed Jacobians: nothing of size T·H² is ever stored, whatever the cell). The new
guess is h + d. Each iteration is therefore one cell evaluation and one scan: Θ(log T) dependent
steps with the parallel strategies.

``quasi-newton`` keeps only the Jacobians' diagonals (quasi-DEER, Gonzalez et al., 2024): each solve
is an elementwise recurrence (``scan.elementwise_recurrence``), H times less work than a full
scan, for more iterations (it converges linearly, Newton quadratically near the solution).

Both are exact at their fixed point, and both make the first k states exact after k iterations (the
first wrong step's residual is corrected exactly), so T + 1 iterations always suffice in exact
arithmetic. Far from the solution, though, a linearised solve over many steps of a recurrence that
is not contractive (a trained RNN) multiplies its corrections by long products of Jacobians and
overflows to inf and NaN: plain DEER diverges there. So a correction that is not a number is
dropped, and every iterate is projected onto the box the cell's states provably lie in
(``Cell.bounds``: tanh's [-1, 1], a GRU's convex combinations, an LSTM's |c_t| <= |c_0| + T). Both
are inactive at the solution, so the fixed point and the first-k-exact property are unchanged, and
a trained model's solve converges where the plain one stops at NaN (re-measured by
``python -m benchmarks.forward --weights trained``).

Iterations stop when the error estimate of the last change, ``max |h_new - h|``, is at most
``tol * max(1, max |h|)``. Both estimates read the observed rate ``change / previous change``. For
Newton it is ``change * rate / (1 - rate)`` while the rate is under 1/2: the rest of a geometric
series at that rate, which over-states a quadratic convergence's error (its rate falls), so a
solve stops once its change is small against the one before, not one iteration later, when the
change itself is under the tolerance (an RNN at PyTorch's initial weights: 3 iterations, not 4;
re-measured by ``python -m benchmarks.forward --tables newton``); the first iteration, with no
rate, and a change that is not shrinking count the change itself. For quasi-Newton (linear) it is
``max(change, change * rate / (1 - rate))``. ``tol`` defaults by dtype (``DEFAULT_TOL``). A solve
that reaches ``max_iters`` without converging, or whose change is not finite, reports
``converged=False``; the layer then runs the native sequential forward instead
(``bppsa_core.layer.solved_forward``), so a state is never silently wrong.

Picard sweeps (``newton_guess="sweeps"``, ``SolverOptions.sweeps``) make the first iterate: each
runs the cell at every step at once from the last states, s_t <- f(x_t, s_{t-1}), as an iteration
does without its scan, so it costs a cell evaluation (on a GPU two launches and one GEMM) where an
iteration adds an H x H scan. Where the recurrence contracts (a model at initialization) each sweep
shrinks the error by the contraction factor, and Newton's method then starts near its solution:
fewer of its iterations, or one to confirm sweeps that converged by quasi-Newton's rule. Sweeps
stop at ``sweeps``, or once one shrinks the change by less than ``SWEEP_RATE``: where the
recurrence does not contract (a trained RNN) they would carry the iterate away from the solution.

The stopping rule runs on the device (``_Watch``): the host never waits on an iteration it has just
queued. On a GPU it reads the flag of the iteration ``LOOKAHEAD`` before the one it has queued, so
the device always has work while the host decides, and an iterate stops changing once its flag is
set: the iterations queued past it leave it as it was, and the result is the one a check after
every iteration gives. Inside a CUDA graph capture the host reads nothing: see ``solve``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from bppsa_core import dispatch
from bppsa_core.dispatch import ScanOptions
from bppsa_core.jacobians import Cell, LayerWeights
from bppsa_core.scan import elementwise_recurrence, forward_scan

SOLVERS: tuple[str, ...] = ("native", "newton", "quasi-newton")
# Largest change, relative to max(1, max |h|), at which the iterations stop.
DEFAULT_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DEFAULT_MAX_ITERS = 100
# Picard sweeps before Newton's iterations (newton_guess="sweeps"): at most MAX_SWEEPS (a GPU sweep's
# four launches are host time; a few leave Newton an iteration fewer), stopped once one shrinks the
# change by less than SWEEP_RATE (both re-measured by python -m benchmarks.forward --sweeps)
MAX_SWEEPS = 4
SWEEP_RATE = 0.75


@dataclass(frozen=True)
class SolverOptions:
    """How a layer's forward is computed: ``method`` one of ``SOLVERS`` ("native": PyTorch's fused
    sequential kernel); for the Newton methods, the tolerance (None: ``DEFAULT_TOL`` of the dtype)
    and the most iterations before the native fallback; ``sweeps``, the most Picard sweeps that
    make the first iterate (0: none)."""

    method: str = "native"
    tol: float | None = None
    max_iters: int = DEFAULT_MAX_ITERS
    sweeps: int = 0

    def __post_init__(self) -> None:
        if self.method not in SOLVERS:
            raise ValueError(f"unknown forward_solver {self.method!r}; accepted: {', '.join(SOLVERS)}")
        tol = self.tol
        ok = tol is None or (isinstance(tol, int | float) and not isinstance(tol, bool) and 0 < tol < 1)
        if not ok or (tol is not None and not math.isfinite(tol)):
            raise ValueError(f"newton_tol must be a number in (0, 1) or None, got {tol!r}")
        if not dispatch.is_count(self.max_iters, 1):
            raise ValueError(f"newton_iters must be a positive integer, got {self.max_iters!r}")
        if not dispatch.is_count(self.sweeps, 0):
            raise ValueError(f"sweeps must be a non-negative integer, got {self.sweeps!r}")

    def tolerance(self, dtype: torch.dtype) -> float:
        """The tolerance for states of ``dtype``."""
        return self.tol if self.tol is not None else DEFAULT_TOL.get(dtype, torch.finfo(dtype).eps ** 0.75)


@dataclass(frozen=True)
class SolveStats:
    """What one layer's forward took: Newton iterations (0 for the native forward), whether they
    converged (False: the native forward was run instead), the last iteration's largest change, and
    the Picard sweeps before them."""

    iterations: int
    converged: bool
    change: float
    sweeps: int = 0

    def as_tensor(self, device: torch.device | None = None) -> Tensor:
        """(iterations, converged, change, sweeps) as a float64 tensor, on the CPU or on ``device``. A GPU's
        copy of the native forward's is made by device ops, never copied from the host, so a
        compiled graph that returns it can be captured in a CUDA graph."""
        if device is None or device.type == "cpu":
            if self is NATIVE:  # every native forward's: a copy, cheaper than a tensor from a list
                return _NATIVE_TENSOR.clone()
            values = [self.iterations, float(self.converged), self.change, self.sweeps]
            return torch.tensor(values, dtype=torch.float64)
        if self is NATIVE:
            return on_device((0.0, 1.0, 0.0, 0.0), device)
        return self.as_tensor().to(device)

    @classmethod
    def from_tensor(cls, t: Tensor) -> SolveStats:
        iterations, converged, change, sweeps = t.tolist()
        return cls(int(iterations), bool(converged), change, int(sweeps))


NATIVE = SolveStats(0, True, 0.0)
_NATIVE_TENSOR = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)


def on_device(values: tuple[float, ...], device: torch.device) -> Tensor:
    """``values`` as a new float64 tensor made on ``device`` by fills, never copied from the host
    (a CUDA graph captures no host copy of unpinned memory), and kept by nothing here (a tensor
    cached across calls would outlive the memory pool of inductor's CUDA graphs, which refuse it)."""
    t = torch.zeros(len(values), dtype=torch.float64, device=device)
    for i, value in enumerate(values):
        if value != 0.0:
            t[i].fill_(value)
    return t


def solve(
    cell: Cell,
    x: Tensor,
    s0: Tensor,
    w: LayerWeights,
    keep: Tensor | None,
    options: SolverOptions,
    scan_options: ScanOptions,
    guess: Tensor | None = None,
) -> tuple[Tensor, SolveStats | Tensor]:
    """The states s_1..s_T (T, B, S) of ``cell`` over x (T, B, I) from s_0 (B, S) by ``options.method``.

    ``keep`` (T, B, 1; 0 past a sequence's end) carries the state past each sequence's end; ``guess``
    (T, B, S), the first iterate (None: zeros), from which ``options.sweeps`` Picard sweeps start.
    Builds no autograd graph. The returned states are the last iterate: use them only when the
    stats say ``converged``.

    Inside a CUDA graph capture (a whole step captured) the host can decide nothing: the solve runs
    ``options.max_iters`` iterations in the Triton kernels (those past the stop do nothing), then,
    where it has not converged, the native forward in a kernel too (``FusedIteration.fall_back``),
    so the returned states are right either way, and the stats are a tensor on the device
    (``SolveStats.as_tensor``'s layout) that each replay rewrites. Only a layer ``FusedIteration``
    takes can be captured so (a tanh/relu RNN or a GRU, Newton's method, float32, the Triton
    kernels' widths, no packed sequences); any other is refused by name.
    """
    if options.method not in ("newton", "quasi-newton"):
        raise ValueError(f"solve() runs the Newton methods; got forward_solver {options.method!r}")
    kernels = _kernels_run(scan_options.strategy, x, s0, w)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        from bppsa_core.triton import newton as newton_kernels

        if not (kernels and newton_kernels.takes(cell, options.method, keep, w)):
            raise RuntimeError(
                f"forward_solver={options.method!r} is captured in a CUDA graph only for a tanh/relu RNN "
                f"or a GRU with Newton's method, float32, H <= {dispatch.MAX_HIDDEN}, no packed sequences "
                "and strategy 'auto' or 'triton' (its iterations and fallback then run on the device); "
                "capture this layer with forward_solver='native'"
            )
        return _solve(cell, x, s0, w, keep, options, scan_options, guess, kernels=True, captured=True)
    if not kernels:
        return _solve(cell, x, s0, w, keep, options, scan_options, guess, kernels=False)
    return dispatch.with_kernels(
        scan_options.strategy,
        x.device,
        lambda: _solve(cell, x, s0, w, keep, options, scan_options, guess, kernels=True),
        lambda: _solve(cell, x, s0, w, keep, options, scan_options, guess, kernels=False),
    )


def _kernels_run(strategy: str, x: Tensor, s0: Tensor, w: LayerWeights) -> bool:
    """Whether a solve's iterations end in the Triton kernels (``bppsa_core.triton.newton``): the
    strategy "triton" where they run, or "auto" on a GPU where they work, with float32 tensors."""
    tensors = (x, s0, *(t for t in vars(w).values() if t is not None))
    if any(t.dtype != torch.float32 for t in tensors) or not dispatch.triton_installed():
        return False
    if strategy == "triton":
        return dispatch.runs_on("triton", x.device)
    return strategy == "auto" and dispatch.kernels_usable(x.device)


def _solve(
    cell: Cell,
    x: Tensor,
    s0: Tensor,
    w: LayerWeights,
    keep: Tensor | None,
    options: SolverOptions,
    scan_options: ScanOptions,
    guess: Tensor | None,
    kernels: bool,
    captured: bool = False,
) -> tuple[Tensor, SolveStats | Tensor]:
    """``solve``; ``kernels``: each iteration ends in the Triton kernels, and a tanh/relu RNN's or
    GRU's Newton iteration runs in them whole (``triton.newton.FusedIteration``); ``captured``: no
    host read (every iteration queued, then the fallback on the device, the stats a tensor there)."""
    steps = x.shape[0]
    quasi = options.method == "quasi-newton"
    with torch.no_grad():
        lo, hi = cell.bounds(s0, steps)
        states = s0.new_empty((steps + 1, *s0.shape))  # s_0 .. s_T: the previous states are a view
        states[0] = s0
        s, prev = states[1:], states[:-1]
        if guess is None:
            s.zero_()
        else:
            s.copy_(guess)
        s.clamp_(lo, hi)
        zero = torch.zeros_like(s0)
        watch = _Watch(options.tolerance(x.dtype), x.device)
        fused = None
        if kernels:
            from bppsa_core.triton import diagonal as diagonal_kernels
            from bppsa_core.triton import newton as newton_kernels

            if newton_kernels.takes(cell, options.method, keep, w):
                chunk = scan_options.chunk
                fused = newton_kernels.FusedIteration(cell, x, w, states, lo, hi, watch.record, chunk)
            else:  # the update's scratch, made once for every iteration
                partial = newton_kernels.update_partials(s)
        if options.sweeps:
            sweeping = _Watch(options.tolerance(x.dtype), x.device)  # the sweeps' own record
            for _ in range(options.sweeps):
                if fused is not None:
                    fused.sweep(sweeping.record)
                elif kernels:  # the update does nothing once the sweeps' record says stopped
                    d = cell.step(x, prev, w, keep)[0].sub_(s)
                    newton_kernels.newton_update(s, d, lo, hi, sweeping.record, False, False, partial, True)
                else:
                    sweep(cell, x, states, w, keep, lo, hi, sweeping.record, sweeping.lookahead > 0)
                if not captured and sweeping.stopped():
                    break
            watch.record[SWEPT].copy_(sweeping.record[ITERATIONS])
        for _ in range(options.max_iters):
            if fused is not None:
                fused()
            else:
                new, factors = cell.step(x, prev, w, keep)
                residual = new.sub_(s)
                if quasi:
                    a = cell.chain(factors, w).diagonals()
                    if kernels:  # three launches, nothing done once the record says stopped
                        d = diagonal_kernels.diagonal_recurrence(a, residual, zero, stop=watch.record)
                    else:
                        d = elementwise_recurrence(a.expand_as(residual), residual, zero)
                else:
                    d = forward_scan(cell.tangent_chain(factors, w), zero, residual, scan_options)[1:]
                if kernels:
                    d = d.contiguous()
                    newton_kernels.newton_update(s, d, lo, hi, watch.record, quasi, False, partial)
                else:  # read at once (lookahead 0): every iteration run counts, none to freeze
                    update(s, d, lo, hi, watch.record, quasi, freeze=watch.lookahead > 0)
            if not captured and watch.stopped():
                break
        if fused is not None:  # eagerly too, where it returns at once: compiled before any capture
            fused.fall_back()
        if captured:
            return s, watch.record[ITERATIONS : SWEPT + 1].clone()  # SolveStats.as_tensor's layout
        return s, watch.stats()


# The stopping rule's record, float64 on the device: its entries (SWEPT: the Picard sweeps before
# the iterations, a count the rule leaves as it is).
STOPPED, ITERATIONS, CONVERGED, CHANGE, SWEPT, LAST, TOL = range(7)


def judge(record: Tensor, change: Tensor, size: Tensor, quasi: bool, sweep: bool = False) -> Tensor:
    """The stopping rule on one iteration's largest change and largest |state| (0-d tensors, a NaN
    counted as infinite), written into ``record`` unless it says stopped; returns whether it did not
    (a 0-d bool tensor: the iteration counts). Stop when the error estimate, at the rate change /
    last change, is at most tol max(1, max |s|), or when the change is not finite: change min(1,
    rate / (1 - rate)) for Newton (the change itself at the first iteration, whose last change is
    infinite), max(change, change rate / (1 - rate)) for quasi-Newton (``quasi``) and for Picard
    sweeps (``sweep``: they too converge linearly), which also stop at a rate above ``SWEEP_RATE``."""
    stopped, iterations, _, _, sweeps, last, tol = record.unbind()
    change, size = (torch.where(t.isnan(), math.inf, t.to(torch.float64)) for t in (change, size))
    if quasi or sweep:  # linear convergence: the error left is change * rate / (1 - rate)
        rate = torch.where(last > 0, change / last, 0.0)
        error = torch.where(rate < 1, torch.maximum(change, change * rate / (1 - rate)), math.inf)
    else:  # the geometric rest at the observed rate, which a quadratic convergence's undercuts
        known = (last > 0) & last.isfinite()
        rate = torch.where(known, change / torch.where(known, last, 1.0), 1.0).clamp(max=0.5)
        error = change * (rate / (1 - rate))  # the change itself from the rate 1/2 up
    finite = change.isfinite()
    converged = finite & ((error <= tol) | (error <= tol * size))  # tol * max(1, max |s|)
    active = stopped == 0
    stop = converged | ~finite
    if sweep:  # a sweep that hardly shrinks the change: the recurrence is not contracting
        stop = stop | (rate > SWEEP_RATE)
    judged = torch.stack((stop.double(), iterations + 1, converged.double(), change, sweeps, change, tol))
    torch.where(active, judged, record, out=record)
    return active


def update(
    s: Tensor,
    d: Tensor,
    lo: Tensor,
    hi: Tensor,
    record: Tensor,
    quasi: bool,
    freeze: bool = True,
    sweep: bool = False,
) -> None:
    """s <- clamp(s + d, lo, hi), a correction that is not a number dropped (``torch.nan_to_num``),
    and the stopping rule (``judge``; ``sweep``: a Picard sweep's) into ``record``; ``freeze``: s
    left as it was once the record says stopped (False where the caller never runs past the stop)."""
    new = d.nan_to_num(nan=0.0).add_(s).clamp_(lo, hi)  # the projected iterate
    active = judge(record, _max_abs(new - s), _max_abs(new), quasi, sweep)
    if freeze:
        torch.where(active, new, s, out=s)
    else:
        s.copy_(new)


def sweep(
    cell: Cell,
    x: Tensor,
    states: Tensor,
    w: LayerWeights,
    keep: Tensor | None,
    lo: Tensor,
    hi: Tensor,
    record: Tensor,
    freeze: bool = True,
) -> None:
    """One Picard sweep: s_t <- clamp(f(x_t, s_{t-1}), lo, hi) at every step at once, from the states
    (T + 1, B, S) with s_0, updated in place, and the sweeps' rule (``judge``) into ``record``;
    ``freeze`` as ``update``'s."""
    s = states[1:]
    update(s, cell.step(x, states[:-1], w, keep)[0].sub_(s), lo, hi, record, False, freeze, sweep=True)


# How many iterations the host queues past the one whose convergence flag it reads, by device type
# (others: the GPU's): a GPU keeps one iteration of work while the host waits for the flag
# (``benchmarks.forward --tables newton`` times it); a CPU computes as it queues, so it reads at once.
LOOKAHEAD = {"cpu": 0, "cuda": 1}


class _Watch:
    """The stopping rule's record (``judge``: stopped, iterations, converged, change, sweeps, last
    change, tol) on the device, which each iteration updates while it says running; the host reads its flag
    ``lookahead`` iterations late (``LOOKAHEAD``) through pinned memory, so it never waits on an
    iteration it has just queued."""

    def __init__(self, tol: float, device: torch.device) -> None:
        self.record = on_device((0.0, 0.0, 0.0, math.nan, 0.0, math.inf, tol), device)  # capturable
        self.lookahead = LOOKAHEAD.get(device.type, LOOKAHEAD["cuda"])
        # the host's copies of the flag: made at the first read (a captured solve reads none, and
        # pinned memory is not made inside a capture)
        self._flags: list[Tensor] = []
        self._events: list[torch.cuda.Event] | None = None
        self._checks = 0

    def _ring(self) -> None:
        """lookahead + 1 host copies of the flag (pinned on a GPU), each with the event of its copy:
        a slot is written again only after it has been read, and none is made per iteration."""
        cuda = self.record.is_cuda
        ring = torch.empty(self.lookahead + 1, dtype=torch.float64, pin_memory=cuda)
        self._flags = list(ring.unbind())
        self._events = [torch.cuda.Event() for _ in self._flags] if cuda else None

    def stopped(self) -> bool:
        """Whether the rule had stopped ``lookahead`` iterations ago (False before that many)."""
        if not self._flags:
            self._ring()
        n, self._checks = self._checks, self._checks + 1
        slot = n % len(self._flags)
        self._flags[slot].copy_(self.record[STOPPED], non_blocking=True)  # as the stream reaches it
        if self._events is not None:
            self._events[slot].record()
        if n < self.lookahead:
            return False
        read = (n - self.lookahead) % len(self._flags)
        if self._events is not None:
            self._events[read].synchronize()
        return bool(self._flags[read])

    def stats(self) -> SolveStats:
        """What the solve took, from the record (one read)."""
        _, iterations, converged, change, sweeps, _, _ = self.record.tolist()
        return SolveStats(int(iterations), bool(converged), change, int(sweeps))


def _max_abs(t: Tensor) -> Tensor:
    """max |t| as a 0-d tensor on t's device (NaN if any is), 0 for an empty t."""
    return t.abs().amax() if t.numel() else t.new_zeros(())
