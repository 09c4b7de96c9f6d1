"""analysis.schemes: the cost model's invariants, its schedules' validity, and the command."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from analysis.data import AnalysisError
from analysis.schemes.cli import main
from analysis.schemes.machine import Machine, load_calibration
from analysis.schemes.network import WIDEST, Layer, Network, build_vgg11, profile, recurrent, vgg11
from analysis.schemes.report import figure, load_measured
from analysis.schemes.schedule import Task, check_schedule, list_schedule, partition, pipeline_memory
from analysis.schemes.schemes import (
    PIPELINES,
    SCHEMES,
    _fold,
    _forward_ends,
    _forward_groups,
    _groups,
    _slices,
    bppsa,
    bppsa_chain,
    data_parallel,
    distributed_bptt,
    estimate,
    estimates,
    grid,
    model_parallel,
    pipeline,
    sequential,
    table,
)
from bppsa_core.distributed import FORWARD_GROUP_MIN_STEPS, forward_groups, sample_groups

VGG = vgg11()
RNN = recurrent("rnn", 40, 1, 20, 10)
GRU = recurrent("gru", 30, 24, 20, 11)
MACHINES = {
    "flops": Machine(),
    "latency": Machine(flops=1e11, alpha=2e-5, beta=1e-9, overhead=2e-6),
}


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


# --- the networks ---------------------------------------------------------------------------------


def test_vgg11_is_traced_into_its_weighted_layers_with_their_flops() -> None:
    assert [x.name for x in VGG.layers] == [f"conv{i}" for i in range(1, 9)] + ["fc9"]
    assert VGG.params == sum(p.numel() for p in build_vgg11().parameters())
    conv1 = VGG.layers[0]
    macs = 3 * 9 * 64 * 32 * 32
    # conv 3 -> 64 at 32 x 32, then ReLU (one op per element) and a 2 x 2 max-pool (one per input)
    assert conv1.forward == 2 * macs + 64 * 32 * 32 + 64 * 32 * 32
    assert conv1.weight_grad == 2 * macs
    assert conv1.input_grad == 2 * 64 * 32 * 32  # no gradient to the image, only through ReLU and pool
    assert (conv1.inputs, conv1.outputs, conv1.channels, conv1.rows) == (3 * 32 * 32, 64 * 16 * 16, 64, 16)
    conv2 = VGG.layers[1]
    assert conv2.input_grad == 2 * 64 * 9 * 128 * 16 * 16 + 2 * 128 * 16 * 16
    assert VGG.layers[-1].outputs == 10


def test_a_wide_vgg11_is_counted_without_allocating_its_weights() -> None:
    """Width 10^4 has 4.7 · 10^12 weights in its widest conv alone (19 TB): built on the meta device,
    the count is the formula's; the widest that counts in 64 bits is WIDEST."""
    wide = vgg11(1e4)
    widest_conv = 5120000 * 5120000 * 9
    assert max(x.params for x in wide.layers) == widest_conv
    assert vgg11(WIDEST).layers[-1].params == round(512 * WIDEST) * 10


def test_profile_refuses_a_module_it_cannot_cost() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
    with pytest.raises(ValueError, match="cannot profile a BatchNorm2d; accepted: Conv2d, Linear"):
        profile(model, (3, 8, 8))
    with pytest.raises(ValueError, match="must start with a Conv2d or Linear"):
        profile(nn.Sequential(nn.ReLU(), nn.Linear(4, 2)), (4,))


def test_profile_leaves_the_model_on_the_meta_device_without_computing() -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    net = profile(model, (5,))
    assert [(x.forward, x.input_grad, x.params) for x in net.layers] == [
        (2 * 35 + 7 + 7, 7, 42),
        (2 * 21 + 3, 42, 24),
    ]
    assert next(model.parameters()).device == torch.device("meta")


def test_an_unrolled_rnn_shares_its_weights_and_has_no_gradient_before_its_first_step() -> None:
    assert len(RNN.layers) == 41 and RNN.layers[-1].name == "head"
    assert RNN.shared == 20 * 21 + 40 and GRU.shared == 3 * 20 * 44 + 120
    assert RNN.layers[0].input_grad == 0 and RNN.layers[1].input_grad == 2 * 20 * 20 + 20
    assert all(x.params == 0 for x in RNN.layers[:-1])


@pytest.mark.parametrize("blocks", [1, 7, 40, 41, 100])
def test_coarsening_keeps_every_cost_and_the_ends(blocks: int) -> None:
    coarse = RNN.coarsen(blocks)
    assert len(coarse.layers) == min(blocks, 41)
    assert close(coarse.work, RNN.work) and coarse.params == RNN.params
    assert sum(x.ops for x in coarse.layers) == 41
    assert coarse.layers[0].inputs == RNN.layers[0].inputs and coarse.layers[-1].outputs == 10


# --- the machine and the partition ---------------------------------------------------------------


