#!/usr/bin/env bash
# On the GPU machine: every gpu-marked test (phase `tests`), the benchmarks (phase `bench`), or
# both (no argument); a short table last. Results and logs go under $OUT (default ./out).
#   bash benchmarks/gpu_session.sh [tests|bench]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
PHASE=${1:-all}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%MZ
} | tee "$OUT/device.txt"

if [[ $PHASE != bench ]]; then
  python -m pytest -q -m gpu -p no:cacheprovider -s tests >"$OUT/pytest_gpu.log" 2>&1
  echo "pytest exit: $?" >>"$OUT/pytest_gpu.log"
fi
if [[ $PHASE != tests ]]; then
  for bench in quantize linear host_profile norm activation layernorm_mlp grouped_linear grouped_mlp offload host_overhead; do
    python "benchmarks/$bench.py" --json "$OUT/$bench.json" >"$OUT/$bench.log" 2>&1
  done
  python benchmarks/train_profile.py medium large >"$OUT/train_profile.log" 2>&1
fi

if [[ $PHASE != bench ]]; then
  echo "== gpu tests"
  grep -E "^(FAILED|ERROR)|passed|failed|launches|pytest exit" "$OUT/pytest_gpu.log" | tail -40
fi
if [[ $PHASE != tests ]]; then
  for bench in quantize linear host_profile norm activation layernorm_mlp grouped_linear grouped_mlp offload host_overhead train_profile; do
    echo "== $bench"
    tail -n 14 "$OUT/$bench.log"
  done
fi
