"""Rotary position embedding of a fused QKV tensor (Transformer Engine's
apply_fused_qkv_rotary_pos_emb): split it into q, k and v and turn q and k, in one pass.

Shapes: qkv (N0, N1, G, (J + 2) D) in fp32 / bf16 / fp16 with a unit stride along its last dim
holds, for each of G key/value groups, its J query heads, then its key head, then its value
head, D channels each (one of N0, N1 is the sequence dim, the other the batch: sbhd or bshd).
The forward gives q (N0, N1, G J, D) turned by q_freqs, k (N0, N1, G, D) turned by k_freqs and
v (N0, N1, G, D) as it was, all contiguous; the backward takes dq, dk, dv (any strides with a
unit stride along D) and gives dqkv (N0, N1, G, (J + 2) D), contiguous. q_freqs (S2q, D2) and
k_freqs (S2k, D2) are fp32 with the same D2 (even, <= D).

Each head turns as rope.py's kernel turns it (pairs, angles, fp32 math, positions from seq_pos
and start, NaN for a position outside freqs); v is copied bit for bit. On CUDA with Triton one
kernel runs per call, a program per token and block of head-sized pieces of its row (none when
empty); elsewhere the torch reference below, built on rope.py's.
"""

from __future__ import annotations

import torch

from ._compile import compiled_as_op
from ._triton import FastLaunch, int_key, ptr_key, tl, triton, triton_available
from .rope import NUM_WARPS, TILE, _rotate_reference, block_sizes, check_inputs

__all__ = [
    "check_qkv_inputs",
    "qkv_rope_backward",
    "qkv_rope_backward_reference",
    "qkv_rope_forward",
    "qkv_rope_forward_reference",
]

