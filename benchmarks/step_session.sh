#!/usr/bin/env bash
# On the GPU machine: the whole training step's measurements (docs/benchmarks.md, "The whole
# training step"): the gpu-marked tests of the step's kernels and modules (phase `tests`, in
# parallel groups), the GPT / Llama block and TransformerLayer (`block`), host time per module
# (`host`), the FP8 producer kernels' tile sweeps (`sweep`) and the training example under
# every recipe and with FusedAdam (`train`, for each seed of SEEDS, default "0"); all by
# default; a short table last. Logs under $OUT (default ./out).
#   bash benchmarks/step_session.sh [tests] [block] [host] [sweep] [train]
set -uo pipefail
# shellcheck source=benchmarks/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}
PHASES=${*:-tests block host sweep train}
TEST_LIMIT=${TEST_LIMIT:-200}
STEPS=${STEPS:-300}
TRAIN_RUNS=${TRAIN_RUNS:-"bf16 delayed current block delayed:fused-adam"}
SEEDS=${SEEDS:-0}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader >"$OUT/device.txt"
GROUPS_OF_TESTS=(
  "tests/test_kernels_cast_dbias.py tests/test_kernels_activation_fp8.py tests/test_kernels_norm_fp8.py tests/test_kernels_scaling.py tests/test_kernels_attention_merge.py tests/test_cross_entropy.py tests/test_kernels_gemm_epilogue.py tests/test_kernels_cast_transpose_gpu.py"
  "tests/test_linear_gpu.py tests/test_layernorm_modules_gpu.py tests/test_layernorm_torch_path.py tests/test_launch_counts_gpu.py tests/test_delay_wgrad.py tests/test_func.py tests/test_ops.py tests/test_module_lifecycle.py"
  "tests/test_graphs_gpu.py tests/test_graphs_te_semantics_gpu.py tests/test_transformer_layer_features_gpu.py tests/test_train_cuda_graph_gpu.py tests/test_master_weights.py tests/test_optimizers.py tests/test_compile.py"
)
if [[ $PHASES == *tests* ]]; then
  run_test_groups step_tests "$TEST_LIMIT" "${GROUPS_OF_TESTS[@]}"
fi
if [[ $PHASES == *block* ]]; then
  timeout 150 python benchmarks/block.py --json "$OUT/block.json" >"$OUT/block.log" 2>&1
fi
if [[ $PHASES == *host* ]]; then
  timeout 100 python benchmarks/host_overhead.py --json "$OUT/host.json" >"$OUT/host.log" 2>&1
fi
if [[ $PHASES == *sweep* ]]; then
  (cd benchmarks && timeout 120 python activation.py --fp8-sweep && timeout 90 python norm.py \
    --fp8-sweep && timeout 60 python cast_dbias.py) >"$OUT/sweep.log" 2>&1
fi
if [[ $PHASES == *train* ]]; then
  for seed in $SEEDS; do
    for run in $TRAIN_RUNS; do
      recipe=${run%%:*}
      args=(--recipe "$recipe")
      case $run in
        *:fused-adam) args+=(--optimizer fused-adam) ;;
        *:master-bf16) args+=(--optimizer fused-adam --master-weights --adam-moments bf16) ;;
      esac
      name=train_${run/:/_}$([[ $seed == 0 ]] || echo "_seed$seed")
      timeout $((60 + STEPS / 3)) python -m torchte.train --size large --steps "$STEPS" \
        --seed "$seed" "${args[@]}" --out "$OUT/$name" >"$OUT/$name.log" 2>&1
      echo "exit: $?" >>"$OUT/$name.log"
    done
  done
fi

{
  echo "== $(cat "$OUT/device.txt")"
  print_test_logs step_tests
  [[ -f $OUT/block.log ]] && tail -14 "$OUT/block.log"
  [[ -f $OUT/host.log ]] && grep -E "^(config|Linear|LayerNorm|Grouped)" "$OUT/host.log"
  for log in "$OUT"/train_*.log; do
    [[ -f $log ]] && { echo "== $log"; grep -E "^(recipe|bf16|delayed|current|block) |^exit" "$log" | tail -3; }
  done
} | tee "$OUT/summary.txt"
