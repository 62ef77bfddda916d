#!/usr/bin/env bash
# On the GPU machine: the block-scaled formats' gpu-marked tests (phase `tests`), their
# benchmark (phase `bench`), or both; a short table last. Logs under $OUT (default ./out).
#   bash benchmarks/block_session.sh [tests|bench]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
PHASE=${1:-all}
mkdir -p "$OUT"
TESTS="tests/test_block_cast_gpu.py tests/test_mxfp8_gpu.py tests/test_nvfp4_gpu.py
  tests/test_grouped_gemm_block_gpu.py tests/test_block_modules_gpu.py tests/test_block_tensor.py
  tests/test_gemm.py"
if [[ $PHASE != bench ]]; then
  # shellcheck disable=SC2086
  python -m pytest -q -m gpu -p no:cacheprovider -x $TESTS >"$OUT/block_gpu.log" 2>&1
  echo "pytest exit: $?" >>"$OUT/block_gpu.log"
fi
if [[ $PHASE != tests ]]; then
  python benchmarks/block_scaling.py --emulated --json "$OUT/block_scaling.json" \
    >"$OUT/block_scaling.log" 2>&1
  cat "$OUT/block_scaling.log"
fi
if [[ $PHASE != bench ]]; then
  grep -E "^(FAILED|ERROR)|passed|failed|pytest exit|Error" "$OUT/block_gpu.log" | tail -30
fi
