"""Rotary position embedding: each pair of channels of x turned by an angle read from freqs.

Shapes: x (N0, N1, H, D) in fp32 / bf16 / fp16, any strides with a unit stride along D (one of
N0, N1 is the sequence dim, the other the batch: sbhd, bshd, or thd as (T, 1, H, D)); freqs
(S2, D2) fp32 with D2 even and D2 <= D, row p holding the angles of position p; y like x,
contiguous. Only the first D2 channels turn; channels D2..D pass through unchanged.

Pairs (a, b) are (k, k + D2/2) for k < D2/2, or (2k, 2k + 1) when interleaved. With the angles
ta = freqs[p, a], tb = freqs[p, b]:
  forward   ya = xa cos ta - xb sin ta     yb = xb cos tb + xa sin tb
  backward  dxa = dya cos ta + dyb sin tb  dxb = dyb cos tb - dya sin ta
The backward is the forward's transpose: a rotation by -theta wherever ta = tb, which holds for
the freqs RotaryPositionEmbedding makes. Math in fp32; y in x's dtype.

The position p of a token at index i along the sequence dim is seq_pos[i] when that table is
given (context-parallel slices, packed sequences), else i; start[j] is added when given, j the
token's index along the other (batch) dim. A position outside freqs (0 <= p < S2) turns its
pairs by NaN: the caller checks positions before launching, and where it cannot (during CUDA
graph capture) a bad position shows as NaN, never as another position's angle.

On CUDA with Triton one kernel runs per call (none when x is empty); elsewhere the torch
reference below. Triton's tl.sin / tl.cos lower to libdevice's accurate sinf / cosf (not the
approximate instructions), so large angles keep their precision.
"""

from __future__ import annotations

import torch

from ._compile import compiled_as_op
from ._triton import FastLaunch, int_key, tl, triton, triton_available

