"""The benchmark tools, a top-level room of their own: each a command (``python -m benchmarks.<tool>``),
and their helpers. ``gpu_check`` runs every GPU check and table in one report.

* ``backward``: BPPSA's backward against PyTorch's BPTT, the scan alone against its peers, and a
  training epoch; ``--suite paper`` runs the paper's shapes, ``--suite long`` long sequences.
* ``capture``: the backward against cuDNN's, eager and as CUDA-graph-captured training steps, and
  against a naive loop of cells, over T and H, with its peak memory.
* ``host``: a short layer's forward and step against ``torch.nn``'s: the host path.
* ``forward``: the Newton forwards (parallel in time) against the native sequential one.
* ``jacobian_table``: the paper's Table 1, CSR transposed Jacobians against autograd row by row.
* ``pruned_vgg``: the pruned VGG-11 study, the sparse scan's FLOPs (``analysis.fig10`` draws it).
* ``kernels``: the Triton kernels compiled for sm_80 / sm_90 without a GPU: registers, spills, shared
  memory and a static estimate of their loops.
* ``schemes``: sequential BP, DDP and GPipe iterations of VGG-11 on two processes, with the FLOP
  rate, α and β the cost model ``analysis.schemes`` takes.
* ``distributed``: a sequence split over gloo ranks (``bppsa_core.distributed``), distributed BPPSA
  against distributed BPTT.

``scan`` and ``floors`` are the pieces of the backward tool's tables; ``common`` holds what the tools
share (argument types, the device, Markdown tables, progress lines); ``memory`` reads a process's
resident-memory peak (the distributed benchmark's per-rank memory). The timing itself is
``experiments.timing``, the suite's one clock. Nothing here imports Hydra, W&B or librosa.
"""
