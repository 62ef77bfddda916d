"""The autograd Functions behind torchte.moe.permutation: each takes tensors and one `Plan`.

Shape legend: N tokens, H hidden, E experts, K routes per token, R permuted rows.

Gradients follow Transformer Engine: permute's input gradient is the unpermute (a sum over
routes) of the output gradient, also where a zero prob zeroed a padding route's row;
unpermute's is the permute of its gradient (times the merging prob of each route); the probs'
gradients go back to the entries they came from (zero elsewhere). Maps get no gradient.

A per-tensor FP8 value (Float8Tensor) moves as its bytes, with the same scale_inv: through
mask-map permutes and chunk sorts (forward and backward), and through the gradient of a mask-map
unpermute without merging probs, as in Transformer Engine; elsewhere it is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import permutation as kernels
from ..quantization.base import QuantizedTensor
from ..quantization.float8 import Float8Storage
from ..quantization.float8_tensor import Float8Tensor

__all__ = ["IndexPermute", "IndexUnpermute", "MaskPermute", "MaskUnpermute", "Plan", "SortChunks"]


@dataclass(frozen=True, slots=True)
class Plan:
    """What a permutation Function needs besides tensors."""

    num_out_tokens: int = 0  # rows of the permuted output (permutes)
    topk: int = 0  # K of an index map (index Functions)
    num_permuted: int = 0  # R, rows of the permuted tensor (unpermute backward)


def _keep(x: torch.Tensor) -> torch.Tensor:
    return x


def as_bytes(
    x: torch.Tensor, where: str
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(rows to move, how to wrap the moved rows back): a Float8Tensor's rowwise bytes as uint8
    and a wrapper making a Float8Tensor of the same scale_inv; a plain tensor as it is."""
    if isinstance(x, Float8Tensor):
        storage = x._storage
        if storage.rowwise_data is None:
            raise NotImplementedError(f"{where}: a Float8Tensor without rowwise data")
        nominal, fp8_dtype, scale_inv = x.dtype, storage.fp8_dtype, storage.scale_inv

        def wrap(moved: torch.Tensor) -> torch.Tensor:
            data = moved.view(fp8_dtype)
            moved_storage = Float8Storage(data, None, scale_inv, fp8_dtype, tuple(data.shape))
            return Float8Tensor(moved_storage, nominal)

        return storage.rowwise_data.view(torch.uint8), wrap
    if isinstance(x, QuantizedTensor):
        raise NotImplementedError(
            f"{where}: {type(x).__name__} inputs are not supported (only per-tensor FP8, "
            "Float8Tensor, moves through permutation)"
        )
    return x, _keep


def refuse_quantized(x: torch.Tensor, where: str) -> None:
    """NotImplementedError where Transformer Engine takes no quantized values either."""
    if isinstance(x, QuantizedTensor):
        raise NotImplementedError(f"{where} does not support quantized (FP8) tensors")


class MaskPermute(torch.autograd.Function):
    """inp (N, H), routing_map (N, E), probs (N, E) | None, pad_offsets (E,) | None ->
    (out (R, H), row_id_map (N, 2E+1) int32, permuted_probs (R,) | None); R = plan's
    num_out_tokens, or when that is negative the routed count (read on the host)."""

    @staticmethod
    def forward(ctx, inp, routing_map, probs, pad_offsets, plan: Plan):
        rows, wrap = as_bytes(inp, "moe_permute")
        row_id_map, counts = kernels.mask_row_id_map(routing_map)
        num_out = plan.num_out_tokens
        if num_out < 0:
            num_out = int(counts[-1])  # the one host sync: the output's size
        # counts tell the kernel which rows no route writes (padding, spare rows): it zeroes
        # just those
        out, out_probs = kernels.permute_rows(
            rows, row_id_map, probs, pad_offsets, counts, num_out, 0
        )
        ctx.save_for_backward(row_id_map, pad_offsets)
        ctx.mark_non_differentiable(row_id_map)
        # Autograd would fill a zero gradient for the map (and for unused probs) each backward:
        # a launch and N (2E+1) words for nothing. Missing gradients come as None instead.
        ctx.set_materialize_grads(False)
        ctx.grad_like = (out.shape, inp.dtype, None if probs is None else probs.dtype)
        return wrap(out), row_id_map, out_probs

    @staticmethod
    def backward(ctx, grad_out, _grad_map, grad_probs):
        if grad_out is not None:
            refuse_quantized(grad_out, "the backward of moe_permute")
        d_inp, d_probs = mask_permute_grads(ctx, grad_out, grad_probs, ctx.needs_input_grad[2])
        return d_inp, None, d_probs, None, None


def mask_permute_grads(ctx, grad_out, grad_probs, probs_need_grad: bool):
    """(d_inp, d_probs): one unpermute of the gradients of a mask-map permutation's rows and
    permuted probs, for a Function that saved (row_id_map, pad_offsets), set
    ctx.grad_like = (rows' shape, inp dtype, probs dtype) and does not materialize missing
    gradients: a None gradient stands for the zeros autograd would have given; d_probs None
    unless probs_need_grad."""
    row_id_map, pad_offsets = ctx.saved_tensors
    shape, dtype, probs_dtype = ctx.grad_like
    dev = row_id_map.device
    if grad_out is None:  # out unused: the zeros autograd would have given
        grad_out = torch.zeros(shape, dtype=dtype, device=dev)
    if not probs_need_grad:
        grad_probs = None
    elif grad_probs is None:
        grad_probs = torch.zeros(shape[:1], dtype=probs_dtype, device=dev)
    return kernels.unpermute_rows(grad_out, row_id_map, None, grad_probs, pad_offsets, 0)


