"""The package's layers point one way (DESIGN.md: module -> quantizer -> kernel, and -> gemm).

Read from the source with ast, so that a change importing across a layer fails here:
- kernels/ import nothing of the package above them (only kernels/ and ground-level helpers);
- gemm.py imports nothing from module/; quantization/ nothing from module/ or gemm;
- _collectives.py imports nothing of the package (only ground-level helpers), and
  quantization/, autocast.py and recompute.py import nothing of torchte.distributed (which
  imports them): no import circle runs there;
- no module file imports an FP8-writing kernel or a scale computation: those are reached
  through quantizers (plain high-precision kernels, norm and activation, stay callable);
- the code that runs inside autograd Functions reads no autocast state;
- recipes are told apart (isinstance) only in quantization/, autocast.py and recipe.py;
- no public kernel launcher takes more than 6 arguments besides tensors.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchte"
GROUND = (
    "torchte._sizes",
    "torchte._group_splits",
    "torchte._device",
    "torchte._nvtx",
    "torchte._collectives",
)
FP8_KERNELS = (
    "torchte.kernels.cast_transpose",
    "torchte.kernels.grouped_cast",
    "torchte.kernels.norm_fp8",
    "torchte.kernels.activation_fp8",
    "torchte.kernels.scaling",
    "torchte.kernels._fp8_codec",
    "torchte.kernels.cast_spec",
    "torchte.kernels.block_cast",
    "torchte.kernels.mxfp8_cast",
    "torchte.kernels.nvfp4_cast",
    "torchte.kernels._fp4_codec",
)
RECIPE_CLASSES = {
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
}
# Module files whose functions run inside autograd Functions' forward and backward.
INSIDE_FUNCTIONS = (
    "_linear_core.py",
    "_linear_backward.py",
    "_tp_gemm.py",
    "_grouped_fp8.py",
    "_norm_spec.py",
    "_common.py",
)


def _files(folder: str = "") -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, absolute, including `from package import submodule`."""
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    package = package or _module_name(path)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _crossing(path: Path, forbidden) -> list[str]:
    return sorted(
        name
        for name in imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def test_the_import_reader_sees_relative_and_submodule_imports():
    names = imported_modules(PACKAGE / "module" / "layernorm_mlp.py")
    assert "torchte.module._linear_core" in names  # from ._linear_core import ...
    assert "torchte.kernels.activation" in names  # from torchte.kernels import activation
    assert "torchte.graphs" not in names and "torch" in names


@pytest.mark.parametrize("path", _files("kernels"), ids=lambda p: p.name)
def test_kernels_import_nothing_above_them(path):
    above = ("torchte.quantization", "torchte.module", "torchte.gemm", "torchte.autocast")
    above += ("torchte.recipe", "torchte.offload", "torchte.graphs", "torchte.train")
    assert _crossing(path, above) == []
    own = {n for n in imported_modules(path) if n.startswith("torchte")}
    allowed = ("torchte.kernels", *GROUND)
    assert [n for n in own if not any(n == a or n.startswith(a + ".") for a in allowed)] == []


def test_gemm_imports_nothing_from_modules():
    assert _crossing(PACKAGE / "gemm.py", ("torchte.module",)) == []


@pytest.mark.parametrize("path", _files("quantization"), ids=lambda p: p.name)
def test_quantization_imports_no_modules_or_gemm(path):
    assert _crossing(path, ("torchte.module", "torchte.gemm")) == []


def test_collectives_import_nothing_of_the_package():
    own = imported_modules(PACKAGE / "_collectives.py")
    own = {n for n in own if n.startswith("torchte")}
    assert [n for n in own if not any(n == g or n.startswith(g + ".") for g in GROUND)] == []


BELOW_DISTRIBUTED = [*_files("quantization"), PACKAGE / "autocast.py", PACKAGE / "recompute.py"]


@pytest.mark.parametrize("path", BELOW_DISTRIBUTED, ids=lambda p: p.name)
def test_no_import_circle_through_distributed(path):
    """torchte.distributed imports recompute, autocast and quantization: none of those imports
    torchte.distributed back (the collectives they need are torchte/_collectives.py)."""
    assert _crossing(path, ("torchte.distributed",)) == []


@pytest.mark.parametrize("path", _files("module") + _files("ops"), ids=lambda p: p.name)
def test_modules_reach_fp8_kernels_only_through_quantizers(path):
    assert _crossing(path, FP8_KERNELS) == []
    source = path.read_text()
    assert "compute_scale" not in source and "scale_from_amax" not in source


@pytest.mark.parametrize("name", INSIDE_FUNCTIONS)
def test_code_inside_autograd_functions_reads_no_autocast_state(name):
    assert _crossing(PACKAGE / "module" / name, ("torchte.autocast",)) == []


@pytest.mark.parametrize("path", _files("ops/basic") + _files("ops/fused"), ids=lambda p: p.name)
def test_fuser_ops_read_no_autocast_state(path):
    """Ops get the autocast state from the fuser (RunSettings), read once per call."""
    assert _crossing(path, ("torchte.autocast",)) == []


def _recipe_isinstance_calls(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        is_call = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
        if is_call and len(node.args) == 2:
            classes = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, ast.Name | ast.Attribute)
            }
            if classes & RECIPE_CLASSES:
                lines.append(node.lineno)
    return lines


def test_recipes_are_told_apart_only_in_quantization_and_autocast():
    allowed = {PACKAGE / "autocast.py", PACKAGE / "recipe.py"}
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in _files()
        if path not in allowed and "quantization" not in path.parts
        if (lines := _recipe_isinstance_calls(path))
    }
    assert found == {}
    # The check sees such calls where they are.
    assert _recipe_isinstance_calls(PACKAGE / "quantization" / "setup.py")


def _non_tensor_parameters(fn) -> list[str]:
    return [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if "Tensor" not in str(p.annotation)
    ]


def _public_launchers():
    for path in _files("kernels"):
        if path.name.startswith("_") or path.name == "cast_spec.py":
            continue
        module = importlib.import_module(_module_name(path))
        for name, fn in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            if getattr(fn, "__module__", module.__name__) == module.__name__:
                yield f"{path.name}:{name}", fn


def test_no_public_launcher_takes_more_than_six_arguments_besides_tensors():
    launchers = dict(_public_launchers())
    assert "cast_transpose.py:quantize" in launchers  # the scan finds the launchers
    too_many = {
        name: params
        for name, fn in launchers.items()
        if len(params := _non_tensor_parameters(fn)) > 6
    }
    assert too_many == {}
