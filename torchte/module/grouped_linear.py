"""te.GroupedLinear: one Linear per mixture-of-experts group, over the groups' stacked tokens.

Legend: x (T, K) the tokens of G groups stacked (group g owns m_g consecutive rows, the
m_splits), W_g (N, K) and b_g (N,) group g's weight and bias, y (T, N) with
y[rows of g] = x[rows of g] W_g^T + b_g.

Three paths, chosen per setting (the plan's mode):
- "grouped": bf16 on a GPU where torch._grouped_mm works (gemm.grouped_mm_supported), without
  FP8 or fused wgrad accumulation: one grouped GEMM each for fprop, dgrad and wgrad, whatever
  G is, and no host-device synchronization when m_splits is a device tensor. The weights are
  views of one (G, N, K) buffer, so the GEMM reads them in place; the weight gradients come
  out of one (G, N, K) buffer as views.
- "fp8": FP8 recipes (_grouped_fp8.py): x and dy quantized for all groups in one launch
  (delayed scaling; three under current scaling) into a GroupedStorage, the GEMMs per group as
  te.Linear runs them (fprop as one torch._scaled_grouped_mm where that runs), the weight
  gradients accumulated into each weight's main_grad with fuse_wgrad_accumulation. Sizes in a
  device tensor are never read back: the casts and Triton grouped GEMMs find the groups on the
  device (see _grouped_fp8.py).
- "per_group": everything else (fp32/fp16, calibration, bf16 main_grad, bf16 off the GPU): group g
  goes through te.Linear's own forward and backward (module/_linear_core.py) with GEMM g's
  quantizers. The weight gradients are stacked into one buffer and handed out as views.
Outside the grouped fprop GEMMs, results equal a stack of te.Linear layers bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchte._group_splits import GroupSplits, group_splits
from torchte.autocast import autocast_state
from torchte.gemm import (
    grouped_dgrad,
    grouped_fprop,
    grouped_mm_supported,
    grouped_wgrad,
)
from torchte.quantization.model_init import model_init_settings

from ._common import (
    as_output,
    group_bias_rows,
    group_sums,
    restore_saved,
    save_for_backward,
    stack_parameters,
)
from ._functorch import apply, transforms_active
from ._grouped_fp8 import fp8_backward, fp8_forward, grouped_fp8_weights
from ._lifecycle import ParameterInit, fill
from ._linear_core import (
    LinearPlan,
    cast_to,
    check_unknown,
    default_init_method,
    gemm_plan,
    gemm_record,
    linear_backward,
    linear_forward,
)
from ._tensor_parallel import check_divides, forked_init, set_group, tensor_parallel
from .base import PlanKey, TransformerEngineBaseModule, check_fp8_dims

__all__ = ["GroupedLinear"]

_STATE = autocast_state()


@dataclass(frozen=True, slots=True, eq=False)
class GroupedPlan:
    """The per-GEMM LinearPlans of one setting, and which path runs: "grouped" (bf16 grouped
    GEMMs), "fp8" (grouped quantization, _grouped_fp8.py) or "per_group"."""

    gemms: list[LinearPlan]
    mode: str


def _grouped_forward(ctx, x, splits: GroupSplits, dtype, weights, biases, needs):
    need_dgrad, need_wgrad = needs
    x = cast_to(x, dtype)
    w = cast_to(stack_parameters(weights), dtype)
    y = grouped_fprop(x, w, splits.offsets())
    if biases:
        y.add_(group_bias_rows(biases, splits, dtype))
    ctx.save_for_backward(x if need_wgrad else None, w if need_dgrad else None)
    return y


def _grouped_backward(ctx, dy: torch.Tensor):
    x, w = ctx.saved_tensors
    splits: GroupSplits = ctx.splits
    dtype = ctx.plan.gemms[0].dtype
    dy = cast_to(dy, dtype).contiguous()
    offs = splits.offsets()
    dx = grouped_dgrad(dy, w, offs) if ctx.need_dgrad else None
    dws = [None] * ctx.num_gemms
    if ctx.need_wgrad:
        dw = grouped_wgrad(dy, x, offs).to(ctx.weight_dtype)
        dws = list(dw.unbind(0))
    dbs = [None] * ctx.num_bias
    if ctx.num_bias and ctx.bias_grad:
        dbs = list(group_sums(dy, splits).to(ctx.weight_dtype).unbind(0))
    return dx, dws, dbs


def _per_group_forward(
    ctx, x, splits: GroupSplits, plan: GroupedPlan, params, w_fp8, needs, param_grads
):
    """param_grads: per group, the (weight, bias) needs_input_grad of the Function."""
    weights, biases = params
    need_dgrad, need_wgrad = needs
    xs = x.split(splits.sizes())
    ys, saved, records = [], [], []
    for g, gemm in enumerate(plan.gemms):
        bias = biases[g] if biases else None
        y, x_saved, w_saved = linear_forward(
            xs[g], weights[g], bias, w_fp8 and w_fp8[g], gemm, need_dgrad, need_wgrad
        )
        ys.append(y)
        saved += [x_saved, w_saved]
        records.append(
            gemm_record(xs[g].shape, weights[g], bias, gemm, need_dgrad, need_wgrad, param_grads[g])
        )
    save_for_backward(ctx, *saved)
    ctx.records = records
    return torch.cat(ys)


def _per_group_backward(ctx, dy: torch.Tensor):
    saved = restore_saved(ctx)
    splits: GroupSplits = ctx.splits
    dys = dy.split(splits.sizes())
    dxs, dws, dbs = [], [], []
    for g, record in enumerate(ctx.records):
        dx, dw, db = linear_backward(record, dys[g], saved[2 * g], saved[2 * g + 1])
        dxs.append(dx)
        dws.append(dw)
        dbs.append(db)
    dx = torch.cat(dxs) if ctx.need_dgrad else None
    grads_are_new = ctx.need_wgrad and ctx.plan.gemms[0].main_grad is None
    if grads_are_new and all(dw is not None for dw in dws) and ctx.num_gemms > 1:
        dws = list(torch.stack(dws).unbind(0))  # one buffer, one view per weight
    return dx, dws, dbs[: ctx.num_bias]


@dataclass(slots=True, eq=False)
class GroupedCall:
    """The one non-tensor argument of the Function: the plan, this call's splits, the FP8
    weights (a GroupedStorage, a list per GEMM, or None) and how many biases follow the
    weights among the tensor arguments."""

    plan: GroupedPlan
    splits: GroupSplits
    w_fp8: Any
    num_bias: int


def grouped_linear_forward(ctx, inp, call: GroupedCall, params, grads):
    """y (T, N); what backward needs goes on ctx. grads: needs_input_grad of the Function's
    inputs (inp, call, *weights, *biases)."""
    plan, splits, w_fp8 = call.plan, call.splits, call.w_fp8
    num_gemms = len(plan.gemms)
    weights, biases = params[:num_gemms], params[num_gemms:]
    first = plan.gemms[0]
    need_dgrad = grads[0]
    need_wgrad = any(grads[2 : 2 + num_gemms]) or first.main_grad is not None
    ctx.splits, ctx.plan, ctx.num_gemms, ctx.num_bias = splits, plan, num_gemms, call.num_bias
    ctx.need_dgrad, ctx.need_wgrad = need_dgrad, need_wgrad
    ctx.bias_grad = any(grads[2 + num_gemms :])
    ctx.weight_grads = grads[2 : 2 + num_gemms]
    ctx.weight_dtype = weights[0].dtype
    needs = (need_dgrad, need_wgrad)
    if plan.mode == "grouped":
        return _grouped_forward(ctx, inp, splits, first.dtype, weights, biases, needs)
    if plan.mode == "fp8":
        return fp8_forward(ctx, inp, splits, plan, biases, w_fp8, needs)
    bias_grads = grads[2 + num_gemms :] if biases else (False,) * num_gemms
    param_grads = list(zip(grads[2 : 2 + num_gemms], bias_grads, strict=True))
    return _per_group_forward(ctx, inp, splits, plan, (weights, biases), w_fp8, needs, param_grads)


class NoGradContext:
    """Stands in for the Function's ctx when autograd is off: nothing is saved."""

    def save_for_backward(self, *tensors) -> None:
        pass


