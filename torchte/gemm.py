"""The one place that chooses a GEMM.

High precision: torch.nn.functional.linear / torch.mm / torch.addmm (fp32 output for wgrad
accumulation). FP8: torch._scaled_mm on a GPU; on a CPU the FP8 operands are multiplied in fp32
(products of FP8 values are exact there) and scaled after.

Every FP8 GEMM here takes both operands "K-major": a (M, K) and b (N, K), row-major, and gives
out (M, N) = (a * a_scale_inv) @ (b * b_scale_inv).T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fp8_gemm", "hp_linear", "hp_mm"]


def hp_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T + bias (N,) -> (M, N), in x's dtype."""
    return F.linear(x, w, bias)


def hp_mm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False
) -> torch.Tensor:
    """a (M, K) @ b (K, N). With `out` (M, N) fp32: written (accumulate=False) or added to
    (accumulate=True) in place, products accumulated in fp32; without it, a's dtype."""
    if out is None:
        return torch.mm(a, b)
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if accumulate:
            return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    a32, b32 = a.float(), b.float()
    if accumulate:
        return out.addmm_(a32, b32)
    return torch.mm(a32, b32, out=out)


def fp8_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """a (M, K) fp8, b (N, K) fp8, scale_invs (1,) fp32 -> (M, N) in out_dtype (+ bias (N,)).

    With `out` (M, N) fp32 the result is written into it, or added to it (accumulate=True).
    """
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return _empty_product(m, n, a.device, out_dtype, bias, out, accumulate)
    if a.is_cuda:
        return _scaled_mm_cuda(
            a, a_scale_inv, b, b_scale_inv, out_dtype, bias, out, accumulate, use_fast_accum
        )
    prod = torch.mm(a.float(), b.float().t()) * (a_scale_inv * b_scale_inv)
    if bias is not None:
        prod = prod + bias.float()
    if out is None:
        return prod.to(out_dtype)
    return out.add_(prod) if accumulate else out.copy_(prod)


def _scaled_mm_cuda(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, out, accumulate, fast):
    fused_bias = bias if (bias is not None and out_dtype != torch.float32) else None
    if out is not None and not accumulate:
        torch._scaled_mm(
            a, b.t(), a_scale_inv, b_scale_inv, fused_bias, None, out_dtype, fast, out=out
        )
        result = out
    else:
        result = torch._scaled_mm(
            a, b.t(), a_scale_inv, b_scale_inv, fused_bias, None, out_dtype, fast
        )
        if out is not None:
            # cuBLAS could add in place (beta = 1); torch._scaled_mm does not expose it.
            result = out.add_(result)
    if bias is not None and fused_bias is None:
        result = result.add_(bias)
    return result


def _empty_product(m, n, device, out_dtype, bias, out, accumulate) -> torch.Tensor:
    """An (M, N) product with an empty dimension: zeros plus bias, written to / added to `out`
    when given."""
    if out is None:
        out = torch.zeros(m, n, dtype=out_dtype, device=device)
    elif not accumulate:
        out.zero_()
    if bias is not None and m > 0:
        out += bias.to(out.dtype)
    return out