def test_collectives_follow_the_alpha_beta_terms() -> None:
    m = Machine(alpha=1e-5, beta=1e-9, word=4)
    assert m.all_gather(1000, 1) == 0 and m.all_reduce(1000, 1) == 0 and m.send(0) == 0
    assert close(m.all_gather(1000, 8), 3e-5 + 1e-9 * 7 / 8 * 4000)
    assert close(m.all_reduce(1000, 5), 2 * (3e-5 + 1e-9 * 4 / 5 * 4000))
    assert close(m.send(10), 1e-5 + 40e-9)


@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 6))
def test_the_partition_is_contiguous_and_its_largest_stage_is_the_least_possible(costs, p) -> None:
    from itertools import combinations

    stages = partition(costs, p)
    assert stages[0] == 0 and all(b - a in (0, 1) for a, b in itertools.pairwise(stages))
    assert max(stages) + 1 == min(p, len(costs))
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs)), strict=True))
        for k in range(min(p, len(costs)))
        for cuts in combinations(range(1, len(costs)), k)
    )
    worst = max(sum(c for c, s in zip(costs, stages, strict=True) if s == j) for j in set(stages))
    assert worst == pytest.approx(best)


# --- the invariants every scheme must meet ------------------------------------------------------


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
@pytest.mark.parametrize("net", [VGG, RNN, GRU], ids=["vgg11", "rnn", "gru"])
def test_every_scheme_on_one_processor_is_sequential_bp(net, machine) -> None:
    reference = sequential(net, 16, machine)
    for scheme in SCHEMES:
        used = net.coarsen(8) if scheme in PIPELINES else net  # blocks keep every layer's inputs
        est = estimate(scheme, used, 16, 1, machine)
        assert close(est.time, reference.time), scheme
        assert close(est.memory, reference.memory) and est.sent == 0, scheme
        busy = machine.compute(net.work * 16) / reference.time  # 1 unless per-operation overheads
        assert close(est.utilisation, busy), scheme


@pytest.mark.parametrize("kind", PIPELINES)
@pytest.mark.parametrize("p", [2, 3, 4, 7, 9])
@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
def test_no_schedule_runs_a_task_before_its_inputs_exist(kind: str, p: int, machine) -> None:
    for net, batch in ((VGG, 32), (RNN, 16)):
        est = pipeline(net, batch, p, machine, kind)
        check_schedule(est.tasks)
        assert est.time >= sequential(net, batch, machine).time / p * (1 - 1e-9)


def test_the_schedule_check_catches_a_task_started_too_early_and_an_overlap() -> None:
    est = pipeline(VGG, 16, 3, Machine(), "pipedream")
    tasks = est.tasks
    waits = next(i for i, t in enumerate(tasks) if t.deps and t.kind == "B")
    early = [Task(**{**t.__dict__}) for t in tasks]
    early[waits].start -= 1.0
    with pytest.raises(AssertionError, match="before its input"):
        check_schedule(early)
    overlap = [Task(**{**t.__dict__}) for t in tasks]
    first, second = sorted((t for t in overlap if t.proc == 0), key=lambda t: t.start)[:2]
    second.start, second.deps = first.start, []
    with pytest.raises(AssertionError, match="overlap on processor 0"):
        check_schedule(overlap)


def test_a_cycle_in_a_task_graph_is_refused() -> None:
    a = Task("F", 0, 0, 0, 0, 0, 1.0, deps=[(1, 0.0)])
    b = Task("F", 1, 1, 0, 0, 0, 1.0, deps=[(0, 0.0)])
    with pytest.raises(AnalysisError, match="cycle"):
        list_schedule([a, b], lambda t: (t.first,))


def test_a_steady_pipeline_runs_at_its_slowest_stage() -> None:
    """Two equal layers on two processors, no communication: each micro-batch costs one stage's
    work once the pipeline is full, so an iteration of M micro-batches costs M of them."""
    layer = Layer(
        "x", forward=1e9, weight_grad=1e9, input_grad=1e9, params=1, inputs=1, outputs=1, channels=1
    )
    net = Network("two", (layer, layer))
    machine = Machine(flops=1e9, alpha=0, beta=0)
    for kind in ("pipedream", "layerpipe"):
        assert pipeline(net, 8, 2, machine, kind, micro=8, iterations=6).time == pytest.approx(8 * 3.0)
    # GPipe flushes: M forwards and M backwards, plus filling and draining one stage each way
    assert pipeline(net, 8, 2, machine, "gpipe", micro=8).time == pytest.approx(8 * 3 + 1 + 2)


