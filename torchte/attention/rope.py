"""Rotary position embeddings with Transformer Engine's names: RotaryPositionEmbedding makes the
angles, apply_rotary_pos_emb turns the channels of queries or keys by them, and
apply_fused_qkv_rotary_pos_emb splits a fused QKV tensor and turns its queries and keys.

Shape legend: s sequence, b batch, h heads, d head dim, t tokens of packed sequences (thd),
s2 positions in freqs, d2 channels turned (d2 <= d, even).

Formats: sbhd t (s, b, h, d), bshd t (b, s, h, d), thd t (t, h, d) with cu_seqlens (B + 1,)
whose sequences each start again at position 0. The kernels (torchte/kernels/rope.py and
rope_qkv.py) see every format as (N0, N1, h, d) plus a table of positions where they are not
simply 0, 1, 2, ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._device import default_device, graph_capturing
from ..kernels import rope as kernels
from ..kernels import rope_qkv

__all__ = ["RotaryPositionEmbedding", "apply_fused_qkv_rotary_pos_emb", "apply_rotary_pos_emb"]

_FORMATS = ("sbhd", "bshd", "thd")


class RotaryPositionEmbedding(torch.nn.Module):
    """The angles of rotary position embeddings: forward(max_seq_len, offset) -> freqs
    (max_seq_len, 1, 1, d2) float32, row p holding position p + offset's angle per channel.

    d2 = int(dim * rotary_percent) (dim itself when rotary_percent is 1), which must be even.
    The angle of position p and pair k is p * rotary_base ** (-2k / d2), with p divided by
    seq_len_interpolation_factor (or, past pretrained_max_position_embeddings times it, by
    max_seq_len / pretrained_max_position_embeddings) when both are set. Pair k's angle sits at
    channels k and k + d2/2, or at 2k and 2k + 1 when interleaved.
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: int | None = None,
        pretrained_max_position_embeddings: int | None = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim <= 0 or dim % 2:
            raise ValueError(
                f"RotaryPositionEmbedding: dim * rotary_percent must be a positive even number "
                f"(channels turn in pairs), got {dim}"
            )
        if seq_len_interpolation_factor is not None and not seq_len_interpolation_factor > 0:
            raise ValueError(
                f"seq_len_interpolation_factor must be positive, got {seq_len_interpolation_factor}"
            )
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=default_device(None)) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponents))  # (d2 / 2,)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """freqs (max_seq_len, 1, 1, d2) float32 on inv_freq's device."""
        inv_freq = self.inv_freq
        seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
        factor = self.seq_len_interpolation_factor
        pretrained = self.pretrained_max_position_embeddings
        if factor is not None and pretrained is not None:
            # Past the interpolated range the scale follows the length (dynamic scaling).
            seq *= 1 / (max_seq_len / pretrained if max_seq_len > pretrained * factor else factor)
        angles = torch.outer(seq, inv_freq)  # (s, d2 / 2)
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=1)
        else:
            emb = torch.cat([angles, angles], dim=1)
        return emb.reshape(max_seq_len, 1, 1, emb.shape[1])


@dataclass(frozen=True)
class _RopeSpec:
    """What the autograd Function needs besides tensors: which dim of (N0, N1) is the
    sequence, pair layout, and whether the Triton kernel may run."""

    seq_first: bool
    interleaved: bool
    fused: bool


# Specs made once per setting; plain dicts, which torch.compile traces without a warning
# (unlike functools.cache).
_SPECS: dict[tuple, _RopeSpec] = {}


def _spec(seq_first: bool, interleaved: bool, fused: bool) -> _RopeSpec:
    key = (seq_first, interleaved, fused)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = _RopeSpec(*key)
    return spec


