"""Run unmodified Transformer Engine client code on torchte: `import torchte.alias` (or
TORCHTE_ALIAS_TE=1 in the environment before `import torchte`) registers torchte under
Transformer Engine's import names, so that

    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

give torchte's modules and recipes. `transformer_engine.__version__` and
`importlib.metadata.version("transformer-engine")` (also "transformer_engine_torch") report
"2.14.0+torchte<version>", answered from memory. Refused with ImportError where the real
Transformer Engine is installed. docs/compat.md, section "The alias", lists what each path
holds; `uninstall()` takes the names away again.

    python -m torchte.alias SCRIPT [ARGS...]     run a script with the alias installed
    python -m torchte.alias -m MODULE [ARGS...]  the same for a module (as python -m)
"""

from __future__ import annotations

import os
import runpy
import sys

from torchte._alias import TE_VERSION, install, is_installed, uninstall, version

__all__ = ["TE_VERSION", "install", "is_installed", "uninstall", "version"]

install()


def _main(argv: list[str]) -> None:
    """Run SCRIPT or `-m MODULE` as `python` would, with argv[1:] as its arguments."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit("usage: python -m torchte.alias SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _main(sys.argv[1:])
