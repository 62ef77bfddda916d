"""An activation scaled per row: y = act(h) * s, the router's probabilities of a mixture-of-
experts MLP applied inside its activation.

Legend: h (M, K), K = 2N for gated activations (else N), s (M,) (any float dtype), a = act(h)
(M, N) in h's dtype, y (M, N) in h's dtype, dy (M, N) in h's dtype.

The arithmetic, which grouped_activation_fp8's kernels reproduce value for value (s is first
rounded to h's dtype, as every other operand of the MLP is; each product is rounded once):
  a = activation_forward(h)                       (rounded to h's dtype)
  y = round(a * round(s))
  g = round(dy * round(s))                         dh = activation_backward(g, h)
  ds = sum over the row of dy * a                  (fp32 sums, then s's dtype)
"""

from __future__ import annotations

import torch

from .activation import activation_backward, activation_forward

__all__ = ["row_dots", "scaled_activation_backward", "scaled_activation_forward"]


def scaled_activation_forward(
    h: torch.Tensor, s: torch.Tensor, name: str, limit: float = 7.0, alpha: float = 1.702
) -> torch.Tensor:
    """y = act(h) * s[:, None], h (M, K), s (M,) -> y (M, N) in h's dtype."""
    a = activation_forward(h, name, limit, alpha)
    return a.mul_(s.to(h.dtype)[:, None])


def scaled_activation_backward(
    dy: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    name: str,
    limit: float = 7.0,
    alpha: float = 1.702,
    need_ds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh (M, K) in h's dtype, ds (M,) in s's dtype or None unless need_ds)."""
    dy = dy.to(h.dtype)
    dh = activation_backward(dy * s.to(h.dtype)[:, None], h, name, limit, alpha)
    ds = None
    if need_ds:
        ds = row_dots(dy, activation_forward(h, name, limit, alpha)).to(s.dtype)
    return dh, ds


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M,) fp32: the dot product of each row of a and b (M, N), the products summed in fp32
    without an fp32 copy of either on a GPU (a batched GEMM)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a[:, None, :], b[:, :, None], out_dtype=torch.float32).view(-1)
    return (a.float() * b.float()).sum(-1)
