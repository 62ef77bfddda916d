#!/usr/bin/env bash
# Transformer Engine's own PyTorch test files, run against torchte through the alias, on the GPU
# machine. The files come from a Transformer Engine checkout (nothing of it is kept here); the
# helpers they import from their `utils` module are replaced by this folder's utils.py.
#   bash benchmarks/te_suite/run.sh TE_CHECKOUT "test_cuda_graphs.py test_deferred_init.py" [pytest args]
# e.g. -k "dtype2 and not NVFP4 and not MXFP8" (bf16; the recipes Hopper lacks natively).
# test_cpu_offloading.py imports Transformer Engine's internal offload classes: its import of
# them is cut down to the public ones, so its TestTELayers cases run (the others need them).
set -euo pipefail
te=$1
files=$2
shift 2
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
cp "$repo"/benchmarks/te_suite/*.py "$work"
for f in $files; do
  cp "$te/tests/pytorch/$f" "$work/$f"
done
if [[ -f $work/test_cpu_offloading.py ]]; then
  python - "$work/test_cpu_offloading.py" <<'PY'
import re
import sys

path = sys.argv[1]
text = open(path).read()
text = re.sub(
    r"from transformer_engine\.pytorch\.cpu_offload import \([^)]*\)",
    "from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context, mark_not_offload\n"
    "OffloadableLayerState = DefaultOffloadSynchronizer = start_offload = None",
    text,
)
open(path, "w").write(text)
PY
fi
cd "$work"
PYTHONPATH="$repo:$work" python -m pytest -q -p no:cacheprovider -rf $files "$@"
