"""te modules: nn.Modules with Transformer Engine's names, each with its autograd.Function."""

from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norm import LayerNorm, RMSNorm

__all__ = ["GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm"]
