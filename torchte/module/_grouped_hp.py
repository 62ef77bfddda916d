"""te.GroupedLinear's two high-precision paths (grouped_linear.py says when each runs): "grouped",
bf16 through torch's grouped GEMMs (gemm.grouped_fprop / grouped_dgrad / grouped_wgrad) over the
weights stacked as one (G, N, K) buffer, and "per_group", each group through te.Linear's own
forward and backward (_linear_core.linear_forward, _linear_backward.linear_backward) with its
GEMM's plan. Each forward saves what its backward reads on the Function's ctx; `plan` is
grouped_linear's GroupedPlan.
"""

from __future__ import annotations

import torch

from torchte._group_splits import GroupSplits
from torchte.gemm import grouped_dgrad, grouped_fprop, grouped_wgrad

from ._common import (
    group_bias_rows,
    group_sums,
    restore_saved,
    save_for_backward,
    stack_parameters,
)
from ._deferred_wgrad import group_wgrads
from ._linear_backward import gemm_record, linear_backward
from ._linear_core import cast_to, linear_forward

__all__ = ["grouped_backward", "grouped_forward", "per_group_backward", "per_group_forward"]


def grouped_forward(ctx, x, splits: GroupSplits, plan, weights, biases, needs):
    """y (T, N) of the "grouped" path: one grouped GEMM over the stacked weights, plus the
    groups' biases; saves x and the stacked weights as backward needs them."""
    need_dgrad, need_wgrad = needs
    dtype = plan.gemms[0].dtype
    x_in, x = x, cast_to(x, dtype)
    w = cast_to(stack_parameters(weights), dtype)
    y = grouped_fprop(x, w, splits.offsets())
    if biases:
        y.add_(group_bias_rows(biases, splits, dtype))
    x_saved = x_in if plan.gemms[0].save_original_input else x  # cast again in backward
    ctx.save_for_backward(x_saved if need_wgrad else None, w if need_dgrad else None)
    return y


def grouped_backward(ctx, dy: torch.Tensor):
    """(dx, [dw_g], [db_g]) of grouped_forward: one grouped GEMM each for dgrad and wgrad."""
    x, w = ctx.saved_tensors
    splits: GroupSplits = ctx.splits
    dtype = ctx.plan.gemms[0].dtype
    x = cast_to(x, dtype)
    dy = cast_to(dy, dtype).contiguous()
    offs = splits.offsets()
    dx = grouped_dgrad(dy, w, offs) if ctx.need_dgrad else None
    dws = [None] * ctx.num_gemms
    if ctx.need_wgrad:

        def compute() -> list:
            return list(grouped_wgrad(dy, x, offs).to(ctx.weight_dtype).unbind(0))

        dws = group_wgrads(ctx, compute, dy.device)
    dbs = [None] * ctx.num_bias
    if ctx.num_bias and ctx.bias_grad:
        dbs = list(group_sums(dy, splits).to(ctx.weight_dtype).unbind(0))
    return dx, dws, dbs


def per_group_forward(ctx, x, splits: GroupSplits, plan, params, w_fp8, needs, param_grads):
    """y (T, N) of the "per_group" path: te.Linear's forward per group. param_grads: per group,
    the (weight, bias) needs_input_grad of the Function."""
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


def per_group_backward(ctx, dy: torch.Tensor):
    """(dx, [dw_g], [db_g]) of per_group_forward: te.Linear's backward per group."""
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
