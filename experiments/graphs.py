"""Training steps captured in CUDA graphs: the README's fast path, for the harness and the benchmarks.

``capture_step`` captures a whole step (forward, backward, optimizer step) as one graph, as the
README shows it; ``CapturedStep`` captures it as three graphs sharing one memory pool (forward and
loss, backward, optimizer step), so that a training loop replays and times each phase apart
(``run.py trainer.capture=true``). Each warms the step up on a side stream first (PyTorch's
documented warm-up), and ``Snapshot`` undoes the warm-up's updates in place, so that training goes
on from the weights it had. Imports nothing beyond torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def warm_up(
    step: Callable[[], object], optimizer: torch.optim.Optimizer, device: torch.device, rounds: int
) -> None:
    """``step``, a training step over fixed tensors (forward, backward, ``optimizer``'s step),
    ``rounds`` times (at least 3) on a side stream, so that the kernels are compiled and cuDNN's plans
    chosen outside a capture (PyTorch's documented warm-up before ``torch.cuda.graph``); the
    gradients are unset before each step and after the last, so that a capture allocates them in
    its own pool."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(rounds, 3)):
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    optimizer.zero_grad(set_to_none=True)


def capture_step(
    step: Callable[[], object],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    rounds: int,
    error_mode: str = "global",
) -> Callable[[], None]:
    """``step`` warmed up (``warm_up``), then captured once in a CUDA graph; returns the graph's
    ``replay``. ``error_mode``: ``torch.cuda.graph``'s ``capture_error_mode`` ("global", PyTorch's
    default, fails a capture on an unsafe CUDA call from any thread; "thread_local" only from the
    capturing one; "relaxed" on none)."""
    warm_up(step, optimizer, device, rounds)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=error_mode):
        step()
    return graph.replay


def capture(fn: Callable[[], object], pool: object) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph that allocates from ``pool``; returns the graph's
    ``replay``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


class Snapshot:
    """A model's weights and buffers and an optimizer's state, kept to be put back in place: a
    graph reads these tensors where they are, so they are written, never replaced."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state = optimizer.state.items()
        self.state = {(id(p), k): v.clone() for p, s in state for k, v in s.items() if isinstance(v, Tensor)}

    @torch.no_grad()
    def restore(self) -> None:
        """Every tensor back to its value at the snapshot; optimizer state made after it zeroed, as a
        fresh optimizer's (Adam's moments and, capturable, its step count; plain SGD has none)."""
        for name, value in self.model.state_dict().items():
            value.copy_(self.weights[name])
        for p, s in self.optimizer.state.items():
            for k, v in s.items():
                if not isinstance(v, Tensor):
                    continue
                before = self.state.get((id(p), k))
                if before is None:
                    v.zero_()
                else:
                    v.copy_(before)


class CapturedStep:
    """A training step over fixed batch tensors of one shape, captured as three CUDA graphs sharing
    one memory pool: ``forward`` (``forward_loss(model, x, y)``, the logits and the loss),
    ``backward`` and ``step`` (the optimizer's), replayed in that order, so each phase is timed apart. The
    backward is captured from unset gradients: a replay writes them, so none are zeroed between
    steps. The warm-up's updates and random numbers are undone: the first replay trains from the
    weights the model had."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        forward_loss: Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor]],
        x: Tensor,
        y: Tensor,
        rounds: int = 3,
    ) -> None:
        self.model, self.optimizer, self.forward_loss = model, optimizer, forward_loss
        self.x, self.y = x.clone(), y.clone()
        self.logits: Tensor | None = None
        self.loss: Tensor | None = None
        device = x.device
        snapshot = Snapshot(model, optimizer)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            warm_up(self._eager_step, optimizer, device, rounds)
            # the warm-up's graph released: alive, its gradient accumulators would stay on the side
            # stream, and the captured backward would wait on it (PyTorch warns of this)
            self.logits = self.loss = None
            pool = torch.cuda.graph_pool_handle()
            self.forward = capture(self._forward, pool)
            self.backward = capture(self._backward, pool)
            self.step = capture(optimizer.step, pool)
        snapshot.restore()

    def load(self, x: Tensor, y: Tensor) -> None:
        """Copy a batch of this step's shape into the tensors the graphs read."""
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)

    def _forward(self) -> None:
        self.logits, self.loss = self.forward_loss(self.model, self.x, self.y)

    def _backward(self) -> None:
        self.loss.backward()

    def _eager_step(self) -> None:
        self._forward()
        self._backward()
        self.optimizer.step()
