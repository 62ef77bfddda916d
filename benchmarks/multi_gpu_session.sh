#!/usr/bin/env bash
# On a machine with 2 GPUs (NCCL): the 2-GPU run, all of it or the phases named, a short table
# last (benchmarks/multi_gpu_summary.py).
#   bash benchmarks/multi_gpu_session.sh [tests] [tp] [fsdp] [ep] [cp] [train]   # none: all
# 1. tests: the gpu-marked distributed tests at world size 2 and the NCCL ones of one rank;
# 2. tp: benchmarks/tensor_parallel.py over 2 ranks (LayerNormMLP TP=2 + SP, bf16 and FP8; the
#    te.Linear pair with te's collectives and with symmetric memory; each against its one-GPU
#    baseline of 1/P work, measured in the same run);
# 3. fsdp: benchmarks/fsdp.py over 2 ranks, bf16 (parameters gathered in bf16 and in fp32) and
#    FP8 with and without the FP8 all-gather (each row against one GPU running one rank's share
#    unsharded, in the same run), at each batch of FSDP_BATCH sequences per rank;
# 3b. ep: benchmarks/expert_parallel.py over 2 ranks (MoELayer EP=2, 8 experts top-2, 16K
#    tokens a rank; bf16, FP8 current and delayed; shared-expert overlap on and off; against
#    one GPU holding all experts on one rank's tokens, measured in the same run);
# 3c. cp: benchmarks/context_parallel.py over 2 ranks (te.DotProductAttention causal, 32K
#    tokens, 32 heads x 128, bf16, forward + backward; p2p, a2a and all_gather against one GPU
#    doing the whole attention, measured in the same run; efficiency = (1-GPU time / 2) / CP);
# 4. train: the training example for TRAIN_STEPS steps, the runs of TRAIN_RUNS: on one GPU
#    (1gpu_a, 1gpu_b, ...: their spread is the run-to-run spread), with --fsdp (fsdp2; fsdp2k:
#    with --fsdp-keep-gathered too) and with
#    --tp 2 --sequence-parallel (tp2) over 2 GPUs; ep2 (asked for in TRAIN_RUNS): an MoE model
#    with --experts 8 --ep 2 over 2 GPUs (ep2f: with --fsdp too; ep2t: with --tp 2
#    --sequence-parallel; 1moe_*: the same model on one GPU); cp2 (asked for in TRAIN_RUNS): --cp 2 over 2 GPUs
#    (each rank its load-balanced share of every sequence).
# Logs and results go to WORK (default ./out/multi_gpu); the small ones (logs, JSON,
# losses.csv) are packed into $OUT/multi_gpu.tgz with the table in $OUT/summary.txt, so that
# they come back from a machine that returns only a few files. Each phase has a time limit,
# cut further so that the whole stays within TOTAL seconds and the table is always printed.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# NVLink multicast stays off (NCCL, torch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
WORK=${WORK:-out/multi_gpu}
TRAIN_SIZE=${TRAIN_SIZE:-large}       # torchte.train --size (large: 355M, 16,384 tokens a step)
TRAIN_STEPS=${TRAIN_STEPS:-300}       # steps of each training run
TRAIN_RECIPE=${TRAIN_RECIPE:-delayed} # bf16, delayed or current
FSDP_SIZE=${FSDP_SIZE:-large}         # benchmarks/fsdp.py --size
FSDP_BATCH=${FSDP_BATCH:-16 32}       # benchmarks/fsdp.py --batch (sequences per rank), each
FSDP_VARIANTS=${FSDP_VARIANTS:-reshard keep} # benchmarks/fsdp.py --variants
TRAIN_RUNS=${TRAIN_RUNS:-1gpu_a fsdp2 tp2 1gpu_b} # 1gpu_*: one GPU; fsdp2, tp2: over 2 GPUs
TOTAL=${TOTAL:-570}                   # seconds for everything (the machine's call limit: 600)
TESTS_LIMIT=${TESTS_LIMIT:-240}       # seconds per phase before it is stopped
BENCH_LIMIT=${BENCH_LIMIT:-200}
TRAIN_LIMIT=${TRAIN_LIMIT:-90}
TESTS=(tests/test_distributed_gpu2.py tests/test_tensor_parallel_gpu.py tests/test_fsdp_gpu.py)
TESTS+=(tests/test_context_parallel.py tests/test_expert_parallel.py tests/test_tp_overlap.py)
PHASES=("$@")
((${#PHASES[@]})) || PHASES=(tests tp fsdp ep cp train)
mkdir -p "$WORK"
START=$SECONDS

wanted() { [[ " ${PHASES[*]} " == *" $1 "* ]]; }

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  date -u +%Y-%m-%dT%H:%MZ
} >"$WORK/device.txt" 2>&1

# The seconds a phase may take: its limit, or what is left of TOTAL (less 15 s for the table).
limit() {
  local left=$((TOTAL - (SECONDS - START) - 15))
  ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"
}

if wanted tests; then
  timeout "$(limit "$TESTS_LIMIT")" python -m pytest -q -m gpu -p no:cacheprovider -rfE \
    "${TESTS[@]}" >"$WORK/pytest_gpu2.log" 2>&1
  echo "pytest exit: $?" >>"$WORK/pytest_gpu2.log"
fi

run2() { timeout "$(limit "$1")" torchrun --standalone --nproc-per-node 2 "${@:2}"; }
if wanted tp; then
  run2 "$BENCH_LIMIT" benchmarks/tensor_parallel.py --json "$WORK/tp2.json" >"$WORK/tp2.log" 2>&1
fi
if wanted fsdp; then
  for batch in $FSDP_BATCH; do
    run2 "$BENCH_LIMIT" benchmarks/fsdp.py --fp8-all-gather --size "$FSDP_SIZE" \
      --batch "$batch" --variants $FSDP_VARIANTS --json "$WORK/fsdp2_b$batch.json" >"$WORK/fsdp2_b$batch.log" 2>&1
  done
fi
if wanted ep; then
  run2 "$BENCH_LIMIT" benchmarks/expert_parallel.py --json "$WORK/ep2.json" >"$WORK/ep2.log" 2>&1
fi
if wanted cp; then
  run2 "$BENCH_LIMIT" benchmarks/context_parallel.py --json "$WORK/cp2.json" >"$WORK/cp2.log" 2>&1
fi
if wanted train; then
  TRAIN=(-m torchte.train --size "$TRAIN_SIZE" --steps "$TRAIN_STEPS" --recipe "$TRAIN_RECIPE")
  for run in $TRAIN_RUNS; do
    case $run in
      1gpu_*) timeout "$(limit "$TRAIN_LIMIT")" python "${TRAIN[@]}" --out "$WORK/train_$run" ;;
      1moe_*) timeout "$(limit "$TRAIN_LIMIT")" python "${TRAIN[@]}" --experts 8 \
        --out "$WORK/train_$run" ;;
      fsdp2) run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --fsdp --out "$WORK/train_$run" ;;
      fsdp2k) run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --fsdp --fsdp-keep-gathered \
        --out "$WORK/train_$run" ;;
      tp2) run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --tp 2 --sequence-parallel --out "$WORK/train_$run" ;;
      ep2) run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --experts 8 --ep 2 --out "$WORK/train_$run" ;;
      ep2f) run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --experts 8 --ep 2 --fsdp --out "$WORK/train_$run" ;;
      ep2t) run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --experts 8 --ep 2 --tp 2 --sequence-parallel \
        --out "$WORK/train_$run" ;;
      cp2) run2 "$TRAIN_LIMIT" "${TRAIN[@]}" --cp 2 --out "$WORK/train_$run" ;;
      *) echo "unknown training run $run (1gpu_*, 1moe_*, fsdp2, fsdp2k, tp2, ep2, ep2f, ep2t or cp2)" ;;
    esac >"$WORK/train_$run.log" 2>&1
  done
fi

{
  echo "== device"
  head -n 3 "$WORK/device.txt"
  if wanted tests; then
    echo "== gpu distributed tests"
    grep -E "^(FAILED|ERROR)|passed|failed|pytest exit" "$WORK/pytest_gpu2.log" | tail -15
  fi
  for log in "$WORK"/tp2.log "$WORK"/fsdp2_b*.log "$WORK"/ep2.log "$WORK"/cp2.log; do
    [[ -f $log ]] || continue
    echo "== $(basename "$log")"
    tail -n 12 "$log"
  done
  for log in "$WORK"/train_*.log; do
    [[ -f $log ]] || continue
    echo "== $(basename "$log")"
    grep -E "tokens/s|^(bf16|delayed|current) |Error|error" "$log" | tail -4
  done
  echo "== wall time: $((SECONDS - START)) s"
  python benchmarks/multi_gpu_summary.py "$WORK"
} 2>&1 | tee "$WORK/summary.txt"
mkdir -p "$OUT"
if [[ $WORK != "$OUT" ]]; then
  cp "$WORK/summary.txt" "$OUT/summary.txt"
  (cd "$WORK" && find . -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.csv' |
    tar czf - -T -) >"$OUT/multi_gpu.tgz"
fi
