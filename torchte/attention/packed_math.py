"""The math backend of packed (thd) attention, and the per-token layout the flex backend shares.

Shape legend: t query tokens, s key/value tokens, h query heads, hg key/value heads (h % hg == 0),
d query/key head size, dv value head size, b sequences.

A token's place in the pack is described by `PackedLayout`: which sequence it belongs to (-1 for
a token in the padding between sequences) and its position inside that sequence. Which keys a
query sees is one rule (`allowed`), evaluated on broadcast tensors by the dense path and on
scalar indices by flex's mask_mod:

    same sequence, and  pos_k >= pos_q + off - left  (left >= 0)
                   and  pos_k <= pos_q + off + right (right >= 0; right = 0 when causal)

with off = len_kv - len_q of the sequence for bottom-right alignment and 0 for top-left.
A query that sees no key (padding, an empty key sequence, a bottom-right causal row above the
diagonal) gets output 0 and sends no gradient. An attention sink (fp32 (h,) logits, _sinks.py)
adds exp(sink[h]) to each softmax denominator of head h.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._sinks import sink_softmax

__all__ = ["MaskSpec", "PackedLayout", "allowed", "dense_attention", "loop_attention"]


@dataclass(frozen=True)
class MaskSpec:
    """Which keys a query sees inside its sequence: causal, alignment, and the window
    (left, right) with -1 unbounded; `right` is already 0 when causal."""

    causal: bool
    bottom_right: bool
    left: int
    right: int


@dataclass(frozen=True)
class PackedLayout:
    """Per-token sequence index and position, built on the tensors' device without a host sync.

    seq_q (t,) int64: sequence of each query token, -1 in padding; pos_q (t,) its position.
    seq_kv (s,), pos_kv (s,): the same for key/value tokens.
    off_q (t,) int64: diagonal offset of each query token's sequence (0 for top-left).
    """

    seq_q: torch.Tensor
    pos_q: torch.Tensor
    seq_kv: torch.Tensor
    pos_kv: torch.Tensor
    off_q: torch.Tensor

    @staticmethod
    def build(
        cu_q: torch.Tensor,
        cu_kv: torch.Tensor,
        starts_q: torch.Tensor,
        starts_kv: torch.Tensor,
        t: int,
        s: int,
        bottom_right: bool,
    ) -> PackedLayout:
        """Layout from cu_seqlens (real lengths) and start offsets (padded or not), all (b+1,)."""
        len_q = (cu_q[1:] - cu_q[:-1]).long()
        len_kv = (cu_kv[1:] - cu_kv[:-1]).long()
        seq_q, pos_q = _token_places(starts_q, len_q, t)
        seq_kv, pos_kv = _token_places(starts_kv, len_kv, s)
        off_q = (len_kv - len_q)[seq_q.clamp(min=0)] if bottom_right else torch.zeros_like(seq_q)
        return PackedLayout(seq_q, pos_q, seq_kv, pos_kv, off_q)


def _token_places(starts: torch.Tensor, lens: torch.Tensor, n: int):
    """(seq, pos) of n packed tokens, each (n,) int64; seq is -1 for tokens past a sequence's
    real length. `starts` (b+1,) gives where each sequence begins in the tensor."""
    idx = torch.arange(n, device=starts.device)
    starts = starts.long()
    # Sequence b holds tokens starts[b] <= i < starts[b+1]; empty sequences never match.
    seq = torch.searchsorted(starts[1:], idx, right=True).clamp(max=max(lens.numel() - 1, 0))
    pos = idx - starts[seq]
    valid = pos < lens[seq]
    return torch.where(valid, seq, -1), pos


def allowed(
    seq_q: torch.Tensor,
    pos_q: torch.Tensor,
    off_q: torch.Tensor,
    seq_kv: torch.Tensor,
    pos_kv: torch.Tensor,
    spec: MaskSpec,
) -> torch.Tensor:
    """Whether query (seq_q, pos_q, off_q) sees key (seq_kv, pos_kv); broadcasting, bool."""
    ok = (seq_q == seq_kv) & (seq_q >= 0)
    diag = pos_q + off_q
    if spec.left >= 0:
        ok = ok & (pos_kv >= diag - spec.left)
    if spec.right >= 0:
        ok = ok & (pos_kv <= diag + spec.right)
    return ok


def _masked_softmax_av(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    dropout_p: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T masked to `visible`) v in fp32; rows that see nothing give 0.

    q (t, h, d), k (s, hg, d), v (s, hg, dv), visible (t, s) bool, sink fp32 (h,) or None;
    returns (t, h, dv) fp32.
    """
    groups = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(groups, dim=1)
    v32 = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k32) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:  # the sink keeps every denominator positive: no row needs care
        probs = sink_softmax(scores, sink.view(-1, 1, 1))
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.einsum("hts,shd->thd", probs, v32)
    if scores.shape[-1] == 0:  # no keys at all: amax has nothing to reduce
        row_max = scores.new_zeros((*scores.shape[:-1], 1))
    else:
        row_max = scores.detach().amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    probs = probs / torch.where(denom > 0, denom, 1.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.einsum("hts,shd->thd", probs, v32)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    spec: MaskSpec,
    scale: float,
    dropout_p: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whole-pack attention over the block-diagonal mask: no host sync, O(h t s) memory.

    q (t, h, d), k (s, hg, d), v (s, hg, dv), sink fp32 (h,) or None; returns (t, h, dv) in
    q's dtype.
    """
    visible = allowed(
        layout.seq_q[:, None],
        layout.pos_q[:, None],
        layout.off_q[:, None],
        layout.seq_kv[None, :],
        layout.pos_kv[None, :],
        spec,
    )
    return _masked_softmax_av(q, k, v, visible, scale, dropout_p, sink).to(q.dtype)


def loop_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    host: tuple[list[int], list[int], list[int], list[int]],
    spec: MaskSpec,
    scale: float,
    dropout_p: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence at a time, from host copies of (cu_q, cu_kv, starts_q, starts_kv).

    q (t, h, d), k (s, hg, d), v (s, hg, dv), sink fp32 (h,) or None; returns (t, h, dv) in
    q's dtype, 0 in padding.
    """
    cu_q, cu_kv, starts_q, starts_kv = host
    h, dv = q.shape[1], v.shape[2]
    pieces: list[torch.Tensor] = []
    for b in range(len(cu_q) - 1):
        len_q, len_kv = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        q0, k0 = starts_q[b], starts_kv[b]
        if len_q > 0:
            pieces.append(
                _one_sequence(
                    q[q0 : q0 + len_q],
                    k[k0 : k0 + len_kv],
                    v[k0 : k0 + len_kv],
                    spec,
                    scale,
                    dropout_p,
                    sink,
                )
            )
        gap = starts_q[b + 1] - q0 - len_q
        if gap > 0:
            pieces.append(q.new_zeros((gap, h, dv)))
    if not pieces:
        return q.new_zeros((q.shape[0], h, dv))
    return torch.cat(pieces, dim=0)


def _one_sequence(q, k, v, spec: MaskSpec, scale: float, dropout_p: float, sink) -> torch.Tensor:
    """Attention of one sequence: q (lq, h, d), k (lk, hg, d), v (lk, hg, dv) -> (lq, h, dv)."""
    len_q, len_kv = q.shape[0], k.shape[0]
    pos_q = torch.arange(len_q, device=q.device)[:, None]
    pos_kv = torch.arange(len_kv, device=q.device)[None, :]
    off = len_kv - len_q if spec.bottom_right else 0
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    visible = allowed(zero, pos_q, off, zero, pos_kv, spec)
    return _masked_softmax_av(q, k, v, visible, scale, dropout_p, sink).to(q.dtype)
