"""Where a context-parallel rank's tokens sit in their sequences (Transformer Engine's
load-balanced "DualChunkSwap" split), as index tables built once per call.

Each sequence of P tokens (P a multiple of 2 cp) is cut into 2 cp chunks of c = P / (2 cp);
rank r holds chunk r then chunk 2 cp - 1 - r, so its slot of a sequence is 2 c = P / cp rows.
Dense formats (bshd, sbhd) are one sequence per batch row; thd packs several per rank, each
slot at row cu_seqlens_padded[i] / cp of the rank's tensor, real tokens first (a sequence of n
real tokens holds positions 0 .. n - 1 of its P; the rest is padding).

Legend: cp ranks, T whole-sequence rows (all ranks), t = T / cp rows of one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPGroup", "SeqTables", "build_tables", "chunk_of", "prefix_tables"]


@dataclass(frozen=True)
class CPGroup:
    """A context-parallel group read once: the group, its size and this rank's place, the
    global ranks of the ring's next and previous rank, the comm type and the side stream."""

    group: object
    size: int
    rank: int
    next_rank: int
    prev_rank: int
    comm_type: str
    stream: object = None


@dataclass(frozen=True)
class SeqTables:
    """The rows of one side (queries, or keys / values) of a call.

    n_local: t, this rank's rows. first / second: this rank's rows of its first and second
    chunks (slices for dense formats, int64 index tensors [t / 2] for thd). to_sequence
    (int64 [T]): for each whole-sequence row, its row in the ranks' tensors stacked in rank
    order ([cp * t]); from_sequence (int64 [T]) the inverse. host: (cu_seqlens_padded,
    cu_seqlens) of the whole sequences as lists; cu_real / cu_pad the same as int32 tensors
    on the device (thd; cu_pad None when no sequence is padded), else None.
    """

    n_local: int
    first: slice | torch.Tensor
    second: slice | torch.Tensor
    to_sequence: torch.Tensor
    from_sequence: torch.Tensor
    host: tuple[list[int], list[int]]
    cu_real: torch.Tensor | None = None
    cu_pad: torch.Tensor | None = None


def chunk_of(rank: int, half: int, cp: int) -> int:
    """The sequence chunk (of 2 cp) that `rank` holds as its first (half 0) or second half."""
    return rank if half == 0 else 2 * cp - 1 - rank


def _sizes(cu_pad: list[int], cu_real: list[int], cp: int):
    pad = torch.tensor(cu_pad, dtype=torch.int64).diff()
    real = torch.tensor(cu_real, dtype=torch.int64).diff()
    return pad, real, pad // (2 * cp), torch.tensor(cu_pad[:-1], dtype=torch.int64) // cp


def build_tables(
    cu_pad: list[int], cu_real: list[int], cp: int, device: torch.device, packed: bool
) -> SeqTables:
    """The SeqTables of sequences with whole padded offsets cu_pad and real offsets cu_real
    (host lists, [B + 1]); dense formats pass one sequence ([0, S], [0, S])."""
    pad, _, c, slot = _sizes(cu_pad, cu_real, cp)
    seqs = torch.arange(len(pad))
    total, n_local = cu_pad[-1], cu_pad[-1] // cp
    seq = seqs.repeat_interleave(pad)
    p = torch.arange(total) - torch.tensor(cu_pad[:-1], dtype=torch.int64)[seq]
    chunk, within = p // c[seq], p % c[seq]
    owner = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
    half = (chunk >= cp).long()
    to_sequence = owner * n_local + slot[seq] + half * c[seq] + within
    from_sequence = torch.empty_like(to_sequence)
    from_sequence[to_sequence] = torch.arange(total)
    if packed:
        local_seq = seqs.repeat_interleave(2 * c)
        w = torch.arange(n_local) - slot[local_seq]
        second_half = w >= c[local_seq]
        first = torch.nonzero(~second_half).flatten().to(device)
        second = torch.nonzero(second_half).flatten().to(device)
        cu_real_t = torch.tensor(cu_real, dtype=torch.int32, device=device)
        cu_pad_t = None  # no padding between sequences: the packed path takes cu_real alone
        if list(cu_pad) != list(cu_real):
            cu_pad_t = torch.tensor(cu_pad, dtype=torch.int32, device=device)
    else:
        first, second = slice(0, n_local // 2), slice(n_local // 2, n_local)
        cu_real_t = cu_pad_t = None
    return SeqTables(
        n_local,
        first,
        second,
        to_sequence.to(device),
        from_sequence.to(device),
        (list(cu_pad), list(cu_real)),
        cu_real_t,
        cu_pad_t,
    )


def rank_positions(tables: SeqTables, cp: int, rank: int, device: torch.device):
    """(sequence id, position in its sequence, real) of each of `rank`'s thd rows: int64 [t],
    int64 [t], bool [t] on device."""
    cu_pad, cu_real = tables.host
    pad, real, c, slot = _sizes(cu_pad, cu_real, cp)
    seq = torch.arange(len(pad)).repeat_interleave(2 * c)
    w = torch.arange(tables.n_local) - slot[seq]
    half = w >= c[seq]
    chunk = torch.where(half, 2 * cp - 1 - rank, rank)
    pos = chunk * c[seq] + w - half.long() * c[seq]
    valid = pos < real[seq]
    return seq.to(device), pos.to(device), valid.to(device)


def prefix_tables(tables: SeqTables, cp: int, chunk: int, kv_chunk: int, device: torch.device):
    """For thd queries of sequence chunk `chunk` (of 2 cp) attending to the keys of chunks 0 ..
    kv_chunk of their sequence: (key rows int64 [sum (kv_chunk + 1) c] of the whole-sequence
    tensor, cu_q real, cu_q padded, cu_kv real, cu_kv padded (int32 [B + 1] each))."""
    cu_pad, cu_real = tables.host
    pad, real, c, _ = _sizes(cu_pad, cu_real, cp)
    span = (kv_chunk + 1) * c
    start = torch.tensor(cu_pad[:-1], dtype=torch.int64)
    seq = torch.arange(len(pad)).repeat_interleave(span)
    offsets = torch.cat([span.new_zeros(1), span.cumsum(0)])
    rows = start[seq] + torch.arange(int(span.sum())) - offsets[:-1][seq]
    q_real = (real - chunk * c).clamp(min=0).minimum(c)
    kv_real = real.minimum(span)

    def cu(lengths):
        out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        out[1:] = lengths.cumsum(0)
        return out.to(device)

    return rows.to(device), cu(q_real), cu(c), cu(kv_real), cu(span)
