#!/usr/bin/env bash
# On a machine with P GPUs (NCCL; P = NPROC, default 2): the P-GPU run, all of it or the phases
# named, a short table last (benchmarks/multi_gpu_summary.py).
#   NPROC=P bash benchmarks/multi_gpu_session.sh [tests] [tp] [fsdp] [ep] [cp] [train]  # none: all
# Files and training runs carry P in their names: tp2.json, fsdp2_b16.json, train_fsdp2 ... at
# NPROC=2; tp4.json, fsdp4_b16.json, train_fsdp4 ... at NPROC=4.
# 1. tests: the gpu-marked distributed tests at world size 2 (they start their own 2 processes,
#    whatever NPROC; log pytest_gpu2.log) and the NCCL ones of one rank;
# 2. tp: benchmarks/tensor_parallel.py over P ranks (tpP.json: LayerNormMLP TP=P + SP, bf16 and
#    FP8; the te.Linear pair with te's collectives and with symmetric memory; each against its
#    one-GPU baseline of 1/P work, measured in the same run);
# 3. fsdp: benchmarks/fsdp.py over P ranks (fsdpP_b<batch>.json), bf16 (parameters gathered in
#    bf16 and in fp32) and FP8 with and without the FP8 all-gather (each row against one GPU
#    running one rank's share unsharded, in the same run), at each batch of FSDP_BATCH
#    sequences per rank;
# 3b. ep: benchmarks/expert_parallel.py over P ranks (epP.json: MoELayer EP=P, 8 experts top-2,
#    16K tokens a rank; bf16, FP8 current and delayed; shared-expert overlap on and off; against
#    one GPU holding all experts on one rank's tokens, measured in the same run);
# 3b'. epdev (asked for by name): benchmarks/ep_device_splits.py over P ranks (epdevP.json: the
#    tokens' all-to-all with split sizes on the device, torch's NVSHMEM all_to_all_vdev_2d,
#    against NCCL's with host split sizes);
# 3c. cp: benchmarks/context_parallel.py over P ranks (cpP.json: te.DotProductAttention causal,
#    32K tokens, 32 heads x 128, bf16, forward + backward; p2p, a2a and all_gather against one
#    GPU doing the whole attention, measured in the same run; efficiency = (1-GPU time / P) / CP);
# 4. train: the training example for TRAIN_STEPS steps, the runs of TRAIN_RUNS (train_<run>/),
#    with P = NPROC in each name: on one GPU (1gpu_a, 1gpu_b, ...: their spread is the
#    run-to-run spread); over P GPUs with --fsdp (fsdpP; fsdpPk: with --fsdp-keep-gathered too)
#    and with --tp P --sequence-parallel (tpP); an MoE model with --experts 8 --ep P (epP; epPf:
#    with --fsdp too; epPt: with --tp P --sequence-parallel; 1moe_*: the same model on one GPU);
#    --cp P (cpP: each rank its load-balanced share of every sequence). A run named for another
#    rank count than NPROC is not run; its log says so.
# Logs and results go to WORK (default ./out/multi_gpu; device.txt ends with "nproc P"); the
# small ones (logs, JSON, losses.csv) are packed into $OUT/multi_gpu.tgz with the table in
# $OUT/summary.txt, so that they come back from a machine that returns only a few files. Each
# phase has a time limit, cut further so that the whole stays within TOTAL seconds and the table
# is always printed.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# NVLink multicast stays off (NCCL, torch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NPROC=${NPROC:-2}                     # ranks (GPUs) of every multi-GPU phase
if [[ ! $NPROC =~ ^[1-9][0-9]*$ ]]; then
  echo "NPROC must be a whole number of ranks, at least 1 (got '$NPROC')" >&2
  exit 2
fi
OUT=${OUT:-out}
WORK=${WORK:-out/multi_gpu}
TRAIN_SIZE=${TRAIN_SIZE:-large}       # torchte.train --size (large: 355M, 16,384 tokens a step)
TRAIN_STEPS=${TRAIN_STEPS:-300}       # steps of each training run
TRAIN_RECIPE=${TRAIN_RECIPE:-delayed} # bf16, delayed or current
FSDP_SIZE=${FSDP_SIZE:-large}         # benchmarks/fsdp.py --size
FSDP_BATCH=${FSDP_BATCH:-16 32}       # benchmarks/fsdp.py --batch (sequences per rank), each
FSDP_VARIANTS=${FSDP_VARIANTS:-reshard keep} # benchmarks/fsdp.py --variants
TRAIN_RUNS=${TRAIN_RUNS:-1gpu_a fsdp$NPROC tp$NPROC 1gpu_b} # 1gpu_*: one GPU; the rest: NPROC GPUs
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
  echo "nproc $NPROC"
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

