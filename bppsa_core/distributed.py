"""Sequence parallelism: one recurrent sequence split in time over the ranks of a process group.

    model = bppsa_core.GRU(24, 20, num_layers=2)
    parallel = SequenceParallel(model, group)           # group: a torch.distributed process group
    out, h_n = parallel(x_local)                         # x_local: this rank's time slice (T_r, B, I)

Rank r of p holds the contiguous time slice r of the input; the slices may differ in length (T need
not divide by p) but each has at least one step. Every rank holds the same weights.

**Forward.** Rank r runs each layer over its slice as one process would (``layer.sequential_forward``:
compiled on a CPU where "auto" takes it, else PyTorch's fused kernel), from the state rank r - 1
ends its slice with (rank 0 starts from h0), and sends its own last state to rank r + 1: p - 1
dependent messages of B·H numbers per layer. The layers run as a wavefront: rank r goes on to
layer i + 1 as soon as it has sent layer i's state, so layer i + 1 on rank r overlaps layer i on
rank r + 1, and L layers over p ranks take about p + L - 1 slices' forwards instead of L·p. One
broadcast at the end hands every layer's final state from the last rank to all, so that every rank
returns the same ``h_n``.

**Groups of samples in the forward.** A compiled step costs its samples' multiply-adds plus a
group's own work (``FORWARD_GROUP_WORK``), so where every CPU rank runs a layer compiled, and the
slices are long enough for a message's latency not to count (``FORWARD_GROUP_MIN_STEPS``), the
batch goes in groups: a rank sends each group's last state on as soon as it has it, and rank r + 1
runs that group while rank r runs the next. For m groups over p ranks a layer then takes about
(p + m - 1) / m slices' forwards of a group instead of p of the batch; ``forward_groups`` picks the
m whose pipeline is shortest (at least ``GROUP_SAMPLES`` samples each, ``micro_batches``
groups at most): two groups for the paper's RNN on two ranks, where a group's own work is four
samples', four for its GRU. The ranks agree on it (one all-gather at the start, which also checks
the slices), since a sender's groups must be its receiver's. PyTorch's fused kernel costs nearly
the same for 2 samples as for 16, so a layer left to it goes whole.

A CPU rank of several writes each layer's outputs batch-major (a (T_r, B, H) view of (B, T_r, H)
memory, as ``layer.native_forward`` can), since its backward walks groups of samples: a group's
steps are then read in order, each sample's side by side, where they lie
(``jacobians.batch_major``): the walk and its weight gradients make no copy of them. What the
rank returns is that view, as torch.nn returns a view for ``batch_first``. The compiled
forward's are in NumPy's memory (``numba_forward.new_outputs``), which takes huge pages where a
tensor's fresh memory faults a page every 4 KB: written a step at a time across B rows, those
faults had doubled the forward.

A GRU's or an LSTM's rank keeps what a module's layer keeps for its compiled walk (``layer.Tape``:
the gates and states, read instead of recomputed), one tape per group of samples its backward walks,
each in arrays of its own: the forward runs its groups a backward group at a time (``_cut``), so
that each call writes one whole tape. A group's slice of one batch-wide tape has rows the kernels
cannot take as contiguous, and cost the forward's stores and the walk's loads their vector code.

**Backward, BPPSA** (``backward="bppsa"``), per layer, from the top, for each group of samples
in turn (below):
1. the last rank runs its slice's backward as a single process would (its chain ends at the loss);
2. every middle rank shares its slice as one affine element per sample, v -> v @ A + b for the
   gradient v reaching its last state. A (H x H, ``slice_fold``: ``bppsa_core.scan.fold`` of the
   slice's chain of transposed Jacobians) depends on the forward alone, so the rank folds it in the
   forward, once it has handed its last layer's state on (the top layer first), while the ranks
   above finish their forwards. b is what the slice's own outputs send back: zero when the loss
   reaches them through the last state only, else the slice's backward walked from nothing at its
   end (the backward is linear, so step 5 then walks from v alone and the two walks' gradients add
   up);
3. one ``all_gather`` of those elements: p·B·H·(H+1) numbers over all groups, independent of T;
4. each rank applies the elements above it to the last rank's gradient: the gradient entering its
   slice from the right, without waiting for any other rank;
5. each rank runs its slice's backward from that gradient (the usual scan of ``bppsa_core.layer``).
The first rank's element is never needed, so it has nothing to do until step 4.

Folding in the forward takes a middle rank's most costly work (2.5 walks of its slice on a CPU rank)
off the backward's path: it overlaps the forwards of the ranks above, and only what exceeds them
delays this rank. Folding after its last layer, not after each, keeps the folds out of the
wavefront. A forward under ``torch.no_grad()`` or with nothing requiring a gradient does not fold;
one whose outputs never reach a backward has folded for nothing.

**Micro-batches in the backward.** Samples are independent, so the batch is cut into
``micro_batches`` contiguous groups at most (default ``MICRO_BATCHES``), on CPU ranks of at least
``GROUP_SAMPLES`` samples each (``backward_groups``: the compiled walk multiplies four samples at a
time, and walks a group of fewer about half as fast per sample, so the paper's B = 16 goes in four
groups), and the steps above run group after group: while the other ranks finish group j (steps 4-5), the last
rank already works on group j + 1 (step 1). That is a pipeline over the groups: the backward takes
about (m + 1) / m of one rank's share of the work for m groups, instead of twice it with two ranks,
where the first rank would wait for the last rank's whole backward. Bytes exchanged are the same;
the dependent steps are m all-gathers instead of one. The last rank needs nothing back from the
all-gathers, so it starts them without waiting (``async_op``) and runs its groups back to back; a
slower group on another rank does not hold it up. A rank whose share needs no walk (the first rank;
a middle rank where the loss reaches its outputs through the last state only) starts all its
groups' all-gathers before its first walk, and each completes while it walks the groups before:
the exchange's own latency (a few ms per group on two one-thread CPU ranks, where its threads wait
for a core) leaves the path, and the rank waits for the last rank's walk alone. A rank's groups
share one set of the walk's scratch buffers (``jacobians.reusing_buffers``): with a fresh set for
each group's call, malloc hands each set back to the system and the next group faults its pages
in again, which cost a two-sample group about a sixth of its walk on a CPU. Those buffers are
sized by the block of time steps a walk takes at once; a CPU rank of several takes blocks of half a
process's budget (``RANK_BLOCK_BYTES``), which lowers its peak at no measurable cost in time. On one
rank there is nothing to overlap and the batch stays whole.

**BPPSA's slices chained** (``exchange="chain"``): no fold and no all-gather. For each group of
samples in turn, rank r walks its slice from the gradient rank r + 1 hands on for that group (the
last rank from the loss's) and sends the gradient of its first state to rank r - 1, which walks that
group while rank r walks the next: about (m + p - 1) / m of a slice's walk for m groups over p
ranks, p - 1 dependent messages of H numbers per sample each (an LSTM's 2H). It drops the fold,
which costs H³ per step and sample where a walk costs H² (about 5 walks on a CPU rank at H = 20) and
which a compiled forward is too short to hide; it pays p - 1 hops where the all-gather pays
⌈log2 p⌉ rounds. On two ranks the two do the same work. ``python -m analysis.schemes`` models both
(``bppsa-chain``).

**Which exchange** (``exchange="auto"``, the default; ``exchange_taken``): the chain on CPU ranks,
where it was as fast on two ranks and two to three times faster on three, and the model keeps it
ahead of the all-gather at every rank count it prices (to 1,024); the all-gather on GPUs, where a
middle rank's fold is a few parallel kernels rather than five walks, and several GPUs have not timed
the two against each other.

**Backward, distributed BPTT** (``backward="bptt"``, the baseline): the gradient travels back rank
by rank: each rank waits for the gradient of its last state from rank r + 1, runs autograd over its
slice (PyTorch's own backward of its fused forward) and sends the gradient of its first state to
rank r - 1: p - 1 dependent messages, with the whole batch (autograd's graph of the fused forward
is one, so it is not cut into micro-batches).

In each, each rank's weight-gradient partial sums are all-reduced, so every rank ends with the
gradient single-process autograd gives (``tests/core/test_distributed.py`` checks it to 1e-10 in float64).
The gradient of ``h_n`` (and ``c_n``) is taken from the last rank (every rank holds the same, so a
loss computed on it on every rank counts once); the gradient of ``h0`` (and ``c0``) goes to rank 0.

Taken: RNN (tanh, relu), GRU and LSTM modules of ``bppsa_core`` or ``torch.nn``, any number of
layers, ``batch_first``; an LSTM's state is (h, c), and both travel together (B, 2H), as do their
gradients and its affine elements (2H x 2H). Refused, each in one line: bidirectional layers (the
reverse direction would need the whole sequence reversed across the ranks), an LSTM with
``proj_size``, packed sequences, dropout between layers.
**Data x sequence.** It composes with ``DistributedDataParallel`` over a second group: each replica
is a sequence-parallel group, and DDP averages the weight gradients over the replicas that hold the
same slice, as for any module (``DistributedDataParallel(SequenceParallel(model, sequence_group),
process_group=data_group)``; ``tests/core/test_distributed.py`` checks 2 x 2 ranks against autograd).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from bppsa_core import dispatch
from bppsa_core.dispatch import ScanOptions
from bppsa_core.jacobians import LayerWeights, PreviousStates, block_budget, reusing_buffers
from bppsa_core.layer import (
    LayerConfig,
    Tape,
    bppsa_backward,
    cell_of,
    native_forward,
    new_tape,
    sequential_forward,
)
from bppsa_core.scan import fold

BACKWARDS: tuple[str, ...] = ("bppsa", "bptt")
# How BPPSA's ranks hand the gradient on (module docstring): the scan's all-gather of folded slices,
# a chain of the slices' walks pipelined over the sample groups, or "auto" (``exchange_taken``).
EXCHANGES: tuple[str, ...] = ("auto", "allgather", "chain")
MODES: tuple[str, ...] = ("RNN_TANH", "RNN_RELU", "GRU", "LSTM")
# The most sample groups the backward runs in turn on more than one rank: the pipeline's fill is 1/m of
# a slice's backward, and each group adds an exchange and its own calls. A GPU rank's group may cost
# nearly what the whole batch does (a launch per product, whatever the samples). Re-measured by
# ``python -m benchmarks.distributed --micro-batches M`` (``--device cuda`` on GPUs, or the ``ranks``
# step of ``benchmarks.gpu_check`` on two GPUs or more, which runs 1 to 16 groups).
MICRO_BATCHES = 16
# Samples a group takes at least on CPU ranks, in the compiled forward (``forward_groups``) and in the
# backward (``backward_groups``): the compiled kernels' products take four samples at a time
# (``numba_math.add_hidden``), and a group of fewer walks each sample about half as fast (re-measured
# by ``python -m benchmarks.distributed --ranks 2 --T 100000 --micro-batches 4``, against 16).
GROUP_SAMPLES = 4
# A compiled step's work for a group of samples beside its samples' (the loop, the stores), in
# multiply-adds: about 100 ns, four samples' of the paper's RNN (re-measured as ``forward_group``
# over ``forward_sample`` by ``python -m benchmarks.distributed --ranks 1 2 --T 100000``).
FORWARD_GROUP_WORK = 2000
# Steps the shortest slice takes at least for its forward to go in groups: each group's state is a
# message, whose latency a shorter slice's groups do not outweigh (re-measured with this set lower,
# ``--micro-batches 1`` against 16 in ``python -m benchmarks.distributed --ranks 2 --T 2000 4000``).
FORWARD_GROUP_MIN_STEPS = 2000
# Samples a middle rank folds at once on a CPU (``slice_fold``): a few keep a fold's products in the
# cache, more leave it (re-measured by the ``fold`` column of ``python -m benchmarks.distributed``). On
# a GPU each product is a kernel launch, whatever the samples, so the batch is folded whole there.
FOLD_SAMPLES = 2
# Bytes of temporaries a CPU rank's walk may use per block of time steps where the group has several
# ranks (``jacobians.block_budget``): half of one process's. Ranks started on one machine share its
# last-level cache, and the blocks' scratch is a larger part of a rank's peak than of one process's; the
# smaller blocks lower a rank's peak a little at no measurable cost in time (re-measured by
# ``python -m benchmarks.distributed --ranks 2``).
RANK_BLOCK_BYTES = 4 << 20


class Traffic:
    """The bytes this process has handed to the process group since ``reset``: what it sends, its
    share of every all-gather and all-reduce, and what it broadcasts. The benchmark reads it."""

    def __init__(self) -> None:
        self.bytes = 0

    def reset(self) -> None:
        self.bytes = 0

    def add(self, tensor: Tensor) -> Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor


traffic = Traffic()


class Timeline:
    """When ``on``, the spans of this process's BPPSA backward since ``reset``: (what, start, end) in
    ``time.perf_counter`` seconds, one clock for every process of a machine, so that the ranks' spans
    line up. ``what`` is "walk" (a group's backward of its slice), "all-gather" (a group's exchange,
    waited for or, on the last rank, started), "wait" (the last rank's pending all-gathers),
    "receive" (chained: a group's gradient from the next rank) or "all-reduce" (the weight
    gradients'). On a GPU a span times the host's launches, not the device's
    work. Off by default; the benchmark's ``--timeline`` reads it to show where two ranks' time goes."""

    def __init__(self) -> None:
        self.on = False
        self.spans: list[tuple[str, float, float]] = []

    def reset(self) -> None:
        self.spans = []

    @contextlib.contextmanager
    def span(self, what: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((what, start, time.perf_counter()))


timeline = Timeline()


class SequenceParallelError(ValueError):
    """A sequence-parallel call that does not add up; raised on every rank alike."""


def exchange_taken(exchange: str, device: torch.device) -> str:
    """The exchange BPPSA's ranks take on ``device`` for ``exchange`` (one of ``EXCHANGES``): itself,
    or for "auto" the chain on CPU ranks, where a middle rank's fold outlasts the forwards that would
    hide it, and the all-gather on GPUs, where a fold is a few parallel kernels (module docstring;
    re-measured by ``python -m benchmarks.distributed --ranks 2 3 --exchange allgather`` and ``chain``)."""
    if exchange != "auto":
        return exchange
    return "chain" if device.type == "cpu" else "allgather"


def _cpu_of_several(size: int, device: torch.device) -> bool:
    """A CPU rank of a group of several: its outputs are stored batch-major and its walks take
    ``RANK_BLOCK_BYTES`` blocks (module docstring)."""
    return size > 1 and device.type == "cpu"


def _peer(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` in ``group``."""
    return rank if group is None else dist.get_global_rank(group, rank)


class SequenceParallel(nn.Module):
    """A recurrent module run sequence-parallel over ``group``: see the module's docstring.

    ``forward(x_local, hx=None)`` takes this rank's slice (T_r, B, I), or (B, T_r, I) with
    ``batch_first``, and the initial states as torch.nn takes them (h0, or an LSTM's (h0, c0), each
    (num_layers, B, H); read on rank 0), and returns this rank's outputs of the top layer and the
    final states of every layer, the same on every rank. ``micro_batches``: how many groups of
    samples the BPPSA backward pipelines over the ranks at most (on CPU ranks, groups of at least
    ``GROUP_SAMPLES``: ``backward_groups``), and the most its compiled forward does;
    ``exchange``: how BPPSA's ranks hand the gradient on, "allgather" (the scan over the ranks'
    folded slices), "chain" (module docstring) or "auto": the chain on CPU ranks, the all-gather on
    GPUs (``exchange_taken``).
    """

    def __init__(
        self,
        module: nn.RNNBase,
        group: dist.ProcessGroup | None = None,
        backward: str = "bppsa",
        micro_batches: int = MICRO_BATCHES,
        exchange: str = "auto",
    ):
        super().__init__()
        if backward not in BACKWARDS:
            raise ValueError(f"unknown backward {backward!r}; accepted: {', '.join(BACKWARDS)}")
        if exchange not in EXCHANGES:
            raise ValueError(f"unknown exchange {exchange!r}; accepted: {', '.join(EXCHANGES)}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches {micro_batches!r} is not taken; accepted: a positive integer")
        if not isinstance(module, nn.RNNBase) or module.mode not in MODES:
            what = getattr(module, "mode", type(module).__name__)
            raise ValueError(
                f"cannot run {what} sequence-parallel; accepted: RNN (tanh, relu), GRU and LSTM modules"
            )
        if getattr(module, "proj_size", 0):
            raise ValueError(
                f"an LSTM with proj_size {module.proj_size} cannot run sequence-parallel; accepted: 0"
            )
        if module.bidirectional:
            raise ValueError("bidirectional layers cannot run sequence-parallel; accepted: one direction")
        if module.num_layers > 1 and module.dropout > 0:
            raise ValueError(
                f"dropout {module.dropout} between layers is not taken sequence-parallel; accepted: 0"
            )
        self.module, self.group, self.backward = module, group, backward
        self.micro_batches, self.exchange = micro_batches, exchange

    def forward(
        self, x: Tensor, hx: Tensor | tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
        m = self.module
        if isinstance(x, nn.utils.rnn.PackedSequence) or x.dim() != 3:
            raise ValueError("sequence-parallel input must be a 3-D tensor (no packed or unbatched input)")
        if m.batch_first:
            x = x.transpose(0, 1)
        batch = x.shape[1]
        per_layer = len(m._flat_weights) // m.num_layers
        layers = [m._flat_weights[i * per_layer : (i + 1) * per_layer] for i in range(m.num_layers)]
        groups = _forward_groups(x, batch, self.backward, self.micro_batches, self.group, m, layers)
        exchange = exchange_taken(self.exchange, x.device)
        lstm = m.mode == "LSTM"
        if hx is None:
            zeros = x.new_zeros(m.num_layers, batch, m.hidden_size)
            hx = (zeros, zeros) if lstm else zeros
        h0, c0 = hx if lstm else (hx, None)
        # a middle rank's folds, run once its forward is done, and only for a backward to come
        folds: list | None = [] if torch.is_grad_enabled() else None
        inp, lasts = x, []
        for i, weights in enumerate(layers):
            c0_i = None if c0 is None else c0[i]
            inp, last = _Layer.apply(
                inp, h0[i], c0_i, m.mode, m.strategy, self.backward, groups[i], self.micro_batches,
                exchange, folds, self.group, *weights,
            )  # fmt: skip
            lasts.append(last)
        with torch.no_grad():  # a fold is part of the backward: no graph of its own
            for run in reversed(folds or []):  # the top layer's first: its backward comes first
                run()
        h_n, c_n = _split(_Final.apply(self.group, *lasts), lstm)
        out = inp.transpose(0, 1) if m.batch_first else inp
        return out, ((h_n, c_n) if lstm else h_n)


def _forward_groups(x, batch, backward, micro_batches, group, module, layers) -> list[int]:
    """Checks that every rank's slice has at least one step and the same batch (one clear error on
    every rank), and returns the groups of samples each layer's forward hands on
    (``forward_groups``): the same on every rank, from one all-gather of the slices' steps and
    batches and of which layers each rank runs compiled (a rank whose thread count keeps an LSTM
    on PyTorch's kernel makes every rank hand it on whole). On the input's device: NCCL exchanges
    GPU tensors only."""
    size = dist.get_world_size(group)
    with torch.no_grad():  # as the layers' forwards ask it
        compiled = [
            backward == "bppsa"
            and _cpu_of_several(size, x.device)
            and dispatch.compiled_forward(module.strategy, module.mode, module.hidden_size, x, *weights)
            for weights in layers
        ]
    mine = torch.tensor([x.shape[0], batch, *compiled], dtype=torch.long, device=x.device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, traffic.add(mine), group=group)
    lengths = [int(t[0]) for t in every]
    batches = {int(t[1]) for t in every}
    if min(lengths) < 1:
        raise SequenceParallelError(
            f"the time slices have {lengths} steps over {len(lengths)} ranks; accepted: at least 1 step "
            "on every rank (a sequence shorter than the ranks cannot be split)"
        )
    if len(batches) > 1:
        raise SequenceParallelError(f"the ranks hold batches of {sorted(batches)}; accepted: one batch size")
    every_rank = torch.stack(every)[:, 2:].cpu().all(0).tolist()
    return [
        forward_groups(batch, min(lengths), micro_batches, size, weights[0].numel() + weights[1].numel())
        if c
        else 1
        for c, weights in zip(every_rank, layers, strict=True)
    ]


class _Layer(torch.autograd.Function):
    """One layer over the ranks' slices: the forward hands states right, the backward as chosen.
    A state is h, or an LSTM's h and c side by side (B, 2H): what travels between ranks."""

    @staticmethod
    def forward(
        ctx, x, h0, c0, mode, strategy, backward, groups, micro_batches, exchange, folds, group, *weights
    ):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        lstm = c0 is not None
        state = _join(h0, c0).detach()
        if backward == "bptt":  # keep this slice's own autograd graph for the backward
            if rank > 0:
                state = torch.empty_like(state)
                dist.recv(state, src=_peer(group, rank - 1), group=group)
            h_in, c_in = _split(state, lstm)
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (x, h_in, c_in, *weights) if t is not None]
                c_leaf = leaves[2] if lstm else None
                out, h_last, c_last = native_forward(
                    mode, leaves[0], leaves[1], c_leaf, leaves[2 + lstm :], None
                )
            ctx.graph = (leaves, out, h_last, c_last)
            out, last = out.detach(), _join(h_last.detach(), None if c_last is None else c_last.detach())
            if rank < size - 1:
                dist.send(traffic.add(last.contiguous()), dst=_peer(group, rank + 1), group=group)
        else:
            walked = _backward_spans(x.shape[1], micro_batches, size, x.device)
            tapes = None
            if backward == "bppsa" and any(ctx.needs_input_grad):
                tapes = _new_tapes(mode, strategy, x, h0, c0, list(weights), walked)
            with torch.no_grad():
                state, out, last = _pipelined_forward(
                    x, state, mode, strategy, groups, group, weights, walked, tapes
                )
            h_in, c_in = _split(state, lstm)
            # the tapes last, as tensors (``Tape.tensors``): freed with the rest after the backward
            kept = [t for tape in tapes or () for t in tape.tensors()]
            ctx.save_for_backward(x, h_in, out, *([c_in] if lstm else []), *weights, *kept)
            ctx.tape_count = len(tapes or ())
        ctx.folded = None
        if (
            backward == "bppsa"
            and exchange == "allgather"
            and folds is not None
            and any(ctx.needs_input_grad)
            and 0 < rank < size - 1
        ):
            folds.append(functools.partial(_fold_into, ctx, mode, x, h_in, c_in, out, list(weights)))
        ctx.mode, ctx.backward, ctx.group, ctx.lstm = mode, backward, group, lstm
        ctx.micro_batches, ctx.exchange = micro_batches, exchange
        ctx.set_materialize_grads(False)  # an output the loss does not reach gets None, not zeros
        return out, last

    @staticmethod
    def backward(ctx, grad_out, grad_last):
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        # the last state's gradient: from h_n (and c_n) on the last rank (``_Final``), else none
        grad_hn, grad_cn = (None, None) if grad_last is None else _split(grad_last, ctx.lstm)
        if ctx.backward == "bptt":
            dx, g_h0, g_c0, grads = _bptt(ctx, grad_out, grad_hn, grad_cn, rank, size)
        elif ctx.exchange == "chain":
            dx, g_h0, g_c0, grads = _chained(ctx, grad_out, grad_hn, grad_cn, rank, size)
        else:
            dx, g_h0, g_c0, grads = _bppsa(ctx, grad_out, grad_hn, grad_cn, rank, size)
        if size > 1:  # every rank's partial sums, summed
            flat = torch.cat([g.reshape(-1) for g in grads])
            with timeline.span("all-reduce"):
                dist.all_reduce(traffic.add(flat), group=group)
            sizes = [g.numel() for g in grads]
            grads = [part.view_as(g) for part, g in zip(flat.split(sizes), grads, strict=True)]
        first = rank == 0
        options = (None,) * 8  # mode, strategy, backward, groups, micro_batches, exchange, folds, group
        return dx, (g_h0 if first else None), (g_c0 if first else None), *options, *grads


class _Final(torch.autograd.Function):
    """Every layer's final state (h, or an LSTM's h and c side by side), from the last rank to every
    rank in one broadcast after the forward: each rank returns the same h_n. Its gradient counts
    once, on the last rank; the other ranks' last states reach nothing."""

    @staticmethod
    def forward(ctx, group, *lasts):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        ctx.top = rank == size - 1
        final = (
            traffic.add(torch.stack(lasts)) if ctx.top else lasts[0].new_empty((len(lasts), *lasts[0].shape))
        )
        dist.broadcast(final, src=_peer(group, size - 1), group=group)
        ctx.set_materialize_grads(False)
        return final

    @staticmethod
    def backward(ctx, grad):
        given = ctx.top and grad is not None
        return None, *(grad.unbind(0) if given else [None] * len(ctx.needs_input_grad[1:]))


def sample_groups(batch: int, groups: int) -> list[slice]:
    """The contiguous groups of samples the BPPSA backward runs in turn (module docstring): ``groups``
    of them, at most one per sample, cut as ``torch.tensor_split`` cuts the batch."""
    return [slice(int(g[0]), int(g[-1]) + 1) for g in torch.arange(batch).tensor_split(min(batch, groups))]


def backward_groups(batch: int, micro_batches: int, ranks: int, device: torch.device) -> int:
    """How many groups of samples the BPPSA backward over ``ranks`` runs in turn (module docstring):
    one on a single rank, ``micro_batches`` at most, and on CPU ranks groups of at least
    ``GROUP_SAMPLES`` samples, for the compiled walk's products."""
    if ranks == 1:
        return 1
    return max(1, min(micro_batches, batch // GROUP_SAMPLES)) if device.type == "cpu" else micro_batches


def forward_groups(batch: int, steps: int, micro_batches: int, ranks: int = 2, work: float = 0) -> int:
    """How many groups of samples a compiled forward over ``ranks`` CPU ranks hands on in turn
    (``_pipelined_forward``), its shortest slice ``steps`` long, a sample's step ``work``
    multiply-adds (0: unknown): the count whose pipeline ends first, a group's step costing its
    samples' work plus ``FORWARD_GROUP_WORK``; ``micro_batches`` at most, each of at least
    ``GROUP_SAMPLES``, the fewest of equals, and one below ``FORWARD_GROUP_MIN_STEPS``."""
    if steps < FORWARD_GROUP_MIN_STEPS:
        return 1
    own = FORWARD_GROUP_WORK / work if work > 0 else 0.0  # a group's own work, in samples

    def pipeline(m: int) -> float:  # the last rank's end: the first rank's m groups, then the last
        return m * own + batch + (ranks - 1) * (own + -(-batch // m))

    return min(range(1, max(1, min(micro_batches, batch // GROUP_SAMPLES)) + 1), key=pipeline)


def _backward_spans(batch: int, micro_batches: int, size: int, device: torch.device) -> list[slice]:
    """The groups of samples the BPPSA backward walks in turn (``backward_groups``)."""
    return sample_groups(batch, backward_groups(batch, micro_batches, size, device))


def _new_tapes(mode, strategy, x, h0, c0, weights, walked) -> list[Tape] | None:
    """A GRU's or an LSTM's tape (``layer.new_tape``, as a module keeps one) for each group of samples
    the backward walks (``walked``), each its own C-contiguous arrays: a group's slice of one tape
    would cost the compiled forward's writes and the walk's reads their vector code (re-measured by
    ``python -m benchmarks.distributed --model gru --ranks 1 2 --T 100000``). None where a module
    keeps no tape."""
    config = LayerConfig(mode, options=ScanOptions(strategy))
    tapes = [new_tape(config, x[:, s], h0[s], None if c0 is None else c0[s], weights, None) for s in walked]
    return None if None in tapes else tapes


def _cut(span: slice, walked: list[slice]) -> list[slice]:
    """``span`` cut where the backward's groups (``walked``) begin: pieces that each lie in one."""
    cuts = [span.start, *(w.start for w in walked if span.start < w.start < span.stop), span.stop]
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def _tape_of(tapes: list[Tape] | None, walked: list[slice], piece: slice) -> Tape | None:
    """The samples ``piece`` of the tape of the backward's group it lies in (``_cut``), or None."""
    if tapes is None:
        return None
    for w, tape in zip(walked, tapes, strict=True):
        if w.start <= piece.start < w.stop:
            return tape.samples(slice(piece.start - w.start, piece.stop - w.start))
    raise ValueError(f"samples {piece.start}..{piece.stop} lie in no group of {walked}")


def _pipelined_forward(x, state, mode, strategy, groups, group, weights, walked, tapes):
    """This rank's BPPSA forward of one layer's slice, from ``state`` on rank 0 and from the state
    the rank before ends with elsewhere: returns that state, the outputs and this slice's last
    state. The samples go in ``groups`` (``_forward_groups``), each group's last state sent on as
    soon as it is made, so that the next rank runs that group while this one runs the next (module
    docstring). ``tapes``: a GRU's or an LSTM's for each of the backward's groups (``walked``;
    ``_new_tapes``), or None; with them a group runs in pieces, each writing one tape."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    steps, batch = x.shape[:2]
    hidden, lstm = weights[1].shape[1], mode == "LSTM"
    major = _cpu_of_several(size, x.device)  # batch-major where the backward walks groups of samples
    spans = sample_groups(batch, groups)
    pieces = [[s] if tapes is None else _cut(s, walked) for s in spans]
    whole = len(spans) == 1 and len(pieces[0]) == 1  # one call, which makes its outputs
    if rank > 0:
        state = torch.empty_like(state)
        arrivals = [
            dist.irecv(state[s], src=_peer(group, rank - 1), group=group, tag=i) for i, s in enumerate(spans)
        ]
    if whole:
        out = None
    else:
        from bppsa_core.numba_forward import new_outputs

        out = new_outputs(steps, batch, hidden, x.dtype, batch_major=major)
    last, sends = torch.empty_like(state), []
    for i, s in enumerate(spans):
        if rank > 0:
            arrivals[i].wait()
        for p in pieces[i]:
            h_in, c_in = _split(state[p], lstm)
            kept = _tape_of(tapes, walked, p)
            if whole:
                out, h_last, c_last = sequential_forward(
                    strategy, mode, x, h_in, c_in, list(weights), None, batch_major=major, tape=kept
                )
            else:
                _, h_last, c_last = sequential_forward(
                    strategy, mode, x[:, p], h_in, c_in, list(weights), None, out=out[:, p], tape=kept
                )
            last[p] = _join(h_last, c_last)
        if rank < size - 1:
            sends.append(dist.isend(traffic.add(last[s]), dst=_peer(group, rank + 1), group=group, tag=i))
    for work in sends:
        work.wait()
    return state, out, last


def _fold_into(ctx, mode: str, x, h_in, c_in, out, weights) -> None:
    """A middle rank's fold of one layer's slice, kept for that layer's backward."""
    ctx.folded = slice_fold(LayerConfig(mode, options=ScanOptions()), x, h_in, c_in, out, weights)


def _split(state: Tensor, lstm: bool) -> tuple[Tensor, Tensor | None]:
    """h, and an LSTM's c, from a state (B, H) or (B, 2H)."""
    return state.chunk(2, -1) if lstm else (state, None)


def _join(h: Tensor, c: Tensor | None) -> Tensor:
    """A state from h and an LSTM's c (None otherwise): ``_split``'s inverse."""
    return h if c is None else torch.cat((h, c), -1)


def _bptt(ctx, grad_out, grad_hn, grad_cn, rank, size):
    leaves, out, h_last, c_last = ctx.graph
    group, lstm = ctx.group, ctx.lstm
    ends = (h_last, c_last) if lstm else (h_last,)
    given = (grad_hn, grad_cn)[: len(ends)]
    v = torch.cat([torch.zeros_like(e) if g is None else g for g, e in zip(given, ends, strict=True)], -1)
    if rank < size - 1:
        dist.recv(v, src=_peer(group, rank + 1), group=group)
    outputs, grads = list(ends), list(_split(v, lstm)[: len(ends)])
    if grad_out is not None:
        outputs.append(out)
        grads.append(grad_out)
    got = torch.autograd.grad(outputs, leaves, grads)
    dx, g_h0, g_c0 = got[0], got[1], (got[2] if lstm else None)
    if rank > 0:
        first = _join(g_h0, g_c0)
        dist.send(traffic.add(first.contiguous()), dst=_peer(group, rank - 1), group=group)
    del ctx.graph
    return dx, g_h0, g_c0, list(got[2 + lstm :])


def _bppsa(ctx, grad_out, grad_hn, grad_cn, rank, size):
    """The BPPSA backward of the micro-batches one after another (module docstring), joined. A rank
    whose share needs no walk of its own starts every group's all-gather first (``early``)."""
    x, h_in, c_in, out, weights, tapes = _saved(ctx)
    spans = _backward_spans(h_in.shape[0], ctx.micro_batches, size, x.device)
    folded = ctx.folded  # a middle rank's A, folded in the forward (kept for a retained graph)
    # views of the group's samples: the walk reads batch-major outputs where they lie and copies
    # time-major ones a block at a time (jacobians.PreviousStates), never the group's whole slice
    groups = [
        [None if t is None else t[:, s] for t in (x, out, grad_out)]
        + [None if t is None else t[s] for t in (h_in, c_in, grad_hn, grad_cn, folded)]
        + [None if tapes is None else tapes[i]]
        for i, s in enumerate(spans)
    ]
    config = LayerConfig(ctx.mode, options=ScanOptions())
    early = size > 1 and (rank == 0 or (rank < size - 1 and grad_out is None))
    started = [
        _exchange(ctx, _share(ctx, config, rank, size, weights, g)[0], wait=False) if early else None
        for g in groups
    ]
    parts, pending = [], []
    budget = RANK_BLOCK_BYTES if _cpu_of_several(size, x.device) else None
    with reusing_buffers(), block_budget(budget):  # one set of the walks' scratch for every group
        for g, exchange in zip(groups, started, strict=True):
            parts.append(_bppsa_group(ctx, config, rank, size, weights, g, exchange, pending))
    if pending:
        with timeline.span("wait"):
            for _buffers, work in pending:
                work.wait()
    return _joined(parts, ctx.lstm)


def _saved(ctx) -> tuple:
    """What a layer's BPPSA forward saved: x, h_in, c_in (an LSTM's, else None), out, the weights and
    the tapes (None where it kept none)."""
    x, h_in, out, *rest = ctx.saved_tensors
    c_in, rest = (rest[0], rest[1:]) if ctx.lstm else (None, rest)
    count = 3 * ctx.tape_count  # each tape's tensors, after the weights
    weights, kept = rest[: len(rest) - count], rest[len(rest) - count :]
    tapes = [Tape.of(*kept[i : i + 3]) for i in range(0, count, 3)]
    return x, h_in, c_in, out, weights, tapes or None


def _joined(parts: list, lstm: bool):
    """The groups' backwards (dx, g_h0, g_c0, weight gradients each) as the whole batch's."""
    dx, g_h0, g_c0, grads = zip(*parts, strict=True)
    g_c0 = torch.cat(g_c0) if lstm else None
    dx = None if dx[0] is None else torch.cat(dx, 1)
    return dx, torch.cat(g_h0), g_c0, [sum(g[1:], g[0]) for g in zip(*grads, strict=True)]


def _chained(ctx, grad_out, grad_hn, grad_cn, rank, size):
    """BPPSA's slices chained (``exchange="chain"``, module docstring): for each group of samples in
    turn, this rank walks its slice from the gradient rank r + 1 hands on for that group (the last
    rank from h_n's) and hands the gradient of its first state to rank r - 1, so that rank r - 1
    walks this group while this rank walks the next."""
    x, h_in, c_in, out, weights, tapes = _saved(ctx)
    group, lstm, need_x = ctx.group, ctx.lstm, ctx.needs_input_grad[0]
    spans = _backward_spans(h_in.shape[0], ctx.micro_batches, size, x.device)
    config = LayerConfig(ctx.mode, options=ScanOptions())
    top = rank == size - 1
    if not top:  # every group's gradient from the right, received as it comes
        given = h_in.new_empty(h_in.shape[0], h_in.shape[1] * (1 + lstm))
        peer = _peer(group, rank + 1)
        arrivals = [dist.irecv(given[s], src=peer, group=group, tag=i) for i, s in enumerate(spans)]
    parts, sends = [], []
    budget = RANK_BLOCK_BYTES if _cpu_of_several(size, x.device) else None
    with reusing_buffers(), block_budget(budget):  # one set of the walks' scratch for every group
        for i, s in enumerate(spans):
            if top:
                v_h, v_c = (None if g is None else g[s] for g in (grad_hn, grad_cn))
            else:
                with timeline.span("receive"):
                    arrivals[i].wait()
                v_h, v_c = _split(given[s], lstm)
            c_s = None if c_in is None else c_in[s]
            g_s = None if grad_out is None else grad_out[:, s]
            tape = None if tapes is None else tapes[i]
            with timeline.span("walk"):
                done = bppsa_backward(
                    config, x[:, s], h_in[s], c_s, weights, None, out[:, s], g_s, v_h, v_c, need_x, tape
                )
            if rank > 0:
                first = traffic.add(_join(done[1], done[2]).contiguous())
                sends.append(dist.isend(first, dst=_peer(group, rank - 1), group=group, tag=i))
            parts.append(done)
    for work in sends:
        work.wait()
    return _joined(parts, lstm)


def _share(ctx, config, rank, size, weights, group):
    """What this rank shares of one group of samples (``group``: its x, out, grad_out, h_in, c_in,
    grad_hn, grad_cn, folded A and tape, as ``_bppsa`` cuts them): its slice as an affine element [A | b]
    of the gradient entering it from the right (middle ranks; A folded in the forward), the
    gradient of its first state (the last rank), nothing (rank 0). Also the last rank's whole
    backward of the group (``done``) and a middle rank's walk of its own outputs' part (``own``),
    each None where not made."""
    x, out, grad_out, h_in, c_in, grad_hn, grad_cn, folded, tape = group
    lstm, need_x = ctx.lstm, ctx.needs_input_grad[0]  # no input gradient where x needs none
    batch, state = h_in.shape[0], h_in.shape[1] * (1 + lstm)
    share = h_in.new_zeros(batch, state, state + 1)
    done = own = None
    if rank == size - 1:
        with timeline.span("walk"):
            done = bppsa_backward(
                config, x, h_in, c_in, weights, None, out, grad_out, grad_hn, grad_cn, need_x, tape
            )
        share[..., state] = _join(done[1], done[2])
    elif rank > 0:
        share[..., :state] = folded
        if grad_out is not None:  # b: what the slice's own outputs send back, walked from nothing at its end
            with timeline.span("walk"):
                own = bppsa_backward(
                    config, x, h_in, c_in, weights, None, out, grad_out, None, None, need_x, tape
                )
            share[..., state] = _join(own[1], own[2])
    return share, done, own


def _exchange(ctx, share: Tensor, wait: bool) -> tuple[list[Tensor], dist.Work | None]:
    """Every rank's share of one group: one all-gather, returned with its work where not waited for."""
    every = [torch.empty_like(share) for _ in range(dist.get_world_size(ctx.group))]
    work = dist.all_gather(every, traffic.add(share), group=ctx.group, async_op=not wait)
    return every, work


def _bppsa_group(ctx, config, rank, size, weights, group, started, pending):
    """Steps 1-5 of the BPPSA backward (module docstring) for one group of samples (``_share``'s
    ``group``); ``started``: the group's all-gather where ``_bppsa`` started it early, else None. The
    last rank needs nothing back from the all-gather, so it does not wait for it: it goes on to the
    next group, and its all-gathers (``pending``) complete while it works."""
    x, out, grad_out, h_in, c_in = group[:5]
    tape = group[-1]
    lstm, need_x = ctx.lstm, ctx.needs_input_grad[0]  # no input gradient where x needs none
    state = h_in.shape[1] * (1 + lstm)
    done = own = None
    if started is None:
        share, done, own = _share(ctx, config, rank, size, weights, group)
        if own is not None:
            grad_out = None  # the walk from the right's gradient below adds the rest (both are linear)
        if size == 1:
            started = [share], None
        else:
            with timeline.span("all-gather"):
                started = _exchange(ctx, share, wait=done is None)
    every, work = started
    if work is not None:
        if done is not None:
            pending.append(started)  # the buffers live until the all-gather completes
        else:
            with timeline.span("all-gather"):
                work.wait()
    if done is None:
        v = every[-1][..., state]  # the gradient of the last rank's first state
        for q in range(size - 2, rank, -1):  # through the slices between, right to left
            v = torch.baddbmm(
                every[q][..., state].unsqueeze(1), v.unsqueeze(1), every[q][..., :state]
            ).squeeze(1)
        v_h, v_c = _split(v, lstm)
        with timeline.span("walk"):
            done = bppsa_backward(config, x, h_in, c_in, weights, None, out, grad_out, v_h, v_c, need_x, tape)
    if own is not None:  # the two walks' gradients, summed
        dx, g_h0, g_c0, grads = done
        g_c0 = None if g_c0 is None else g_c0 + own[2]
        dx = None if dx is None else dx + own[0]
        done = dx, g_h0 + own[1], g_c0, [g + o for g, o in zip(grads, own[3], strict=True)]
    return done


def slice_fold(
    config: LayerConfig, x: Tensor, h_in: Tensor, c_in: Tensor | None, out: Tensor, weights: list[Tensor]
) -> Tensor:
    """A slice's chain of transposed Jacobians as one matrix per sample (a middle rank's fold): the
    gradient v that reaches its last state from the right reaches its first state as v @ A.

    x (T_r, B, I) the slice's inputs, h_in (B, H) and c_in (B, H) or None the state it starts from,
    out (T_r, B, H) its outputs, ``weights`` the layer's. Returns A (B, S, S), S the state's width (an
    LSTM's 2H). On a CPU the samples are folded ``FOLD_SAMPLES`` at a time, so that the fold's
    products stay in cache; elsewhere all at once, one launch per product for the whole batch.
    ``benchmarks.distributed`` times it as the model's fold cost."""
    cell, w = cell_of(config.mode), LayerWeights(*weights)
    batch = h_in.shape[0]
    parts = []
    for s in sample_groups(batch, -(-batch // FOLD_SAMPLES) if x.device.type == "cpu" else 1):
        c_s = None if c_in is None else c_in[s]
        h_prev = PreviousStates(h_in[s], out[:, s]).whole()
        a, _ = fold(cell.chain(cell.factors(x[:, s], h_prev, out[:, s], w, c_s, None), w))
        parts.append(a.expand(s.stop - s.start, -1, -1))
    return torch.cat(parts)
