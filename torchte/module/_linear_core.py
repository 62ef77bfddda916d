"""The machinery every module ending in a GEMM shares (te.Linear, te.LayerNormLinear).

Legend: x (..., K) input, W (N, K) weight, b (N,) bias, y (..., N); M = prod(...) tokens.
FP8 GEMMs (all operands K-major): fprop y = x W^T from x rowwise and W rowwise; dgrad dx = dy W
from dy rowwise and W columnwise; wgrad dW = dy^T x from dy columnwise and x columnwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchte._options import check_options
from torchte.gemm import fp8_gemm, hp_linear, operand_gemm
from torchte.quantization.base import QuantizedTensor
from torchte.quantization.float8 import Float8Storage
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.model_init import make_fp8_parameter, model_init_settings
from torchte.quantization.setup import FP8Setup
from torchte.recipe import Recipe

from ._common import (
    MainGradTarget,
    NoopCat,
    as_output,
    split_parameter_names,
)
from ._deferred_wgrad import WgradStore
from ._functorch import apply
from ._lifecycle import ParameterInit, fill
from .base import PlanKey, TransformerEngineBaseModule, check_fp8_dims

__all__ = [
    "LinearCore",
    "LinearPlan",
    "cast_to",
    "check_save_original_input",
    "check_unknown",
    "check_unsupported",
    "fprop",
    "gemm_plan",
    "linear_forward",
]


ALL_ROWS = slice(None)  # quantized_gemm's rows: all of A's


def default_init_method(weight: torch.Tensor) -> None:
    """Transformer Engine's default weight init: normal with std 0.023."""
    nn.init.normal_(weight, mean=0.0, std=0.023)


@dataclass(frozen=True, slots=True, eq=False)
class LinearPlan:
    """Everything one GEMM's forward/backward needs beyond tensors, built once per setting."""

    gemm: int
    """Which GEMM of the module: its quantizers and cached weight."""
    dtype: torch.dtype
    """The compute dtype (of the GEMM's output)."""
    fp8: bool
    calibrating: bool
    recipe: Recipe | None
    group: Any
    """The amax reduction group of the autocast region."""
    setup: FP8Setup | None
    """The module's quantizers for `recipe` (None without one)."""
    is_first_microbatch: bool | None
    fp8_output: bool
    fp8_grad: bool
    main_grad: MainGradTarget | None
    """Where fused wgrad accumulation adds the weight gradient (None: returned)."""
    backward_hook: Callable[[], None] | None
    """Called once the backward quantized its gradients (delayed scaling's update; None: none)."""
    tp: Any = None
    """The module's TensorParallel setting (_tensor_parallel.py); NO_TP where it has none."""
    wgrad_store: WgradStore | None = None
    """Where backward defers the weight-gradient GEMM (delay_wgrad_compute; None: runs it)."""
    save_original_input: bool = False
    """Backward keeps the GEMM's input as given and casts it again (not its FP8 copy)."""
    fast: bool = field(init=False)
    """Plain high precision: nn.Linear's own kernels and autograd do everything."""
    backward_override: str | None = field(init=False)
    """The recipe's backward_override under FP8: "high_precision" (backward GEMMs from the
    input and weight as given), "dequantized" (from the forward's FP8 operands, dequantized),
    None (FP8 backward GEMMs)."""

    def __post_init__(self) -> None:
        special = self.main_grad is not None or self.wgrad_store is not None
        fast = not (self.fp8 or self.calibrating or special or self.save_original_input)
        object.__setattr__(self, "fast", fast)
        override = self.recipe.backward_override if self.fp8 else None
        object.__setattr__(self, "backward_override", override)

    @property
    def fp8_backward(self) -> bool:
        """Whether backward runs FP8 GEMMs (FP8, without a backward_override): only then are
        columnwise (transposed) FP8 copies of the input and weight needed."""
        return self.fp8 and self.backward_override is None

    def input_quantizer(self):
        """The quantizer of the GEMM's input under FP8 (a producer in front, such as a norm or
        an activation, may write with it); None in high precision, and where backward needs
        the input as it was before the cast (backward_override="high_precision")."""
        if not self.fp8 or self.backward_override == "high_precision":
            return None
        return self.setup.input[self.gemm]

    def grad_output_quantizer(self):
        """The quantizer of the GEMM's output gradient under FP8 backward; None otherwise."""
        return self.setup.grad_output[self.gemm] if self.fp8_backward else None


