"""te.parallel_cross_entropy: cross entropy over logits whose vocabulary is split across the
ranks of a tensor-parallel group (Transformer Engine's `transformer_engine.pytorch.cross_entropy`).

Each rank holds the logits of an equal shard of the vocabulary, (..., V / W), rank r classes
r V / W .. (r + 1) V / W - 1, and the same targets (..., ) of the whole vocabulary. Each rank
reduces its shard to four numbers per token (max, sum of exp(x - max), the target's logit,
sum of x); one all-gather of those (4 N floats a rank) gives every rank the loss of the whole
vocabulary, and the gradient of its shard, which is computed in the forward and kept (fp32)
until backward scales it by the upstream gradient. The kernels and their torch reference are in
torchte/kernels/cross_entropy.py; CPU tensors run the reference, CUDA tensors the Triton kernels.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._device import graph_capturing
from .distributed import gather_along_first_dim
from .kernels.cross_entropy import (
    check_logits,
    cross_entropy_backward,
    cross_entropy_loss_and_grad,
    cross_entropy_stats,
)

__all__ = ["parallel_cross_entropy"]

_NAME = "parallel_cross_entropy"


@dataclass(frozen=True, slots=True)
class _CrossEntropySpec:
    """What the autograd Function gets besides the tensors (one call's settings).

    label_smoothing: in [0, 1]. reduce_loss: mean over the tokens not ignored.
    group: the tensor-parallel group the vocabulary is split over (None: not split).
    world, rank: its size and this rank's place (1 and 0 without a group).
    ignore_idx: the target that marks a token without loss.
    check_targets: read the targets on the host to refuse one out of range (not while a CUDA
    graph is captured, nor with is_cg_capturable).
    """

    label_smoothing: float
    reduce_loss: bool
    group: object
    world: int
    rank: int
    ignore_idx: int
    check_targets: bool


class _CrossEntropyFunction(torch.autograd.Function):
    """loss of logits (N, V / W) and targets (N,); the gradient is made in forward and saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, spec: _CrossEntropySpec):
        n_cols = x.shape[1]
        if spec.check_targets:
            _check_targets(target, n_cols * spec.world, spec.ignore_idx)
        vocab_start = spec.rank * n_cols
        stats = cross_entropy_stats(x, target, vocab_start)
        if spec.world > 1:
            stats_all, _ = gather_along_first_dim(stats[None], spec.group)
        else:
            stats_all = stats[None]
        write_grad = ctx.needs_input_grad[0]
        loss, grad = cross_entropy_loss_and_grad(
            x, target, stats_all, vocab_start, spec.ignore_idx, spec.label_smoothing, write_grad
        )
        count = None
        if spec.reduce_loss:
            # Tokens not ignored, at least 1 (all ignored: loss 0), kept on the device.
            count = (target != spec.ignore_idx).sum().clamp_(min=1).reshape(1)
            loss = loss.sum().reshape(1) / count
        ctx.save_for_backward(grad, count)
        ctx.x_dtype = x.dtype
        ctx.in_place = x.dtype == grad.dtype
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        # An fp32 (fp64) gradient is scaled in place, as Transformer Engine does; bf16 / fp16
        # ones are written anew (half the size), which leaves the saved gradient as it was.
        # Checked before saved_tensors, whose own error (a tensor modified in place) names
        # neither the function nor the cause.
        if ctx.used and ctx.in_place:
            raise RuntimeError(
                f"{_NAME}: backward ran twice through one forward of {ctx.x_dtype} logits (the "
                "saved gradient is scaled in place); run the forward again"
            )
        ctx.used = True
        grad, count = ctx.saved_tensors
        if count is None:
            scale = dy.reshape(-1).to(grad.dtype).contiguous()
        else:
            scale = dy.reshape(1).to(grad.dtype) / count
        dx = cross_entropy_backward(grad, scale, ctx.x_dtype, ctx.in_place)
        return dx, None, None


