"""The epilogue of an emulated GEMM (gemm_block._dequantized_mm): its fp32 accumulator times
the two operands' per-tensor factors, plus the bias, rounded once to the output dtype, in one
pass over the accumulator; the torch reference of the same arithmetic beside it.

    out = to_dtype(((acc * factor_a) * factor_b) + bias)        every operation fp32, rounded

A factor or the bias that is absent is skipped (not multiplied by 1 / added 0: -0.0 stays).
The Triton kernel computes the same operations in the same order, compiled without fused
multiply-add (which would round the product and the sum once), so it gives the reference's
bytes; bf16 is rounded to nearest even in integer arithmetic (mxfp8_cast._store_as), as the
GPU's conversion does, because Triton's CPU interpreter truncates.

Launches: one, reading the (M, N) fp32 accumulator once and writing (M, N) of the output dtype
(the three torch passes it replaces each read and wrote the accumulator).
"""

from __future__ import annotations

import torch

from ._triton import FastLaunch, cdiv, int_key, ptr_key, tl, triton, triton_available

__all__ = ["EPILOGUE_CONFIG", "scale_epilogue", "scale_epilogue_reference"]

# (BLOCK_M, BLOCK_N, num_warps): 32 fp32 values a thread in 16-byte loads. Not yet tuned on a
# GPU (benchmarks/emulated_formats.py times it).
EPILOGUE_CONFIG = (32, 128, 4)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:
    from .mxfp8_cast import _store_as
    from .permutation import _NoFpFusion

    @triton.jit
    def _scale_epilogue_kernel(
        acc_ptr,  # (M, N) fp32 GEMM accumulator, contiguous
        factor_a_ptr,  # (1,) fp32, read when HAS_A
        factor_b_ptr,  # (1,) fp32, read when HAS_B
        bias_ptr,  # (N,) fp32 / bf16 / fp16, read when HAS_BIAS
        out_ptr,  # (M, N) fp32 / bf16 / fp16
        M,
        N,
        HAS_A: tl.constexpr,
        HAS_B: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        offs = rows[:, None] * N + cols[None, :]
        r = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        if HAS_A:
            r = r * tl.load(factor_a_ptr)
        if HAS_B:
            r = r * tl.load(factor_b_ptr)
        if HAS_BIAS:
            r = r + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        _store_as(out_ptr, offs, r, mask)

    _launch_epilogue = FastLaunch(_NoFpFusion(_scale_epilogue_kernel))


def _check(acc, factor_a, factor_b, bias, out_dtype) -> None:
    """ValueError / TypeError naming the argument where the inputs break the rules."""
    if acc.dim() != 2 or acc.dtype != torch.float32:
        raise TypeError(f"scale_epilogue: acc must be a 2-D fp32 tensor, got {acc.dtype} "
                        f"of shape {tuple(acc.shape)}")  # fmt: skip
    for name, f in (("factor_a", factor_a), ("factor_b", factor_b)):
        if f is not None and (f.numel() != 1 or f.dtype != torch.float32):
            raise ValueError(f"scale_epilogue: {name} must be a one-element fp32 tensor")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != acc.shape[1]):
        raise ValueError(
            f"scale_epilogue: bias must be (N,) = ({acc.shape[1]},), got {tuple(bias.shape)}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"scale_epilogue: out_dtype must be fp32, bf16 or fp16, got {out_dtype}")


def scale_epilogue(
    acc: torch.Tensor,
    factor_a: torch.Tensor | None,
    factor_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(M, N) out_dtype: ((acc * factor_a) * factor_b + bias) of acc (M, N) fp32, factors (1,)
    fp32 and bias (N,), each absent one skipped, rounded once (module docstring). May return
    acc itself (fp32 out, nothing to apply); may overwrite acc on the CPU."""
    _check(acc, factor_a, factor_b, bias, out_dtype)
    if factor_a is None and factor_b is None and bias is None and out_dtype == torch.float32:
        return acc
    if not (acc.is_cuda and triton_available() and acc.numel() > 0):
        return scale_epilogue_reference(acc, factor_a, factor_b, bias, out_dtype)
    return _epilogue_triton(acc, factor_a, factor_b, bias, out_dtype)


def _epilogue_triton(acc, factor_a, factor_b, bias, out_dtype, config=EPILOGUE_CONFIG):
    """Launch _scale_epilogue_kernel (scale_epilogue's arguments, checked; M, N > 0)."""
    acc = acc.contiguous()
    rows, cols = acc.shape
    out = torch.empty(rows, cols, dtype=out_dtype, device=acc.device)
    block_m, block_n, num_warps = config
    flags = (factor_a is not None, factor_b is not None, bias is not None)
    # An argument that is absent is never read: any pointer will do.
    args = tuple(acc if t is None else t for t in (factor_a, factor_b, bias))
    grid = (cdiv(rows, block_m), cdiv(cols, block_n), 1)
    key = (out_dtype, args[2].dtype, *flags, config, *int_key(rows), *int_key(cols))
    key += ptr_key(acc, *args, out)
    _launch_epilogue(
        key, grid, num_warps, acc, *args, out, rows, cols, *flags, block_m, block_n
    )  # fmt: skip
    return out


def scale_epilogue_reference(
    acc: torch.Tensor,
    factor_a: torch.Tensor | None,
    factor_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference of scale_epilogue (in place on acc where it can)."""
    for factor in (factor_a, factor_b):
        if factor is not None:
            acc = acc.mul_(factor)
    if bias is not None:
        acc = acc.add_(bias.float())
    return acc.to(out_dtype)
