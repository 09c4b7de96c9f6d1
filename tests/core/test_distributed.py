"""Sequence parallelism over gloo processes: the gradients single-process autograd gives, for 1 to 4
ranks, RNN, GRU and LSTM, two layers, a loss on h_T or on every output; and the fold it exchanges."""

from __future__ import annotations

import json
import os
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import extended_except
from torch import nn

from bppsa_core import GRU, LSTM, RNN
from bppsa_core.chain import DenseChain
from bppsa_core.distributed import GROUP_SAMPLES, MICRO_BATCHES, SequenceParallel, SequenceParallelError
from bppsa_core.layer import LayerConfig
from bppsa_core.scan import fold, sequential_scan

T, B, F, H = 11, 3, 4, 5  # steps, batch, features, hidden


# --- the fold ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "chunk"), [(1, None), (7, None), (16, 4), (17, 4), (30, 7), (9, 1), (5, 9)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_the_fold_is_the_whole_chain_as_one_affine_element(n, chunk, shared, with_offsets) -> None:
    g = torch.Generator().manual_seed(n)
    elements = torch.randn(n, 1 if shared else B, H, H, generator=g, dtype=torch.float64) / H**0.5
    offsets = torch.randn(n, B, H, generator=g, dtype=torch.float64) if with_offsets else None
    a, b = fold(DenseChain(elements), offsets, chunk=chunk)
    assert a.shape == ((1 if shared else B), H, H) and (b is None) == (not with_offsets)
    x_n = torch.randn(B, H, generator=g, dtype=torch.float64)
    expected = sequential_scan(elements, x_n, offsets)[0]
    got = (x_n.unsqueeze(1) @ a).squeeze(1) + (0 if b is None else b)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("device", "folds"), [("cpu", 3), ("meta", 1)])
def test_a_slice_is_folded_a_few_samples_at_a_time_on_a_cpu_only(device: str, folds: int) -> None:
    """On a CPU the fold takes ``FOLD_SAMPLES`` samples at a time (cache); on any other device (here
    ``meta``, which runs no arithmetic, standing for a GPU) the batch whole: one launch per product."""
    from unittest import mock

    import bppsa_core.distributed as sp

    batch = 2 * sp.FOLD_SAMPLES + 1
    x, out = torch.randn(T, batch, F, device=device), torch.randn(T, batch, H, device=device)
    model = nn.RNN(F, H, device=device)
    with mock.patch.object(sp, "fold", wraps=sp.fold) as calls:
        a = sp.slice_fold(
            LayerConfig("RNN_TANH"), x, out[0], None, out, [w.detach() for w in model.parameters()]
        )
    assert a.shape == (batch, H, H) and a.device.type == device
    assert calls.call_count == folds


# --- across processes -------------------------------------------------------------------------------


def _ranks(size: int, fn, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, size, *args)`` on ``size`` processes of one thread each; with NCCL, rank r on
    GPU r."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_entry, args=(size, store, backend, fn, args), nprocs=size, join=True)


def _entry(rank: int, size: int, store: str, backend: str, fn, args) -> None:
    torch.set_num_threads(1)
    bound = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        bound["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size, **bound)
    try:
        fn(rank, size, *args)
    finally:
        dist.destroy_process_group()


def _mine(rank: int, size: int) -> slice:
    """Rank ``rank``'s contiguous time slice of the T steps, as ``SequenceParallel`` splits them."""
    slices = torch.tensor_split(torch.arange(T), size)
    return slice(int(slices[rank][0]), int(slices[rank][-1]) + 1)


def _exact(rank: int, size: int) -> None:
    import bppsa_core.distributed as sp

    mine = _mine(rank, size)
    cases = ((RNN, {"nonlinearity": "tanh"}), (RNN, {"nonlinearity": "relu"}), (GRU, {}), (LSTM, {}))
    # BPPSA with the batch whole, in groups of 2 + 1 samples, and one sample a group (the default
    # count, with groups of one sample at least here, and any slice) in the backward and the compiled
    # forward; its slices' walks chained in groups of 2 + 1 and of one sample
    sp.GROUP_SAMPLES, sp.FORWARD_GROUP_MIN_STEPS, sp.FORWARD_GROUP_WORK = 1, 1, 0
    runs = (
        ("bppsa", 1, "allgather"),
        ("bppsa", 2, "allgather"),
        ("bppsa", MICRO_BATCHES, "allgather"),
        ("bppsa", 2, "chain"),
        ("bppsa", MICRO_BATCHES, "chain"),
        ("bptt", MICRO_BATCHES, "allgather"),
    )
    assert MICRO_BATCHES >= B
    for cls, kwargs in cases:
        for backward, groups, exchange in runs:
            for every in (False, True):
                torch.manual_seed(0)
                model = cls(F, H, num_layers=2, dtype=torch.float64, **kwargs)
                reference = getattr(nn, cls.__name__)(F, H, num_layers=2, dtype=torch.float64, **kwargs)
                reference.load_state_dict(model.state_dict())
                lstm = cls is LSTM
                x = torch.randn(T, B, F, dtype=torch.float64)
                h0 = torch.randn(2 + 2 * lstm, B, H, dtype=torch.float64)  # an LSTM's (h0, c0) stacked
                c, d = (
                    torch.randn(T, B, H, dtype=torch.float64),
                    torch.randn(2 + 2 * lstm, B, H, dtype=torch.float64),
                )

                def state(h, lstm=lstm):  # what the modules take and give: h, or (h, c)
                    return (h[:2], h[2:]) if lstm else h

                def final(s, lstm=lstm):
                    return torch.cat(s) if lstm else s

                xr, h0r = x.clone().requires_grad_(), h0.clone().requires_grad_()
                out, h_n = reference(xr, state(h0r))
                ((out * c).sum() * every + (final(h_n) * d).sum()).backward()

                xl, h0l = x[mine].clone().requires_grad_(), h0.clone().requires_grad_()
                parallel = SequenceParallel(model, backward=backward, micro_batches=groups, exchange=exchange)
                out_l, h_n_l = parallel(xl, state(h0l))
                ((out_l * c[mine]).sum() * every + (final(h_n_l) * d).sum()).backward()
                h_n, h_n_l = final(h_n), final(h_n_l)

                case = f"{cls.__name__} {kwargs} {backward} {exchange} ({groups}) every={every}"
                case += f" rank {rank}/{size}"
                close = {"rtol": 1e-10, "atol": 1e-10, "msg": lambda m, case=case: f"{case}: {m}"}
                torch.testing.assert_close(out_l, out[mine].detach(), **close)
                torch.testing.assert_close(h_n_l, h_n.detach(), **close)
                torch.testing.assert_close(xl.grad, xr.grad[mine], **close)
                for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad, **{**close, "msg": f"{case}: {name}"})
                if rank == 0:
                    torch.testing.assert_close(h0l.grad, h0r.grad, **close)
                else:
                    assert h0l.grad is None or not h0l.grad.any()
                # inputs that need no gradient: the same weight gradients (no input gradient is made)
                model.zero_grad()
                out_l, h_n_l = parallel(x[mine], state(h0))
                ((out_l * c[mine]).sum() * every + (final(h_n_l) * d).sum()).backward()
                for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                    torch.testing.assert_close(
                        p.grad, q.grad, **{**close, "msg": f"{case}: {name}, no x grad"}
                    )


