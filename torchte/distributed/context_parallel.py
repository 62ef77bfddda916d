"""Context parallelism: attention over sequences split across the ranks of a group, as
Transformer Engine splits them (load-balanced: the sequence cut into 2 cp chunks, rank r
holding chunk r then chunk 2 cp - 1 - r; see _cp_layout.py), for te.DotProductAttention.

Comm types (cp_comm_type):
- "p2p": ring attention (context_parallel_ring.py): key / value blocks travel the ring, the
  partial outputs merge through their log-sum-exp; backward as a ring too.
- "all_gather": keys and values gathered in sequence order; each local query chunk attends to
  the keys up to its chunk's end (bottom-right causal), through the module's own attention;
  the backward reduce-scatters dK / dV.
- "a2a" (Ulysses): all-to-all from sequence-split / all heads to whole sequences / heads split,
  the module's own attention on the whole sequences, and all-to-all back.

Users cut their batches with `split_for_cp_rank` (or Transformer Engine's
`get_batch_on_this_cp_rank`) and put outputs back in sequence order with
`gather_from_cp_ranks`.

Legend: cp ranks, n this rank's rows of a sequence dim (t for thd), N = cp n whole rows,
*B the batch dims (b for dense formats, none for thd), h / hg heads, d / dv head sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import _collectives as collectives
from ._cp_layout import CPGroup, SeqTables, build_tables, chunk_of, prefix_tables
from .context_parallel_ring import RingPlan, flash_ok, ring_attention

__all__ = [
    "CPGroup",
    "context_parallel_attention",
    "cp_group_of",
    "gather_from_cp_ranks",
    "get_batch_on_this_cp_rank",
    "split_for_cp_rank",
]

COMM_TYPES = ("p2p", "all_gather", "a2a")
_DENSE_TABLES: dict[tuple, SeqTables] = {}


def cp_group_of(group, comm_type: str, stream=None) -> CPGroup | None:
    """The CPGroup of a process group (its size and rank read once), or None for a group of
    one rank (or None)."""
    if group is None or not dist.is_initialized():
        return None
    size = dist.get_world_size(group)
    if size == 1:
        return None
    rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prev = dist.get_global_rank(group, (rank - 1) % size)
    return CPGroup(group, size, rank, nxt, prev, comm_type, stream)


def _host_offsets(cu: torch.Tensor) -> list[int]:
    return [int(x) for x in cu.tolist()]


def _check_lengths(name: str, offsets: list[int], cp: int) -> None:
    for i in range(len(offsets) - 1):
        length = offsets[i + 1] - offsets[i]
        if length % (2 * cp):
            raise ValueError(
                f"context parallelism: every sequence must be a multiple of 2 * cp_size = "
                f"{2 * cp} tokens long ({name}), but sequence {i} has {length}"
            )


def thd_tables(cu_real, cu_pad, cp: int, device) -> SeqTables:
    """The tables of packed sequences: cu_real / cu_pad int32 [B + 1] offsets of the whole
    sequences (cu_pad None: no padding between sequences); one host read."""
    real = _host_offsets(cu_real)
    pad = real if cu_pad is None else _host_offsets(cu_pad)
    _check_lengths("cu_seqlens_padded" if cu_pad is not None else "cu_seqlens", pad, cp)
    for i in range(len(real) - 1):
        if real[i + 1] - real[i] > pad[i + 1] - pad[i]:
            raise ValueError(f"sequence {i} is longer by cu_seqlens than by cu_seqlens_padded")
    return build_tables(pad, real, cp, device, packed=True)


def dense_tables(n_local: int, cp: int, device) -> SeqTables:
    """The tables of one dense sequence dim of n_local rows per rank (cached)."""
    if n_local % 2:
        raise ValueError(
            f"context parallelism: the sequence length ({cp} ranks x {n_local} rows) must be "
            f"divisible by 2 * cp_size = {2 * cp}"
        )
    key = (n_local, cp, device)
    tables = _DENSE_TABLES.get(key)
    if tables is None:
        whole = [0, n_local * cp]
        tables = _DENSE_TABLES[key] = build_tables(whole, whole, cp, device, packed=False)
    return tables


def split_for_cp_rank(
    x: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    seq_dim: int = 1,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's load-balanced part of a whole-sequence tensor: along seq_dim (N rows), chunk
    cp_rank and chunk 2 cp_size - 1 - cp_rank of every sequence (of 2 cp_size chunks) -> N /
    cp_size rows. Dense: one sequence per row (N a multiple of 2 cp_size). thd: the packed
    sequences at cu_seqlens_padded (int32 [B + 1], each a multiple of 2 cp_size)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size), got {cp_rank} and {cp_size}")
    if cp_size == 1:
        return x
    if cu_seqlens_padded is None:
        tables = dense_tables(x.shape[seq_dim] // cp_size, cp_size, x.device)
        if x.shape[seq_dim] % (2 * cp_size):
            dense_tables(1, cp_size, x.device)  # the divisibility error
    else:
        tables = thd_tables(cu_seqlens_padded, cu_seqlens_padded, cp_size, x.device)
    n = tables.n_local
    rows = tables.from_sequence[cp_rank * n : (cp_rank + 1) * n]
    return x.index_select(seq_dim, rows)


def gather_from_cp_ranks(
    x: torch.Tensor,
    cp_group,
    seq_dim: int = 1,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inverse of split_for_cp_rank over the ranks of cp_group (a collective): every
    rank's part (n rows along seq_dim) -> the whole sequences (cp n rows) in sequence order.
    Not differentiable."""
    cp = dist.get_world_size(cp_group)
    if cp == 1:
        return x
    n = x.shape[seq_dim]
    if cu_seqlens_padded is None:
        tables = dense_tables(n, cp, x.device)
    else:
        tables = thd_tables(cu_seqlens_padded, cu_seqlens_padded, cp, x.device)
    rows = x.movedim(seq_dim, 0).contiguous()
    gathered, _ = collectives.gather_rows(rows, cp_group, cp)
    return gathered.index_select(0, tables.to_sequence).movedim(0, seq_dim)


