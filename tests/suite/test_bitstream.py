"""datasets.bitstream: the paper's task, reproducible, lean, and strict about its arguments."""

from __future__ import annotations

import pytest
import torch
from helpers import run_child

from datasets.bitstream import NUM_CLASSES, BitstreamDataset, bitstream_loaders, sample_bits


def test_bits_are_pinned_for_any_machine() -> None:
    # Raw Philox output is platform- and version-stable; these values must never change.
    bits = sample_bits(0, 7, 64)
    assert "".join(map(str, bits[:32])) == "10110000011110111110010101111011"
    assert int(bits.sum()) == 43
    assert int(sample_bits(123, 12345, 1000).sum()) == 556


def test_same_seed_same_data_in_any_batch_order() -> None:
    a = BitstreamDataset(50, num_samples=100, seed=3)
    b = BitstreamDataset(50, num_samples=100, seed=3)
    xa, ya = a.__getitems__([5, 9, 2])
    x9, y9 = b[9]
    assert torch.equal(xa[1], x9) and ya[1] == y9
    other = BitstreamDataset(50, num_samples=100, seed=4)
    assert not torch.equal(other[9][0], x9)


def test_class_k_draws_bits_with_probability_005_plus_01k() -> None:
    data = BitstreamDataset(20_000, num_samples=NUM_CLASSES, split="all")
    x, y = data.__getitems__(range(NUM_CLASSES))
    assert y.tolist() == list(range(NUM_CLASSES))
    rates = x.mean(dim=(1, 2))
    expected = 0.05 + 0.1 * torch.arange(NUM_CLASSES)
    assert torch.allclose(rates, expected, atol=0.01)


def test_paper_split_sizes_and_balanced_classes() -> None:
    train, test = bitstream_loaders(seq_len=4, batch_size=1000)
    assert (len(train.dataset), len(test.dataset)) == (32_000, 18_000)
    for loader, per_class in ((train, 3_200), (test, 1_800)):
        labels = torch.cat([y for _, y in loader])
        assert torch.bincount(labels, minlength=NUM_CLASSES).tolist() == [per_class] * NUM_CLASSES


def test_loader_batches_are_float32_batch_time_one() -> None:
    train, _ = bitstream_loaders(seq_len=33, batch_size=16, num_samples=200, seed=1)
    x, y = next(iter(train))
    assert x.shape == (16, 33, 1) and x.dtype == torch.float32
    assert y.shape == (16,) and y.dtype == torch.int64
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    again, _ = bitstream_loaders(seq_len=33, batch_size=16, num_samples=200, seed=1)
    x2, y2 = next(iter(again))
    assert torch.equal(x, x2) and torch.equal(y, y2)  # the shuffle is seeded too


def test_long_sequences_never_hold_the_data_set_in_memory() -> None:
    child = (
        "from datasets.bitstream import bitstream_loaders\n"
        "train, _ = bitstream_loaders(30_000, 256)\n"
        "before = rss_bytes()\n"
        "reset_peak()\n"
        "for i, (x, y) in zip(range(3), train): pass\n"
        "print(peak_bytes() - before)\n"
    )
    # The float32 data set would be 50,000 x 30,000 x 4 B = 6 GB; a batch is ~92 MB.
    assert int(run_child(child)) < 300e6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, "seq_len must be a positive integer, got 0"),
        ({"seq_len": 5, "num_samples": -1}, "num_samples must be a positive integer, got -1"),
        ({"seq_len": 5, "split": "val"}, "unknown split 'val'; accepted: train, test, all"),
        ({"seq_len": 5, "train_fraction": 1.5}, "train_fraction must lie strictly between 0 and 1"),
        ({"seq_len": 5, "seed": -2}, "seed must be a non-negative integer, got -2"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BitstreamDataset(**kwargs)


def test_bad_loader_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        bitstream_loaders(5, 0)
    with pytest.raises(IndexError, match="index 7 out of range for a split of 5 samples"):
        BitstreamDataset(5, num_samples=10, split="test", train_fraction=0.5)[7]
