#!/usr/bin/env bash
# On the GPU machine: the block-scaled formats' gpu-marked tests (phase `tests`, in parallel
# groups), the kernel benchmarks (phase `kernels`: fused producers, casts),
# the module benchmark (phase `modules`) and a short training comparison (phase `train`); all
# by default; a short table last. Logs under $OUT (default ./out).
#   bash benchmarks/block_session.sh [tests] [kernels] [modules] [train]
set -uo pipefail
# shellcheck source=benchmarks/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
PHASES=${*:-tests kernels modules train}
TEST_LIMIT=${TEST_LIMIT:-300}
STEPS=${STEPS:-100}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader >"$OUT/device.txt"
GROUPS_OF_TESTS=(
  "tests/test_activation_block_gpu.py tests/test_kernels_gemm_epilogue.py"
  "tests/test_nvfp4_gpu.py tests/test_mxfp8_gpu.py tests/test_mx_native_gpu.py"
  "tests/test_block_modules_gpu.py tests/test_grouped_gemm_block_gpu.py tests/test_block_tp.py"
  "tests/test_block_tensor.py tests/test_gemm.py tests/test_block_master_weights.py"
  "tests/test_block_cast_gpu.py -k grouped"
  "tests/test_group_scales.py tests/test_host_splits_gpu.py"
)
if [[ $PHASES == *tests* ]]; then
  run_test_groups gpu_tests "$TEST_LIMIT" "${GROUPS_OF_TESTS[@]}"
fi
if [[ $PHASES == *modules* ]]; then
  timeout 240 python benchmarks/block_scaling.py --emulated --json "$OUT/block_scaling.json" \
    >"$OUT/block_scaling.log" 2>&1
fi
if [[ $PHASES == *kernels* ]]; then
  timeout 100 python benchmarks/fused_block.py >"$OUT/fused_block.log" 2>&1
  timeout 60 python benchmarks/block_quantize.py >"$OUT/block_quantize.log" 2>&1
  timeout 200 python benchmarks/nvfp4_cast.py >"$OUT/nvfp4_cast.log" 2>&1
fi
if [[ $PHASES == *train* ]]; then
  for recipe in bf16 block mxfp8 nvfp4; do
    timeout 90 python -m torchte.train --size large --recipe "$recipe" --steps "$STEPS" \
      --seed 0 --out "$OUT/train_$recipe" >"$OUT/train_$recipe.log" 2>&1
  done
fi
print_test_logs gpu_tests
for log in fused_block block_quantize nvfp4_cast block_scaling; do
  [[ -f $OUT/$log.log ]] && { echo "== $log"; tail -n 30 "$OUT/$log.log"; }
done
for recipe in bf16 block mxfp8 nvfp4; do
  [[ -f $OUT/train_$recipe.log ]] && { echo "== train $recipe"; grep -E "tokens/s|val" "$OUT/train_$recipe.log" | tail -n 2; }
done