def _check_targets(target: torch.Tensor, n_vocab: int, ignore_idx: int) -> None:
    """ValueError naming a target outside [0, n_vocab) that is not ignore_idx (one host read)."""
    bad = (target != ignore_idx) & ((target < 0) | (target >= n_vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"{_NAME}: target must be in [0, {n_vocab}) (the whole vocabulary) or ignore_idx "
            f"({ignore_idx}), got {value}"
        )


def _group_place(group) -> tuple[int, int]:
    """(world, rank) of the group; (1, 0) for None."""
    if group is None:
        return 1, 0
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{_NAME}: dist_process_group must be a torch.distributed.ProcessGroup or None, "
            f"got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(
            f"{_NAME}: dist_process_group given but torch.distributed is not initialized"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def _check_arguments(
    inp: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    reduce_loss: bool,
    ignore_idx: int,
) -> None:
    """TypeError / ValueError naming the argument and its rule, before any kernel runs."""
    if not isinstance(inp, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{_NAME}: inp and target must be tensors")
    if inp.dim() < 2:
        raise ValueError(
            f"{_NAME}: inp must be (..., V), e.g. (B, SQ, V) or (SQ, B, V), got shape "
            f"{tuple(inp.shape)}"
        )
    if inp.shape[-1] < 1:
        raise ValueError(f"{_NAME}: inp's vocabulary dim (last) must be >= 1, got 0")
    if target.shape != inp.shape[:-1] and target.shape != (math.prod(inp.shape[:-1]),):
        raise ValueError(
            f"{_NAME}: target must have inp's shape without its last dim, "
            f"{tuple(inp.shape[:-1])} (or be flat), got {tuple(target.shape)}"
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, int | float):
        raise TypeError(f"{_NAME}: label_smoothing must be a float, got {label_smoothing!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{_NAME}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not isinstance(reduce_loss, bool):
        raise TypeError(f"{_NAME}: reduce_loss must be a bool, got {reduce_loss!r}")
    if isinstance(ignore_idx, bool) or not isinstance(ignore_idx, int):
        raise TypeError(f"{_NAME}: ignore_idx must be an int, got {ignore_idx!r}")


def parallel_cross_entropy(
    inp: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group: dist.ProcessGroup | None = None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    *,
    _input: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross entropy of logits `inp` (..., V / W) against `target` (...), the vocabulary split
    evenly over the W ranks of `dist_process_group` (None: this rank has all of it).

    inp: fp32 / bf16 / fp16 (or fp64, computed in fp64), unit stride along V; e.g. (B, SQ, V)
    or (SQ, B, V). target: int64 / int32 of inp's shape without the last dim (or flat), each
    in [0, V) of the whole vocabulary or `ignore_idx` (loss and gradient 0). Returns the loss
    in fp32 (fp64 for fp64 logits): inp.shape[:-1], or with reduce_loss the mean over tokens
    not ignored, shape (1,) (0 when all are ignored). `label_smoothing` as torch's
    cross_entropy. `is_cg_capturable`: no host reads (the target check is skipped, as it is
    while a CUDA graph is captured: a bad target then gives NaN). Every rank of the group must
    call with the same targets. `_input`: deprecated name of `inp` (FutureWarning).
    """
    if _input is not None:
        warnings.warn(f"{_NAME}: '_input' is deprecated; pass 'inp'", FutureWarning, stacklevel=2)
        inp = _input
    _check_arguments(inp, target, label_smoothing, reduce_loss, ignore_idx)
    world, rank = _group_place(dist_process_group)
    n_cols = inp.shape[-1]
    x = inp.reshape(-1, n_cols)
    if n_cols > 1 and x.stride(1) != 1:
        x = x.contiguous()
    target_flat = target.reshape(-1)
    check_logits(x, target_flat, _NAME)
    check_targets = not (is_cg_capturable or graph_capturing(x))
    spec = _CrossEntropySpec(
        float(label_smoothing), reduce_loss, dist_process_group, world, rank, ignore_idx,
        check_targets,
    )  # fmt: skip
    loss = _CrossEntropyFunction.apply(x, target_flat, spec)
    if reduce_loss:
        return loss
    return loss.view(inp.shape[:-1])