if triton is not None:
    from .rope import pair_angles, pair_columns, token_position

    @triton.jit
    def _qkv_rope_kernel(
        qkv_ptr,  # (N0, N1, G, (J + 2) D), strides (sp0, sp1, spg, 1): read, or written if INVERSE
        q_ptr,  # (N0, N1, G J, D), strides (sq0, sq1, sqh, 1): written, or read if INVERSE
        k_ptr,  # (N0, N1, G, D), strides (sk0, sk1, skh, 1)
        v_ptr,  # (N0, N1, G, D), strides (sv0, sv1, svh, 1)
        q_freqs_ptr,  # (S2q, D2) fp32, contiguous
        k_freqs_ptr,  # (S2k, D2) fp32, contiguous
        pos_ptr,  # (N_seq,) int32, the position of each sequence index; read when HAS_POS
        start_ptr,  # (N_batch,) int32, added per batch index; read when HAS_START
        n1,  # N1
        rows,  # G (J + 2): head-sized pieces of one token's row
        per,  # J, query heads per group
        d,  # D
        half,  # D2 / 2
        s2_q,  # S2q
        s2_k,  # S2k
        sp0,
        sp1,
        spg,
        sq0,
        sq1,
        sqh,
        sk0,
        sk1,
        skh,
        sv0,
        sv1,
        svh,
        SEQ_FIRST: tl.constexpr,
        HAS_POS: tl.constexpr,
        HAS_START: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        INVERSE: tl.constexpr,  # the backward: read dq, dk, dv and write dqkv
        BLOCK_N: tl.constexpr,  # pieces per program
        BLOCK_K: tl.constexpr,  # power of two >= D2 / 2
        BLOCK_P: tl.constexpr,  # power of two >= D - D2, or 0 when nothing passes through
    ):
        tok = tl.program_id(0).to(tl.int64)
        i0, i1, p = token_position(tok, n1, pos_ptr, start_ptr, SEQ_FIRST, HAS_POS, HAS_START)
        k_mask, col_a, col_b = pair_columns(half, INTERLEAVED, BLOCK_K)
        tq_a, tq_b = pair_angles(q_freqs_ptr, p, s2_q, half, col_a, col_b, k_mask)
        tk_a, tk_b = pair_angles(k_freqs_ptr, p, s2_k, half, col_a, col_b, k_mask)

        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = (n // (per + 2)).to(tl.int64)
        r = n - (n // (per + 2)) * (per + 2)
        is_q = (r < per)[:, None]
        is_k = (r == per)[:, None]
        is_v = (r > per)[:, None]
        cos_a = tl.where(is_q, tl.cos(tq_a)[None, :], tl.cos(tk_a)[None, :])
        sin_a = tl.where(is_q, tl.sin(tq_a)[None, :], tl.sin(tk_a)[None, :])
        cos_b = tl.where(is_q, tl.cos(tq_b)[None, :], tl.cos(tk_b)[None, :])
        sin_b = tl.where(is_q, tl.sin(tq_b)[None, :], tl.sin(tk_b)[None, :])

        n_mask = (n < rows)[:, None]
        packed = (qkv_ptr + i0 * sp0 + i1 * sp1 + g * spg + r.to(tl.int64) * d)[:, None]
        q_row = (q_ptr + i0 * sq0 + i1 * sq1 + (g * per + r) * sqh)[:, None]
        k_row = (k_ptr + i0 * sk0 + i1 * sk1 + g * skh)[:, None]
        v_row = (v_ptr + i0 * sv0 + i1 * sv1 + g * svh)[:, None]
        mask = n_mask & k_mask[None, :]
        if INVERSE:
            xa = _qkv_split_load(q_row, k_row, v_row, col_a[None, :], mask, is_q, is_k, is_v)
            xb = _qkv_split_load(q_row, k_row, v_row, col_b[None, :], mask, is_q, is_k, is_v)
            ya = tl.where(is_v, xa, xa * cos_a + xb * sin_b)
            yb = tl.where(is_v, xb, xb * cos_b - xa * sin_a)
            out_ty = qkv_ptr.dtype.element_ty
            tl.store(packed + col_a[None, :], ya.to(out_ty), mask=mask)
            tl.store(packed + col_b[None, :], yb.to(out_ty), mask=mask)
        else:
            xa = tl.load(packed + col_a[None, :], mask=mask, other=0.0).to(tl.float32)
            xb = tl.load(packed + col_b[None, :], mask=mask, other=0.0).to(tl.float32)
            ya = tl.where(is_v, xa, xa * cos_a - xb * sin_a)
            yb = tl.where(is_v, xb, xb * cos_b + xa * sin_b)
            _qkv_split_store(q_row, k_row, v_row, col_a[None, :], ya, mask, is_q, is_k, is_v)
            _qkv_split_store(q_row, k_row, v_row, col_b[None, :], yb, mask, is_q, is_k, is_v)
        if BLOCK_P > 0:
            c = (2 * half + tl.arange(0, BLOCK_P))[None, :]
            c_mask = n_mask & (c < d)
            if INVERSE:
                val = _qkv_split_load(q_row, k_row, v_row, c, c_mask, is_q, is_k, is_v)
                tl.store(packed + c, val.to(qkv_ptr.dtype.element_ty), mask=c_mask)
            else:
                val = tl.load(packed + c, mask=c_mask, other=0.0)
                _qkv_split_store(q_row, k_row, v_row, c, val, c_mask, is_q, is_k, is_v)

    @triton.jit
    def _qkv_split_load(q_row, k_row, v_row, cols, mask, is_q, is_k, is_v):
        """One tile of q, k or v per row (fp32), each row read from the tensor it belongs to."""
        xq = tl.load(q_row + cols, mask=mask & is_q, other=0.0).to(tl.float32)
        xk = tl.load(k_row + cols, mask=mask & is_k, other=0.0).to(tl.float32)
        xv = tl.load(v_row + cols, mask=mask & is_v, other=0.0).to(tl.float32)
        return tl.where(is_q, xq, tl.where(is_k, xk, xv))

    @triton.jit
    def _qkv_split_store(q_row, k_row, v_row, cols, val, mask, is_q, is_k, is_v):
        """Store one tile, each row into the tensor (q, k or v) it belongs to."""
        tl.store(q_row + cols, val.to(q_row.dtype.element_ty), mask=mask & is_q)
        tl.store(k_row + cols, val.to(k_row.dtype.element_ty), mask=mask & is_k)
        tl.store(v_row + cols, val.to(v_row.dtype.element_ty), mask=mask & is_v)

    _launch = FastLaunch(_qkv_rope_kernel)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------

_SCHEMA = (
    "(Tensor qkv, Tensor q_freqs, Tensor k_freqs, Tensor? seq_pos, Tensor? start, bool seq_first,"
    " bool interleaved, int per) -> (Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor dq, Tensor dk, Tensor dv, Tensor q_freqs, Tensor k_freqs, Tensor? seq_pos,"
    " Tensor? start, bool seq_first, bool interleaved, int per) -> Tensor"
)


@compiled_as_op(_SCHEMA)
def qkv_rope_forward(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
    per: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused qkv (N0, N1, G, (per + 2) D) and turn its q and k: q_freqs / k_freqs
    (S2, D2) fp32 -> q (N0, N1, G per, D), k (N0, N1, G, D), v (N0, N1, G, D), contiguous."""
    if not (qkv.is_cuda and triton_available()):
        return qkv_rope_forward_reference(
            qkv, q_freqs, k_freqs, seq_pos, start, seq_first, interleaved, per
        )
    check_qkv_inputs(qkv, q_freqs, k_freqs, seq_pos, start, seq_first, per)
    n0, n1, groups, width = qkv.shape
    d = width // (per + 2)
    split = (
        qkv.new_empty((n0, n1, groups * per, d)),
        qkv.new_empty((n0, n1, groups, d)),
        qkv.new_empty((n0, n1, groups, d)),
    )
    qkv = qkv if qkv.stride(3) == 1 else qkv.contiguous()
    _qkv_rope_triton(qkv, split, q_freqs, k_freqs, seq_pos, start, seq_first, interleaved, False)
    return split


@compiled_as_op(_BACKWARD_SCHEMA)
def qkv_rope_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
    per: int,
) -> torch.Tensor:
    """The transpose of qkv_rope_forward: dq (N0, N1, G per, D), dk / dv (N0, N1, G, D) ->
    dqkv (N0, N1, G, (per + 2) D), contiguous."""
    if not (dq.is_cuda and triton_available()):
        return qkv_rope_backward_reference(
            dq, dk, dv, q_freqs, k_freqs, seq_pos, start, seq_first, interleaved, per
        )
    n0, n1, groups, d = _check_qkv_grads(dq, dk, dv, per)
    dqkv = dq.new_empty((n0, n1, groups, (per + 2) * d))
    check_qkv_inputs(dqkv, q_freqs, k_freqs, seq_pos, start, seq_first, per)
    grads = tuple(x if x.stride(3) == 1 else x.contiguous() for x in (dq, dk, dv))
    _qkv_rope_triton(dqkv, grads, q_freqs, k_freqs, seq_pos, start, seq_first, interleaved, True)
    return dqkv


def check_qkv_inputs(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    per: int,
) -> None:
    """Raise naming the argument when a fused qkv (N0, N1, G, (per + 2) D) and its freqs do
    not fit each other (check_inputs for each head)."""
    if qkv.dim() != 4 or per < 1 or qkv.shape[3] % (per + 2):
        raise ValueError(
            f"rope: qkv must be (N0, N1, G, (per + 2) D) with per = {per} >= 1, got shape "
            f"{tuple(qkv.shape)}"
        )
    head = qkv[..., : qkv.shape[3] // (per + 2)]  # a view: only its shape and dtype are read
    check_inputs(head, q_freqs, seq_pos, start, seq_first)
    check_inputs(head, k_freqs, seq_pos, start, seq_first)
    if q_freqs.shape[1] != k_freqs.shape[1]:
        raise ValueError(
            f"rope: q_freqs and k_freqs must turn as many channels, got {q_freqs.shape[1]} "
            f"and {k_freqs.shape[1]}"
        )


def _check_qkv_grads(dq, dk, dv, per: int) -> tuple[int, int, int, int]:
    """(N0, N1, G, D) of the output gradients, after checking that they fit each other."""
    n0, n1, groups, d = dk.shape
    if dv.shape != dk.shape or dq.shape != (n0, n1, groups * per, d):
        raise ValueError(
            f"rope: dq {tuple(dq.shape)}, dk {tuple(dk.shape)} and dv {tuple(dv.shape)} must be "
            f"(N0, N1, G {per}, D), (N0, N1, G, D) and (N0, N1, G, D)"
        )
    return n0, n1, groups, d


def _qkv_rope_triton(
    qkv: torch.Tensor,
    split: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
    inverse: bool,
    tile: int = TILE,
) -> None:
    """Launch _qkv_rope_kernel: qkv (N0, N1, G, (per + 2) D) -> split = (q, k, v), or (inverse)
    split -> qkv; every tensor with a unit stride along D; no launch when empty."""
    q, k, v = split
    q_freqs, k_freqs = q_freqs.contiguous(), k_freqs.contiguous()
    n0, n1, groups, d = k.shape
    per = qkv.shape[3] // d - 2
    rows = groups * (per + 2)
    if n0 * n1 * rows == 0:
        return
    half = q_freqs.shape[1] // 2
    block_n, block_k, block_p = block_sizes(rows, d, half, tile)
    strides = (*qkv.stride()[:3], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    grid = (n0 * n1, -(-rows // block_n), 1)
    pos_arg = seq_pos if seq_pos is not None else q_freqs  # an unread pointer when absent
    start_arg = start if start is not None else q_freqs
    s2_q, s2_k = q_freqs.shape[0], k_freqs.shape[0]
    ints = (n1, rows, per, d, half, s2_q, s2_k, *strides)
    key = (
        qkv.dtype, seq_first, seq_pos is not None, start is not None, interleaved, inverse,
        block_n, block_k, block_p, *(bit for i in ints for bit in int_key(i)),
        *ptr_key(qkv, q, k, v, q_freqs, k_freqs, pos_arg, start_arg),
    )  # fmt: skip
    _launch(
        key, grid, NUM_WARPS, qkv, q, k, v, q_freqs, k_freqs, pos_arg, start_arg, *ints,
        seq_first, seq_pos is not None, start is not None, interleaved, inverse,
        block_n, block_k, block_p,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def qkv_rope_forward_reference(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
    per: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of qkv_rope_forward: qkv (N0, N1, G, (per + 2) D) -> q (N0, N1, G per,
    D), k (N0, N1, G, D), v (N0, N1, G, D), contiguous; fp32 math."""
    check_qkv_inputs(qkv, q_freqs, k_freqs, seq_pos, start, seq_first, per)
    n0, n1, groups, width = qkv.shape
    d = width // (per + 2)
    q_in = qkv[..., : per * d].reshape(n0, n1, groups * per, d)
    k_in = qkv[..., per * d : (per + 1) * d]
    q = _rotate_reference(q_in, q_freqs, seq_pos, start, seq_first, interleaved, False)
    k = _rotate_reference(k_in, k_freqs, seq_pos, start, seq_first, interleaved, False)
    v = qkv[..., (per + 1) * d :].clone(memory_format=torch.contiguous_format)
    return q, k, v


def qkv_rope_backward_reference(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
    per: int,
) -> torch.Tensor:
    """Torch reference of qkv_rope_backward: dq, dk, dv -> dqkv (N0, N1, G, (per + 2) D)."""
    n0, n1, groups, d = _check_qkv_grads(dq, dk, dv, per)
    dq_in = _rotate_reference(dq, q_freqs, seq_pos, start, seq_first, interleaved, True)
    dk_in = _rotate_reference(dk, k_freqs, seq_pos, start, seq_first, interleaved, True)
    return torch.cat([dq_in.reshape(n0, n1, groups, per * d), dk_in, dv], dim=-1)