__all__ = ["rope_backward", "rope_backward_reference", "rope_forward", "rope_forward_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements of one half (BLOCK_H x BLOCK_K) per program, and the warps that run it.
TILE = 2048
NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def _rope_kernel(
        x_ptr,  # (N0, N1, H, D); fp32 / bf16 / fp16, strides (sx0, sx1, sxh, 1)
        y_ptr,  # (N0, N1, H, D), contiguous, x's dtype
        freqs_ptr,  # (S2, D2) fp32, contiguous
        pos_ptr,  # (N_seq,) int32, the position of each sequence index; read when HAS_POS
        start_ptr,  # (N_batch,) int32, added per batch index; read when HAS_START
        n1,  # N1
        heads,  # H
        d,  # D
        half,  # D2 / 2
        s2,  # S2
        sx0,
        sx1,
        sxh,
        SEQ_FIRST: tl.constexpr,  # the sequence dim is N0 (sbhd, thd) rather than N1 (bshd)
        HAS_POS: tl.constexpr,
        HAS_START: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        INVERSE: tl.constexpr,  # the backward (transpose)
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,  # power of two >= D2 / 2
        BLOCK_P: tl.constexpr,  # power of two >= D - D2, or 0 when nothing passes through
    ):
        tok = tl.program_id(0).to(tl.int64)
        i0, i1, p = token_position(tok, n1, pos_ptr, start_ptr, SEQ_FIRST, HAS_POS, HAS_START)
        k_mask, col_a, col_b = pair_columns(half, INTERLEAVED, BLOCK_K)
        t_a, t_b = pair_angles(freqs_ptr, p, s2, half, col_a, col_b, k_mask)
        cos_a, sin_a = tl.cos(t_a)[None, :], tl.sin(t_a)[None, :]
        cos_b, sin_b = tl.cos(t_b)[None, :], tl.sin(t_b)[None, :]

        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = (h < heads)[:, None]
        mask = h_mask & k_mask[None, :]
        x_row = x_ptr + i0 * sx0 + i1 * sx1 + h.to(tl.int64)[:, None] * sxh
        y_row = y_ptr + tok * heads * d + h.to(tl.int64)[:, None] * d
        xa = tl.load(x_row + col_a[None, :], mask=mask, other=0.0).to(tl.float32)
        xb = tl.load(x_row + col_b[None, :], mask=mask, other=0.0).to(tl.float32)
        if INVERSE:
            ya = xa * cos_a + xb * sin_b
            yb = xb * cos_b - xa * sin_a
        else:
            ya = xa * cos_a - xb * sin_a
            yb = xb * cos_b + xa * sin_b
        out_ty = y_ptr.dtype.element_ty
        tl.store(y_row + col_a[None, :], ya.to(out_ty), mask=mask)
        tl.store(y_row + col_b[None, :], yb.to(out_ty), mask=mask)
        if BLOCK_P > 0:
            c = 2 * half + tl.arange(0, BLOCK_P)
            c_mask = h_mask & (c < d)[None, :]
            v = tl.load(x_row + c[None, :], mask=c_mask, other=0.0)
            tl.store(y_row + c[None, :], v, mask=c_mask)

    @triton.jit
    def token_position(
        tok,  # the program's token: i0 * N1 + i1, int64
        n1,
        pos_ptr,
        start_ptr,
        SEQ_FIRST: tl.constexpr,
        HAS_POS: tl.constexpr,
        HAS_START: tl.constexpr,
    ):
        """(i0, i1, p): the token's indices along N0 and N1 and its position (int64)."""
        i0 = tok // n1
        i1 = tok - i0 * n1
        if SEQ_FIRST:
            i_seq, i_batch = i0, i1
        else:
            i_seq, i_batch = i1, i0
        p = tl.load(pos_ptr + i_seq).to(tl.int64) if HAS_POS else i_seq
        if HAS_START:
            p += tl.load(start_ptr + i_batch).to(tl.int64)
        return i0, i1, p

    @triton.jit
    def pair_columns(half, INTERLEAVED: tl.constexpr, BLOCK_K: tl.constexpr):
        """(k_mask, col_a, col_b), each (BLOCK_K,): the channels of pair k < D2 / 2."""
        k = tl.arange(0, BLOCK_K)
        k_mask = k < half
        if INTERLEAVED:
            col_a = 2 * k
            col_b = col_a + 1
        else:
            col_a = k
            col_b = k + half
        return k_mask, col_a, col_b

    @triton.jit
    def pair_angles(freqs_ptr, p, s2, half, col_a, col_b, k_mask):
        """(t_a, t_b), fp32 (BLOCK_K,): row p of freqs (S2, D2) at the pairs' channels; NaN
        when p is outside [0, S2)."""
        in_range = (p >= 0) & (p < s2)
        f_row = freqs_ptr + p * (2 * half)
        t_a = tl.load(f_row + col_a, mask=k_mask & in_range, other=0.0)
        t_b = tl.load(f_row + col_b, mask=k_mask & in_range, other=0.0)
        t_a = tl.where(in_range, t_a, float("nan"))
        t_b = tl.where(in_range, t_b, float("nan"))
        return t_a, t_b

    _launch = FastLaunch(_rope_kernel)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------

_SCHEMA = (
    "(Tensor x, Tensor freqs, Tensor? seq_pos, Tensor? start, bool seq_first, bool interleaved)"
    " -> Tensor"
)


@compiled_as_op(_SCHEMA)
def rope_forward(
    x: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
) -> torch.Tensor:
    """y = x with its first D2 channels turned: x (N0, N1, H, D), freqs (S2, D2) fp32,
    seq_pos (N_seq,) / start (N_batch,) int32 or None -> y (N0, N1, H, D), contiguous."""
    if x.is_cuda and triton_available():
        return _rope_triton(x, freqs, seq_pos, start, seq_first, interleaved, False)
    return rope_forward_reference(x, freqs, seq_pos, start, seq_first, interleaved)


@compiled_as_op(_SCHEMA.replace("Tensor x", "Tensor dy"))
def rope_backward(
    dy: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
) -> torch.Tensor:
    """dx = the transpose of rope_forward applied to dy (N0, N1, H, D) -> dx like dy."""
    if dy.is_cuda and triton_available():
        return _rope_triton(dy, freqs, seq_pos, start, seq_first, interleaved, True)
    return rope_backward_reference(dy, freqs, seq_pos, start, seq_first, interleaved)


def check_inputs(
    x: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
) -> None:
    """Raise naming the argument when the kernel's inputs do not fit each other."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"rope: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"rope: x must be (N0, N1, H, D), got shape {tuple(x.shape)}")
    if freqs.dtype != torch.float32 or freqs.dim() != 2:
        raise ValueError(f"rope: freqs must be (S2, D2) float32, got {freqs.dtype} {freqs.shape}")
    d2 = freqs.shape[1]
    if d2 % 2 or d2 == 0 or d2 > x.shape[3]:
        raise ValueError(
            f"rope: freqs' last dim must be even, positive and at most x's {x.shape[3]}, got {d2}"
        )
    for name, table, n in (("seq_pos", seq_pos, 0), ("start", start, 1)):
        if table is None:
            continue
        want = x.shape[n if seq_first else 1 - n]
        if table.dtype != torch.int32 or table.shape != (want,):
            got = f"{table.dtype} {tuple(table.shape)}"
            raise ValueError(f"rope: {name} must be ({want},) int32, got {got}")
        if table.device != x.device:
            raise ValueError(f"rope: {name} is on {table.device}, x on {x.device}")
    if freqs.device != x.device:
        raise ValueError(f"rope: freqs is on {freqs.device}, x on {x.device}")


def block_sizes(rows: int, d: int, half: int, tile: int) -> tuple[int, int, int]:
    """(BLOCK rows, BLOCK_K, BLOCK_P) of a program turning `rows` heads of D channels whose
    first 2 half turn: powers of two, BLOCK rows x BLOCK_K within `tile` elements."""
    block_k = 1 << (half - 1).bit_length()
    block_rows = min(1 << (rows - 1).bit_length(), max(1, tile // block_k))
    n_pass = d - 2 * half
    block_p = 1 << (n_pass - 1).bit_length() if n_pass else 0
    return block_rows, block_k, block_p


def _rope_triton(
    x: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
    inverse: bool,
    tile: int = TILE,
) -> torch.Tensor:
    """Launch _rope_kernel over x (N0, N1, H, D) -> y (N0, N1, H, D); no launch when empty."""
    check_inputs(x, freqs, seq_pos, start, seq_first)
    if x.stride(3) != 1:
        x = x.contiguous()
    if not freqs.is_contiguous():
        freqs = freqs.contiguous()
    n0, n1, heads, d = x.shape
    y = torch.empty((n0, n1, heads, d), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    half = freqs.shape[1] // 2
    block_h, block_k, block_p = block_sizes(heads, d, half, tile)
    sx0, sx1, sxh = x.stride(0), x.stride(1), x.stride(2)
    grid = (n0 * n1, -(-heads // block_h), 1)
    pos_arg = seq_pos if seq_pos is not None else freqs  # an unread pointer when absent
    start_arg = start if start is not None else freqs
    key = (
        x.dtype, seq_first, seq_pos is not None, start is not None, interleaved, inverse,
        block_h, block_k, block_p, *int_key(n1), *int_key(heads), *int_key(d), *int_key(half),
        *int_key(freqs.shape[0]), *int_key(sx0), *int_key(sx1), *int_key(sxh),
        x.data_ptr() & 15, y.data_ptr() & 15, freqs.data_ptr() & 15,
        pos_arg.data_ptr() & 15, start_arg.data_ptr() & 15,
    )  # fmt: skip
    _launch(
        key, grid, NUM_WARPS, x, y, freqs, pos_arg, start_arg, n1, heads, d, half,
        freqs.shape[0], sx0, sx1, sxh, seq_first, seq_pos is not None, start is not None,
        interleaved, inverse, block_h, block_k, block_p,
    )  # fmt: skip
    return y


# ----------------------------------------------------------------------------------------------
# Torch reference: the same function, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def rope_forward_reference(
    x: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
) -> torch.Tensor:
    """Torch reference of rope_forward: x (N0, N1, H, D) -> y (N0, N1, H, D), fp32 math."""
    return _rotate_reference(x, freqs, seq_pos, start, seq_first, interleaved, False)


def rope_backward_reference(
    dy: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
) -> torch.Tensor:
    """Torch reference of rope_backward: dy (N0, N1, H, D) -> dx (N0, N1, H, D), fp32 math."""
    return _rotate_reference(dy, freqs, seq_pos, start, seq_first, interleaved, True)


def _angles_reference(
    x: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
) -> torch.Tensor:
    """The angles of each token, (N0, N1, 1, D2) fp32: NaN for positions outside freqs."""
    n_seq = x.shape[0 if seq_first else 1]
    p = seq_pos.long() if seq_pos is not None else torch.arange(n_seq, device=x.device)
    p = p[:, None] if seq_first else p[None, :]
    if start is not None:
        p = p + (start.long()[None, :] if seq_first else start.long()[:, None])
    p = p.expand(x.shape[0], x.shape[1])
    valid = (p >= 0) & (p < freqs.shape[0])
    if freqs.shape[0] == 0:
        return freqs.new_full((x.shape[0], x.shape[1], 1, freqs.shape[1]), float("nan"))
    theta = freqs[p.clamp(0, freqs.shape[0] - 1)]
    return torch.where(valid[..., None], theta, float("nan"))[:, :, None, :]


def _rotate_reference(
    x: torch.Tensor,
    freqs: torch.Tensor,
    seq_pos: torch.Tensor | None,
    start: torch.Tensor | None,
    seq_first: bool,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    """The forward (or, inverse, its transpose) of x (N0, N1, H, D), fp32 math, x's dtype."""
    check_inputs(x, freqs, seq_pos, start, seq_first)
    d2 = freqs.shape[1]
    theta = _angles_reference(x, freqs, seq_pos, start, seq_first)
    x_rot = x[..., :d2].float()
    if interleaved:  # pairs (2k, 2k + 1)
        a, b = slice(0, None, 2), slice(1, None, 2)
    else:  # pairs (k, k + d2 / 2)
        a, b = slice(0, d2 // 2), slice(d2 // 2, None)
    xa, xb, t_a, t_b = x_rot[..., a], x_rot[..., b], theta[..., a], theta[..., b]
    sin_a, sin_b = torch.sin(t_a), torch.sin(t_b)
    if inverse:  # the transpose: each partner's term takes the partner's angle, negated
        sin_a, sin_b = -sin_b, -sin_a
    ya = xa * torch.cos(t_a) - xb * sin_a
    yb = xb * torch.cos(t_b) + xa * sin_b
    y_rot = torch.stack([ya, yb], -1).flatten(-2) if interleaved else torch.cat([ya, yb], -1)
    return torch.cat([y_rot.to(x.dtype), x[..., d2:]], -1).contiguous()