def test_layerpipe_moves_weight_gradients_off_the_busiest_stage() -> None:
    """One heavy layer: PipeDream's stage of it carries its whole backward, LayerPipe gives its weight
    gradient to the processor beside it."""
    heavy = Layer("heavy", 1e9, 4e9, 1e9, params=10, inputs=1, outputs=1, channels=1)
    light = Layer("light", 1e8, 1e8, 1e8, params=10, inputs=1, outputs=1, channels=1)
    net = Network("skewed", (light, heavy))
    machine = Machine(flops=1e9, alpha=0, beta=0)
    pd_time = pipeline(net, 4, 2, machine, "pipedream", micro=4, iterations=6).time
    lp = pipeline(net, 4, 2, machine, "layerpipe", micro=4, iterations=6)
    check_schedule(lp.tasks)
    assert pd_time == pytest.approx(4 * 6.0)
    assert lp.time == pytest.approx(4 * 4.0)  # the heavy weight gradient alone on the other processor
    forward = {t.proc for t in lp.tasks if t.kind == "F" and t.first <= 1 <= t.last}
    weight = {t.proc for t in lp.tasks if t.kind == "W" and t.first <= 1 <= t.last}
    assert len(weight) == 1 and weight.isdisjoint(forward)


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
@pytest.mark.parametrize("net", [VGG, RNN, GRU], ids=["vgg11", "rnn", "gru"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_grid_at_pr_1_is_data_parallel_and_at_pc_1_model_parallel(net, machine, p: int) -> None:
    batch = 32
    data, model = data_parallel(net, batch, p, machine), model_parallel(net, batch, p, machine)
    batch_only = grid(net, batch, p, machine, fixed=(1, p))
    assert close(batch_only.time, data.time) and close(batch_only.sent, data.sent)
    assert close(batch_only.memory, data.memory)
    pinned = grid(net, batch, p, machine, fixed=(p, 1), hows=("model",))
    if math.isnan(model.time):
        assert math.isnan(pinned.time)
    else:
        assert close(pinned.time, model.time) and close(pinned.sent, model.sent)
        assert close(pinned.memory, model.memory)
    best = grid(net, batch, p, machine).time
    assert best <= min(data.time, model.time if not math.isnan(model.time) else math.inf) * (1 + 1e-12)


def test_the_grid_goes_past_the_batch_where_data_parallelism_stops() -> None:
    machine = Machine()
    assert math.isnan(data_parallel(VGG, 8, 32, machine).time)
    est = grid(VGG, 8, 32, machine)
    assert est.time < sequential(VGG, 8, machine).time
    assert est.detail == "conv1..conv4 8x4 model, conv5..conv8 32x1 model, fc9 4x8 model"


def test_domain_parallelism_splits_rows_where_channels_and_batch_run_out() -> None:
    """One sample, four channels, eight processes: only a split of the image's rows fits."""
    net = profile(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()), (3, 64, 64))
    machine = Machine()
    assert math.isnan(data_parallel(net, 1, 8, machine).time)
    assert math.isnan(model_parallel(net, 1, 8, machine).time)
    est = grid(net, 1, 8, machine)
    assert est.detail == "conv1 8x1 domain"
    conv = net.layers[0]
    halo = 4 * machine.send(conv.halo)  # both neighbours, forward and backward
    expected = machine.compute(conv.work) / 8 + halo + machine.all_reduce(conv.params, 8)
    assert close(est.time, expected)


def test_distributed_bptt_is_gpipe_with_one_micro_batch() -> None:
    """Two derivations of the same schedule: the closed form of distributed BPTT and the list
    scheduler running GPipe with a single micro-batch."""
    for net in (VGG, RNN):
        for p in (2, 3, 5):
            for machine in MACHINES.values():
                bptt = distributed_bptt(net, 16, p, machine).time
                assert close(pipeline(net, 16, p, machine, "gpipe", micro=1).time, bptt)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16, 32])
def test_bppsa_takes_log_p_dependent_exchanges_where_bptt_takes_p(p: int) -> None:
    net, machine = recurrent("rnn", 1000, 1, 20, 10), MACHINES["latency"]
    assert distributed_bptt(net, 16, p, machine).hops == p - 1
    assert bppsa(net, 16, p, machine, "allgather").hops == math.ceil(math.log2(p))
    tree = math.ceil(math.log2(p - 1)) if p > 2 else 0
    assert bppsa(net, 16, p, machine, "tree").hops == tree + math.ceil(math.log2(p))


def test_bppsa_beats_distributed_bptt_on_a_latency_bound_rnn_and_loses_on_vgg11() -> None:
    """The model's two regimes: a small H × H aggregate against a chain of latency-bound steps, and
    VGG-11's activations, whose aggregates are dense matrices of thousands squared per sample."""
    rnn, machine = recurrent("rnn", 1000, 1, 20, 10), MACHINES["latency"]
    for p in (4, 8, 16):
        assert bppsa(rnn, 16, p, machine, "tree").time < 0.8 * distributed_bptt(rnn, 16, p, machine).time
    assert bppsa(VGG, 16, 4, Machine(), "allgather").time > 10 * distributed_bptt(VGG, 16, 4, Machine()).time


# A device running bppsa_core.distributed: a fused forward per step, a compiled walk and fold per step
# and sample; a network of steps alone (no head), a free interconnect, and no cost per operation.
STEP = Layer(
    "t", forward=1.0, weight_grad=1.0, input_grad=1.0, params=0, inputs=20, outputs=20, channels=20, step=True
)
STEPS = Network("steps", (STEP,) * 600, shared=0)
COMPILED = Machine(flops=1e30, alpha=0, beta=0, forward_step=1e-5, walk=1e-7, fold=2e-6)


