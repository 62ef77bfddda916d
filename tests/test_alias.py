"""torchte.alias: torchte under Transformer Engine's module and distribution names.

In this process the `alias` fixture installs it and uninstalls it after the test (checking that
nothing of it is left in sys.modules); `import torchte.alias`, the TORCHTE_ALIAS_TE variable,
`python -m torchte.alias` and the refusal at import run in fresh interpreters.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
import textwrap
import types
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import torchte
from torchte import _alias as alias_api  # what torchte.alias exports, without installing at import
from torchte import recipe
from torchte._alias.finder import public_names
from torchte._alias.paths import PATHS, children

ROOT = Path(__file__).resolve().parent.parent
DIST_NAMES = (
    "transformer_engine",
    "transformer-engine",
    "Transformer_Engine",
    "transformer_engine_torch",
    "transformer-engine-torch",
    "transformer_engine_cu12",
)


def _te_modules() -> list[str]:
    return [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_en")]


@pytest.fixture
def alias():
    """The alias installed for one test, then removed without a trace."""
    assert not alias_api.is_installed() and not _te_modules()
    alias_api.install()
    try:
        yield
    finally:
        alias_api.uninstall()
    assert not alias_api.is_installed() and not _te_modules()


def run_python(code: str, env_alias: str | None = None, pythonpath: str | None = None):
    """Run code in a fresh interpreter (torchte importable); the CompletedProcess."""
    return run_interpreter(["-c", textwrap.dedent(code)], env_alias, pythonpath)


def run_interpreter(args: list[str], env_alias: str | None = None, pythonpath: str | None = None):
    """Run `python *args` in a fresh interpreter (torchte importable); the CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHTE_ALIAS_TE"}
    if env_alias is not None:
        env["TORCHTE_ALIAS_TE"] = env_alias
    paths = [p for p in (pythonpath, str(ROOT), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# Import paths


def test_the_import_forms_clients_use(alias):
    import transformer_engine
    import transformer_engine.pytorch as te
    import transformer_engine.pytorch.cpu_offload
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch import Linear

    assert te.Linear is Linear is torchte.Linear and te.LayerNormMLP is torchte.LayerNormMLP
    assert DelayedScaling is recipe.DelayedScaling and Format is recipe.Format
    offload = transformer_engine.pytorch.cpu_offload
    assert offload.get_cpu_offload_context is torchte.get_cpu_offload_context
    assert offload.mark_not_offload is torchte.offload.mark_not_offload
    # Attribute chains without importing the submodules (as Megatron-Core writes them).
    assert transformer_engine.common.recipe.Format.E4M3 is recipe.Format.E4M3
    assert transformer_engine.pytorch.fp8.FP8GlobalStateManager is torchte.fp8.FP8GlobalStateManager
    assert (
        te.fp8.fp8_autocast is torchte.fp8_autocast and te.ops.Sequential is torchte.ops.Sequential
    )


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_path_hands_out_torchte_objects(alias, path):
    module = importlib.import_module(path)
    plan = PATHS[path]
    assert module.__name__ == path and importlib.util.find_spec(path) is module.__spec__
    for name, target in plan.names.items():
        source, _, attribute = target.partition(":")
        assert getattr(module, name) is getattr(importlib.import_module(source), attribute), name
    for source in plan.sources:
        source_module = importlib.import_module(source)
        for name in public_names(source_module):
            if name not in children(path):
                assert getattr(module, name) is getattr(source_module, name), name
    for child in children(path):
        assert getattr(module, child) is importlib.import_module(f"{path}.{child}")
    assert set(module.__all__) <= set(dir(module))
    if "." in path:
        parent, _, last = path.rpartition(".")
        assert getattr(sys.modules[parent], last) is module


def test_names_clients_import_through_the_paths(alias):
    from transformer_engine.pytorch.fp8 import (
        FP8GlobalStateManager,
        check_fp8_block_scaling_support,
        check_fp8_support,
        check_mxfp8_support,
        fp8_model_init,
    )
    from transformer_engine.pytorch.module import Fp8Padding, Fp8Unpadding
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, get_dummy_wgrad
    from transformer_engine.pytorch.quantization import autocast, quantized_model_init
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    assert FP8GlobalStateManager is torchte.fp8.FP8GlobalStateManager
    assert fp8_model_init is torchte.fp8_model_init and autocast is torchte.autocast
    assert quantized_model_init is torchte.quantized_model_init
    assert (Fp8Padding, Fp8Unpadding) == (torchte.Fp8Padding, torchte.Fp8Unpadding)
    assert isinstance(torchte.Linear(16, 16, device="cpu"), TransformerEngineBaseModule)
    assert get_dummy_wgrad([2, 2], torch.float32).shape == (2, 2)
    assert Float8Tensor is torchte.Float8Tensor
    for check in (check_fp8_support, check_mxfp8_support, check_fp8_block_scaling_support):
        available, reason = check()
        assert isinstance(available, bool) and isinstance(reason, str)
    assert check_mxfp8_support()[0] is True and "MXFP8" in check_mxfp8_support()[1]


def test_check_functions_answer_as_the_availability_queries():
    fp8 = torchte.fp8
    assert fp8.check_fp8_support() == torchte.is_fp8_available(return_reason=True)
    assert fp8.check_mxfp8_support() == torchte.is_mxfp8_available(return_reason=True)
    assert fp8.check_nvfp4_support() == torchte.is_nvfp4_available(return_reason=True)
    block = fp8.check_fp8_block_scaling_support()
    assert block == torchte.is_fp8_block_scaling_available(return_reason=True)
    assert block[0] is True and "Float8BlockScaling" in block[1]


def test_a_te_script_trains_a_step_through_the_alias(alias):
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    layer = te.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 32)
    fp8_recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        y = layer(x)
    y.sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


def test_missing_names_and_paths_say_so(alias):
    import transformer_engine.pytorch as te

    assert not hasattr(te, "initialize_ub")
    with pytest.raises(AttributeError, match=r"docs/compat\.md"):
        te.initialize_ub  # noqa: B018
    with pytest.raises(ImportError, match=r"cannot import name 'initialize_ub'.*alias\.py"):
        exec("from transformer_engine.pytorch import initialize_ub", {})
    for path in ("transformer_engine.pytorch.jit", "transformer_engine.pytorch.cpp_extensions"):
        with pytest.raises(ModuleNotFoundError, match=path.replace(".", r"\.")):
            importlib.import_module(path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine_torch")


def test_torchte_own_modules_are_left_alone(alias):
    import transformer_engine.pytorch.distributed
    import transformer_engine.pytorch.fp8
    import transformer_engine.pytorch.module  # noqa: F401

    assert torchte.fp8 is sys.modules["torchte.fp8"] and torchte.fp8.__name__ == "torchte.fp8"
    assert torchte.distributed.__name__ == "torchte.distributed"
    assert not hasattr(torchte.module, "Fp8Padding")
    assert sys.modules["transformer_engine.pytorch"] is not torchte


def test_install_is_idempotent_and_uninstall_takes_the_names_away():
    alias_api.install()
    try:
        alias_api.install()
        finders = [f for f in sys.meta_path if type(f).__name__ == "AliasFinder"]
        assert len(finders) == 1 and sys.meta_path[0] is finders[0]
        import transformer_engine.pytorch  # noqa: F401
    finally:
        alias_api.uninstall()
    assert not _te_modules()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("transformer-engine")


# Version and metadata


def test_version_is_a_2x_that_names_torchte(alias):
    import transformer_engine

    reported = transformer_engine.__version__
    assert reported == alias_api.version() == f"2.14.0+torchte{torchte.__version__}"
    parsed = Version(reported)
    assert parsed.major == 2 and Version("2.0.0") <= parsed < Version("3")
    assert parsed.local.startswith("torchte") and parsed.public == alias_api.TE_VERSION


@pytest.mark.parametrize("name", DIST_NAMES)
def test_metadata_look_ups(alias, name):
    assert importlib.metadata.version(name) == alias_api.version()
    dist = importlib.metadata.distribution(name)
    normalized = name.lower().replace("-", "_")
    assert dist.metadata["Name"] == normalized and dist.version == alias_api.version()
    assert "torchte" in dist.metadata["Summary"]
    assert dist.files is None and dist.requires is None and not list(dist.entry_points)


def test_availability_probes_of_clients(alias):
    # accelerate: find_spec of the package, then the distribution's metadata.
    assert importlib.util.find_spec("transformer_engine") is not None
    assert importlib.metadata.metadata("transformer-engine")["Version"] == alias_api.version()
    # Megatron-Core: packaging's Version of the distribution's version.
    assert Version(importlib.metadata.version("transformer-engine")) >= Version("2.0.0")
    names = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    assert {"transformer_engine", "transformer_engine_torch"} <= names
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("transformer-engine-jax")


def test_nothing_is_written_to_disk():
    site = Path(sysconfig.get_paths()["purelib"])
    before = sorted(p.name for p in site.iterdir())
    alias_api.install()
    try:
        import transformer_engine.pytorch  # noqa: F401

        importlib.metadata.distribution("transformer-engine").metadata["Version"]
    finally:
        alias_api.uninstall()
    assert sorted(p.name for p in site.iterdir()) == before
    assert not any(name.startswith("transformer_engine") for name in before)


# Refusal with the real Transformer Engine present


def _fake_real_te(folder: Path) -> Path:
    package = folder / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '2.5.0'\n")
    return package


def test_refused_where_the_real_one_is_installed(tmp_path, monkeypatch):
    package = _fake_real_te(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="real Transformer Engine is installed") as error:
        alias_api.install()
    assert str(package / "__init__.py") in str(error.value)
    assert not alias_api.is_installed() and not _te_modules()


def test_refused_where_the_real_one_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    with pytest.raises(ImportError, match="is imported already"):
        alias_api.install()
    assert not alias_api.is_installed()


def test_a_bare_folder_of_that_name_does_not_count(tmp_path, monkeypatch, alias):
    (tmp_path / "transformer_engine").mkdir()  # a namespace package, not an installation
    monkeypatch.syspath_prepend(str(tmp_path))
    import transformer_engine.pytorch as te

    assert te.Linear is torchte.Linear


def test_refused_at_import_in_a_fresh_interpreter(tmp_path):
    _fake_real_te(tmp_path)
    by_import = run_python("import torchte.alias", pythonpath=str(tmp_path))
    assert by_import.returncode != 0 and "real Transformer Engine is installed" in by_import.stderr
    by_env = run_python("import torchte", env_alias="1", pythonpath=str(tmp_path))
    assert by_env.returncode != 0 and "unset TORCHTE_ALIAS_TE" in by_env.stderr


# Activation in a fresh interpreter


def test_import_torchte_alias_and_the_environment_variable():
    code = """
        import importlib.util, sys
        import torchte
        assert importlib.util.find_spec("transformer_engine") is None
        import torchte.alias
        import transformer_engine.pytorch as te
        assert te.Linear is torchte.Linear
        print("ok")
    """
    plain = run_python(code, env_alias="0")
    assert plain.returncode == 0 and plain.stdout.strip() == "ok", plain.stderr[-2000:]
    code = """
        import sys
        import torchte
        assert "transformer_engine" not in sys.modules  # installed, made on import
        from transformer_engine.pytorch import Linear
        from transformer_engine.common.recipe import DelayedScaling
        import importlib.metadata
        assert Linear is torchte.Linear and DelayedScaling is torchte.recipe.DelayedScaling
        print(importlib.metadata.version("transformer-engine"))
    """
    by_env = run_python(code, env_alias="1")
    assert by_env.returncode == 0, by_env.stderr[-2000:]
    assert by_env.stdout.strip() == alias_api.version()


def test_python_m_torchte_alias_runs_an_unmodified_script(tmp_path):
    script = tmp_path / "te_client.py"  # also importable as a module from tmp_path
    script.write_text(
        textwrap.dedent("""
        import sys
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Format
        print(te.Linear.__module__, Format.HYBRID.name, __name__, sys.argv[1:])
        """)
    )
    result = run_interpreter(["-m", "torchte.alias", str(script), "--steps", "2"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "torchte.module.linear HYBRID __main__ ['--steps', '2']"
    module = run_interpreter(["-m", "torchte.alias", "-m", "te_client", "x"], None, str(tmp_path))
    assert module.returncode == 0, module.stderr[-2000:]
    assert module.stdout.strip() == "torchte.module.linear HYBRID __main__ ['x']"
    usage = run_interpreter(["-m", "torchte.alias"])
    assert usage.returncode != 0 and "usage: python -m torchte.alias" in usage.stderr


def test_the_documented_list_names_every_path():
    text = (ROOT / "docs" / "compat.md").read_text()
    section = text.split("## The alias", 1)[1].split("\n## ", 1)[0]
    table = section.split("| Transformer Engine path |", 1)[1].split("\n\n", 1)[0]
    documented = {cell for cell in table.replace("|", ",").split(",") if "`transformer_en" in cell}
    documented = {cell.strip().strip("`") for cell in documented}
    assert documented == set(PATHS)
