"""te.GroupedLinear under FP8: all groups quantized in one launch into a GroupedStorage.

Legend as in grouped_linear.py. Forward: x's groups quantized together with their own scales
(delayed: GEMM g's input scale; current: each group's own amax), then y per group as te.Linear
computes it (fp8_gemm with the bias fused), or one torch._scaled_grouped_mm where it runs
(gemm.scaled_grouped_mm_supported: e4m3 operands on sm90). Backward: dy quantized the same way
with the grad_output scales, dgrad and wgrad per group with te.Linear's FP8 GEMMs, so with the
per-group forward the results equal a stack of te.Linear layers bit for bit.
"""

from __future__ import annotations

import torch

from torchte.autocast import autocast_state
from torchte.gemm import fp8_gemm, scaled_grouped_fprop, scaled_grouped_mm_supported
from torchte.kernels import grouped_cast
from torchte.quantization.grouped import GroupedStorage
from torchte.recipe import Float8CurrentScaling

from ._common import restore_saved, save_for_backward
from ._group_splits import GroupSplits

_STATE = autocast_state()


def quantize_groups(
    x, splits: GroupSplits, setup, slot: str, forward: bool, usage
) -> GroupedStorage:
    """x (T, K) -> GroupedStorage with GEMM g's `slot` scale (delayed) or each group's own
    (current); usage = (rowwise, columnwise)."""
    sizes = splits.sizes()
    rows, cols = grouped_cast.grouped_offsets(sizes, x.device)
    recipe = setup.recipe
    fmt = recipe.fp8_format
    fp8_dtype = fmt.fwd_dtype if forward else fmt.bwd_dtype
    scale_inv = torch.empty(len(sizes), dtype=torch.float32, device=x.device)
    if isinstance(recipe, Float8CurrentScaling):
        rowwise, columnwise, _ = grouped_cast.quantize_grouped_current(
            x, sizes, rows, cols, scale_inv, fp8_dtype, recipe.amax_epsilon,
            recipe.use_power_2_scales, *usage,
        )  # fmt: skip
    else:
        state = setup.fwd_state if forward else setup.bwd_state
        scale, amax = state.slot_vectors(slot)
        rowwise, columnwise = grouped_cast.quantize_grouped_delayed(
            x, sizes, rows, cols, scale, amax, scale_inv, fp8_dtype, *usage
        )
    return GroupedStorage(rowwise, columnwise, scale_inv, fp8_dtype, sizes, tuple(x.shape))


def aligned_scale_invs(storage: GroupedStorage) -> list[torch.Tensor]:
    """Each group's scale_inv as a (1,) tensor at a 16-byte aligned address (cuBLAS rejects FP8
    scale pointers that are not, and scale_inv[g] of the (G,) vector is at 4 g bytes): one
    padded copy, then views."""
    padded = torch.nn.functional.pad(storage.scale_inv[:, None], (0, 3))
    return [padded[g, :1] for g in range(padded.shape[0])]


def fp8_forward(ctx, x, splits: GroupSplits, plan, weights, biases, w_fp8, needs):
    """y (T, N) under FP8; saves what fp8_backward needs on ctx."""
    need_dgrad, need_wgrad = needs
    first = plan.gemms[0]
    dtype = first.dtype
    x_fp8 = quantize_groups(
        cast_input(x, dtype), splits, first.setup, "input", True, (True, need_wgrad)
    )
    bias = [b.to(dtype) for b in biases] if biases else [None] * len(weights)
    if one_fprop_gemm(x.device, x_fp8.fp8_dtype, w_fp8[0].fp8_dtype, splits.sizes()):
        y = scaled_grouped_fprop(x_fp8, w_fp8, splits, dtype)
        if biases:
            y.add_(torch.stack(bias).index_select(0, splits.row_groups()))
    else:
        parts = []
        scale_invs = aligned_scale_invs(x_fp8)
        for g, (w, b) in enumerate(zip(w_fp8, bias, strict=True)):
            parts.append(
                fp8_gemm(x_fp8.group(g).rowwise_data, scale_invs[g], w.rowwise_data, w.scale_inv,
                         dtype, bias=b, use_fast_accum=True)
            )  # fmt: skip
        y = torch.cat(parts)
    if need_wgrad:
        x_fp8.update_usage(rowwise_usage=False)  # wgrad reads the columnwise blocks only
    save_for_backward(ctx, x_fp8 if need_wgrad else None, *(w_fp8 if need_dgrad else ()))
    return y


def one_fprop_gemm(device, a_dtype, b_dtype, sizes: list[int]) -> bool:
    """Whether fprop runs as one torch._scaled_grouped_mm for these group sizes."""
    if scaled_grouped_mm_supported(device, a_dtype, b_dtype, True):
        return True
    aligned = all(size % 16 == 0 for size in sizes)
    return aligned and scaled_grouped_mm_supported(device, a_dtype, b_dtype, False)


def cast_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = x if x.dtype == dtype else x.to(dtype)
    return x if x.is_contiguous() else x.contiguous()


def fp8_backward(ctx, dy: torch.Tensor):
    """(dx, [dw_g], [db_g]) under FP8, the GEMMs and sums as te.Linear's per group."""
    saved = restore_saved(ctx)
    x_fp8, w_fp8 = saved[0], saved[1:]
    plan, splits = ctx.plan, ctx.splits
    first = plan.gemms[0]
    dtype, sizes = first.dtype, splits.sizes()
    dy = cast_input(dy, dtype)
    dy_fp8 = quantize_groups(
        dy, splits, first.setup, "grad_output", False, (ctx.need_dgrad, ctx.need_wgrad)
    )
    if first.setup.bwd_state is not None:
        _STATE.register_backward(first.setup.bwd_state, first.recipe, first.group)
    dx = None
    dy_scale_invs = aligned_scale_invs(dy_fp8)
    if ctx.need_dgrad:
        parts = []
        for g, w in enumerate(w_fp8):
            rows = dy_fp8.group(g).rowwise_data
            parts.append(fp8_gemm(rows, dy_scale_invs[g], w.columnwise_data, w.scale_inv, dtype))
        dx = torch.cat(parts)
    dws = [None] * ctx.num_gemms
    if ctx.need_wgrad:
        grads = []
        x_scale_invs = aligned_scale_invs(x_fp8)
        for g in range(ctx.num_gemms):
            dyg, xg = dy_fp8.group(g), x_fp8.group(g)
            grads.append(
                fp8_gemm(dyg.columnwise_data, dy_scale_invs[g], xg.columnwise_data,
                         x_scale_invs[g], ctx.weight_dtype)
            )  # fmt: skip
        dws = list(torch.stack(grads).unbind(0))  # one buffer, one view per weight
    dbs = [None] * ctx.num_bias
    if ctx.num_bias and ctx.bias_grad:
        dbs = [part.sum(0).to(dtype) for part in dy.split(sizes)]
    return dx, dws, dbs
