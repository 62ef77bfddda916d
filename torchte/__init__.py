"""torchte: Transformer Engine layers for PyTorch in Python and Triton.

Use it as Transformer Engine's `transformer_engine.pytorch`: `import torchte as te`. To run
unmodified Transformer Engine code, `import torchte.alias` (or set TORCHTE_ALIAS_TE=1 before
`import torchte`) registers torchte under Transformer Engine's module names.
"""

import os
import sys

from . import constants, distributed, fp8, offload, ops, optimizers, recipe, utils
from ._device import (
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .attention.dot_product_attention import DotProductAttention
from .attention.inference import InferenceParams
from .attention.multi_head_attention import MultiheadAttention
from .attention.rope import RotaryPositionEmbedding
from .autocast import autocast, fp8_autocast
from .checkpoint_compat import export_transformer_engine_state_dict
from .constants import DType
from .cross_entropy import parallel_cross_entropy
from .distributed import fsdp
from .graphs import make_graphed_callables
from .module.fp8_padding import Fp8Padding, Fp8Unpadding
from .module.grouped_linear import GroupedLinear
from .module.layernorm_linear import LayerNormLinear
from .module.layernorm_mlp import LayerNormMLP
from .module.linear import Linear
from .module.norm import LayerNorm, RMSNorm
from .offload import get_cpu_offload_context
from .quantization.base import QuantizedTensor
from .quantization.block_tensor import Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor
from .quantization.float8_tensor import Float8Tensor
from .quantization.model_init import fp8_model_init, quantized_model_init
from .quantization.te_api import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensorStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8TensorStorage,
    MXFP8Quantizer,
    MXFP8TensorStorage,
    NVFP4Quantizer,
    NVFP4TensorStorage,
    QuantizedTensorStorage,
    Quantizer,
    QuantizerRole,
    prepare_for_saving,
    restore_from_func_ctx,
    restore_from_saved,
)
from .recompute import checkpoint
from .transformer import TransformerLayer

# te.fsdp is distributed/fsdp.py: `import torchte.fsdp` finds the same module under that name.
sys.modules[f"{__name__}.fsdp"] = fsdp

__all__ = [
    "DType",
    "DotProductAttention",
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensor",
    "Float8BlockwiseQTensorStorage",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "Float8TensorStorage",
    "Fp8Padding",
    "Fp8Unpadding",
    "GroupedLinear",
    "InferenceParams",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "MXFP8TensorStorage",
    "MultiheadAttention",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "NVFP4TensorStorage",
    "QuantizedTensor",
    "QuantizedTensorStorage",
    "Quantizer",
    "QuantizerRole",
    "RMSNorm",
    "RotaryPositionEmbedding",
    "TransformerLayer",
    "autocast",
    "checkpoint",
    "constants",
    "distributed",
    "export_transformer_engine_state_dict",
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
    "optimizers",
    "parallel_cross_entropy",
    "prepare_for_saving",
    "quantized_model_init",
    "recipe",
    "restore_from_func_ctx",
    "restore_from_saved",
    "utils",
]

__version__ = "0.1.0"

if os.environ.get("TORCHTE_ALIAS_TE", "0") == "1":
    from . import alias  # noqa: F401  (registers Transformer Engine's module names)
