"""The permutation of tokens to experts fused with the FP8 cast of the experts' first GEMM's
input (te.moe.MoELayer under FP8 delayed or current scaling, split sizes on the device).

Unfused, the permute kernel writes the routed rows in high precision (P, H) and the grouped
cast reads them back to write their FP8 copies. Fused, the grouped cast reads each permuted
row straight from the tokens (grouped_cast.quantize_grouped's src_rows): no (P, H) buffer is
written or read. The FP8 bytes, scale_invs and amaxes are those of the unfused path (the pad
and spare rows are zeros in both), so the layer's outputs and gradients are the same bits.

Legend as in layer.py: T tokens, H hidden, E experts, P permuted rows (padded), row_id_map the
mask map of kernels/permutation_maps.py (unpadded rows; pad_offsets (E,) added per expert).
"""

from __future__ import annotations

import torch

from ..kernels import permutation as kernels
from ..quantization.grouped import GroupedTensor
from ..quantization.grouped_quantizer import GroupedQuantizer
from ._permutation_functions import mask_permute_grads

__all__ = ["GatherQuantize", "fp8_input_quantizer", "permuted_sources"]


def fp8_input_quantizer(experts, x: torch.Tensor, requires_grad: bool):
    """(the GroupedQuantizer the experts' first GEMM would quantize x's rows with, whether it
    writes the columnwise copy) under the current autocast state, or None where the fused path
    does not apply: not FP8, a recipe other than delayed / current scaling, an input kept in
    high precision for the backward, or x not in the GEMM's compute dtype."""
    settings = experts.first_run_settings(x, requires_grad)
    if settings is None or not settings.fp8 or settings.dtype != x.dtype:
        return None
    fc1 = experts.fc1
    plan = fc1.grouped_plan(settings)
    first = plan.gemms[0]
    quantizer = first.setup.grouped_input
    if plan.mode != "fp8" or first.save_original_input:
        return None
    if not isinstance(quantizer, GroupedQuantizer):
        return None
    columnwise = settings.requires_grad and any(w.requires_grad for w in fc1.weight_params())
    return quantizer, columnwise


def permuted_sources(row_id_map, counts, pad_offsets, probs, rows: int):
    """(src (P,) int32: the token of each permuted row, -1 for pad and spare rows (and for a
    route of probability 0, whose permuted row moe_permute writes as zeros); probs_P (P,) in
    probs' dtype, 0 on those rows), without a host sync: the permute kernel moves each token's
    number + 1 as a one-column row, rows no route writes coming out 0."""
    tokens = row_id_map.shape[0]
    ids = torch.arange(1, tokens + 1, dtype=torch.int32, device=row_id_map.device)
    moved, probs_P = kernels.permute_rows(
        ids.unsqueeze(1), row_id_map, probs, pad_offsets, counts, rows, 0
    )
    return moved.view(-1) - 1, probs_P


class GatherQuantize(torch.autograd.Function):
    """(x (T, H), probs (T, E)) -> (the permuted rows x[src] quantized for the experts' first
    GEMM, as a GroupedTensor (P, H) of x's dtype; the permuted probs (P,)); backward: each
    token's gradient the sum of its rows' and the probs' gradients sent back to their routes,
    one unpermute launch (moe_permute's backward)."""

    @staticmethod
    def forward(ctx, x, probs, row_id_map, counts, pad_offsets, quantizer, splits, columnwise):
        rows = splits.total
        src, probs_P = permuted_sources(row_id_map, counts, pad_offsets, probs, rows)
        storage = quantizer.quantize(x.contiguous(), splits, True, columnwise, src_rows=src)
        ctx.save_for_backward(row_id_map, pad_offsets)
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        ctx.grad_like = ((rows, x.shape[1]), x.dtype, probs.dtype)
        return GroupedTensor(storage, x.dtype), probs_P

    @staticmethod
    def backward(ctx, grad, grad_probs):
        grad = None if grad is None else grad.contiguous()
        dx, d_probs = mask_permute_grads(ctx, grad, grad_probs, ctx.needs_input_grad[1])
        return dx, d_probs, None, None, None, None, None, None