class MaskUnpermute(torch.autograd.Function):
    """inp (R, H), row_id_map (N, 2E+1), merging_probs (N, E) | None, pad_offsets (E,) | None
    -> out (N, H): each token's routes summed in fp32, times their merging probs when given."""

    @staticmethod
    def forward(ctx, inp, row_id_map, merging_probs, pad_offsets, plan: Plan):
        out, _ = kernels.unpermute_rows(inp, row_id_map, merging_probs, None, pad_offsets, 0)
        ctx.save_for_backward(
            inp if merging_probs is not None else None, row_id_map, merging_probs, pad_offsets
        )
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad):
        inp, row_id_map, merging_probs, pad_offsets = ctx.saved_tensors
        if merging_probs is None:
            rows, wrap = as_bytes(grad, "the backward of moe_unpermute")
            d_inp, _ = kernels.permute_rows(
                rows, row_id_map, None, pad_offsets, None, ctx.plan.num_permuted, 0
            )
            return wrap(d_inp), None, None, None, None
        refuse_quantized(grad, "the backward of moe_unpermute with merging probs")
        d_inp, d_probs = kernels.unpermute_rows_backward(
            grad, row_id_map, inp, merging_probs, pad_offsets, None, 0
        )
        return d_inp, None, d_probs if ctx.needs_input_grad[2] else None, None, None


class IndexPermute(torch.autograd.Function):
    """inp (N, H), indices (N, K) -> (out (R, H), row_id_map (K*N,) int32); R = plan's
    num_out_tokens (routes sorted past it are dropped, rows past N*K are zero)."""

    @staticmethod
    def forward(ctx, inp, indices, plan: Plan):
        row_id_map = kernels.index_row_id_map(indices, plan.num_out_tokens)
        out, _ = kernels.permute_rows(
            inp, row_id_map, None, None, None, plan.num_out_tokens, plan.topk
        )
        ctx.save_for_backward(row_id_map)
        ctx.topk = plan.topk
        ctx.mark_non_differentiable(row_id_map)
        ctx.set_materialize_grads(False)  # no zero fill for the map's gradient (MaskPermute)
        ctx.grad_like = (out.shape, out.dtype)
        return out, row_id_map

    @staticmethod
    def backward(ctx, grad_out, _grad_map):
        (row_id_map,) = ctx.saved_tensors
        if grad_out is None:  # out unused: the zeros autograd would have given
            shape, dtype = ctx.grad_like
            grad_out = torch.zeros(shape, dtype=dtype, device=row_id_map.device)
        d_inp, _ = kernels.unpermute_rows(grad_out, row_id_map, None, None, None, ctx.topk)
        return d_inp, None, None


class IndexUnpermute(torch.autograd.Function):
    """inp (R, H), row_id_map (K*N,), probs (N, K) float32 | None -> out: (N, H), the routes
    of each token summed times probs; without probs (Transformer Engine's K = 1 reading of the
    map) (K*N, H), entry k*N + t the row of route k of token t."""

    @staticmethod
    def forward(ctx, inp, row_id_map, probs, plan: Plan):
        out, _ = kernels.unpermute_rows(inp, row_id_map, probs, None, None, plan.topk)
        ctx.save_for_backward(inp if probs is not None else None, row_id_map, probs)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad):
        inp, row_id_map, probs = ctx.saved_tensors
        plan = ctx.plan
        if probs is None:
            d_inp, _ = kernels.permute_rows(
                grad, row_id_map, None, None, None, plan.num_permuted, 1
            )
            return d_inp, None, None, None
        d_inp, d_probs = kernels.unpermute_rows_backward(
            grad, row_id_map, inp, probs, None, None, plan.topk
        )
        return d_inp, None, d_probs if ctx.needs_input_grad[2] else None, None


class SortChunks(torch.autograd.Function):
    """inp (N, H), split_sizes (S,), sorted_index (S,), probs (N,) | None -> (out (N, H),
    permuted_probs (N,) | None): the chunks of rows put in sorted_index's order."""

    @staticmethod
    def forward(ctx, inp, split_sizes, sorted_index, probs):
        rows, wrap = as_bytes(inp, "moe_sort_chunks_by_index")
        n = rows.shape[0]
        row_id_map = kernels.chunk_sort_map(split_sizes, sorted_index, n)
        probs_2d = probs.reshape(n, 1) if probs is not None else None
        out, out_probs = kernels.permute_rows(rows, row_id_map, probs_2d, None, None, n, 1)
        ctx.save_for_backward(row_id_map)
        return wrap(out), out_probs

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        (row_id_map,) = ctx.saved_tensors
        rows, wrap = as_bytes(grad_out, "the backward of moe_sort_chunks_by_index")
        grad_probs = grad_probs if ctx.needs_input_grad[3] else None
        d_inp, d_probs = kernels.unpermute_rows(rows, row_id_map, None, grad_probs, None, 1)
        d_probs = d_probs.reshape(-1) if d_probs is not None else None
        return wrap(d_inp), None, None, d_probs
