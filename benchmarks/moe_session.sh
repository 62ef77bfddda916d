#!/usr/bin/env bash
# On the GPU machine: the mixture-of-experts GPU tests (phase `tests`, in parallel groups), the
# grouped GEMM, grouped MLP, routing / permutation and MoE layer host-time benchmarks (phase
# `kernels`) and the training example with experts (phase `train`); all by default; a short
# table last. Logs under $OUT (default ./out).
#   bash benchmarks/moe_session.sh [tests] [kernels] [train]
set -uo pipefail
# shellcheck source=benchmarks/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
PHASES=${*:-tests kernels train}
TEST_LIMIT=${TEST_LIMIT:-240}
STEPS=${STEPS:-120}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader >"$OUT/device.txt"
GROUPS_OF_TESTS=(
  "tests/test_moe_layer_gpu.py tests/test_host_splits_gpu.py tests/test_train_cuda_graph_gpu.py tests/test_graphs_gpu.py"
  "tests/test_grouped_device_splits.py tests/test_grouped_linear_gpu.py tests/test_kernels_grouped_gemm.py tests/test_kernels_grouped_activation.py"
  "tests/test_moe_router.py tests/test_moe_router_packed.py"
  "tests/test_moe_permutation.py tests/test_moe_permutation_speed.py tests/test_ops_grouped.py tests/test_grouped_cast_gather.py tests/test_moe_fused_permute.py"
)
if [[ $PHASES == *tests* ]]; then
  run_test_groups moe_tests "$TEST_LIMIT" "${GROUPS_OF_TESTS[@]}"
fi
if [[ $PHASES == *kernels* ]]; then
  timeout 150 python benchmarks/grouped_fp8_gemm.py >"$OUT/grouped_fp8_gemm.log" 2>&1
  timeout 240 python benchmarks/grouped_mlp.py >"$OUT/grouped_mlp.log" 2>&1
  timeout 120 python benchmarks/moe_routing.py --json "$OUT/moe_routing.json" \
    >"$OUT/moe_routing.log" 2>&1
  timeout 120 python benchmarks/moe_layer_host.py --json "$OUT/moe_layer_host.json" \
    >"$OUT/moe_layer_host.log" 2>&1
fi
if [[ $PHASES == *train* ]]; then  # the example's defaults: blocks graphed (--cuda-graph auto)
  for size in medium large; do
    for recipe in bf16 delayed current; do
      timeout 150 python -m torchte.train --size "$size" --experts 8 --recipe "$recipe" \
        --steps "$STEPS" --seed 0 --out "$OUT/train_moe_${size}_$recipe" \
        >"$OUT/train_moe_${size}_$recipe.log" 2>&1
    done
  done
fi
print_test_logs moe_tests
for log in grouped_fp8_gemm:20 grouped_mlp:20 moe_routing:26 moe_layer_host:24; do
  [[ -f $OUT/${log%:*}.log ]] && { echo "== ${log%:*}"; tail -n "${log#*:}" "$OUT/${log%:*}.log"; }
done
for size in medium large; do
  for recipe in bf16 delayed current; do
    log=$OUT/train_moe_${size}_$recipe.log
    [[ -f $log ]] && { echo "== train --size $size --experts 8 $recipe"; grep -A2 "^recipe  *compute" "$log" | tail -1; }
  done
done
