"""torchte: Transformer Engine layers for PyTorch in Python and Triton.

Use it as Transformer Engine's `transformer_engine.pytorch`: `import torchte as te`.
"""

from . import distributed, fp8, fsdp, offload, ops, recipe
from ._device import (
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .autocast import autocast, fp8_autocast
from .graphs import make_graphed_callables
from .module.grouped_linear import GroupedLinear
from .module.layernorm_linear import LayerNormLinear
from .module.layernorm_mlp import LayerNormMLP
from .module.linear import Linear
from .module.norm import LayerNorm, RMSNorm
from .offload import get_cpu_offload_context
from .quantization.float8_tensor import Float8Tensor
from .quantization.model_init import fp8_model_init, quantized_model_init
from .recompute import checkpoint

__all__ = [
    "Float8Tensor",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
    "autocast",
    "checkpoint",
    "distributed",
    "fp8",
    "fp8_autocast",
    "fp8_model_init",
    "fsdp",
    "get_cpu_offload_context",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "make_graphed_callables",
    "offload",
    "ops",
    "quantized_model_init",
    "recipe",
]

__version__ = "0.1.0"
