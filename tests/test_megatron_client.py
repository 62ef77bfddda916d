"""Megatron-Core's calls into Transformer Engine, mirrored by tests/te_client/megatron_calls.py
(no torchte line in it), run through `python -m torchte.alias` with RuntimeWarning an error:
Megatron's imports, version gates, wrapper pattern and fused MoE, loss, RoPE and optimizer
paths. Megatron itself runs on the GPU machine (tests/te_client/megatron_session.sh)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "te_client" / "megatron_calls.py"
ROOT = Path(__file__).parent.parent


def test_the_script_has_no_torchte_line():
    module = ast.parse(SCRIPT.read_text())
    code = ast.unparse(module.body[1:])  # its docstring (which says how to run it) left out
    assert ast.get_docstring(module) and "torchte" not in code


def test_megatron_calls_run_through_the_alias():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TORCHTE_ALIAS_TE", None)
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "torchte.alias", str(SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
