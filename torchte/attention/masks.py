"""Attention masks with Transformer Engine's conventions: mask types, sliding windows, padding,
arbitrary masks and ALiBi, described once (`MaskPlan`) and turned into what each backend takes.

Legend: b batch, h query heads, sq / skv query / key sequence lengths.

- `attention_mask` is True where a position is masked OUT. Padding masks are [b, 1, 1, s] (one
  for self-attention, or a (q, kv) pair); an "arbitrary" mask is [b|1, h|1, sq, skv].
- A window (left, right) lets query i see keys j with i + off - left <= j <= i + off + right,
  where off is 0 for top-left alignment and skv - sq (per sequence, with padding) for
  bottom-right alignment; -1 is unbounded on that side. Causal masks are windows with right 0.
- A query row that sees no key gives zeros (as Transformer Engine's fused kernels do).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

__all__ = [
    "MASK_TYPES",
    "MaskPlan",
    "alibi_bias",
    "allowed_mask",
    "check_alibi_slopes",
    "check_arbitrary",
    "check_bias",
    "check_window_size",
    "default_alibi_slopes",
    "dense_plan",
    "mask_mod",
    "normalize_mask_type",
    "padding_from_cu_seqlens",
    "padding_from_mask",
    "padding_masks",
    "plan_mask",
    "same_device",
]

MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
_TOP_LEFT_CAUSAL = ("causal", "padding_causal")


def normalize_mask_type(attn_mask_type: str) -> str:
    """Transformer Engine's spelling rules: "padding,causal", "causal,padding" and
    "causal_padding" mean "padding_causal". ValueError naming attn_mask_type otherwise."""
    if not isinstance(attn_mask_type, str):
        raise TypeError(f"attn_mask_type must be a str, got {type(attn_mask_type).__name__}")
    name = attn_mask_type.replace(",", "_")
    if name == "causal_padding":
        name = "padding_causal"
    if name not in MASK_TYPES:
        raise ValueError(f"attn_mask_type must be one of {MASK_TYPES}, got {attn_mask_type!r}")
    return name


def check_window_size(attn_mask_type: str, window_size: tuple[int, int] | None) -> tuple[int, int]:
    """The window for a mask type, by Transformer Engine's rule: causal types take (-1, 0) or
    (>=0, 0); the others (-1, -1) or (>=0, >=0). None gives the type's default; (-1, -1) for a
    causal type, (>=0, >0) for a causal type, and (-1, 0) for a non-causal type are corrected
    with a warning (as Transformer Engine does); anything else is a ValueError."""
    if window_size is not None:
        if (
            not isinstance(window_size, tuple | list)
            or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
        ):
            raise TypeError(f"window_size must be a pair of ints or None, got {window_size!r}")
        window_size = (int(window_size[0]), int(window_size[1]))
    rule = "(-1, 0) or (>=0, 0)" if "causal" in attn_mask_type else "(-1, -1) or (>=0, >=0)"
    message = f"window_size should be {rule} for attn_mask_type={attn_mask_type!r}"
    if "causal" in attn_mask_type:
        if window_size is None:
            return (-1, 0)
        left, right = window_size
        if window_size == (-1, -1) or (left >= 0 and right != 0):
            warnings.warn(f"{message}; using ({left}, 0)", UserWarning, stacklevel=3)
            return (left, 0)
        if window_size != (-1, 0) and (left < 0 or right != 0):
            raise ValueError(f"{message}, got {window_size}")
        return window_size
    if window_size is None:
        return (-1, -1)
    if window_size == (-1, 0):
        warnings.warn(f"{message}; using (-1, -1)", UserWarning, stacklevel=3)
        return (-1, -1)
    if window_size != (-1, -1) and (window_size[0] < 0 or window_size[1] < 0):
        raise ValueError(f"{message}, got {window_size}")
    return window_size


@dataclass(frozen=True)
class MaskPlan:
    """Everything that decides which keys a query sees, and the additive bias, for one call.

    left, right: the window (-1: unbounded); causal types have right == 0.
    bottom_right: the window's (and ALiBi's) diagonal ends at the bottom-right corner.
    pad_q, pad_kv: [b, sq] / [b, skv] bool, True at padded positions (or None).
    arbitrary: [b|1, h|1, sq, skv] bool, True where masked out (or None).
    """

    left: int
    right: int
    bottom_right: bool
    sq: int
    skv: int
    pad_q: torch.Tensor | None = None
    pad_kv: torch.Tensor | None = None
    arbitrary: torch.Tensor | None = None

    @property
    def windowed(self) -> bool:
        """Whether a window (causal included) limits the keys."""
        return self.left >= 0 or self.right >= 0

    @property
    def is_plain_causal(self) -> bool:
        """Causal with the top-left diagonal and nothing else: SDPA's is_causal."""
        top_left = not self.bottom_right or self.sq == self.skv
        return (
            self.left < 0
            and self.right == 0
            and top_left
            and self.pad_q is None
            and self.arbitrary is None
        )

    @property
    def is_empty(self) -> bool:
        """Nothing is masked."""
        return not self.windowed and self.pad_q is None and self.arbitrary is None

    def offset(self) -> torch.Tensor | int:
        """The diagonal's offset: 0 top-left, skv - sq bottom-right ([b, 1, 1, 1] int64 per
        sequence with padding, else an int)."""
        if not self.bottom_right:
            return 0
        if self.pad_q is not None:
            len_q = (~self.pad_q).sum(-1)
            len_kv = (~self.pad_kv).sum(-1)
            return (len_kv - len_q).view(-1, 1, 1, 1)
        return self.skv - self.sq