class _RotaryFunction(torch.autograd.Function):
    """x (N0, N1, h, d) -> y (N0, N1, h, d); the gradient flows to x only."""

    @staticmethod
    def forward(ctx, x, freqs, seq_pos, start, spec: _RopeSpec):
        apply = kernels.rope_forward if spec.fused else kernels.rope_forward_reference
        y = apply(x, freqs, seq_pos, start, spec.seq_first, spec.interleaved)
        ctx.save_for_backward(freqs, seq_pos, start)
        ctx.spec = spec
        return y

    @staticmethod
    def backward(ctx, dy):
        freqs, seq_pos, start = ctx.saved_tensors
        spec = ctx.spec
        apply = kernels.rope_backward if spec.fused else kernels.rope_backward_reference
        dx = apply(dy, freqs, seq_pos, start, spec.seq_first, spec.interleaved)
        return dx, None, None, None, None


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Turn the first d2 channels of t by the angles of its tokens' positions; the rest pass.

    t: (s, b, h, d) sbhd, (b, s, h, d) bshd or (t, h, d) thd, fp32 / bf16 / fp16.
    freqs: (s2, 1, 1, d2) angles (RotaryPositionEmbedding's output), taken as float32.
    start_positions: (b,) or, thd, (B,) integers added to each sequence's positions (with
      cp_size > 1, to the rank's chunk positions, as Transformer Engine adds them).
    cu_seqlens: (B + 1,) integer offsets of the packed sequences (thd only; with cp_size > 1,
      the padded offsets of the whole sequences, each a multiple of 2 cp_size long).
    cp_size, cp_rank: context parallelism: each rank holds two chunks of every sequence (chunk
      cp_rank and chunk 2 cp_size - 1 - cp_rank of 2 cp_size), and gets their positions.
    fused: run the Triton kernel on CUDA (the torch reference elsewhere, and when False).
    Returns a tensor of t's shape and dtype; differentiable with respect to t.
    """
    if tensor_format not in _FORMATS:
        known = ", ".join(_FORMATS)
        raise ValueError(f"tensor_format must be one of {known}, got {tensor_format!r}")
    x, seq_first = _as_4d(t, tensor_format)
    freqs_2d = _freqs_2d(freqs, t.shape[-1], t.device)
    _check_cp(cp_size, cp_rank)
    cp = (cp_size, cp_rank)
    if tensor_format == "thd":
        seq_pos, start = _thd_positions(t, cu_seqlens, start_positions, freqs_2d, *cp)
    else:
        seq_pos, start = _padded_positions(x, seq_first, start_positions, freqs_2d, *cp)
    spec = _spec(seq_first, bool(interleaved), bool(fused))
    return _RotaryFunction.apply(x, freqs_2d, seq_pos, start, spec).view(t.shape)


@dataclass(frozen=True)
class _QKVSpec:
    """What the fused-QKV Function needs besides tensors: the sequence dim, pair layout, and
    the query heads per key/value group."""

    seq_first: bool
    interleaved: bool
    per: int


_QKV_SPECS: dict[tuple, _QKVSpec] = {}


def _qkv_spec(seq_first: bool, interleaved: bool, per: int) -> _QKVSpec:
    key = (seq_first, interleaved, per)
    spec = _QKV_SPECS.get(key)
    if spec is None:
        spec = _QKV_SPECS[key] = _QKVSpec(*key)
    return spec


class _FusedQKVRotaryFunction(torch.autograd.Function):
    """qkv (N0, N1, G, (per + 2) d) -> q (N0, N1, G per, d), k, v (N0, N1, G, d); the
    gradient flows to qkv only."""

    @staticmethod
    def forward(ctx, qkv, q_freqs, k_freqs, seq_pos, start, spec: _QKVSpec):
        q, k, v = rope_qkv.qkv_rope_forward(
            qkv, q_freqs, k_freqs, seq_pos, start, spec.seq_first, spec.interleaved, spec.per
        )
        ctx.save_for_backward(q_freqs, k_freqs, seq_pos, start)
        ctx.spec = spec
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        q_freqs, k_freqs, seq_pos, start = ctx.saved_tensors
        spec = ctx.spec
        dqkv = rope_qkv.qkv_rope_backward(
            dq, dk, dv, q_freqs, k_freqs, seq_pos, start, spec.seq_first, spec.interleaved,
            spec.per,
        )  # fmt: skip
        return dqkv, None, None, None, None, None


def apply_fused_qkv_rotary_pos_emb(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    qkv_split_arg_list: list[int],
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused QKV tensor into q, k and v, and turn q by q_freqs and k by k_freqs.

    qkv: (s, b, g, c) sbhd or (b, s, g, c) bshd, fp32 / bf16 / fp16: per key/value group, its
      query heads, its key head and its value head, concatenated along c (Megatron-Core's
      layout of the QKV projection's output).
    qkv_split_arg_list: [per * d, d, d], the channels of the group's queries, key and value
      (they sum to c); per query heads of d channels share each key/value head.
    q_freqs, k_freqs: (s2, 1, 1, d2) angles with the same d2 (even, <= d), taken as float32.
    start_positions, interleaved, cp_size, cp_rank: as apply_rotary_pos_emb. cu_seqlens is
      accepted and unused, as in Transformer Engine.
    Returns q (s, b, g * per, d), k (s, b, g, d), v (s, b, g, d) (b first for bshd), contiguous,
    in qkv's dtype; differentiable with respect to qkv. One Triton kernel on CUDA (forward, and
    its transpose for the backward), the torch reference elsewhere.
    """
    if tensor_format == "thd":
        raise NotImplementedError(
            "apply_fused_qkv_rotary_pos_emb: tensor_format='thd' is not supported (as in "
            "Transformer Engine); split qkv and use apply_rotary_pos_emb"
        )
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format must be 'sbhd' or 'bshd', got {tensor_format!r}")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"apply_fused_qkv_rotary_pos_emb: qkv must be 4-D, got {shape}")
    per, d = _check_split(qkv_split_arg_list, qkv.shape[-1])
    q_2d = _freqs_2d(q_freqs, d, qkv.device, "q_freqs", "qkv")
    k_2d = _freqs_2d(k_freqs, d, qkv.device, "k_freqs", "qkv")
    if q_2d.shape[1] != k_2d.shape[1]:
        raise ValueError(
            f"q_freqs and k_freqs must have the same d2, got {q_2d.shape[1]} and {k_2d.shape[1]}"
        )
    _check_cp(cp_size, cp_rank)
    seq_first = tensor_format == "sbhd"
    shorter = q_2d if q_2d.shape[0] <= k_2d.shape[0] else k_2d
    seq_pos, start = _padded_positions(qkv, seq_first, start_positions, shorter, cp_size, cp_rank)
    spec = _qkv_spec(seq_first, bool(interleaved), per)
    return _FusedQKVRotaryFunction.apply(qkv, q_2d, k_2d, seq_pos, start, spec)


def _check_split(split, channels: int) -> tuple[int, int]:
    """(query heads per group, head size d) of qkv_split_arg_list [per * d, d, d]."""
    ok = isinstance(split, list | tuple) and len(split) == 3
    ok = ok and all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in split)
    if not ok or sum(split) != channels or split[1] != split[2] or split[0] % split[1]:
        raise ValueError(
            "qkv_split_arg_list must be [per * d, d, d] (query, key and value channels of a "
            f"group, per >= 1) summing to qkv's last dim {channels}, got {split!r}"
        )
    return split[0] // split[1], split[1]


