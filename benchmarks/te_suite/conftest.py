"""Runs Transformer Engine's own PyTorch test files against torchte through the alias: the
measure of docs/compat.md's "Transformer Engine's own tests" (see run.sh)."""

import torchte.alias  # noqa: F401  (installs transformer_engine.* before the files import it)
