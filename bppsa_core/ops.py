"""One layer call as ``torch`` operators: the glue between ``bppsa_core.layer``'s maths and PyTorch.

``layer`` runs one layer in one direction as an ``autograd.Function`` whose work is done by three
operators registered with ``torch.library``, so that ``torch.compile`` (which sees their shapes
through the fake implementations) and ``torch.jit.trace`` treat each as one opaque step:

* ``bppsa::layer_forward``: ``layer.solved_forward``, PyTorch's fused kernel in segments or a Newton
  solve parallel in time;
* ``bppsa::layer_backward``: ``layer.bppsa_backward``, the chain of Jacobians scanned;
* ``bppsa::layer_tangent``: ``layer.bppsa_tangent``, forward-mode differentiation by the same scan
  over the transposed elements.

In plain eager work (``_plain``: no compiler, tracer, ``torch.func`` transform, dispatch mode, tensor
subclass or meta device) the call skips the operators: an ``_EagerLayer`` runs ``bppsa_core.layer``'s
maths directly, since the operators' dispatch costs as much as a short layer's work.

Under ``vmap`` each operator runs once per mapped index (``_loop_vmap``). Optional results are
returned as empty tensors (operators return tensors only); weights and tangents are separate
arguments, not lists, which vmap's fallback for batched gradients needs. A gradient that is itself
differentiated goes through ``layer.differentiable_vjp`` instead of the operators.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from bppsa_core import layer as bppsa_layer
from bppsa_core.dispatch import ScanOptions
from bppsa_core.layer import LayerConfig
from bppsa_core.newton import SolverOptions, SolveStats

# ----------------------------------------------------------------------------------------- operators


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _present(*tensors: Tensor | None) -> list[Tensor]:
    return [t for t in tensors if t is not None]


@torch.library.custom_op("bppsa::layer_forward", mutates_args=())
def _forward_op(
    # the layer call's tensors
    x: Tensor, h0: Tensor, c0: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None,
    b_hh: Tensor | None, lengths: Tensor | None, guess: Tensor | None,
    # the layer, its forward's solver and the scan (``LayerConfig``)
    mode: str, segment: int, solver: str, tol: float | None, max_iters: int, sweeps: int,
    strategy: str, chunk: int | None, levels: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    solving = SolverOptions(solver, tol, max_iters, sweeps)
    config = LayerConfig(mode, segment, ScanOptions(strategy, chunk, levels), solving)
    weights = _present(w_ih, w_hh, b_ih, b_hh)
    out, h, c, stats = bppsa_layer.solved_forward(config, x, h0, c0, weights, lengths, guess)
    # an operator's results may not be views of its others; its stats stay on x's device, as a
    # compiled graph with a CPU result is not captured by inductor's CUDA graphs ("reduce-overhead")
    stats = stats if isinstance(stats, Tensor) else stats.as_tensor(x.device)  # a tensor: captured
    return out, h.clone(), (_empty(h) if c is None else c.clone()), stats


@_forward_op.register_fake
def _(x, h0, c0, w_ih, w_hh, b_ih, b_hh, *rest):  # rest: lengths .. levels
    out = x.new_empty((x.shape[0], x.shape[1], w_hh.shape[1]))
    # on x's device, as the real one, in ``SolveStats.as_tensor``'s layout: one entry per field
    stats = torch.empty((len(fields(SolveStats)),), dtype=torch.float64, device=x.device)
    return out, h0.new_empty(h0.shape), (_empty(h0) if c0 is None else c0.new_empty(c0.shape)), stats


@torch.library.custom_op("bppsa::layer_backward", mutates_args=())
def _backward_op(
    # the layer call's tensors, its outputs and their gradients
    x: Tensor, h0: Tensor, c0: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None,
    b_hh: Tensor | None, lengths: Tensor | None, out: Tensor,
    grad_out: Tensor | None, grad_hn: Tensor | None, grad_cn: Tensor | None,
    # the layer and the scan (``LayerConfig``), and whether x's gradient is needed
    mode: str, strategy: str, chunk: int | None, levels: int | None, need_input: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    config = LayerConfig(mode, options=ScanOptions(strategy, chunk, levels))
    weights = _present(w_ih, w_hh, b_ih, b_hh)
    dx, dh0, dc0, dw = bppsa_layer.bppsa_backward(
        config, x, h0, c0, weights, lengths, out, grad_out, grad_hn, grad_cn, need_input
    )
    biases = dw[2:] if len(dw) == 4 else [_empty(h0), _empty(h0)]
    return (
        (_empty(h0) if dx is None else dx),
        dh0,
        (_empty(h0) if dc0 is None else dc0),
        dw[0],
        dw[1],
        *biases,
    )


@_backward_op.register_fake
def _(x, h0, c0, w_ih, w_hh, b_ih, b_hh, *rest):  # rest: lengths .. levels, need_input
    dtype, need_input = w_hh.dtype, rest[-1]

    def like(t: Tensor | None) -> Tensor:
        return _empty(h0) if t is None else t.new_empty(t.shape, dtype=dtype)

    return (
        (like(x) if need_input else _empty(h0)),
        like(h0),
        like(c0),
        like(w_ih),
        like(w_hh),
        like(b_ih),
        like(b_hh),
    )


@torch.library.custom_op("bppsa::layer_tangent", mutates_args=())
def _tangent_op(
    # the layer call's tensors and outputs, then the tangents of the tensors
    x: Tensor, h0: Tensor, c0: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None,
    b_hh: Tensor | None, lengths: Tensor | None, out: Tensor,
    dx: Tensor | None, dh0: Tensor | None, dc0: Tensor | None,
    dw_ih: Tensor | None, dw_hh: Tensor | None, db_ih: Tensor | None, db_hh: Tensor | None,
    # the layer and the scan (``LayerConfig``)
    mode: str, strategy: str, chunk: int | None, levels: int | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    config = LayerConfig(mode, options=ScanOptions(strategy, chunk, levels))
    weights = _present(w_ih, w_hh, b_ih, b_hh)
    tangents = [dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh]
    d_out, d_h, d_c = bppsa_layer.bppsa_tangent(config, x, h0, c0, weights, lengths, out, tangents)
    return d_out, d_h, _empty(d_h) if d_c is None else d_c


@_tangent_op.register_fake
def _(x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, out, *rest):  # rest: the tangents, then the scan's
    dtype = w_hh.dtype
    d_c = _empty(h0) if c0 is None else c0.new_empty(c0.shape, dtype=dtype)
    return out.new_empty(out.shape, dtype=dtype), h0.new_empty(h0.shape, dtype=dtype), d_c


def _loop_vmap(op: Any) -> Any:
    """A vmap rule for ``op``: the operator once per mapped index, results stacked along dim 0."""

    def rule(info: Any, in_dims: tuple, *args: Any) -> tuple[Any, Any]:
        def take(i: int) -> list[Any]:
            return [
                a if d is None or a is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)
            ]

        results = [op(*take(i)) for i in range(info.batch_size)]
        return tuple(torch.stack(r) for r in zip(*results, strict=True)), (0,) * len(results[0])

    return rule


for _op in (_forward_op, _backward_op, _tangent_op):
    torch.library.register_vmap(_op, _loop_vmap(_op))


def _plain(*tensors: Tensor | None) -> bool:
    """Whether a layer call is plain eager work, which runs ``bppsa_core.layer``'s maths directly
    (from an ``_EagerLayer``): the operators' dispatch (schema binding, redispatch through the
    autograd keys, the config rebuilt from its fields) and ``Function.apply``'s argument binding
    cost as much as a short layer's work (re-measured by ``python -m benchmarks.host``). The
    operators stay wherever something must see one opaque step: ``torch.compile``, ``jit.trace``,
    the ``torch.func`` transforms and the older vmap of ``autograd.functional`` (their batching
    rules), a dispatch mode (fake tensors, flop counters), a tensor subclass and the meta device;
    ``tensors``: the call's inputs besides the weights (None for one not given)."""
    if (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
        or _get_current_dispatch_mode() is not None
    ):
        return False
    for t in tensors:  # a loop, not all() over a generator: asked twice a layer call
        if t is not None and (type(t) is not Tensor or t.is_meta or _legacy_batched(t)):
            return False
    return True


