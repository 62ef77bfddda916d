"""Transformer Engine's optimizers package (`te.optimizers`): FusedAdam, FusedSGD, the
multi-tensor applier and the `multi_tensor_*` functions Megatron-Core calls (scale, scale by a
tensor, L2 norm, Adam, SGD), on torch's fused and foreach kernels; CPU and CUDA."""

from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor import (
    MultiTensorApply,
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_adam_fp8,
    multi_tensor_adam_param_remainder,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_scale_tensor,
    multi_tensor_sgd,
    multi_tensor_unscale_l2norm,
)

__all__ = [
    "FusedAdam",
    "FusedSGD",
    "MultiTensorApply",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adam_fp8",
    "multi_tensor_adam_param_remainder",
    "multi_tensor_applier",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "multi_tensor_scale_tensor",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
]