@pytest.mark.parametrize("size", extended_except([1, 2, 3, 4], 2))
def test_gradients_equal_single_process_autograd(size: int) -> None:
    _ranks(size, _exact)


def _on_gpus(rank: int, size: int) -> None:
    """Both backwards of RNN and GRU (BPPSA's by either exchange) against torch.nn's autograd on the
    same GPU, in float64: in float32 cuDNN's reference may run in TF32
    (``torch.backends.cudnn.allow_tf32``), 5e-4 off."""
    device = torch.device("cuda", rank)
    mine = _mine(rank, size)
    for cls in (RNN, GRU):
        for backward, exchange in (("bppsa", "allgather"), ("bppsa", "chain"), ("bptt", "allgather")):
            torch.manual_seed(0)
            model = cls(F, H, num_layers=2, device=device, dtype=torch.float64)
            reference = getattr(nn, cls.__name__)(F, H, num_layers=2, device=device, dtype=torch.float64)
            reference.load_state_dict(model.state_dict())
            x = torch.randn(T, B, F, device=device, dtype=torch.float64)
            xr, xl = x.clone().requires_grad_(), x[mine].clone().requires_grad_()
            out, h_n = reference(xr)
            (out.sum() + h_n.sum()).backward()
            out_l, h_n_l = SequenceParallel(model, backward=backward, exchange=exchange)(xl)
            (out_l.sum() + h_n_l.sum()).backward()
            close = {
                "rtol": 1e-10,
                "atol": 1e-10,
                "msg": lambda m, c=f"{cls.__name__} {backward} {exchange}": f"{c}: {m}",
            }
            torch.testing.assert_close(h_n_l, h_n.detach(), **close)
            torch.testing.assert_close(xl.grad, xr.grad[mine], **close)
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, **close)


