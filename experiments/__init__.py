"""The experiments: ``run.py``'s Hydra job (configuration, training loop, phase timing, result
records, loggers, sweep merge) and, in ``experiments.bench``, the benchmark tools."""
