"""te.ops.BasicLinear: y = x W^T (no bias), in high precision or FP8, with main_grad
accumulation. The GEMMs are te.Linear's (module/_linear_core.py): the same plans, FP8 weight
cache and kernels, so an op and the module give the same bits.

Legend: x (..., in_features), W (out_features, in_features), y (..., out_features).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchte.module._lifecycle import ParameterInit
from torchte.module._linear_core import (
    default_init_method,
    gemm_plan,
    gemm_record,
    linear_backward,
    linear_forward,
)
from torchte.module.base import PlanKey, check_fp8_dims

from ..op import BasicOperation, OperationContext, RunSettings

__all__ = ["BasicLinear"]

_TP_ARGS = ("tensor_parallel_mode", "tensor_parallel_group", "sequence_parallel")


class BasicLinear(BasicOperation):
    """y = x W^T with Transformer Engine's arguments; FP8 under te.autocast.

    accumulate_into_main_grad: the weight gradient is added to `weight.main_grad` (fp32, the
    weight's shape) instead of being returned (Megatron-style; see te.Linear's
    fuse_wgrad_accumulation).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device=None,
        dtype: torch.dtype | None = None,
        tensor_parallel_mode: str | None = None,
        tensor_parallel_group=None,
        sequence_parallel: bool = False,
        rng_state_tracker_function: Callable | None = None,
        accumulate_into_main_grad: bool = False,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__(device, dtype, num_gemms=1)
        given = (tensor_parallel_mode, tensor_parallel_group, sequence_parallel)
        if any(value not in (None, False) for value in given):
            raise NotImplementedError(
                f"te.ops.BasicLinear: {', '.join(_TP_ARGS)} (tensor parallelism) are not "
                "implemented in torchte yet; leave them at their defaults"
            )
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = accumulate_into_main_grad
        self._init_method = init_method or default_init_method
        weight = torch.empty(out_features, in_features, dtype=self.params_dtype, device=self.device)
        if rng_state_tracker_function is not None:
            with rng_state_tracker_function().fork():
                self._init_method(weight)
        else:
            self._init_method(weight)
        self.weight = nn.Parameter(weight)
        self._finish_init()

    @property
    def input_features(self) -> int:
        return self.in_features

    def output_features(self, features: int | None) -> int:
        return self.out_features

    def _parameter_inits(self) -> list[ParameterInit]:
        return [ParameterInit(("weight",), self._init_method, gemm=0)]

    def check_settings(self, settings: RunSettings) -> None:
        if settings.fp8:
            check_fp8_dims(
                "te.ops.BasicLinear", in_features=self.in_features, out_features=self.out_features
            )

    def linear_plan(self, settings: RunSettings):
        """The LinearPlan of this op's GEMM under `settings` (built once per setting)."""
        plan = self._plans.get(settings)
        if plan is None:
            key = PlanKey(
                settings.fp8, settings.calibrating, settings.recipe, settings.group,
                settings.dtype, None, False, False,
            )  # fmt: skip
            plan = self._plans[settings] = gemm_plan(self, key, [self.weight])
        return plan

    def gemm_forward(self, ctx: OperationContext, x, bias, settings: RunSettings, residual=None):
        """y = x W^T (+ bias, (out_features,) or None, in the GEMM's epilogue; + residual,
        x's rows by out_features, added by the GEMM: high precision without bias only); ctx
        filled for op_backward. x may be a Float8Storage a fused producer wrote (FP8 only)."""
        if isinstance(x, torch.Tensor):
            self._check_input(x, self.in_features)
        plan = self.linear_plan(settings)
        weight = self.weight
        need_dgrad = settings.requires_grad and ctx.input_requires_grad
        need_wgrad = settings.requires_grad and (weight.requires_grad or plan.main_grad is not None)
        w_fp8 = self._fp8_weight(weight, plan, None, need_dgrad, [weight])
        y, x_saved, w_saved = linear_forward(
            x, weight, bias, w_fp8, plan, need_dgrad, need_wgrad, residual=residual
        )
        if settings.requires_grad:
            ctx.save_for_backward(x_saved, w_saved)
            grads = (weight.requires_grad, False)
            ctx.record = gemm_record(x.shape, weight, None, plan, need_dgrad, need_wgrad, grads)
        return y

    def op_forward(self, ctx, x, extra_inputs, settings):
        return self.gemm_forward(ctx, x, None, settings), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        x_saved, w_saved = ctx.saved
        dx, dw, _ = linear_backward(ctx.record, dy, x_saved, w_saved)
        return dx, (), (dw,)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
