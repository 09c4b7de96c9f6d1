"""Floors: what no backward can beat on the measured machine.

The bytes a backward must move over the measured copy bandwidth, and the paper's Blelloch scan's
2·ceil(log2 T) dependent levels times the measured cost of one launch. The backward and scan
tables print both beside their times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from experiments.timing import median_ms


def min_bytes(steps: int, batch: int, hidden: int, terms: int = 1, itemsize: int = 4) -> int:
    """Bytes a BPPSA backward must move at the least: read one (T, B, H) tensor (the states h, or
    f'(z) made from them), read the K shared (H, H) recurrent weights, write x_0..x_T."""
    return itemsize * (steps * batch * hidden + terms * hidden * hidden + (steps + 1) * batch * hidden)


def dependent_levels(steps: int) -> int:
    """Dependent levels of the paper's Blelloch scan of a chain of T elements: 2·ceil(log2 T)."""
    return 2 * math.ceil(math.log2(steps)) if steps > 1 else 1


@dataclass(frozen=True)
class Floors:
    """The measured machine constants the floors are made of."""

    bandwidth_gbs: float  # copy bandwidth, bytes read + written per second / 1e9
    launch_us: float  # time of one tiny op among many issued back to back

    def bytes_ms(self, steps: int, batch: int, hidden: int, terms: int = 1) -> float:
        return min_bytes(steps, batch, hidden, terms) / (self.bandwidth_gbs * 1e6)

    def levels_ms(self, steps: int) -> float:
        return dependent_levels(steps) * self.launch_us / 1e3

    def note(self) -> str:
        """What the floor columns count, for the lines under a table."""
        return (
            f"Floors: bytes = 4·(T·B·H read (h, or f'(z) made from it) + K·H² (W_hh; K = 1 RNN, 3 GRU) + "
            f"(T+1)·B·H written (x_0..x_T)) / copy bandwidth {self.bandwidth_gbs:.1f} GB/s (read + written, "
            f"a large copy on the device); levels = 2·ceil(log2 T) Blelloch levels × {self.launch_us:.2f} "
            "µs per launch (back-to-back tiny ops). best / floor = best BPPSA time / the larger floor; a "
            "fused kernel path may go below the levels floor, which assumes one launch per level."
        )


def measure_floors(device: torch.device, repeats: int = 5) -> Floors:
    """Copy bandwidth (a large device-to-device copy) and the per-launch cost of a tiny op."""
    nbytes = (256 if device.type == "cuda" else 64) << 20
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), device, 2, repeats)
    count = 1000 if device.type == "cuda" else 200
    x = torch.zeros(1, device=device)

    def launches() -> None:
        for _ in range(count):
            x.add_(1.0)

    launch_ms = median_ms(launches, device, 1, repeats) / count
    return Floors(bandwidth_gbs=2 * nbytes / (copy_ms * 1e6), launch_us=launch_ms * 1e3)
