"""A Newton iteration of a layer's forward (``bppsa_core.newton``) in Triton kernels, each beside its
plain-PyTorch reference (``*_ref``).

The states s_0..s_T sit in one (T + 1, B, S) buffer, so the previous states are a view of it. An
iteration of a tanh/relu RNN or a GRU (``FusedIteration``) is seven launches and no host sync:

1. the hidden GEMM (cuBLAS, into a kept buffer): an RNN's pre-activations x W_ih^T + b_ih + b_hh +
   s_{t-1} W_hh^T, the input part made once per solve; a GRU's s_{t-1} W_hh^T + b_hh;
2. ``_rnn_residual`` / ``_gru_residual``: the cell at every step, its residual f(x_t, s_{t-1}) - s_t
   and the factors of its Jacobian, written in reversed time order, as the transposed chain's scan
   reads them (no flips);
3. the transposed chunked scan, three launches (``chunk_scan.factored_scan``): the corrections d_t;
4. ``_update``: s_t <- clamp(s_t + d_t, lo, hi), a NaN correction dropped and an infinite one cut to
   the largest float (``torch.nan_to_num``), and per program the largest change and |state|;
5. ``_decide``: one program folds those into the stopping rule's record (``newton.judge``).

A Picard sweep (``FusedIteration.sweep``, ``newton_guess="sweeps"``) is steps 1, 2 and 4 with the
residual for the correction, and ``_decide`` by the sweeps' rule into a record of their own: four
launches and no scan.

A solve captured in a CUDA graph ends in ``_walk``: where it has not converged, the native forward,
one program a sample (``FusedIteration.fall_back``).

Any other layer (an LSTM, quasi-Newton, packed sequences) takes only steps 4 and 5
(``newton_update``) after its own cell evaluation and scan (quasi-Newton's: the diagonal recurrence
in three launches, ``bppsa_core.triton.diagonal``). Every kernel, the scan's included,
reads the record first and does nothing once it says stopped, so iterations queued past the stop
leave the states as they were and cost their launches and the GEMM only.

The states after s_0 are a view one row into the buffer: 16-byte aligned, as the compile check
(``benchmarks.kernels``) assumes, when B S is a multiple of 4; otherwise Triton compiles the
kernels without that hint.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from bppsa_core import dispatch, newton
from bppsa_core.chain import FactoredChain
from bppsa_core.jacobians import GRUCell, LayerWeights, RNNCell
from bppsa_core.triton.chunk_scan import GRU, RELU, TANH, _load_weights, factored_scan, num_warps
from bppsa_core.triton.launch import BY_DATA, Launch, padded, triton_from

BLOCK = 1024  # elements a program of the pointwise kernels takes
WARPS = (
    8  # 4 elements a thread: the GRU residual at 4 warps took 146 registers (python -m benchmarks.kernels)
)
FLOAT_MAX = tl.constexpr(
    3.4028234663852886e38
)  # float32's largest: where torch.nan_to_num cuts an infinite correction
# The stopping rule's record (``bppsa_core.newton.judge``), float64: its entries, for the kernels.
STOPPED, ITERATIONS, CONVERGED, CHANGE, SWEPT, LAST, TOL = (tl.constexpr(i) for i in range(7))
SWEEP_RATE = tl.constexpr(newton.SWEEP_RATE)  # a sweep shrinking the change by less stops the sweeps
NEWTON_SIZES = ("N", "BH", "P")  # run-time sizes, never specialized on


@triton.jit
def _rows(idx, N, BH):
    """The element in reversed time order of each flat index of a (T, B, S) tensor, S = BH / B:
    (T - 1 - t) B S + j for idx = t B S + j."""
    t = idx // BH
    return (N - BH) - t * BH + (idx - t * BH)


@triton.jit
def _running(record_ptr, idx):
    """Per lane of ``idx``, whether the record says running (the flag read at every lane: Triton's
    interpreter cannot combine a scalar with a vector mask)."""
    return tl.load(record_ptr + 0 * idx) == 0


@triton.jit(do_not_specialize=NEWTON_SIZES)
def _rnn_residual(
    pre_ptr, s_ptr, record_ptr, res_ptr, fp_ptr,  # pointers: pre-activations, states, record read; written
    N, BH,  # sizes: T B H, B H
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """h = f(z) at every step, the residual h - s and f'(z) read off h (1 - h^2, or [not h <= 0] as
    autograd's relu backward), both written at the step's reversed row."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = (idx < N) & _running(record_ptr, idx)
    z = tl.load(pre_ptr + idx, mask=live, other=0.0)
    if ACT == TANH:
        h = 2.0 * tl.sigmoid(2.0 * z) - 1.0
        fp = 1.0 - h * h
    else:
        h = tl.where(z > 0, z, tl.where(z != z, z, 0.0))  # relu; NaN passes, as torch.relu's
        fp = tl.where(h <= 0, 0.0, 1.0)
    rev = _rows(idx, N, BH)
    tl.store(res_ptr + rev, h - tl.load(s_ptr + idx, mask=live, other=0.0), mask=live)
    tl.store(fp_ptr + rev, fp, mask=live)


