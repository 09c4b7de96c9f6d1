"""Sparse transposed Jacobians of CNN layers, written straight into CSR, and a scan over them.

For Conv2d, ReLU, MaxPool2d, AvgPool2d, Flatten and Linear, the transposed Jacobian J^T of one
sample (input size n_in, output size n_out; rows index the input, columns the output, both in
C x H x W order) has a sparsity pattern fixed by the layer's shape before training (DESIGN.md §1).
Each builder computes the index arithmetic of that pattern in a few vectorized tensor ops and
hands it to ``torch.sparse_csr_tensor``; autograd is never asked for a row.

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

import torch
import torch.nn.functional as F
from torch import Tensor


def _quiet_csr(make):
    """Build CSR tensors without PyTorch's 'beta' notice, which every construction repeats."""

    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
            return make(*args, **kwargs)

    return wrapped


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


@_quiet_csr
def _csr(crow: Tensor, cols: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    return torch.sparse_csr_tensor(crow, cols, values, size=shape, check_invariants=False)


def _out_size(size: int, pad: int, dil: int, k: int, stride: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def _pattern(c: int, h: int, w: int, og: int, cg: int, kernel, stride, padding, dilation):
    """The J^T pattern of a (grouped) sliding window, generated directly in CSR order.

    Entries are laid out over (input channel, input row, input col, output channel in the group,
    kernel row descending, kernel col descending): rows ascend, and within a row the output index
    (o, i, j) ascends, so no sort is needed. Returns the mask of valid entries over that layout,
    their output (column) indices, the row pointer, and the output height and width.
    """
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _pair(kernel), _pair(stride), _pair(padding), _pair(dilation)
    ho, wo = _out_size(h, ph, dh, kh, sh), _out_size(w, pw, dw, kw, sw)

    def axis(size: int, k: int, s: int, pad: int, dil: int, n_out: int) -> tuple[Tensor, Tensor]:
        num = torch.arange(size).view(-1, 1) + pad - torch.arange(k - 1, -1, -1).view(1, -1) * dil
        out = torch.div(num, s, rounding_mode="floor")
        return (num % s == 0) & (num >= 0) & (out < n_out), out  # (size, k): valid, output coordinate

    vi, oi = axis(h, kh, sh, ph, dh, ho)
    vj, oj = axis(w, kw, sw, pw, dw, wo)
    o = (torch.arange(c) // cg).view(c, 1, 1, 1, 1, 1) * og + torch.arange(og).view(1, 1, 1, og, 1, 1)
    mask = (vi.view(1, h, 1, 1, kh, 1) & vj.view(1, 1, w, 1, 1, kw)).expand(c, h, w, og, kh, kw)
    cols = (o * ho + oi.view(1, h, 1, 1, kh, 1)) * wo + oj.view(1, 1, w, 1, 1, kw)
    crow = torch.zeros(c * h * w + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum(mask.reshape(c * h * w, -1).sum(1), 0)
    return mask, cols.expand(c, h, w, og, kh, kw)[mask], crow, ho, wo


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
    mask, cols, crow, ho, wo = _pattern(c, h, w, og, cg, (kh, kw), stride, padding, dilation)
    # weight[g·og + oo, c mod cg, p, q] per (input channel, oo, p descending, q descending)
    wg = weight.detach().reshape(groups, og, cg, kh, kw).permute(0, 2, 1, 3, 4).reshape(c, og, kh, kw)
    wg = wg.flip(-1, -2).to(x.dtype)
    values = wg.view(c, 1, 1, og, kh, kw).expand(c, h, w, og, kh, kw)[mask]
    if (wg == 0).any():  # pruned weights are part of the pattern known before training: drop them
        keep = values != 0
        rows = torch.repeat_interleave(torch.arange(c * h * w), crow.diff())[keep]
        crow = torch.zeros_like(crow)
        crow[1:] = torch.cumsum(torch.bincount(rows, minlength=c * h * w), 0)
        cols, values = cols[keep], values[keep]
    return _csr(crow, cols, values, (c * h * w, o * ho * wo))


def relu_jt(x: Tensor) -> Tensor:
    """J^T of ReLU: the diagonal f'(x) (all n entries stored: the pattern is the diagonal)."""
    n = x.numel()
    return _csr(torch.arange(n + 1), torch.arange(n), (x.reshape(-1) > 0).to(x.dtype), (n, n))


def maxpool2d_jt(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """J^T of ``F.max_pool2d``: every (input, window) membership; 1 at the window's maximum."""
    c, h, w = x.shape
    stride = kernel_size if stride is None else stride
    _, cols, crow, ho, wo = _pattern(c, h, w, 1, 1, kernel_size, stride, padding, 1)
    _, argmax = F.max_pool2d(x.unsqueeze(0), kernel_size, stride, padding, return_indices=True)
    winner = (torch.arange(c).view(c, 1, 1) * h * w + argmax[0]).reshape(-1)  # input index per output
    rows = torch.repeat_interleave(torch.arange(c * h * w), crow.diff())
    return _csr(crow, cols, (rows == winner[cols]).to(x.dtype), (c * h * w, c * ho * wo))


def avgpool2d_jt(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """J^T of ``F.avg_pool2d`` (count_include_pad=True, PyTorch's default): 1 / kernel area."""
    c, h, w = x.shape
    stride = kernel_size if stride is None else stride
    _, cols, crow, ho, wo = _pattern(c, h, w, 1, 1, kernel_size, stride, padding, 1)
    kh, kw = _pair(kernel_size)
    return _csr(crow, cols, torch.full(cols.shape, 1.0 / (kh * kw), dtype=x.dtype), (c * h * w, c * ho * wo))


def flatten_jt(x: Tensor) -> Tensor:
    """J^T of a flatten: the identity."""
    n = x.numel()
    return _csr(torch.arange(n + 1), torch.arange(n), torch.ones(n, dtype=x.dtype), (n, n))


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