def test_a_device_with_compiled_costs_pays_its_forward_per_step_and_its_scan_per_step_and_sample() -> None:
    """One device: the fused forward (a step costs the same for any batch), then BPPSA's compiled
    backward; the head of the paper's RNN is charged its operations as before; the other schemes
    run the same forward and schedule the backward's operations."""
    machine = replace(COMPILED, overhead=1e-6, flops=1e9)
    net = recurrent("rnn", 500, 1, 20, 10)
    head = [net.layers[-1]]
    for batch in (2, 16):
        est = bppsa(net, batch, 1, machine, "allgather", groups=8)
        forward = 500 * 1e-5 + machine.run(head, "forward", batch)
        assert close(est.time, forward + 500 * batch * 1e-7 + machine.run(head, "backward", batch))
        assert est.detail == ""  # one device keeps the batch whole
        reference = forward + machine.run(net.layers, "backward", batch)
        assert close(sequential(net, batch, machine).time, reference)
        assert close(distributed_bptt(net, batch, 1, machine).time, reference)


@pytest.mark.parametrize("groups", [1, 2, 3, 8, 16])
def test_sample_groups_pipeline_two_devices(groups: int) -> None:
    """Two equal slices: the bottom device walks group g as soon as the top has walked it, so the
    backward takes (m + 1) / m of one slice's walk for m groups; one group takes two slices' worth,
    no better than one device."""
    est = bppsa(STEPS, 16, 2, COMPILED, "allgather", groups)
    slice_walk = 300 * 16 * 1e-7
    # groups of 16 samples that do not divide evenly: the largest group sets the pipeline's fill
    largest = max(_groups(16, groups))
    assert close(est.time, 600 * 1e-5 + slice_walk + 300 * largest * 1e-7)
    if 16 % groups == 0:
        assert close(est.time - 600 * 1e-5, slice_walk * (groups + 1) / groups)
    assert est.detail == ("" if groups == 1 else f"{groups} sample groups")
    assert bppsa(STEPS, 16, 1, COMPILED, "allgather", groups).time == pytest.approx(
        600 * 1e-5 + 2 * slice_walk
    )
    # the model's groups are the code's (bppsa_core.distributed.sample_groups)
    assert _groups(16, groups) == [s.stop - s.start for s in sample_groups(16, groups)]


def test_a_middle_devices_fold_can_outlast_the_top_devices_forward_and_walk() -> None:
    """Three equal slices, one group: the exchange waits for the top's walk and the middle's fold
    (started after its forward), then the two lower devices walk their slices side by side."""
    est = bppsa(STEPS, 16, 3, COMPILED, "allgather")
    top = 600 * 1e-5 + 200 * 16 * 1e-7
    middle = 400 * 1e-5 + 200 * 16 * 2e-6
    assert middle > top and close(est.time, middle + 200 * 16 * 1e-7)
    cheap = replace(COMPILED, fold=1e-7)
    assert close(bppsa(STEPS, 16, 3, cheap, "allgather").time, top + 200 * 16 * 1e-7)
    # without compiled costs the fold is the slice's input gradients applied to its 20 unit vectors
    plain = Machine(flops=1e6, alpha=0, beta=0)
    assert close(_fold(STEPS.layers[:200], 16, plain), 200 * 16 * 20 / 1e6)


def test_a_middle_device_folds_every_group_before_its_first_exchange() -> None:
    """Three equal slices, 8 groups, a fold far dearer than a walk: the middle device folds all 16
    samples as soon as its forward is done, then walks the groups as their exchanges come; folding
    each group between walks (idle until the top's first group, then fold, walk, fold ...) would
    take longer."""
    est = bppsa(STEPS, 16, 3, COMPILED, "allgather", groups=8)
    folds, walks = 200 * 16 * 2e-6, 200 * 16 * 1e-7
    assert close(est.time, 400 * 1e-5 + folds + walks)
    top_first_group = 600 * 1e-5 + walks / 8
    interleaved = top_first_group + walks + folds * 7 / 8
    assert est.time < interleaved


