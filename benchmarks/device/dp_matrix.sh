#!/usr/bin/env bash
# Issue 38's many-core matrix in one call with a hard time bound: loom DataParallel (defaults, observe=False) vs
# raw DDP vs one process at 2, 4, 8 and 16 workers for the 1.9 M, 25 M and 100 M MLPs, then `loom bench
# allreduce --quick` at 4, 8 and 16 processes. CPU only (CUDA_VISIBLE_DEVICES= hides the GPU), 1 thread per
# process, gloo on loopback.
#
# On the device machine (16 cores; Python 3.12 and torch 2.11 in its image, no network), from the repo root:
#   here, once:   bash benchmarks/device/fetch_wheels.sh          # pyzmq -> .whl/ (loom imports it)
#   there:        run(command="bash benchmarks/device/dp_matrix.sh", carry=[".whl"], timeout_s=560)
# Dry run here (one width, one model, one repetition; end to end, a minute or two):
#   OUT=/tmp/dpm DP_MATRIX_DRY=1 PYTHON=/work/main/.venv/bin/python bash benchmarks/device/dp_matrix.sh
#
# Bounds: everything, installs included, ends within DP_MATRIX_BUDGET_S (default 450 s) of the start. Cells run in
# priority order (1.9 M at every width, then 25 M, then the all-reduce widths, then 100 M from 16 workers down);
# each gets `--max-seconds` (no repetition begins that would end past its share) and a hard `timeout`; a cell
# that no longer fits is skipped and listed. What comes back under $OUT (at most 8 files, none nested):
#   dp_matrix.md     the table of every cell that ran, the skipped ones, the commands  (loom_bench.dp_matrix)
#   dp_matrix.log    everything printed, with the host's description and the load before each cell
#   reports.tar.gz   every report: dp_vs_ddp_<model>_n<N>.{md,json}, allreduce_n<N>/allreduce.{md,json,png}
#   allreduce_n<N>.md  each all-reduce width's report, readable without unpacking
set -u -o pipefail
START=$(date +%s)
BUDGET=${DP_MATRIX_BUDGET_S:-450}
PY=${PYTHON:-python3}
OUT=${OUT:?set OUT to the folder the reports go to}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d /tmp/dp_matrix.XXXXXX)
LOG=$OUT/dp_matrix.log
mkdir -p "$OUT" "$WORK/reports"
: >"$WORK/skipped.txt"
exec > >(tee -a "$LOG") 2>&1

left() { echo $((BUDGET - ($(date +%s) - START))); }

# -- the environment: no GPU, one thread per process, a calibration cache of this run's own -----------------------
export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
export LOOM_CACHE_DIR=$WORK/cache
if ! "$PY" -c "import zmq" 2>/dev/null; then
    ls "$ROOT"/.whl/pyzmq-*.whl >/dev/null 2>&1 || { echo "no pyzmq and no .whl/pyzmq-*.whl: run fetch_wheels.sh here, carry .whl"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$ROOT"/.whl/pyzmq-*.whl || exit 2
    export PYTHONPATH=$WORK/site
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}   # loom and loom_bench from the carried checkout
cd "$ROOT" || exit 2
"$PY" - <<'EOF' || exit 2
import os, platform, torch, zmq, loom
print(f"host: {platform.machine()}, {os.cpu_count()} cores (affinity {len(os.sched_getaffinity(0))}), "
      f"Python {platform.python_version()}, torch {torch.__version__}, pyzmq {zmq.__version__}, "
      f"cuda visible: {torch.cuda.is_available()}, loom from {loom.__file__}")
EOF
echo "git: $(git -C "$ROOT" log -1 --format='%h %cd' 2>/dev/null || echo 'no git')"
echo "load: $(cat /proc/loadavg); budget ${BUDGET} s; work in $WORK"

