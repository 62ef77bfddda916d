#!/usr/bin/env bash
# On the GPU machine, the block-scaling figures of docs/benchmarks.md in one call: the module
# benchmark (benchmarks/block_scaling.py), Megatron-Core's blockwise / MXFP8 cases through the
# alias (wheel carried in .whl/), and the training example under bf16, block, mxfp8, nvfp4
# (STEPS steps each, default 300); a short table last. Logs under $OUT.
#   bash benchmarks/block_final.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
STEPS=${STEPS:-300}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
timeout 240 python benchmarks/block_scaling.py --emulated --json "$OUT/block_scaling.json" \
  >"$OUT/block_scaling.log" 2>&1
wheel=$(ls .whl/megatron_core-*.whl 2>/dev/null | head -n 1)
if [[ -n $wheel ]]; then
  site=$(mktemp -d)
  python -m zipfile -e "$wheel" "$site"
  PYTHONPATH=".:$site" timeout 150 python tests/te_client/megatron_gpt.py \
    --cases fp8-blockwise,fp8-mxfp8,moe-grouped-blockwise >"$OUT/megatron.log" 2>&1
fi
for recipe in bf16 block mxfp8 nvfp4; do
  steps=$STEPS
  [[ $recipe == mxfp8 || $recipe == nvfp4 ]] && steps=$((STEPS / 3))
  timeout 150 python -m torchte.train --recipe "$recipe" --steps "$steps" --seed 0 \
    --out "$OUT/train_$recipe" >"$OUT/train_$recipe.log" 2>&1
done
cat "$OUT/block_scaling.log"
tail -n 5 "$OUT/megatron.log"
for recipe in bf16 block mxfp8 nvfp4; do
  echo "== train $recipe"
  grep -E "tokens/s|val|recipe " "$OUT/train_$recipe.log" | tail -n 4
done
