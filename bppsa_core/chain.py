"""Chains of transposed-Jacobian elements, dense or factored, as the scans consume them.

A scan only ever needs two things from a chain: right-multiply a block of row vectors by selected
elements (``rmul``), and the elements as explicit matrices (``dense``; Blelloch's up-sweep pairs two
elements). Two representations provide them:

* ``DenseChain``: explicit (n, B or 1, H, H) matrices; a batch size of 1 is shared by every sample.
* ``FactoredChain``: ``M_k[b] = sum_j diag(scales[k, b, j]) @ weights[j] + diag(diagonal[k, b])``, the
  form every recurrent Jacobian has (tanh RNN: one term, ``diag(f'(z_t)) @ W_hh``; GRU: three terms
  and a diagonal). The diagonal factors stay (n, B, K, H) vectors and the shared weights are never
  copied per sample: each product folds them on the fly, ``X @ M_k = [X * s_k1 | ... | X * s_kK] @
  [W_1; ...; W_K] + X * e_k``, which is one large GEMM against a shared matrix, however many samples
  and rows are multiplied at once. Memory is O(n·B·K·H) instead of O(n·B·H²).

* ``LSTMChain``: the LSTM's elements over its state (h, c) of 2H, kept factored the same way: the h
  part goes through the four gates' shared weights, the c part is diagonal (``LSTMChain``).

Factored chains can also hold the transposed elements (``transposed=True``): ``x @ M_k^T``, the
product a tangent takes going forward in time (forward-mode differentiation, ``bppsa_core.layer``).

Elements are selected by an ``int`` (no leading dimension) or a ``slice`` (a leading dimension S),
so chunked and paired layouts are strided views, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

Index = int | slice


@dataclass(frozen=True)
class DenseChain:
    """Explicit elements: (n, B or 1, H, H)."""

    elements: Tensor

    def __post_init__(self) -> None:
        e = self.elements
        if e.dim() != 4 or e.shape[-1] != e.shape[-2]:
            raise ValueError(f"dense chain elements must have shape (n, B or 1, H, H), got {tuple(e.shape)}")

    @property
    def length(self) -> int:
        return self.elements.shape[0]

    @property
    def batch(self) -> int:
        return self.elements.shape[1]

    @property
    def hidden(self) -> int:
        return self.elements.shape[-1]

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.elements,)

    def with_tensors(self, tensors: list[Tensor]) -> DenseChain:
        """The same chain over other tensors, in ``tensors()``'s order (a CUDA graph's buffers)."""
        return DenseChain(*tensors)

    def work_shape(self, x: Tensor) -> tuple[int, ...]:
        """Shape of the ``work`` buffer ``rmul`` takes for x (unused by dense chains)."""
        return (0,)

    def rmul(self, x: Tensor, idx: Index, *, out: Tensor | None = None, work: Tensor | None = None) -> Tensor:
        """x @ M[idx] for x of shape ([S,] B, R, H); ``out`` (not aliasing x) receives the result."""
        return torch.matmul(x, self.elements[idx], out=out)

    def dense(self, idx: Index = slice(None)) -> Tensor:
        return self.elements[idx]


@dataclass(frozen=True)
class FactoredChain:
    """Elements ``sum_j diag(scales[k, b, j]) @ weights[j] (+ diag(diagonal[k, b]))``.

    scales: (n, B or 1, K, H); weights: (K, H, H), shared by all steps and samples;
    diagonal: optional (n, B or 1, H). ``transposed``: the elements are the transposes of these.
    """

    scales: Tensor
    weights: Tensor
    diagonal: Tensor | None = None
    transposed: bool = False

    def __post_init__(self) -> None:
        s, w = self.scales, self.weights
        if w.dim() != 3 or w.shape[-1] != w.shape[-2]:
            raise ValueError(f"weights must have shape (K, H, H), got {tuple(w.shape)}")
        k, h = w.shape[0], w.shape[-1]
        if s.dim() != 4 or s.shape[-2:] != (k, h):
            raise ValueError(f"scales must have shape (n, B or 1, {k}, {h}), got {tuple(s.shape)}")
        if self.diagonal is not None and self.diagonal.shape != (s.shape[0], s.shape[1], h):
            raise ValueError(
                f"diagonal must have shape {(s.shape[0], s.shape[1], h)}, got {tuple(self.diagonal.shape)}"
            )

    @property
    def length(self) -> int:
        return self.scales.shape[0]

    @property
    def batch(self) -> int:
        return self.scales.shape[1]

    @property
    def hidden(self) -> int:
        return self.weights.shape[-1]

    def rmul(self, x: Tensor, idx: Index, *, out: Tensor | None = None, work: Tensor | None = None) -> Tensor:
        """x @ M[idx] for x of shape ([S,] B, R, H): one GEMM against the stacked shared weights.

        ``out`` (shape of x, not aliasing it) and ``work`` (x's shape with a K dimension before the
        last) are optional buffers, so that a loop of products allocates nothing.
        """
        s = self.scales[idx].unsqueeze(-3)  # ([S,] B, 1, K, H)
        k, h = self.weights.shape[0], self.hidden
        if self.transposed:  # x @ W_j^T for every j at once, then scaled and summed over j
            work = torch.matmul(x, self.weights.reshape(k * h, h).t(), out=_flat(work))
            out = torch.sum(work.unflatten(-1, (k, h)).mul_(s), dim=-2, out=out)
        else:
            scaled = torch.mul(x.unsqueeze(-2), s, out=work)  # ([S,] B, R, K, H)
            out = torch.matmul(scaled.flatten(-2), self.weights.reshape(k * h, h), out=out)
        if self.diagonal is not None:
            out.addcmul_(x, self.diagonal[idx].unsqueeze(-2))
        return out

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.scales, self.weights) + (() if self.diagonal is None else (self.diagonal,))

    def with_tensors(self, tensors: list[Tensor]) -> FactoredChain:
        """The same chain over other tensors, in ``tensors()``'s order (a CUDA graph's buffers)."""
        return FactoredChain(*tensors, transposed=self.transposed)

    def work_shape(self, x: Tensor) -> tuple[int, ...]:
        """Shape of the ``work`` buffer ``rmul`` takes for x."""
        return (*x.shape[:-1], self.weights.shape[0], self.hidden)

    def dense(self, idx: Index = slice(None)) -> Tensor:
        """The folded (H, H) matrices of the selected elements."""
        s = self.scales[idx]
        pattern = "...kj,kji->...ij" if self.transposed else "...ki,kij->...ij"
        out = torch.einsum(pattern, s, self.weights)
        if self.diagonal is not None:
            out.diagonal(dim1=-2, dim2=-1).add_(self.diagonal[idx])
        return out

    def diagonals(self) -> Tensor:
        """Every element's diagonal, (n, B or 1, H), without forming an element (transposed or not)."""
        out = (self.scales * self.weights.diagonal(dim1=-2, dim2=-1)).sum(-2)
        return out if self.diagonal is None else out.add_(self.diagonal)