def grouped_plan(module, key: PlanKey, weight_names: list[str], who: str) -> GroupedPlan:
    """The GroupedPlan of `module` (a te module with in/out_features, num_gemms and
    fuse_wgrad_accumulation) for the plan key: one LinearPlan per GEMM and the path to run."""
    fp8, dtype = key.fp8, key.dtype
    if fp8:
        check_fp8_dims(who, in_features=module.in_features, out_features=module.out_features)
    p = module._parameters
    gemms = [gemm_plan(module, key, [p[name]], g) for g, name in enumerate(weight_names)]
    mode = "per_group"
    if all(gemm.fast for gemm in gemms):
        if dtype == torch.bfloat16 and grouped_mm_supported(module.device, dtype, True):
            mode = "grouped"
    elif fp8:
        mode = "fp8"
    return GroupedPlan(gemms, mode)


def grouped_weights_fp8(module, plan: GroupedPlan, weights, is_first_microbatch, columnwise):
    """The FP8 weights the plan's path reads: one GroupedStorage ("fp8"), a Float8Storage per
    GEMM (FP8 "per_group"), or None (high precision)."""
    first = plan.gemms[0]
    if not first.fp8:
        return None
    if transforms_active():
        raise NotImplementedError(
            f"{type(module).__name__} under torch.func runs in high precision only: its FP8 "
            "path quantizes the experts' weights and splits outside its autograd Function; run "
            "it outside te.autocast there, or use te.Linear per expert"
        )
    if plan.mode == "fp8":
        setup = first.setup
        key = (module._weight_version(weights), (_STATE.step, setup.weight_generation()))
        return grouped_fp8_weights(weights, setup, key, is_first_microbatch, columnwise)
    return [
        module._fp8_weight(w, gemm, is_first_microbatch, columnwise, (w,))
        for w, gemm in zip(weights, plan.gemms, strict=True)
    ]


