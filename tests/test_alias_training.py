"""A training script written for Transformer Engine 2.x runs unchanged through the alias.

tests/te_client/train_te_style.py has no torchte-specific line: it imports
transformer_engine.pytorch and transformer_engine.common.recipe and uses fp8_model_init,
fp8_autocast with DelayedScaling, make_graphed_callables(recipe=...), delay_wgrad_compute with
backward_dw and the CPU offload context. Run with `python -m torchte.alias`, it must train (the
script checks its own losses) and give the very losses of the same script with its imports
pointed at torchte by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "te_client" / "train_te_style.py"
ROOT = Path(__file__).parent.parent


def _run(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TORCHTE_ALIAS_TE", None)
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _losses(out: str) -> list[str]:
    return re.findall(r"^step \d+ loss (\S+)$", out, flags=re.MULTILINE)


def test_the_script_has_no_torchte_line():
    assert "torchte" not in SCRIPT.read_text()


def test_a_transformer_engine_script_trains_through_the_alias(tmp_path):
    out = _run(["-m", "torchte.alias", str(SCRIPT)])
    losses = _losses(out)
    assert len(losses) == 12
    engine = re.search(r"^engine (\S+) (\S+)$", out, flags=re.MULTILINE)
    assert engine is not None and engine.group(1).startswith("2.")
    assert engine.group(2).startswith("torchte.")
    # The same script with its imports pointed at torchte by hand: the same losses.
    direct = SCRIPT.read_text()
    for te_name, own in (
        ("import transformer_engine.pytorch as te", "import torchte as te"),
        ("from transformer_engine.common.recipe import", "from torchte.recipe import"),
        ("import transformer_engine\n", "import torchte as transformer_engine\n"),
    ):
        assert te_name in direct
        direct = direct.replace(te_name, own)
    direct_script = tmp_path / "train_direct.py"
    direct_script.write_text(direct)
    assert _losses(_run([str(direct_script)])) == losses
