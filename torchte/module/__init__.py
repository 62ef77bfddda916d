"""te modules: nn.Modules with Transformer Engine's names, each with its autograd.Function."""

from .linear import Linear

__all__ = ["Linear"]
