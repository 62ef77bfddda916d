"""Small helpers both GEMM files use (gemm.py, gemm_block.py)."""

from __future__ import annotations

import torch

__all__ = ["empty_product", "fp32_mm"]


def fp32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) in fp32 (both fp32), also inside a torch.autocast region, which would
    otherwise run the product in its low-precision dtype."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b)


def empty_product(m, n, device, out_dtype, bias, out, accumulate) -> torch.Tensor:
    """An (M, N) product with an empty dimension: zeros plus bias, written to / added to `out`
    when given."""
    if out is None:
        out = torch.zeros(m, n, dtype=out_dtype, device=device)
    elif not accumulate:
        out.zero_()
    if bias is not None and m > 0:
        out += bias.to(out.dtype)
    return out