def fprop(x, w, bias, plan: LinearPlan, residual=None) -> torch.Tensor:
    """y (M, N) = x (M, K) w (N, K)^T + bias in plan.dtype: FP8 operands (Float8Storage, rowwise
    data) under FP8, else high-precision tensors of plan.dtype; bias (N,) | None in plan.dtype.
    residual (M, N) in plan.dtype (high precision, no bias): added by the GEMM itself (one
    rounding). The one forward GEMM call, so a recompute in backward gives the same bits."""
    if residual is not None:
        return torch.addmm(residual, x, w.t())
    if plan.fp8:
        return quantized_gemm(x, "rowwise", w, "rowwise", plan.dtype, bias=bias, fast=True)
    return hp_linear(x, w, bias)


def quantized_gemm(a, a_usage, b, b_usage, out_dtype, bias=None, out=None, accumulate=False,
                   rows=ALL_ROWS, fast=False):  # fmt: skip
    """(R_a, R_b) = A @ B^T of two quantized values, each read through one usage ("rowwise":
    its (rows, K) data; "columnwise": its (K, rows) transpose copy), + bias; `rows` keeps
    rows of A only (fused wgrad accumulation into a split weight's main_grad); `out` (fp32)
    written or added to. Per-tensor FP8 (Float8Storage) straight to fp8_gemm (fast:
    cuBLAS fast accumulation, the forward's); block-scaled formats through their GEMM
    operands (gemm.operand_gemm)."""
    if type(a) is Float8Storage:
        a_data = a.rowwise_data if a_usage == "rowwise" else a.columnwise_data
        if rows != ALL_ROWS:  # a view costs the host a dispatcher call: only when it selects
            a_data = a_data[rows]
        b_data = b.rowwise_data if b_usage == "rowwise" else b.columnwise_data
        return fp8_gemm(
            a_data, a.scale_inv, b_data, b.scale_inv, out_dtype, bias=bias, out=out,
            accumulate=accumulate, use_fast_accum=fast,
        )  # fmt: skip
    a_op = a.gemm_operand(a_usage).rows(rows)
    return operand_gemm(a_op, b.gemm_operand(b_usage), out_dtype, bias, out, accumulate)


def linear_forward(
    inp, weight, bias, w_fp8, plan: LinearPlan, need_dgrad, need_wgrad, keep_rowwise=False,
    residual=None, scatter=None,
):  # fmt: skip
    """y (..., N) and what backward needs: (x_saved, w_saved). inp may be a Float8Storage made
    by a fused producer (FP8 only). With keep_rowwise the saved FP8 input keeps its rowwise data
    too (for a recompute of this GEMM in backward). residual (M, N) (high precision, no bias):
    y = x W^T + residual from the GEMM (see fprop). scatter(x, w, bias) (row + SP,
    _tp_gemm.overlapped_scatter): the GEMM with its reduce-scatter under it, y this rank's
    rows of the sum."""
    produced = not isinstance(inp, torch.Tensor)  # a quantized storage a producer wrote
    x2d = None if produced else inp.reshape(-1, inp.shape[-1])
    dtype = plan.dtype
    if bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    if plan.fp8:
        setup = plan.setup
        wgrad_fp8 = need_wgrad and plan.fp8_backward
        if produced:
            x_fp8 = inp
        elif isinstance(inp, Float8Tensor):
            x_fp8 = inp._storage
            x_fp8.update_usage(rowwise_usage=True, columnwise_usage=wgrad_fp8 or None)
        else:
            columnwise = wgrad_fp8 and not plan.save_original_input
            x_fp8 = setup.input[plan.gemm].quantize(x2d, rowwise=True, columnwise=columnwise)
        y = fprop(x_fp8, w_fp8, bias, plan) if scatter is None else scatter(x_fp8, w_fp8, bias)
        if plan.backward_override is not None:
            own = not isinstance(inp, Float8Tensor)  # a user's Float8Tensor is left as it is
            x_saved, w_saved = _saved_for_override(
                plan, x2d, weight, x_fp8 if own else None, w_fp8, need_dgrad, need_wgrad
            )
            return _output(y, inp, plan), x_saved, w_saved
        x_saved = x_fp8 if need_wgrad else None
        if need_wgrad and plan.save_original_input and x2d is not None:
            x_saved = x2d  # kept as given: backward casts it again (_columnwise_input)
        w_saved = w_fp8 if need_dgrad else None
        if x_saved is x_fp8 and not keep_rowwise and not isinstance(inp, Float8Tensor):
            x_fp8.update_usage(rowwise_usage=False)  # only the transpose is used in wgrad
    else:
        x_hp = x2d if x2d.dtype == dtype else x2d.to(dtype)
        w_hp = weight if weight.dtype == dtype else weight.to(dtype)
        if plan.calibrating:
            plan.setup.input[plan.gemm].record_amax(x2d)
            plan.setup.weight[plan.gemm].record_amax(weight)
        if scatter is None:
            y = fprop(x_hp, w_hp, bias, plan, residual)
        else:
            y = scatter(x_hp, w_hp, bias)
        x_saved = (x2d if plan.save_original_input else x_hp) if need_wgrad else None
        w_saved = w_hp if need_dgrad else None
    return _output(y, inp, plan, scatter is not None), x_saved, w_saved


