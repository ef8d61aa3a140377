#!/usr/bin/env bash
# The GPU lane, in one call on a lent GPU machine (issue 35): torch 2.11+cu130 on Python 3.12 there, no pyzmq,
# nothing to download. Here, once per session: `bash benchmarks/device/fetch_wheels.sh` (pyzmq for Python 3.12
# into .whl/, ignored; keep one pyzmq wheel there), then the device tool's run: command
# "bash benchmarks/device/gpu_lane.sh", carry [".whl"], timeout_s 560.
# Writes under $OUT: env.txt (device, torch, CUDA, NCCL, cores), gpu_lane.txt (pytest -m gpu, every test's
# result), gpu_step.md/.json (loom's one-process step vs the plain loop), unit_lane.txt (the unit lane on this
# torch, GPU hidden: the CPU suite on torch 2.11). Each part has its own time bound, so one hang cannot take the
# others' results with it. GPU_LANE_PARTS (default "lane step unit") names the parts to run, in that order.
set -uo pipefail
PARTS=" ${GPU_LANE_PARTS:-lane step unit} "
OUT=${OUT:-/tmp/gpu-lane}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "carry .whl (pyzmq for Python 3.12): see this script's header"; exit 1; }
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
{
    nvidia-smi -L
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
    echo "cores: $(nproc --all)"; python3 --version; date -u
} > "$OUT/env.txt" 2>&1
if [[ $PARTS == *" lane "* ]]; then
    timeout 300 python3 -m pytest -p no:cacheprovider -m gpu -v -rA --timeout 280 tests/test_gpu.py > "$OUT/gpu_lane.txt" 2>&1
    echo "gpu lane exit $? at $(date -u +%T)" >> "$OUT/env.txt"
fi
if [[ $PARTS == *" step "* ]]; then
    timeout 120 python3 -m loom_bench.gpu_step --out "$OUT" --reps 5 --steps 100 > "$OUT/gpu_step.log" 2>&1
    echo "gpu_step exit $? at $(date -u +%T)" >> "$OUT/env.txt"
fi
if [[ $PARTS == *" unit "* ]]; then
    CUDA_VISIBLE_DEVICES= timeout 150 python3 -m pytest -p no:cacheprovider -m unit -q -n 14 --timeout 100 > "$OUT/unit_lane.txt" 2>&1
    echo "unit lane exit $? at $(date -u +%T)" >> "$OUT/env.txt"
fi
tail -n 25 "$OUT"/gpu_lane.txt "$OUT"/unit_lane.txt "$OUT"/gpu_step.log 2>/dev/null; cat "$OUT/gpu_step.md" "$OUT/env.txt" 2>/dev/null
