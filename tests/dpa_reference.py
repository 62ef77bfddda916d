"""An fp64 reference of te.DotProductAttention written from Transformer Engine's documented
rules, element by element (tests import it as `from dpa_reference import ...`).

Legend: b batch, sq / skv query / key lengths, h query heads, hg key/value heads, d / dv head
sizes. Reference tensors are "bshd": q [b, sq, h, d], k [b, skv, hg, d], v [b, skv, hg, dv].
"""

from __future__ import annotations

import torch
from tolerances import representable

CAUSAL_TOP_LEFT = ("causal", "padding_causal")


def visible(
    mask_type: str,
    window: tuple[int, int],
    i: int,
    j: int,
    len_q: int,
    len_kv: int,
    bottom_right: bool | None = None,
) -> bool:
    """Whether query i sees key j by the mask type's diagonal and the window alone: query i
    sees keys in [i + off - left, i + off + right], off = len_kv - len_q when the diagonal is
    bottom-right (bottom_right types, and the non-causal types unless told otherwise), else 0;
    causal types have right = 0; -1 is unbounded."""
    causal = "causal" in mask_type
    if mask_type in CAUSAL_TOP_LEFT:
        aligned_right = False
    elif "bottom_right" in mask_type:
        aligned_right = True
    else:
        aligned_right = True if bottom_right is None else bottom_right
    off = len_kv - len_q if aligned_right else 0
    left, right = window
    if causal:
        right = 0
    if right >= 0 and j > i + off + right:
        return False
    return not (left >= 0 and j < i + off - left)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask_type: str = "no_mask",
    window: tuple[int, int] = (-1, -1),
    pad_q: torch.Tensor | None = None,
    pad_kv: torch.Tensor | None = None,
    arbitrary: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bottom_right: bool | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias + alibi, masked) v in fp64 -> [b, sq, h, dv]; pad_* are
    [b, s] bool (True = padding), arbitrary [b|1, h|1, sq, skv] bool (True = masked out),
    alibi_slopes [h] or [b, h]. Rows that see no key are 0."""
    q, k, v = (x.to(torch.float64) for x in (q, k, v))
    b, sq, h, _ = q.shape
    skv, group = k.shape[1], h // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    allowed = torch.ones(b, h, sq, skv, dtype=torch.bool)
    for bi in range(b):
        len_q = sq if pad_q is None else int((~pad_q[bi]).sum())
        len_kv = skv if pad_kv is None else int((~pad_kv[bi]).sum())
        off = len_kv - len_q
        for i in range(sq):
            for j in range(skv):
                ok = visible(mask_type, window, i, j, len_q, len_kv, bottom_right)
                if pad_q is not None:
                    ok = ok and not bool(pad_q[bi, i]) and not bool(pad_kv[bi, j])
                if not ok:
                    allowed[bi, :, i, j] = False
                if alibi_slopes is not None:
                    slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[bi]
                    br = _aligned_right(mask_type, bottom_right)
                    distance = abs(i - j + (off if br else 0))
                    scores[bi, :, i, j] -= slopes.to(torch.float64) * distance
    if arbitrary is not None:
        allowed = allowed & ~arbitrary.expand(b, h, sq, skv)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    probs = probs * allowed.any(-1, keepdim=True)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def _aligned_right(mask_type: str, bottom_right: bool | None) -> bool:
    if mask_type in CAUSAL_TOP_LEFT:
        return False
    if "bottom_right" in mask_type:
        return True
    return True if bottom_right is None else bottom_right


def to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """A bshd tensor [b, s, ...] in `fmt` (sbhd swaps the first two dims), contiguous."""
    return x.transpose(0, 1).contiguous() if fmt == "sbhd" else x.contiguous()


def output_to_bshd(out: torch.Tensor, fmt: str, h: int) -> torch.Tensor:
    """The module's output ([s, b, h * dv] or [b, s, h * dv]) as [b, s, h, dv]."""
    if fmt == "sbhd":
        out = out.transpose(0, 1)
    return out.reshape(out.shape[0], out.shape[1], h, -1)


def qkv(b, sq, skv, h, hg, d, dv, dtype, generator=None):
    """Representable q [b, sq, h, d], k [b, skv, hg, d], v [b, skv, hg, dv] (fp32 values exact
    in dtype), and a representable output gradient [b, sq, h, dv]."""
    shapes = ((b, sq, h, d), (b, skv, hg, d), (b, skv, hg, dv), (b, sq, h, dv))
    return [representable(s, dtype, generator=generator) for s in shapes]


def padding(lengths: list[int], s: int) -> torch.Tensor:
    """[b, s] bool, True at positions >= each length (sequences padded at their end)."""
    return torch.arange(s).view(1, s) >= torch.tensor(lengths).view(-1, 1)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """int32 [b + 1] cumulative lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
