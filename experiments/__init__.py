"""The experiments: ``run.py``'s Hydra job (configuration, training loop, phase timing, result
records, loggers, sweep merge). The benchmark tools are the top-level package ``benchmarks``."""
