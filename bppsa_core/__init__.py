"""BPPSA: back-propagation through recurrent layers as a parallel scan.

``bppsa_core.nn``: drop-in ``RNN`` / ``GRU`` modules with a scan-based backward.
``bppsa_core.scan``: the scans (sequential reference, Blelloch, chunked).
``bppsa_core.jacobians``: folded per-step Jacobians and the gradients that follow the scan.

A library: it imports nothing beyond torch and logs instead of printing.
"""

from bppsa_core.nn import GRU, RNN
from bppsa_core.scan import scan

__all__ = ["GRU", "RNN", "scan"]
