"""The MoE load-balancing loss (Switch Transformer's), forward and backward.

Shapes: probs (R, C) fp32 / bf16 / fp16, C a multiple of the expert count (Megatron-Core folds
the sequences of a batch into the columns for its per-sequence loss); tokens_per_expert (C,),
any integer or float dtype. With the coefficient

    c = num_experts * coeff / topk / total_num_tokens / total_num_tokens

(fp32 operations in this order, as Transformer Engine forms it),

    loss = c * sum_j tokens_per_expert[j] * sum_i probs[i, j]      a scalar, probs' dtype
    d loss / d probs[i, j] = c * tokens_per_expert[j] * grad_loss   (R, C), probs' dtype

total_num_tokens is a Python int (c is formed on the host) or a one-element tensor on probs'
device (c is formed on the device, so that the value can change between CUDA graph replays).
The forward also returns c as a one-element fp32 tensor: what the backward reads.

On CUDA with Triton the forward runs two kernels (column sums over row slices, then one program
adds them up: no atomics, so the loss is the same bits on every run) and the backward one; on
the CPU the torch reference below.
"""

from __future__ import annotations

import numpy as np
import torch

from ._triton import FastLaunch, int_key, tl, triton, triton_available

__all__ = [
    "aux_loss_backward",
    "aux_loss_backward_reference",
    "aux_loss_coefficient",
    "aux_loss_forward",
    "aux_loss_forward_reference",
]

# (rows per loop step, columns per program) of the column sums; at most MAX_SLICES row slices.
# Not yet tuned on a GPU.
BLOCK_R, BLOCK_C, MAX_SLICES = 32, 128, 64