def get_batch_on_this_cp_rank(
    cu_seqlens_padded: torch.Tensor,
    input_ids_padded: torch.Tensor,
    labels_padded: torch.Tensor,
    position_ids_padded: torch.Tensor,
    cp_group=None,
    qvk_format: str = "thd",
):
    """Transformer Engine's helper: this rank's part of packed (thd) input ids, labels and
    position ids ([T] or [b, T]; None passes through), by cu_seqlens_padded."""
    if qvk_format != "thd":
        raise ValueError(f"get_batch_on_this_cp_rank takes qvk_format='thd', got {qvk_format!r}")
    cp = dist.get_world_size(cp_group)
    rank = dist.get_rank(cp_group)

    def part(x):
        if x is None:
            return None
        dim = 0 if x.dim() == 1 else 1
        return split_for_cp_rank(x, cp, rank, dim, cu_seqlens_padded)

    return part(input_ids_padded), part(labels_padded), part(position_ids_padded)


class _AllToAll(torch.autograd.Function):
    """x [cp, ...] -> [cp, ...], row i from rank i's row for this rank; its own transpose."""

    @staticmethod
    def forward(ctx, x, cp: CPGroup):
        ctx.cp = cp
        return collectives.all_to_all_rows(x, cp.group, cp.size)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_to_all_rows(grad, ctx.cp.group, ctx.cp.size), None


