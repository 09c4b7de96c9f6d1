"""The suite's toolbox, what every part of it shares: one-line errors (``errors``), atomic writes
and output paths (``files``), and the command-line pieces (``cli``).

The datasets, the experiments, the benchmarks and the analysis all import these, so they sit in a
package of their own that imports nothing of the suite. (``bppsa_core`` is a library of its own
and keeps its own checks, ``bppsa_core.dispatch``.)
"""
