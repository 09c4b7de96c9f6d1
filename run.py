"""Main entry point of the suite.

Until the Hydra training app lands, the main job is the backward benchmark on the paper's vanilla RNN
(B = 16, H = 20): PyTorch's BPTT backward against BPPSA's, T = 100 and 1000, on the CPU. Arguments
are those of ``python -m experiments.bench_backward``.
"""

from __future__ import annotations

import sys

from experiments import bench_backward

DEFAULTS = ["--model", "rnn", "--T", "100", "1000", "--B", "16", "--H", "20", "--repeats", "5"]

if __name__ == "__main__":
    raise SystemExit(bench_backward.main(sys.argv[1:] or DEFAULTS))