# runp LIMIT ARGS...: torchrun over NPROC ranks, stopped after LIMIT (cut by limit()) seconds.
runp() { timeout "$(limit "$1")" torchrun --standalone --nproc-per-node "$NPROC" "${@:2}"; }
if wanted tp; then
  runp "$BENCH_LIMIT" benchmarks/tensor_parallel.py --json "$WORK/tp$NPROC.json" \
    >"$WORK/tp$NPROC.log" 2>&1
fi
if wanted fsdp; then
  for batch in $FSDP_BATCH; do
    runp "$BENCH_LIMIT" benchmarks/fsdp.py --fp8-all-gather --size "$FSDP_SIZE" \
      --batch "$batch" --variants $FSDP_VARIANTS --json "$WORK/fsdp${NPROC}_b$batch.json" \
      >"$WORK/fsdp${NPROC}_b$batch.log" 2>&1
  done
fi
if wanted ep; then
  runp "$BENCH_LIMIT" benchmarks/expert_parallel.py --json "$WORK/ep$NPROC.json" \
    >"$WORK/ep$NPROC.log" 2>&1
fi
if wanted epdev; then
  runp "$BENCH_LIMIT" benchmarks/ep_device_splits.py --json "$WORK/epdev$NPROC.json" \
    >"$WORK/epdev$NPROC.log" 2>&1
fi
if wanted cp; then
  runp "$BENCH_LIMIT" benchmarks/context_parallel.py --json "$WORK/cp$NPROC.json" \
    >"$WORK/cp$NPROC.log" 2>&1
fi
if wanted train; then
  TRAIN=(-m torchte.train --size "$TRAIN_SIZE" --steps "$TRAIN_STEPS" --recipe "$TRAIN_RECIPE")
  for run in $TRAIN_RUNS; do
    case $run in
      1gpu_*) timeout "$(limit "$TRAIN_LIMIT")" python "${TRAIN[@]}" --out "$WORK/train_$run" ;;
      1moe_*) timeout "$(limit "$TRAIN_LIMIT")" python "${TRAIN[@]}" --experts 8 \
        --out "$WORK/train_$run" ;;
      "fsdp$NPROC") runp "$TRAIN_LIMIT" "${TRAIN[@]}" --fsdp --out "$WORK/train_$run" ;;
      "fsdp${NPROC}k") runp "$TRAIN_LIMIT" "${TRAIN[@]}" --fsdp --fsdp-keep-gathered \
        --out "$WORK/train_$run" ;;
      "tp$NPROC") runp "$TRAIN_LIMIT" "${TRAIN[@]}" --tp "$NPROC" --sequence-parallel \
        --out "$WORK/train_$run" ;;
      "ep$NPROC") runp "$TRAIN_LIMIT" "${TRAIN[@]}" --experts 8 --ep "$NPROC" \
        --out "$WORK/train_$run" ;;
      "ep${NPROC}f") runp "$TRAIN_LIMIT" "${TRAIN[@]}" --experts 8 --ep "$NPROC" --fsdp \
        --out "$WORK/train_$run" ;;
      "ep${NPROC}t") runp "$TRAIN_LIMIT" "${TRAIN[@]}" --experts 8 --ep "$NPROC" --tp "$NPROC" \
        --sequence-parallel --out "$WORK/train_$run" ;;
      "cp$NPROC") runp "$TRAIN_LIMIT" "${TRAIN[@]}" --cp "$NPROC" --out "$WORK/train_$run" ;;
      *)
        if [[ $run =~ ^(fsdp[0-9]+k?|tp[0-9]+|ep[0-9]+[ft]?|cp[0-9]+)$ ]]; then
          echo "mismatched training run $run: its rank count is not NPROC=$NPROC (not run)"
        else
          echo "unknown training run $run (1gpu_*, 1moe_*, fsdp$NPROC, fsdp${NPROC}k, tp$NPROC," \
            "ep$NPROC, ep${NPROC}f, ep${NPROC}t or cp$NPROC)"
        fi
        ;;
    esac >"$WORK/train_$run.log" 2>&1
  done
fi

{
  echo "== device"
  head -n $((NPROC + 1)) "$WORK/device.txt" # nvidia-smi's first GPU lines
  grep "^nproc " "$WORK/device.txt"
  if wanted tests; then
    echo "== gpu distributed tests"
    grep -E "^(FAILED|ERROR)|passed|failed|pytest exit" "$WORK/pytest_gpu2.log" | tail -15
  fi
  for log in "$WORK/tp$NPROC.log" "$WORK/fsdp${NPROC}_b"*.log "$WORK/ep$NPROC.log" \
    "$WORK/epdev$NPROC.log" \
    "$WORK/cp$NPROC.log"; do
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
  python benchmarks/multi_gpu_summary.py "$WORK" --nproc "$NPROC"
} 2>&1 | tee "$WORK/summary.txt"
mkdir -p "$OUT"
if [[ $WORK != "$OUT" ]]; then
  cp "$WORK/summary.txt" "$OUT/summary.txt"
  (cd "$WORK" && find . -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.csv' |
    tar czf - -T -) >"$OUT/multi_gpu.tgz"
fi