@triton.jit(do_not_specialize=NEWTON_SIZES)
def _gru_residual(
    gi_ptr, gh_ptr, prev_ptr, s_ptr, record_ptr,  # pointers read: gate pre-activations, states, record
    res_ptr, scales_ptr, diag_ptr,  # pointers written
    N, BH, H,  # sizes: T B H, B H, H
    BLOCK: tl.constexpr,
):  # fmt: skip
    """The GRU's h = n + z (s_{t-1} - n) from gi = W_ih x + b_ih and gh = W_hh s_{t-1} + b_hh (rows
    r, z, n), the residual h - s, and the Jacobian's scales (dn m r (1 - r), (s_{t-1} - n) z (1 - z),
    dn r; dn = (1 - z)(1 - n^2)) and diagonal z, as ``GRUCell.factors``, at the reversed row."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = (idx < N) & _running(record_ptr, idx)
    row = idx // H
    col = idx - row * H
    gates = row * 3 * H + col
    i_r = tl.load(gi_ptr + gates, mask=live, other=0.0)
    i_z = tl.load(gi_ptr + gates + H, mask=live, other=0.0)
    i_n = tl.load(gi_ptr + gates + 2 * H, mask=live, other=0.0)
    r = tl.sigmoid(i_r + tl.load(gh_ptr + gates, mask=live, other=0.0))
    z = tl.sigmoid(i_z + tl.load(gh_ptr + gates + H, mask=live, other=0.0))
    m = tl.load(gh_ptr + gates + 2 * H, mask=live, other=0.0)
    n = 2.0 * tl.sigmoid(2.0 * (i_n + r * m)) - 1.0  # tanh
    prev = tl.load(prev_ptr + idx, mask=live, other=0.0)
    h = n + z * (prev - n)
    dn = (1.0 - z) * (1.0 - n * n)
    rev = _rows(idx, N, BH)
    rev_row = rev // H
    tl.store(res_ptr + rev, h - tl.load(s_ptr + idx, mask=live, other=0.0), mask=live)
    scales = rev_row * 3 * H + col
    tl.store(scales_ptr + scales, dn * m * r * (1.0 - r), mask=live)
    tl.store(scales_ptr + scales + H, (prev - n) * z * (1.0 - z), mask=live)
    tl.store(scales_ptr + scales + 2 * H, dn * r, mask=live)
    tl.store(diag_ptr + rev, z, mask=live)


@triton.jit(do_not_specialize=NEWTON_SIZES)
def _update(
    s_ptr, d_ptr, lo_ptr, hi_ptr, record_ptr, partial_ptr,  # pointers: states updated; partials written
    N, BH,  # sizes: T B S, B S
    REVERSED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """s <- clamp(s + d, lo, hi), d's NaN dropped and its infinities cut to float32's largest, d read
    in time order or (REVERSED) at the reversed rows; this program's largest |change| and |state|
    (a NaN counted as infinite) into ``partial`` (2 per program)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    running = tl.load(record_ptr) == 0
    live = (idx < N) & _running(record_ptr, idx)
    rows = _rows(idx, N, BH) if REVERSED else idx
    d = tl.load(d_ptr + rows, mask=live, other=0.0)
    d = tl.where(d != d, 0.0, tl.minimum(tl.maximum(d, -FLOAT_MAX), FLOAT_MAX))
    s = tl.load(s_ptr + idx, mask=live, other=0.0)
    j = idx % BH
    lo = tl.load(lo_ptr + j, mask=live, other=0.0)
    hi = tl.load(hi_ptr + j, mask=live, other=0.0)
    new = s + d
    new = tl.where(new < lo, lo, tl.where(new > hi, hi, new))  # NaN passes, as torch.clamp's
    tl.store(s_ptr + idx, new, mask=live)
    change = tl.abs(new - s)
    size = tl.abs(new)
    change = tl.where(live, tl.where(change != change, float("inf"), change), 0.0)
    size = tl.where(live, tl.where(size != size, float("inf"), size), 0.0)
    tl.store(partial_ptr + 2 * pid, tl.max(change, axis=0), mask=running)
    tl.store(partial_ptr + 2 * pid + 1, tl.max(size, axis=0), mask=running)