_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


# ------------------------------------------------------------------------------------------ autograd


def _squeezed(*states: Tensor | None) -> list[Tensor | None]:
    """A layer call's states and their gradients or tangents, (1, B, H) as the call takes them
    (``layer``), as (B, H): the backward's and the tangent's shapes."""
    return [None if s is None else s[0] for s in states]


def _unsqueezed(*states: Tensor | None) -> list[Tensor | None]:
    """``_squeezed``'s inverse: (B, H) gradients or tangents as the call's (1, B, H)."""
    return [None if s is None else s.unsqueeze(0) for s in states]


# Bytes from which NumPy asks the system for huge pages for an array (its own threshold, 4 MiB).
_HUGE_PAGE_BYTES = 4 << 20


def _copy(out: Tensor) -> Tensor:
    """A copy of a layer's outputs for the caller to own. A large contiguous one on a CPU is made as
    the compiled forward makes its outputs (``numba_forward.new_outputs``: NumPy's memory, in huge
    pages) where that module is loaded: in a tensor's fresh memory, which faults a page every 4 KB,
    the faults cost most of the copy and up to half of a long layer's training forward
    (re-measured by ``python -m benchmarks.forward --tables compiled --T 30000``)."""
    compiled = sys.modules.get("bppsa_core.numba_forward")  # loaded where the compiled forward runs
    large = out.numel() * out.element_size() >= _HUGE_PAGE_BYTES
    if compiled is None or out.dtype not in compiled.NUMPY_DTYPES or out.device.type != "cpu":
        return out.clone()
    if not large or not out.is_contiguous():
        return out.clone()
    return compiled.new_outputs(*out.shape, out.dtype).copy_(out)