def _as_4d(t: torch.Tensor, tensor_format: str) -> tuple[torch.Tensor, bool]:
    """t as (N0, N1, h, d) and whether N0 is the sequence dim."""
    want = 3 if tensor_format == "thd" else 4
    if t.dim() != want:
        raise ValueError(
            f"apply_rotary_pos_emb: t must have {want} dims for tensor_format {tensor_format!r}, "
            f"got shape {tuple(t.shape)}"
        )
    if tensor_format == "thd":
        return t.unsqueeze(1), True
    return t, tensor_format == "sbhd"


def _freqs_2d(
    freqs: torch.Tensor, d: int, device: torch.device, name: str = "freqs", of: str = "t"
) -> torch.Tensor:
    """freqs (s2, 1, 1, d2) as (s2, d2) float32, after checking it against heads of d
    channels on `device` (the tensor `of`'s)."""
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(freqs).__name__}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"{name} must be (s2, 1, 1, d2), got shape {tuple(freqs.shape)}")
    d2 = freqs.shape[3]
    if d2 == 0 or d2 % 2 or d2 > d:
        size = f"{of}'s" if of == "t" else f"the head size of {of},"
        raise ValueError(f"{name}' last dim d2 must be even, positive and <= {size} {d}, got {d2}")
    if freqs.device != device:
        raise ValueError(f"{name} is on {freqs.device}, {of} on {device}")
    return freqs.reshape(freqs.shape[0], d2).float()


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if not (isinstance(cp_size, int) and cp_size >= 1 and 0 <= cp_rank < cp_size):
        raise ValueError(
            f"cp_size must be >= 1 and 0 <= cp_rank < cp_size, got {cp_size} and {cp_rank}"
        )


def _index_table(table: torch.Tensor, name: str, length: int, device: torch.device) -> torch.Tensor:
    """A 1-D integer tensor checked for its length, as int32 on `device`."""
    if table.dim() != 1 or table.shape[0] != length or table.is_floating_point():
        raise ValueError(
            f"{name} must be a 1-D integer tensor of {length} entries, "
            f"got {table.dtype} {tuple(table.shape)}"
        )
    return table.to(device=device, dtype=torch.int32)


def _read_back(values: list[torch.Tensor]) -> list[int] | None:
    """Scalars of `values` on the host in one read, or None while a CUDA graph is captured
    (the kernels then turn any position outside freqs by NaN)."""
    if graph_capturing(values[0]):
        return None
    return torch.stack([v.long() for v in values]).tolist()