@triton.jit(do_not_specialize=NEWTON_SIZES)
def _decide(
    partial_ptr, record_ptr,  # pointers: the programs' partials read; the record updated
    P,  # size: partial pairs
    QUASI: tl.constexpr, SWEEP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The stopping rule on the largest change and |state| of the partials (``newton.judge``): the
    error estimate at the rate change / last change is change min(1, rate / (1 - rate)) (Newton;
    the change itself while the last change is infinite) or max(change, change rate / (1 - rate))
    (QUASI, and SWEEP: a Picard sweep's, linear too); stop when it is at most tol max(1, max |s|) or
    not finite, and (SWEEP) at a rate above SWEEP_RATE."""
    running = tl.load(record_ptr) == 0
    change = tl.zeros([BLOCK], dtype=tl.float32)
    size = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, P, BLOCK):
        k = i + tl.arange(0, BLOCK)
        more = (k < P) & _running(record_ptr, k)
        change = tl.maximum(change, tl.load(partial_ptr + 2 * k, mask=more, other=0.0))
        size = tl.maximum(size, tl.load(partial_ptr + 2 * k + 1, mask=more, other=0.0))
    change = tl.max(change, axis=0).to(tl.float64)
    size = tl.max(size, axis=0).to(tl.float64)
    last = tl.load(record_ptr + LAST)
    tol = tl.load(record_ptr + TOL)
    if QUASI or SWEEP:
        rate = tl.where(last > 0, change / last, 0.0)
        error = tl.where(rate < 1, tl.maximum(change, change * rate / (1 - rate)), float("inf"))
    else:
        known = (last > 0) & (last < float("inf"))
        rate = tl.minimum(tl.where(known, change / tl.where(known, last, 1.0), 1.0), 0.5)
        error = change * (rate / (1 - rate))  # the change itself from the rate 1/2 up
    infinite = change == float("inf")  # a NaN is counted as infinite already
    converged = (change < float("inf")) & ((error <= tol) | (error <= tol * size))
    stop = converged | infinite
    if SWEEP:  # a sweep that hardly shrinks the change: the recurrence is not contracting
        stop = stop | (rate > SWEEP_RATE)
    iterations = tl.load(record_ptr + ITERATIONS)
    tl.store(record_ptr + STOPPED, tl.where(stop, 1.0, 0.0).to(tl.float64), mask=running)
    tl.store(record_ptr + ITERATIONS, iterations + 1, mask=running)
    tl.store(record_ptr + CONVERGED, tl.where(converged, 1.0, 0.0).to(tl.float64), mask=running)
    tl.store(record_ptr + CHANGE, change, mask=running)
    tl.store(record_ptr + LAST, change, mask=running)


@triton.jit(do_not_specialize=BY_DATA)
def _walk(
    gi_ptr, w_ptr, b_ptr, record_ptr, states_ptr,  # pointers read: input part, W_hh, b_hh, record; written
    T, B, H,  # sizes: steps, batch, hidden
    MODE: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """Where the record says not converged, sample b's native forward step by step from s_0 into the
    states s_1..s_T: a captured solve's fallback. ``MODE``: TANH or RELU (gi = W_ih x + b_ih + b_hh),
    or GRU (gi = W_ih x + b_ih, rows r, z, n; W_hh's three blocks and b_hh applied here)."""
    if tl.load(record_ptr + CONVERGED) != 0:
        return
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, HP)
    vec = r < H
    w_r, w_z, w_n = _load_weights(w_ptr, H, 3 if MODE == GRU else 1, HP, True)
    h = tl.load(states_ptr + b * H + r, mask=vec, other=0.0)
    for t in range(0, T):
        row = t * B + b
        if MODE == GRU:
            gi = gi_ptr + row * 3 * H + r
            h_r = tl.sum(h[:, None] * w_r, axis=0) + tl.load(b_ptr + r, mask=vec, other=0.0)
            h_z = tl.sum(h[:, None] * w_z, axis=0) + tl.load(b_ptr + H + r, mask=vec, other=0.0)
            h_n = tl.sum(h[:, None] * w_n, axis=0) + tl.load(b_ptr + 2 * H + r, mask=vec, other=0.0)
            gate_r = tl.sigmoid(tl.load(gi, mask=vec, other=0.0) + h_r)
            gate_z = tl.sigmoid(tl.load(gi + H, mask=vec, other=0.0) + h_z)
            n = 2.0 * tl.sigmoid(2.0 * (tl.load(gi + 2 * H, mask=vec, other=0.0) + gate_r * h_n)) - 1.0
            h = n + gate_z * (h - n)
        else:
            z = tl.load(gi_ptr + row * H + r, mask=vec, other=0.0) + tl.sum(h[:, None] * w_r, axis=0)
            if MODE == TANH:
                h = 2.0 * tl.sigmoid(2.0 * z) - 1.0
            else:
                h = tl.where(z > 0, z, tl.where(z != z, z, 0.0))
        h = tl.where(vec, h, 0.0)
        tl.store(states_ptr + (row + B) * H + r, h, mask=vec)


# ------------------------------------------------------------------------------------------- launch


@cache
def residual_launch(mode: int) -> Launch:
    """``_rnn_residual`` (``mode`` TANH's or RELU's value) or ``_gru_residual`` (GRU's), as
    ``FusedIteration`` runs it and ``benchmarks.kernels`` compiles it; made once."""
    if mode == GRU.value:
        return Launch(_gru_residual, {"BLOCK": BLOCK}, WARPS)
    return Launch(_rnn_residual, {"ACT": mode, "BLOCK": BLOCK}, WARPS)


@cache
def update_launches(quasi: bool, reversed_: bool, sweep: bool = False) -> tuple[Launch, Launch]:
    """``_update`` (reading the corrections ``reversed_``) and ``_decide`` (``quasi``'s rule, or with
    ``sweep`` a Picard sweep's), as ``newton_update`` runs them and ``benchmarks.kernels`` compiles
    them; made once."""
    return (
        Launch(_update, {"REVERSED": reversed_, "BLOCK": BLOCK}, WARPS),
        Launch(_decide, {"QUASI": quasi, "SWEEP": sweep, "BLOCK": BLOCK}, WARPS),
    )


@cache
def walk_launch(mode: int, hp: int) -> Launch:
    """``_walk`` for ``mode`` (TANH's, RELU's or GRU's value) at ``hp`` = ``padded(H)``, on
    ``fallback_warps``; made once."""
    return Launch(_walk, {"MODE": mode, "HP": hp}, fallback_warps(mode, hp))


def fallback_warps(mode: int, hp: int, release: tuple[int, ...] | None = None) -> int:
    """``_walk``'s warps under Triton ``release`` (None: the installed one): the scan kernels' for its
    weights (``chunk_scan.num_warps``); but a GRU's at HP = 64 from Triton 3.8 on 16, where on 8 ptxas
    spills it at 255 registers for sm_90 (python -m benchmarks.kernels)."""
    gru = mode == GRU.value
    if gru and hp == 64 and triton_from((3, 8), release):
        return 16
    return num_warps(3 if gru else 1, hp)


def newton_update(
    s: Tensor,
    d: Tensor,
    lo: Tensor,
    hi: Tensor,
    record: Tensor,
    quasi: bool,
    reversed_: bool,
    partial: Tensor | None = None,
    sweep: bool = False,
) -> None:
    """``_update`` then ``_decide``: the projected iterate written into ``s`` (T, B, S) from the
    corrections ``d`` ((T, B, S) in time order, or the rows of a transposed scan's output,
    ``reversed_``) and the bounds lo, hi (B, S), and the stopping rule into ``record`` (``sweep``: a
    Picard sweep's). ``partial``: the programs' partial maxima (``update_partials``), kept across a
    solve's iterations, or None for a new one."""
    n = s.numel()
    programs = _programs(n)
    partial = update_partials(s) if partial is None else partial
    update, decide = update_launches(quasi, reversed_, sweep)
    bh = s[0].numel() if s.shape[0] else 1
    update.run(
        (programs,),
        s_ptr=s,
        d_ptr=d,
        lo_ptr=lo.expand_as(s[0]).contiguous(),
        hi_ptr=hi.expand_as(s[0]).contiguous(),
        record_ptr=record,
        partial_ptr=partial,
        N=n,
        BH=bh,
    )
    decide.run((1,), partial_ptr=partial, record_ptr=record, P=programs)


def update_partials(s: Tensor) -> Tensor:
    """The scratch ``newton_update`` takes for an iterate ``s``: two partial maxima per program."""
    return s.new_empty(2 * _programs(s.numel()))


def _programs(n: int) -> int:
    """The pointwise kernels' programs over n states: one per BLOCK of them, at least one."""
    return max(1, triton.cdiv(n, BLOCK))


def newton_update_ref(
    s: Tensor,
    d: Tensor,
    lo: Tensor,
    hi: Tensor,
    record: Tensor,
    quasi: bool,
    reversed_: bool,
    sweep: bool = False,
) -> None:
    """``newton_update`` in plain PyTorch: ``bppsa_core.newton.update``."""
    d = d[: s.shape[0]].flip(0) if reversed_ else d
    newton.update(s, d, lo, hi, record, quasi, sweep=sweep)


def takes(cell: object, method: str, keep: Tensor | None, w: LayerWeights) -> bool:
    """Whether ``FusedIteration`` takes the layer: a tanh/relu RNN or a GRU, Newton's method, no
    packed sequences, float32 weights the scan kernels take (``dispatch.kernels_take``)."""
    if method != "newton" or keep is not None or not isinstance(cell, RNNCell | GRUCell):
        return False
    hidden = w.w_hh.shape[1]
    return dispatch.kernels_take(cell.gates, hidden, *(t.dtype for t in vars(w).values() if t is not None))


class FusedIteration:
    """One Newton iteration of a tanh/relu RNN or GRU layer (see the module docstring), its buffers
    made once per solve: ``states`` (T + 1, B, H) the iterate with s_0, updated in place; lo, hi
    (B, H) the bounds; ``record`` the stopping rule's."""

    def __init__(
        self,
        cell: RNNCell | GRUCell,
        x: Tensor,
        w: LayerWeights,
        states: Tensor,
        lo: Tensor,
        hi: Tensor,
        record: Tensor,
        chunk: int | None,
    ) -> None:
        steps, batch, hidden = states.shape[0] - 1, states.shape[1], states.shape[2]
        self.steps, self.batch, self.hidden = steps, batch, hidden
        self.states, self.lo, self.hi, self.record = states, lo, hi, record
        self.gru = isinstance(cell, GRUCell)
        self.mode = GRU.value if self.gru else cell_act(cell)  # the residual's and the walk's
        self.chunk = chunk or dispatch.default_chunk(steps)
        self.w_hh = w.w_hh.contiguous()
        self.w_hh_t = self.w_hh.t()
        self.prev = states[:-1].view(steps * batch, hidden)
        rows = steps * batch
        # the pointwise kernels' grid and sizes: one program per BLOCK states
        self.grid = (_programs(rows * hidden),)
        self.sizes = {"N": rows * hidden, "BH": batch * hidden}
        projected = torch.nn.functional.linear(x.reshape(rows, -1), w.w_ih, w.b_ih)
        if self.gru:
            self.gi = projected
            self.b_hh = w.b_hh if w.b_hh is not None else projected.new_zeros(3 * hidden)
            self.pre = projected.new_empty((rows, 3 * hidden))  # gh
            self.scales = projected.new_empty((steps, batch, 3, hidden))
            self.diag = projected.new_empty((steps, batch, hidden))
            weights = w.w_hh.reshape(3, hidden, hidden)
            self.chain = FactoredChain(self.scales, weights, self.diag, transposed=True)
        else:
            self.gi = projected if w.b_hh is None else projected.add_(w.b_hh)  # x W_ih^T + b_ih + b_hh
            self.pre = projected.new_empty((rows, hidden))
            self.scales = projected.new_empty((steps, batch, 1, hidden))
            self.chain = FactoredChain(self.scales, w.w_hh.unsqueeze(0), transposed=True)
        self.residual = projected.new_empty((steps, batch, hidden))
        self.partial = update_partials(states[1:])
        self.zero = projected.new_zeros((batch, hidden))

    def fall_back(self) -> None:
        """Where the solve has not converged (the record read on the device), the native forward
        into the states, sample by sample (``_walk``): a captured solve's fallback."""
        if self.steps == 0:
            return
        bias = self.b_hh if self.gru else self.gi  # not read by an RNN's walk: its biases are in gi
        walk_launch(self.mode, padded(self.hidden)).run(
            (self.batch,), gi_ptr=self.gi, w_ptr=self.w_hh, b_ptr=bias, record_ptr=self.record,
            states_ptr=self.states, T=self.steps, B=self.batch, H=self.hidden,
        )  # fmt: skip

    def __call__(self) -> None:
        """One iteration: the states and the record updated in place, on the device."""
        self._residual(self.record)
        d = factored_scan(self.chain, self.zero, self.residual, self.chunk, stop=self.record)
        newton_update(self.states[1:], d, self.lo, self.hi, self.record, False, True, self.partial)

    def sweep(self, record: Tensor) -> None:
        """One Picard sweep (``newton.solve``): an iteration without its scan, the residual itself
        the correction, so s_t <- f(x_t, s_{t-1}) at every step; the sweeps' rule into their own
        ``record``, after which the sweeps queued do nothing. Its twin: ``newton.sweep``."""
        self._residual(record)
        newton_update(
            self.states[1:], self.residual, self.lo, self.hi, record, False, True, self.partial, True
        )

    def _residual(self, record: Tensor) -> None:
        """The hidden GEMM, then the cell at every step: its residual and Jacobian factors, written in
        reversed time order; nothing once ``record`` says stopped."""
        s = self.states[1:]
        residual = residual_launch(self.mode)
        if self.gru:
            torch.addmm(self.b_hh, self.prev, self.w_hh_t, out=self.pre)
            residual.run(
                self.grid, gi_ptr=self.gi, gh_ptr=self.pre, prev_ptr=self.prev, s_ptr=s,
                record_ptr=record, res_ptr=self.residual, scales_ptr=self.scales, diag_ptr=self.diag,
                H=self.hidden, **self.sizes,
            )  # fmt: skip
        else:
            torch.addmm(self.gi, self.prev, self.w_hh_t, out=self.pre)
            residual.run(
                self.grid, pre_ptr=self.pre, s_ptr=s, record_ptr=record, res_ptr=self.residual,
                fp_ptr=self.scales, **self.sizes,
            )  # fmt: skip


def fused_iteration_ref(
    cell: RNNCell | GRUCell,
    x: Tensor,
    w: LayerWeights,
    states: Tensor,
    lo: Tensor,
    hi: Tensor,
    record: Tensor,
) -> None:
    """``FusedIteration()`` in plain PyTorch: the cell's step, the tangent chain's scan and
    ``newton.update``, as ``bppsa_core.newton.solve`` runs an iteration."""
    from bppsa_core.scan import forward_scan

    s, prev = states[1:], states[:-1]
    new, factors = cell.step(x, prev, w)
    residual = new.sub_(s)
    d = forward_scan(cell.tangent_chain(factors, w), torch.zeros_like(s[0]), residual, _chunked())[1:]
    newton.update(s, d, lo, hi, record, False)


def fall_back_ref(
    cell: RNNCell | GRUCell, x: Tensor, w: LayerWeights, states: Tensor, record: Tensor
) -> None:
    """``FusedIteration.fall_back`` in plain PyTorch: where the record says not converged, the
    cell's steps one by one from s_0."""
    if record[CONVERGED.value] == 0:
        for t in range(x.shape[0]):
            states[t + 1] = cell.step(x[t : t + 1], states[t : t + 1], w)[0][0]


def _chunked() -> dispatch.ScanOptions:
    return dispatch.ScanOptions("chunked")


def cell_act(cell: RNNCell) -> int:
    """An RNN cell's activation as the residual kernel's ACT."""
    return (TANH if cell.nonlinearity == "tanh" else RELU).value