def plan_mask(
    mask_type: str,
    window: tuple[int, int],
    sq: int,
    skv: int,
    pad_q: torch.Tensor | None = None,
    pad_kv: torch.Tensor | None = None,
    arbitrary: torch.Tensor | None = None,
    bottom_right_diagonal: bool | None = None,
) -> MaskPlan:
    """The MaskPlan of a (checked) mask type and window. Non-causal types align the window and
    ALiBi to the bottom right unless bottom_right_diagonal is False, as Transformer Engine."""
    if mask_type in _TOP_LEFT_CAUSAL:
        bottom_right = False
    elif "bottom_right" in mask_type:
        bottom_right = True
    else:
        bottom_right = True if bottom_right_diagonal is None else bool(bottom_right_diagonal)
    left, right = window
    if "causal" in mask_type:
        right = 0
    return MaskPlan(left, right, bottom_right, sq, skv, pad_q, pad_kv, arbitrary)


def mask_mod(plan: MaskPlan, offset: torch.Tensor | int):
    """A function (b, h, qi, kj) -> bool tensor, True where query qi may see key kj: the one
    definition of the mask, used vectorized (allowed_mask) and by flex_attention."""
    left, right = plan.left, plan.right
    pad_q, pad_kv, arbitrary = plan.pad_q, plan.pad_kv, plan.arbitrary
    per_batch = isinstance(offset, torch.Tensor)
    off_b = offset.view(-1) if per_batch else None

    def allowed(b, h, qi, kj):
        off = off_b[b] if per_batch else offset
        ok = torch.ones_like(qi - kj, dtype=torch.bool)
        if right >= 0:
            ok = ok & (kj - qi <= off + right)
        if left >= 0:
            ok = ok & (qi + off - kj <= left)
        if pad_q is not None:
            ok = ok & ~pad_q[b, qi] & ~pad_kv[b, kj]
        if arbitrary is not None:
            mb = b if arbitrary.shape[0] > 1 else torch.zeros_like(b)
            mh = h if arbitrary.shape[1] > 1 else torch.zeros_like(h)
            ok = ok & ~arbitrary[mb, mh, qi, kj]
        return ok

    return allowed


def allowed_mask(plan: MaskPlan, num_heads: int, device: torch.device) -> torch.Tensor | None:
    """[b|1, h|1, sq, skv] bool, True where a query may see a key; None if nothing is masked."""
    if plan.is_empty:
        return None
    nb = 1
    if plan.pad_q is not None:
        nb = plan.pad_q.shape[0]
    elif plan.arbitrary is not None:
        nb = plan.arbitrary.shape[0]
    nh = num_heads if plan.arbitrary is not None and plan.arbitrary.shape[1] > 1 else 1
    b = torch.arange(nb, device=device).view(nb, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, nh, 1, 1)
    qi = torch.arange(plan.sq, device=device).view(1, 1, plan.sq, 1)
    kj = torch.arange(plan.skv, device=device).view(1, 1, 1, plan.skv)
    offset = plan.offset()
    allowed = mask_mod(plan, offset)(b, h, qi, kj)
    return allowed.expand(nb, nh, plan.sq, plan.skv)