def grouped_linear_backward(ctx, dy, dbias: torch.Tensor | None = None):
    """(dx, [dw_g], [db_g]) of the path grouped_linear_forward took. On the "fp8" path dy may
    be a GroupedStorage a fused producer wrote, with the bias gradients it summed (dbias)."""
    if ctx.plan.mode == "fp8":
        return fp8_backward(ctx, dy, dbias)
    if ctx.plan.mode == "grouped":
        return _grouped_backward(ctx, dy)
    return _per_group_backward(ctx, dy)


class _GroupedLinearFunction(torch.autograd.Function):
    """inp (T, K), the call's context, then the G weights and the G biases (if any)
    -> y (T, N)."""

    @staticmethod
    def forward(ctx, inp, call: GroupedCall, *params):
        return grouped_linear_forward(ctx, inp, call, params, ctx.needs_input_grad)

    @staticmethod
    def backward(ctx, dy):
        dx, dws, dbs = grouped_linear_backward(ctx, dy)
        return dx, None, *dws, *dbs


class GroupedLinear(TransformerEngineBaseModule):
    """G Linear layers applied to the consecutive row groups of one input, with Transformer
    Engine's arguments; FP8 under te.autocast.

    forward(inp (T, in_features), m_splits, is_first_microbatch=None) -> (T, out_features).
    Parameters weight0..weight{G-1} (out_features, in_features) and bias0..bias{G-1}
    (out_features,), as in Transformer Engine, so state_dicts carry over; with return_bias the
    biases are not added but returned (a list, cast to the compute dtype) after the output.
    """

    _slot_major = True

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
        **unsupported,
    ) -> None:
        if not isinstance(num_gemms, int) or num_gemms <= 0:
            raise ValueError(f"num_gemms must be a positive int, got {num_gemms!r}")
        super().__init__(device, params_dtype, num_gemms=num_gemms)
        module = "te.GroupedLinear"
        check_unknown(module, unsupported)
        tp = tensor_parallel(module, tp_group, tp_size, parallel_mode, sequence_parallel)
        if tp.sequence_parallel and tp.split:
            raise NotImplementedError(
                f"{module}: sequence_parallel over more than one rank is not implemented (the "
                "experts' tokens are permuted, not a sequence to split)"
            )
        check_divides(module, tp, in_features, out_features)
        self._tp, self.parallel_mode, self.tp_size = tp, parallel_mode, tp.size
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        if model_init_settings() is not None:
            raise NotImplementedError(
                "quantized_model_init is not implemented for te.GroupedLinear yet: build it "
                "outside the context (its weights are quantized per call under te.autocast)"
            )
        in_features, out_features = tp.local_features(in_features, out_features)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation, self.name = fuse_wgrad_accumulation, name
        self._nvtx_name = f"te.GroupedLinear.forward {name or ''}"
        kw = {"dtype": self.params_dtype, "device": self.device}
        # One buffer per kind: the parameters are its views, so the grouped GEMM reads them in
        # place (a parameter later moved elsewhere is stacked per call instead).
        weights = torch.empty(num_gemms, out_features, in_features, **kw)
        biases = torch.zeros(num_gemms, out_features, **kw)
        self._init_method = forked_init(
            init_method or default_init_method, get_rng_state_tracker, rng_tracker_name
        )
        for g in range(num_gemms):
            self._init_method(weights[g])
            self.register_parameter(f"weight{g}", nn.Parameter(weights[g]))
            self.register_parameter(f"bias{g}", nn.Parameter(biases[g]) if bias else None)
        self.weight_names = [f"weight{g}" for g in range(num_gemms)]
        self.bias_names = [f"bias{g}" for g in range(num_gemms)] if bias else []
        tp.mark(
            [getattr(self, n) for n in self.weight_names],
            [getattr(self, n) for n in self.bias_names],
        )
        self._finish_init()

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group (when the module was built before it), as in
        Transformer Engine; its size must be tp_size."""
        self._tp = set_group("te.GroupedLinear", self._tp, tp_group)
        self.__dict__.update(_plans={}, _last_plan=None)  # the plans hold the old setting

    def _parameter_inits(self) -> list[ParameterInit]:
        inits = [ParameterInit((f"weight{g}",), self._init_method) for g in range(self.num_gemms)]
        return inits + [ParameterInit((name,), fill(0.0)) for name in self.bias_names]

    def _build_plan(self, key: PlanKey) -> GroupedPlan:
        return grouped_plan(self, key, self.weight_names, "te.GroupedLinear")

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: bool | None = None):
        """inp (..., in_features) with the groups' rows stacked -> y (..., out_features)
        [, the biases]."""
        dtype = self._compute_dtype()
        self._check_input(inp, self.in_features)
        tp = self._tp
        x = inp.reshape(-1, self.in_features)
        splits = group_splits(m_splits, self.num_gemms, x.shape[0], self.device)
        if tp.split:  # column: dx all-reduced in backward; row: y all-reduced, biases after
            x = tp.gemm_input(x)
        plan: GroupedPlan = self._plan(dtype, is_first_microbatch, False, False)
        p = self._parameters
        weights = [p[n] for n in self.weight_names]
        biases = [] if self.return_bias else [p[n] for n in self.bias_names]
        row_biases = biases if tp.split and tp.mode == "row" else []
        if row_biases:
            biases = []
        first = plan.gemms[0]

        def run():
            w_fp8 = grouped_weights_fp8(self, plan, weights, is_first_microbatch, inp.requires_grad)
            call = GroupedCall(plan, splits, w_fp8, len(biases))
            params = (*weights, *biases)
            if torch.is_grad_enabled():
                return apply(_GroupedLinearFunction, x, call, *params)
            return grouped_linear_forward(
                NoGradContext(), x, call, params, (False,) * (len(params) + 2)
            )

        y = self._guarded_forward(first.setup, first.group, run)
        if tp.split:
            y = tp.gemm_output(y)
        if row_biases:  # under autograd: stacked by torch.stack, not group_bias_rows' view
            stacked = cast_to(torch.stack(row_biases), dtype)
            y = y + stacked.index_select(0, splits.row_groups())
        y = as_output(y, (*inp.shape[:-1], self.out_features))
        if self.return_bias:
            return y, [cast_to(p[n], dtype) for n in self.bias_names]
        return y

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}, "
            f"params_dtype={self.params_dtype}, device={self.device}"
        )
