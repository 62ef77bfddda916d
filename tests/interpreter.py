"""Running Triton kernels under Triton's CPU interpreter, in a fresh process (tests import it
as `from interpreter import ...`). TRITON_INTERPRET must be set before kernels are defined,
hence the subprocess. The interpreter is fine for indexing, masking and integer-coded FP8
bytes; it mis-rounds Triton's own FP8 conversions, which the kernels here do not use."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

requires_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (for its CPU interpreter)"
)

# Put before every script: the launch cache asks for a CUDA device, and Triton 3.6's
# interpreter makes a loop bound of a one-element numpy array with int(array), which recent
# numpy refuses (kernels that loop up to M or N): index the one element instead.
PRELUDE = """
import torch
import triton.runtime.interpreter as interpreter
torch.cuda.current_device = lambda: 0

patch_lang_tensor = getattr(interpreter, "_patch_lang_tensor", None)

def patch_index(tensor, scope):
    patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

if patch_lang_tensor is not None:
    interpreter._patch_lang_tensor = patch_index
"""


def run_under_interpreter(script: str, timeout: int = 600) -> None:
    """Run PRELUDE + script with TRITON_INTERPRET=1; it must exit 0 and print just 'ok'."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    tests = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), tests, env.get("PYTHONPATH", "")])
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(script)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-4000:]
