#!/usr/bin/env bash
# On a machine with 2 GPUs (NCCL): the whole 2-GPU run in one command, a short table last
# (benchmarks/multi_gpu_summary.py). Results and logs go under $OUT (default ./out).
#   bash benchmarks/multi_gpu_session.sh
# 1. the gpu-marked distributed tests at world size 2 and the NCCL ones of one rank;
# 2. benchmarks/tensor_parallel.py over 2 ranks (LayerNormMLP TP=2 + SP, bf16 and FP8; the
#    te.Linear pair with te's collectives and with symmetric memory; each against its one-GPU
#    baseline of 1/P work, measured in the same run);
# 3. benchmarks/fsdp.py over 2 ranks, bf16 and FP8 with and without the FP8 all-gather (each
#    row against one GPU running one rank's share unsharded, in the same run);
# 4. the training example for TRAIN_STEPS steps on one GPU (twice: the run-to-run spread),
#    with --fsdp and with --tp 2 --sequence-parallel over 2 GPUs.
# Budget (2 H100s, from the one-GPU figures in docs/benchmarks.md): tests ~2 min, benchmarks
# ~3 min, 4 training runs of ~45 s. Each phase has a time limit, cut further so that the whole
# stays within TOTAL seconds and the table is always printed.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
OUT=${OUT:-out}
TRAIN_SIZE=${TRAIN_SIZE:-large}       # torchte.train --size (large: 355M, 16,384 tokens a step)
TRAIN_STEPS=${TRAIN_STEPS:-300}       # steps of each training run
TRAIN_RECIPE=${TRAIN_RECIPE:-delayed} # bf16, delayed or current
FSDP_SIZE=${FSDP_SIZE:-large}         # benchmarks/fsdp.py --size
FSDP_BATCH=${FSDP_BATCH:-16}          # benchmarks/fsdp.py --batch (sequences per rank)
TOTAL=${TOTAL:-560}                   # seconds for everything (the machine's call limit: 600)
TESTS_LIMIT=${TESTS_LIMIT:-180}       # seconds per phase before it is stopped
BENCH_LIMIT=${BENCH_LIMIT:-150}
TRAIN_LIMIT=${TRAIN_LIMIT:-75}
TESTS=(tests/test_distributed_gpu2.py tests/test_tensor_parallel_gpu.py tests/test_fsdp_gpu.py)
mkdir -p "$OUT"
START=$SECONDS

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  date -u +%Y-%m-%dT%H:%MZ
} >"$OUT/device.txt" 2>&1

# The seconds a phase may take: its limit, or what is left of TOTAL (less 10 s for the table).
limit() {
  local left=$((TOTAL - (SECONDS - START) - 10))
  ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"
}

timeout "$(limit "$TESTS_LIMIT")" python -m pytest -q -m gpu -p no:cacheprovider "${TESTS[@]}" \
  >"$OUT/pytest_gpu2.log" 2>&1
echo "pytest exit: $?" >>"$OUT/pytest_gpu2.log"

run2() { timeout "$(limit "$1")" torchrun --standalone --nproc-per-node 2 "${@:2}"; }
run2 "$BENCH_LIMIT" benchmarks/tensor_parallel.py --json "$OUT/tp2.json" >"$OUT/tp2.log" 2>&1
run2 "$BENCH_LIMIT" benchmarks/fsdp.py --fp8-all-gather --size "$FSDP_SIZE" --batch "$FSDP_BATCH" \
  --json "$OUT/fsdp2.json" >"$OUT/fsdp2.log" 2>&1

TRAIN=(-m torchte.train --size "$TRAIN_SIZE" --steps "$TRAIN_STEPS" --recipe "$TRAIN_RECIPE")
run1() { timeout "$(limit "$TRAIN_LIMIT")" python "${TRAIN[@]}" --out "$OUT/train_$1"; }
run1 1gpu_a >"$OUT/train_1gpu_a.log" 2>&1
run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --fsdp --out "$OUT/train_fsdp2" >"$OUT/train_fsdp2.log" 2>&1
run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --tp 2 --sequence-parallel --out "$OUT/train_tp2" \
  >"$OUT/train_tp2.log" 2>&1
run1 1gpu_b >"$OUT/train_1gpu_b.log" 2>&1  # last: the spread is the least needed

echo "== device"
head -n 3 "$OUT/device.txt"
echo "== gpu distributed tests"
grep -E "^(FAILED|ERROR)|passed|failed|pytest exit" "$OUT/pytest_gpu2.log" | tail -15
for log in tp2 fsdp2; do
  echo "== $log"
  tail -n 14 "$OUT/$log.log"
done
echo "== wall time: $((SECONDS - START)) s"
python benchmarks/multi_gpu_summary.py "$OUT"
