"""One recurrent layer in one direction: PyTorch's forward, a BPPSA backward and a BPPSA tangent.

The maths of a layer call; ``bppsa_core.ops`` makes each of them a ``torch.library`` operator and
ties them into one differentiable call (``ops.layer``), which ``bppsa_core.nn`` builds its modules
from, one call per layer and direction:

* ``native_forward``: PyTorch's fused kernel (cuDNN on a GPU) over the layer, in segments of at most
  ``segment`` steps (default ``SEGMENT``) with the state passed across, and over packed sequences
  when ``lengths`` is given; ``solved_forward``: with a Newton ``solver``, the states solved parallel
  in time (``bppsa_core.newton``), falling back to the fused kernel when they do not converge;
* ``bppsa_backward``: the per-step Jacobians recovered from the saved states
  (``bppsa_core.jacobians``), the chain ``g_{t-1} = g_t @ J_t + u_{t-1}`` scanned
  (``bppsa_core.scan``), and every input, state, weight and bias gradient from a few large matmuls;
* ``bppsa_tangent``: forward-mode differentiation. A tangent of the state obeys the linear
  recurrence ``v_t = J_t v_{t-1} + c_t``, so the same factored Jacobians and the same scan, run over
  the transposed elements, give it.

The backward is the BPPSA scan whenever the gradient itself is not differentiated. When it is
(``create_graph=True``, ``torch.func.grad``, ``jacrev``, Hessians), the layer's gradient is taken
through PyTorch's own differentiable forward instead (``differentiable_vjp``), so that every higher
derivative is exact; the values of the first derivative are the same.

Sequences of different lengths (``lengths``, sorted longest first, as packing leaves them) are
padded to T steps: past a sequence's end its outputs are 0 and its Jacobians are identities, so the
state that reaches the end of the chain is each sequence's last valid one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from torch.nn.functional import linear
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from bppsa_core import dispatch, newton
from bppsa_core.denormals import flush_denormals
from bppsa_core.dispatch import ScanOptions
from bppsa_core.jacobians import (
    Cell,
    Deltas,
    GRUCell,
    LayerWeights,
    LSTMCell,
    PreviousStates,
    RNNCell,
    buffer,
    layer_grads,
    reusing_buffers,
)
from bppsa_core.newton import SolverOptions, SolveStats
from bppsa_core.scan import forward_scan, scan

if TYPE_CHECKING:  # numba (and the NumPy it needs) is an optional extra: imported where it runs
    import numpy as np

    from bppsa_core.numba_scan import GRUWalk, LSTMWalk, RNNWalk

log = logging.getLogger(__name__)
MODES: tuple[str, ...] = ("RNN_TANH", "RNN_RELU", "GRU", "LSTM")
# The steps of one call of PyTorch's fused forward; longer sequences run in segments, the state passed
# across (cuDNN refuses more than 65,535 steps a call). Short segments reuse memory malloc already holds,
# faster on a CPU and with a peak near the outputs, while 2,048 keeps the paper's GRU sequences
# (T = 1034) in one call; re-measured by ``python -m benchmarks.forward --T 100000``.
SEGMENT = 2048
# The most steps PyTorch's fused kernel takes in one call, by device type (cuDNN refuses more than
# 65,535): no segment is longer there
ONE_CALL_STEPS = {"cuda": 65_535}
# The steps from which a layer's backward runs with subnormals flushed (``bppsa_core.denormals``):
# a shorter chain's products sink too little to pay for switching the mode, which costs a short
# layer's backward a few percent (re-measured by ``python -m benchmarks.host``).
FLUSH_MIN_STEPS = 64

_NATIVE = {
    "RNN_TANH": torch._VF.rnn_tanh,
    "RNN_RELU": torch._VF.rnn_relu,
    "GRU": torch._VF.gru,
    "LSTM": torch._VF.lstm,
}


@dataclass(frozen=True)
class LayerConfig:
    """What a layer call needs besides tensors: the cell, the forward's segment length, the scan,
    and how the forward is solved."""

    mode: str
    segment: int = SEGMENT
    options: ScanOptions = field(default_factory=ScanOptions)
    solver: SolverOptions = field(default_factory=SolverOptions)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; accepted: {', '.join(MODES)}")
        if not dispatch.is_count(self.segment, 1):
            raise ValueError(f"segment must be a positive integer, got {self.segment!r}")


def cell_of(mode: str) -> Cell:
    """The cell of a PyTorch RNN mode."""
    if mode == "GRU":
        return GRUCell()
    if mode == "LSTM":
        return LSTMCell()
    return RNNCell("relu" if mode == "RNN_RELU" else "tanh")


class Tape(NamedTuple):
    """What a GRU or LSTM layer's compiled forward keeps for its fused compiled backward
    (``numba_scan.GRUWalk`` / ``LSTMWalk``, block by block: ``_walked_tape``), which otherwise
    recomputes them (a GRU's factors by the cell's PyTorch code, ``_walked``; an LSTM's gates by
    two GEMMs and its cell states, ``numba_scan.lstm_layer_backward``; most of the backward's time
    at small H): the gates (T, B, 4H; an LSTM's i, f, g, o activated, a GRU's r, z, n and
    m = W_hn h + b_hn, side by side), an LSTM's cell states c_0..c_T (T + 1, B, H; a GRU's None)
    and the states h_0..h_T (T + 1, B, H), as the NumPy arrays the kernels write and read (no
    conversion per call), zeros past each packed sequence's end. ``hidden`` is ``states`` as a
    tensor, the same memory: the backward's outputs h_1..h_T and previous states h_0..h_{T-1}, so
    the outputs the layer returns are not what its backward reads, and its caller may change them
    in place with no copy (``ops.layer``'s ``own_output``). 5H or 6H numbers a step and sample,
    fewer than autograd keeps for ``torch.nn``'s modules."""

    gates: np.ndarray
    cells: np.ndarray | None
    states: np.ndarray
    hidden: Tensor

    def samples(self, s: slice) -> Tape:
        """The tape of the samples ``s``: views, no copy (a sequence-parallel rank's forward writes
        a piece of a group's tape through one where its groups and the backward's do not nest)."""
        cells = None if self.cells is None else self.cells[:, s]
        return Tape(self.gates[:, s], cells, self.states[:, s], self.hidden[:, s])

    def tensors(self) -> tuple[Tensor, Tensor | None, Tensor]:
        """The gates, the cells (or None) and the states as tensors of the same memory, for
        ``ctx.save_for_backward``: autograd then frees the tape once the backward has run, unless the
        graph is retained, as it frees what it saved itself (held by the context instead, a tape
        lived as long as the outputs, into the next step's forward), and its memory is free for the
        next tape (``numba_forward.TapeMemory``). ``of`` is the inverse."""
        cells = None if self.cells is None else torch.from_numpy(self.cells)
        return torch.from_numpy(self.gates), cells, self.hidden

    @staticmethod
    def of(gates: Tensor, cells: Tensor | None, hidden: Tensor) -> Tape:
        """The tape whose ``tensors`` these are."""
        return Tape(gates.numpy(), None if cells is None else cells.numpy(), hidden.numpy(), hidden)


def new_tape(
    config: LayerConfig,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
) -> Tape | None:
    """An empty ``Tape`` for a GRU or LSTM layer call, inside its forward (nothing recorded there),
    whose backward will be the fused compiled walk (the scan strategy resolves to "numba"; a GRU's
    walked as one chunk, ``dispatch.numba_chunk``) and whose forward runs compiled
    (``dispatch.compiled_forward``, taped), else None; for ``solved_forward`` to fill. ``lengths``
    (packed sequences) change nothing: the tape holds zeros past each end."""
    strategy, mode = config.options.strategy, config.mode
    if mode not in _TAPED_MODES or config.solver.method != "native" or x.device.type != "cpu":
        return None
    if strategy not in dispatch.COMPILED_FORWARD_STRATEGIES:  # asked first: a layer call's host work counts
        return None
    steps, batch, hidden = x.shape[0], x.shape[1], h0.shape[-1]
    dtypes = tuple(t.dtype for t in (x, h0, c0, *weights) if t is not None)
    if not steps or not _taped(mode, strategy, (steps, batch, hidden), dtypes):
        return None
    if mode == "GRU" and _chunk(config, steps, batch, hidden, 3) < steps:  # the stored chain's chunked scan
        return None
    if torch.is_autocast_enabled("cpu"):
        return None
    from bppsa_core.numba_forward import tape_arrays

    gates, cells, states = tape_arrays(steps, batch, hidden, x.dtype, mode == "LSTM")
    return Tape(gates, cells, states, torch.from_numpy(states))


def release_tapes() -> None:
    """Hand back the memory kept for the CPU tapes of GRU and LSTM layers (``Tape``): after its
    backward a long tape's memory is kept for the next forward's (``numba_forward.TapeMemory``: it
    would otherwise be faulted in again every step), up to what the steps held at once.
    Tapes still in use go when their backward has run. As ``torch.cuda.empty_cache`` for a GPU."""
    forward = sys.modules.get("bppsa_core.numba_forward")  # none made where it was never imported
    if forward is not None:
        forward.TAPES.release()


_TAPED_MODES = {"GRU": GRUCell(), "LSTM": LSTMCell()}  # the modes whose compiled forward keeps a tape


@functools.lru_cache(maxsize=256)  # asked once a layer call: a short layer's work costs as much
def _taped(mode: str, strategy: str, shape: tuple[int, int, int], dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether a CPU GRU or LSTM layer call of this (T, B, H) keeps a tape: its backward routes to
    the compiled kernels (``_route``) and its forward runs compiled, taped
    (``dispatch.compiled_forward_takes``)."""
    cpu = torch.device("cpu")
    return _route(_TAPED_MODES[mode], strategy, shape, cpu, *dtypes)[2] and dispatch.compiled_forward_takes(
        strategy, mode, shape[2], "cpu", dtypes, True
    )


def _chunk(config: LayerConfig, steps: int, batch: int, hidden: int, terms: int) -> int:
    """The chunk of a layer's compiled scan: the configured one, else the threads'
    (``dispatch.numba_chunk``)."""
    return config.options.chunk or dispatch.numba_chunk(steps, batch, hidden, terms, torch.get_num_threads())


# ------------------------------------------------------------------------------------------- forward


def native_forward(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
    segment: int = SEGMENT,
    batch_major: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """PyTorch's fused forward of one layer: x (T, B, I), h0 and c0 (an LSTM's) (B, H), or
    (1, B, H) as the kernel takes them (a module's layer states: no view made on the way).

    Returns the outputs h_1..h_T (T, B, H), 0 past each sequence's end, and the last state (h, c),
    shaped as h0 and c0.
    Runs in segments of at most ``segment`` steps, each written into the outputs as it is made (the
    outputs exist once, not once more as a list of segments). ``batch_major``: the outputs are a
    (T, B, H) view of (B, T, H) memory, each sample's steps side by side, for a backward that walks
    the samples in groups (``bppsa_core.distributed``). Differentiable (PyTorch's own autograd).
    """
    steps, batch = x.shape[:2]
    if steps == 0:  # PyTorch's kernel refuses it, in its own words
        return _native_call(mode, x, None, h0, c0, weights)
    segment = min(segment, ONE_CALL_STEPS.get(x.device.type, segment))
    if steps <= segment and not batch_major:
        if lengths is None:  # one call of the kernel (a short layer's call costs as much as its work)
            return _native_call(mode, x, None, h0, c0, weights)
        return _segment(mode, x, h0, c0, weights, lengths)
    h, c, outs = h0, c0, None
    for s in range(0, steps, segment):
        e = min(steps, s + segment)
        seg = None if lengths is None else (lengths - s).clamp(0, e - s)
        if seg is not None and not seg.any():  # every sequence has ended: the rest outputs 0
            if outs is None:
                return _outputs(x, steps, batch, h.shape[-1], x.dtype, batch_major).zero_(), h, c
            outs[s:] = 0
            break
        out, h, c = _segment(mode, x[s:e], h, c, weights, seg)
        if outs is None:  # the kernel's dtype (autocast's, say), not necessarily x's
            outs = _outputs(x, steps, batch, out.shape[-1], out.dtype, batch_major)
        outs[s:e] = out
    return outs, h, c


def _outputs(
    like: Tensor, steps: int, batch: int, hidden: int, dtype: torch.dtype, batch_major: bool
) -> Tensor:
    """Uninitialized (T, B, H) outputs: time-major memory, or a view of batch-major (B, T, H) memory."""
    if batch_major:
        return like.new_empty((batch, steps, hidden), dtype=dtype).transpose(0, 1)
    return like.new_empty((steps, batch, hidden), dtype=dtype)


def _segment(
    mode: str, x: Tensor, h: Tensor, c: Tensor | None, weights: list[Tensor], lengths: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One call of PyTorch's fused kernel over x (T, B, I) from (h, c) ((B, H) or (1, B, H)), the
    sequences of ``lengths`` (sorted longest first, 0 for one that has ended) packed."""
    if lengths is None:
        return _native_call(mode, x, None, h, c, weights)
    steps, batch = x.shape[:2]
    active = int((lengths > 0).sum())
    if active == 0:
        return x.new_zeros((steps, batch, h.shape[-1])), h, c
    packed = pack_padded_sequence(x[:, :active], lengths[:active])
    data, h_a, c_a = _native_call(
        mode, packed.data, packed.batch_sizes, _samples(h, 0, active), _samples(c, 0, active), weights
    )
    out = pad_packed_sequence(PackedSequence(data, packed.batch_sizes), total_length=steps)[0]
    if active == batch:
        return out, h_a, c_a
    # the sequences that have ended keep their state, and output 0
    out = torch.cat((out, out.new_zeros((steps, batch - active, out.shape[-1]))), 1)
    h = torch.cat((h_a, _samples(h, active, batch)), -2)
    return out, h, (None if c is None else torch.cat((c_a, _samples(c, active, batch)), -2))


def solved_forward(
    config: LayerConfig,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
    guess: Tensor | None = None,
    tape: Tape | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, SolveStats | Tensor]:
    """``native_forward``'s results by ``config.solver``, and what the solve took (inside a CUDA
    graph capture, as a tensor on the device: ``newton.solve``); ``tape`` (from ``new_tape``) is
    filled by the compiled forward. h0 and c0 (B, H) or (1, B, H), the last states shaped as they are.

    The Newton methods solve the states parallel in time (``bppsa_core.newton.solve``) from ``guess``
    (h_1..h_T (T, B, H), or None for zeros; an LSTM's c follows from it, ``LSTMCell.cell_states``).
    When they do not converge the layer says so in the log and runs ``native_forward`` instead.
    Not differentiable.
    """
    solver, strategy = config.solver, config.options.strategy
    if solver.method == "native" or x.shape[0] == 0:
        out = sequential_forward(
            strategy, config.mode, x, h0, c0, weights, lengths, config.segment, tape=tape
        )
        return *out, newton.NATIVE
    hidden, lead = h0.shape[-1], h0.dim() == 3
    s0 = h0 if c0 is None else torch.cat((h0, c0), -1)
    if lead:  # a module's layer states (1, B, H); the solve's are (B, H)
        s0 = s0[0]
    keep = _keep(lengths, x.shape[0], x)
    cell, w = cell_of(config.mode), LayerWeights(*weights)
    if guess is not None and c0 is not None:
        c = cell.cell_states(x, torch.cat((s0[None, :, :hidden], guess[:-1])), w, s0[:, hidden:], keep)
        guess = torch.cat((guess, c), -1)
    states, stats = newton.solve(cell, x, s0, w, keep, solver, config.options, guess)
    if isinstance(stats, SolveStats) and not stats.converged:  # a tensor: captured, fallen back already
        log.warning(
            "%s forward did not converge in %d iterations (last change %.3g, tolerance %.3g); "
            "this layer ran the native sequential forward instead",
            solver.method,
            stats.iterations,
            stats.change,
            solver.tolerance(x.dtype),
        )
        return *sequential_forward(strategy, config.mode, x, h0, c0, weights, lengths, config.segment), stats
    out = states[..., :hidden]
    out = out * keep if keep is not None else out.contiguous()
    last = slice(-1, None) if lead else -1  # the last step's states, shaped as h0
    c = states[last, :, hidden:].clone() if c0 is not None else None
    return out, states[last, :, :hidden].clone(), c, stats


def sequential_forward(
    strategy: str,
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
    segment: int = SEGMENT,
    batch_major: bool = False,
    tape: Tape | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``native_forward``'s results, compiled (``bppsa_core.numba_forward``) where
    ``dispatch.compiled_forward`` says so for the scan ``strategy`` (always with a ``tape`` to fill,
    which ``new_tape`` gives only then), else by PyTorch's fused kernel. ``out``: (T, B, H), any
    strides, for the outputs (the compiled forward writes them there, PyTorch's are copied)."""
    hidden = h0.shape[-1]
    if tape is not None or (
        x.shape[0] and dispatch.compiled_forward(strategy, mode, hidden, x, h0, c0, *weights)
    ):
        from bppsa_core import numba_forward

        if out is None and batch_major:
            out = numba_forward.new_outputs(x.shape[0], x.shape[1], hidden, x.dtype, True)
        kept = None if tape is None else (tape.gates, tape.cells, tape.states)
        return numba_forward.layer_forward(mode, x, h0, c0, weights, lengths, segment, out, kept)
    made, h, c = native_forward(mode, x, h0, c0, weights, lengths, segment, batch_major)
    return (made, h, c) if out is None else (out.copy_(made), h, c)


def stepwise_forward(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], lengths: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``native_forward`` one step at a time through PyTorch's cell functions: slow, and
    differentiable under every transform (packed sequences are not, under ``torch.func``)."""
    steps = x.shape[0]
    keep = _keep(lengths, steps, x)
    w = (*weights, None, None)[:4]
    h, c, outs = h0, c0, []
    for t in range(steps):
        if mode == "LSTM":
            h_new, c_new = torch.lstm_cell(x[t], (h, c), *w)
        else:
            h_new, c_new = _CELLS[mode](x[t], h, *w), None
        if keep is not None:  # past a sequence's end the state is carried and the output is 0
            h_new = torch.lerp(h, h_new, keep[t])
            c_new = None if c is None else torch.lerp(c, c_new, keep[t])
            outs.append(h_new * keep[t])
        else:
            outs.append(h_new)
        h, c = h_new, c_new
    return torch.stack(outs), h, c


_CELLS = {"RNN_TANH": torch.rnn_tanh_cell, "RNN_RELU": torch.rnn_relu_cell, "GRU": torch.gru_cell}


def _samples(state: Tensor | None, start: int, end: int) -> Tensor | None:
    """Samples start..end-1 of a state, (B, H) or (1, B, H)."""
    return None if state is None else state[..., start:end, :]


def _native_call(
    mode: str, x: Tensor, batch_sizes: Tensor | None, h: Tensor, c: Tensor | None, weights: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One call of PyTorch's fused kernel for one layer, padded or packed (``batch_sizes``).

    In training mode where autograd records (distributed BPTT, the double-backward path): cuDNN keeps
    what its backward needs only then, and refuses the backward otherwise. Under no_grad (the
    layer's own forward, whose backward is BPPSA) it keeps nothing; dropout is 0, so the outputs
    are the same either way.

    On cuDNN, the weights of a layer after the first are a slice of the module's flattened buffer
    that cuDNN does not take as its own (it looks for a layer's weights from the start of their
    storage), so it copies them per call and warns; the warning is expected there and silenced
    (the copy is a few KB for the paper's sizes). Weights at the start of their storage, the first
    layer's, are taken in place or warned about as ``torch.nn``'s own call would be.
    """
    lead = h.dim() == 3  # (1, B, H), as the kernel takes and gives the states: no view either way
    if not lead:
        h, c = h.unsqueeze(0), (None if c is None else c.unsqueeze(0))
    hx = h if c is None else (h, c)
    bias = len(weights) == 4
    packed = () if batch_sizes is None else (batch_sizes,)
    flags = (bias, 1, 0.0, torch.is_grad_enabled(), False) + (() if packed else (False,))
    # the warning is cuDNN's; catching warnings costs as much as a short layer (benchmarks.host)
    if x.device.type != "cuda" or not weights[0].storage_offset():
        result = _NATIVE[mode](x, *packed, hx, weights, *flags)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not part of single contiguous chunk of memory.*")
            result = _NATIVE[mode](x, *packed, hx, weights, *flags)
    h, c = result[1], (result[2] if c is not None else None)
    if not lead:
        h, c = h[0], (None if c is None else c[0])
    return result[0], h, c


# ------------------------------------------------------------------------------------------ backward


def _keep(lengths: Tensor | None, steps: int, like: Tensor) -> Tensor | None:
    """(T, B, 1): 1 where step t (1..T) is within its sequence, else 0; None without lengths."""
    if lengths is None:
        return None
    t = torch.arange(1, steps + 1, device=lengths.device).unsqueeze(1)
    return (t <= lengths.unsqueeze(0)).to(device=like.device, dtype=like.dtype).unsqueeze(-1)


def bppsa_backward(
    config: LayerConfig,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
    out: Tensor,
    grad_out: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    need_input: bool = True,
    tape: Tape | None = None,
    need_state: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, list[Tensor]]:
    """The gradients of x, h0, c0 and the weights of one layer, from those of its outputs, its
    last h and (an LSTM) its last c, by scanning its Jacobian chain from the end; ``tape``: what
    the layer's compiled forward kept (``new_tape``), or None. Without ``need_input`` the gradient
    of x is None, without ``need_state`` those of h0 and c0 (a zero initial state's, say)."""
    grads = (grad_out, grad_hn, grad_cn)
    # scans and gradient GEMMs: see bppsa_core.denormals; the blocks' scratch: jacobians.reusing_buffers
    flush = flush_denormals(x.device) if out.shape[0] >= FLUSH_MIN_STEPS else contextlib.nullcontext()
    with flush, reusing_buffers():
        if tape is not None:
            return _taped_backward(tape, x, weights, lengths, *grads, need_input, need_state)
        return _backward(config, x, h0, c0, weights, lengths, out, *grads, need_input, need_state)


def _backward(config, x, h0, c0, weights, lengths, out, grad_out, grad_hn, grad_cn, need_input, need_state):
    # Under autocast the forward kept lower-precision states; the backward runs in the weights'
    # dtype (autograd casts each returned gradient back to its input's dtype).
    dtype = weights[0].dtype
    x, h0, h, grad_out, grad_hn, c0, grad_cn = (
        t if t is None or t.dtype == dtype else t.to(dtype)
        for t in (x, h0, out, grad_out, grad_hn, c0, grad_cn)
    )
    cell, w = cell_of(config.mode), LayerWeights(*weights)
    steps, _batch, hidden = h.shape
    keep = _keep(lengths, steps, h)
    if grad_out is not None and keep is not None:
        grad_out = grad_out * keep  # outputs past a sequence's end are constants
    h_prev: Tensor | PreviousStates = PreviousStates(h0, h)
    g_last = _last_grad(grad_out, grad_hn, h)
    g_c_last = None if c0 is None else (torch.zeros_like(g_last) if grad_cn is None else grad_cn)
    fused = _fused_layer(config, cell, x, h_prev, h, w, grad_out, g_last, c0, g_c_last, lengths, keep)
    if fused is not None:  # made block by block: the previous states too
        deltas, first = fused
    else:
        h_prev = h_prev.whole()
        factors = cell.factors(x, h_prev, h, w, c0, keep)
        offsets, start = injected(grad_out), g_last
        if c0 is not None:  # an LSTM's state is (h, c): c gets gradient only from c_n
            start = torch.cat((g_last, g_c_last), -1)
            offsets = None if offsets is None else torch.cat((offsets, torch.zeros_like(offsets)), -1)
        o = config.options
        g = scan(cell.chain(factors, w), start, offsets, strategy=o.strategy, chunk=o.chunk, levels=o.levels)

        def deltas(t: slice, g=g[1:]) -> tuple[Tensor, Tensor]:
            return cell.preactivation_grads(g[t], tuple(f[t] for f in factors))

        def first(g0=g[0]) -> Tensor:
            return g0

    dx, dw = layer_grads(deltas, x, h_prev, w, need_input)
    g_h0 = g_c0 = None
    if need_state:  # a walk made block by block knows g_0 once layer_grads has taken every block
        g0 = first()
        if c0 is None:
            g_h0 = g0.clone()
        else:
            g_h0, g_c0 = g0[:, :hidden].clone(), g0[:, hidden:].clone()
    return dx, g_h0, g_c0, _weight_grads(dw)


def _taped_backward(
    tape: Tape,
    x: Tensor,
    weights: list[Tensor],
    lengths: Tensor | None,
    grad_out: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    need_input: bool,
    need_state: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, list[Tensor]]:
    """``bppsa_backward`` of a GRU or LSTM layer whose compiled forward kept its ``tape``: the
    compiled walk over the kept gates, block by block from the end (``_walked_tape``), and the
    gradients' GEMMs (``layer_grads``), with none of the general path's routing, casts or copies: a
    short layer's backward is mostly such host work (re-measured by ``python -m benchmarks.host``).
    A tape is kept only for one dtype throughout (``new_tape``); ``lengths``: packed sequences'."""
    from bppsa_core.numba_scan import GRUWalk, LSTMWalk

    w = LayerWeights(*weights)
    if grad_out is not None and lengths is not None:
        grad_out = grad_out * _keep(lengths, grad_out.shape[0], grad_out)  # constants past each end
    g_last = _last_grad(grad_out, grad_hn, tape.hidden)
    steps = tape.gates.shape[0]
    if tape.cells is None:  # a GRU's
        walk = GRUWalk(tape.gates, tape.states, w.w_hh, grad_out, lengths)
        deltas, first = _walked_tape(walk, steps, g_last, (3, 3))
    else:
        g_c_last = torch.zeros_like(g_last) if grad_cn is None else grad_cn
        walk = LSTMWalk(tape.gates, tape.states[1:], w.w_hh, grad_out, tape.cells, lengths)
        deltas, first = _walked_tape(walk, steps, torch.stack((g_last, g_c_last)), (4,))
    dx, dw = layer_grads(deltas, x, tape.hidden[:-1], w, need_input)
    if not need_state:
        return dx, None, None, _weight_grads(dw)
    g0 = first()  # the walk's own: no copy
    g_h0, g_c0 = (g0, None) if tape.cells is None else g0
    return dx, g_h0, g_c0, _weight_grads(dw)


def _weight_grads(w: LayerWeights) -> list[Tensor]:
    """A layer's weight gradients as the list its weights came in: without biases, two."""
    return [t for t in (w.w_ih, w.w_hh, w.b_ih, w.b_hh) if t is not None]


def injected(grad_out: Tensor | None) -> Tensor | None:
    """The gradients the chain injects along its length, from the outputs' (T, B, H): u_0 = 0
    (nothing reaches h_0 from outside), then u_1 .. u_{T-1}; u_T is where the scan starts."""
    if grad_out is None:
        return None
    return torch.cat((torch.zeros_like(grad_out[:1]), grad_out[:-1]))


def _last_grad(u: Tensor | None, u_last: Tensor | None, h: Tensor) -> Tensor:
    """dL/dh_T: what reaches the last state from the outputs and from h_n, contiguous: a gradient
    autograd expanded (a sum's) would have the compiled walks compile a second build for its strides."""
    parts = [t for t in (None if u is None else u[-1], u_last) if t is not None]
    return sum(parts[1:], parts[0]).contiguous() if parts else torch.zeros_like(h[-1])


def _fused_layer(
    config: LayerConfig,
    cell: Cell,
    x: Tensor,
    h_prev: PreviousStates,
    h: Tensor,
    w: LayerWeights,
    u: Tensor | None,
    g_last: Tensor,
    c0: Tensor | None,
    g_c_last: Tensor | None,
    lengths: Tensor | None,
    keep: Tensor | None,
) -> tuple[Deltas, Callable[[], Tensor]] | None:
    """A layer's input- and hidden-side pre-activation gradients (``deltas(t)`` for slices of steps)
    and its g_0 (``first()``, once ``layer_grads`` has taken the deltas; an LSTM's (dL/dh_0,
    dL/dc_0)), or None. ``g_last``, ``g_c_last``: the gradients of h_T and (an LSTM) c_T;
    ``lengths`` and ``keep`` (``_keep``): packed sequences' (the compiled kernels take them, the
    Triton kernels do not), or None.

    Where the layer's strategy resolves to "triton" (``dispatch.resolve``: "triton" itself, or
    "auto" on a GPU) and the kernels take the layer and run on its device: the fused Triton kernels
    of an RNN, a GRU or an LSTM (``bppsa_core.triton.rnn_layer_backward`` / ``gru_layer_backward`` /
    ``lstm_layer_backward``, the LSTM's from its gates and cell states recomputed). Where it
    resolves to "numba" ("auto" on the CPU): an LSTM's fused compiled backward in one call from its gates
    recomputed (``numba_scan.lstm_layer_backward``; a layer whose forward kept them takes
    ``_taped_backward`` instead), and, where the compiled scan is one chunk, an RNN's walked block
    by block from its outputs (``numba_scan.RNNWalk``, ``_walked_tape``) and a GRU's from its factors
    (``_walked``). Everything else
    goes through ``scan``, which also gives the strategies' errors.
    """
    steps, batch, hidden = h.shape
    lstm = isinstance(cell, LSTMCell)
    strategy, chunk = config.options.strategy, config.options.chunk
    dtypes = (h.dtype, w.w_hh.dtype, g_last.dtype)
    chosen, fits, compiled = _route(cell, strategy, h.shape, h.device, *dtypes)
    if compiled:
        if lstm:
            from bppsa_core import numba_scan

            gates = cell.activations(x, h_prev.whole(), w)
            delta, g0 = numba_scan.lstm_layer_backward(gates, h, c0, w.w_hh, g_last, g_c_last, u, lengths)
            return (lambda t: (delta[t],) * 2), (lambda: g0)  # one object: the biases summed once
        if _chunk(config, steps, batch, hidden, cell.gates) < steps:  # the stored chain's chunked scan
            return None
        if isinstance(cell, RNNCell):  # its factors read off the outputs inside the walk
            from bppsa_core.numba_scan import RNNWalk

            walk = RNNWalk(h, w.w_hh, cell.nonlinearity == "relu", u, lengths, outputs=h_prev.outputs)
            return _walked_tape(walk, steps, g_last, (1,))
        return _walked(cell, x, h_prev, w, u, g_last, keep)
    if chosen != "triton" or not fits or keep is not None or not dispatch.kernels_run_on(h.device):
        return None
    from bppsa_core import triton as triton_kernels

    chunk = chunk or dispatch.default_chunk(steps)

    def kernels() -> tuple[Deltas, Callable[[], Tensor]]:
        if lstm:  # the gates from their two GEMMs and one kernel, the cell states from them, the scan
            gates = triton_kernels.lstm_gates(cell.gate_sums(x, h_prev.whole(), w), w.b_hh)
            cells = triton_kernels.lstm_cells(gates, c0)
            g0, delta = triton_kernels.lstm_layer_backward(gates, cells, w.w_hh, g_last, g_c_last, u, chunk)
            return (lambda t: (delta[t],) * 2), (lambda: g0)  # one object: the biases summed once
        if isinstance(cell, RNNCell):
            g0, g_in = triton_kernels.rnn_layer_backward(h, w.w_hh, g_last, u, cell.nonlinearity, chunk)
            g_hid = g_in
        else:
            whole = h_prev.whole()
            gi, gh = cell.pre_activations(x, whole, w)
            g0, g_in, g_hid = triton_kernels.gru_layer_backward(gi, gh, whole, w.w_hh, g_last, u, chunk)
        if g_hid is g_in:  # an RNN: one pre-activation, one object, so the biases are summed once
            return (lambda t: (g_in[t],) * 2), (lambda: g0)
        return (lambda t: (g_in[t], g_hid[t])), (lambda: g0)

    return dispatch.with_kernels(strategy, h.device, kernels, lambda: None)


def _route(
    cell: Cell, strategy: str, shape: torch.Size, device: torch.device, *dtypes: torch.dtype
) -> tuple[str, bool, bool]:
    """How a layer's backward runs (``_fused_layer``; ``new_tape`` asks the same): the concrete
    strategy, whether the Triton kernels take the layer, and whether the compiled CPU kernels run
    it (the strategy resolves to "numba" and they take and run it). ``shape``: (T, B, H)."""
    lstm = isinstance(cell, LSTMCell)
    return _routed(cell.gates, lstm, strategy, tuple(shape), device, dtypes, dispatch.kernels_usable(device))


@functools.lru_cache(maxsize=256)  # asked once or twice a layer call: a short layer's work costs as much
def _routed(
    gates: int,
    lstm: bool,
    strategy: str,
    shape: tuple[int, int, int],
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
    _usable: bool,
) -> tuple[str, bool, bool]:
    """``_route``'s answer: a function of these and of whether the Triton kernels are usable on the
    device (``dispatch.kernels_usable``, which "auto" reads: ``_usable`` keys it)."""
    steps, batch, hidden = shape
    if lstm:
        fits = dispatch.lstm_kernels_take(hidden, *dtypes)
    else:
        fits = dispatch.kernels_take(gates, hidden, *dtypes)
    takes = dispatch.numba_takes(gates, *dtypes, lstm=lstm)
    chosen = dispatch.resolve(strategy, steps, batch, hidden, device, fits, takes)
    return chosen, fits, chosen == "numba" and takes and dispatch.runs_on("numba", device)


def _walked(
    cell: Cell,
    x: Tensor,
    h_prev: PreviousStates,
    w: LayerWeights,
    u: Tensor | None,
    g_last: Tensor,
    keep: Tensor | None,
) -> tuple[Deltas, Callable[[], Tensor]]:
    """A layer's scan as one chunk of the compiled kernels (each sample walked once, samples in
    parallel), made block by block from the end as ``layer_grads`` asks for the deltas: a block's
    factors (the cell's vectorized PyTorch code; with ``keep``, the identity past each sequence's
    end), its walk from the gradient at its end
    (``numba_scan.chunked_scan``), its pre-activation gradients. Only a block's worth ever exists;
    the walk's output and the side-by-side states reuse one buffer each, block after block
    (``jacobians.reusing_buffers``, whose scope ``bppsa_backward`` opens).

    Returns ``deltas(t)`` for slices asked for from the last one down (the last again starts over)
    and ``first()``, g_0 once the first block has been walked.
    """
    from bppsa_core import numba_scan

    def walk(lo: int, hi: int, g_end: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        kept = None if keep is None else keep[lo:hi]
        factors = cell.factors(x[lo:hi], h_prev[lo:hi], h_prev.outputs(lo, hi), w, keep=kept)
        chain = cell.chain(factors, w)
        offsets = None  # element k's offset is u_k = dL/dh_k from outside (u_0 = 0)
        if u is not None:
            offsets = u[lo - 1 : hi - 1] if lo else torch.cat((torch.zeros_like(u[:1]), u[: hi - 1]))
        out = buffer("walk", (hi - lo + 1, *g_last.shape), g_last)
        g = numba_scan.chunked_scan(
            chain.scales, chain.weights, g_end, offsets, hi - lo, chain.diagonal, out=out
        )
        # g_0 not a view: the next block's walk overwrites the buffer
        return cell.preactivation_grads(g[1:], factors), g[0].clone()

    return _from_the_end(h_prev.shape[0], g_last, walk)


def _walked_tape(
    walk: RNNWalk | GRUWalk | LSTMWalk, steps: int, g_start: Tensor, widths: tuple[int, ...]
) -> tuple[Deltas, Callable[[], Tensor]]:
    """A layer's compiled backward over its tape (``numba_scan.GRUWalk`` / ``LSTMWalk``; an RNN's
    over its outputs, ``RNNWalk``), made block by block from the end as ``layer_grads`` asks for
    the deltas, a block's in buffers reused block after block (``jacobians.reusing_buffers``): the
    deltas of T steps never exist at once, and a block's are still in the cache when
    ``layer_grads`` takes them (re-measured by
    ``python -m benchmarks.backward --model lstm --threads 1 --strategies numba``). ``g_start``:
    dL/dh_T (B, H), an LSTM's stacked with dL/dc_T (2, B, H); ``widths``: the delta buffers' widths
    in H, an RNN's or LSTM's one (H or 4H, both sides: the biases summed once), a GRU's input and
    hidden sides (3H each). ``first()`` is g_0 shaped as ``g_start``, a tensor of the walk's own."""

    def block(lo: int, hi: int, g_end: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        batch, hidden = g_end.shape[-2:]
        made = [buffer(f"tape deltas {i}", (hi - lo, batch, n * hidden), g_end) for i, n in enumerate(widths)]
        g = torch.empty_like(g_end)  # not in place: a walk started over from the end reads g_last again
        walk(lo, hi, g_end, g, *made)
        return (made[0], made[-1]), g

    return _from_the_end(steps, g_start, block)


def _from_the_end(
    steps: int, g_last: Tensor, walk: Callable[[int, int, Tensor], tuple[tuple[Tensor, Tensor], Tensor]]
) -> tuple[Deltas, Callable[[], Tensor]]:
    """``deltas(t)`` and ``first()`` of a backward walked block by block: ``walk(lo, hi, g)`` walks
    steps hi - 1 down to lo from ``g``, the gradient after them, and returns the block's
    pre-activation gradients and the gradient before them. ``deltas`` takes slices from the last
    one down (the last again starts over); ``first()`` is g_0 once the first block is walked."""
    state = {"g": g_last, "next": steps}

    def deltas(t: slice) -> tuple[Tensor, Tensor]:
        lo, hi, _ = t.indices(steps)
        if hi == steps:
            state["g"] = g_last
        elif hi != state["next"]:
            raise RuntimeError(f"steps {lo}..{hi} asked for; a walk from the end needs ..{state['next']}")
        block, state["g"] = walk(lo, hi, state["g"])
        state["next"] = lo
        return block

    def first() -> Tensor:
        if state["next"] != 0:
            raise RuntimeError("g_0 is known once every block has been walked")
        return state["g"]

    return deltas, first


# ------------------------------------------------------------------------------------------- tangent


def bppsa_tangent(
    config: LayerConfig,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    lengths: Tensor | None,
    out: Tensor,
    tangents: list[Tensor | None],
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The tangents of a layer's outputs, last h and last c, from those of (x, h0, c0, *weights).

    The pre-activations' tangents from x's and the weights' are a few GEMMs, the cell turns them
    into each step's own part c_t (``direct_tangent``), and the scan over the transposed Jacobians
    carries the state's tangent from v_0 = (dh0, dc0) through all steps.
    """
    with flush_denormals(x.device):
        dtype = weights[0].dtype
        x, h0, h, c0 = (None if t is None else t.to(dtype) for t in (x, h0, out, c0))
        tangents = [None if t is None else t.to(dtype) for t in tangents]
        dx, dh0, dc0, *dweights = tangents
        cell, w = cell_of(config.mode), LayerWeights(*weights)
        dw = LayerWeights(*dweights)
        steps, batch, hidden = h.shape
        keep = _keep(lengths, steps, h)
        h_prev = PreviousStates(h0, h).whole()
        factors = cell.factors(x, h_prev, h, w, c0, keep)
        rows = w.w_ih.shape[0]
        e_in, e_hid = h.new_zeros((steps, batch, rows)), h.new_zeros((steps, batch, rows))
        if dx is not None:
            e_in += linear(dx, w.w_ih)
        if dw.w_ih is not None:
            e_in += linear(x, dw.w_ih)
        if dw.b_ih is not None:
            e_in += dw.b_ih
        if dw.w_hh is not None:
            e_hid += linear(h_prev, dw.w_hh)
        if dw.b_hh is not None:
            e_hid += dw.b_hh
        direct = cell.direct_tangent(e_in, e_hid, factors)
        v0 = torch.zeros_like(h0) if dh0 is None else dh0
        if c0 is not None:
            v0 = torch.cat((v0, torch.zeros_like(c0) if dc0 is None else dc0), -1)
        v = forward_scan(cell.tangent_chain(factors, w), v0, direct, config.options)
        d_out = v[1:, :, :hidden] * keep if keep is not None else v[1:, :, :hidden].clone()
        return (
            d_out,
            v[-1, :, :hidden].clone(),
            (v[-1, :, hidden:].clone() if c0 is not None else None),
        )


# ------------------------------------------------------------------------------- higher derivatives


def differentiable_vjp(
    config: LayerConfig,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    lengths: Tensor | None,
    weights: list[Tensor],
    grads: tuple[Tensor | None, ...],
) -> tuple[Tensor | None, ...]:
    """The layer's vector-Jacobian product through PyTorch's own differentiable forward: exact to
    every order, for gradients that are themselves differentiated."""
    lstm = c0 is not None

    def forward(x: Tensor, h0: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        c, w = (rest[0] if lstm else None), list(rest[int(lstm) :])
        if lengths is None:
            out, h, c = native_forward(config.mode, x, h0, c, w, None, config.segment)
        else:
            out, h, c = stepwise_forward(config.mode, x, h0, c, w, lengths)
        return (out, h, c) if lstm else (out, h)

    primals = (x, h0, *((c0,) if lstm else ()), *weights)
    outputs, vjp = torch.func.vjp(forward, *primals)
    cotangents = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outputs, grads, strict=False))
    result = vjp(cotangents)
    if not lstm:
        return (result[0], result[1], None, *result[2:])
    return tuple(result)
