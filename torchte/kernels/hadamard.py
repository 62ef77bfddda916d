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
then rounded to fp32 (and by the caller to the input dtype). The Triton kernels (nvfp4_cols.py)
hold the 16 rows of a group as 16 tensors and run the butterfly on them (_wht16). Sums of 16
bf16 values are exact in fp64 unless their exponents span more than ~40 binades, and exact in
fp32 (so in any accumulation order, the tensor core's included) when they span at most 12:
wherever the tensor core's sum is exact, these are its bytes. A zero result is +0, as an fp32
accumulation from a zero addend gives.
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
    def _pm(a, b):
        return a + b, a - b

    @triton.jit
    def _signed(v, SIGN_MASK: tl.constexpr, ROW: tl.constexpr):
        """v times the sign s[ROW] of the mask."""
        if (SIGN_MASK >> ROW) & 1:
            v = -v
        return v

    @triton.jit
    def _wht16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
        """The 16-point Walsh-Hadamard butterfly (unnormalized) of 16 same-shaped tensors, the
        16 rows of a group: the stage of span h maps each pair of rows (r, r + h) to
        (a + b, a - b), spans 1, 2, 4, 8 in turn (the order _butterfly_reference follows).
        Elementwise on each thread's own values: nothing moves between threads."""
        v0, v1 = _pm(v0, v1)
        v2, v3 = _pm(v2, v3)
        v4, v5 = _pm(v4, v5)
        v6, v7 = _pm(v6, v7)
        v8, v9 = _pm(v8, v9)
        v10, v11 = _pm(v10, v11)
        v12, v13 = _pm(v12, v13)
        v14, v15 = _pm(v14, v15)
        v0, v2 = _pm(v0, v2)
        v1, v3 = _pm(v1, v3)
        v4, v6 = _pm(v4, v6)
        v5, v7 = _pm(v5, v7)
        v8, v10 = _pm(v8, v10)
        v9, v11 = _pm(v9, v11)
        v12, v14 = _pm(v12, v14)
        v13, v15 = _pm(v13, v15)
        v0, v4 = _pm(v0, v4)
        v1, v5 = _pm(v1, v5)
        v2, v6 = _pm(v2, v6)
        v3, v7 = _pm(v3, v7)
        v8, v12 = _pm(v8, v12)
        v9, v13 = _pm(v9, v13)
        v10, v14 = _pm(v10, v14)
        v11, v15 = _pm(v11, v15)
        v0, v8 = _pm(v0, v8)
        v1, v9 = _pm(v1, v9)
        v2, v10 = _pm(v2, v10)
        v3, v11 = _pm(v3, v11)
        v4, v12 = _pm(v4, v12)
        v5, v13 = _pm(v5, v13)
        v6, v14 = _pm(v6, v14)
        v7, v15 = _pm(v7, v15)
        return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15

    @triton.jit
    def _rht_value(t):
        """One output row of the butterfly (float64) -> the transform's fp32 value: times 1/4,
        rounded once to fp32, a zero made +0."""
        y = (t * 0.25).to(tl.float32)
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
