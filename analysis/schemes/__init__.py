"""Parallel training schemes side by side: one α–β cost model, one network, one p.

    python -m analysis.schemes --model vgg11 --p 1 2 4 8 16 32 --alpha 5e-6 --beta 1e-10 --out schemes
    python -m analysis.schemes --model rnn --T 1000 --batch 16 --p 1 2 4 8 16 32 --out schemes

Predicts the time of one training iteration (B samples) on p processors, with the busiest
processor's compute, the utilisation, the memory and the bytes sent per processor, for: sequential
BP; a GPipe pipeline (micro-batches, flush every iteration); PipeDream's 1F1B pipeline (delayed
gradients, no flush); LayerPipe (a layer's backward split into its activation- and weight-gradient
tasks, list-scheduled on the p processors); data parallel; model parallel; the best P_r x P_c grid
of Gholami et al. chosen layer by layer; and BPPSA across p devices (the chain of Jacobians cut in
p slices, one all-gather or a log-depth tree of exchanges) beside distributed BPTT (the gradient
going back device by device). Writes ``schemes.csv``, ``schemes.md`` and ``schemes.png`` / ``.pdf``
(time per iteration against p; the Gantt charts of the pipeline schedules at one p), byte for byte
reproducible. docs/SCHEMES.md states what is modelled and what is measured.

The model, in one place:
- A processor computes at ``flops`` FLOP/s whatever the size of the work (no efficiency loss for
  small micro-batches or thin slices).
- A message of n bytes takes α + β·n; an all-gather of n bytes in total over p processes takes
  α⌈log2 p⌉ + β(p-1)/p·n and an all-reduce twice that (Gholami et al.); a group of one costs 0.
  Messages do not contend and do not overlap with compute, except in the pipeline schedules, where a
  transfer delays only the task that waits for it.
- A layer keeps its input for the backward; memory counts weights (times the versions a delayed-
  gradient pipeline stashes) and the kept activations, not the optimizer's state.

The modules: ``network`` (the layers and their costs; VGG-11's one definition, torch only),
``machine`` (the processors and the interconnect, calibration files), ``schedule`` (the pipelines'
task graphs and the list scheduler), ``schemes`` (every scheme, by name in ``SCHEMES``), ``report``
(the table, the figure, the files) and ``cli`` (the command). Importing the package imports none of
them, so that the benchmarks can take VGG-11 from ``network`` without pandas or matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m analysis.schemes``: see ``analysis.schemes.cli``."""
    from analysis.schemes.cli import main as run

    return run(argv)
