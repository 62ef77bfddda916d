"""te.ops.BasicLinear: y = x W^T (no bias), in high precision or FP8, with main_grad
accumulation and tensor / sequence parallelism. The GEMMs are te.Linear's (module/_linear_core.py)
and so are the collectives around them (module/linear.py's split forward, module/
_tensor_parallel.py's reductions), so an op and the module give the same bits.

Legend: P ranks in the tensor-parallel group; x (..., K_local), W (N_local, K_local),
y (..., N_local). tensor_parallel_mode (Transformer Engine's):
- "column": W's rows split (N_local = N / P); the input is whole on every rank, its gradient
  all-reduced in backward; with sequence_parallel the input arrives split along its first
  (sequence) dim, is all-gathered before the GEMM and its gradient reduce-scattered back.
- "row": W's columns split (K_local = K / P); the partial outputs are all-reduced, or with
  sequence_parallel reduce-scattered along the first dim (the output gradient all-gathered in
  backward).
- None, or a group of one rank: no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchte.module._lifecycle import ParameterInit
from torchte.module._linear_backward import gemm_record, linear_backward
from torchte.module._linear_core import (
    default_init_method,
    gemm_plan,
    linear_forward,
)
from torchte.module._tensor_parallel import check_divides
from torchte.module.base import PlanKey, check_fp8_dims
from torchte.module.linear import _fuses_symmetric, _split_forward, _symmetric_dgrad

from ..op import BasicOperation, OperationContext, RunSettings
from ._parallel import op_tensor_parallel

__all__ = ["BasicLinear"]


class BasicLinear(BasicOperation):
    """y = x W^T with Transformer Engine's arguments; FP8 under te.autocast.

    in_features / out_features are the whole layer's; this rank's weight is (local_out_features,
    local_in_features) (see the module docstring). accumulate_into_main_grad: the weight gradient
    is added to `weight.main_grad` (fp32, the weight's shape) instead of being returned
    (Megatron-style; `overwrite_main_grad` on the weight overwrites it). On the meta device the
    weight is not initialized (a client assigns its own, or reset_parameters() makes it).
    userbuffers_options (communication overlap through userbuffers) is not implemented: only
    None is accepted. init_method (torchte's): the weight's init, default te.Linear's (normal,
    std 0.023; Transformer Engine's op draws kaiming-uniform values instead).
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
        userbuffers_options: dict[str, Any] | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__(device, dtype, num_gemms=1)
        who = "te.ops.BasicLinear"
        if userbuffers_options is not None:
            raise NotImplementedError(
                f"{who}: userbuffers_options (tensor-parallel communication overlapped through "
                "userbuffers) is not implemented in torchte; pass None, got "
                f"{userbuffers_options!r}"
            )
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        tp = op_tensor_parallel(who, tensor_parallel_mode, tensor_parallel_group, sequence_parallel)
        check_divides(who, tp, in_features, out_features)
        self._tp = tp
        self.tensor_parallel_mode, self.tensor_parallel_group = tp.mode, tp.group
        self.tensor_parallel_size, self.sequence_parallel = tp.size, tp.sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.local_in_features, self.local_out_features = tp.local_features(
            in_features, out_features
        )
        self.fuse_wgrad_accumulation = self._accumulate_into_main_grad = accumulate_into_main_grad
        self._userbuffers_options = userbuffers_options
        self._rng_state_tracker_function = rng_state_tracker_function
        self._init_method = init_method or default_init_method
        shape = (self.local_out_features, self.local_in_features)
        weight = torch.empty(shape, dtype=self.params_dtype, device=self.device)
        if not weight.is_meta:
            self._init_weight(weight)
        self.weight = nn.Parameter(weight)
        self._finish_init()

    def _init_weight(self, weight: torch.Tensor) -> None:
        """init_method, inside the RNG tracker's fork when one was given."""
        if self._rng_state_tracker_function is None:
            self._init_method(weight)
            return
        with self._rng_state_tracker_function().fork():
            self._init_method(weight)

    @property
    def input_features(self) -> int:
        return self.local_in_features

    def output_features(self, features: int | None) -> int:
        return self.local_out_features

    def output_rows(self, rows: int | None) -> int | None:
        tp = self._tp
        if rows is None or not tp.sequence_parallel:
            return rows
        return rows * tp.size if tp.mode == "column" else rows // tp.size

    def _parameter_inits(self) -> list[ParameterInit]:
        return [ParameterInit(("weight",), self._init_weight, gemm=0)]

    def _check_parameter(self, name: str, param) -> None:
        shape = (self.local_out_features, self.local_in_features)
        if name == "weight" and tuple(param.shape) != shape:
            raise ValueError(
                f"te.ops.BasicLinear: the weight must have shape {shape} (local_out_features, "
                f"local_in_features), got {tuple(param.shape)}"
            )

    def check_settings(self, settings: RunSettings) -> None:
        if settings.fp8:
            check_fp8_dims(
                "te.ops.BasicLinear",
                in_features=self.local_in_features,
                out_features=self.local_out_features,
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

    @property
    def gathers_input(self) -> bool:
        """Whether the input is all-gathered before the GEMM (column + sequence parallel): a
        producer in front cannot hand it over in FP8."""
        return self._tp.gathers_sequence

    def gemm_forward(self, ctx: OperationContext, x, bias, settings: RunSettings, residual=None):
        """y = x W^T (+ bias, (local_out_features,) or None, in the GEMM's epilogue: not with
        row parallelism, whose bias goes after the reduction; + residual, x's rows by
        local_out_features, added by the GEMM: high precision without bias or parallelism);
        ctx filled for op_backward. x may be a Float8Storage a fused producer wrote (FP8, and
        no gather)."""
        tp = self._tp
        if isinstance(x, torch.Tensor):
            what = "local_in_features" if tp.split else "in_features"
            self._check_input(x, self.local_in_features, what)
            if tp.split:
                tp.check_output_rows(x)
        plan = self.linear_plan(settings)
        weight = self.weight
        need_dgrad = settings.requires_grad and ctx.input_requires_grad
        need_wgrad = settings.requires_grad and (weight.requires_grad or plan.main_grad is not None)
        needs = (need_dgrad, need_wgrad)
        w_fp8 = self._fp8_weight(weight, plan, None, need_dgrad, [weight])
        symmetric = tp.split and _fuses_symmetric(plan, tp)
        if tp.split:
            y, x_saved, w_saved, shape = _split_forward(x, weight, bias, w_fp8, plan, tp, needs)
        else:
            y, x_saved, w_saved = linear_forward(
                x, weight, bias, w_fp8, plan, *needs, residual=residual
            )
            shape = x.shape
        if settings.requires_grad:
            ctx.save_for_backward(x_saved, w_saved)
            ctx.symmetric, ctx.inp_shape = symmetric, x.shape
            if symmetric:  # the fused collective's backward makes the dgrad itself
                needs = (False, need_wgrad)
            grads = (weight.requires_grad, False)
            ctx.record = gemm_record(shape, weight, None, plan, *needs, grads)
        return y

    def gemm_backward(self, ctx: OperationContext, dy, dy_fp8=None):
        """(dx, dw) of gemm_forward's GEMM and its collectives: dy the output gradient, or
        None with dy_fp8 (a Float8Storage a fused producer wrote; not with row + sequence
        parallelism, whose output gradient is gathered first)."""
        x_saved, w_saved = ctx.saved
        tp, reduction, dgrad = self._tp, None, None
        if tp.split:
            if ctx.symmetric and w_saved is not None:
                dgrad, dy = _symmetric_dgrad(tp, dy, w_saved, ctx.inp_shape)
            else:
                if tp.mode == "row" and tp.sequence_parallel and dy is not None:
                    dy = tp.gather_sequence(dy)
                reduction = tp.input_grad_reduction()  # column: overlaps the wgrad GEMM
        gemm_dgrad, dw, _ = linear_backward(
            ctx.record, dy, x_saved, w_saved, dy_fp8=dy_fp8, start_reduction=reduction
        )
        return (gemm_dgrad if dgrad is None else dgrad), dw

    def op_forward(self, ctx, x, extra_inputs, settings):
        return self.gemm_forward(ctx, x, None, settings), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        dx, dw = self.gemm_backward(ctx, dy)
        return dx, (), (dw,)

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}"
        if self.tensor_parallel_mode is not None:
            text += (
                f", tensor_parallel_mode={self.tensor_parallel_mode!r}, "
                f"tensor_parallel_size={self.tensor_parallel_size}, "
                f"sequence_parallel={self.sequence_parallel}"
            )
        return text
