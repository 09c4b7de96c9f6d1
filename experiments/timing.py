"""The suite's one clock: CUDA events on a GPU, a wall clock on the CPU.

``Interval`` times one stretch of work. On a GPU it records two CUDA events and reads them only
when asked (``seconds``), so a training loop can time every phase without a synchronization per
phase; on the CPU it reads ``time.perf_counter``. ``time_ms`` times one call to completion (the
benchmarks), ``median_ms`` the median of repeated calls after warm-up ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class Interval:
    """``with Interval(device) as it: work()``; then ``it.seconds``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> Interval:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    @property
    def seconds(self) -> float:
        """The interval's length; on a GPU this waits for its end event."""
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._t1 - self._t0


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of ``fn`` on ``device``, from an idle device to the end of its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with Interval(device) as interval:
        fn()
    return interval.seconds * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median of ``repeats`` timed calls (``time_ms``) after ``warmup`` untimed ones."""
    for _ in range(warmup):
        time_ms(fn, device)
    return statistics.median(time_ms(fn, device) for _ in range(repeats))