# -- the cells ----------------------------------------------------------------------------------------------------
dp_cell() {  # dp_cell MODEL WIDTH REPS STEPS WARMUP CAP_S [--no-one-process]
    local model=$1 n=$2 reps=$3 steps=$4 warmup=$5 cap=$6 extra=${7:-}
    local budget_left; budget_left=$(left)
    local share=$((cap < budget_left - 15 ? cap : budget_left - 15))
    if [ "$share" -lt $((cap / 2)) ] || [ "$share" -lt 25 ]; then
        echo "$model at $n workers: skipped, ${budget_left} s left of the budget (cap ${cap} s)" | tee -a "$WORK/skipped.txt"
        return
    fi
    # the workers' own bound leaves ~15 s of the share to starting the job and ending it
    echo "== dp $model n=$n: reps $reps x $steps steps, max ${share} s; load $(cut -d' ' -f1-3 /proc/loadavg)"
    timeout -k 10 $((share + 30)) "$PY" -m loom_bench.data_parallel -n "$n" --model "$model" --repetitions "$reps" \
        --steps "$steps" --warmup "$warmup" --max-seconds $((share - 15)) $extra --out "$WORK/reports" \
        >"$WORK/cell.log" 2>&1
    local code=$?
    grep -v '^\[rank[1-9]' "$WORK/cell.log" | tail -n 20
    if [ $code -ne 0 ]; then
        echo "$model at $n workers: exit $code$(why $code)" | tee -a "$WORK/skipped.txt"
        tail -n 15 "$WORK/cell.log"
        stray
    fi
}

allreduce_cell() {  # allreduce_cell WIDTH CAP_S
    local n=$1 cap=$2 budget_left; budget_left=$(left)
    if [ "$budget_left" -lt $((cap + 15)) ]; then
        echo "allreduce at $n processes: skipped, ${budget_left} s left (cap ${cap} s)" | tee -a "$WORK/skipped.txt"
        return
    fi
    echo "== allreduce n=$n --quick, at most ${cap} s; load $(cut -d' ' -f1-3 /proc/loadavg)"
    timeout -k 10 "$cap" "$PY" -m loom_bench.allreduce --quick --world-sizes "$n" --out "$WORK/reports/allreduce_n$n" \
        >"$WORK/cell.log" 2>&1
    local code=$?
    grep -v '^\[rank[1-9]' "$WORK/cell.log" | tail -n 12
    if [ $code -ne 0 ]; then
        echo "allreduce at $n processes: exit $code$(why $code)" | tee -a "$WORK/skipped.txt"
        stray
    else
        cp "$WORK/reports/allreduce_n$n/allreduce.md" "$OUT/allreduce_n$n.md"
    fi
}

why() { case $1 in 124 | 137) echo " (stopped by the hard timeout)" ;; esac; }

stray() {  # workers a killed cell left behind (they would skew the next cell): only this run's, by their ids
    local pid ended=""
    for pid in $(pgrep -f "loom_bench\.(dp_worker|allreduce_worker)" || true); do
        if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "LOOM_CACHE_DIR=$WORK/cache"; then
            kill -9 "$pid" 2>/dev/null && ended="$ended $pid"
        fi
    done
    [ -n "$ended" ] && echo "ended stray workers:$ended"
}

if [ -n "${DP_MATRIX_DRY:-}" ]; then
    dp_cell 1.9m 2 1 3 1 120
    allreduce_cell 2 120
else
    # caps (s) sized from 2-core step times scaled to a quiet 16-core host, for >= 5 repetitions each; a
    # cell's report says how many it got. Re-size them from this run's log before the next.
    for n in 2 4 8 16; do dp_cell 1.9m "$n" 7 20 3 25; done
    dp_cell 25m 2 5 3 1 45
    dp_cell 25m 4 5 3 1 40
    for n in 8 16; do dp_cell 25m "$n" 5 4 1 35; done
    for n in 4 8 16; do allreduce_cell "$n" 30; done
    for n in 16 8 4 2; do dp_cell 100m "$n" 5 2 1 45 --no-one-process; done
fi

# -- what comes back ------------------------------------------------------------------------------------------------
"$PY" -m loom_bench.dp_matrix "$WORK/reports" --skipped "$WORK/skipped.txt" >"$OUT/dp_matrix.md"
tar -czf "$OUT/reports.tar.gz" -C "$WORK/reports" .
echo "done in $(($(date +%s) - START)) s of ${BUDGET} s; load $(cat /proc/loadavg)"
cat "$OUT/dp_matrix.md"
