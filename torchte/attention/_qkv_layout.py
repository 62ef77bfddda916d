"""How te.MultiheadAttention's projections lay out query, key and value, as Transformer Engine
lays them out, so that its checkpoints carry over.

Legend: np query heads, ng key/value groups (GQA; ng divides np), hn channels per head,
r = np / ng query heads per group; `...` the leading dims ([s, b], [b, s] or [t]).

Self attention, one projection of np*hn + 2*ng*hn features:
- interleaved (`qkv_weight_interleaved=True`, fused parameters only): per group g the r query
  heads of g, then k_g, then v_g: [ng, r + 2, hn]. Query head h belongs to group h // r.
- not interleaved: [q (np*hn); k (ng*hn); v (ng*hn)], each head's hn channels contiguous
  (the parameters_split "query", "key", "value" of the unfused layout).
Cross attention, the key_value projection of 2*ng*hn features:
- interleaved: [ng, 2, hn] (k_g, v_g per group); not interleaved: [k (ng*hn); v (ng*hn)].
"""

from __future__ import annotations

import torch

__all__ = ["split_kv", "split_qkv"]


def split_qkv(
    mixed: torch.Tensor, heads: int, groups: int, head_dim: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixed (..., (np + 2 ng) hn) -> q (..., np, hn), k (..., ng, hn), v (..., ng, hn)."""
    per_group = heads // groups
    lead = mixed.shape[:-1]
    if interleaved:
        grouped = mixed.view(*lead, groups, per_group + 2, head_dim)
        q, k, v = grouped.split((per_group, 1, 1), dim=-2)
    else:
        q, k, v = mixed.split((heads * head_dim, groups * head_dim, groups * head_dim), dim=-1)
    return (
        q.reshape(*lead, heads, head_dim),
        k.reshape(*lead, groups, head_dim),
        v.reshape(*lead, groups, head_dim),
    )


def split_kv(
    mixed: torch.Tensor, groups: int, head_dim: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """mixed (..., 2 ng hn) -> k (..., ng, hn), v (..., ng, hn)."""
    lead = mixed.shape[:-1]
    if interleaved:
        k, v = mixed.view(*lead, groups, 2, head_dim).split((1, 1), dim=-2)
    else:
        k, v = mixed.split((groups * head_dim, groups * head_dim), dim=-1)
    return k.reshape(*lead, groups, head_dim), v.reshape(*lead, groups, head_dim)