def _keep(ctx: Any, inputs: tuple, output: tuple, out: Tensor, tape: bppsa_layer.Tape | None = None) -> None:
    """What a layer call's backward and tangent read: its inputs and ``out``, its outputs h_1..h_T
    (``output[0]``, or a copy the call did not return: ``_EagerLayer``), and the ``tape`` a compiled
    GRU or LSTM forward kept (``_EagerLayer``), saved last (``Tape.tensors``). The tangent's copy is
    made only where forward-mode differentiation is on (a dual level entered): the one place a jvp
    runs."""
    x, h0, c0, lengths, _guess, config, *weights = inputs
    ctx.config = config
    ctx.taped = tape is not None
    ctx.save_for_backward(x, h0, c0, lengths, out, *weights, *(() if tape is None else tape.tensors()))
    if forward_ad._current_level >= 0:
        ctx.save_for_forward(x, h0, c0, lengths, out, *weights)
    ctx.set_materialize_grads(False)
    # no c (an RNN's, a GRU's) and the stats, where they are tensors (``_EagerLayer``'s may not be)
    fixed = [t for t in (output[2:] if c0 is None else output[3:]) if isinstance(t, Tensor)]
    if fixed:
        ctx.mark_non_differentiable(*fixed)


class _CompiledLayer(torch.autograd.Function):
    """One layer call; inputs (x, h0, c0, lengths, guess, config, *weights), outputs (out, h_n, c_n,
    stats), the last ``newton.SolveStats.as_tensor`` (not differentiable)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        lengths: Tensor | None,
        guess: Tensor | None,
        config: LayerConfig,
        *weights: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        w_ih, w_hh, b_ih, b_hh = (*weights, None, None)[:4]
        o, s = config.options, config.solver
        return torch.ops.bppsa.layer_forward(
            x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, guess, config.mode, config.segment,
            s.method, s.tol, s.max_iters, s.sweeps, o.strategy, o.chunk, o.levels,
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        _keep(ctx, inputs, output, output[0])

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor | None, grad_hn: Tensor | None, grad_cn: Tensor | None, _stats: Any
    ) -> tuple:
        x, h0, c0, lengths, out, *weights = ctx.saved_tensors
        tape = None
        if ctx.taped:  # saved after the weights (``_keep``)
            *weights, gates, cells, hidden = weights
            tape = bppsa_layer.Tape.of(gates, cells, hidden)
        config: LayerConfig = ctx.config
        if c0 is None:
            grad_cn = None
        if grad_out is None and grad_hn is None and grad_cn is None:
            return (None,) * (6 + len(weights))
        h0, c0, grad_hn, grad_cn = _squeezed(h0, c0, grad_hn, grad_cn)
        if torch.is_grad_enabled():  # the gradient will itself be differentiated
            grads = bppsa_layer.differentiable_vjp(
                config, x, h0, c0, lengths, weights, (grad_out, grad_hn, grad_cn)
            )
            return (grads[0], *_unsqueezed(*grads[1:3]), None, None, None, *grads[3:])
        need = ctx.needs_input_grad[-6 - len(weights) :]  # an ``_EagerLayer``'s has ``record``, ``own`` first
        if _plain(x, h0, grad_out, grad_hn, grad_cn):
            need_state = need[1] or (c0 is not None and need[2])
            dx, dh0, dc0, dw = bppsa_layer.bppsa_backward(
                config, x, h0, c0, weights, lengths, out, grad_out, grad_hn, grad_cn, need[0], tape,
                need_state,
            )  # fmt: skip
        else:
            o = config.options
            dx, dh0, dc0, *dw = torch.ops.bppsa.layer_backward(
                x, h0, c0, *(*weights, None, None)[:4], lengths, out, grad_out, grad_hn, grad_cn,
                config.mode, o.strategy, o.chunk, o.levels, need[0],
            )  # fmt: skip
        dh0, dc0 = _unsqueezed(dh0, dc0 if c0 is not None else None)
        return (dx if need[0] else None, dh0, dc0, None, None, None, *dw[: len(weights)])


class _Layer(_CompiledLayer):
    """``_CompiledLayer`` with forward-mode differentiation: the tangent is a scan too."""

    @staticmethod
    def jvp(ctx: Any, dx: Tensor | None, dh0: Tensor | None, dc0: Tensor | None, *rest: Any) -> tuple:
        x, h0, c0, lengths, out, *weights = ctx.saved_tensors
        config: LayerConfig = ctx.config
        dweights = (*rest[3:], None, None)[:4]
        h0, c0, dh0, dc0 = _squeezed(h0, c0, dh0, dc0)
        if _plain(x, h0, dx, dh0, dc0):
            tangents = [dx, dh0, dc0, *dweights]
            d_out, d_h, d_c = bppsa_layer.bppsa_tangent(config, x, h0, c0, weights, lengths, out, tangents)
        else:
            o = config.options
            d_out, d_h, d_c = torch.ops.bppsa.layer_tangent(
                x, h0, c0, *(*weights, None, None)[:4], lengths, out, dx, dh0, dc0, *dweights,
                config.mode, o.strategy, o.chunk, o.levels,
            )  # fmt: skip
        return d_out, *_unsqueezed(d_h, d_c if c0 is not None else None), None


class _EagerLayer(torch.autograd.Function):
    """``_Layer`` in plain eager work (``_plain``): its forward runs ``layer.solved_forward`` itself
    and takes its context, so that ``apply`` does not bind the arguments to the forward's signature;
    not usable under the ``torch.func`` transforms, which ``_plain`` rules out. Its first inputs:
    ``record``, whether the call is recorded for a backward (the grad mode at the call; inside the
    forward it is off): then a compiled GRU or LSTM forward keeps its gates and states for the backward
    (``layer.Tape``), saved with the rest (``_keep``); ``own``, ``layer``'s ``own_output``. Its results are
    ``solved_forward``'s as they come, c None without one and the stats a ``SolveStats`` (a tensor
    inside a capture): outputs autograd passes through, with no empty tensor or copy made for them."""

    @staticmethod
    def forward(ctx: Any, record: bool, own: bool, *inputs: Any) -> tuple[Tensor, Tensor, Tensor | None, Any]:
        x, h0, c0, lengths, guess, config, *weights = inputs
        tape = None
        recorded = record and any(ctx.needs_input_grad)
        if recorded:
            tape = bppsa_layer.new_tape(config, x, h0, c0, weights, lengths)
        output = bppsa_layer.solved_forward(config, x, h0, c0, weights, lengths, guess, tape)
        kept = output[0]
        if tape is not None:  # the tape's copy of the outputs, which the kernel wrote beside them
            kept = tape.hidden[1:]
        elif own and recorded:
            output = (_copy(kept), *output[1:])
        _keep(ctx, inputs, output, kept, tape)
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        return (None, None, *_Layer.backward(ctx, *grads))

    @staticmethod
    def jvp(ctx: Any, _record: Any, _own: Any, *tangents: Any) -> tuple:
        return _Layer.jvp(ctx, *tangents)


def layer(
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    config: LayerConfig,
    lengths: Tensor | None = None,
    guess: Tensor | None = None,
    own_output: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, SolveStats | Tensor]:
    """One layer in one direction, differentiable by BPPSA: x (T, B, I) time-major, h0 and c0 (an
    LSTM's, else None) (1, B, H), the layer's slice of a module's states, as PyTorch's kernel takes
    and gives them (no view made on the way: ``benchmarks.host``, the forward), ``weights``
    PyTorch's (w_ih, w_hh[, b_ih, b_hh]), ``lengths`` (B,) sorted longest first or None, ``guess`` a
    Newton solver's first iterate of the outputs (T, B, H) or None. Returns the outputs (T, B, H),
    the last h and c (or None) (1, B, H), and what the forward took: a ``newton.SolveStats``, or its
    ``as_tensor`` from the operators or a capture.
    ``own_output``: the outputs returned are not what the backward reads, so that the caller may
    change them in place (a module's top layer, as ``torch.nn``'s): a copy where the backward keeps
    them, none where a tape holds its own (a GRU's, an LSTM's).
    """
    # torch.compile traces autograd.Functions, but not their jvp: compiled graphs get the same
    # function without it (forward-mode differentiation of a compiled graph is not supported anyway).
    # Plain eager work skips the operators (``_plain``).
    if torch.compiler.is_compiling() or not _plain(x, h0):
        function = _CompiledLayer if torch.compiler.is_compiling() else _Layer
        out, h, c, stats = function.apply(x, h0, c0, lengths, guess, config, *weights)
        if own_output:
            out = out.clone()
    elif not torch.is_grad_enabled() and forward_ad._current_level < 0:
        # inference: nothing records or carries a tangent, so no Function (its call costs as much as
        # a short layer's forward) and no copy of the outputs, which no backward keeps
        out, h, c, stats = bppsa_layer.solved_forward(config, x, h0, c0, weights, lengths, guess)
    else:
        record = torch.is_grad_enabled()
        out, h, c, stats = _EagerLayer.apply(record, own_output, x, h0, c0, lengths, guess, config, *weights)
    return out, h, (c if c0 is not None else None), stats
