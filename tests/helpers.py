"""Helpers the tests share: tolerances, child processes with memory probes, generated IRMAS trees,
and reading the Markdown tables the tools print."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from benchmarks import memory
from datasets.irmas import SAMPLE_RATE
from datasets.synthetic_irmas import stereo_clip, write_synthetic

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# A run of seconds: the bitstream task shrunk, two epochs, one warm-up iteration.
TINY = ["dataset.seq_len=8", "dataset.num_samples=80", "trainer.epochs=2", "trainer.warmup_iters=1"]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with torch's thread count at ``n``, then put it back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of b from the reference a (0 when both are 0)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / a.norm().clamp_min(1e-300)).item()


# Peak-memory probes for child processes (benchmarks.memory says why these and not ru_maxrss).
MEMORY_PROBES = "from benchmarks.memory import peak_bytes, reset_peak, rss_bytes\n"


def run_child(code: str, *args: str) -> str:
    """Run ``MEMORY_PROBES + code`` in a fresh interpreter at the repository root; its stdout.

    malloc there returns every block of 64 KiB or more to the system when freed
    (``memory.MALLOC``), so the resident set follows the live tensors.
    """
    env = {**os.environ, **memory.MALLOC, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBES + code, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
    )
    return done.stdout.strip()


def run_py(
    *args: str, cwd: Path, timeout: float = 300, wandb: str = "disabled", env: dict | None = None
) -> subprocess.CompletedProcess:
    """``run.py`` with ``args`` in a fresh interpreter, from ``cwd``; W&B in ``wandb`` mode."""
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": wandb, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_module(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m module args`` in a fresh interpreter at the repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def composed(*overrides: str, hydra: bool = False):
    """The configuration ``run.py`` would compose from ``overrides``."""
    from hydra import compose, initialize_config_dir

    import experiments.schema  # noqa: F401  (registers what the config files use)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def write_tree(root: Path, per_class: int = 2) -> Path:
    """11 class folders of stereo clips, plus one of each kind of misfit."""
    import soundfile  # not on every machine that runs the GPU tests

    write_synthetic(root, per_class)
    soundfile.write(root / "cel" / "mono.wav", stereo_clip(99)[:, 0], SAMPLE_RATE)
    soundfile.write(root / "cla" / "rate22k.wav", stereo_clip(98, rate=22_050), 22_050)
    soundfile.write(root / "flu" / "short.wav", stereo_clip(97, seconds=2.0), SAMPLE_RATE)
    (root / "gac" / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really audio")
    return root


def walk_warps_seen(monkeypatch: pytest.MonkeyPatch, tool: object) -> list[int | None]:
    """The kernels' walk warps set (``launch.walk_warps_set``) each time ``tool.bench`` (a
    benchmark's row) runs, in order: ``tool.bench`` wrapped to record them."""
    from bppsa_core.triton import launch

    seen, real = [], tool.bench

    def bench(*args, **kwargs):
        seen.append(launch.walk_warps_set())
        return real(*args, **kwargs)

    monkeypatch.setattr(tool, "bench", bench)
    return seen


def extended_except(values: Iterable, *keep, first: int = 0) -> list:
    """``values`` for ``pytest.mark.parametrize``, all but ``keep`` and the ``first`` few marked
    ``extended``: the default run takes a few cases of a wide test, ``.ci/run`` all of them."""
    return [
        v
        if v in keep or i < first
        else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.extended)
        for i, v in enumerate(values)
    ]
