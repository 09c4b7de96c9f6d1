"""``python -m experiments.gpu_check``: the one GPU command under the name it has always had; the
command itself is ``benchmarks.gpu_check``."""

from benchmarks.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m experiments.gpu_check"))
