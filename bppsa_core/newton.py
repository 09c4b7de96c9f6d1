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
(``Cell.bounds``: tanh's [-1, 1], a GRU's convex combinations, an LSTM's |c_t| <= |c_0| + t). Both
are inactive at the solution, so the fixed point and the first-k-exact property are unchanged, and
a trained model's solve converges where the plain one stops at NaN (re-measured by
``python -m benchmarks.forward --weights trained``).

Iterations stop when the error estimate of the last change, ``max |h_new - h|``, is at most
``tol * max(1, max |h|)``: the change itself for Newton (quadratic: the error left is far smaller),
``change * rate / (1 - rate)`` for quasi-Newton (linear, at the observed rate ``change /
previous change``). ``tol`` defaults by dtype (``DEFAULT_TOL``). A solve that reaches ``max_iters``
without converging, or whose change is not finite, reports ``converged=False``; the layer then runs
the native sequential forward instead (``bppsa_core.layer.solved_forward``), so a state is never
silently wrong.
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


@dataclass(frozen=True)
class SolverOptions:
    """How a layer's forward is computed: ``method`` one of ``SOLVERS`` ("native": PyTorch's fused
    sequential kernel); for the Newton methods, the tolerance (None: ``DEFAULT_TOL`` of the dtype)
    and the most iterations before the native fallback."""

    method: str = "native"
    tol: float | None = None
    max_iters: int = DEFAULT_MAX_ITERS

    def __post_init__(self) -> None:
        if self.method not in SOLVERS:
            raise ValueError(f"unknown forward_solver {self.method!r}; accepted: {', '.join(SOLVERS)}")
        tol = self.tol
        ok = tol is None or (isinstance(tol, int | float) and not isinstance(tol, bool) and 0 < tol < 1)
        if not ok or (tol is not None and not math.isfinite(tol)):
            raise ValueError(f"newton_tol must be a number in (0, 1) or None, got {tol!r}")
        if not dispatch.is_count(self.max_iters, 1):
            raise ValueError(f"newton_iters must be a positive integer, got {self.max_iters!r}")

    def tolerance(self, dtype: torch.dtype) -> float:
        """The tolerance for states of ``dtype``."""
        return self.tol if self.tol is not None else DEFAULT_TOL.get(dtype, torch.finfo(dtype).eps ** 0.75)


@dataclass(frozen=True)
class SolveStats:
    """What one layer's forward took: Newton iterations (0 for the native forward), whether they
    converged (False: the native forward was run instead), and the last iteration's largest change."""

    iterations: int
    converged: bool
    change: float

    def as_tensor(self) -> Tensor:
        if self is NATIVE:  # every native forward's: a copy, cheaper than a tensor from a list
            return _NATIVE_TENSOR.clone()
        return torch.tensor([self.iterations, float(self.converged), self.change], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: Tensor) -> SolveStats:
        iterations, converged, change = t.tolist()
        return cls(int(iterations), bool(converged), change)


NATIVE = SolveStats(0, True, 0.0)
_NATIVE_TENSOR = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)


def solve(
    cell: Cell,
    x: Tensor,
    s0: Tensor,
    w: LayerWeights,
    keep: Tensor | None,
    options: SolverOptions,
    scan_options: ScanOptions,
    guess: Tensor | None = None,
) -> tuple[Tensor, SolveStats]:
    """The states s_1..s_T (T, B, S) of ``cell`` over x (T, B, I) from s_0 (B, S) by ``options.method``.

    ``keep`` (T, B, 1; 0 past a sequence's end) carries the state past each sequence's end; ``guess``
    (T, B, S), the first iterate (None: zeros). Builds no autograd graph. The returned states are
    the last iterate: use them only when the stats say ``converged``.
    """
    if options.method not in ("newton", "quasi-newton"):
        raise ValueError(f"solve() runs the Newton methods; got forward_solver {options.method!r}")
    steps = x.shape[0]
    tol = options.tolerance(x.dtype)
    with torch.no_grad():
        lo, hi = cell.bounds(s0, steps)
        s = s0.new_zeros((steps, *s0.shape)) if guess is None else guess.to(s0.dtype, copy=True)
        s.clamp_(lo, hi)
        zero = torch.zeros_like(s0)
        change, last = math.inf, math.inf
        for k in range(1, options.max_iters + 1):
            prev = torch.cat((s0.unsqueeze(0), s[:-1]))
            new, factors = cell.step(x, prev, w, keep)
            residual = new.sub_(s)
            if options.method == "newton":
                d = forward_scan(cell.tangent_chain(factors, w), zero, residual, scan_options)[1:]
            else:
                a = cell.chain(factors, w).diagonals().expand_as(residual)
                d = elementwise_recurrence(a, residual, zero)
            new = d.nan_to_num_(nan=0.0).add_(s).clamp_(lo, hi)  # the projected iterate
            change = _max_abs(new - s)
            s = new
            if not math.isfinite(change):
                return s, SolveStats(k, False, change)
            error = change
            if options.method == "quasi-newton":
                rate = change / last if last > 0 else 0.0
                error = max(change, change * rate / (1 - rate)) if rate < 1 else math.inf
            if error <= tol or error <= tol * _max_abs(s):  # tol * max(1, max |h|); the pass only when needed
                return s, SolveStats(k, True, change)
            last = change
    return s, SolveStats(options.max_iters, False, change)


def _max_abs(t: Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0