def test_a_compiled_forward_pays_per_sample_and_hands_its_batch_on_in_groups_where_the_code_does() -> None:
    """BPPSA's compiled forward (``forward_sample``) costs per step and sample; over two slices of at
    least ``FORWARD_GROUP_MIN_STEPS`` steps of much work it goes in groups of 4 of 16 samples, the
    second device running group g while the first runs g + 1: (m + 1) / m of a slice's forward for m
    groups, and each group's message. Shorter slices go whole, and distributed BPTT keeps its fused
    forward."""
    fs, alpha = 1e-7, 3e-6
    machine = replace(COMPILED, forward_sample=fs)
    steps = FORWARD_GROUP_MIN_STEPS
    long = Network("steps", (replace(STEP, forward=2e6),) * (2 * steps), shared=0)
    slices = _slices(long, 2)
    group = steps * 4 * fs  # one group's forward of one slice
    ends = _forward_ends(slices, 16, replace(machine, alpha=alpha), True, 4)
    assert close(ends[0], 4 * group) and close(ends[1], 5 * group + alpha)
    whole = _forward_ends(slices, 16, replace(machine, alpha=alpha), True, 1)
    assert close(whole[1], 8 * group + alpha)  # each device's forward after the other's
    # the estimate: forward in 4 groups (16 micro-batches, 4 samples at least each), then the
    # backward's 16 groups of one sample: the top's walks, the bottom's one group behind
    walk = steps * 1e-7
    est = bppsa(long, 16, 2, machine, "allgather", groups=16)
    assert close(est.time, 5 * group + 17 * walk)
    assert est.compute == pytest.approx(steps * 16 * (fs + 1e-7))
    # below the floor the forward goes whole: the bottom's forward after the top's
    short = bppsa(STEPS, 16, 2, machine, "allgather", groups=16)
    assert close(short.time, 600 * 16 * fs + 300 * 1e-7 + 300 * 16 * 1e-7)
    # distributed BPTT's forward is the fused one, forward_step per step whatever the batch
    assert distributed_bptt(long, 16, 2, machine).time == distributed_bptt(long, 16, 2, COMPILED).time
    # groups as the code makes them; without forward_sample BPPSA's forward is the fused one, whole
    assert _forward_groups(slices, 16, machine, 16) == 4 and _forward_groups(slices, 16, machine, 2) == 2
    assert _forward_groups(slices, 16, COMPILED, 16) == 1
    # a step of little work (the paper's RNN: 420 multiply-adds a sample, a group's own work about 5
    # samples') goes in 2 groups over 2 devices, 4 over 4; one of almost none goes whole
    for work, p, m in ((420, 2, 2), (420, 4, 4), (0.5, 2, 1)):
        step = replace(STEP, forward=2 * work)
        net = Network("steps", (step,) * (p * steps), shared=0)
        assert _forward_groups(_slices(net, p), 16, machine, 16) == m
        assert _forward_groups(_slices(net, p), 16, machine, 16) == forward_groups(16, steps, 16, p, work)
    assert close(bppsa(long, 16, 2, COMPILED, "allgather", groups=16).time, 2 * steps * 1e-5 + 17 * walk)


def test_a_compiled_forward_pays_a_part_per_group_whatever_its_samples() -> None:
    """``forward_group`` is charged once per step of each group run at once: one device's forward of
    16 samples pays it once a step, two devices handing 4 groups on pay it 4 times a step each, so
    small groups cost more per sample than the batch whole."""
    fs, fg = 1e-7, 3e-7
    machine = replace(COMPILED, forward_sample=fs, forward_group=fg)
    steps = FORWARD_GROUP_MIN_STEPS
    long = Network("steps", (STEP,) * (2 * steps), shared=0)
    assert close(_forward_ends([list(long.layers)], 16, machine, True, 1)[0], 2 * steps * (fg + 16 * fs))
    group = steps * (fg + 4 * fs)  # one group's forward of one slice
    ends = _forward_ends(_slices(long, 2), 16, machine, True, 4)
    assert close(ends[0], 4 * group) and close(ends[1], 5 * group)
    # only BPPSA's compiled forward: distributed BPTT's fused one is forward_step per step
    assert distributed_bptt(long, 16, 2, machine).time == distributed_bptt(long, 16, 2, COMPILED).time