@pytest.mark.gpu
def test_nccl_ranks_of_one_gpu_each_give_autograds_gradients() -> None:
    """As many ranks as GPUs, up to 4 (one on a one-GPU machine: the NCCL path end to end)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    _ranks(min(4, torch.cuda.device_count()), _on_gpus, backend="nccl")


def _folds_in_the_forward(rank: int, size: int) -> None:
    """With the all-gather, each middle rank folds each layer's slice once, in the forward, and only
    when a backward can follow; the first and last ranks never fold. A retained graph goes back twice
    from one fold. CPU ranks by default chain their slices: no rank folds, and every one receives a
    gradient from the next rank but the last."""
    from unittest import mock

    import bppsa_core.distributed as sp

    model = GRU(F, H, num_layers=2, dtype=torch.float64)
    x = torch.randn(T, B, F, dtype=torch.float64)
    mine = torch.tensor_split(x, size)[rank]
    middle = 0 < rank < size - 1
    with mock.patch.object(sp, "slice_fold", wraps=sp.slice_fold) as folds:
        out, h_n = SequenceParallel(model)(mine)
        with mock.patch.object(sp.dist, "irecv", wraps=sp.dist.irecv) as receives:
            (out.sum() + h_n.sum()).backward()
        assert folds.call_count == 0, f"rank {rank}: folded under the default exchange on CPU ranks"
        assert (receives.call_count > 0) == (rank < size - 1), f"rank {rank}: {receives.call_count} receives"
        model.zero_grad()
        parallel = SequenceParallel(model, exchange="allgather")
        with torch.no_grad():
            parallel(mine)
        assert folds.call_count == 0, f"rank {rank}: folded without a backward to come"
        out, h_n = parallel(mine)
        assert folds.call_count == 2 * middle, f"rank {rank}: {folds.call_count} folds in the forward"
        loss = out.sum() + h_n.sum()
        loss.backward(retain_graph=True)
        once = [p.grad.clone() for p in model.parameters()]
        loss.backward()  # a retained graph goes back again from what the forward folded
        for p, g in zip(model.parameters(), once, strict=True):
            torch.testing.assert_close(p.grad, 2 * g, rtol=1e-12, atol=1e-12)
        assert folds.call_count == 2 * middle, f"rank {rank}: folded again in the backward"
        SequenceParallel(model, backward="bptt")(mine)[1].sum().backward()
        assert folds.call_count == 2 * middle, f"rank {rank}: distributed BPTT folded"


@pytest.mark.extended
def test_a_middle_rank_folds_in_the_forward_only() -> None:
    _ranks(4, _folds_in_the_forward)


def _spans(rank: int, size: int) -> None:
    """Three ranks, two sample groups, a loss on every output (so the middle rank walks twice per
    group: its own outputs' part and the gradient from the right)."""
    import bppsa_core.distributed as sp
    from bppsa_core.distributed import timeline

    sp.GROUP_SAMPLES = 1  # groups of fewer samples than a CPU rank's tiles take, for a batch of 3
    torch.manual_seed(0)
    parallel = SequenceParallel(RNN(F, H, dtype=torch.float64), micro_batches=2, exchange="allgather")
    x = torch.randn(T, B, F, dtype=torch.float64)[_mine(rank, size)]
    timeline.reset()
    out, h_n = parallel(x)
    (out.sum() + h_n.sum()).backward()
    assert timeline.spans == []  # off unless asked for
    timeline.on = True
    try:
        out, h_n = parallel(x)
        (out.sum() + h_n.sum()).backward()
    finally:
        timeline.on = False
    names = [what for what, _, _ in timeline.spans]
    count = {what: names.count(what) for what in set(names)}
    walks = {0: 2, 1: 4, 2: 2}[rank]
    expected = {"walk": walks, "all-gather": 2, "all-reduce": 1} | ({"wait": 1} if rank == 2 else {})
    assert count == expected, f"rank {rank}: {count}"
    assert all(start <= end for _, start, end in timeline.spans)
    if rank == 0:  # the first rank walks a group once its all-gather has brought the gradient
        (_, _, gathered), (what, walked, _) = timeline.spans[:2]
        assert what == "walk" and walked >= gathered


@pytest.mark.extended
def test_the_timeline_records_each_ranks_spans_only_when_on() -> None:
    _ranks(3, _spans)


def _order(rank: int, size: int) -> None:
    """Three ranks, two sample groups: each rank's all-gathers (started without waiting, or waited
    for) and walks in the order it makes them, for a loss on h_T and on every output."""
    from unittest import mock

    import bppsa_core.distributed as sp

    sp.GROUP_SAMPLES = 1  # groups of fewer samples than a CPU rank's tiles take, for a batch of 3
    torch.manual_seed(0)
    parallel = SequenceParallel(RNN(F, H, dtype=torch.float64), micro_batches=2, exchange="allgather")
    x = torch.randn(T, B, F, dtype=torch.float64)[_mine(rank, size)]
    events, real_gather, real_walk = [], dist.all_gather, sp.bppsa_backward

    def gather(*args, async_op=False, **kwargs):
        events.append("start" if async_op else "gather")
        return real_gather(*args, async_op=async_op, **kwargs)

    def walk(*args):
        events.append("walk")
        return real_walk(*args)

    for every_output in (False, True):
        out, h_n = parallel(x)
        loss = h_n.sum() + (out.sum() if every_output else 0)
        events.clear()
        with (
            mock.patch.object(sp.dist, "all_gather", gather),
            mock.patch.object(sp, "bppsa_backward", walk),
        ):
            loss.backward()
        # the first rank, and a middle rank whose outputs the loss does not reach, share no walk:
        # they start both groups' all-gathers before they walk; the others exchange group by group
        expected = {
            0: ["start", "start", "walk", "walk"],
            1: ["walk", "gather", "walk"] * 2 if every_output else ["start", "start", "walk", "walk"],
            2: ["walk", "start"] * 2,
        }[rank]
        assert events == expected, f"rank {rank}, loss on every output {every_output}: {events}"


@pytest.mark.extended
def test_ranks_whose_share_needs_no_walk_start_every_all_gather_before_walking() -> None:
    _ranks(3, _order)


def _one_scratch(rank: int, size: int) -> None:
    """Each rank walks its sample groups with one set of scratch buffers, not fresh ones per group."""
    from unittest import mock

    import bppsa_core.distributed as sp
    import bppsa_core.numba_scan as numba_scan

    sp.GROUP_SAMPLES = 1  # groups of fewer samples than a CPU rank's tiles take, for a batch of 3
    torch.manual_seed(0)
    parallel = SequenceParallel(RNN(F, H, dtype=torch.float64), micro_batches=2)  # groups of 2 and 1
    out, h_n = parallel(torch.randn(T, B, F, dtype=torch.float64)[_mine(rank, size)])
    walks = []

    class Walk(numba_scan.RNNWalk):
        def __call__(self, first, last, g_in, g_out, delta):
            walks.append(delta)  # held: no freed buffer's address can come back as a "new" one
            return super().__call__(first, last, g_in, g_out, delta)

    from bppsa_core import jacobians

    # these small groups' scratch named too (``jacobians.SCRATCH_MIN_BYTES``)
    with (
        mock.patch.object(numba_scan, "RNNWalk", Walk),
        mock.patch.object(jacobians, "SCRATCH_MIN_BYTES", 0),
    ):
        (h_n.sum() + out.sum()).backward()
    assert len(walks) == 2, f"rank {rank}: {len(walks)} walks"
    assert len({w.untyped_storage().data_ptr() for w in walks}) == 1, f"rank {rank}: a buffer per group"


@pytest.mark.extended
def test_a_ranks_sample_groups_share_the_walks_scratch() -> None:
    _ranks(2, _one_scratch)


def _forward_sends(rank: int, size: int) -> None:
    """A layer that runs compiled hands its last state on a group of samples at a time (groups of
    ``GROUP_SAMPLES`` samples at least, ``micro_batches`` at most), where the shortest slice
    has ``FORWARD_GROUP_MIN_STEPS``; one that runs PyTorch's kernel (strategy "sequential", or
    compiled on one rank only) and the BPTT baseline hand on the batch whole. Either way the
    outputs and final states are torch.nn's."""
    from unittest import mock

    from bppsa_core import distributed as sp

    batch = 3 * sp.GROUP_SAMPLES + 1
    x = torch.randn(T, batch, F, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    shortest = T // size
    # strategy, backward, micro-batches, the least steps, the first rank compiled only; sends a layer
    cases = (
        ("numba", "bppsa", MICRO_BATCHES, shortest, False, 3),
        ("numba", "bppsa", 2, shortest, False, 2),
        ("numba", "bppsa", MICRO_BATCHES, shortest + 1, False, 1),
        ("numba", "bppsa", MICRO_BATCHES, shortest, True, 1),
        ("sequential", "bppsa", MICRO_BATCHES, shortest, False, 1),
        ("numba", "bptt", MICRO_BATCHES, shortest, False, 1),
    )
    real = sp.dispatch.compiled_forward
    for strategy, backward, groups, least, first_only, per_layer in cases:
        torch.manual_seed(0)
        model = GRU(F, H, num_layers=2, dtype=torch.float64, strategy=strategy)
        reference = nn.GRU(F, H, num_layers=2, dtype=torch.float64)
        reference.load_state_dict(model.state_dict())
        compiled = (lambda *a: real(*a) and rank == 0) if first_only else real
        with (
            mock.patch.object(sp, "FORWARD_GROUP_MIN_STEPS", least),
            mock.patch.object(sp, "FORWARD_GROUP_WORK", 0),  # as many groups as there may be
            mock.patch.object(sp.dispatch, "compiled_forward", compiled),
            mock.patch.object(sp.dist, "isend", wraps=sp.dist.isend) as isend,
            mock.patch.object(sp.dist, "send", wraps=sp.dist.send) as send,
        ):
            out, h_n = SequenceParallel(model, backward=backward, micro_batches=groups)(x[_mine(rank, size)])
        case = f"{strategy} {backward} ({groups}, {least} steps, first only {first_only}), rank {rank}"
        sent = isend.call_count + send.call_count
        assert sent == (2 * per_layer if rank < size - 1 else 0), f"{case}: {sent} sends"
        expected, expected_h_n = reference(x)
        close = {"rtol": 1e-12, "atol": 1e-12, "msg": lambda m, case=case: f"{case}: {m}"}
        torch.testing.assert_close(out, expected[_mine(rank, size)].detach(), **close)
        torch.testing.assert_close(h_n, expected_h_n.detach(), **close)


@pytest.mark.parametrize(
    ("batch", "ranks", "work", "micro_batches", "groups"),
    [
        (16, 2, 420, 16, 2),  # the paper's RNN: a group's own work is about 5 samples'
        (16, 4, 420, 16, 4),  # more ranks to fill: more groups
        (64, 2, 420, 16, 4),
        (16, 2, 3 * 20 * 44, 16, 4),  # its GRU (24 inputs): a group costs little more than its samples
        (16, 2, 0, 16, 4),  # work unknown: as many as groups of GROUP_SAMPLES allow
        (16, 2, 420, 1, 1),  # micro_batches bounds them
        (3, 2, 0, 16, 1),  # fewer samples than a group takes
    ],
)
def test_a_compiled_forward_takes_the_group_count_whose_pipeline_ends_first(
    batch, ranks, work, micro_batches, groups
) -> None:
    from bppsa_core.distributed import FORWARD_GROUP_MIN_STEPS, forward_groups

    assert forward_groups(batch, FORWARD_GROUP_MIN_STEPS, micro_batches, ranks, work) == groups
    assert forward_groups(batch, FORWARD_GROUP_MIN_STEPS - 1, micro_batches, ranks, work) == 1


@pytest.mark.extended
def test_a_compiled_forward_hands_its_state_on_a_group_of_samples_at_a_time() -> None:
    _ranks(2, _forward_sends)


def _taped(rank: int, size: int) -> None:
    """A GRU's or an LSTM's ranks keep a tape for each group of samples their backward walks, which
    their forward's groups (2 of 4 samples here) write a backward group (2 samples) at a time, each
    into C-contiguous arrays, and which their walks take instead of recomputing the gates: autograd's
    gradients, float64. The tapes go once the backward has run, though the outputs live on."""
    import gc
    import weakref
    from unittest import mock

    import bppsa_core.distributed as sp
    from bppsa_core import layer, numba_forward

    batch, mine, real = 8, _mine(rank, size), numba_forward.layer_forward
    written = []  # per forward call: its samples, and whether its tape's arrays are C-contiguous
    alive, real_tapes = [], sp._new_tapes

    def tapes(*args):
        made = real_tapes(*args)
        alive.extend(weakref.ref(tape.gates) for tape in made or ())
        return made

    def forward(*args, **kwargs):
        tape = args[8] if len(args) > 8 else kwargs.get("tape")
        arrays = [a for a in tape or () if a is not None]
        written.append((args[1].shape[1], bool(arrays) and all(a.flags.c_contiguous for a in arrays)))
        return real(*args, **kwargs)

    for cls in (GRU, LSTM):
        torch.manual_seed(0)
        model = cls(F, H, dtype=torch.float64)
        reference = getattr(nn, cls.__name__)(F, H, dtype=torch.float64)
        reference.load_state_dict(model.state_dict())
        x = torch.randn(T, batch, F, dtype=torch.float64)
        xr, xl = x.clone().requires_grad_(), x[mine].clone().requires_grad_()
        out, h_n = reference(xr)
        h_n = h_n[0] if cls is LSTM else h_n
        (out.sum() + h_n.pow(2).sum()).backward()
        written.clear()
        alive.clear()
        with (
            mock.patch.object(sp, "GROUP_SAMPLES", 2),  # the backward: 4 groups of 2
            mock.patch.object(sp, "FORWARD_GROUP_MIN_STEPS", 1),
            mock.patch.object(sp, "forward_groups", lambda *args: 2),  # the forward: 2 groups of 4
            mock.patch.object(numba_forward, "layer_forward", forward),
            mock.patch.object(sp, "_new_tapes", tapes),
            mock.patch.object(layer, "_taped_backward", wraps=layer._taped_backward) as taped,
            mock.patch.object(layer, "_backward", wraps=layer._backward) as untaped,
        ):
            out_l, h_n_l = SequenceParallel(model, micro_batches=4)(xl)
            h_n_l = h_n_l[0] if cls is LSTM else h_n_l
            (out_l.sum() + h_n_l.pow(2).sum()).backward()
        case = f"{cls.__name__}, rank {rank}"
        assert written == [(2, True)] * 4, f"{case}: the forward's calls (samples, C-contiguous): {written}"
        assert (taped.call_count, untaped.call_count) == (4, 0), f"{case}: {taped.call_count} taped walks"
        taped.reset_mock()  # the calls it recorded hold the tapes
        gc.collect()
        assert len(alive) == 4 and all(r() is None for r in alive), f"{case}: tapes kept past the backward"
        close = {"rtol": 1e-10, "atol": 1e-10, "msg": lambda m, case=case: f"{case}: {m}"}
        torch.testing.assert_close(xl.grad, xr.grad[mine], **close)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **{**close, "msg": f"{case}: {name}"})


@pytest.mark.extended
def test_gru_and_lstm_ranks_walk_a_tape_per_group_of_samples() -> None:
    _ranks(2, _taped)


@pytest.mark.parametrize(
    ("span", "walked", "pieces"),
    [
        ((0, 8), [(0, 4), (4, 8)], [(0, 4), (4, 8)]),  # groups nested in the backward's: theirs
        ((3, 6), [(0, 2), (2, 4), (4, 6)], [(3, 4), (4, 6)]),  # across a boundary: cut there
        ((0, 2), [(0, 4), (4, 8)], [(0, 2)]),  # within one: whole
    ],
)
def test_a_taped_forwards_group_is_cut_where_the_backwards_groups_begin(span, walked, pieces) -> None:
    from bppsa_core.distributed import _cut

    assert _cut(slice(*span), [slice(*w) for w in walked]) == [slice(*p) for p in pieces]


def _rank_blocks(rank: int, size: int) -> None:
    """A CPU rank of several stores its outputs batch-major and takes its blocks of steps within
    ``RANK_BLOCK_BYTES``; one rank keeps time-major outputs and a process's budget (both budgets
    shrunk here, so that a slice of a few steps spans several blocks)."""
    from unittest import mock

    import bppsa_core.layer as layer
    from bppsa_core import distributed, jacobians

    step = (4 * H + F + H) * 8  # what layer_grads counts per step and sample (float64)
    lengths, real = [], layer.layer_grads

    def grads(deltas, *args):
        def taken(t: slice):
            gi, gh = deltas(t)
            lengths.append(gi.shape[0])
            return gi, gh

        return real(taken, *args)

    distributed.GROUP_SAMPLES = 1  # on several ranks, groups of one sample, for a batch of 3
    torch.manual_seed(0)
    parallel = SequenceParallel(RNN(F, H, dtype=torch.float64))
    out, h_n = parallel(torch.randn(T, B, F, dtype=torch.float64)[_mine(rank, size)])
    layout = (H, out.shape[0] * H, 1) if size > 1 else (B * H, H, 1)
    assert out.stride() == layout, f"rank {rank} of {size}: outputs of strides {out.stride()}"
    with (
        mock.patch.dict(jacobians.BLOCK_BYTES, cpu=4 * B * step),  # 4 steps of the whole batch
        mock.patch.object(distributed, "RANK_BLOCK_BYTES", 2 * step),  # 2 steps of one sample
        mock.patch.object(layer, "layer_grads", grads),
    ):
        (h_n.sum() + out.sum()).backward()
    assert max(lengths) == (2 if size > 1 else 4), f"rank {rank} of {size}: blocks of {lengths} steps"


@pytest.mark.extended
def test_a_cpu_rank_of_several_stores_its_outputs_batch_major_and_walks_in_blocks_of_its_own_budget() -> None:
    _ranks(1, _rank_blocks)
    _ranks(2, _rank_blocks)


def _data_and_sequence(rank: int, size: int) -> None:
    """Four ranks: two replicas of DistributedDataParallel, each a sequence split over two ranks."""
    from torch.nn.parallel import DistributedDataParallel

    replica, part = divmod(rank, 2)
    sequence_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    data_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(0)
    model = GRU(F, H, num_layers=2, dtype=torch.float64)
    reference = nn.GRU(F, H, num_layers=2, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    xs = torch.randn(2, T, B, F, dtype=torch.float64)  # one batch per replica
    for x in xs:  # DDP averages the replicas' gradients
        (reference(x)[1].pow(2).sum() / 2).backward()
    parallel = DistributedDataParallel(
        SequenceParallel(model, sequence_groups[replica]), process_group=data_groups[part]
    )
    mine = torch.tensor_split(xs[replica], 2)[part]
    parallel(mine)[1].pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=f"rank {rank}: {name}")


@pytest.mark.extended
def test_sequence_parallel_composes_with_distributed_data_parallel() -> None:
    _ranks(4, _data_and_sequence)


def _refusals(rank: int, size: int) -> None:
    model = GRU(F, H, dtype=torch.float64)
    x = torch.randn(1 if rank == 0 else 0, B, F, dtype=torch.float64)  # one step for 2 ranks
    with pytest.raises(SequenceParallelError, match=r"the time slices have \[1, 0\] steps over 2 ranks"):
        SequenceParallel(model)(x)
    x = torch.randn(3, B + rank, F, dtype=torch.float64)
    with pytest.raises(SequenceParallelError, match=r"the ranks hold batches of \[3, 4\]"):
        SequenceParallel(model)(x)


def test_a_split_that_does_not_add_up_is_refused_on_every_rank() -> None:
    _ranks(2, _refusals)


@pytest.mark.parametrize(
    ("module", "kwargs", "message"),
    [
        (nn.LSTM(F, H, proj_size=2), {}, "an LSTM with proj_size 2 cannot run sequence-parallel"),
        (
            nn.Linear(F, H),
            {},
            "cannot run Linear sequence-parallel; accepted: RNN (tanh, relu), GRU and LSTM",
        ),
        (GRU(F, H, bidirectional=True), {}, "bidirectional layers cannot run sequence-parallel"),
        (GRU(F, H, num_layers=2, dropout=0.5), {}, "dropout 0.5 between layers is not taken"),
        (GRU(F, H), {"backward": "ring"}, "unknown backward 'ring'; accepted: bppsa, bptt"),
        (GRU(F, H), {"exchange": "tree"}, "unknown exchange 'tree'; accepted: auto, allgather, chain"),
        (GRU(F, H), {"micro_batches": 0}, "micro_batches 0 is not taken; accepted: a positive integer"),
        (GRU(F, H), {"micro_batches": 2.5}, "micro_batches 2.5 is not taken; accepted: a positive integer"),
    ],
)
def test_modules_it_cannot_split_are_refused_at_construction(module, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SequenceParallel(module, **kwargs)


# --- the benchmark --------------------------------------------------------------------------------


@pytest.mark.extended
def test_the_benchmark_times_both_modes_and_its_bytes_do_not_grow_with_t(tmp_path, capsys) -> None:
    import pandas as pd

    from analysis.schemes.machine import load_calibration
    from analysis.schemes.report import load_measured
    from benchmarks import distributed as bench

    args = ["--ranks", "1", "2", "--T", "40", "80", "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "| 80 | 2 | bppsa |" in printed and "vs BPTT, same ranks" in printed
    rows = pd.read_csv(tmp_path / "measured.csv")
    assert set(zip(rows["scheme"], rows["p"], strict=True)) == {
        (s, p)
        for s in ("bppsa-chain", "bptt-distributed")
        for p in (1, 2)  # CPU ranks' default exchange
    }
    assert (rows["time"] > 0).all() and (rows["backward_s"] > 0).all()
    assert (rows["memory_per_rank"] > 0).all()  # the forward keeps its states for the backward
    assert "| memory vs 1 rank |" in printed
    # one rank's BPPSA also ran in the two ranks' processes: a speedup on their BPPSA rows only
    bppsa_two = (rows["p"] == 2) & (rows["backward"] == "bppsa")
    assert (rows.loc[bppsa_two, "speedup_same_processes"] > 0).all()
    assert rows.loc[~bppsa_two, "speedup_same_processes"].isna().all()
    line = next(line for line in printed.splitlines() if line.startswith("| 80 | 2 | bppsa |"))
    assert "| vs 1 rank, same processes |" in printed and line.split("|")[8].strip().endswith("×")
    two = rows[(rows["p"] == 2) & (rows["backward"] == "bppsa")].set_index("T")["bytes_per_rank"]
    assert two[40] == two[80] > 0  # a gradient of B·H numbers handed on, whatever T
    load_measured(tmp_path / "measured.csv")  # what analysis.schemes draws beside its model
    # one rank's costs at the largest T, as the model charges a device (analysis.schemes)
    costs = load_calibration(tmp_path / "calibration.json")
    assert (
        set(costs)
        == {"forward_step", "forward_sample", "forward_group", "walk", "fold", "overhead", "groups"}
        and costs["groups"] == 16 // GROUP_SAMPLES  # a CPU rank's groups: MICRO_BATCHES at most
    )
    one = rows[(rows["p"] == 1) & (rows["T"] == 80)].set_index("backward")
    # BPTT's forward is the fused one, per step; BPPSA's is compiled here, per step and sample and
    # per step of a group of samples run at once, one group of 16 making one rank's forward
    assert costs["forward_step"] == pytest.approx(one.loc["bptt", "forward_s"] / 80)
    assert costs["forward_sample"] > 0 and costs["forward_group"] >= 0
    per_step = costs["forward_group"] + 16 * costs["forward_sample"]
    assert per_step == pytest.approx(one.loc["bppsa", "forward_s"] / 80)
    assert costs["walk"] == pytest.approx(one.loc["bppsa", "backward_s"] / (80 * 16))
    assert costs["overhead"] == pytest.approx(one.loc["bptt", "backward_s"] / 159)
    assert costs["fold"] > 0 and "one rank at T = 80: forward" in printed
    # without one rank there are no costs to calibrate, and the earlier ones do not stay beside new rows
    assert bench.main(["--ranks", "2", *args[3:]]) == 0
    alone = pd.read_csv(tmp_path / "measured.csv")
    assert not (tmp_path / "calibration.json").exists() and set(alone["p"]) == {2}
    assert alone["speedup_same_processes"].isna().all()  # nor is one rank run alongside


@pytest.mark.extended
def test_the_benchmark_runs_an_lstm_with_its_loss_on_h_t(tmp_path, capsys) -> None:
    import pandas as pd

    from benchmarks import distributed as bench

    args = ["--model", "lstm", "--ranks", "1", "2", "--T", "40", "--warmup", "0", "--repeats", "1"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    assert "lstm, 1 layer(s)" in capsys.readouterr().out
    rows = pd.read_csv(tmp_path / "measured.csv")
    assert (rows["backward_s"] > 0).all() and set(rows["p"]) == {1, 2}
    two = rows[(rows["p"] == 2) & (rows["backward"] == "bppsa")]
    assert (two["bytes_per_rank"] > 0).all()  # h and c handed on: B·2H numbers
    assert json.loads((tmp_path / "calibration.json").read_text())["fold"] > 0


@pytest.mark.extended
def test_the_benchmark_prints_each_ranks_timeline_when_asked(capsys) -> None:
    from benchmarks import distributed as bench

    args = ["--ranks", "1", "2", "--T", "40", "--B", "8", "--warmup", "0", "--repeats", "1"]  # groups of 4
    assert bench.main(args) == 0
    assert "each rank's spans" not in capsys.readouterr().out
    allgather = ["--ranks", "2", *args[3:], "--timeline", "--micro-batches", "2", "--exchange", "allgather"]
    assert bench.main(allgather) == 0
    two = capsys.readouterr().out.split("BPPSA backward, T = 40, 2 rank(s)")[1].splitlines()
    assert two[1].startswith("rank 0: all-gather ") and two[1].count("walk ") == 2
    assert two[2].startswith("rank 1: walk ") and "wait " in two[2] and two[2].endswith(tuple("0123456789)"))


def test_a_timeline_prints_each_span_in_milliseconds_in_the_order_it_began() -> None:
    from benchmarks.distributed import timeline_text

    spans = [[("all-reduce", 0.030, 0.0305), ("walk", 0.0102, 0.0251), ("all-gather", 0.0001, 0.01)], []]
    assert timeline_text(spans) == (
        "rank 0: all-gather 0.1-10.0, walk 10.2-25.1 (14.9), all-reduce 30.0-30.5\nrank 1: "
    )


def test_rounds_take_turns_and_the_speedups_are_the_median_of_each_rounds_own(
    tmp_path, monkeypatch, capsys
) -> None:
    import pandas as pd

    from benchmarks import distributed as bench

    # backward seconds per round and rank count: each round's ratio 2.0, 1.5 and 1.25 (median 1.5),
    # where the ratio of the medians (2.0 / 1.0) would read 2.0
    bppsa = {1: [2.0, 3.0, 1.0], 2: [1.0, 2.0, 0.8]}
    calls: list[int] = []

    def measure(steps, ranks, settings):
        turn = sum(1 for c in calls if c == ranks)
        calls.append(ranks)
        times = {
            "bppsa": {"forward": 0.5, "backward": bppsa[ranks][turn]},
            "bptt": {"forward": 0.5, "backward": 10 * bppsa[ranks][turn]},
        }
        rank = {
            "times": times,
            "sent": {"bppsa": 100, "bptt": 10},
            "memory": {"bppsa": 40 * 2**20 // ranks, "bptt": 1},
        }
        if ranks == 1:
            return [{**rank, "fold": 0.1 * (turn + 1), "compiled_forward": False}]
        return [{**rank, "alone_speedup": [1.9, 1.2, 1.6][turn]}, rank]  # rank 0's, in the same processes

    monkeypatch.setattr(bench, "measure", measure)
    args = ["--ranks", "1", "2", "--T", "50", "--rounds", "3", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    assert calls == [1, 2, 2, 1, 1, 2]  # the rank counts take turns
    out, err = capsys.readouterr()
    assert "round 3 of 3, T = 50, 2 rank(s)" in err and "then over 3 rounds taking turns" in out
    two = next(line for line in out.splitlines() if line.startswith("| 50 | 2 | bppsa |"))
    cells = [c.strip() for c in two.strip("|").split("|")]
    assert cells[3:] == [
        "500.0",
        "1000.0",
        "10.00× (10.00–10.00)",
        "1.50× (1.25–2.00)",
        "1.60× (1.20–1.90)",
        "100",
        "20",
        "0.50× (0.50–0.50)",
    ]
    rows = pd.read_csv(tmp_path / "measured.csv")  # one row per mode and rank count: the medians
    assert len(rows) == 4
    two = rows[(rows["p"] == 2) & (rows["backward"] == "bppsa")].iloc[0]
    assert two["backward_s"] == 1.0 and two["time"] == 1.5
    costs = json.loads((tmp_path / "calibration.json").read_text())
    assert costs["fold"] == pytest.approx(0.2 / (50 * 16))
    # a forward that did not run compiled: BPPSA's is priced as the fused one, BPTT's
    assert costs["forward_sample"] == costs["forward_group"] == 0
    assert costs["forward_step"] == pytest.approx(0.5 / 50)
    assert "forward BPTT's 0.01 s per step, BPPSA's fused;" in out


@pytest.mark.parametrize(
    ("share", "batch", "split"),
    [
        (0.4, 16, (0.05, 0.2)),  # a group of 4 costs 0.2 + 4 * 0.05 = 0.4 of the 16 samples' step
        (0.25, 16, (1 / 16, 0.0)),  # in proportion to its samples: no part per group
        (0.2, 16, (1 / 16, 0.0)),  # cheaper than its samples: no line with a part >= 0 passes both
        (1.2, 16, (1 / 16, 0.0)),  # dearer than the whole batch: none with a part per sample > 0
        (0.0, 16, (1 / 16, 0.0)),  # none measured
        (1.0, 4, (0.25, 0.0)),  # the batch is one group
    ],
)
def test_a_compiled_forwards_step_splits_into_a_part_per_sample_and_one_per_group(
    share, batch, split
) -> None:
    from benchmarks.distributed import forward_split

    assert forward_split(1.0, batch, share) == pytest.approx(split)


def test_each_spawns_times_are_printed_as_it_ends_so_a_stopped_run_keeps_them(monkeypatch, capsys) -> None:
    from benchmarks import distributed as bench

    calls: list[int] = []

    def measure(steps, ranks, settings):
        calls.append(ranks)
        if len(calls) == 3:
            raise RuntimeError("the machine was lost")
        times = {
            "bppsa": {"forward": 0.25, "backward": 0.5 / ranks},
            "bptt": {"forward": 0.25, "backward": 4.0},
        }
        rank = {"times": times, "sent": {"bppsa": 1, "bptt": 1}, "memory": {"bppsa": 1, "bptt": 1}}
        return (
            [{**rank, "fold": 0.1, "compiled_forward": True}]
            if ranks == 1
            else [{**rank, "alone_speedup": 1.75}, rank]
        )

    monkeypatch.setattr(bench, "measure", measure)
    with pytest.raises(RuntimeError, match="lost"):
        bench.main(["--ranks", "1", "2", "--T", "50", "--rounds", "2"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "rank(s):" in line]
    assert lines == [
        "[distributed] T = 50, 1 rank(s): bppsa forward 250.0 ms, backward 500.0 ms; "
        "bptt forward 250.0 ms, backward 4000.0 ms",
        "[distributed] T = 50, 2 rank(s): bppsa forward 250.0 ms, backward 250.0 ms; "
        "bptt forward 250.0 ms, backward 4000.0 ms; BPPSA 1.75× one rank in the same processes",
    ]


@pytest.mark.parametrize(
    ("device", "ranks", "alongside"),
    [("cpu", ["1", "2"], True), ("cpu", ["2", "3"], False), ("cuda", ["1", "2"], False)],
)
def test_one_rank_runs_in_the_p_ranks_processes_only_on_cpus_and_when_one_rank_is_asked_for(
    device, ranks, alongside, monkeypatch
) -> None:
    from benchmarks import distributed as bench

    asked = []

    def measure(steps, ranks, settings):
        asked.append(settings["alongside"])
        rank = {"times": {b: {"forward": 1.0, "backward": 1.0} for b in ("bppsa", "bptt")}}
        rank |= {"sent": {"bppsa": 1, "bptt": 1}, "memory": {"bppsa": 1, "bptt": 1}}
        return [rank] * ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(bench, "measure", measure)
    assert bench.main(["--device", device, "--ranks", *ranks, "--T", "30"]) == 0
    assert asked == [alongside, alongside]


def test_the_exchange_taken_reaches_the_ranks_and_names_its_rows_as_the_model_does(
    tmp_path, monkeypatch, capsys
) -> None:
    import pandas as pd

    from analysis.schemes.report import load_measured
    from benchmarks import distributed as bench

    asked = []

    def measure(steps, ranks, settings):
        asked.append(settings["exchange"])
        rank = {"times": {b: {"forward": 1.0, "backward": 1.0} for b in ("bppsa", "bptt")}}
        rank |= {"sent": {"bppsa": 1, "bptt": 1}, "memory": {"bppsa": 1, "bptt": 1}}
        return [rank] * ranks

    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    # the module's default names the exchange it takes: the chain on CPU ranks, the all-gather on GPUs
    cases = (([], "chain"), (["--exchange", "allgather"], "allgather"), (["--device", "cuda"], "allgather"))
    for extra, taken in cases:
        asked.clear()
        out = tmp_path / taken / str(len(extra))
        assert bench.main(["--ranks", "2", "3", "--T", "30", *extra, "--out", str(out)]) == 0
        assert asked == [taken, taken] and f"BPPSA's exchange {taken};" in capsys.readouterr().out
        rows = pd.read_csv(out / "measured.csv")
        assert set(rows["scheme"]) == {f"bppsa-{taken}", "bptt-distributed"}
        load_measured(out / "measured.csv")  # schemes the model draws


def test_the_speedup_in_the_same_processes_pairs_each_iteration_and_other_ranks_only_meet(
    monkeypatch,
) -> None:
    """Rank 0's one-rank backward over the p ranks' right after it, iteration by iteration: the median
    of the pairs, not the ratio of the medians; a rank without that turn meets each of its barriers."""
    from benchmarks import distributed as bench

    clock = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    weight = torch.ones(1, requires_grad=True)

    def run(durations: list[float]):
        def forward(x):
            h_n = (weight * x).unsqueeze(0)
            h_n.register_hook(lambda g: clock.__setitem__(0, clock[0] + durations.pop(0)))
            return h_n, h_n

        return forward

    # alone 4, 9, 3 s against 2, 3, 3: pairs 2, 3 and 1 (median 2), medians' ratio 4 / 3
    turns = {"alone": (run([4.0, 9.0, 3.0]), torch.ones(1)), "bppsa": (run([2.0, 3.0, 3.0]), torch.ones(1))}
    met = []
    result = bench._times(turns, torch.nn.Linear(1, 1), lambda: met.append(1), 0, 3)
    assert result["alone_speedup"] == 2.0 and result["times"]["alone"]["backward"] == 4.0
    mine = len(met)
    met.clear()
    other = bench._times(
        {"alone": None, "bppsa": (run([1.0] * 3), torch.ones(1))},
        torch.nn.Linear(1, 1),
        lambda: met.append(1),
        0,
        3,
    )
    assert len(met) == mine == 18 and set(other["times"]) == {"bppsa"} and "alone_speedup" not in other


@pytest.mark.parametrize(
    ("device", "spawns"),
    [("cpu", [(("memory",), "65536"), (("times",), None)]), ("cuda", [(("memory", "times"), None)])],
)
def test_memory_is_measured_under_its_malloc_setting_and_times_without_it(
    device, spawns, monkeypatch
) -> None:
    """On CPUs the peaks come from processes whose malloc unmaps every large freed block, the times
    from processes with the usual malloc (which the setting slows); torch's allocator needs neither."""
    from benchmarks import distributed as bench

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    seen = []

    def spawn(fn, args, nprocs, join):
        ranks, _, out, settings = args
        seen.append((settings["phases"], os.environ.get("MALLOC_MMAP_THRESHOLD_")))
        result = {"memory": 1} if "memory" in settings["phases"] else {}
        result |= {"times": 2} if "times" in settings["phases"] else {}
        Path(out).write_text(json.dumps([result] * ranks))

    monkeypatch.setattr(bench.mp, "spawn", spawn)
    assert bench.measure(40, 2, {"device": device}) == [{"times": 2, "memory": 1}] * 2
    assert seen == spawns


def test_the_benchmark_refuses_a_sequence_shorter_than_the_ranks(capsys) -> None:
    from benchmarks import distributed as bench

    with pytest.raises(SystemExit) as stop:
        bench.main(["--ranks", "1", "4", "--T", "3"])
    assert stop.value.code == 2
    assert "--T 3 is shorter than 4 ranks" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        (0, "--device cuda: no CUDA GPU is visible; accepted: --device cpu"),
        (1, "--ranks 2 with --device cuda needs a GPU per rank and 1 are visible; accepted: at most 1"),
    ],
)
def test_the_benchmark_refuses_more_gpu_ranks_than_gpus(gpus, message, tmp_path, monkeypatch, capsys) -> None:
    from benchmarks import distributed as bench

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--device", "cuda", "--ranks", "1", "2", "--T", "30", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and not (tmp_path / "out").exists()
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.extended
def test_the_benchmark_stacks_layers_but_writes_only_what_the_one_layer_model_prices(
    tmp_path, capsys
) -> None:
    from benchmarks import distributed as bench

    assert (
        bench.main(["--ranks", "1", "3", "--T", "30", "--layers", "2", "--warmup", "0", "--repeats", "1"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "rnn, 2 layer(s)" in printed and "| 30 | 3 | bppsa |" in printed
    assert "one rank at T" not in printed  # a one-layer calibration is not taken from two layers
    with pytest.raises(SystemExit) as stop:
        bench.main(["--layers", "2", "--out", str(tmp_path)])
    assert stop.value.code == 2 and not any(tmp_path.iterdir())
    assert "--layers 2 with --out" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_rank_that_dies_after_the_results_are_in_loses_nothing_and_one_before_fails(monkeypatch, capsys):
    from benchmarks import distributed as bench

    def died(write: bool):
        def spawn(fn, args, nprocs, join):
            ranks, _, out, _ = args
            if write:
                Path(out).write_text(json.dumps([{"rank": r} for r in range(ranks)]))
            raise mp.ProcessExitedException(
                "process 0 terminated with signal SIGABRT", error_index=0, error_pid=1, exit_code=-6,
                signal_name="SIGABRT",
            )  # fmt: skip

        return spawn

    monkeypatch.setattr(bench.mp, "spawn", died(write=True))
    assert bench.measure(40, 2, {}) == [{"rank": 0}, {"rank": 1}]
    assert "SIGABRT after every rank's results were in; kept" in capsys.readouterr().err
    monkeypatch.setattr(bench.mp, "spawn", died(write=False))
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        bench.measure(40, 2, {})
