#!/usr/bin/env bash
# The tables and figures of docs/SCHEMES.md, from the committed measurements: the model is
# deterministic, so the same tables give the same files byte for byte. Takes a few minutes.
#
#   bash docs/schemes/run.sh                   # redraw
#   bash docs/schemes/run.sh --measure         # measure this machine first (2 processes, ~8 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
# the interpreter: $PYTHON, else the README's .venv, else python on the PATH
python=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}
here=docs/schemes
if [[ "${1:-}" == "--measure" ]]; then
    "$python" -m benchmarks.schemes --out "$here/measured" --repeats 9
    "$python" -m benchmarks.distributed --ranks 1 2 --T 100000 --repeats 5 --rounds 3 --out "$here/distributed"
fi
# VGG-11 on an assumed interconnect: 1 TFLOP/s processors, 5 µs latency, 10 GB/s
"$python" -m analysis.schemes --model vgg11 --p 1 2 4 8 16 32 --alpha 5e-6 --beta 1e-10 \
    --out "$here/vgg11" > /dev/null
# the paper's RNN (T = 1000, H = 20, B = 16), each layer operation costing 2 µs as a kernel launch does
"$python" -m analysis.schemes --model rnn --T 1000 --p 1 2 4 8 16 32 64 --overhead 2e-6 \
    --out "$here/rnn" > /dev/null
# the paper's RNN at T = 100,000 split over 1 to 1024 devices: BPPSA (all-gather, tree) against
# distributed BPTT, each device costed as one rank of benchmarks.distributed measured (BPTT's fused
# forward, BPPSA's compiled forward, walk and fold, BPTT's cost per operation, 16 sample groups),
# beside the measured 1- and 2-rank iterations
"$python" -m analysis.schemes --model rnn --T 100000 --batch 16 \
    --p 1 2 3 4 6 8 16 32 64 128 256 512 1024 \
    --schemes sequential bptt-distributed bppsa-allgather bppsa-tree bppsa-chain \
    --calibration "$here/measured/calibration.json" "$here/distributed/calibration.json" \
    --measured "$here/distributed/measured.csv" --out "$here/distributed" > /dev/null
# the same beside 1 to 4 ranks measured on a 16-core machine, one core each, and costed as its ranks
# (four-ranks/: the measured.csv and calibration.json of `python -m benchmarks.gpu_check`'s ranks step)
"$python" -m analysis.schemes --model rnn --T 100000 --batch 16 \
    --p 1 2 3 4 6 8 16 32 64 128 256 512 1024 \
    --schemes sequential bptt-distributed bppsa-allgather bppsa-tree bppsa-chain \
    --calibration "$here/measured/calibration.json" "$here/four-ranks/calibration.json" \
    --measured "$here/four-ranks/measured.csv" --out "$here/four-ranks" > /dev/null
# VGG-11 on the measured FLOP rate, α and β (measured/calibration.json), beside the measured iterations
"$python" -m analysis.schemes --model vgg11 --batch 32 --p 1 2 4 8 --micro-batches 8 \
    --calibration "$here/measured/calibration.json" --measured "$here/measured/measured.csv" \
    --out "$here/measured" > /dev/null
ls "$here"/*/schemes.*