if triton is not None:

    @triton.jit
    def _column_sums_kernel(
        probs_ptr,  # (R, C) fp32 / bf16 / fp16, contiguous
        partial_ptr,  # (S, C) fp32: column sums of row slice s
        R, C, ROWS_PER_SLICE,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        s = tl.program_id(1)
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        start = s * ROWS_PER_SLICE
        for r0 in range(start, start + ROWS_PER_SLICE, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            mask = (r < R)[:, None] & (c < C)[None, :]
            offs = r.to(tl.int64)[:, None] * C + c[None, :]
            acc += tl.load(probs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(partial_ptr + s * C + c, tl.sum(acc, axis=0), mask=c < C)

    @triton.jit
    def _finish_kernel(
        partial_ptr,  # (S, C) fp32
        tokens_ptr,  # (C,) tokens per expert, any integer / float dtype
        total_ptr,  # (1,) total tokens, any dtype; read when ON_DEVICE
        loss_ptr,  # () probs' dtype
        coeff_ptr,  # (1,) fp32: c, for the backward
        S, C, coeff, num_experts, topk,
        ON_DEVICE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        srow = tl.arange(0, BLOCK_S)[:, None]
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            part = tl.load(partial_ptr + srow * C + c[None, :], mask=(srow < S) & (c < C)[None, :])
            tokens = tl.load(tokens_ptr + c, mask=c < C, other=0).to(tl.float32)
            acc += tl.sum(part, axis=0) * tokens
        if ON_DEVICE:
            total = tl.load(total_ptr).to(tl.float32)
            # int args equal to 1 arrive as constants: * 1.0 makes them fp32 either way; div_rn:
            # correctly rounded, so c has the host's bits
            coeff = tl.math.div_rn((num_experts * 1.0) * coeff, topk * 1.0)
            coeff = tl.math.div_rn(tl.math.div_rn(coeff, total), total)
        tl.store(coeff_ptr, coeff)
        tl.store(loss_ptr, (tl.sum(acc, axis=0) * coeff).to(loss_ptr.dtype.element_ty))

    @triton.jit
    def _backward_kernel(
        coeff_ptr,  # (1,) fp32: c
        tokens_ptr,  # (C,) tokens per expert, any integer / float dtype
        grad_ptr,  # () d loss, any float dtype
        out_ptr,  # (R, C) d probs, probs' dtype
        R, C,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        coeff = tl.load(coeff_ptr)
        g = tl.load(grad_ptr).to(tl.float32)
        tokens = tl.load(tokens_ptr + c, mask=c < C, other=0).to(tl.float32)
        value = coeff * tokens * g
        mask = (r < R)[:, None] & (c < C)[None, :]
        offs = r.to(tl.int64)[:, None] * C + c[None, :]
        tile = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32) + value[None, :]
        tl.store(out_ptr + offs, tile.to(out_ptr.dtype.element_ty), mask=mask)

    _launch_sums = FastLaunch(_column_sums_kernel)
    _launch_finish = FastLaunch(_finish_kernel)
    _launch_backward = FastLaunch(_backward_kernel)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------


def aux_loss_coefficient(num_experts: int, topk: int, coeff: float, total_num_tokens: int) -> float:
    """c = num_experts * coeff / topk / total / total in fp32 operations, as a Python float."""
    with np.errstate(all="ignore"):
        c = np.float32(num_experts) * np.float32(coeff) / np.float32(topk)
        total = np.float32(total_num_tokens)
        return float(c / total / total)


def aux_loss_forward(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int | torch.Tensor,
    num_experts: int,
    topk: int,
    coeff: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss () in probs' dtype, c (1,) fp32) of probs (R, C) and tokens_per_expert (C,)."""
    if probs.is_cuda and triton_available():
        return _forward_triton(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)
    return aux_loss_forward_reference(
        probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff
    )


def aux_loss_backward(
    coefficient: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    grad_loss: torch.Tensor,
    rows: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """d loss / d probs (rows, C) in `dtype`, from the forward's c (1,) fp32, tokens_per_expert
    (C,) and d loss ()."""
    if grad_loss.is_cuda and triton_available():
        return _backward_triton(coefficient, tokens_per_expert, grad_loss, rows, dtype)
    return aux_loss_backward_reference(coefficient, tokens_per_expert, grad_loss, rows, dtype)


def _forward_triton(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int | torch.Tensor,
    num_experts: int,
    topk: int,
    coeff: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch _column_sums_kernel over (column blocks, row slices), then _finish_kernel."""
    probs = probs.contiguous()
    tokens = tokens_per_expert.contiguous()
    rows, cols = probs.shape
    slices = max(1, min(MAX_SLICES, -(-rows // BLOCK_R)))
    rows_per_slice = -(-rows // (slices * BLOCK_R)) * BLOCK_R
    partial = torch.empty(slices, cols, dtype=torch.float32, device=probs.device)
    grid = (-(-cols // BLOCK_C), slices, 1)
    key = (probs.dtype, int_key(rows), int_key(cols), int_key(rows_per_slice))
    key += (probs.data_ptr() & 15, partial.data_ptr() & 15)
    _launch_sums(key, grid, 4, probs, partial, rows, cols, rows_per_slice, BLOCK_R, BLOCK_C)

    loss = torch.empty((), dtype=probs.dtype, device=probs.device)
    coefficient = torch.empty(1, dtype=torch.float32, device=probs.device)
    on_device = isinstance(total_num_tokens, torch.Tensor)
    total = total_num_tokens if on_device else coefficient
    host_c = 0.0 if on_device else aux_loss_coefficient(num_experts, topk, coeff, total_num_tokens)
    c_arg = float(coeff) if on_device else host_c
    block_s = 1 << max(slices - 1, 0).bit_length()
    ints = (slices, cols, num_experts, topk)
    key = (probs.dtype, tokens.dtype, total.dtype, on_device, block_s, *map(int_key, ints))
    key += tuple(t.data_ptr() & 15 for t in (partial, tokens, total, loss, coefficient))
    _launch_finish(
        key, (1, 1, 1), 4, partial, tokens, total, loss, coefficient, slices, cols, c_arg,
        num_experts, topk, on_device, block_s, BLOCK_C,
    )  # fmt: skip
    return loss, coefficient


def _backward_triton(
    coefficient: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    grad_loss: torch.Tensor,
    rows: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Launch _backward_kernel over (row blocks, column blocks); none for zero rows."""
    tokens = tokens_per_expert.contiguous()
    cols = tokens.numel()
    out = torch.empty(rows, cols, dtype=dtype, device=grad_loss.device)
    if rows == 0:
        return out
    block_r, block_c = 16, 128
    grid = (-(-rows // block_r), -(-cols // block_c), 1)
    key = (tokens.dtype, grad_loss.dtype, dtype, int_key(rows), int_key(cols))
    key += tuple(t.data_ptr() & 15 for t in (coefficient, tokens, grad_loss, out))
    _launch_backward(
        key, grid, 4, coefficient, tokens, grad_loss, out, rows, cols, block_r, block_c
    )
    return out


# ----------------------------------------------------------------------------------------------
# Torch reference: the same functions, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def aux_loss_forward_reference(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int | torch.Tensor,
    num_experts: int,
    topk: int,
    coeff: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of aux_loss_forward (fp64 math for fp64 probs, else fp32)."""
    cd = torch.float64 if probs.dtype == torch.float64 else torch.float32
    if isinstance(total_num_tokens, torch.Tensor):
        total = total_num_tokens.reshape(1).to(torch.float32)
        c = float(np.float32(num_experts) * np.float32(coeff))
        c = torch.tensor([c], dtype=torch.float32, device=total.device)
        c = (c / float(topk) / total / total).to(probs.device)
    else:
        c = aux_loss_coefficient(num_experts, topk, coeff, total_num_tokens)
        c = torch.tensor([c], dtype=torch.float32, device=probs.device)
    weighted = probs.to(cd).sum(0) * tokens_per_expert.to(cd)
    loss = (weighted.sum() * c.to(cd)[0]).to(probs.dtype)
    return loss, c


def aux_loss_backward_reference(
    coefficient: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    grad_loss: torch.Tensor,
    rows: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference of aux_loss_backward."""
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    value = coefficient.to(cd) * tokens_per_expert.to(cd) * grad_loss.to(cd)
    return value.to(dtype).expand(rows, -1).contiguous()
