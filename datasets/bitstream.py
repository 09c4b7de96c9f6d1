"""The paper's synthetic bitstream classification task, generated on demand.

A sample of class k (k = 0..9) is T i.i.d. Bernoulli(0.05 + 0.1·k) bits. The paper uses 50,000
samples, 64 % (32,000) for training and the rest for testing.

Nothing is stored but the labels: sample i's bits are drawn from a Philox counter-based generator
keyed by (seed, i), so any batch is generated directly, in any order, by any worker process, and
the same seed gives the same bits on any machine (the raw Philox stream is platform-independent and
stable across NumPy versions, NEP 19; bits are ``raw >> 11`` scaled to [0, 1) and compared with p).
Sample i has label ``i % 10``, so both splits are class-balanced; training samples are the first
64 %. Peak memory is one batch: its B·T bits (a byte each) and the B·T·4-byte float32 batch
(B = 256, T = 30,000: about 38 MB), plus one sample's T·8 bytes of raw draws at a time, never the
(N, T) data set (6 GB in float32 at N = 50,000).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from toolbox.cli import require_count
from toolbox.errors import DataError

NUM_CLASSES = 10
NUM_SAMPLES = 50_000
TRAIN_FRACTION = 0.64
SPLITS = ("train", "test", "all")


def bit_probability(label: int | np.ndarray) -> float | np.ndarray:
    """P(bit = 1) for a class: 0.05 + 0.1·k."""
    return 0.05 + 0.1 * label


def sample_bits(seed: int, index: int, length: int) -> np.ndarray:
    """The ``length`` bits (uint8) of sample ``index``: a pure function of (seed, index, length)."""
    gen = np.random.Philox(key=[seed & (2**64 - 1), index])
    uniform = (gen.random_raw(length) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return (uniform < bit_probability(index % NUM_CLASSES)).astype(np.uint8)


class BitstreamDataset(Dataset):
    """One split of the bitstream task; items are (x (T, 1) float32, label int64 tensor).

    ``__getitems__`` builds a whole batch at once, so a DataLoader with this dataset fetches a batch
    with one call (see ``bitstream_loaders``).
    """

    def __init__(
        self,
        seq_len: int,
        num_samples: int = NUM_SAMPLES,
        split: str = "train",
        seed: int = 0,
        train_fraction: float = TRAIN_FRACTION,
    ) -> None:
        self.seq_len = require_count("seq_len", seq_len)
        self.num_samples = require_count("num_samples", num_samples)
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; accepted: {', '.join(SPLITS)}")
        if not 0.0 < train_fraction < 1.0:
            raise DataError(f"train_fraction must lie strictly between 0 and 1, got {train_fraction!r}")
        require_count("seed", seed, minimum=0)
        n_train = round(num_samples * train_fraction)
        start, stop = {"train": (0, n_train), "test": (n_train, num_samples), "all": (0, num_samples)}[split]
        if stop <= start:
            raise DataError(
                f"the {split} split of {num_samples} samples at train_fraction {train_fraction} is empty; "
                f"accepted: num_samples x train_fraction rounding to 1 .. num_samples - 1"
            )
        self.split, self.seed, self.start, self.stop = split, seed, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def _global(self, i: int) -> int:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for a split of {len(self)} samples")
        return self.start + (i % len(self))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch: x (B, T, 1) float32 and labels (B,) int64."""
        idx = [self._global(int(i)) for i in indices]
        bits = np.empty((len(idx), self.seq_len), dtype=np.uint8)
        for row, g in enumerate(idx):
            bits[row] = sample_bits(self.seed, g, self.seq_len)
        x = torch.from_numpy(bits).to(torch.float32).unsqueeze(-1)
        return x, torch.tensor([g % NUM_CLASSES for g in idx], dtype=torch.int64)


def _batch_as_is(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``__getitems__`` already returns a collated batch."""
    return batch


def bitstream_loaders(
    seq_len: int,
    batch_size: int,
    num_samples: int = NUM_SAMPLES,
    seed: int = 0,
    train_fraction: float = TRAIN_FRACTION,
    workers: int = 0,
) -> tuple[DataLoader, DataLoader]:
    """Train and test loaders; training order is shuffled with a generator seeded by ``seed``."""
    require_count("batch_size", batch_size)
    require_count("workers", workers, minimum=0)
    common = {"batch_size": batch_size, "num_workers": workers, "collate_fn": _batch_as_is}
    train = BitstreamDataset(seq_len, num_samples, "train", seed, train_fraction)
    test = BitstreamDataset(seq_len, num_samples, "test", seed, train_fraction)
    order = torch.Generator().manual_seed(seed)
    return (
        DataLoader(train, shuffle=True, generator=order, **common),
        DataLoader(test, shuffle=False, **common),
    )


@dataclass(frozen=True)
class Bitstream:
    """The bitstream task as the suite trains on it (``conf/dataset/bitstream.yaml``): its loaders,
    its name and its class count, which the records carry."""

    seq_len: int
    num_samples: int = NUM_SAMPLES
    train_fraction: float = TRAIN_FRACTION
    seed: int = 0
    name: ClassVar[str] = "bitstream"
    classes: ClassVar[int] = NUM_CLASSES

    def loaders(self, batch_size: int, workers: int = 0) -> tuple[DataLoader, DataLoader]:
        """Train and test loaders (``bitstream_loaders``); ``workers``: DataLoader worker processes."""
        return bitstream_loaders(
            self.seq_len, batch_size, self.num_samples, self.seed, self.train_fraction, workers
        )
