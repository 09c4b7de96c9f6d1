#!/usr/bin/env bash
# Every figure and table of docs/REPRODUCTION.md: the paper's experiments shrunk by overrides a 2-core
# CPU finishes in well under an hour, their merged result tables copied here, then everything drawn
# from those tables (equal tables give byte-identical figures).
#
#   bash docs/reproduction/run.sh                  # run, copy the tables, draw (CPU)
#   bash docs/reproduction/run.sh --draw           # only draw, from the committed tables
#   bash docs/reproduction/run.sh --device cuda    # the same runs on a GPU, into docs/reproduction/cuda/
#                                                  # (the ranks sweep: one GPU per rank; fig. 10 and
#                                                  # Table 1 are the CPU's)
#   bash docs/reproduction/run.sh --only rnn_seq_len,rnn_curve   # those sweeps alone (no fig. 10 or
#                                                  # Table 1), then everything drawn from the tables there
#   bash docs/reproduction/run.sh --device cuda --capture   # every step captured in CUDA graphs
#                                                  # (trainer.capture=true), into docs/reproduction/cuda-captured/
#                                                  # (no ranks sweep: a captured step runs on one rank)
#   bash docs/reproduction/run.sh --flush          # every step with subnormals flushed to zero on the CPU
#                                                  # (hardware.flush_denormals=true: BPTT's autograd too,
#                                                  # the fair baseline where subnormals are slow), into
#                                                  # docs/reproduction/flushed/ (no fig. 10 or Table 1)
#
# Runs go to results/reproduction[-<device>]/<table>/; a sweep re-run skips its completed jobs, so
# an interrupted script continues where it stopped (delete that folder to measure anew).
set -euo pipefail
cd "$(dirname "$0")/../.."
# the interpreter: $PYTHON, else the README's .venv, else python on the PATH
py=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}
device=cpu
draw_only=0
only=""
capture=0
flush=0
# the sweeps' tables, in the order the report lists them
TABLES=(rnn_batch rnn_curve rnn_seq_len workers ranks gru_curves gru_irmas)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --draw) draw_only=1 ;;
        --device) device="${2:-}"; shift ;;
        --only) only="${2:-}"; shift ;;
        --capture) capture=1 ;;
        --flush) flush=1 ;;
        *) echo "run.sh: unknown argument $1; accepted: --draw, --device cpu|cuda, --only TABLE[,TABLE...], --capture, --flush" >&2
           exit 2 ;;
    esac
    shift
done
if [[ $capture == 1 && "$device" == cpu ]]; then
    echo "run.sh: --capture needs --device cuda (CUDA graphs); accepted: --device cuda --capture, or no --capture" >&2
    exit 2
fi
if [[ $flush == 1 && "$device" != cpu ]]; then
    echo "run.sh: --flush sets a CPU's floating-point mode, and a GPU takes subnormals at full speed; accepted: --flush with --device cpu (the default)" >&2
    exit 2