def _output(y, inp, plan: LinearPlan, scattered: bool = False):
    """The GEMM's (M, N) result as the layer's output: inp's leading dims (the first one cut
    by the ranks where scattered), FP8 if asked."""
    lead = tuple(inp.shape[:-1])
    if scattered:
        lead = (y.shape[0] // math.prod(lead[1:]), *lead[1:])
    y = as_output(y, (*lead, y.shape[-1]))
    if plan.fp8_output:
        y = plan.setup.output[plan.gemm].quantize(y, rowwise=True, columnwise=True)
    return y


def _saved_for_override(plan: LinearPlan, x2d, weight, x_fp8, w_fp8, need_dgrad, need_wgrad):
    """(x_saved, w_saved) for a backward in high precision (backward_override):
    "high_precision" keeps the input and weight as given; "dequantized" keeps the forward's
    FP8 operands, rowwise only. x_fp8: the FP8 input made here or by a fused producer (None:
    the input came as a user's Float8Tensor, x2d, kept as it is)."""
    if plan.backward_override == "high_precision" or x_fp8 is None:
        x_keep = x2d if x2d is not None else x_fp8
        w_keep = weight if plan.backward_override == "high_precision" else w_fp8
    else:
        x_keep, w_keep = x_fp8, w_fp8
        if need_wgrad:
            x_fp8.update_usage(rowwise_usage=True, columnwise_usage=False)
    return (x_keep if need_wgrad else None), (w_keep if need_dgrad else None)


class LinearCore(TransformerEngineBaseModule):
    """What modules ending in a GEMM share: the weight and bias parameters (with
    parameters_split), the per-setting plans, the cached FP8 weight, and the exception-safe
    autograd.Function call. Subclasses give `_apply_function` and `_needs_dgrad`."""

    _state_at_init = True

    def _init_linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        init_method: Callable | None,
        return_bias: bool,
        fuse_wgrad_accumulation: bool,
        parameters_split,
        name: str | None,
    ) -> None:
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.name = name
        self._nvtx_name = f"te.{type(self).__name__}.forward {name or ''}"
        self._splits = split_parameter_names(parameters_split, out_features, "out_features")
        self._init_method = init_method or default_init_method
        self._make_parameters(self._init_method)

    def _apply_function(self, inp, weight, bias, w_fp8, plan: LinearPlan):
        raise NotImplementedError

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group (when the module was built before it), as in
        Transformer Engine; its size must be tp_size."""
        from ._tensor_parallel import set_group  # _tensor_parallel imports this file

        self._fast_setattr("_tp", set_group(f"te.{type(self).__name__}", self._tp, tp_group))
        self.__dict__.update(_plans={}, _last_plan=None)  # the plans hold the old setting

    def _parameter_inits(self) -> list[ParameterInit]:
        return [
            ParameterInit(tuple(self.weight_names), self._init_method, gemm=0),
            ParameterInit(tuple(self.bias_names), fill(0.0)),
        ]

    def _needs_dgrad(self, inp: torch.Tensor) -> bool:
        """Whether backward needs the input gradient of the GEMM (the weight's transpose):
        never without autograd (torch.no_grad, torch.inference_mode)."""
        return torch.is_grad_enabled() and inp.requires_grad

    def _make_parameters(self, init_method: Callable) -> None:
        kw = {"dtype": self.params_dtype, "device": self.device}
        weight = torch.empty(self.out_features, self.in_features, **kw)
        init_method(weight)
        bias = torch.zeros(self.out_features, **kw) if self.use_bias else None
        settings = model_init_settings()
        if settings is not None:
            self._fp8_setup(settings.recipe).prime_weight(weight)
        self.weight_names, self.bias_names = [], []
        start = 0
        for prefix, rows in self._splits:
            w_name = f"{prefix}_weight" if prefix else "weight"
            part = weight[start : start + rows]
            if settings is not None:
                quantizer = self._fp8_setup(settings.recipe).weight[0]
                param = make_fp8_parameter(
                    part, quantizer, settings.preserve_high_precision_init_val
                )
            else:
                param = nn.Parameter(part)
            self.register_parameter(w_name, param)
            self.weight_names.append(w_name)
            if bias is not None:
                b_name = f"{prefix}_bias" if prefix else "bias"
                self.register_parameter(b_name, nn.Parameter(bias[start : start + rows]))
                self.bias_names.append(b_name)
            start += rows
        if bias is None:
            self.register_parameter("bias", None)

    # -- per-call ---------------------------------------------------------------------------------

    def _build_plan(self, key: PlanKey) -> LinearPlan:
        if (key.fp8_output or key.fp8_grad) and not key.fp8:
            raise ValueError("fp8_output and fp8_grad need FP8: run the layer under te.autocast")
        if key.fp8:
            check_fp8_dims(
                f"te.{type(self).__name__}",
                in_features=self.in_features,
                out_features=self.out_features,
            )
        return gemm_plan(self, key, [getattr(self, n) for n in self.weight_names])

    def _full(self, names: list[str]) -> torch.Tensor:
        params = self._parameters
        if len(names) == 1:
            return params[names[0]]
        return apply(NoopCat, *[params[n] for n in names])

    def _forward_function(self, inp, weight, bias, plan: LinearPlan, is_first_microbatch):
        """The autograd.Function path (FP8, calibration, fused wgrad), exception-safe."""

        def run():
            w_fp8 = self._fp8_weight(
                weight, plan, is_first_microbatch, self._needs_dgrad(inp), self._weight_params()
            )
            return self._apply_function(inp, weight, bias, w_fp8, plan)

        return self._guarded_forward(plan.setup, plan.group, run)

    def _weight_params(self) -> list[torch.Tensor]:
        """The parameters the weight is made of (one, or the parameters_split parts)."""
        params = self._parameters
        return [params[n] for n in self.weight_names]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, params_dtype={self.params_dtype}, device={self.device}"
        )


def gemm_plan(module, key: PlanKey, weights: list, gemm: int = 0) -> LinearPlan:
    """The plan of GEMM `gemm` of `module` for the plan key; main_grad reached through the
    weight parameters `weights` when the module fuses wgrad accumulation."""
    recipe = key.recipe
    setup = module._fp8_setup(recipe) if recipe is not None else None
    store = module._wgrad_store
    if module.__dict__.get("_is_fsdp_managed_module"):
        for option, on in (
            ("fuse_wgrad_accumulation", module.fuse_wgrad_accumulation),
            ("delay_wgrad_compute", store is not None),
        ):
            if on:
                raise NotImplementedError(
                    f"te.{type(module).__name__}: {option} under FSDP2 is not supported: "
                    "FSDP2 reduce-scatters each parameter's .grad when its backward ends and "
                    f"keeps no main_grad; build the module with {option}=False"
                )
    return LinearPlan(
        gemm=gemm,
        dtype=key.dtype,
        fp8=key.fp8,
        calibrating=key.calibrating,
        recipe=recipe,
        group=key.group,
        setup=setup,
        is_first_microbatch=key.is_first_microbatch,
        fp8_output=key.fp8_output,
        fp8_grad=key.fp8_grad,
        main_grad=MainGradTarget(weights) if module.fuse_wgrad_accumulation else None,
        backward_hook=setup.backward_hook(key.group) if key.fp8 else None,
        tp=getattr(module, "_tp", None) or _no_tp(),
        wgrad_store=store,
        save_original_input=module._save_original_input,
    )


def _no_tp():
    from ._tensor_parallel import NO_TP  # _tensor_parallel imports this file

    return NO_TP


def cast_to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """t in dtype (t itself when it already is, or None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def high_precision(t, dtype: torch.dtype) -> torch.Tensor | None:
    """t (a tensor, a quantized tensor or storage, or None) as a plain tensor in dtype."""
    if t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.dtype == dtype):
        return t
    if isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor):
        return t.to(dtype)
    return t.dequantize(dtype)


