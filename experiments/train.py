"""The training loop: a recurrent classifier, trained with every iteration's phases timed apart.

Each iteration is timed in three phases, forward (model and loss), backward (``loss.backward()``;
for BPPSA this includes building the Jacobians, as the paper counts it) and optimizer step: CUDA
events on a GPU, a synchronized wall clock on the CPU. The first ``warmup_iters`` iterations of a
run are left out of the phase sums, and one untimed forward and backward (``prime``) comes before
the first epoch. One row per epoch records the sums, the iteration counts, the
epoch's wall time, loss, accuracy and throughput, so no second "no-backward" run is needed to get
the backward time. With ``trainer.capture`` each phase is the replay of a CUDA graph
(``experiments.graphs.CapturedStep``); either way the losses are read from the device only every
``READ_EVERY`` iterations (``Tally``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from bppsa_core.distributed import SequenceParallel
from experiments.graphs import CapturedStep
from experiments.timing import Interval
from toolbox.errors import SuiteError
from toolbox.files import write_atomic

PHASES = ("forward", "backward", "step")
# Iterations between reads of the loss per device type: a GPU's read waits for its queue to drain.
READ_EVERY = {"cpu": 1, "cuda": 100}


class NonFiniteLossError(SuiteError, RuntimeError):
    """The loss became NaN or infinite: the run stops and is recorded as failed."""


class Classifier(nn.Module):
    """A recurrent layer and a linear head on its last state: the paper's models.

    ``ranks=(rank, size)``: the layer runs sequence-parallel over the default process group
    (``bppsa_core.distributed.SequenceParallel``, its backward the layer's ``backward_mode``, BPPSA's
    ranks handing the gradient on by ``exchange``). Each
    rank takes whole batches (B, T, I), keeps its time slice (``torch.tensor_split``'s) and gets the
    final state every rank holds, so the loss is the same on every rank. The parameters and their
    names are those of one process: a checkpoint loads whatever the rank count.
    """

    def __init__(
        self, rnn: nn.RNNBase, classes: int, ranks: tuple[int, int] | None = None, exchange: str = "auto"
    ) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size, classes)
        self.ranks = ranks
        # the same layer run across the ranks; set past nn.Module, so it adds no parameter names
        parallel = (
            None if ranks is None else SequenceParallel(rnn, backward=rnn.backward_mode, exchange=exchange)
        )
        object.__setattr__(self, "parallel", parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            rank, size = self.ranks
            _, state = self.parallel(torch.tensor_split(x, size, dim=1)[rank])
        else:
            _, state = self.rnn(x)
        h_n = state[0] if isinstance(state, tuple) else state  # an LSTM's state is (h_n, c_n)
        return self.head(h_n[-1])


class PhaseTimer:
    """Sums the time of named phases (``experiments.timing.Interval``); reads a GPU's events once,
    at ``collect``, so the loop is not synchronized per phase."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: list[tuple[str, Interval]] = []

    def time(self, phase: str, fn: Callable[[], object], record: bool) -> object:
        """Run ``fn``; add its duration to ``phase`` when ``record``."""
        if not record:
            return fn()
        with Interval(self.device) as interval:
            out = fn()
        self.pending.append((phase, interval))
        return out

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect."""
        totals = dict.fromkeys(PHASES, 0.0)
        for phase, interval in self.pending:
            totals[phase] += interval.seconds
        self.pending.clear()
        return totals


class Tally:
    """Each iteration's loss and correct count, kept where they were computed and read every
    ``every`` iterations: on a GPU a read waits for the device, so the loop reads rarely and the
    host runs ahead; a loss that is not finite stops the run at the read that sees it."""

    def __init__(self, every: int, hint: str) -> None:
        self.every, self.hint = every, hint
        self.pending: list[tuple[Tensor, int, str]] = []
        self.loss_sum, self.correct, self.seen = 0.0, 0, 0
        self.last = math.nan  # the last loss read

    def add(self, logits: Tensor, loss: Tensor, y: Tensor, where: str) -> None:
        """Count one iteration (``where``: its place, for the error); read if ``every`` are pending."""
        correct = (logits.detach().argmax(-1) == y).sum()
        self.pending.append((torch.stack((loss.detach().float(), correct.float())), len(y), where))
        if len(self.pending) >= self.every:
            self.read()

    def read(self) -> None:
        """Add the pending iterations to the sums (one wait for the device)."""
        if not self.pending:
            return
        values = torch.stack([v for v, _, _ in self.pending]).tolist()
        for (loss, correct), (_, n, where) in zip(values, self.pending, strict=True):
            if not math.isfinite(loss):
                self.pending.clear()
                why = f"training loss became {loss} at {where}; the run stops ({self.hint})"
                raise NonFiniteLossError(why)
            self.loss_sum += loss * n
            self.correct += round(correct)
            self.seen += n
            self.last = loss
        self.pending.clear()


@dataclass
class TrainState:
    """What a checkpoint holds besides the model and optimizer."""

    epoch: int = 0  # epochs finished
    iteration: int = 0  # iterations finished, over all epochs
    wall: float = 0.0  # seconds of training so far, evaluation excluded
    initial_loss: float | None = None  # mean training loss before the first step (the curves' t = 0)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Mean loss and accuracy over a loader."""
    model.eval()
    total, correct, count = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        total += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        count += len(y)
    model.train()
    return total / max(count, 1), correct / max(count, 1)


def prime(model: nn.Module, loader: DataLoader, device: torch.device) -> None:
    """One forward and backward on the first training batch, before any epoch is timed: one-time
    work (the compiled kernels' first compile, cuDNN's plans) stays out of the epochs' times. Its
    gradients are dropped and every random state is restored, so training goes on as without it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        x, y = first_batch(loader)
        _forward(model, x.to(device), y.to(device))[1].backward()
    model.zero_grad(set_to_none=True)


def first_batch(loader: DataLoader) -> tuple[Tensor, Tensor]:
    """The loader's first batch, its shuffle's random state left as it was: the epochs' order stays."""
    order = loader.generator.get_state() if loader.generator is not None else None
    batch = next(iter(loader))
    if order is not None:
        loader.generator.set_state(order)
    return batch


def train_epoch(
    model: Classifier,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    device: torch.device,
    state: TrainState,
    warmup_iters: int,
    progress: bool,
    captured: dict[tuple, CapturedStep] | None = None,
) -> dict:
    """One epoch; returns its row (phase sums, counts, loss, accuracy, throughput). ``captured``
    (``capture_steps``): each batch's step replays the graphs of its shape instead of running eagerly."""
    timer = PhaseTimer(device)
    lr = optimizer.param_groups[0]["lr"]
    tally = Tally(READ_EVERY.get(device.type, 1), f"try an optimizer.lr below {lr:g}")
    timed, iterations = 0, 0
    solves: list = []  # every layer's forward solve of the epoch (bppsa_core.newton.SolveStats)
    t0 = time.perf_counter()
    bar = None
    if progress:  # tqdm only for a bar: a GPU machine's bare Python may lack it
        from tqdm import tqdm

        bar = tqdm(loader, desc=f"epoch {state.epoch + 1}", leave=False, file=sys.stderr)
    for x, y in bar if bar is not None else loader:
        record = state.iteration >= warmup_iters
        if captured is not None:
            step = captured[_shape(x, y)]
            step.load(x, y)
            y = step.y
            for phase, replay in zip(PHASES, (step.forward, step.backward, step.step), strict=True):
                timer.time(phase, replay, record)
            logits, loss = step.logits, step.loss
        else:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, loss = timer.time("forward", lambda x=x, y=y: _forward(model, x, y), record)
            optimizer.zero_grad(set_to_none=True)
            timer.time("backward", loss.backward, record)
            timer.time("step", optimizer.step, record)
        solves += model.rnn.solver_stats
        tally.add(logits, loss, y, f"epoch {state.epoch + 1}, iteration {state.iteration + 1}")
        timed += record
        iterations += 1
        state.iteration += 1
        if bar is not None and not tally.pending:
            bar.set_postfix(loss=f"{tally.last:.4f}", refresh=False)
    tally.read()
    epoch_s = time.perf_counter() - t0
    state.wall += epoch_s
    phases = timer.collect()
    seen = tally.seen
    return {
        "epoch": state.epoch + 1,
        "iterations": iterations,
        "timed_iterations": timed,
        **{f"{p}_s": phases[p] for p in PHASES},
        "epoch_s": epoch_s,
        "wall_s": state.wall,
        "loss": tally.loss_sum / max(seen, 1),
        "accuracy": tally.correct / max(seen, 1),
        "samples_per_s": seen / epoch_s if epoch_s > 0 else float("nan"),
        # Newton iterations per layer forward (0: the native forward), and the solves that fell back
        "newton_iterations": sum(s.iterations for s in solves) / max(len(solves), 1),
        "newton_fallbacks": sum(not s.converged for s in solves),
    }


def _shape(x: Tensor, y: Tensor) -> tuple:
    return (*x.shape, *y.shape)


def capture_steps(
    model: Classifier, optimizer: torch.optim.Optimizer, loader: DataLoader, device: torch.device
) -> dict[tuple, CapturedStep]:
    """The training step captured (``experiments.graphs.CapturedStep``) for each batch shape the
    loader gives: its batch size and, where the samples do not divide into batches, the last
    batch's, from the first batch; the weights, the optimizer state and the loader's order stay as
    they were."""
    x, y = (t.to(device) for t in first_batch(loader))
    samples, size = len(loader.dataset), loader.batch_size
    sizes = {min(size, samples), 0 if loader.drop_last else samples % size} - {0}
    steps = {}
    for n in sorted(sizes, reverse=True):
        steps[_shape(x[:n], y[:n])] = CapturedStep(model, optimizer, _forward, x[:n], y[:n])
    return steps


def _forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(x)
    return logits, F.cross_entropy(logits, y)


def save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, rows: list[dict]
) -> None:
    """Everything a resumed run needs, written atomically."""
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "state": vars(state),
        "rows": rows,
        "rng": torch.get_rng_state(),
    }
    write_atomic(path, lambda p: torch.save(payload, p))


class CheckpointError(SuiteError, ValueError):
    """A checkpoint that cannot be resumed from, said in one line that names it."""


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[TrainState, list[dict]]:
    """Model, optimizer and RNG state from ``path``; the training state and the records it holds."""
    try:
        payload = torch.load(path, weights_only=False)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        torch.set_rng_state(payload["rng"])
        return TrainState(**payload["state"]), payload["rows"]
    except Exception as exc:  # truncated, corrupt, or another model's: say which file
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        raise CheckpointError(
            f"cannot resume from {path} ({why.rstrip(': ')}); delete it, or pass trainer.resume=false "
            "to start the run over"
        ) from None