@pytest.mark.parametrize("groups", [1, 8])
def test_chained_slices_walk_one_group_apart_and_never_fold(groups: int) -> None:
    """Three equal slices, m groups: the top device walks group g as soon as its forward is done,
    each device below one group behind it, so the backward takes (m + q - 1) walks of a group; no
    device folds (a fold however dear changes nothing), each sends its first state's gradient once
    per sample, q - 1 hops. Without groups or compiled costs it is distributed BPTT's schedule."""
    est = bppsa_chain(STEPS, 16, 3, COMPILED, groups)
    group_walk = 200 * (16 // groups) * 1e-7
    assert close(est.time, 600 * 1e-5 + (groups + 2) * group_walk)
    assert est.time == bppsa_chain(STEPS, 16, 3, replace(COMPILED, fold=1.0), groups).time
    assert est.hops == 2 and est.sent == COMPILED.word * 16 * 20
    assert est.detail == ("" if groups == 1 else f"{groups} sample groups")
    assert (
        bppsa_chain(STEPS, 16, 3, COMPILED, groups).time
        < bppsa(STEPS, 16, 3, COMPILED, "allgather", groups).time
    )
    for p in (1, 2, 4):
        assert close(bppsa_chain(VGG, 16, p, Machine()).time, distributed_bptt(VGG, 16, p, Machine()).time)
    assert estimate("bppsa-chain", STEPS, 16, 3, COMPILED, groups=groups).time == est.time


def test_infeasible_points_say_why() -> None:
    machine = Machine()
    assert "exceeds the batch 8" in data_parallel(VGG, 8, 16, machine).note
    assert "exceeds a layer's 10 channels" in model_parallel(VGG, 64, 16, machine).note
    assert "exceeds the 9 layers" in pipeline(VGG, 64, 16, machine, "gpipe").note
    with pytest.raises(ValueError, match="unknown scheme 'ring'; accepted: sequential, gpipe"):
        estimate("ring", VGG, 8, 2, machine)


def test_pipeline_memory_counts_stashed_weights_and_activations_in_flight() -> None:
    """Two equal layers on two processors, four micro-batches of one sample: GPipe keeps all four
    micro-batches' inputs on the first processor and one weight version; 1F1B admits two there
    and, never flushing, stashes the weights of two iterations."""
    layer = Layer(
        "x", forward=1e9, weight_grad=1e9, input_grad=1e9, params=100, inputs=10, outputs=10, channels=1
    )
    net = Network("two", (layer, layer))
    machine = Machine(flops=1e9, alpha=0, beta=0, word=1)
    gpipe = pipeline(net, 4, 2, machine, "gpipe", micro=4)
    pipedream = pipeline(net, 4, 2, machine, "pipedream", micro=4)
    assert pipeline_memory(gpipe.tasks, net, 1, machine, "gpipe")[0] == 100 + 4 * 10
    assert pipeline_memory(pipedream.tasks, net, 1, machine, "pipedream")[0] == 2 * 100 + 2 * 10
    assert sequential(net, 4, machine).memory == 200 + 4 * 20


# --- the command ----------------------------------------------------------------------------------


@pytest.mark.extended
def test_the_command_writes_the_table_and_a_reproducible_figure(tmp_path: Path, capsys) -> None:
    measured = tmp_path / "measured.csv"
    pd.DataFrame({"scheme": ["sequential", "data"], "p": [1, 2], "time": [0.2, 0.11]}).to_csv(
        measured, index=False
    )
    args = [
        "--model",
        "rnn",
        "--T",
        "60",
        "--p",
        "1",
        "2",
        "4",
        "--measured",
        str(measured),
        "--overhead",
        "1e-6",
    ]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert "| BPPSA, tree |" in printed and "LayerPipe's saving" in printed
    table = pd.read_csv(tmp_path / "a" / "schemes.csv")
    assert set(table["scheme"]) == set(SCHEMES) and sorted(table["p"].unique()) == [1, 2, 4]
    for name in ("schemes.csv", "schemes.md", "schemes.png", "schemes.pdf"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--p", "0"], "argument --p: 0 is not positive; accepted: positive integers"),
        (["--alpha", "-1"], "argument --alpha: -1 is negative; accepted: a number >= 0"),
        (["--model", "lstm"], "argument --model: invalid choice: 'lstm'"),
        (["--batch", "4", "--micro-batches", "8"], "--micro-batches 8 exceeds the batch 4; accepted: 1 to 4"),
        (["--batch", "4", "--groups", "5"], "--groups 5 exceeds the batch 4; accepted: 1 to 4"),
        (["--walk", "-1"], "argument --walk: -1 is negative; accepted: a number >= 0"),
        (["--measured", "nowhere.csv"], "no measured table at 'nowhere.csv'"),
        (["--calibration", "nowhere.json"], "no calibration at 'nowhere.json'"),
        (["--flops", "1e-300"], "sequential at p = 1 takes inf s on this machine (1e-300 FLOP/s"),
        (["--width", "1e6"], "--width 1e+06 is too wide to count: VGG-11's widest weight would pass 2^63"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_and_nothing_is_written(
    tmp_path: Path, capsys, args, message
) -> None:
    with pytest.raises(SystemExit) as stop:
        raise SystemExit(main([*args, "--out", str(tmp_path / "out")]))
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line
    assert not (tmp_path / "out").exists()


def test_a_scheme_orders_of_magnitude_slower_leaves_the_chart_named_in_the_legend() -> None:
    machine = Machine()
    frame = table(estimates(VGG, 16, [1, 2, 4], machine, ["sequential", "data", "bppsa-allgather"]))
    fig = figure(frame, [], None, "title")
    ax = fig.axes[0]
    assert ax.get_ylim()[1] == pytest.approx(20 * sequential(VGG, 16, machine).time)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("BPPSA, all-gather (off the chart from p = 4: ") for t in labels)
    assert "data parallel" in labels
    frame = table(estimates(VGG, 16, [1, 2], machine, ["sequential", "data"]))
    assert figure(frame, [], None, "title").axes[0].get_ylim()[1] < sequential(VGG, 16, machine).time * 2


def test_a_calibration_sets_what_the_flags_leave_unset(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"flops": 2e11, "alpha": 3e-5, "beta": 4e-10, "iteration_flops": 1}))
    assert load_calibration(path) == {"flops": 2e11, "alpha": 3e-5, "beta": 4e-10}
    args = ["--p", "1", "2", "--schemes", "sequential", "data", "--calibration", str(path), "--beta", "0"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    header = (tmp_path / "out" / "schemes.md").read_text().splitlines()[0]
    assert "2e+11 FLOP/s" in header and "α = 3e-05 s" in header and "β = 0 s/byte" in header
    for bad, message in (
        ({"flops": 0, "alpha": 0, "beta": 0}, "flops is 0; accepted: a positive number"),
        ({"flops": 1e9, "alpha": "fast", "beta": 0}, "alpha is 'fast'; accepted: a number >= 0"),
        ({"walk": -1e-7}, "walk is -1e-07; accepted: a number >= 0"),
        ({"groups": 2.5}, "groups is 2.5; accepted: a positive integer"),
        ({"groups": True}, "groups is True; accepted: a positive integer"),
        ([1, 2], "sets none of flops, alpha, beta, overhead"),
        ({"T": 100}, "sets none of flops"),
        ({"walkz": 1e-5}, "sets none of flops, .*; it holds walkz"),
        (
            {"walk": 1e-7, "T": 9, "walkz": 1e-5},
            r"unknown key 'walkz'; accepted: flops, .*, groups \(and T, B",
        ),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(AnalysisError, match=message):
            load_calibration(path)
    path.write_text("{")
    with pytest.raises(AnalysisError, match="is not JSON"):
        load_calibration(path)
    with pytest.raises(AnalysisError, match=f"cannot read {tmp_path}: Is a directory"):
        load_calibration(tmp_path)  # there, but not a file it can read


def test_calibrations_of_both_benchmarks_combine_and_set_the_devices_compiled_costs(tmp_path: Path) -> None:
    """The schemes benchmark's FLOP rate, α and β and the distributed benchmark's device costs and
    groups, from two files (a later one winning, a flag over both): the table follows them."""
    first, second = tmp_path / "schemes.json", tmp_path / "distributed.json"
    first.write_text(json.dumps({"flops": 2e11, "alpha": 3e-5, "beta": 4e-10, "overhead": 1.0}))
    costs = {"forward_step": 5e-6, "walk": 2e-7, "fold": 1.5e-6, "overhead": 9e-6, "groups": 8, "T": 2000}
    costs["forward_sample"], costs["forward_group"] = 4e-8, 6e-8
    second.write_text(json.dumps(costs))
    assert load_calibration(second) == {k: v for k, v in costs.items() if k != "T"}
    args = ["--model", "rnn", "--T", "400", "--p", "1", "2", "--schemes", "sequential", "bppsa-allgather"]
    args += ["--calibration", str(first), str(second), "--beta", "0", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    header = (tmp_path / "out" / "schemes.md").read_text().splitlines()[0]
    assert "2e+11 FLOP/s" in header and "overhead 9e-06 s" in header and "β = 0 s/byte" in header
    assert (
        "forward 5e-06 s per step (BPPSA's 4e-08 s per step and sample, 6e-08 s per step and group), "
        "walk 2e-07 s and fold 1.5e-06 s"
        in header
        and "8 sample groups" in header
    )
    frame = pd.read_csv(tmp_path / "out" / "schemes.csv").set_index(["scheme", "p"])
    machine = Machine(2e11, 3e-5, 0.0, 4, 9e-6, 5e-6, 2e-7, 1.5e-6, 4e-8, 6e-8)
    net = recurrent("rnn", 400, 1, 20, 10)
    assert frame.loc[("bppsa-allgather", 2), "time"] == pytest.approx(
        bppsa(net, 16, 2, machine, "allgather", 8).time
    )
    assert frame.loc[("bppsa-allgather", 2), "detail"] == "8 sample groups"
    assert main([*args[:-2], "--groups", "1", "--out", str(tmp_path / "one")]) == 0
    one = pd.read_csv(tmp_path / "one" / "schemes.csv").set_index(["scheme", "p"])
    assert one.loc[("bppsa-allgather", 2), "time"] > frame.loc[("bppsa-allgather", 2), "time"]


def test_a_scheme_that_does_not_apply_at_some_p_leaves_an_empty_cell_not_an_error(tmp_path: Path) -> None:
    """Data parallelism beyond the batch has no estimate (its time is nan, with a note): the command
    still writes the table, the other rows and the note, as the README's RNN command needs."""
    args = ["--model", "rnn", "--T", "50", "--batch", "4", "--p", "1", "8"]
    assert main([*args, "--schemes", "sequential", "data", "--out", str(tmp_path / "out")]) == 0
    frame = pd.read_csv(tmp_path / "out" / "schemes.csv", keep_default_na=False).set_index(["scheme", "p"])
    assert frame.loc[("data", 8), "note"] == "p = 8 exceeds the batch 4"
    assert frame.loc[("data", 8), "time"] == "" and float(frame.loc[("data", 1), "time"]) > 0
    assert "data parallel: p = 8 exceeds the batch 4" in (tmp_path / "out" / "schemes.md").read_text()


def test_a_measured_table_must_name_known_schemes(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    pd.DataFrame({"scheme": ["ring"], "p": [2], "time": [1.0]}).to_csv(path, index=False)
    with pytest.raises(AnalysisError, match="unknown schemes ring"):
        load_measured(path)
    pd.DataFrame({"scheme": ["data"], "p": [2]}).to_csv(path, index=False)
    with pytest.raises(AnalysisError, match="lacks the columns time"):
        load_measured(path)
    pd.DataFrame({"scheme": ["data"], "p": [2], "time": ["slow"]}).to_csv(path, index=False)
    with pytest.raises(AnalysisError, match="time is 'slow' in row 1; accepted: a number"):
        load_measured(path)
    path.write_text("")
    with pytest.raises(AnalysisError, match="is empty; accepted: a table with the columns scheme, p, time"):
        load_measured(path)
    for cells, message in (
        (
            {"scheme": [None], "p": [2], "time": [1.0]},
            "scheme is empty in row 1; accepted: a scheme's name",
        ),
        ({"scheme": ["data"], "p": [0], "time": [1.0]}, "p is 0 in row 1; accepted: a whole number >= 1"),
        (
            {"scheme": ["data"], "p": [2], "time": [-1.0]},
            "time is -1.0 in row 1; accepted: a finite number >= 0",
        ),
        ({"scheme": ["data"], "p": [2], "time": [float("inf")]}, "time is inf in row 1"),
        ({"scheme": [], "p": [], "time": []}, "holds no rows; accepted: the measured iterations"),
    ):
        pd.DataFrame(cells).to_csv(path, index=False)
        with pytest.raises(AnalysisError, match=message):
            load_measured(path)


# --- the measured points --------------------------------------------------------------------------


def test_the_benchmark_cuts_vgg11_where_the_model_does() -> None:
    from benchmarks.schemes import split_at

    stages = partition([x.work for x in VGG.layers], 2)
    first, second = split_at(build_vgg11(), 4)
    assert stages.count(0) == 4
    assert sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in first) == 4
    assert isinstance(second[0], nn.Conv2d) and second[0].in_channels == 256
    with pytest.raises(ValueError, match="--split 9 does not cut the network; accepted: 1 to 8"):
        split_at(build_vgg11(), 9)


@pytest.mark.extended
def test_the_benchmark_measures_three_schemes_on_two_processes(tmp_path: Path, capsys) -> None:
    from benchmarks import schemes as bench

    args = ["--width", "0.125", "--batch", "8", "--micro-batches", "4", "--warmup", "0", "--repeats", "1"]
    assert bench.main([*args, "--pingpong-mb", "0.25", "--out", str(tmp_path)]) == 0
    measured = load_measured(tmp_path / "measured.csv")
    assert list(zip(measured["scheme"], measured["p"], strict=True)) == [
        ("sequential", 1),
        ("data", 2),
        ("gpipe", 2),
    ]
    assert (measured["time"] > 0).all()
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert calibration["flops"] > 0 and calibration["alpha"] > 0 and calibration["beta"] >= 0
    command = capsys.readouterr().out.splitlines()[-1]
    assert command.startswith("python -m analysis.schemes --model vgg11 --batch 8 --p 1 2 4 8 --width 0.125")
    out = tmp_path / "model"
    assert main([*command.split()[3:-2], "--out", str(out)]) == 0  # the printed command runs
    assert (out / "schemes.png").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "9"], "--batch 9 does not split into 8 micro-batches"),
        (["--batch", "9", "--micro-batches", "3"], "--batch 9 does not split over 2 processes"),
        (["--split", "12"], "--split 12 does not cut the network; accepted: 1 to 8"),
        (["--width", "0"], "argument --width: 0 is not positive; accepted: a positive number"),
        (["--pingpong-mb", "inf"], "argument --pingpong-mb: inf is not finite; accepted: a positive number"),
    ],
)
def test_the_benchmark_refuses_bad_settings_in_one_line(tmp_path: Path, capsys, args, message) -> None:
    from benchmarks import schemes as bench

    with pytest.raises(SystemExit) as stop:
        bench.main([*args, "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", PIPELINES)
def test_bytes_sent_do_not_depend_on_the_interconnects_speed(kind: str) -> None:
    """The bytes a schedule moves are what it moves, whatever α and β are (0 included)."""
    sent = {
        (alpha, beta): pipeline(VGG, 32, 4, Machine(alpha=alpha, beta=beta), kind).sent
        for alpha, beta in ((5e-6, 1e-10), (5e-6, 0.0), (0.0, 0.0), (1e-3, 1e-8))
    }
    assert len(set(sent.values())) == 1 and next(iter(sent.values())) > 0


@pytest.mark.extended
def test_the_schemes_page_redraws_to_its_committed_tables(tmp_path: Path) -> None:
    """docs/schemes/run.sh, run on a copy of its folder without its outputs, writes every table
    (csv, md) of docs/SCHEMES.md byte for byte as committed (the model is deterministic) and every
    figure (their bytes follow the matplotlib release, so they are only required to be there)."""
    committed = ROOT / "docs" / "schemes"
    copy = tmp_path / "docs" / "schemes"
    shutil.copytree(committed, copy)
    for made in copy.glob("*/schemes.*"):  # the run must make every one again
        made.unlink()
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["bash", str(copy / "run.sh")], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    tables = sorted(committed.glob("*/schemes.*[dv]"))  # .md and .csv
    assert len(tables) == 10  # vgg11, rnn, distributed, four-ranks, measured: csv and md
    for written in tables:
        assert (tmp_path / written.relative_to(ROOT)).read_bytes() == written.read_bytes(), written
    for drawn in committed.glob("*/schemes.p*"):
        assert (tmp_path / drawn.relative_to(ROOT)).stat().st_size > 0
