"""The meta-path finder of the alias: it makes the modules of paths.PATHS on import (each a
plain module of Transformer Engine's name holding torchte's objects) and answers
importlib.metadata look-ups for Transformer Engine's distributions."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import pathlib
import types

from . import metadata
from .paths import PATHS, AliasPath, children

__all__ = ["AliasFinder", "AliasLoader", "public_names"]

_DOCS = "docs/compat.md, section 'The alias', lists what each path holds"


def _resolve(target: str):
    """The object of a "module:attribute" reference."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def public_names(module: types.ModuleType) -> list[str]:
    """The names of `__all__` that the module has (all without an underscore if it has no
    `__all__`)."""
    names = getattr(module, "__all__", None)
    if names is None:
        return [n for n in vars(module) if n[0] != "_"]
    return [n for n in names if hasattr(module, n)]


def _contents(path: str, plan: AliasPath) -> dict[str, object]:
    """Name -> object for the module `path`: its sources' public names, then its own names.
    A name that is also a child path is left to the child (`pytorch.fp8` is the alias's)."""
    kids = set(children(path))
    contents: dict[str, object] = {}
    for source in plan.sources:
        module = importlib.import_module(source)
        contents.update((n, getattr(module, n)) for n in public_names(module) if n not in kids)
    contents.update((name, _resolve(target)) for name, target in plan.names.items())
    return contents


def _module_getattr(path: str):
    """PEP 562 __getattr__ of an alias module: a child path is imported on first use (as
    Transformer Engine's package imports its submodules); any other name is refused."""
    kids = frozenset(children(path))

    def __getattr__(name: str):
        if name in kids:
            return importlib.import_module(f"{path}.{name}")
        message = f"module {path!r} has no attribute {name!r}"
        if not name.startswith("__"):
            message += f": torchte's alias of Transformer Engine does not provide it ({_DOCS})"
        raise AttributeError(message)

    return __getattr__


class AliasLoader(importlib.abc.Loader):
    """Fills a fresh module of a PATHS path with the objects its plan names."""

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        return None  # a plain module, with the spec's name, __path__, __file__

    def exec_module(self, module: types.ModuleType) -> None:
        path = module.__name__
        contents = _contents(path, PATHS[path])
        vars(module).update(contents)
        module.__all__ = sorted(contents)
        module.__getattr__ = _module_getattr(path)
        module.__dir__ = lambda: sorted({*contents, *children(path), *vars(module)})
        if path == "transformer_engine":
            module.__version__ = metadata.version()


_LOADER = AliasLoader()
_ORIGIN = str(pathlib.Path(__file__).resolve().parent.parent / "alias.py")


class AliasFinder(importlib.metadata.DistributionFinder):
    """First on sys.meta_path while the alias is installed: finds the PATHS modules (None for
    any other name) and Transformer Engine's distributions (metadata.find_distributions)."""

    def find_spec(self, fullname: str, path=None, target=None):
        plan = PATHS.get(fullname)
        if plan is None:
            return None
        # __file__ is torchte/alias.py, so that an import error names where the module is made.
        spec = importlib.machinery.ModuleSpec(
            fullname, _LOADER, origin=_ORIGIN, is_package=plan.package
        )
        spec.has_location = True
        return spec

    def find_distributions(self, context=None):
        context = context or importlib.metadata.DistributionFinder.Context()
        return metadata.find_distributions(context.name)

    def invalidate_caches(self) -> None:
        """Nothing cached."""
