"""Routing-map layouts and the quantile-balancing histogram of the MoE router, in torch ops
(the same on every device): the bit map a routing map packs into, the bool mask any routing
output (bool map, bit map, dense indices) stands for, and the histogram update.

Layouts: bool map (T, E); bit map uint8 (T, ceil(E / 8)) with bit e % 8 of byte e // 8 set for
expert e (LSB first, Transformer Engine's BITMAP_U8); dense indices (T, topk).
"""

from __future__ import annotations

import torch

__all__ = ["pack_bitmap", "qb_histogram_accumulate", "routing_to_mask"]


def pack_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """Bool (..., E) -> uint8 (..., ceil(E / 8)): bit e % 8 of byte e // 8 is mask[..., e]."""
    e = mask.shape[-1]
    nbytes = -(-e // 8)
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, nbytes * 8 - e))
    # shifts made on the device (no host-to-device copy: the call can be graph-captured)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (bits.view(*mask.shape[:-1], nbytes, 8) << shifts).sum(-1, dtype=torch.uint8)


def routing_to_mask(routing: torch.Tensor, layout: str, num_experts: int) -> torch.Tensor:
    """The bool routing mask (T, E) of a routing output of `layout` "bytemap" (bool (..., E)),
    "bitmap_u8" (uint8 (..., ceil(E / 8))) or "indices" (integer (..., topk))."""
    if layout == "indices":
        index = routing.reshape(-1, routing.shape[-1]).long()
        mask = torch.zeros(index.shape[0], num_experts, dtype=torch.bool, device=routing.device)
        return mask.scatter_(1, index, True)
    if layout == "bitmap_u8":
        shifts = torch.arange(8, dtype=torch.uint8, device=routing.device)
        bits = (routing.reshape(-1, routing.shape[-1], 1) >> shifts) & 1
        return bits.reshape(bits.shape[0], bits.shape[1] * 8)[:, :num_experts].bool()
    return routing.reshape(-1, num_experts)


def qb_histogram_accumulate(
    raw_scores: torch.Tensor,
    cutoff: torch.Tensor,
    bin_bounds: torch.Tensor,
    histogram: torch.Tensor,
) -> None:
    """Quantile balancing: add 1 to histogram[e, bin] for each token t and expert e, bin =
    floor((cutoff[t] - raw_scores[t, e] - lower) * num_bins / (upper - lower)) clamped to
    [0, num_bins). raw_scores (T, E) fp32 (the sigmoid), cutoff (T,) fp32, bin_bounds (2,) fp32
    [lower, upper], histogram (E, num_bins) int32, contiguous, updated in place (no host sync)."""
    num_experts, num_bins = histogram.shape
    raw = raw_scores.reshape(-1, num_experts)
    lower, upper = bin_bounds[0], bin_bounds[1]
    scale = num_bins / (upper - lower)
    bins = torch.floor((cutoff.reshape(-1, 1) - raw - lower) * scale)
    bins = bins.nan_to_num(0.0).clamp_(0, num_bins - 1).long()
    bins += torch.arange(num_experts, device=raw.device) * num_bins
    ones = torch.ones(1, dtype=histogram.dtype, device=histogram.device).expand(bins.numel())
    histogram.view(-1).index_add_(0, bins.view(-1), ones)
