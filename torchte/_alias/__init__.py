"""Installing and removing the alias (torchte under Transformer Engine's module names); see
torchte/alias.py for the user's side."""

from __future__ import annotations

import importlib.util
import sys

from .finder import AliasFinder, AliasLoader
from .metadata import TE_VERSION, version

__all__ = ["TE_VERSION", "install", "is_installed", "uninstall", "version"]

_ROOT = "transformer_engine"


def is_installed() -> bool:
    """Whether the alias's finder is on sys.meta_path."""
    return any(isinstance(finder, AliasFinder) for finder in sys.meta_path)


def install() -> None:
    """Register torchte under Transformer Engine's module and distribution names (first on
    sys.meta_path; the modules are made on import). A no-op when installed already. ImportError
    when the real Transformer Engine is imported or importable: the alias would hide it."""
    if is_installed():
        return
    _refuse_real_transformer_engine()
    sys.meta_path.insert(0, AliasFinder())
    _speak_transformer_engine(True)


def uninstall() -> None:
    """Undo install(): remove the finder and every alias module from sys.modules (objects a
    client already holds keep working; new imports of Transformer Engine's names fail)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]
    _speak_transformer_engine(False)
    for name in [n for n in sys.modules if n == _ROOT or n.startswith(_ROOT + ".")]:
        if _is_alias(sys.modules[name]):
            del sys.modules[name]


_RECIPE_PATH = "transformer_engine.common.recipe"
_RENAMED: dict[type, str] = {}


def _speak_transformer_engine(on: bool) -> None:
    """While the alias is installed, te objects serialize as Transformer Engine's do: the
    recipe classes (with Format, QParams, MMParams) pickled under their
    transformer_engine.common.recipe path, which is what a client's restricted unpickler allows
    (Megatron-Core's lists those names); the modules' `_extra_state` is in Transformer Engine's
    uint8 form always. Off restores torchte's own names."""
    from torchte import recipe

    if not on:
        for cls, module in _RENAMED.items():
            cls.__module__ = module
        _RENAMED.clear()
        return
    for name in [*recipe.__all__, "_FormatHelper"]:
        cls = getattr(recipe, name)
        if isinstance(cls, type) and cls.__module__.startswith("torchte."):
            _RENAMED.setdefault(cls, cls.__module__)
            cls.__module__ = _RECIPE_PATH


def _is_alias(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return isinstance(getattr(spec, "loader", None), AliasLoader)


def _refuse_real_transformer_engine() -> None:
    """ImportError naming where the real Transformer Engine is, if it is imported already or
    importable (found by the import system before the alias is installed)."""
    module = sys.modules.get(_ROOT)
    if module is not None and not _is_alias(module):
        where = getattr(module, "__file__", None) or repr(module)
        raise ImportError(_conflict(f"is imported already ({where})"), name=_ROOT)
    if module is None:
        spec = importlib.util.find_spec(_ROOT)
        # A namespace package (a bare folder of that name, origin None) is not an installation.
        if spec is not None and spec.origin not in (None, "namespace"):
            raise ImportError(_conflict(f"is installed ({spec.origin})"), name=_ROOT)


def _conflict(what: str) -> str:
    return (
        f"torchte.alias: the real Transformer Engine {what}; torchte will not register itself "
        f"under Transformer Engine's names and hide it. Use `import torchte as te` without the "
        f"alias (unset TORCHTE_ALIAS_TE), or uninstall transformer-engine to run its clients on "
        f"torchte."
    )
