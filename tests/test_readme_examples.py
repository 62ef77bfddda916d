"""The README's Python examples run as they are: each ```python block is executed on its own
(fresh namespace) on the device the examples pick (CUDA when present, else the CPU), and
must leave every tensor it computed finite."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def examples() -> list[str]:
    """The README's ```python blocks, in order."""
    return BLOCK.findall(README.read_text())


def finite_tensors(namespace: dict) -> list[str]:
    """Names of the namespace's tensors that hold a NaN or inf (value or gradient)."""
    bad = []
    for name, value in namespace.items():
        if not isinstance(value, torch.Tensor):
            continue
        grad = value.grad if value.is_leaf else None
        for tensor in (value, grad):
            floating = tensor is not None and tensor.is_floating_point()
            if floating and not bool(torch.isfinite(tensor.float()).all()):
                bad.append(name)
    return bad


def test_readme_has_the_examples():
    """Every module the README promises an example of has one."""
    code = "\n".join(examples())
    for name in ("te.Linear(", "te.LayerNormMLP(", "te.GroupedLinear(", "te.TransformerLayer(",
                 "te.ops.Sequential(", "MoELayer(", "te.make_graphed_callables("):  # fmt: skip
        assert name in code, f"no README example uses {name}"


@pytest.mark.parametrize("index", range(len(examples())))
def test_readme_example_runs(index):
    """The example runs to the end, every name it uses defined in it, its tensors finite."""
    namespace: dict = {"__name__": "__readme__"}
    with warnings.catch_warnings():
        # make_graphed_callables says once that the CPU runs the module eagerly
        warnings.filterwarnings("ignore", message="no CUDA: make_graphed_callables")
        exec(compile(examples()[index], f"README.md example {index}", "exec"), namespace)
    assert not finite_tensors(namespace)