# Transformer Engine's options that torchte does not implement, with the value that means
# "off" (_options.check_options). ub_name only names a buffer for the userbuffers options: any
# value is accepted.
_OFF_OPTIONS = {
    **dict.fromkeys(
        (
            "ub_overlap_ag",
            "ub_overlap_rs",
            "ub_overlap_rs_dgrad",
            "ub_overlap_ag_fprop",
            "ub_overlap_rs_fprop",
            "ub_overlap_ag_dgrad",
            "ub_bulk_dgrad",
            "ub_bulk_wgrad",
            "delay_wgrad_compute",
            "save_original_input",
        ),
        False,
    ),
    "symmetric_ar_type": None,
}


def check_save_original_input(module: str, key: PlanKey, tp) -> None:
    """save_original_input casts the input again in backward: that needs the scale made from
    the tensor itself (not delayed scaling's, moved on by then) and the input at hand (not
    gathered from the other ranks)."""
    recipe = key.recipe
    if key.fp8 and recipe is not None and recipe.delayed():
        raise NotImplementedError(
            f"{module}: save_original_input=True does not work with DelayedScaling: the "
            "input's forward scale is updated before backward casts it again; use "
            "Float8CurrentScaling, or save_original_input=False"
        )
    if tp.gathers_sequence:
        raise NotImplementedError(
            f"{module}: save_original_input=True is not implemented with sequence parallelism "
            "in column mode (the gathered input would be gathered again in backward); use "
            "save_original_input=False"
        )


