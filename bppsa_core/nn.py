"""Drop-in ``torch.nn.RNN`` / ``GRU`` / ``LSTM`` whose backward pass is a BPPSA scan.

The modules subclass PyTorch's, so constructor arguments and their checks, parameter names,
``state_dict``, the forward signature and its input checks are PyTorch's own. With
``backward="bppsa"`` (the default) the forward runs PyTorch's fused kernel (cuDNN on a GPU) one
layer and one direction at a time (``bppsa_core.layer``), so that every layer's states are kept,
and each layer's backward scans its chain of Jacobians:

1. recover the per-step factors from the saved states (``bppsa_core.jacobians``),
2. form one Jacobian per step, kept factored (``bppsa_core.chain``),
3. scan the affine chain ``g_{t-1} = g_t @ J_t + u_{t-1}`` (``bppsa_core.scan``), where u_t is the
   gradient that reaches h_t from outside: ``output``'s gradient on the top layer, the gradient of
   the layer above's input below it, plus ``h_n``'s gradient at the last step,
4. turn g into every input, state, weight and bias gradient with a few large matmuls.

Everything ``torch.nn`` takes is taken: stacked layers, ``bidirectional=True`` (the second direction
is the same layer run over each sequence reversed within its length), dropout between layers in
training (read from ``self.dropout`` at every call), ``PackedSequence`` input (steps past a
sequence's end are identity elements of the chain), unbatched input, any sequence length (the
forward runs in segments of at most ``segment`` steps, default ``layer.SEGMENT``), double
backward, forward-mode AD, ``torch.func`` transforms, ``torch.compile`` and ``torch.jit.trace``.

``forward_solver="newton"`` (or ``"quasi-newton"``) solves each layer's forward parallel in time by
Newton iterations over the same scans (``bppsa_core.newton``; ``newton_tol``, ``newton_iters``,
``newton_guess``: the first iterate, "zeros", "previous" (the last forward's outputs when the
shapes match) or "sweeps" (Picard sweeps from zeros, ``newton.MAX_SWEEPS`` at most)); the backward is
unchanged. What each layer's solve took is in ``solver_stats`` after every forward.
Not taken: an LSTM with ``proj_size > 0`` (refused at construction; ``backward="bptt"`` runs it).
Under ``strategy="auto"``, a module of a width at which ``torch.nn``'s own kernels (cuDNN's
on a GPU) are faster than any BPPSA path is ``torch.nn``'s (``dispatch.torch_nn_instead``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.nn.functional import dropout
from torch.nn.utils.rnn import PackedSequence

from bppsa_core import layer as bppsa_layer
from bppsa_core.dispatch import ScanOptions, compiled_forward_takes, torch_nn_instead
from bppsa_core.layer import SEGMENT, LayerConfig
from bppsa_core.newton import DEFAULT_MAX_ITERS, MAX_SWEEPS, NATIVE, SolverOptions, SolveStats
from bppsa_core.ops import layer

BACKWARDS: tuple[str, ...] = ("bppsa", "bptt")
GUESSES: tuple[str, ...] = ("zeros", "previous", "sweeps")

State = Tensor | tuple[Tensor, Tensor]


class _BPPSAMixin:
    """Shared by RNN, GRU and LSTM: option checks and the forward that runs the layers."""

    # How torch.nn's forward of this class words a wrong input rank.
    _RANK_MESSAGE = "RNN: Expected input to be 2D or 3D, got {dim}D tensor instead"

    def __init__(
        self,
        *args: Any,
        backward: str = "bppsa",
        strategy: str = "auto",
        chunk: int | None = None,
        levels: int | None = None,
        segment: int = SEGMENT,
        forward_solver: str = "native",
        newton_tol: float | None = None,
        newton_iters: int = DEFAULT_MAX_ITERS,
        newton_guess: str = "zeros",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)  # torch.nn's RNN / GRU / LSTM: its arguments, parameters and checks
        if backward not in BACKWARDS:
            raise ValueError(f"unknown backward {backward!r}; accepted: {', '.join(BACKWARDS)}")
        solver = SolverOptions(forward_solver, newton_tol, newton_iters)
        LayerConfig(
            self.mode, segment, ScanOptions(strategy, chunk, levels), solver
        )  # checked now and at every call
        if newton_guess not in GUESSES:
            raise ValueError(f"unknown newton_guess {newton_guess!r}; accepted: {', '.join(GUESSES)}")
        if backward == "bptt" and forward_solver != "native":
            raise ValueError(
                f"forward_solver={forward_solver!r} needs backward='bppsa'; accepted with backward='bptt': "
                "forward_solver='native'"
            )
        if backward == "bppsa" and self.proj_size > 0:
            raise ValueError(
                f"proj_size={self.proj_size} is not supported by backward='bppsa'; accepted: proj_size=0, "
                "or backward='bptt' (PyTorch's own backward) for an LSTM with projections"
            )
        self.backward_mode = backward
        self.strategy, self.chunk, self.levels, self.segment = strategy, chunk, levels, segment
        self.forward_solver, self.newton_tol, self.newton_iters = forward_solver, newton_tol, newton_iters
        self.newton_guess = newton_guess
        self._stats: list[SolveStats | Tensor] = []
        self._guesses: dict[int, Tensor] = {}

    def _config(self) -> LayerConfig:
        """The layer calls' config from the options as they are now (they may be set at any time)."""
        sweeps = MAX_SWEEPS if self.newton_guess == "sweeps" else 0
        # traced by Dynamo uncached: it traces into a cache anyway, and warns that it does
        make = _layer_config.__wrapped__ if torch.compiler.is_compiling() else _layer_config
        return make(
            self.mode, self.segment, self.strategy, self.chunk, self.levels,
            self.forward_solver, self.newton_tol, self.newton_iters, sweeps,
        )  # fmt: skip

    @property
    def solver_stats(self) -> list[SolveStats]:
        """What the last forward's solve took, per layer and direction (torch.nn's order of h_n):
        Newton iterations (0: the native forward), whether they converged, the last change, and the
        Picard sweeps before them."""
        return [s if isinstance(s, SolveStats) else SolveStats.from_tensor(s) for s in self._stats]

    def forward(self, input: Tensor | PackedSequence, hx: State | None = None) -> tuple[Any, State]:
        """Same contract as ``torch.nn``'s forward; the backward is BPPSA in ``bppsa`` mode, but for
        a module that "auto" leaves to ``torch.nn`` (``_torch_nn_instead``), which is its. While a
        model is exported (``torch.export``, ``torch.onnx.export``) it is ``torch.nn``'s forward,
        exported as ``torch.nn``'s is: an exported graph is run, not differentiated by BPPSA. So is
        inference that would run PyTorch's fused kernel in every layer (``_inference``, not
        ``_compiles``). A GPU sequence longer than cuDNN takes in one call runs in the module's own
        layers either way, in segments (``_beyond_one_call``)."""
        inference = self._inference()
        # the ONNX exporter's flag only under tracing, which that exporter does: asking costs imports
        if (
            self.backward_mode == "bptt"
            or (
                (self._torch_nn_instead(inference) or (inference and not self._compiles()))
                and not _beyond_one_call(input, self.batch_first)
            )
            or torch.compiler.is_exporting()
            or (torch.jit.is_tracing() and torch.onnx.is_in_onnx_export())
        ):
            self.__dict__["_stats"] = [NATIVE] * (self.num_layers * self._directions)
            return super().forward(input, hx)
        self._update_flat_weights()  # weights swapped by functional_call or a parametrization
        self._check_flags()
        lstm = self.mode == "LSTM"
        packed = isinstance(input, PackedSequence)
        if lstm and hx is not None:
            hx = _lstm_state(hx, packed)
        if packed:
            data, batch_sizes, sorted_indices, unsorted_indices = input
            if hx is None:
                hx = self._zero_state(data, int(batch_sizes[0]))
            else:
                hx = self.permute_hidden(hx, sorted_indices)
            self.check_forward_args(data, hx, batch_sizes)
            self._check_devices(data, hx)
            index, lengths = _packing(batch_sizes, data.shape[0], data.device)
            out, state = self._layers(_unpack(data, index, lengths), hx, lengths, index)
            packed = PackedSequence(_pack(out, index), batch_sizes, sorted_indices, unsorted_indices)
            return packed, self.permute_hidden(state, unsorted_indices)
        if input.dim() not in (2, 3):
            raise ValueError(self._RANK_MESSAGE.format(dim=input.dim()))
        batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:
            input = input.unsqueeze(batch_dim)
        if hx is None:
            hx = self._zero_state(input, input.shape[batch_dim])
        else:
            hx = self._check_state_rank(hx, batched)
        self.check_forward_args(input, hx, None)
        self._check_devices(input, hx)
        x = input.transpose(0, 1) if self.batch_first else input
        out, state = self._layers(x, hx)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(batch_dim)
            state = (state[0].squeeze(1), state[1].squeeze(1)) if lstm else state.squeeze(1)
        return out, state

    def _torch_nn_instead(self, inference: bool = False) -> bool:
        """Whether this call runs as ``torch.nn``'s, its fused forward and autograd's backward,
        because "auto" finds no faster BPPSA path for the module here (``dispatch.torch_nn_instead``;
        ``inference``: the call is, ``_inference``)."""
        weight = self._flat_weights[0]
        return self.forward_solver == "native" and torch_nn_instead(
            self.strategy, self.mode, self.hidden_size, weight.device, weight.dtype, inference
        )

    def _inference(self) -> bool:
        """Whether this call is inference of the native forward: nothing records, carries a tangent
        or is transformed by ``torch.func``, and it is not compiled or traced (which see one graph
        either way). Where its layers would each run PyTorch's fused kernel (not ``_compiles``),
        ``torch.nn``'s forward runs instead, the same kernel, all layers in one call, and no layer
        call's host work (``benchmarks.host``, inference)."""
        return not (
            torch.is_grad_enabled()
            or self.forward_solver != "native"
            or forward_ad._current_level >= 0
            or torch.compiler.is_compiling()
            or torch.jit.is_tracing()
            or torch._C._are_functorch_transforms_active()
        )

    def _compiles(self) -> bool:
        """Whether the layers' inference runs the compiled forward (``dispatch.compiled_forward_takes``)."""
        weight = self._flat_weights[0]
        return compiled_forward_takes(
            self.strategy, self.mode, self.hidden_size, weight.device.type, (weight.dtype,), False
        )

    def _check_flags(self) -> None:
        """The flags torch.nn's constructor keeps unchecked and its fused kernel then refuses
        (``TypeError``): ``bidirectional`` not a bool, ``num_layers`` a bool."""
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"{self.mode}: bidirectional must be a bool, got {self.bidirectional!r}")
        if isinstance(self.num_layers, bool):
            raise TypeError(f"{self.mode}: num_layers must be an int, got {self.num_layers!r}")

    def _check_devices(self, x: Tensor, hx: State) -> None:
        """torch.nn's device checks, in its words (its fused kernel makes them; the layers run theirs
        one by one, some as operators a meta tensor passes through unchecked)."""
        weight = self._flat_weights[0]
        if x.device != weight.device:
            raise RuntimeError(
                "Input and parameter tensors are not at the same device, found input tensor at "
                f"{x.device} and parameter tensor at {weight.device}"
            )
        for h in hx if isinstance(hx, tuple) else (hx,):
            if h.device != x.device:
                raise RuntimeError(
                    "Input and hidden tensors are not at the same device, found input tensor at "
                    f"{x.device} and hidden tensor at {h.device}"
                )

    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _zero_state(self, like: Tensor, batch: int) -> State:
        """torch.nn's default initial state: zeros (num_layers * directions, batch, hidden_size)."""
        h = torch.zeros(
            self.num_layers * self._directions, batch, self.hidden_size, dtype=like.dtype, device=like.device
        )
        return (h, torch.zeros_like(h)) if self.mode == "LSTM" else h

    def _check_state_rank(self, hx: State, batched: bool) -> State:
        """torch.nn's checks of the initial state's rank; an unbatched state gets its batch dimension."""
        rank, kind = (3, "batched 3-D") if batched else (2, "unbatched 2-D")
        if self.mode == "LSTM":
            h, c = hx
            if h.dim() != rank or c.dim() != rank:
                got = f"but got ({h.dim()}-D, {c.dim()}-D) tensors"
                raise RuntimeError(f"For {kind} input, hx and cx should also be {rank}-D {got}")
            return hx if batched else (h.unsqueeze(1), c.unsqueeze(1))
        if hx.dim() != rank:
            raise RuntimeError(f"For {kind} input, hx should also be {rank}-D but got {hx.dim()}-D tensor")
        return hx if batched else hx.unsqueeze(1)

    def _layers(
        self, x: Tensor, hx: State, lengths: Tensor | None = None, index: Tensor | None = None
    ) -> tuple[Tensor, State]:
        """Every layer and direction over time-major x (T, B, I); for packed input, ``lengths``
        (sorted) and the ``index`` of the packed steps (``_packing``).

        Returns the top layer's outputs (T, B, directions * H) and the last states, as torch.nn
        orders them: (num_layers * directions, B, H), layer by layer, forward direction first.
        """
        lstm = self.mode == "LSTM"
        h0, c0 = hx if lstm else (hx, None)
        config = self._config()
        directions = self._directions
        calls = self.num_layers * directions
        per_call = len(self._flat_weights) // calls
        hs, cs, stats = [], [], []
        inp = x
        for i in range(self.num_layers):
            outs = []
            for d in range(directions):
                k = i * directions + d
                w = self._flat_weights[k * per_call : (k + 1) * per_call]
                seq = inp if d == 0 else _reverse(inp, lengths)
                guess = self._guess(k, (*seq.shape[:2], self.hidden_size), seq) if self._guesses else None
                # the top layer's outputs are the caller's (as torch.nn's, changed in place at will),
                # unless a concatenation (bidirectional) or packing (lengths) copies them anyway; a
                # copy only where torch.nn's may be changed so too
                top = i == self.num_layers - 1 and directions == 1 and lengths is None
                # the layer's states (1, B, H), as PyTorch's kernel takes them: h0 itself for one call
                h0_k = h0 if calls == 1 else h0[k : k + 1]
                c0_k = None if c0 is None else (c0 if calls == 1 else c0[k : k + 1])
                own = top and not _outputs_kept_by_torch_nn(x)
                out, h, c, solve = layer(seq, h0_k, c0_k, w, config, lengths, guess, own_output=own)
                if self.newton_guess == "previous" and self.forward_solver != "native":
                    # a copy of the caller's own outputs, which they may change in place
                    self._guesses[k] = out.detach().clone() if top else out.detach()
                stats.append(solve)
                outs.append(out if d == 0 else _reverse(out, lengths))
                hs.append(h)
                cs.append(c)
            inp = outs[0] if directions == 1 else torch.cat(outs, -1)
            if self.training and self.dropout > 0 and i < self.num_layers - 1:
                inp = _dropout(inp, self.dropout, lengths, index)
        self.__dict__["_stats"] = stats  # a plain attribute: no nn.Module.__setattr__ per call
        return inp, ((_last(hs), _last(cs)) if lstm else _last(hs))

    def _guess(self, k: int, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        """With ``newton_guess="previous"``, layer-direction k's outputs of the last forward when
        they have this shape, dtype and device; else None (zeros)."""
        guess = self._guesses.get(k)
        if guess is None or guess.shape != shape or guess.dtype != like.dtype or guess.device != like.device:
            return None
        return guess

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", backward={self.backward_mode!r}"
        if self.backward_mode == "bppsa":
            s += f", strategy={self.strategy!r}, chunk={self.chunk}, levels={self.levels}"
            if self.segment != SEGMENT:
                s += f", segment={self.segment}"
            if self.forward_solver != "native":
                s += f", forward_solver={self.forward_solver!r}"
        return s


@functools.lru_cache(maxsize=256, typed=True)
def _layer_config(
    mode: str, segment: int, strategy: str, chunk: int | None, levels: int | None,
    solver: str, tol: float | None, iters: int, sweeps: int,
) -> LayerConfig:  # fmt: skip
    """A ``LayerConfig``, checked once per set of options: checking costs as much as a short layer."""
    solving = SolverOptions(solver, tol, iters, sweeps)
    return LayerConfig(mode, segment, ScanOptions(strategy, chunk, levels), solving)


def _outputs_kept_by_torch_nn(x: Tensor) -> bool:
    """Whether ``torch.nn``'s module keeps its outputs for its backward on x: cuDNN's does, so there
    changing them in place before the backward is an error, and BPPSA's top layer hands the caller
    the outputs its backward reads, with no copy (time and memory: ``benchmarks.host --device cuda``);
    PyTorch's CPU kernels keep none, and the caller gets a copy to change at will. A compiled graph
    keeps the copy (no cuDNN query traced into it)."""
    return x.is_cuda and not torch.compiler.is_compiling() and torch.backends.cudnn.is_acceptable(x)


def _beyond_one_call(input: Tensor | PackedSequence, batch_first: bool) -> bool:
    """Whether the input is too long for one call of PyTorch's fused kernel on its device
    (``layer.ONE_CALL_STEPS``: cuDNN's limit), as ``torch.nn``'s forward would make it: the
    module's own layers run it then, in segments."""
    if isinstance(input, PackedSequence):
        data, steps = input.data, len(input.batch_sizes)
    elif isinstance(input, Tensor) and input.dim():
        data, steps = input, input.shape[1 if batch_first and input.dim() == 3 else 0]
    else:  # torch.nn's forward words what is wrong with it
        return False
    return steps > bppsa_layer.ONE_CALL_STEPS.get(data.device.type, math.inf)


def _last(states: list[Tensor]) -> Tensor:
    """The layer calls' last states (1, B, H each) as torch.nn's (num_layers * directions, B, H): a
    tensor of its own, as torch.nn's, since a view may not be detached or changed in place; one
    call's own result (PyTorch's kernel's, say) as it is."""
    if len(states) == 1 and not states[0]._is_view():
        return states[0]
    return torch.cat(states)


def _lstm_state(hx: object, packed: bool) -> tuple[Tensor, Tensor]:
    """An LSTM's initial state as the pair (h_0, c_0), torch.nn's list form included; anything else
    refused naming it, with the class torch.nn's forward raises for it."""
    if isinstance(hx, tuple | list) and len(hx) == 2 and all(isinstance(h, Tensor) for h in hx):
        return tuple(hx)
    message = f"LSTM: hx must be a tuple (h_0, c_0) of two tensors, got {_described(hx)}"
    if isinstance(hx, tuple | list) and len(hx) != 2:  # torch.nn: its kernel counts them, or no hx[1]
        raise (RuntimeError if packed or len(hx) > 2 else IndexError)(message)
    if isinstance(hx, Tensor) and not packed:  # torch.nn: hx[1] of one layer, else its rank check
        raise (RuntimeError if hx.dim() > 0 and hx.shape[0] > 1 else IndexError)(message)
    raise TypeError(message)


def _described(value: object) -> str:
    """A value in an error message: a tensor by its shape, anything else by its type."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def _reverse(x: Tensor, lengths: Tensor | None) -> Tensor:
    """x (T, B, F) with each sequence's steps reversed within its length; padding stays in place."""
    if lengths is None:
        return x.flip(0)
    steps = x.shape[0]
    t = torch.arange(steps).unsqueeze(1)
    n = lengths.unsqueeze(0)
    index = torch.where(t < n, n - 1 - t, t).to(x.device)
    return x.gather(0, index.unsqueeze(-1).expand_as(x))


def _dropout(x: Tensor, p: float, lengths: Tensor | None, index: Tensor | None) -> Tensor:
    """Dropout between layers, drawn as torch.nn draws it: over the time-major outputs, or over the
    packed data when the input was packed (the same random numbers for the same seed)."""
    if lengths is None:
        return dropout(x, p, training=True)
    return _unpack(dropout(_pack(x, index), p, training=True), index, lengths)


# Packing and unpacking as index operations (PyTorch's own have no forward-mode derivatives). Packed
# data holds, step after step, the batch's sequences that are still running: row r of the data is
# entry index[r] of the T * B padded steps.


def _packing(batch_sizes: Tensor, rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The padded position of every packed row, and each sequence's length (sorted, on the CPU);
    a PackedSequence whose batch sizes grow or do not count its ``rows`` refused (torch.nn's class
    where its kernel fails on one)."""
    if batch_sizes.numel() > 1 and bool((batch_sizes[1:] > batch_sizes[:-1]).any()):
        raise RuntimeError(f"PackedSequence: batch_sizes must not increase, got {batch_sizes.tolist()}")
    running = torch.arange(int(batch_sizes[0])).unsqueeze(0) < batch_sizes.unsqueeze(1)  # (T, B)
    index = running.flatten().nonzero().squeeze(1)
    if index.numel() != rows:
        raise RuntimeError(
            f"PackedSequence: batch_sizes {batch_sizes.tolist()} count {index.numel()} rows, "
            f"its data has {rows}"
        )
    return index.to(device), running.sum(0)


def _unpack(data: Tensor, index: Tensor, lengths: Tensor) -> Tensor:
    """Packed data (N, F) as a padded, time-major (T, B, F) tensor, 0 past each sequence's end."""
    steps, batch = int(lengths[0]), len(lengths)
    padded = data.new_zeros((steps * batch, data.shape[-1])).index_copy(0, index, data)
    return padded.unflatten(0, (steps, batch))


def _pack(x: Tensor, index: Tensor) -> Tensor:
    """The packed data (N, F) of a padded, time-major (T, B, F) tensor."""
    return x.flatten(0, 1).index_select(0, index)


class RNN(_BPPSAMixin, torch.nn.RNN):
    """``torch.nn.RNN`` with ``backward="bppsa"`` (default) or ``"bptt"`` (PyTorch's own backward).

    Extra keyword arguments: ``strategy``, ``chunk`` and ``levels`` choose the scan
    (``bppsa_core.scan.scan``); ``segment`` is the longest run of steps one native forward call takes.
    """


class GRU(_BPPSAMixin, torch.nn.GRU):
    """``torch.nn.GRU`` with ``backward="bppsa"`` (default) or ``"bptt"``; see ``RNN``."""

    _RANK_MESSAGE = "GRU: Expected input to be 2D or 3D, got {dim}D instead"


class LSTM(_BPPSAMixin, torch.nn.LSTM):
    """``torch.nn.LSTM`` with ``backward="bppsa"`` (default) or ``"bptt"``; see ``RNN``.

    ``proj_size > 0`` is refused with ``bppsa`` (it runs with ``bptt``).
    """

    _RANK_MESSAGE = "LSTM: Expected input to be 2D or 3D, got {dim}D instead"


# Whole-model checkpoints: ``torch.load``'s default (``weights_only=True``) unpickles only allowed
# classes; these hold nothing but torch.nn's state, plain options (strings, numbers, tensors) and
# the last forward's ``SolveStats`` (three numbers).
torch.serialization.add_safe_globals([RNN, GRU, LSTM, SolveStats])
