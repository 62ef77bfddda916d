#!/usr/bin/env bash
# One call on the GPU machine: every gpu-marked test, then the benchmarks; a short table last.
#   bash benchmarks/gpu_session.sh            (results and logs under $OUT, default ./out)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%MZ
} | tee "$OUT/device.txt"

python -m pytest -q -m gpu -p no:cacheprovider -s tests >"$OUT/pytest_gpu.log" 2>&1
echo "pytest exit: $?" >>"$OUT/pytest_gpu.log"
python benchmarks/quantize.py --json "$OUT/quantize.json" >"$OUT/quantize.log" 2>&1
python benchmarks/linear.py --json "$OUT/linear.json" >"$OUT/linear.log" 2>&1
python benchmarks/host_profile.py --json "$OUT/host_profile.json" >"$OUT/host_profile.log" 2>&1
python benchmarks/norm.py --json "$OUT/norm.json" >"$OUT/norm.log" 2>&1
python benchmarks/activation.py --json "$OUT/activation.json" >"$OUT/activation.log" 2>&1

echo "== gpu tests"
grep -E "^(FAILED|ERROR)|passed|failed|launches|pytest exit" "$OUT/pytest_gpu.log" | tail -40
echo "== quantize"
tail -n 15 "$OUT/quantize.log"
echo "== linear"
tail -n 25 "$OUT/linear.log"
echo "== host profile"; tail -n 18 "$OUT/host_profile.log"
echo "== norm"; tail -n 14 "$OUT/norm.log"
echo "== activation"; tail -n 14 "$OUT/activation.log"
