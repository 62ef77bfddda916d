"""te.ops.GroupedLinear: G linear maps over the consecutive row groups of one input, the group
sizes an extra input (a host list or an integer tensor, on the CPU or the op's GPU).

Legend: x (..., K) whose flattened rows T are stacked group by group (group g owns m_g rows),
W_g (N, K), b_g (N,), y (..., N) with y[rows of g] = x[rows of g] W_g^T + b_g.

The GEMMs are te.GroupedLinear's (module/grouped_linear.py): the same plans, paths ("grouped"
bf16 grouped GEMMs, "fp8" grouped quantization, "per_group" te.Linear per group), FP8 weight
cache and kernels, so the op and the module give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchte._group_splits import GroupSplits, group_splits
from torchte.gemm import hp_mm
from torchte.module._lifecycle import ParameterInit, fill
from torchte.module._linear_core import default_init_method
from torchte.module.base import PlanKey
from torchte.module.grouped_linear import (
    GroupedCall,
    GroupedPlan,
    NoGradContext,
    exact_requested,
    grouped_linear_backward,
    grouped_linear_forward,
    grouped_plan,
    grouped_weights_fp8,
)
from torchte.quantization.model_init import model_init_settings

from ..op import BasicOperation, OperationContext, RunSettings
from ._row_scales import check_row_scales

__all__ = ["GroupedLinear"]

_NOT_YET = ("single_grouped_weight", "single_grouped_bias", "delay_wgrad_compute")


class GroupedLinear(BasicOperation):
    """y_g = x_g W_g^T (+ b_g) for G groups of rows; extra input: the split sizes.

    Parameters weight0..weight{G-1} (out_features, in_features) and bias0..bias{G-1}, views
    of one (G, N, K) and one (G, N) buffer, so grouped GEMMs read them in place.
    accumulate_into_main_grad: each weight's gradient is added to its `main_grad` (fp32)
    instead of being returned, as te.GroupedLinear's fuse_wgrad_accumulation.
    scale_bias (with bias): a second extra input s (one value per row) scales the bias, y_t =
    x_t W_g^T + s_t b_g, as an MoE layer whose router probabilities were applied before the
    GEMM needs to stay p (x W^T + b).
    """

    num_extra_inputs = 1
    _slot_major = True

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        rng_state_tracker_function: Callable | None = None,
        accumulate_into_main_grad: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        delay_wgrad_compute: bool = False,
        scale_bias: bool = False,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if not isinstance(num_groups, int) or num_groups <= 0:
            raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        given = (single_grouped_weight, single_grouped_bias, delay_wgrad_compute)
        asked = [name for name, on in zip(_NOT_YET, given, strict=True) if on]
        if asked:
            raise NotImplementedError(
                f"te.ops.GroupedLinear: {', '.join(asked)} not implemented in torchte yet"
            )
        if model_init_settings() is not None:
            raise NotImplementedError(
                "quantized_model_init is not implemented for te.ops.GroupedLinear yet: build it "
                "outside the context (its weights are quantized per call under te.autocast)"
            )
        super().__init__(device, dtype, num_gemms=num_groups)
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bias
        self.scale_bias = scale_bias and bias
        if self.scale_bias:
            self.num_extra_inputs = 2  # the split sizes, then the scales of the bias
        self.fuse_wgrad_accumulation = accumulate_into_main_grad
        self._init_method = init_method or default_init_method
        kw = {"dtype": self.params_dtype, "device": self.device}
        weights = torch.empty(num_groups, out_features, in_features, **kw)
        for g in range(num_groups):
            if rng_state_tracker_function is not None:
                with rng_state_tracker_function().fork():
                    self._init_method(weights[g])
            else:
                self._init_method(weights[g])
            self.register_parameter(f"weight{g}", nn.Parameter(weights[g]))
        biases = torch.zeros(num_groups, out_features, **kw)
        for g in range(num_groups):
            self.register_parameter(f"bias{g}", nn.Parameter(biases[g]) if bias else None)
        self.weight_names = [f"weight{g}" for g in range(num_groups)]
        self.bias_names = [f"bias{g}" for g in range(num_groups)] if bias else []
        self._finish_init()

    @property
    def input_features(self) -> int:
        return self.in_features

    def output_features(self, features: int | None) -> int:
        return self.out_features

    def _parameter_inits(self) -> list[ParameterInit]:
        inits = [ParameterInit((name,), self._init_method) for name in self.weight_names]
        return inits + [ParameterInit((name,), fill(0.0)) for name in self.bias_names]

    def op_parameters(self) -> list[nn.Parameter]:
        p = self._parameters
        return [p[name] for name in (*self.weight_names, *self.bias_names)]

    def check_settings(self, settings: RunSettings) -> None:
        self.grouped_plan(settings)  # FP8 dims checked here, before any kernel runs

    def check_extra_inputs(self, extra_inputs: tuple, rows: int | None) -> None:
        if rows is not None:
            group_splits(extra_inputs[0], self.num_groups, rows, self.device)
            if self.scale_bias:
                self._check_scales(extra_inputs[1], rows, self.device)

    def grouped_plan(self, settings: RunSettings) -> GroupedPlan:
        """The GroupedPlan of this op under `settings` (built once per setting)."""
        plan = self._plans.get(settings)
        if plan is None:
            key = PlanKey(
                settings.fp8, settings.calibrating, settings.recipe, settings.group,
                settings.dtype, None, False, False,
            )  # fmt: skip
            plan = grouped_plan(self, key, self.weight_names, "te.ops.GroupedLinear")
            self._plans[settings] = plan
        return plan

    def grouped_call(self, x2d, split_sizes, settings: RunSettings, need_dgrad: bool):
        """(GroupedCall, parameters) of one call on x2d (T, K): the splits (as given, or a
        GroupSplits already checked) checked against x."""
        splits = split_sizes
        if not isinstance(splits, GroupSplits):
            splits = group_splits(split_sizes, self.num_groups, x2d.shape[0], self.device)
        plan = self.grouped_plan(settings)
        params = self.op_parameters()
        weights = params[: self.num_groups]
        w_fp8 = grouped_weights_fp8(self, plan, weights, None, need_dgrad)
        exact = exact_requested()  # as te.GroupedLinear: te.Linear's GEMMs when deterministic
        return GroupedCall(plan, splits, w_fp8, len(self.bias_names), exact=exact), params

    def gemm_forward(self, ctx: OperationContext, x, split_sizes, settings, scales=None):
        """y (T, N) from x (T, K) (a tensor, or a GroupedStorage a fused producer wrote under
        FP8); ctx filled for op_backward. scales: the (T,) bias scales (scale_bias only)."""
        need_dgrad = settings.requires_grad and ctx.input_requires_grad
        call, params = self.grouped_call(x, split_sizes, settings, need_dgrad)
        if self.scale_bias:
            call.num_bias, params = 0, params[: self.num_groups]  # the bias is added below
        target = ctx if settings.requires_grad else NoGradContext()
        grads = (need_dgrad, False, *(p.requires_grad and settings.requires_grad for p in params))
        y = grouped_linear_forward(target, x, call, params, grads)
        if self.scale_bias:
            y = self._add_scaled_bias(ctx, y, call.splits, scales, settings)
        return y

    def _add_scaled_bias(self, ctx, y, splits: GroupSplits, scales, settings: RunSettings):
        """y += s[:, None] * b[group of each row] as one GEMM of K = G: (s_t where row t is in
        group g) (T, G) @ b (G, N), s and b in y's dtype, products summed in fp32."""
        self._check_scales(scales, y.shape[0], y.device)
        s = scales.reshape(-1)
        if settings.requires_grad:
            ctx.bias_scales, ctx.scales_grad = s, scales.requires_grad
            ctx.scales_shape = scales.shape
        return y.addmm_(self._scaled_one_hot(splits, s, y.dtype).t(), self._biases(y.dtype))

    @staticmethod
    def _check_scales(scales, rows: int, device) -> None:
        """TypeError / ValueError unless the bias scales are one float per row on device."""
        who = "te.ops.GroupedLinear(scale_bias=True)"
        check_row_scales(who, "its second extra input (the bias scales)", scales, rows, device)

    def _biases(self, dtype: torch.dtype) -> torch.Tensor:
        """(G, N) in dtype."""
        return torch.stack([self._parameters[name] for name in self.bias_names]).to(dtype)

    @staticmethod
    def _scaled_one_hot(splits: GroupSplits, s: torch.Tensor, dtype) -> torch.Tensor:
        """(G, T) in dtype: s_t where row t belongs to group g, else 0."""
        return splits.one_hot(dtype) * s.to(dtype)[None, :]

    def op_forward(self, ctx, x, extra_inputs, settings):
        self._check_input(x, self.in_features)
        x2d = x.reshape(-1, self.in_features)
        y = self.gemm_forward(ctx, x2d, extra_inputs[0], settings, *extra_inputs[1:])
        return y.view(*x.shape[:-1], self.out_features), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        dy2d = dy.reshape(-1, self.out_features)
        dx, dws, dbs = grouped_linear_backward(ctx, dy2d)
        if dx is not None:
            dx = dx.view(*dy.shape[:-1], self.in_features)
        if not self.scale_bias:
            return dx, (None,), (*dws, *dbs)
        dbs, ds = self._scaled_bias_grads(ctx, dy2d)
        return dx, (None, ds), (*dws, *dbs)

    def _scaled_bias_grads(self, ctx, dy2d):
        """([db_g] (N,) each, ds (the scales' shape) or None) of y += s b[group], as GEMMs
        with fp32 sums: db = (s one-hot) (G, T) @ dy, ds_t = (dy @ b^T)[t, group of t]."""
        s, splits = ctx.bias_scales, ctx.splits
        dtype = dy2d.dtype
        params = [self._parameters[name] for name in self.bias_names]
        dbs = [None] * len(params)
        if any(b.requires_grad for b in params):
            sums = torch.empty(len(params), dy2d.shape[1], dtype=torch.float32, device=s.device)
            hp_mm(self._scaled_one_hot(splits, s, dtype), dy2d, out=sums)
            dbs = list(sums.to(params[0].dtype).unbind(0))
        ds = None
        if ctx.scales_grad:
            per_group = torch.empty(dy2d.shape[0], len(params), dtype=torch.float32,
                                    device=s.device)  # fmt: skip
            hp_mm(dy2d, self._biases(dtype).t(), out=per_group)
            rows = splits.row_groups()[:, None]
            ds = per_group.gather(1, rows).to(s.dtype).view(ctx.scales_shape)
        return dbs, ds

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}"
        )
