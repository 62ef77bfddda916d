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


def permuted_sources(row_id_map: torch.Tensor, pad_offsets: torch.Tensor, rows: int):
    """(src (P,) int32: the token of each permuted row, -1 for pad and spare rows; expert
    (P,) int64: its expert, 0 for those rows) from the mask map, without a host sync."""
    tokens, width = row_id_map.shape
    experts = (width - 1) // 2
    row = row_id_map[:, :experts].long()
    expert = row_id_map[:, experts : 2 * experts].long()
    routed = row >= 0
    padded = row + pad_offsets.long()[expert.clamp(min=0)]
    index = torch.where(routed, padded, rows).reshape(-1)  # unused slots: the spare slot P
    token = torch.arange(tokens, device=row.device).unsqueeze(1).expand(tokens, experts)
    src = torch.full((rows + 1,), -1, dtype=torch.int64, device=row.device)
    src.scatter_(0, index, torch.where(routed, token, -1).reshape(-1))
    expert_of = torch.zeros(rows + 1, dtype=torch.int64, device=row.device)
    expert_of.scatter_(0, index, torch.where(routed, expert, 0).reshape(-1))
    return src[:rows].int(), expert_of[:rows]


class GatherQuantize(torch.autograd.Function):
    """x (T, H) -> the permuted rows x[src] quantized for the experts' first GEMM, as a
    GroupedTensor (P, H) of x's dtype; backward: each token's gradient is the sum of its rows'
    (the unpermutation)."""

    @staticmethod
    def forward(ctx, x, src, row_id_map, pad_offsets, quantizer, splits, columnwise):
        storage = quantizer.quantize(x.contiguous(), splits, True, columnwise, src_rows=src)
        ctx.save_for_backward(row_id_map, pad_offsets)
        return GroupedTensor(storage, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        row_id_map, pad_offsets = ctx.saved_tensors
        dx, _ = kernels.unpermute_rows(grad.contiguous(), row_id_map, None, None, pad_offsets, 0)
        return dx, None, None, None, None, None, None