def default_alibi_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """ALiBi's slopes for num_heads heads, fp32 [h]: 2^(-8 i / n) for i = 1..n, n the largest
    power of two <= h, then the odd steps of 2^(-4 / n) for the heads beyond n."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, n + 1, dtype=torch.float64))
    if n < num_heads:
        extra = torch.arange(1, 2 * (num_heads - n), 2, dtype=torch.float64)
        slopes = torch.cat([slopes, torch.pow(2.0 ** (-4.0 / n), extra)])
    return slopes.to(device=device, dtype=torch.float32)


def alibi_bias(plan: MaskPlan, slopes: torch.Tensor) -> torch.Tensor:
    """fp32 [b|1, h, sq, skv]: -slope * |i - j + off|, off the plan's diagonal offset.
    slopes: fp32 [h] or [b, h]."""
    device = slopes.device
    qi = torch.arange(plan.sq, device=device).view(1, 1, plan.sq, 1)
    kj = torch.arange(plan.skv, device=device).view(1, 1, 1, plan.skv)
    distance = (qi - kj + plan.offset()).abs().to(torch.float32)
    per_head = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes[:, :, None, None]
    return -per_head.to(torch.float32) * distance


def _check_padding_tensor(mask, name: str, b: int, s: int) -> torch.Tensor:
    """A padding mask [b, 1, 1, s] bool -> [b, s]; TypeError / ValueError naming it."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = masked out), got {mask.dtype}")
    if tuple(mask.shape) != (b, 1, 1, s):
        raise ValueError(
            f"{name} of a padding mask must have shape [b, 1, 1, s] = {[b, 1, 1, s]}, "
            f"got {list(mask.shape)}"
        )
    return mask.view(b, s)


def padding_from_mask(attention_mask, b: int, sq: int, skv: int):
    """(pad_q [b, sq], pad_kv [b, skv]) bool from a padding attention_mask: one [b, 1, 1, s]
    tensor (sq == skv) or a (q, kv) pair of them."""
    if isinstance(attention_mask, tuple | list):
        if len(attention_mask) != 2:
            raise ValueError(
                f"attention_mask as a tuple must be (q_mask, kv_mask), got {len(attention_mask)}"
            )
        pad_q = _check_padding_tensor(attention_mask[0], "attention_mask[0]", b, sq)
        pad_kv = _check_padding_tensor(attention_mask[1], "attention_mask[1]", b, skv)
        return pad_q, pad_kv
    if sq != skv:
        raise ValueError(
            "attention_mask: with sq != skv (cross-attention) a padding mask must be a pair "
            f"(q_mask [b, 1, 1, sq], kv_mask [b, 1, 1, skv]); got one tensor (sq={sq}, skv={skv})"
        )
    pad = _check_padding_tensor(attention_mask, "attention_mask", b, sq)
    return pad, pad


def padding_from_cu_seqlens(cu_seqlens: torch.Tensor, name: str, b: int, s: int) -> torch.Tensor:
    """[b, s] bool, True at positions >= each sequence's length, from int32 cu_seqlens [b + 1]
    of sequences padded at their end to s."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or tuple(cu_seqlens.shape) != (b + 1,):
        raise ValueError(
            f"{name} must be an int32 tensor of shape [batch_size + 1] = [{b + 1}], got "
            f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return torch.arange(s, device=cu_seqlens.device).view(1, s) >= lengths.view(b, 1)


def check_arbitrary(attention_mask, b: int, h: int, sq: int, skv: int) -> torch.Tensor:
    """An "arbitrary" attention_mask: bool [b|1, h|1, sq, skv]; TypeError / ValueError."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            "attention_mask for attn_mask_type='arbitrary' must be a bool tensor "
            f"[b|1, h|1, sq, skv], got {type(attention_mask).__name__}"
        )
    if attention_mask.dtype != torch.bool:
        raise TypeError(
            f"attention_mask must be a bool tensor (True = masked out), got {attention_mask.dtype}"
        )
    shape = tuple(attention_mask.shape)
    if (
        len(shape) != 4
        or shape[0] not in (1, b)
        or shape[1] not in (1, h)
        or shape[2:] != (sq, skv)
    ):
        raise ValueError(
            f"attention_mask for attn_mask_type='arbitrary' must have shape [b|1, h|1, sq, skv] "
            f"with b={b}, h={h}, sq={sq}, skv={skv}; got {list(shape)}"
        )
    return attention_mask