class _GatherRows(torch.autograd.Function):
    """x [n, ...] -> [cp n, ...] in rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, cp: CPGroup):
        ctx.cp = cp
        return collectives.gather_rows(x.contiguous(), cp.group, cp.size)[0]

    @staticmethod
    def backward(ctx, grad):
        return collectives.reduce_scatter_along_first_dim(grad, ctx.cp.group)[0], None


def _heads_to_sequence(x: torch.Tensor, cp: CPGroup, tables: SeqTables) -> torch.Tensor:
    """[n, *B, h, d] sequence-split -> [N, *B, h / cp, d] whole sequences, this rank's heads."""
    *lead, h, d = x.shape
    x = x.reshape(*lead, cp.size, h // cp.size, d).movedim(-3, 0)
    x = _AllToAll.apply(x, cp)  # [cp (source rank), n, *B, h / cp, d]
    x = x.reshape(cp.size * lead[0], *lead[1:], h // cp.size, d)
    return x.index_select(0, tables.to_sequence)


def _sequence_to_heads(out: torch.Tensor, cp: CPGroup, tables: SeqTables) -> torch.Tensor:
    """[N, *B, (h / cp) dv] whole sequences -> [n, *B, h dv] this rank's rows, all heads."""
    out = out.index_select(0, tables.from_sequence)
    out = out.reshape(cp.size, tables.n_local, *out.shape[1:])
    out = _AllToAll.apply(out, cp)  # [cp (head group), n, *B, (h / cp) dv]
    return out.movedim(0, -2).flatten(-2)


def _a2a(q, k, v, cp, tq, tkv, mask_type, local):
    """Ulysses: q [n, *B, h, d], k / v [n_kv, *B, hg, d | dv] -> [n, *B, h dv]."""
    h, hg = q.shape[-2], k.shape[-2]
    if h % cp.size or hg % cp.size:
        raise ValueError(
            f"cp_comm_type='a2a' needs the heads of this rank divisible by cp_size: "
            f"num_attention_heads {h} and num_gqa_groups {hg} by {cp.size}"
        )
    qs, ks, vs = (_heads_to_sequence(x, cp, t) for x, t in ((q, tq), (k, tkv), (v, tkv)))
    cu = None if tq.cu_real is None else (tq.cu_real, tkv.cu_real, tq.cu_pad, tkv.cu_pad)
    out = local(qs, ks, vs, mask_type, cu)
    return _sequence_to_heads(out, cp, tq)


def _all_gather(q, k, v, cp, tq, tkv, causal, mask_type, local):
    """Keys and values gathered: q [n, *B, h, d], k / v [n_kv, *B, hg, d | dv] ->
    [n, *B, h dv]."""
    ks, vs = (_GatherRows.apply(x, cp).index_select(0, tkv.to_sequence) for x in (k, v))
    if tq.cu_real is None:
        if not causal:
            return local(q, ks, vs, mask_type, None)
        outs = []
        for half, rows in enumerate((tq.first, tq.second)):
            end = (chunk_of(cp.rank, half, cp.size) + 1) * (tq.n_local // 2)
            outs.append(local(q[rows], ks[:end], vs[:end], "causal_bottom_right", None))
        return torch.cat(outs, 0)
    kind = "padding_causal_bottom_right" if causal else "padding"
    outs = []
    for half, rows in enumerate((tq.first, tq.second)):
        chunk = chunk_of(cp.rank, half, cp.size)
        kv_rows, *cu = prefix_tables(
            tq, cp.size, chunk, chunk if causal else 2 * cp.size - 1, q.device
        )
        cu_q, cu_q_pad, cu_kv, cu_kv_pad = cu
        ki, vi = ks.index_select(0, kv_rows), vs.index_select(0, kv_rows)
        outs.append(
            local(q.index_select(0, rows), ki, vi, kind, (cu_q, cu_kv, cu_q_pad, cu_kv_pad))
        )
    order = torch.empty(tq.n_local, dtype=torch.long, device=q.device)
    order[torch.cat([tq.first, tq.second])] = torch.arange(tq.n_local, device=q.device)
    return torch.cat(outs, 0).index_select(0, order)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: CPGroup,
    qkv_format: str,
    causal: bool,
    scale: float,
    cu_seqlens: tuple | None,
    local: Callable,
) -> torch.Tensor:
    """Attention of this rank's load-balanced rows over the whole sequences of the group.

    q [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd); k, v the same with hg heads
    and d / dv channels -> [s, b, h dv], [b, s, h dv] or [t, h dv] in q's dtype. causal: the
    "causal" (dense) or "padding_causal" (thd) mask, else "no_mask" / "padding". cu_seqlens:
    thd's (cu_q, cu_kv, cu_q_padded, cu_kv_padded) of the whole sequences (int32 [B + 1]).
    local(q, k, v, mask_type, cu) runs the attention of one rank on seq-first tensors
    ([N, b, h, d] as sbhd, or thd with cu = (cu_q, cu_kv, cu_q_padded, cu_kv_padded)) and
    returns [N, b, h dv] or [N, h dv] (all_gather and a2a use it).
    """
    tq, tkv = _tables(q, k, cp, qkv_format, cu_seqlens)
    if cp.comm_type == "p2p":
        return _ring(q, k, v, cp, qkv_format, tq, tkv, causal, scale)
    x = (q, k, v) if qkv_format != "bshd" else (y.transpose(0, 1) for y in (q, k, v))
    qs, ks, vs = x
    if cp.comm_type == "a2a":
        mask = ("padding_causal" if causal else "padding") if qkv_format == "thd" else None
        mask = mask or ("causal" if causal else "no_mask")
        out = _a2a(qs, ks, vs, cp, tq, tkv, mask, local)
    else:
        mask = "padding" if qkv_format == "thd" else "no_mask"
        out = _all_gather(qs, ks, vs, cp, tq, tkv, causal, mask, local)
    return out.transpose(0, 1).contiguous() if qkv_format == "bshd" else out


def _tables(q, k, cp: CPGroup, qkv_format: str, cu_seqlens):
    """(query tables, key tables), checked before any collective."""
    if qkv_format == "thd":
        cu_q, cu_kv, pad_q, pad_kv = cu_seqlens
        tq = thd_tables(cu_q, pad_q, cp.size, q.device)
        same = cu_kv is cu_q and pad_kv is pad_q
        tkv = tq if same else thd_tables(cu_kv, pad_kv, cp.size, q.device)
        if tkv.host != tq.host:
            raise ValueError(
                "context parallelism with qkv_format='thd' needs self-attention: cu_seqlens_kv "
                "(and _padded) equal to cu_seqlens_q (and _padded)"
            )
        for name, x, tables in (("query_layer", q, tq), ("key_layer", k, tkv)):
            if x.shape[0] != tables.n_local:
                raise ValueError(
                    f"{name} has {x.shape[0]} tokens, but this rank's share of the sequences "
                    f"(cu_seqlens_padded[-1] / cp_size) is {tables.n_local}"
                )
        return tq, tkv
    s_dim = 0 if qkv_format == "sbhd" else 1
    tq = dense_tables(q.shape[s_dim], cp.size, q.device)
    tkv = (
        tq if k.shape[s_dim] == q.shape[s_dim] else dense_tables(k.shape[s_dim], cp.size, q.device)
    )
    return tq, tkv


def _ring(q, k, v, cp, qkv_format, tq, tkv, causal, scale) -> torch.Tensor:
    """p2p: the inputs as [b, s, h, d] for the ring, its output back in the format."""
    if qkv_format == "thd":
        q4, k4, v4 = (x.unsqueeze(0) for x in (q, k, v))
    elif qkv_format == "sbhd":
        q4, k4, v4 = (x.transpose(0, 1) for x in (q, k, v))
    else:
        q4, k4, v4 = q, k, v
    plan = RingPlan(
        cp,
        tq,
        tkv,
        causal,
        qkv_format == "thd",
        scale,
        flash_ok(q, v.shape[-1], qkv_format == "thd"),
    )
    out = ring_attention(q4, k4, v4, plan)  # [b, s, h, dv]
    if qkv_format == "thd":
        return out[0].flatten(-2)
    if qkv_format == "sbhd":
        return out.transpose(0, 1).flatten(-2)
    return out.flatten(-2)
