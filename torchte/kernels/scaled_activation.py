"""An activation scaled per row: y = act(h) * s, the router's probabilities of a mixture-of-
experts MLP applied inside its activation.

Legend: h (M, K), K = 2N for gated activations (else N), s (M,) (any float dtype), a = act(h)
(M, N) in h's dtype, y (M, N) in h's dtype, dy (M, N).

The arithmetic, which grouped_activation_fp8's kernel reproduces value for value:
  a = activation_forward(h)                       (rounded to h's dtype)
  y = round_to_h_dtype(fp32(a) * fp32(s))
  g = round_to_h_dtype(fp32(dy) * fp32(s))        dh = activation_backward(g, h)
  ds = sum over the row of fp32(dy) * fp32(a)      (fp32, then s's dtype)
"""

from __future__ import annotations

import torch

from .activation import activation_backward, activation_forward

__all__ = ["scaled_activation_backward", "scaled_activation_forward"]


def scaled_activation_forward(
    h: torch.Tensor, s: torch.Tensor, name: str, limit: float = 7.0, alpha: float = 1.702
) -> torch.Tensor:
    """y = act(h) * s[:, None], h (M, K), s (M,) -> y (M, N) in h's dtype."""
    a = activation_forward(h, name, limit, alpha)
    return (a.float() * s.float()[:, None]).to(h.dtype)


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
    s32 = s.float()[:, None]
    g = (dy.float() * s32).to(h.dtype)
    dh = activation_backward(g, h, name, limit, alpha)
    ds = None
    if need_ds:
        a = activation_forward(h, name, limit, alpha)
        ds = (dy.float() * a.float()).sum(-1).to(s.dtype)
    return dh, ds
