"""te modules: nn.Modules with Transformer Engine's names, each with its autograd.Function."""

from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norm import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm"]