def same_device(device: torch.device, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name} must be on query_layer's device {device}, got {tensor.device}"
            )


def padding_masks(mask_type, attention_mask, cu_q, cu_kv, shapes):
    """(pad_q [b, sq], pad_kv [b, skv]) bool of a padding mask type: from cu_seqlens_q /
    cu_seqlens_kv where given (sequences padded at their end), else from attention_mask."""
    from_mask = None
    if cu_q is None or cu_kv is None:
        if attention_mask is None:
            raise ValueError(
                f"attn_mask_type={mask_type!r} needs attention_mask ([b, 1, 1, s] bool, True = "
                "padding, or a (q, kv) pair) or cu_seqlens_q and cu_seqlens_kv"
            )
        from_mask = padding_from_mask(attention_mask, shapes.b, shapes.sq, shapes.skv)
    b = shapes.b
    pad_q = (
        from_mask[0]
        if cu_q is None
        else padding_from_cu_seqlens(cu_q, "cu_seqlens_q", b, shapes.sq)
    )
    pad_kv = (
        from_mask[1]
        if cu_kv is None
        else padding_from_cu_seqlens(cu_kv, "cu_seqlens_kv", b, shapes.skv)
    )
    return pad_q, pad_kv


def check_bias(bias, shapes, q: torch.Tensor) -> torch.Tensor:
    """core_attention_bias: a float tensor [1|b, 1|h, sq, skv] on q's device."""
    if not isinstance(bias, torch.Tensor):
        raise ValueError(
            "core_attention_bias must be a tensor [1|b, 1|h, sq, skv] for a pre/post-scale "
            f"bias, got {type(bias).__name__}"
        )
    shape = tuple(bias.shape)
    if (
        not bias.is_floating_point()
        or len(shape) != 4
        or shape[0] not in (1, shapes.b)
        or shape[1] not in (1, shapes.h)
        or shape[2:] != (shapes.sq, shapes.skv)
    ):
        raise ValueError(
            f"core_attention_bias must be a float tensor [1|b, 1|h, sq, skv] with b={shapes.b}, "
            f"h={shapes.h}, sq={shapes.sq}, skv={shapes.skv}; got {bias.dtype} {list(shape)}"
        )
    same_device(q.device, core_attention_bias=bias)
    return bias


def check_alibi_slopes(slopes, shapes, q: torch.Tensor) -> torch.Tensor:
    """alibi_slopes: [h] or [b, h] floats on q's device, as fp32."""
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        raise ValueError("alibi_slopes must be a float tensor [h] or [b, h]")
    if tuple(slopes.shape) not in ((shapes.h,), (shapes.b, shapes.h)):
        raise ValueError(
            f"alibi_slopes must have shape [h] = [{shapes.h}] or [b, h] = [{shapes.b}, "
            f"{shapes.h}], got {list(slopes.shape)}"
        )
    same_device(q.device, alibi_slopes=slopes)
    return slopes.to(torch.float32)


def dense_plan(
    mask_type,
    window,
    shapes,
    attention_mask,
    cu_q,
    cu_kv,
    max_q,
    max_kv,
    bottom_right_diagonal,
    device,
) -> MaskPlan:
    """The MaskPlan of an sbhd / bshd call, its mask tensors checked."""
    for name, given, actual in (
        ("max_seqlen_q", max_q, shapes.sq),
        ("max_seqlen_kv", max_kv, shapes.skv),
    ):
        if given is not None and given != actual:
            raise ValueError(
                f"{name}={given} differs from the sequence length {actual} of the inputs"
            )
    pad_q = pad_kv = arbitrary = None
    if "padding" in mask_type:
        pad_q, pad_kv = padding_masks(mask_type, attention_mask, cu_q, cu_kv, shapes)
        same_device(device, attention_mask=pad_q, cu_seqlens_kv=pad_kv)
    elif mask_type == "arbitrary":
        if attention_mask is None:
            raise ValueError("attn_mask_type='arbitrary' needs an attention_mask")
        arbitrary = check_arbitrary(attention_mask, shapes.b, shapes.h, shapes.sq, shapes.skv)
        same_device(device, attention_mask=arbitrary)
    return plan_mask(
        mask_type,
        window,
        shapes.sq,
        shapes.skv,
        pad_q,
        pad_kv,
        arbitrary,
        bottom_right_diagonal,
    )
