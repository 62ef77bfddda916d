"""Which Transformer Engine module path hands out which torchte names, under the alias.

Each path of `PATHS` becomes a module of that name (only while the alias is installed) whose
attributes are the public names of its `sources` (their `__all__`) and its `names`; a child
path in the table is its attribute too (`transformer_engine.pytorch.fp8`). A name in neither is
an AttributeError that says so (and `from path import name` an ImportError). Paths not in the
table (jit, the C++ extensions, ...) are not importable:
docs/compat.md, section "The alias", lists both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PATHS", "AliasPath", "children"]


@dataclass(frozen=True)
class AliasPath:
    """What one Transformer Engine module path holds under the alias.

    sources: torchte modules whose public names (`__all__`) it hands out.
    names: Transformer Engine name -> "module:attribute" of the object it is (these win).
    package: whether the path is a package in Transformer Engine (it can have children).
    """

    sources: tuple[str, ...] = ()
    names: dict[str, str] = field(default_factory=dict)
    package: bool = False


_PADDING = "torchte.module.fp8_padding"
_MODEL_INIT = "torchte.quantization.model_init"
_DEVICE = "torchte._device"
_BLOCK_TENSORS = "torchte.quantization.block_tensor"
_TE_API = "torchte.quantization.te_api"
_FLOAT8 = ("Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8TensorStorage")
_QUANTIZED_TENSOR = (
    "QuantizedTensorStorage",
    "Quantizer",
    "prepare_for_saving",
    "restore_from_saved",
    "restore_from_func_ctx",
)
# The block formats' quantizers and Storages (Transformer Engine's defaults: internal=False).
_BLOCK_API = (
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensorStorage",
    "MXFP8Quantizer",
    "MXFP8TensorStorage",
    "NVFP4Quantizer",
    "NVFP4TensorStorage",
)
_AVAILABLE = (
    "is_fp8_available",
    "is_mxfp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
)


def _one(module: str, *names: str) -> dict[str, str]:
    """{name: "module:name"} for names kept under the same name."""
    return {name: f"{module}:{name}" for name in names}


PATHS: dict[str, AliasPath] = {
    "transformer_engine": AliasPath(package=True),
    "transformer_engine.common": AliasPath(package=True),
    "transformer_engine.common.recipe": AliasPath(
        sources=("torchte.recipe",), names=_one("torchte.recipe", "_FormatHelper")
    ),
    "transformer_engine.pytorch": AliasPath(
        sources=("torchte",),
        names={
            **_one("torchte.offload", "mark_not_offload"),
            **_one("torchte.distributed", "CudaRNGStatesTracker"),
        },
        package=True,
    ),
    "transformer_engine.pytorch.fp8": AliasPath(
        sources=("torchte.fp8",),
        names={
            **_one("torchte.autocast", "fp8_autocast"),
            **_one(_MODEL_INIT, "fp8_model_init"),
        },
    ),
    "transformer_engine.pytorch.quantization": AliasPath(
        sources=("torchte.fp8",),
        names={
            **_one("torchte.autocast", "autocast", "fp8_autocast"),
            **_one(_MODEL_INIT, "quantized_model_init", "fp8_model_init"),
            **_one(_DEVICE, *_AVAILABLE),
            **_one(_PADDING, "get_align_size_for_quantization"),
            **_one(_TE_API, "QuantizerRole"),
        },
    ),
    "transformer_engine.pytorch.module": AliasPath(
        sources=("torchte.module",),
        names=_one(_PADDING, "Fp8Padding", "Fp8Unpadding"),
        package=True,
    ),
    "transformer_engine.pytorch.module.base": AliasPath(
        names={
            **_one("torchte.module.base", "TransformerEngineBaseModule"),
            **_one("torchte.module.dummy_wgrad", "get_dummy_wgrad"),
        }
    ),
    "transformer_engine.pytorch.module.linear": AliasPath(names=_one("torchte", "Linear")),
    "transformer_engine.pytorch.module.layernorm_linear": AliasPath(
        names=_one("torchte", "LayerNormLinear")
    ),
    "transformer_engine.pytorch.module.layernorm_mlp": AliasPath(
        names=_one("torchte", "LayerNormMLP")
    ),
    "transformer_engine.pytorch.module.grouped_linear": AliasPath(
        names=_one("torchte", "GroupedLinear")
    ),
    "transformer_engine.pytorch.module.layernorm": AliasPath(names=_one("torchte", "LayerNorm")),
    "transformer_engine.pytorch.module.rmsnorm": AliasPath(names=_one("torchte", "RMSNorm")),
    "transformer_engine.pytorch.module.fp8_padding": AliasPath(names=_one(_PADDING, "Fp8Padding")),
    "transformer_engine.pytorch.module.fp8_unpadding": AliasPath(
        names=_one(_PADDING, "Fp8Unpadding")
    ),
    "transformer_engine.pytorch.attention": AliasPath(sources=("torchte.attention",), package=True),
    "transformer_engine.pytorch.attention.rope": AliasPath(sources=("torchte.attention.rope",)),
    "transformer_engine.pytorch.attention.dot_product_attention": AliasPath(
        names=_one("torchte.attention", "DotProductAttention"), package=True
    ),
    "transformer_engine.pytorch.attention.multi_head_attention": AliasPath(
        names=_one("torchte.attention", "MultiheadAttention")
    ),
    "transformer_engine.pytorch.attention.inference": AliasPath(
        names=_one("torchte.attention", "InferenceParams")
    ),
    "transformer_engine.pytorch.transformer": AliasPath(names=_one("torchte", "TransformerLayer")),
    "transformer_engine.pytorch.tensor": AliasPath(
        names={
            **_one("torchte", "Float8Tensor", "QuantizedTensor"),
            **_one(_TE_API, *_FLOAT8, "QuantizedTensorStorage", "Quantizer"),
            **_one(_BLOCK_TENSORS, "Float8BlockwiseQTensor", "MXFP8Tensor", "NVFP4Tensor"),
            **_one(_TE_API, *_BLOCK_API),
        },
        package=True,
    ),
    "transformer_engine.pytorch.tensor.float8_blockwise_tensor": AliasPath(
        names={
            **_one(_TE_API, "Float8BlockQuantizer"),
            **_one(_BLOCK_TENSORS, "Float8BlockwiseQTensor"),
        }
    ),
    "transformer_engine.pytorch.tensor.mxfp8_tensor": AliasPath(
        names={
            **_one(_TE_API, "MXFP8Quantizer"),
            **_one(_BLOCK_TENSORS, "MXFP8Tensor"),
        }
    ),
    "transformer_engine.pytorch.tensor.nvfp4_tensor": AliasPath(
        names={
            **_one(_TE_API, "NVFP4Quantizer"),
            **_one(_BLOCK_TENSORS, "NVFP4Tensor"),
        }
    ),
    "transformer_engine.pytorch.tensor.storage": AliasPath(
        names={
            **_one(_TE_API, "Float8TensorStorage"),
            **_one("torchte.quantization.blockwise", "Float8BlockwiseQTensorStorage"),
            **_one("torchte.quantization.mxfp8", "MXFP8TensorStorage"),
            **_one("torchte.quantization.nvfp4", "NVFP4TensorStorage"),
        },
        package=True,
    ),
    "transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage": AliasPath(
        names=_one("torchte.quantization.blockwise", "Float8BlockwiseQTensorStorage")
    ),
    "transformer_engine.pytorch.tensor.storage.float8_tensor_storage": AliasPath(
        names=_one(_TE_API, "Float8TensorStorage")
    ),
    "transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage": AliasPath(
        names=_one("torchte.quantization.mxfp8", "MXFP8TensorStorage")
    ),
    "transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage": AliasPath(
        names=_one("torchte.quantization.nvfp4", "NVFP4TensorStorage")
    ),
    "transformer_engine.pytorch.tensor.utils": AliasPath(
        sources=("torchte.quantization.block_param_utils",)
    ),
    "transformer_engine.pytorch.quantized_tensor": AliasPath(
        names={**_one("torchte", "QuantizedTensor"), **_one(_TE_API, *_QUANTIZED_TENSOR)}
    ),
    "transformer_engine.pytorch.router": AliasPath(sources=("torchte.moe.router",)),
    "transformer_engine.pytorch.permutation": AliasPath(sources=("torchte.moe.permutation",)),
    "transformer_engine.pytorch.cross_entropy": AliasPath(sources=("torchte.cross_entropy",)),
    "transformer_engine.pytorch.optimizers": AliasPath(
        sources=("torchte.optimizers",), package=True
    ),
    "transformer_engine.pytorch.optimizers.fused_adam": AliasPath(
        names=_one("torchte.optimizers", "FusedAdam")
    ),
    "transformer_engine.pytorch.optimizers.fused_sgd": AliasPath(
        names=_one("torchte.optimizers", "FusedSGD")
    ),
    "transformer_engine.pytorch.optimizers.multi_tensor_apply": AliasPath(
        names=_one("torchte.optimizers", "MultiTensorApply", "multi_tensor_applier")
    ),
    "transformer_engine.pytorch.tensor.float8_tensor": AliasPath(
        names={**_one("torchte", "Float8Tensor"), **_one(_TE_API, *_FLOAT8)}
    ),
    "transformer_engine.pytorch.float8_tensor": AliasPath(names=_one("torchte", "Float8Tensor")),
    "transformer_engine.pytorch.distributed": AliasPath(sources=("torchte.distributed",)),
    "transformer_engine.pytorch.cpu_offload": AliasPath(sources=("torchte.offload",)),
    "transformer_engine.pytorch.graph": AliasPath(sources=("torchte.graphs",)),
    "transformer_engine.pytorch.ops": AliasPath(sources=("torchte.ops",), package=True),
    "transformer_engine.pytorch.ops.basic": AliasPath(sources=("torchte.ops.basic",), package=True),
    "transformer_engine.pytorch.ops.basic.grouped_linear": AliasPath(
        sources=("torchte.ops.basic.grouped_linear",)
    ),
    "transformer_engine.pytorch.ops.op": AliasPath(
        names=_one(
            "torchte.ops",
            "BasicOperation",
            "FusedOperation",
            "FusibleOperation",
            "OperationContext",
        )
    ),
    "transformer_engine.pytorch.ops.sequential": AliasPath(names=_one("torchte.ops", "Sequential")),
    "transformer_engine.pytorch.utils": AliasPath(
        sources=("torchte.utils",),
        names={
            **_one(_DEVICE, "get_device_compute_capability", "is_bf16_available"),
            "is_bf16_compatible": f"{_DEVICE}:is_bf16_available",
        },
    ),
    "transformer_engine.pytorch.constants": AliasPath(
        sources=("torchte.constants",),
        names={"dist_group_type": "torch.distributed:ProcessGroup"},
    ),
}


def children(path: str) -> list[str]:
    """The last name of each path of the table directly under `path`."""
    prefix = path + "."
    return sorted(
        name[len(prefix) :]
        for name in PATHS
        if name.startswith(prefix) and "." not in name[len(prefix) :]
    )