def _cp_table(n: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """Positions (n,) int32 of a sequence slice of n tokens held by cp_rank: its first half is
    chunk cp_rank, its second chunk 2 cp_size - 1 - cp_rank, of a sequence of cp_size n."""
    i = torch.arange(n, device=device)
    seg = n // 2
    late = cp_size * n - (cp_rank + 1) * seg + (i - seg)
    return torch.where(i < seg, cp_rank * seg + i, late).int()


def _padded_positions(x, seq_first, start_positions, freqs_2d, cp_size, cp_rank):
    """(seq_pos or None, start or None) for sbhd / bshd, after checking they fit freqs. With
    cp_size > 1 the positions are the rank's two chunks' (seq_pos), each sequence's start
    position added to them as Transformer Engine adds it."""
    n_seq, n_batch = (x.shape[0], x.shape[1]) if seq_first else (x.shape[1], x.shape[0])
    s2 = freqs_2d.shape[0]
    seq_pos, span = None, n_seq  # span: the positions the whole sequence takes
    if cp_size > 1:
        if n_seq % 2:
            raise ValueError(f"with cp_size > 1 the sequence length must be even, got {n_seq}")
        seq_pos, span = _cp_table(n_seq, cp_size, cp_rank, x.device), cp_size * n_seq
    if start_positions is None:
        if span > s2 and cp_size > 1:
            raise ValueError(f"freqs has {s2} positions; cp_size * seq len needs {span}")
        if span > s2:
            raise ValueError(f"freqs has {s2} positions, fewer than t's sequence length {n_seq}")
        return seq_pos, None
    # Checked where start_positions lies: no device read when the caller keeps it on the host.
    start = _index_table(start_positions, "start_positions", n_batch, start_positions.device)
    if n_batch and n_seq:
        got = _read_back([start.min(), start.max()])
        if got is not None and (got[0] < 0 or got[1] + span > s2):
            raise ValueError(
                f"start_positions must be >= 0 and leave room for {span} positions in freqs' "
                f"{s2}, got min {got[0]}, max {got[1]}"
            )
    return seq_pos, start.to(x.device)


def _thd_positions(t, cu_seqlens, start_positions, freqs_2d, cp_size, cp_rank):
    """(seq_pos (t,) int32, None) for thd: each token's position within its sequence (and cp
    chunk), plus its sequence's start position."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens is required when tensor_format is 'thd'")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor of B + 1 >= 2 offsets, "
            f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    n_seqs, n_tok, device = cu_seqlens.shape[0] - 1, t.shape[0], t.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64) // cp_size
    start = None
    if start_positions is not None:
        start = _index_table(start_positions, "start_positions", n_seqs, device).long()
    lengths = cu[1:] - cu[:-1]
    need = cp_size * lengths + (start if start is not None else 0)
    checks = [cu[0], cu[-1], lengths.min(), need.max(), (lengths % 2).max()]
    if start is not None:
        checks.append(start.min())
    got = _read_back(checks)
    if got is not None:
        _check_thd(got, n_tok, freqs_2d.shape[0], cp_size)
    tok = torch.arange(n_tok, device=device)
    seq = torch.searchsorted(cu[1:], tok, right=True).clamp_(max=n_seqs - 1)
    begin, length = cu[seq], lengths[seq]
    local = tok - begin
    pos = local
    if cp_size > 1:
        seg = length // 2
        late = cp_size * length - (cp_rank + 1) * seg + (local - seg)
        pos = torch.where(local < seg, cp_rank * seg + local, late)
    if start is not None:  # added after the context-parallel chunk's offset, as TE adds it
        pos = pos + start[seq]
    return pos.int(), None


def _check_thd(got: list[int], n_tok: int, s2: int, cp_size: int) -> None:
    """Raise for cu_seqlens that do not describe t, or positions past freqs."""
    first, last, shortest, need, odd = got[:5]
    if first != 0 or last != n_tok or shortest < 0:
        raise ValueError(
            f"cu_seqlens must rise from 0 to t's {n_tok} tokens"
            + (f" (times cp_size {cp_size})" if cp_size > 1 else "")
            + f", got first {first}, last {last}, a step of {shortest}"
        )
    if cp_size > 1 and odd:
        raise ValueError(f"with cp_size > 1 every sequence must be a multiple of 2 * {cp_size}")
    if need > s2:
        raise ValueError(f"freqs has {s2} positions; the longest sequence needs {need}")
    if len(got) > 5 and got[5] < 0:
        raise ValueError(f"start_positions must be >= 0, got {got[5]}")
