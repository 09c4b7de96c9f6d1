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

Elements are selected by an ``int`` (no leading dimension) or a ``slice`` (a leading dimension S),
so chunked and paired layouts are strided views, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    diagonal: optional (n, B or 1, H).
    """

    scales: Tensor
    weights: Tensor
    diagonal: Tensor | None = None

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
        scaled = torch.mul(x.unsqueeze(-2), s, out=work)  # ([S,] B, R, K, H)
        out = torch.matmul(scaled.flatten(-2), self.weights.reshape(k * h, h), out=out)
        if self.diagonal is not None:
            out.addcmul_(x, self.diagonal[idx].unsqueeze(-2))
        return out

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.scales, self.weights) + (() if self.diagonal is None else (self.diagonal,))

    def work_shape(self, x: Tensor) -> tuple[int, ...]:
        """Shape of the ``work`` buffer ``rmul`` takes for x."""
        return (*x.shape[:-1], self.weights.shape[0], self.hidden)

    def dense(self, idx: Index = slice(None)) -> Tensor:
        """The folded (H, H) matrices of the selected elements."""
        s = self.scales[idx]
        out = torch.einsum("...ki,kij->...ij", s, self.weights)
        if self.diagonal is not None:
            out.diagonal(dim1=-2, dim2=-1).add_(self.diagonal[idx])
        return out


Chain = DenseChain | FactoredChain


def as_chain(elements: Tensor | Chain) -> Chain:
    """Accept a plain (n, B or 1, H, H) tensor wherever a chain is expected."""
    return DenseChain(elements) if isinstance(elements, Tensor) else elements
