"""The 16-point random Hadamard transform (RHT) of NVFP4's columnwise copies, as Transformer
Engine applies it: Triton device function, torch reference, sign vectors.

A transform acts on groups of 16 consecutive rows of a matrix v (M, N), M a multiple of 16,
column by column: the 16 values v[0..15] of a group in one column become

    y[c] = 1/4 * sum_r s[r] * H[r, c] * v[r]          (y = v @ diag(s) @ H / 4)

with H the 16 x 16 Sylvester-Hadamard matrix (H[r, c] = (-1)**popcount(r & c)) and s the
sign vector (Transformer Engine's fixed "random" signs, or all +1). The matrix diag(s) H / 4 is
orthogonal, so the inverse is y @ H / 4 @ diag(s) (its transpose).

Arithmetic: Transformer Engine multiplies on tensor cores (bf16 x bf16, fp32 accumulation, no
addend) and rounds the result to bf16. Here the sum is formed in float64 by the fast
Walsh-Hadamard butterfly (4 stages of a + b, a - b), in the same order in Triton and in torch,
then rounded to fp32 (and by the caller to the input dtype). Sums of 16 bf16 values are exact
in fp64 unless their exponents span more than ~40 binades, and exact in fp32 (so in any
accumulation order, the tensor core's included) when they span at most 12: wherever the tensor
core's sum is exact, these are its bytes. A zero result is +0, as an fp32 accumulation from a
zero addend gives.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton

__all__ = [
    "RHT_DIM",
    "TE_SIGN_MASK",
    "hadamard_matrix",
    "rht16_reference",
    "sign_mask",
    "sign_vector",
]

RHT_DIM = 16

# Transformer Engine's fixed sign vector of the wgrad transform (get_wgrad_sign_vector), as a
# 16-bit mask: bit r set where s[r] = -1.
_TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
TE_SIGN_MASK = sum(1 << r for r, s in enumerate(_TE_SIGNS) if s < 0)


def sign_mask(with_random_sign_mask: bool = True) -> int:
    """The sign mask of a transform: Transformer Engine's fixed signs, or none (all +1)."""
    return TE_SIGN_MASK if with_random_sign_mask else 0


def sign_vector(mask: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """(16,) the signs s[r] = -1 where bit r of mask is set, else +1."""
    bits = (mask >> torch.arange(RHT_DIM, device=device)) & 1
    return (1 - 2 * bits).to(dtype)


def hadamard_matrix(mask: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """(16, 16) the transform's matrix diag(s) @ H / 4 (orthogonal): y = v @ matrix for each
    row vector v of 16 values."""
    r = torch.arange(RHT_DIM, device=device)
    anded = r[:, None] & r[None, :]
    parity = torch.zeros_like(anded)
    for bit in range(4):
        parity ^= (anded >> bit) & 1
    h = (1 - 2 * parity).to(torch.float64)
    return (sign_vector(mask, torch.float64, device)[:, None] * h / 4).to(dtype)


if triton is not None:

    @triton.jit
    def _butterfly_rows(t, ROWS: tl.constexpr, COLS: tl.constexpr):
        """The 16-point Walsh-Hadamard transform (unnormalized) of t (ROWS, COLS) along its
        rows, in groups of 16 (ROWS a multiple of 16): 4 stages; the stage of span h maps the
        rows (r, r + h) of each pair to (a + b, a - b)."""
        for stage in tl.static_range(4):
            pairs = tl.reshape(t, (ROWS // (2 << stage), 2, (1 << stage) * COLS))
            which = tl.arange(0, 2)[None, :, None]
            total = tl.sum(pairs, axis=1)
            diff = tl.sum(tl.where(which == 0, pairs, -pairs), axis=1)
            t = tl.reshape(tl.where(which == 0, total[:, None, :], diff[:, None, :]), (ROWS, COLS))
        return t

    @triton.jit
    def _rht16(v, SIGN_MASK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        """The transform of v (ROWS, COLS) fp32 along its rows (module docstring): fp32, the
        float64 result rounded once; zeros +0."""
        r = tl.arange(0, ROWS) % 16
        negative = ((tl.full((ROWS,), SIGN_MASK, tl.int32) >> r) & 1) == 1
        t = v.to(tl.float64)
        t = tl.where(negative[:, None], -t, t)
        t = _butterfly_rows(t, ROWS, COLS) * 0.25
        y = t.to(tl.float32)
        return tl.where(y == 0.0, 0.0, y)


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------


def _butterfly_reference(t: torch.Tensor) -> torch.Tensor:
    """_butterfly_rows in torch: t (M, N) float64, M a multiple of 16."""
    rows, cols = t.shape
    for stage in range(4):
        h = 1 << stage
        pairs = t.reshape(rows // (2 * h), 2, h * cols)
        a, b = pairs[:, 0], pairs[:, 1]
        t = torch.stack((a + b, a - b), dim=1).reshape(rows, cols)
    return t


def rht16_reference(v: torch.Tensor, mask: int, inverse: bool = False) -> torch.Tensor:
    """The transform (inverse=False) or its inverse of v (M, N), M a multiple of 16, along M
    in groups of 16 rows: float64 arithmetic, returned in fp32 with zeros +0 (the Triton
    function's bytes). The inverse applies H / 4, then the signs."""
    rows, _ = v.shape
    signs = sign_vector(mask, torch.float64, v.device).repeat(rows // RHT_DIM)[:, None]
    t = v.to(torch.float64)
    if not inverse:
        t = t * signs
    t = _butterfly_reference(t) * 0.25
    if inverse:
        t = t * signs
    y = t.to(torch.float32)
    return torch.where(y == 0, torch.zeros_like(y), y)