def _flat(work: Tensor | None) -> Tensor | None:
    """A ``work`` buffer (..., K, H) as the (..., K * H) output of one GEMM."""
    return None if work is None else work.flatten(-2)


@dataclass(frozen=True)
class LSTMChain:
    """An LSTM layer's elements over its state (h, c), each (2H, 2H), kept factored.

    With the gates i, f, g, o of W_hh's row blocks W_i, W_f, W_g, W_o (each (H, H)), an element
    is, for a row vector x = (x_h, x_c) (``bppsa_core.jacobians.LSTMCell`` has the factors):

        (x @ M)_h = sum_j (x_h * scales_h[j] + x_c * scales_c[j]) @ W_j (+ x_h * diag_hh),
        (x @ M)_c = x_h * diag_hc + x_c * diag_cc,

    so a product is one GEMM against the stacked (4H, H) weights, as for ``FactoredChain``.
    scales_h, scales_c: (n, B, 4, H); weights: (4, H, H); diag_hc, diag_cc and the optional diag_hh
    (the identity past the end of a shorter sequence): (n, B, H).
    """

    scales_h: Tensor
    scales_c: Tensor
    weights: Tensor
    diag_hc: Tensor
    diag_cc: Tensor
    diag_hh: Tensor | None = None
    transposed: bool = False

    def __post_init__(self) -> None:
        w = self.weights
        if w.dim() != 3 or w.shape[0] != 4 or w.shape[-1] != w.shape[-2]:
            raise ValueError(f"weights must have shape (4, H, H), got {tuple(w.shape)}")
        n, b = self.scales_h.shape[:2]
        h = w.shape[-1]
        for f in fields(self)[:6]:
            t = getattr(self, f.name)
            if t is None:
                continue
            want = (4, h, h) if f.name == "weights" else (n, b, 4, h) if "scales" in f.name else (n, b, h)
            if tuple(t.shape) != want:
                raise ValueError(f"{f.name} must have shape {want}, got {tuple(t.shape)}")

    @property
    def length(self) -> int:
        return self.scales_h.shape[0]

    @property
    def batch(self) -> int:
        return self.scales_h.shape[1]

    @property
    def hidden(self) -> int:
        """The state's size, 2H."""
        return 2 * self.weights.shape[-1]

    def tensors(self) -> tuple[Tensor, ...]:
        hh = () if self.diag_hh is None else (self.diag_hh,)
        return (self.scales_h, self.scales_c, self.weights, self.diag_hc, self.diag_cc, *hh)

    def with_tensors(self, tensors: list[Tensor]) -> LSTMChain:
        """The same chain over other tensors, in ``tensors()``'s order (a CUDA graph's buffers)."""
        return replace(self, **{f.name: t for f, t in zip(fields(self)[:6], tensors, strict=False)})

    def work_shape(self, x: Tensor) -> tuple[int, ...]:
        """Shape of the ``work`` buffer ``rmul`` takes for x."""
        return (*x.shape[:-1], 4, self.weights.shape[-1])

    def rmul(self, x: Tensor, idx: Index, *, out: Tensor | None = None, work: Tensor | None = None) -> Tensor:
        """x @ M[idx] for x of shape ([S,] B, R, 2H); ``out`` and ``work`` as ``FactoredChain.rmul``'s."""
        h = self.weights.shape[-1]
        s_h, s_c = self.scales_h[idx].unsqueeze(-3), self.scales_c[idx].unsqueeze(-3)  # ([S,] B, 1, 4, H)
        d_hc, d_cc = self.diag_hc[idx].unsqueeze(-2), self.diag_cc[idx].unsqueeze(-2)
        x_h, x_c = x[..., :h], x[..., h:]
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        o_h, o_c = out[..., :h], out[..., h:]
        w = self.weights.reshape(4 * h, h)
        if self.transposed:  # p_j = x_h @ W_j^T; out_h = sum_j p_j s_h,j + x_c d_hc; out_c likewise
            p = torch.matmul(x_h, w.t(), out=_flat(work)).unflatten(-1, (4, h))
            torch.sum(p * s_h, dim=-2, out=o_h).addcmul_(x_c, d_hc)
            torch.sum(p.mul_(s_c), dim=-2, out=o_c).addcmul_(x_c, d_cc)
        else:
            v = torch.mul(x_h.unsqueeze(-2), s_h, out=work).addcmul_(x_c.unsqueeze(-2), s_c)
            o_h.copy_(torch.matmul(v.flatten(-2), w))
            torch.mul(x_h, d_hc, out=o_c).addcmul_(x_c, d_cc)
        if self.diag_hh is not None:
            o_h.addcmul_(x_h, self.diag_hh[idx].unsqueeze(-2))
        return out

    def dense(self, idx: Index = slice(None)) -> Tensor:
        """The (2H, 2H) matrices of the selected elements."""
        h = self.weights.shape[-1]
        s_h, s_c = self.scales_h[idx], self.scales_c[idx]
        d_hc, d_cc = self.diag_hc[idx], self.diag_cc[idx]
        out = s_h.new_zeros((*s_h.shape[:-2], 2 * h, 2 * h))
        out[..., :h, :h] = torch.einsum("...ki,kij->...ij", s_h, self.weights)
        out[..., h:, :h] = torch.einsum("...ki,kij->...ij", s_c, self.weights)
        out[..., :h, h:].diagonal(dim1=-2, dim2=-1).copy_(d_hc)
        out[..., h:, h:].diagonal(dim1=-2, dim2=-1).copy_(d_cc)
        if self.diag_hh is not None:
            out[..., :h, :h].diagonal(dim1=-2, dim2=-1).add_(self.diag_hh[idx])
        return out.transpose(-1, -2).contiguous() if self.transposed else out

    def diagonals(self) -> Tensor:
        """Every element's diagonal, (n, B, 2H): h's through the gates' weights, c's ``diag_cc``."""
        d_h = (self.scales_h * self.weights.diagonal(dim1=-2, dim2=-1)).sum(-2)
        if self.diag_hh is not None:
            d_h.add_(self.diag_hh)
        return torch.cat((d_h, self.diag_cc), -1)


Chain = DenseChain | FactoredChain | LSTMChain


def as_chain(elements: Tensor | Chain) -> Chain:
    """Accept a plain (n, B or 1, H, H) tensor wherever a chain is expected."""
    return DenseChain(elements) if isinstance(elements, Tensor) else elements
