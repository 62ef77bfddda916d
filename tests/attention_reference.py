"""Plain-PyTorch fp64 references for te.MultiheadAttention and te.TransformerLayer tests (tests
import it as `from attention_reference import ...`).

Legend: s query tokens, sk key tokens, b batch, h hidden, np query heads, ng key/value groups,
hn channels per head; tensors in "sbhd" order ((s, b, h) hidden states). `rnd(t, dtype)` rounds
an fp64 tensor through `dtype` where the module rounds (a module output in its compute
dtype), so what is left between module and reference is accumulation order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tolerances import representable


def rnd(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t (fp64) rounded to dtype and back (differentiable: the gradient is rounded too)."""
    return t.to(dtype).to(torch.float64)


def f64(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached fp64 leaf copy of t that requires grad (None stays None)."""
    if t is None:
        return None
    return t.detach().to(torch.float64).requires_grad_(True)


def norm(x, weight, bias, normalization: str, eps: float, zero_centered: bool = False):
    """LayerNorm (F.layer_norm) or RMSNorm of x (..., h) over h, weight (h,), bias (h,)."""
    w = weight + 1 if zero_centered else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, bias, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def linear(x, weight, bias, dtype):
    """rnd(x W^T + b): nn.functional.linear in fp64, rounded to the compute dtype."""
    return rnd(F.linear(x, weight, bias), dtype)


def qkv_rows(heads: int, groups: int, hn: int, interleaved: bool):
    """Row indices of the fused QKV weight for each head, written out from Transformer
    Engine's documented layout: (q (np, hn), k (ng, hn), v (ng, hn)) int64.

    Interleaved: per group g, its np/ng query heads, then k_g, then v_g. Otherwise all query
    heads, then all keys, then all values."""
    per = heads // groups
    q, k, v = [], [], []
    for h in range(heads):
        g, j = divmod(h, per)
        start = (g * (per + 2) + j) * hn if interleaved else h * hn
        q.append(list(range(start, start + hn)))
    for g in range(groups):
        if interleaved:
            k_start = (g * (per + 2) + per) * hn
            v_start = k_start + hn
        else:
            k_start = heads * hn + g * hn
            v_start = heads * hn + groups * hn + g * hn
        k.append(list(range(k_start, k_start + hn)))
        v.append(list(range(v_start, v_start + hn)))
    return torch.tensor(q), torch.tensor(k), torch.tensor(v)


def kv_rows(groups: int, hn: int, interleaved: bool):
    """Row indices of the fused key_value weight: (k (ng, hn), v (ng, hn))."""
    k, v = [], []
    for g in range(groups):
        k_start = 2 * g * hn if interleaved else g * hn
        v_start = k_start + hn if interleaved else groups * hn + g * hn
        k.append(list(range(k_start, k_start + hn)))
        v.append(list(range(v_start, v_start + hn)))
    return torch.tensor(k), torch.tensor(v)


def gather_heads(y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y (..., features), rows (n, hn) -> (..., n, hn): y's columns picked per head."""
    return y[..., rows.reshape(-1)].reshape(*y.shape[:-1], *rows.shape)


def attention(q, k, v, causal: bool, dtype) -> torch.Tensor:
    """Softmax attention in fp64: q (s, b, np, hn), k and v (sk, b, ng, hn) -> (s, b, np hn),
    rounded to dtype. Query head i reads key/value group i // (np / ng); causal masks key j
    > query i (top-left)."""
    s, b, heads, hn = q.shape
    per = heads // k.shape[2]
    q_ = q.permute(1, 2, 0, 3)
    k_ = k.permute(1, 2, 0, 3).repeat_interleave(per, dim=1)
    v_ = v.permute(1, 2, 0, 3).repeat_interleave(per, dim=1)
    scores = q_ @ k_.transpose(-1, -2) / math.sqrt(hn)
    if causal:
        sk = k.shape[0]
        above = torch.ones(s, sk, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v_
    return rnd(out.permute(2, 0, 1, 3).reshape(s, b, heads * hn), dtype)


def set_representable(module: torch.nn.Module, dtype: torch.dtype, scale: float) -> None:
    """Overwrite every parameter with values exact in dtype: norm weights near 1 (in
    [1 - 1/4, 1 + 1/4], or near 0 when zero-centered), the others in [-scale, scale]."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "layer_norm_weight" in name or name.endswith("norm.weight"):
                centered = getattr(_owner(module, name), "zero_centered_gamma", False)
                base = 0.0 if centered else 1.0
                param.copy_(base + representable(param.shape, dtype, scale=0.25))
            else:
                param.copy_(representable(param.shape, dtype, scale=scale))


def _owner(module: torch.nn.Module, name: str) -> torch.nn.Module:
    return module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
