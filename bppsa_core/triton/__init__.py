"""Triton kernels of the chunked scan over a factored chain, three launches however long the chain;
each entry point's plain-PyTorch reference is beside it (``*_ref``, built on
``bppsa_core.scan.chunked_scan``). Needs the optional ``triton`` package: the rest of ``bppsa_core``
imports this package only where the strategy "triton" runs.

1. reduce: one program per (chunk 1..P-2, sample) multiplies its chunk's C elements into one
   aggregate (and offset) in registers, ``tl.dot`` per weight term and step;
2. spine: one program per sample walks the remainder chunk from x_n, then scans the chunk
   aggregates sequentially, writing every chunk's entry vector;
3. expand: one program per (chunk 0..P-2, sample) walks its chunk from its entry vector.

Modules, one a job:

* ``chunk_scan``: a tanh/relu RNN's or a GRU's chain: ``factored_scan`` (a stored ``FactoredChain``,
  or its transpose), and the fused layer backwards ``rnn_layer_backward`` and ``gru_layer_backward``,
  which build the Jacobians in the kernels;
* ``lstm``: an LSTM's chain over (h, c): ``lstm_scan``, and the fused layer backward
  ``lstm_layer_backward``, which forms the elements in the kernels from the gates (``lstm_gates``,
  activated in one launch) and the cell states (``lstm_cells``, one more);
* ``newton``: a Newton iteration of a layer's forward (``bppsa_core.newton``): a tanh/relu RNN's or
  GRU's cell, residual and Jacobian factors in one pointwise kernel, written as the transposed
  chain's scan reads them, and the projected update and stopping rule on the device (``FusedIteration``);
* ``diagonal``: a diagonal chain's recurrence x_t = a_t x_{t-1} + b_t in three launches, a quasi-Newton
  iteration's correction (``diagonal_recurrence``);
* ``launch``: each kernel's compile settings (``Launch``), the run-time loop bounds and the three
  launches. ``benchmarks.kernels`` lists every configuration the modules can launch and compiles it
  for sm_80 and sm_90 without a GPU.

The weights stay in registers, H padded to a power of two of at least 16 (``tl.dot``'s minimum); the
chunk aggregates go through memory padded likewise. ``tl.dot`` runs with ``input_precision="ieee"``
(full fp32: TF32's ~1e-3 error would exceed the gradient tolerances) unless PyTorch's float32 matmul
precision is lowered (``torch.set_float32_matmul_precision("high")``): then one-term chains' and the
LSTM's take three TF32 products, "tf32x3" (``launch.dot_precision``).
Elements shared by the batch are read with a batch stride of 0, never copied; offsets into memory
are 64-bit, so tensors of more than 2^31 elements are indexed correctly. Every kernel is checked
against its reference on the CPU with ``TRITON_INTERPRET=1``.
"""

from bppsa_core.triton.chunk_scan import (
    GRU,
    MODE_NAMES,
    RELU,
    SCALES,
    SCALES_T,
    TANH,
    factored_scan,
    factored_scan_ref,
    gru_layer_backward,
    gru_layer_backward_ref,
    launch_config,
    rnn_layer_backward,
    rnn_layer_backward_ref,
)
from bppsa_core.triton.launch import Launch, padded
from bppsa_core.triton.lstm import (
    lstm_cells,
    lstm_cells_ref,
    lstm_gates,
    lstm_gates_ref,
    lstm_launch_config,
    lstm_layer_backward,
    lstm_layer_backward_ref,
    lstm_scan,
    lstm_scan_ref,
)

__all__ = [
    "GRU",
    "MODE_NAMES",
    "RELU",
    "SCALES",
    "SCALES_T",
    "TANH",
    "Launch",
    "factored_scan",
    "factored_scan_ref",
    "gru_layer_backward",
    "gru_layer_backward_ref",
    "launch_config",
    "lstm_cells",
    "lstm_cells_ref",
    "lstm_gates",
    "lstm_gates_ref",
    "lstm_launch_config",
    "lstm_layer_backward",
    "lstm_layer_backward_ref",
    "lstm_scan",
    "lstm_scan_ref",
    "padded",
    "rnn_layer_backward",
    "rnn_layer_backward_ref",
]
