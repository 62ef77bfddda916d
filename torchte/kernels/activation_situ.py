"""SiTU-GLU, the soft-capped SiLU-gated unit (Transformer Engine's situglu), forward and backward.

Shapes: x (M, 2N) = [a, b] (leading dims allowed), fp32 / bf16 / fp16; y and dy (M, N); dx
(M, 2N). y and dx have x's dtype; the math runs in fp32:
  y  = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2)
  dy/da = ((1 - t1^2) s + beta1 t1 s (1 - s)) * beta2 t2,   t1 = tanh(a / beta1), s = sigmoid(a)
  dy/db = beta1 t1 s * (1 - t2^2),                          t2 = tanh(b / beta2)
1 - s is taken as sigmoid(-a) (no cancellation where s is near 1).

Torch ops on every device (a few launches; there is no Triton kernel of it yet), so an op using
it writes its output in high precision and the next op quantizes it.
"""

from __future__ import annotations

import torch

__all__ = ["situglu_backward", "situglu_forward"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) of x in fp32, after checking x's dtype and that its last dim is even."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"situglu: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"situglu: x's last dim must be even (a, b halves), got {tuple(x.shape)}")
    a, b = x.float().chunk(2, dim=-1)
    return a, b


def _gate_act(a: torch.Tensor, beta1: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(beta1 tanh(a / beta1) sigmoid(a), tanh(a / beta1), sigmoid(a)) of fp32 a."""
    t1, s = torch.tanh(a / beta1), torch.sigmoid(a)
    return beta1 * t1 * s, t1, s


def situglu_forward(x: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """y = situ(a) * beta2 tanh(b / beta2): x (M, 2N) -> y (M, N) in x's dtype."""
    a, b = _halves(x)
    act, _, _ = _gate_act(a, beta1)
    return (act * (beta2 * torch.tanh(b / beta2))).to(x.dtype)


def situglu_backward(
    dy: torch.Tensor, x: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """dx = dy * dy/dx: dy (M, N), x (M, 2N) -> dx (M, 2N) in x's dtype."""
    a, b = _halves(x)
    want = (*x.shape[:-1], x.shape[-1] // 2)
    if dy.shape != want:
        got = tuple(dy.shape)
        raise ValueError(f"situglu: dy must have shape {want} for x {tuple(x.shape)}, got {got}")
    dy32 = dy.float()
    act, t1, s = _gate_act(a, beta1)
    t2 = torch.tanh(b / beta2)
    dact = (1.0 - t1 * t1) * s + beta1 * t1 * s * torch.sigmoid(-a)
    da = dy32 * dact * (beta2 * t2)
    db = dy32 * act * (1.0 - t2 * t2)
    return torch.cat([da, db], dim=-1).to(x.dtype)
