"""``python -m experiments.gpu_check``: the one GPU command under the name it has always had; the
command itself is ``benchmarks.gpu_check``."""

from benchmarks.common import run_tool
from benchmarks.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(run_tool("experiments.gpu_check", lambda: main(prog="python -m experiments.gpu_check")))
