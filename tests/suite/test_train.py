"""The training loop of ``run.py`` without Hydra: the loss tally and the captured step
(``trainer.capture``), on a CPU with CUDA's graphs stood in for, and on a GPU (``gpu`` marker)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from bppsa_core import GRU, RNN
from experiments import graphs, train

CPU = torch.device("cpu")


def loader(samples: int, batch: int, steps: int = 6, features: int = 3, classes: int = 3, seed: int = 0):
    """A shuffled loader of random sequences, its order seeded."""
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, steps, features, generator=g), torch.randint(classes, (samples,), generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator())


def epochs(model, optimizer, data, device, count: int, captured=None) -> list[dict]:
    """``count`` epochs of ``train_epoch``, each with its order seeded as run.py seeds it."""
    state, rows = train.TrainState(), []
    for epoch in range(count):
        data.generator.manual_seed(1000 + epoch)
        rows.append(train.train_epoch(model, optimizer, data, device, state, 0, False, captured))
        state.epoch += 1
    return rows


def test_a_captured_step_trains_as_the_eager_loop_does(cuda_stood_in_for) -> None:
    """Two epochs with each batch shape's step captured (the last batch is short: two shapes), from
    the same weights, give the eager loop's rows and weights. A large learning rate and dropout make
    the warm-up's updates and random numbers show, were they not undone."""
    torch.manual_seed(0)
    model = train.Classifier(GRU(3, 5, num_layers=2, dropout=0.3, batch_first=True), classes=3)
    twin = copy.deepcopy(model)
    data = loader(10, 4)
    torch.manual_seed(1)
    eager = epochs(twin, torch.optim.Adam(twin.parameters(), lr=0.05), data, CPU, 2)
    torch.manual_seed(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    captured = train.capture_steps(model, optimizer, data, CPU)
    assert sorted(captured) == [(2, 6, 3, 2), (4, 6, 3, 4)]
    ran = cuda_stood_in_for
    assert ran == ["capture _forward", "capture _backward", "capture step"] * 2
    ran.clear()
    rows = epochs(model, optimizer, data, CPU, 2, captured)
    assert ran == ["_forward", "_backward", "step"] * 6  # 3 batches an epoch, each phase replayed
    for a, b in zip(eager, rows, strict=True):
        assert (a["iterations"], a["accuracy"]) == (b["iterations"], b["accuracy"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert all(b[f"{p}_s"] > 0 for p in train.PHASES)
    for p, q in zip(twin.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_a_snapshot_puts_the_weights_and_the_optimizers_state_back_in_place() -> None:
    """A resumed run's optimizer has state before the warm-up: it comes back; state the warm-up made
    is zeroed (a fresh Adam's); every tensor is the one it was, written, not replaced."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam([model.weight], lr=0.1)
    sgd = torch.optim.SGD([model.bias], lr=0.1, momentum=0.9)

    def step():
        model(torch.randn(4, 3)).square().sum().backward()
        adam.step(), sgd.step()

    fresh = graphs.Snapshot(model, sgd)  # before its first step: no state
    weights = [p.detach().clone() for p in model.parameters()]
    step()
    resumed = graphs.Snapshot(model, adam)  # after: Adam's state, as a checkpoint loads it
    before = {k: v.clone() for k, v in adam.state[model.weight].items()}
    tensors = [model.weight, model.bias, *adam.state[model.weight].values()]
    for _ in range(3):
        step()
    buffer = sgd.state[model.bias]["momentum_buffer"]
    assert buffer.abs().sum() > 0
    resumed.restore()
    assert all(torch.equal(adam.state[model.weight][k], v) for k, v in before.items())
    fresh.restore()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    now = [model.weight, model.bias, *adam.state[model.weight].values()]
    assert all(a is b for a, b in zip(now, tensors, strict=True))
    assert sgd.state[model.bias]["momentum_buffer"] is buffer and not buffer.any()


def test_the_tally_reads_rarely_and_names_the_iteration_whose_loss_is_not_finite() -> None:
    tally = train.Tally(3, "a hint")
    logits, y = torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, 1])
    tally.add(logits, torch.tensor(0.5), y, "iteration 1")
    tally.add(logits, torch.tensor(0.25), y, "iteration 2")
    assert tally.seen == 0 and len(tally.pending) == 2  # nothing read yet
    tally.add(logits, torch.tensor(0.75), y, "iteration 3")
    assert (tally.seen, tally.correct, tally.loss_sum, tally.last) == (6, 3, 3.0, 0.75)
    tally.add(logits, torch.tensor(1.0), y, "iteration 4")
    tally.add(logits, torch.tensor(math.inf), y, "iteration 5")
    with pytest.raises(
        train.NonFiniteLossError, match=r"^training loss became inf at iteration 5; .*\(a hint\)$"
    ):
        tally.read()
    assert not tally.pending


def test_a_gpu_reads_the_loss_every_hundred_iterations_a_cpu_every_one() -> None:
    assert train.READ_EVERY == {"cpu": 1, "cuda": 100}


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["bptt", "bppsa"])
def test_on_a_gpu_the_captured_step_trains_as_the_eager_loop_does(backward: str) -> None:
    """``trainer.capture``'s loop on a GPU: each phase a CUDA graph of its own, one memory pool; two
    epochs with a short last batch give the eager loop's losses and weights (float32 rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    model = train.Classifier(RNN(3, 20, batch_first=True, backward=backward), classes=3).to(cuda)
    twin = copy.deepcopy(model)
    data = loader(40, 16, steps=200)
    eager = epochs(twin, torch.optim.Adam(twin.parameters(), lr=1e-2), data, cuda, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    captured = train.capture_steps(model, optimizer, data, cuda)
    assert len(captured) == 2
    rows = epochs(model, optimizer, data, cuda, 2, captured)
    for a, b in zip(eager, rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["iterations"] == a["iterations"] == 3
        assert all(b[f"{p}_s"] > 0 for p in train.PHASES)
    for p, q in zip(twin.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-4)