fi
for table in ${only//,/ }; do
    if [[ " ${TABLES[*]} " != *" $table "* ]]; then
        echo "run.sh: --only $only: unknown table $table; accepted: ${TABLES[*]}" >&2
        exit 2
    fi
    if [[ $capture == 1 && $table == ranks ]]; then
        echo "run.sh: --only $only: the ranks sweep splits a step over processes, which --capture does not; accepted with --capture: every other table" >&2
        exit 2
    fi
done
wanted() {  # wanted <table>: whether this run sweeps it (a captured step runs on one rank)
    [[ ($capture == 0 || $1 != ranks) && (-z $only || ",$only," == *",$1,"*) ]]
}
here=docs/reproduction
tables=$here
work=results/reproduction
if [[ "$device" != cpu ]]; then
    suffix=$device$([[ $capture == 1 ]] && echo -captured || true)
    tables=$here/$suffix
    work=results/reproduction-$suffix
elif [[ $flush == 1 ]]; then
    tables=$here/flushed
    work=results/reproduction-flushed
fi
mode=()  # the overrides of --capture and --flush
if [[ $capture == 1 ]]; then mode=(trainer.capture=true); fi
if [[ $flush == 1 ]]; then mode=(hardware.flush_denormals=true); fi
mkdir -p "$tables"

swept=()
sweep() {  # sweep <table> <preset> <overrides...>: run the preset shrunk, if it is wanted
    local table=$1 preset=$2; shift 2
    wanted "$table" || return 0
    mkdir -p "$work"
    echo "== $table (log: $work/$table.log)"
    if ! "$py" run.py -m "experiment=$preset" "$@" "${mode[@]}" logger=csv "hardware.device=$device" \
        "hydra.sweep.dir=$work/$table" > "$work/$table.log" 2>&1; then
        tail -n 5 "$work/$table.log" >&2
        echo "run.sh: $table did not complete; see $work/$table.log" >&2
        exit 1
    fi
    grep -E "^sweep " "$work/$table.log"
    swept+=("$table")
}

if [[ $draw_only == 0 ]]; then
    irmas=$work/irmas-synthetic
    if wanted gru_irmas || wanted gru_curves; then
        [[ -d $irmas ]] || "$py" -m datasets.synthetic_irmas --out "$irmas" --per-class 40
    fi
    gru=(dataset.root="$irmas" dataset.cache_dir="$work/irmas-cache" trainer.warmup_iters=2)
    # fig. 8 a, c, e: T = 10 ... 30,000 at B = 16
    sweep rnn_seq_len rnn_seq_len dataset.num_samples=400 trainer.epochs=3
    # fig. 8 b, d, f: B = 2 ... 256 at T = 1000
    sweep rnn_batch rnn_batch dataset.num_samples=1600 trainer.epochs=3 trainer.warmup_iters=2
    # fig. 7: loss against wall-clock, T = 1000, B = 16
    sweep rnn_curve rnn_curve dataset.num_samples=2000 trainer.epochs=20
    # worker scaling: threads 1 and 2 (the machine's cores)
    sweep workers workers dataset.num_samples=800 trainer.epochs=3
    # the paper's p devices: the sequence split over 1 and 2 processes, T = 100,000: on the CPU one
    # thread each; on GPUs one GPU each, all its SMs (2 ranks only where there are 2 GPUs)
    if [[ "$device" == cpu ]]; then
        split=(hardware.ranks=1,2 hardware.workers=1)
    else
        gpus=$("$py" -c 'import torch; print(min(2, torch.cuda.device_count()))')
        split=("hardware.ranks=$(seq -s, 1 "$gpus")" hardware.workers=null)
    fi
    sweep ranks workers "${split[@]}" dataset.seq_len=100000 \
        dataset.num_samples=100 trainer.epochs=3 trainer.warmup_iters=1
    # fig. 9: GRU breakdown, s / m / l x B = 16, 32, 64, on synthetic clips of IRMAS's shape
    sweep gru_irmas gru_irmas "${gru[@]}" trainer.epochs=3
    # fig. 13: GRU loss against wall-clock, s / m / l, B = 16
    sweep gru_curves gru_curves "${gru[@]}" trainer.epochs=15
    # the merged tables are copied only now: a table copied into the checkout earlier would mark
    # every later run's records as made from a modified tree (their `dirty` column)
    for table in "${swept[@]}"; do cp "$work/$table/records.csv" "$tables/$table.csv"; done
    if [[ "$device" == cpu && $flush == 0 && -z $only ]]; then
        # fig. 10: the pruned VGG-11 study at a quarter of the width; Table 1: CSR against autograd
        "$py" -m benchmarks.pruned_vgg --out "$work/pruned_vgg" --width 0.25 --steps 50 > /dev/null
        cp "$work/pruned_vgg/products.csv" "$here/fig10_products.csv"
        cp "$work/pruned_vgg/summary.csv" "$here/fig10_summary.csv"
        "$py" -m benchmarks.jacobian_table > "$here/table1.md"
    fi
fi

drawn=()
for table in "${TABLES[@]}"; do
    if [[ -f "$tables/$table.csv" ]]; then drawn+=("$tables/$table.csv"); fi
done
if [[ ${#drawn[@]} == 0 ]]; then
    echo "run.sh: no table in $tables to draw from; run the sweeps first (without --draw)" >&2
    exit 1
fi
"$py" -m analysis.report "${drawn[@]}" --out "$tables" > /dev/null
if [[ "$device" == cpu && $flush == 0 ]]; then
    "$py" -m analysis.fig10 "$here/fig10_products.csv" --out "$here" > /dev/null
fi
echo "drawn into $tables from ${drawn[*]##*/}"
# the speedup table of report.md
sed -n '/^## Speedups/,/^## Figures/p' "$tables/report.md" | sed '$d'
