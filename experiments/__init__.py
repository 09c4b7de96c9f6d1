"""Training loop, phase timing, benchmarks and result records; uses bppsa_core and datasets."""
