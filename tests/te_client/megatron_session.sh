#!/usr/bin/env bash
# On the GPU machine, one command: megatron-core (its wheel carried in .whl/, unpacked, no
# registry needed) trains through the alias (tests/te_client/megatron_gpt.py: every case), after
# the gpu-marked tests (all of them, or the files given as arguments). Logs under $OUT.
#   bash tests/te_client/megatron_session.sh [tests/test_x.py ...]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%Y-%m-%dT%H:%MZ
} | tee "$OUT/device.txt"

tests=("$@")
[[ ${#tests[@]} -eq 0 ]] && tests=(tests)
python -m pytest -q -m gpu -p no:cacheprovider "${tests[@]}" >"$OUT/pytest_gpu.log" 2>&1
echo "pytest exit: $?" >>"$OUT/pytest_gpu.log"

wheel=$(ls .whl/megatron_core-*.whl 2>/dev/null | head -n 1)
if [[ -z $wheel ]]; then
  echo "no megatron-core wheel in .whl/ (pip download --no-deps megatron-core==0.19.2 -d .whl" \
    "--python-version 3.12 --only-binary=:all:)" | tee "$OUT/megatron.log"
else
  site=$(mktemp -d)
  python -m zipfile -e "$wheel" "$site"
  PYTHONPATH=".:$site" python tests/te_client/megatron_gpt.py >"$OUT/megatron.log" 2>&1
  echo "megatron exit: $?" >>"$OUT/megatron.log"
fi

echo "== gpu tests"
grep -E "^(FAILED|ERROR)|passed|failed|pytest exit" "$OUT/pytest_gpu.log" | tail -30
echo "== megatron-core through the alias"
tail -n 16 "$OUT/megatron.log"
