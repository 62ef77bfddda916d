"""The installed-distribution answers of the alias: `importlib.metadata.version(
"transformer-engine")` and its kin name a 2.x version that names torchte, served from memory
(a DistributionFinder on sys.meta_path), with nothing written to disk."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
from collections.abc import Iterator

__all__ = ["DISTRIBUTIONS", "TE_VERSION", "AliasDistribution", "find_distributions", "version"]

# The highest Transformer Engine release whose features clients gate on that torchte has:
# Megatron-Core 0.19's is_te_min_version gates up to 2.14 (single grouped weights, the te.ops
# grouped MLP), 2.13 (sqrtsoftplus routing), 2.12 (unpermute pad_offsets), 2.10 (num_splits,
# retained pinned offload buffers, graph reset), 2.9 (return_max_logit); docs/compat.md,
# section "Megatron-Core", lists each gate and torchte's side of it.
TE_VERSION = "2.14.0"

# Transformer Engine's distributions (normalized names): the package, the PyTorch extension,
# and the core library of the CUDA 12 wheels.
DISTRIBUTIONS = ("transformer_engine", "transformer_engine_torch", "transformer_engine_cu12")

_METADATA = """\
Metadata-Version: 2.1
Name: {name}
Version: {version}
Summary: torchte serving Transformer Engine's import names (torchte.alias), not Transformer Engine
License: Apache-2.0
"""


def version() -> str:
    """TE_VERSION with torchte's version as its local part, e.g. "2.14.0+torchte0.1.0": a valid
    PEP 440 version that compares as 2.14.0 against public versions."""
    from torchte import __version__

    return f"{TE_VERSION}+torchte{re.sub(r'[^0-9A-Za-z.]+', '.', __version__)}"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


class AliasDistribution(importlib.metadata.Distribution):
    """One of Transformer Engine's distributions, as the alias reports it: METADATA only (no
    files, no entry points, no requirements)."""

    def __init__(self, name: str) -> None:
        self._alias_name = name

    def read_text(self, filename) -> str | None:
        if str(filename) in ("METADATA", "PKG-INFO"):
            return _METADATA.format(name=self._alias_name, version=version())
        return None

    def locate_file(self, path) -> pathlib.Path:
        # It lists no files; a path is placed beside torchte's sources, where its code is.
        return pathlib.Path(__file__).resolve().parent.parent / str(path)


def find_distributions(name: str | None) -> Iterator[AliasDistribution]:
    """The alias's distributions matching `name` (any spelling: "transformer-engine",
    "Transformer_Engine", ...), or all of them for None."""
    if name is None:
        return iter([AliasDistribution(dist) for dist in DISTRIBUTIONS])
    normalized = _normalize(name)
    return iter([AliasDistribution(normalized)] if normalized in DISTRIBUTIONS else [])
