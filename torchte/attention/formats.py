"""qkv_format handling: Transformer Engine's "sbhd", "bshd" and "thd" tensors, checked and
viewed as the [b, h, s, d] tensors PyTorch's attention kernels take.

Legend: s sequence, b batch, h heads (hg key/value heads), d head size, t total tokens.
q, k and v may be views of one packed tensor (sb3hd, sbh3d, bshd_bs2hd, ...): only their
shapes matter here, never their strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "QKV_FORMATS",
    "Shapes",
    "check_hidden_states",
    "check_qkv",
    "check_qkv_format",
    "from_bhsd",
    "to_bhsd",
]

QKV_FORMATS = ("sbhd", "bshd", "thd")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The layouts, in words, of a layer's input (hidden) and of attention's q, k, v (heads).
_HIDDEN_LAYOUTS = {
    "sbhd": "3-D [seq, batch, hidden]",
    "bshd": "3-D [batch, seq, hidden]",
    "thd": "2-D [tokens, hidden]",
}
_HEADS_LAYOUTS = {
    "sbhd": "[seq, batch, heads, head_dim]",
    "bshd": "[batch, seq, heads, head_dim]",
    "thd": "[tokens, heads, head_dim]",
}


def check_qkv_format(qkv_format: str) -> str:
    """qkv_format itself: one of QKV_FORMATS, ValueError naming it otherwise."""
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    return qkv_format


def check_hidden_states(
    owner: str, name: str, x, hidden_size: int, qkv_format: str, format_arg: str
) -> None:
    """The input of a layer that attends (te.TransformerLayer, te.MultiheadAttention): a
    tensor of the layout `qkv_format` names (format_arg: the layer's argument that set it)
    whose last dim is hidden_size; TypeError / ValueError naming that layout, before any
    projection runs."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(x).__name__}")
    rank = 2 if qkv_format == "thd" else 3
    if x.dim() == rank and x.shape[-1] == hidden_size:
        return
    others = ", ".join(f"{f!r} {_HIDDEN_LAYOUTS[f]}" for f in QKV_FORMATS if f != qkv_format)
    raise ValueError(
        f"{owner}: {name} must be {_HIDDEN_LAYOUTS[qkv_format]} with hidden = hidden_size = "
        f"{hidden_size} ({format_arg}={qkv_format!r}; the other formats take {others}), got "
        f"shape {list(x.shape)}"
    )


@dataclass(frozen=True)
class Shapes:
    """Sizes of one call: b (None for thd), sq, skv (token counts for thd), h, hg, dk, dv."""

    b: int | None
    sq: int
    skv: int
    h: int
    hg: int
    dk: int
    dv: int


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv_format: str,
    kv_heads: int,
    dk: int,
    dv: int,
) -> Shapes:
    """Check query/key/value against the format and the module's sizes (kv_heads key/value heads
    of dk / dv channels): TypeError or ValueError naming the argument, before any kernel."""
    names = ("query_layer", "key_layer", "value_layer")
    for name, x in zip(names, (q, k, v), strict=True):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    rank = 3 if qkv_format == "thd" else 4
    for name, x in zip(names, (q, k, v), strict=True):
        if x.dim() != rank:
            raise ValueError(
                f"{name} must be {rank}-D {_HEADS_LAYOUTS[qkv_format]} for "
                f"qkv_format={qkv_format!r}, got shape {list(x.shape)}"
            )
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp32, bf16 or fp16, got {x.dtype}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(
                f"{name} must have query_layer's dtype and device ({q.dtype}, {q.device}), "
                f"got {x.dtype}, {x.device}"
            )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"key_layer and value_layer must agree in all but the last dim, got "
            f"{list(k.shape)} and {list(v.shape)}"
        )
    _check_sizes(q, k, v, kv_heads, dk, dv)
    if qkv_format == "thd":
        return Shapes(None, q.shape[0], k.shape[0], q.shape[1], k.shape[1], dk, dv)
    s_dim, b_dim = (0, 1) if qkv_format == "sbhd" else (1, 0)
    if q.shape[b_dim] != k.shape[b_dim]:
        raise ValueError(
            f"query_layer and key_layer must have the same batch size, got {q.shape[b_dim]} "
            f"and {k.shape[b_dim]} (qkv_format={qkv_format!r})"
        )
    return Shapes(q.shape[b_dim], q.shape[s_dim], k.shape[s_dim], q.shape[-2], kv_heads, dk, dv)


def _check_sizes(q, k, v, kv_heads: int, dk: int, dv: int) -> None:
    if q.shape[-1] != dk or k.shape[-1] != dk:
        raise ValueError(
            f"query_layer and key_layer must have kv_channels = {dk} channels per head, got "
            f"{q.shape[-1]} and {k.shape[-1]}"
        )
    if v.shape[-1] != dv:
        raise ValueError(
            f"value_layer must have {dv} channels per head (kv_channels), got {v.shape[-1]}"
        )
    if k.shape[-2] != kv_heads:
        raise ValueError(
            f"key_layer and value_layer must have num_gqa_groups / tp_size = {kv_heads} heads, "
            f"got {k.shape[-2]}"
        )
    if q.shape[-2] % kv_heads != 0:
        raise ValueError(
            f"query_layer's {q.shape[-2]} heads must be a multiple of the {kv_heads} key/value "
            "heads (num_gqa_groups)"
        )


def to_bhsd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """A view [b, h, s, d] of an sbhd or bshd tensor."""
    if qkv_format == "sbhd":
        return x.permute(1, 2, 0, 3)
    return x.transpose(1, 2)


def from_bhsd(out: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """[b, h, s, dv] -> [s, b, h * dv] (sbhd) or [b, s, h * dv] (bshd), as Transformer Engine
    returns the attention output."""
    b, h, s, dv = out.shape
    if qkv_format == "sbhd":
        return out.permute(2, 0, 1, 3).reshape(s, b, h * dv)
    return out.transpose(1, 2).reshape(b, s, h * dv)
