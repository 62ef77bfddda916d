"""The merge of two partial attention outputs through their log-sum-exps, as ring attention
(distributed/context_parallel_ring.py) merges each key / value block's output into the running
one: for the rows merged,
    lse = log(exp(lse_acc) + exp(lse_blk)),
    out = out_acc exp(lse_acc - lse) + out_blk exp(lse_blk - lse),
a row that sees no key on either side (both lse -inf) staying 0 with lse -inf.

- `merge_reference(acc, acc_lse, block, block_lse)`: torch operations on any device; returns
  the merged rows in fp32 and their lse.
- `merge_into(acc, acc_lse, first_row, block, block_lse)`: one Triton launch on a CUDA device
  that writes the merged rows in place, into acc's rows [first_row, first_row + r) in acc's
  dtype (computed in fp32, rounded once) and into acc_lse. Any strides: acc may be the
  transposed view of an attention kernel's [b, h, s, dv] output, so that the last merge writes
  the layer's output without an fp32 copy of it and a cast after.

Shapes: acc [b, s, h, dv], acc_lse fp32 [b, h, s], block [b, r, h, dv], block_lse fp32 [b, h, r].
"""

from __future__ import annotations

import torch

from ._triton import cdiv, next_power_of_2, tl, triton

__all__ = ["merge_into", "merge_reference"]

_ROWS = 32  # rows of one program's tile (all dv columns of one head)


def merge_reference(
    acc: torch.Tensor, acc_lse: torch.Tensor, block: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged rows fp32 [b, r, h, dv], their lse [b, h, r]) of acc's rows (already the r rows
    that merge) and the block's."""
    lse = torch.logaddexp(acc_lse, block_lse)
    w_acc = torch.nan_to_num(torch.exp(acc_lse - lse)).transpose(1, 2).unsqueeze(-1)
    w_blk = torch.nan_to_num(torch.exp(block_lse - lse)).transpose(1, 2).unsqueeze(-1)
    return torch.addcmul(acc.float() * w_acc, block.float(), w_blk), lse


if triton is not None:

    @triton.jit
    def _merge_kernel(
        acc_ptr, acc_lse_ptr, blk_ptr, blk_lse_ptr,
        first_row, rows, heads, dv,
        sa_b, sa_s, sa_h, sa_d,  # acc strides (elements)
        sb_b, sb_s, sb_h, sb_d,  # block strides
        la_b, la_h, la_s,  # acc_lse strides
        lb_b, lb_h, lb_s,  # block_lse strides
        ROWS: tl.constexpr,
        DV: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // heads, bh % heads
        r = tile * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, DV)
        live = r < rows
        la = tl.load(acc_lse_ptr + b * la_b + h * la_h + (first_row + r) * la_s, mask=live)
        lb = tl.load(blk_lse_ptr + b * lb_b + h * lb_h + r * lb_s, mask=live)
        top = tl.maximum(la, lb)
        finite = top > float("-inf")
        top = tl.where(finite, top, 0.0)
        total = tl.exp(la - top) + tl.exp(lb - top)
        lse = tl.where(finite, top + tl.log(total), float("-inf"))
        w_acc = tl.where(finite, tl.exp(la - top) / total, 0.0)
        w_blk = tl.where(finite, tl.exp(lb - top) / total, 0.0)
        mask = live[:, None] & (d[None, :] < dv)
        a_off = b * sa_b + (first_row + r)[:, None] * sa_s + h * sa_h + d[None, :] * sa_d
        b_off = b * sb_b + r[:, None] * sb_s + h * sb_h + d[None, :] * sb_d
        acc = tl.load(acc_ptr + a_off, mask=mask, other=0.0).to(tl.float32)
        blk = tl.load(blk_ptr + b_off, mask=mask, other=0.0).to(tl.float32)
        out = acc * w_acc[:, None] + blk * w_blk[:, None]
        tl.store(acc_ptr + a_off, out.to(acc_ptr.dtype.element_ty), mask=mask)
        tl.store(acc_lse_ptr + b * la_b + h * la_h + (first_row + r) * la_s, lse, mask=live)


def merge_into(
    acc: torch.Tensor,
    acc_lse: torch.Tensor,
    first_row: int,
    block: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    """Merge block [b, r, h, dv] (lse [b, h, r]) into acc's rows [first_row, first_row + r)
    and acc_lse's, in place (CUDA tensors; acc in fp32, bf16 or fp16, any strides)."""
    b, rows, heads, dv = block.shape
    if acc.shape[0] != b or acc.shape[2:] != block.shape[2:] or first_row + rows > acc.shape[1]:
        raise ValueError(
            f"merge_into: block {tuple(block.shape)} at row {first_row} does not fit acc "
            f"{tuple(acc.shape)}"
        )
    if acc_lse.dtype != torch.float32 or block_lse.dtype != torch.float32:
        raise ValueError("merge_into: the log-sum-exps must be fp32")
    if rows == 0 or b * heads == 0:
        return
    grid = (cdiv(rows, _ROWS), b * heads)
    _merge_kernel[grid](
        acc, acc_lse, block, block_lse, first_row, rows, heads, dv,
        *acc.stride(), *block.stride(), *acc_lse.stride(), *block_lse.stride(),
        ROWS=_ROWS, DV=next_power_of_2(dv), num_warps=4,
    )  # fmt: skip
