"""Helpers for the tests of the recurrent modules: a torch.nn module and ours with the same weights,
their results flattened, and both compared output by output and gradient by gradient."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from helpers import rel_err
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from bppsa_core import nn as bnn

F64 = torch.float64
# name: (torch.nn's class, ours, constructor keywords)
KINDS = {
    "tanh": (torch.nn.RNN, bnn.RNN, {}),
    "relu": (torch.nn.RNN, bnn.RNN, {"nonlinearity": "relu"}),
    "gru": (torch.nn.GRU, bnn.GRU, {}),
    "lstm": (torch.nn.LSTM, bnn.LSTM, {}),
}
CLASSES = {"RNN": (torch.nn.RNN, bnn.RNN), "GRU": (torch.nn.GRU, bnn.GRU), "LSTM": (torch.nn.LSTM, bnn.LSTM)}
SCAN_OPTIONS = (
    "backward", "strategy", "chunk", "levels", "segment",
    "forward_solver", "newton_tol", "newton_iters", "newton_guess",
)  # fmt: skip


def pair(kind: str, *args, dtype=F64, seed: int = 0, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """torch.nn's module and ours with the same weights (our scan options go to ours only)."""
    ref_cls, our_cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    ours_only = {k: kwargs.pop(k) for k in SCAN_OPTIONS if k in kwargs}
    ref = ref_cls(*args, **extra, **kwargs).to(dtype)
    ours = our_cls(*args, **extra, **kwargs, **ours_only).to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def state(
    module: torch.nn.Module, batch: int | None, dtype=F64, seed: int = 1
) -> Tensor | tuple[Tensor, Tensor]:
    """A random initial state for ``module`` (unbatched when ``batch`` is None), requiring grad."""
    g = torch.Generator().manual_seed(seed)
    first = module.num_layers * (2 if module.bidirectional else 1)
    shape = (first, module.hidden_size) if batch is None else (first, batch, module.hidden_size)

    def one() -> Tensor:
        return torch.randn(shape, generator=g, dtype=dtype).requires_grad_()

    return (one(), one()) if isinstance(module, torch.nn.LSTM) else one()


def state_leaves(hx) -> list[Tensor]:
    return [] if hx is None else list(hx) if isinstance(hx, tuple) else [hx]


def flat(result) -> list[Tensor]:
    """(output, state) as a list of tensors: the output (a packed one's data), then h (and c)."""
    out, st = result
    if isinstance(out, PackedSequence):
        out = out.data
    return [out, *st] if isinstance(st, tuple) else [out, st]


def run(module: torch.nn.Module, inp, hx=None, seed: int = 0) -> list[Tensor]:
    """The module's results from a fixed random seed (the same dropout masks for both modules)."""
    torch.manual_seed(seed)
    return flat(module(inp, hx))


def assert_same(
    ref: torch.nn.Module,
    ours: torch.nn.Module,
    inp,
    hx=None,
    leaves: Sequence[Tensor] = (),
    tol: float = 1e-10,
    outputs: Sequence[int] | None = None,
    seed: int = 0,
) -> None:
    """Equal results, and equal gradients of a random projection of the ``outputs`` chosen (indices
    into ``flat``'s list; all by default) w.r.t. every parameter and the ``leaves``."""
    a, b = run(ref, inp, hx, seed), run(ours, inp, hx, seed)
    assert len(a) == len(b)
    same = 1e-12 if a[0].dtype == F64 else 1e-6  # the same kernels, called per layer and direction
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert rel_err(x.detach(), y.detach()) < same, rel_err(x.detach(), y.detach())
    chosen = range(len(a)) if outputs is None else outputs
    g = torch.Generator().manual_seed(seed + 1)
    cot = [torch.randn(a[i].shape, generator=g, dtype=a[i].dtype) for i in chosen]
    wrt_a = [*ref.parameters(), *leaves]
    wrt_b = [*ours.parameters(), *leaves]
    ga = torch.autograd.grad(
        sum((a[i] * c).sum() for i, c in zip(chosen, cot, strict=True)),
        wrt_a,
        retain_graph=True,
        allow_unused=True,
    )
    gb = torch.autograd.grad(
        sum((b[i] * c).sum() for i, c in zip(chosen, cot, strict=True)),
        wrt_b,
        retain_graph=True,
        allow_unused=True,
    )
    names = [n for n, _ in ours.named_parameters()] + [f"leaf{i}" for i in range(len(leaves))]
    for name, x, y in zip(names, ga, gb, strict=True):
        if x is None:
            assert y is None or not y.any(), name
            continue
        assert y is not None, name
        assert rel_err(x, y) < tol, (name, rel_err(x, y))
