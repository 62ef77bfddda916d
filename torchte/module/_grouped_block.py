"""te.GroupedLinear under Float8BlockScaling: the DeepSeek-style mixture-of-experts path.

Legend as in grouped_linear.py. Forward: x's rows quantized for all groups in one launch (1x128
blocks along K; with wgrad, the columnwise copy in 1x128 blocks along each group's own tokens),
the G weights as 128x128 tiles (cached like te.Linear's FP8 weight), then one grouped GEMM that
finds each group's rows on the device. Backward: dy quantized the same way, dgrad as one grouped
GEMM against the weights' columnwise tiles, wgrad as one grouped GEMM over each group's tokens.
Nothing reads the group sizes on the host: a device split tensor never synchronizes, and a CUDA
graph can hold the whole layer. Every product is promoted to fp32 once per 128-wide block and
scaled there (gemm.block_grouped_*), on the CPU the same arithmetic through the references.
"""

from __future__ import annotations

import torch

from torchte._device import graph_capturing
from torchte._group_splits import GroupSplits
from torchte.gemm import block_grouped_dgrad, block_grouped_fprop, block_grouped_wgrad
from torchte.quantization.grouped_quantizer import split_offsets

from ._common import (
    group_bias_rows,
    group_sums,
    restore_saved,
    save_for_backward,
    stack_parameters,
)
from ._deferred_wgrad import group_wgrads
from ._grouped_fp8 import device_wgrads
from ._linear_core import cast_to
from ._weight_cache import cached_quantization

__all__ = ["block_backward", "block_forward", "block_weights"]


def block_weights(weights, setup, key, is_first_microbatch, columnwise):
    """The G weights (N, K) as one 128x128-tiled storage of shape (G, N, K) (rowwise for fprop,
    columnwise (G, K, N) for dgrad), cached as grouped_fp8_weights caches (requantized when a
    weight changed)."""

    def quantize():
        return setup.grouped_weight.quantize(
            stack_parameters(weights), rowwise=True, columnwise=columnwise
        )

    capturing = graph_capturing(weights[0])
    cache = setup.grouped_weight_cache
    return cached_quantization(cache, key, is_first_microbatch, capturing, quantize, columnwise)


def _row_offsets(splits: GroupSplits, device) -> torch.Tensor:
    """o (G + 1,) int32 on the device: group g owns rows [o_g, o_{g+1})."""
    return split_offsets(splits, device)[1]


def block_forward(ctx, x, splits: GroupSplits, plan, biases, w_q, needs):
    """y (T, N); saves what block_backward needs on ctx. x (T, K) in high precision."""
    need_dgrad, need_wgrad = needs
    first = plan.gemms[0]
    dtype = first.dtype
    keep = need_wgrad and first.save_original_input  # x kept as given, cast again in backward
    x = cast_to(x, dtype).contiguous()
    offsets = _row_offsets(splits, x.device)
    columnwise = need_wgrad and not keep
    x_q = first.setup.grouped_input.quantize_grouped(
        x, offsets, splits.host_sizes(), rowwise=True, columnwise=columnwise
    )
    y = block_grouped_fprop(x_q, w_q, dtype)
    if biases:
        y.add_(group_bias_rows(biases, splits, dtype))
    x_saved = None
    if need_wgrad:
        x_saved = x if keep else x_q
        if not keep:
            x_q.update_usage(rowwise_usage=False)  # wgrad reads the columnwise copy only
    save_for_backward(ctx, x_saved, w_q if need_dgrad else None)
    return y


def block_backward(ctx, dy: torch.Tensor):
    """(dx, [dw_g], [db_g]) under Float8BlockScaling, all GEMMs grouped on the device."""
    x_saved, w_q = restore_saved(ctx)
    plan, splits = ctx.plan, ctx.splits
    first = plan.gemms[0]
    dtype = first.dtype
    dy = cast_to(dy, dtype).contiguous()
    device = dy.device
    offsets = _row_offsets(splits, device)
    sizes = splits.host_sizes()
    quantizer = first.setup.grouped_grad_output
    dy_q = quantizer.quantize_grouped(
        dy, offsets, sizes, rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad
    )
    dx = block_grouped_dgrad(dy_q, w_q, dtype) if ctx.need_dgrad else None
    dws = [None] * ctx.num_gemms
    if ctx.need_wgrad:
        x_q = x_saved
        if isinstance(x_saved, torch.Tensor):  # save_original_input: cast again now
            x_q = first.setup.grouped_input.quantize_grouped(
                cast_to(x_saved, dtype).contiguous(), offsets, sizes, rowwise=False,
                columnwise=True,
            )  # fmt: skip

        def wgrad(out_dtype):
            return block_grouped_wgrad(dy_q, x_q, out_dtype)

        def compute() -> list:
            return device_wgrads(ctx, wgrad, first.main_grad is not None, device)

        dws = group_wgrads(ctx, compute, device)
    dbs = [None] * ctx.num_bias
    if ctx.num_bias and ctx.bias_grad:
        dbs = list(group_sums(dy, splits).to(dtype).unbind(0))
    return dx, dws, dbs