def check_unknown(module: str, unsupported) -> None:
    """Keyword arguments beyond a module's own: Transformer Engine's options that torchte does
    not implement are accepted while off and NotImplementedError naming them when on (userbuffers
    overlap, deferred weight gradients, the original input kept, symmetric all-reduce);
    anything else is a TypeError naming it."""
    check_options(module, unsupported, _OFF_OPTIONS, inert=("ub_name",))


def check_unsupported(
    module: str, unsupported, tp_group, tp_size, parallel_mode, sequence_parallel
) -> None:
    """Unknown keyword arguments are an error; tensor-parallel ones are accepted only in their
    single-GPU form (the modules other than te.Linear, for now)."""
    check_unknown(module, unsupported)
    group_size = 1
    if tp_group is not None and torch.distributed.is_initialized():
        group_size = torch.distributed.get_world_size(tp_group)
    if tp_size != 1 or group_size != 1:
        raise NotImplementedError(
            f"{module}: tensor parallelism (tp_size={tp_size}, tp_group of size {group_size}) "
            "is implemented for te.Linear only so far; use tp_size=1 here"
        )
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
    if sequence_parallel:
        raise NotImplementedError(
            f"{module}: sequence_parallel is implemented for te.Linear, te.LayerNorm and "
            "te.RMSNorm only so far"
        )
