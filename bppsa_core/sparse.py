"""Sparse transposed Jacobians of CNN layers, written straight into CSR, and a scan over them.

For Conv2d, ReLU, MaxPool2d, AvgPool2d, Flatten and Linear, the transposed Jacobian J^T of one
sample (input size n_in, output size n_out; rows index the input, columns the output, both in
C x H x W order) has a sparsity pattern fixed by the layer's shape before training (docs/DESIGN.md).
Each builder computes the index arithmetic of that pattern with vectorized tensor ops on x's
device and hands it to ``torch.sparse_csr_tensor``; autograd is never asked for a row. A sliding
window's pattern is cut into a few rectangular blocks (runs of input positions that share a kernel
pattern, crossed over the two axes) and every block is written with one broadcast op into a strided
view of the entries, so the build is one pass over its output; the row pointer is closed-form.
Nothing is cached between calls.

Stored entries are the structural non-zeros, as the paper counts them: the whole diagonal of a
ReLU (value f'(x), which is 0 for a negative input) and every (input, window) membership of a
max-pool (value 1 at the window's maximum, else 0). ``to_dense()`` equals autograd's Jacobian.

``sparse_scan`` runs BPPSA's scan over such a chain (the full Blelloch scan, or the heterogeneous
one with ``levels`` up/down levels and a sequential middle) and counts its cost the paper's way:
each sparse product costs 2 x the matching non-zero pairs, a sparse-matrix x vector product 2 x
nnz; the critical path is the largest product of every parallel level plus the sequential middle.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from itertools import accumulate, product

import torch
import torch.nn.functional as F
from torch import Tensor

from bppsa_core.denormals import flush_denormals

# Both notices in one filter: the wrapper runs on every CSR build, whose time Table 1 measures.
_NOTICES = "Sparse (CSR tensor support is in beta state|invariant checks are implicitly disabled)"


def _quiet_csr(make):
    """Build CSR tensors without PyTorch's 'beta' notice, which every construction repeats, nor
    torch 2.11's notice that invariant checks are off (they are, on purpose: the indices are built
    valid, and checking them costs a pass over every non-zero)."""

    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOTICES)
            return make(*args, **kwargs)

    return wrapped


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


@_quiet_csr
def _csr(crow: Tensor, cols: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    return torch.sparse_csr_tensor(crow, cols, values, size=shape, check_invariants=False)


def _out_size(size: int, pad: int, dil: int, k: int, stride: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


@dataclass(frozen=True)
class _Run:
    """Positions start, start + stride, ... (``length`` of them) of one axis with one kernel pattern.

    A slot is a flipped kernel offset, k - 1 - p, so a position's output coordinates ascend with
    its slots. The run's slots are slot0, slot0 + slot_step, ... (``slots`` of them); at the first
    member they reach output coordinates out0, out0 + out_step, ...; from one member to the next
    every output coordinate grows by one and the axis's running count of entries by ``inc``.
    """

    start: int
    length: int
    inc: int
    slot0: int
    slots: int
    slot_step: int
    out0: int
    out_step: int

    def slot_range(self) -> slice:
        return slice(self.slot0, self.slot0 + (self.slots - 1) * self.slot_step + 1, self.slot_step)


@dataclass(frozen=True)
class _Axis:
    """One spatial axis of a sliding window: which windows hold each input position."""

    n_out: int
    counts: list[int]  # windows holding each position
    prefix: list[int]  # running sum of counts, one longer
    lowest: list[int]  # lowest output coordinate holding each position (0 where none does)
    runs: list[_Run]
    slots: list[list[int]]  # valid slots of each position


def _axis(size: int, k: int, s: int, pad: int, dil: int) -> _Axis:
    """Valid (position, kernel offset) pairs of one axis, grouped into runs of equal pattern.

    O(size · k) integer arithmetic on Python ints: an axis is short, and all the per-entry work
    is left to tensor ops over the runs. A position's valid slots solve a linear congruence on an
    interval, so they are an arithmetic progression; positions a stride apart share them except
    near the borders, so an axis has about stride + border runs.
    """
    n_out = _out_size(size, pad, dil, k, s)
    limit = s * n_out  # a valid numerator is in [0, limit) and divisible by s
    if s == 1:  # every slot whose numerator i + pad - (k - 1 - t)·dil lies in [0, limit)
        top = (k - 1) * dil - pad
        slots = [
            list(range(max(0, (top - i - 1) // dil + 1), min(k, (limit - 1 + top - i) // dil + 1)))
            for i in range(size)
        ]
    else:
        slots = [
            [t for t in range(k) if 0 <= (num := i + pad - (k - 1 - t) * dil) < limit and num % s == 0]
            for i in range(size)
        ]
    counts = [len(v) for v in slots]
    prefix = list(accumulate(counts, initial=0))
    lowest = [(i + pad - (k - 1 - v[0]) * dil) // s if v else 0 for i, v in enumerate(slots)]
    runs: list[_Run] = []
    for r in range(min(s, size)):
        i = r
        while i < size:
            v = slots[i]
            if not v:
                i += s
                continue
            j, inc = i + s, 0
            # extend while the pattern repeats and the entry count grows evenly (affine offsets)
            while j < size and slots[j] == v and (j == i + s or prefix[j] - prefix[j - s] == inc):
                inc = prefix[j] - prefix[j - s]
                j += s
            step = v[1] - v[0] if len(v) > 1 else 1
            runs.append(_Run(i, (j - i) // s, inc, v[0], len(v), step, lowest[i], step * dil // s))
            i = j
    return _Axis(n_out, counts, prefix, lowest, runs, slots)


def _crow(c: int, og: int, ah: _Axis, aw: _Axis, device: torch.device) -> Tensor:
    """Row pointer in closed form: row (ci, i, j) starts after og·(ci·Nh·Nw + Nw·Ph[i] + nh[i]·Pw[j])
    entries (N: an axis's total count, P: its running count, n: its count)."""
    h, w = len(ah.counts), len(aw.counts)
    nh, nw = ah.prefix[-1], aw.prefix[-1]
    hp = torch.tensor([[og * nw * p for p in ah.prefix[:-1]], [og * n for n in ah.counts]], device=device)
    wp = torch.tensor(aw.prefix[:-1], device=device)
    plane = torch.addcmul(hp[0].view(h, 1), hp[1].view(h, 1), wp.view(1, w))
    step = og * nh * nw
    # channel c (one past the last) starts at plane[0, 0] = 0 past c·step: the entry count
    rows = torch.arange(c + 1, device=device).mul_(step).view(c + 1, 1) + plane.view(1, h * w)
    return rows.view(-1)[: c * h * w + 1]


@dataclass(frozen=True)
class _Pattern:
    """The CSR pattern of a (grouped) sliding window's J^T, as blocks of one entry layout.

    Entries are laid out over (input channel, input row, input col, output channel in the group,
    slot row, slot col): rows ascend and within a row the output index (o, i, j) ascends, so no
    sort is needed. The rows of an h-run crossed with a w-run start at affine offsets and hold
    og·slots_h·slots_w contiguous entries each: one strided block (c, length_h, length_w, entries).
    """

    c: int
    og: int
    ah: _Axis
    aw: _Axis
    nnz: int

    def block(self, t: Tensor, rh: _Run, rw: _Run) -> Tensor:
        """The strided view (c, length_h, length_w, entries per row) of entry tensor t for two runs."""
        ah, aw, og = self.ah, self.aw, self.og
        nh, nw = ah.prefix[-1], aw.prefix[-1]
        offset = og * (nw * ah.prefix[rh.start] + rh.slots * aw.prefix[rw.start])
        size = (self.c, rh.length, rw.length, og * rh.slots * rw.slots)
        return t.as_strided(size, (og * nh * nw, og * nw * rh.inc, og * rh.slots * rw.inc, 1), offset)


def _pattern(c: int, h: int, w: int, og: int, cg: int, kernel, stride, padding, dilation, device):
    """Pattern, row pointer and column indices of a (grouped) sliding window's J^T.

    No mask over a dense (c, h, w, og, kh, kw) layout and no index tensor as long as the entries:
    each block is written in one broadcast add of a per-channel row template (c, og·slots) and
    the growth of the columns from member to member, one pass over the entries.
    """
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _pair(kernel), _pair(stride), _pair(padding), _pair(dilation)
    ah = _axis(h, kh, sh, ph, dh)
    aw = ah if (h, kh, sh, ph, dh) == (w, kw, sw, pw, dw) else _axis(w, kw, sw, pw, dw)
    ho, wo = ah.n_out, aw.n_out
    pat = _Pattern(c, og, ah, aw, c * og * ah.prefix[-1] * aw.prefix[-1])
    crow = _crow(c, og, ah, aw, device)
    cols = torch.empty(pat.nnz, dtype=torch.int64, device=device)
    if not pat.nnz:
        return pat, crow, cols, ho, wo
    # column of (ci, oo, oi, oj) = ((g·og + oo)·Ho + oi)·Wo + oj with g = ci // cg
    groups = c // cg
    chan = torch.arange(0, groups * og * ho * wo, ho * wo, device=device).view(groups, 1, og, 1, 1)
    chan = chan.expand(groups, cg, og, 1, 1).reshape(c, og, 1, 1)
    # column at the first member of every pair of runs, per (ci, oo, slot row, slot col)
    first_h = [(r.out0 + a * r.out_step) * wo for r in ah.runs for a in range(r.slots)]
    first_w = [r.out0 + b * r.out_step for r in aw.runs for b in range(r.slots)]
    first = chan + (torch.tensor(first_h, device=device).view(-1, 1) + torch.tensor(first_w, device=device))
    # from one member to the next the output coordinate, so the column, grows by Wo (h) or 1 (w)
    longest_h, longest_w = max(r.length for r in ah.runs), max(r.length for r in aw.runs)
    grow = torch.arange(0, longest_h * wo, wo, device=device).view(-1, 1)
    grow = grow + torch.arange(longest_w, device=device)
    at_h = list(accumulate((r.slots for r in ah.runs), initial=0))
    at_w = list(accumulate((r.slots for r in aw.runs), initial=0))
    for (ih, rh), (iw, rw) in product(enumerate(ah.runs), enumerate(aw.runs)):
        # a contiguous row template (c, og·slots) plus the growth of every member pair: the inner
        # loop of the add runs over a whole row
        row = first[:, :, at_h[ih] : at_h[ih + 1], at_w[iw] : at_w[iw + 1]].reshape(c, 1, 1, -1)
        torch.add(row, grow[: rh.length, : rw.length].unsqueeze(-1), out=pat.block(cols, rh, rw))
    return pat, crow, cols, ho, wo


def conv2d_jt(
    x: Tensor,
    weight: Tensor,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
) -> Tensor:
    """J^T of ``F.conv2d(x, weight, ...)`` for one sample ``x`` (C, H, W): (C·H·W, O·Ho·Wo).

    Zero weights (a pruned layer) are left out of the pattern.
    """
    c, h, w = x.shape
    o, cg, kh, kw = weight.shape
    og = o // groups
    pat, crow, cols, ho, wo = _pattern(c, h, w, og, cg, (kh, kw), stride, padding, dilation, x.device)
    # weight[g·og + oo, ci mod cg, p, q] per (input channel ci, oo, slot row, slot col), slots = flipped p, q
    wg = weight.detach().reshape(groups, og, cg, kh, kw).transpose(1, 2).reshape(c, og, kh, kw)
    wg = wg.flip(-1, -2).to(device=x.device, dtype=x.dtype)
    values = torch.empty(pat.nnz, dtype=x.dtype, device=x.device)
    for rh, rw in product(pat.ah.runs, pat.aw.runs):
        pat.block(values, rh, rw).copy_(wg[:, :, rh.slot_range(), rw.slot_range()].reshape(c, 1, 1, -1))
    nonzero = wg != 0
    if not nonzero.all():  # pruned weights are part of the pattern known before training: drop them
        keep = values != 0
        # stored entries per row: the non-zero weights of the row's channel at the row's valid slots
        valid_h, valid_w = _valid(pat.ah, kh, x.device), _valid(pat.aw, kw, x.device)
        per_row = torch.einsum("it,ctu,ju->cij", valid_h, nonzero.sum(1, dtype=torch.float64), valid_w)
        crow = torch.zeros(c * h * w + 1, dtype=torch.int64, device=x.device)
        torch.cumsum(per_row.reshape(-1).round().to(torch.int64), 0, out=crow[1:])
        cols, values = cols[keep], values[keep]
    return _csr(crow, cols, values, (c * h * w, o * ho * wo))


def _valid(axis: _Axis, k: int, device: torch.device) -> Tensor:
    """(size, k) 0/1 in float64: which slots of each position hold an entry."""
    return torch.tensor([[t in v for t in range(k)] for v in axis.slots], dtype=torch.float64, device=device)


def _identity(n: int, values: Tensor) -> Tensor:
    """A diagonal J^T. Its column indices are the row pointer without its last entry, so one arange
    serves both (they share memory: do not write to them in place)."""
    crow = torch.arange(n + 1, device=values.device)
    return _csr(crow, crow[:n], values, (n, n))


def relu_jt(x: Tensor) -> Tensor:
    """J^T of ReLU: the diagonal f'(x) (all n entries stored: the pattern is the diagonal)."""
    n = x.numel()
    # f'(x) = 1 for x > 0, else 0 (autograd's choice at 0), written as x's dtype in one pass
    values = torch.gt(x.detach().reshape(-1), 0, out=torch.empty(n, dtype=x.dtype, device=x.device))
    return _identity(n, values)


def _disjoint(h: int, w: int, kernel, stride, padding) -> bool:
    """True when no input is in two windows and nothing is padded: the pools' fast path."""
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(padding)
    return ph == pw == 0 and kh <= min(sh, h) and kw <= min(sw, w)


def _disjoint_pattern(c: int, h: int, w: int, kernel, stride, device) -> tuple[Tensor, Tensor, int, int]:
    """Row pointer and columns of a pool whose windows neither overlap nor pad.

    Each input is in at most one window; those that are, (ci, oi·sh + a, oj·sw + b) with a < kh
    and b < kw, hold one entry each, in the contiguous order (ci, oi, a, oj, b).
    """
    (kh, kw), (sh, sw) = _pair(kernel), _pair(stride)
    ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
    cols = torch.empty(c * ho * kh * wo * kw, dtype=torch.int64, device=device)
    # one (kh, wo, kw) template per (ci, oi) slab: inner loops over contiguous slabs, not over kw
    slab = torch.arange(wo, device=device).view(1, wo, 1).expand(kh, wo, kw).reshape(1, -1)
    torch.add(torch.arange(0, c * ho * wo, wo, device=device).view(-1, 1), slab, out=cols.view(c * ho, -1))
    if kh == sh and kw == sw and h == ho * kh and w == wo * kw:  # every input in exactly one window
        return torch.arange(c * h * w + 1, device=device), cols, ho, wo
    h_counts = [int(i < ho * sh and i % sh < kh) for i in range(h)]
    w_counts = [int(j < wo * sw and j % sw < kw) for j in range(w)]
    ah = _Axis(ho, h_counts, list(accumulate(h_counts, initial=0)), [], [], [])
    aw = _Axis(wo, w_counts, list(accumulate(w_counts, initial=0)), [], [], [])
    return _crow(c, 1, ah, aw, device), cols, ho, wo


def maxpool2d_jt(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """J^T of ``F.max_pool2d``: every (input, window) membership; 1 at the window's maximum."""
    c, h, w = x.shape
    stride = kernel_size if stride is None else stride
    # the window maxima exactly as autograd takes them (first maximum; a NaN wins), as input rows
    _, argmax = F.max_pool2d(x.detach(), kernel_size, stride, padding, return_indices=True)
    rows = argmax + torch.arange(0, c * h * w, h * w, device=x.device).view(c, 1, 1)
    if _disjoint(h, w, kernel_size, stride, padding):
        crow, cols, ho, wo = _disjoint_pattern(c, h, w, kernel_size, stride, x.device)
        # one entry per row: a maximum's entry is at its row's pointer (its row, if every input has one)
        place = rows if cols.numel() == c * h * w else crow[rows]
    else:
        pat, crow, cols, ho, wo = _pattern(c, h, w, 1, 1, kernel_size, stride, padding, 1, x.device)
        # the maximum of window (ci, oi, oj) is input (ci, i, j); within that row the window is
        # entry (oi - lowest oi of row i)·(windows of col j) + oj - lowest oj of col j
        lowest_h = torch.tensor(pat.ah.lowest, device=x.device)
        lowest_w, n_w = torch.tensor([pat.aw.lowest, pat.aw.counts], device=x.device)
        i = torch.div(argmax, w, rounding_mode="floor")
        j = argmax - i * w
        oi = torch.arange(ho, device=x.device).view(1, ho, 1) - lowest_h[i]
        oj = torch.arange(wo, device=x.device).view(1, 1, wo) - lowest_w[j]
        place = crow[rows] + oi * n_w[j] + oj
    values = torch.zeros(cols.shape, dtype=x.dtype, device=x.device)
    values.index_fill_(0, place.view(-1), 1)
    return _csr(crow, cols, values, (c * h * w, c * ho * wo))


def avgpool2d_jt(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """J^T of ``F.avg_pool2d`` (count_include_pad=True, PyTorch's default): 1 / kernel area."""
    c, h, w = x.shape
    stride = kernel_size if stride is None else stride
    if _disjoint(h, w, kernel_size, stride, padding):
        crow, cols, ho, wo = _disjoint_pattern(c, h, w, kernel_size, stride, x.device)
    else:
        _, crow, cols, ho, wo = _pattern(c, h, w, 1, 1, kernel_size, stride, padding, 1, x.device)
    kh, kw = _pair(kernel_size)
    values = torch.full(cols.shape, 1.0 / (kh * kw), dtype=x.dtype, device=x.device)
    return _csr(crow, cols, values, (c * h * w, c * ho * wo))


def flatten_jt(x: Tensor) -> Tensor:
    """J^T of a flatten: the identity."""
    n = x.numel()
    return _identity(n, torch.ones(n, dtype=x.dtype, device=x.device))


@_quiet_csr
def linear_jt(weight: Tensor) -> Tensor:
    """J^T of ``F.linear`` is W^T; stored entries are W's non-zeros (pruned weights drop out)."""
    return weight.detach().t().contiguous().to_sparse_csr()


@dataclass
class ScanCost:
    """FLOPs and depth of a sparse scan, counted the paper's way."""

    total_flops: int = 0
    critical_flops: int = 0
    steps: int = 0  # dependent steps: each parallel level or sequential product is one
    products: list[dict] = field(default_factory=list)  # level, kind, m, k, n, nnz_a, nnz_b, flops

    def level(self, level: int, kind: str, items: list[dict]) -> None:
        """Record one parallel level (or one sequential product) of products."""
        if not items:
            return
        for item in items:
            item.update(level=level, kind=kind)
        self.products += items
        self.total_flops += sum(i["flops"] for i in items)
        self.critical_flops += max(i["flops"] for i in items)
        self.steps += 1


def spgemm_flops(a: Tensor, b: Tensor) -> int:
    """2 x the matching non-zero pairs of a @ b: sum over k of nnz(a[:, k]) * nnz(b[k, :])."""
    col_a = torch.bincount(a.col_indices(), minlength=a.shape[1])
    row_b = b.crow_indices().diff()
    return int(2 * (col_a * row_b).sum())


def _product(a: Tensor, b: Tensor) -> tuple[Tensor, dict]:
    out = a @ b
    info = {"m": a.shape[0], "k": a.shape[1], "n": b.shape[1], "nnz_a": a._nnz(), "nnz_b": b._nnz()}
    return out, {**info, "flops": spgemm_flops(a, b)}


def _matvec_cost(a: Tensor) -> dict:
    """Cost of a sparse matrix times a dense vector: 2 x nnz."""
    return {
        "m": a.shape[0],
        "k": a.shape[1],
        "n": 1,
        "nnz_a": a._nnz(),
        "nnz_b": a.shape[1],
        "flops": 2 * a._nnz(),
    }


def _matvec(a: Tensor, v: Tensor) -> tuple[Tensor, dict]:
    return a @ v, _matvec_cost(a)


def sparse_scan(
    elements: list[Tensor], g_last: Tensor, levels: int | None = None
) -> tuple[list[Tensor], ScanCost]:
    """BPPSA over a chain of sparse J^T: x_n = g_last, x_k = elements[k] @ x_{k+1}; returns x_0..x_n.

    ``elements[k]`` is the transposed Jacobian of layer k+1 (CSR), so x_0 is the gradient with
    respect to the network's input. ``levels=None`` is the full Blelloch scan; ``levels=m`` runs m
    up/down levels around a sequential middle (heterogeneous BPPSA; 0 is plain back-propagation).
    """
    cost = ScanCost()
    with flush_denormals(g_last.device):  # long products of Jacobians underflow: see denormals
        xs = _scan(list(elements), g_last, levels, 0, cost)
    return xs, cost


def _scan(
    elems: list[Tensor], x_last: Tensor, levels: int | None, depth: int, cost: ScanCost
) -> list[Tensor]:
    n = len(elems)
    out: list[Tensor | None] = [None] * (n + 1)
    out[n] = x_last
    if n == 0 or levels == 0:  # the sequential middle: one dependent product per element
        x = x_last
        for k in reversed(range(n)):
            x, info = _matvec(elems[k], x)
            cost.level(depth, "sequential", [info])
            out[k] = x
        return out
    pairs = (n - 1) // 2
    lo0 = (n - 1) - 2 * pairs
    spine, spine_info = _matvec(elems[n - 1], x_last)
    up, infos = [], [spine_info]
    for q in range(pairs):
        prod, info = _product(elems[lo0 + 2 * q], elems[lo0 + 2 * q + 1])
        up.append(prod)
        infos.append(info)
    cost.level(depth, "up-sweep", infos)
    kept = _scan(up, spine, None if levels is None else levels - 1, depth + 1, cost)
    for q, x in enumerate(kept):
        out[lo0 + 2 * q] = x
    down = []
    for j in range(1 - lo0, n - 1, 2):
        out[j], info = _matvec(elems[j], out[j + 1])
        down.append(info)
    cost.level(depth, "down-sweep", down)
    return out


def backprop_cost(elements: list[Tensor]) -> ScanCost:
    """Plain back-propagation over the same chain: n dependent sparse matrix-vector products."""
    cost = ScanCost()
    for e in reversed(elements):
        cost.level(0, "sequential", [_matvec_cost(e)])
    return cost
