"""BPPSA: back-propagation through recurrent layers as a parallel scan.

``bppsa_core.nn``: drop-in ``RNN`` / ``GRU`` / ``LSTM`` modules with a scan-based backward (re-exported here).
``bppsa_core.layer``: one layer in one direction: PyTorch's forward, the BPPSA backward and tangent;
``release_tapes`` (re-exported here) hands back the memory kept for CPU GRU and LSTM tapes.
``bppsa_core.ops``: a layer call as ``torch.library`` operators, differentiable (``autograd.Function``).
``bppsa_core.scan``: the scans (sequential reference twin, Blelloch, chunked; on a GPU Triton kernels
(``bppsa_core.triton``) and a CUDA-graph capture).
``bppsa_core.chain``: dense and factored chains of Jacobian elements, as the scans consume them.
``bppsa_core.jacobians``: per-step Jacobians of RNN, GRU and LSTM cells and the gradients that follow.
``bppsa_core.distributed``: one sequence split in time over the ranks of a ``torch.distributed`` group.

A library: it imports nothing beyond torch, and logs instead of printing.
"""

from bppsa_core.layer import release_tapes
from bppsa_core.nn import GRU, LSTM, RNN

__all__ = ["GRU", "LSTM", "RNN", "release_tapes"]
