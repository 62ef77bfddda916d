"""Transformer Engine's multi-tensor functions, on torch's foreach and fused optimizer ops.

Each `multi_tensor_*` function has Transformer Engine's signature
`op(chunk_size, noop_flag, tensor_lists, *args)` and is called through `multi_tensor_applier`
(or directly). `tensor_lists` is a list of equally long lists of tensors on one device;
`noop_flag` is a one-element tensor (int32 by convention) that the scale and norm functions
set to 1 when they meet a non-finite value, and that the capturable Adam and SGD functions read
(a set flag skips their update). `chunk_size` is accepted and not used: torch's foreach ops
choose their own chunking. Nothing here synchronizes with the device, except SGD with
`wd_after_momentum=True` or non-contiguous tensors (it reads the flag there).

The Adam functions live in `_adam.py`; this file holds the applier, scale, L2 norm and SGD.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._adam import (
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_adam_fp8,
    multi_tensor_adam_param_remainder,
)
from ._lists import check_flag, check_lists, fp32, local_tensor, raise_flag, working_fp32

__all__ = [
    "MultiTensorApply",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adam_fp8",
    "multi_tensor_adam_param_remainder",
    "multi_tensor_applier",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "multi_tensor_scale_tensor",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
]


class MultiTensorApply:
    """Calls a multi-tensor function on aligned tensor lists, as Transformer Engine's applier.

    `applier(op, noop_flag_buffer, tensor_lists, *args)`: DTensors are replaced by their local
    tensors, slots whose tensor in the first list is empty are dropped from every list, and
    `op(chunk_size, noop_flag_buffer, lists, *args)` is returned (None when no slot is left).
    The caller's lists are not modified.
    """

    def __init__(self, chunk_size: int) -> None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(
                f"MultiTensorApply: chunk_size must be a positive int, got {chunk_size}"
            )
        self.chunk_size = chunk_size

    def __call__(
        self,
        op: Callable[..., Any],
        noop_flag_buffer: torch.Tensor,
        tensor_lists: Sequence[Sequence[torch.Tensor]],
        *args: Any,
    ) -> Any:
        if not callable(op):
            raise TypeError(f"multi_tensor_applier: op must be callable, got {type(op).__name__}")
        if isinstance(tensor_lists, torch.Tensor) or not tensor_lists:
            raise ValueError("multi_tensor_applier: tensor_lists must be a non-empty list of lists")
        lists = [[local_tensor(t) for t in tensors] for tensors in tensor_lists]
        if any(len(tensors) != len(lists[0]) for tensors in lists):
            sizes = [len(tensors) for tensors in lists]
            raise RuntimeError(
                f"multi_tensor_applier: expected aligned tensor lists (equal lengths), got {sizes}"
            )
        keep = [t.numel() > 0 for t in lists[0]]
        lists = [[t for t, k in zip(tensors, keep, strict=True) if k] for tensors in lists]
        if not lists[0]:
            return None
        return op(self.chunk_size, noop_flag_buffer, lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
"""The applier with Transformer Engine's chunk size (2048 * 32 elements)."""


# ----------------------------------------------------------------------------------------------
# Scale
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: float,
) -> None:
    """dst = src * scale for tensor_lists = [srcs, dsts]; noop_flag set to 1 if a src value is
    inf or NaN (every dst is written all the same).

    Tensors are fp32, bf16 or fp16 (a src and its dst may differ); the product is taken in fp32
    (scale rounded to fp32) and rounded once to the dst's dtype. src and dst may be the same
    tensor (an in-place scale).
    """
    srcs, dsts = _scale_lists(noop_flag, tensor_lists, "multi_tensor_scale")
    if not srcs:
        return
    scale_t = torch.full((), fp32(float(scale)), dtype=torch.float32, device=srcs[0].device)
    _scale_into(noop_flag, srcs, dsts, scale_t, unit=float(scale) == 1.0)


@torch.no_grad()
def multi_tensor_scale_tensor(
    chunk_size: int,
    is_infinite: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: torch.Tensor,
) -> None:
    """multi_tensor_scale with the scale read from a one-element fp32 tensor on the tensors'
    device (no synchronization: a clip coefficient computed on the device)."""
    srcs, dsts = _scale_lists(is_infinite, tensor_lists, "multi_tensor_scale_tensor")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError("multi_tensor_scale_tensor: scale must be a one-element tensor")
    if scale.dtype != torch.float32:
        raise TypeError(f"multi_tensor_scale_tensor: scale must be fp32, got {scale.dtype}")
    if not srcs:
        return
    if scale.device != srcs[0].device:
        raise ValueError(
            f"multi_tensor_scale_tensor: scale is on {scale.device}, the tensors on "
            f"{srcs[0].device}"
        )
    _scale_into(is_infinite, srcs, dsts, scale.reshape(()))


def _scale_lists(noop_flag, tensor_lists, name):
    check_flag(noop_flag, name)
    srcs, dsts = check_lists(tensor_lists, 2, name, floating=True)
    for i, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
        if s.numel() != d.numel():
            raise ValueError(
                f"{name}: tensor {i} has {s.numel()} elements in the source and {d.numel()} "
                "in the destination"
            )
    return srcs, dsts


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same values (one tensor, or two views of the same elements)."""
    if a is b:
        return True
    return (a.data_ptr(), a.dtype, a.shape, a.stride()) == (
        b.data_ptr(),
        b.dtype,
        b.shape,
        b.stride(),
    )


def _scale_into(flag, srcs, dsts, scale_t, unit: bool = False) -> None:
    """dst = src * scale_t (0-dim fp32), the non-finite check of the srcs into flag; `unit`:
    the scale is 1, a copy (rounded to the dst's dtype as the product would be)."""
    found = torch.zeros(1, dtype=torch.float32, device=srcs[0].device)
    pairs = list(zip(srcs, dsts, strict=True))
    in_place = [d for s, d in pairs if _same_memory(s, d)]
    if in_place:
        # One pass: check and scale in place, in fp32 (the AMP unscale kernel).
        torch._amp_foreach_non_finite_check_and_unscale_(in_place, found, scale_t.reshape(1))
    others = [(s, d) for s, d in pairs if not _same_memory(s, d)]
    if others:
        src_o = [s for s, _ in others]
        dst_o = [d for _, d in others]
        _record_nonfinite(src_o, found)
        if unit:
            torch._foreach_copy_(dst_o, src_o)
        else:
            # Keep the fp32 product when src is narrower than dst: upcast such a src first.
            src_w = [s if s.dtype == d.dtype else s.float() for s, d in others]
            torch._foreach_copy_(dst_o, torch._foreach_mul(src_w, scale_t))
    raise_flag(flag, found)


def _record_nonfinite(tensors: list[torch.Tensor], found: torch.Tensor) -> None:
    """found (1,) fp32 = 1 where a tensor holds an inf or NaN (its max |x| is not finite)."""
    amaxes = torch.stack(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32))
    bad = ~torch.isfinite(amaxes).all()
    found.masked_fill_(bad, 1.0)


# ----------------------------------------------------------------------------------------------
# L2 norm
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, per_tensor_norms): the L2 norm of all tensors of tensor_lists[0] together, (1,)
    fp32, and with per_tensor each tensor's, (n,) fp32 (else an empty (0,) tensor). Sums of
    squares are taken in fp32; noop_flag is set to 1 when the total is not finite."""
    return _l2norm(noop_flag, tensor_lists, None, per_tensor, "multi_tensor_l2norm")


@torch.no_grad()
def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    inv_scale: torch.Tensor,
    per_tensor: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """multi_tensor_l2norm of the tensors multiplied by inv_scale (a one-element fp32 tensor);
    the tensors themselves are not changed."""
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1:
        raise ValueError("multi_tensor_unscale_l2norm: inv_scale must be a one-element tensor")
    return _l2norm(noop_flag, tensor_lists, inv_scale, per_tensor, "multi_tensor_unscale_l2norm")


def _l2norm(noop_flag, tensor_lists, inv_scale, per_tensor, name):
    check_flag(noop_flag, name)
    if isinstance(tensor_lists, torch.Tensor) or not tensor_lists:
        raise ValueError(f"{name}: tensor_lists must hold at least one list of tensors")
    (tensors,) = check_lists(tensor_lists[:1], 1, name, floating=True)
    device = tensors[0].device if tensors else noop_flag.device
    if not tensors:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return torch.zeros(1, dtype=torch.float32, device=device), empty
    if inv_scale is None:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    else:
        scaled = torch._foreach_mul(working_fp32(tensors), inv_scale.float().reshape(()))
        norms = torch._foreach_norm(scaled, 2)
    per = torch.stack(norms)
    total = torch.linalg.vector_norm(per).reshape(1)
    raise_flag(noop_flag, (~torch.isfinite(total)).float())
    if not per_tensor:
        per = torch.zeros(0, dtype=torch.float32, device=device)
    return total, per


# ----------------------------------------------------------------------------------------------
# SGD
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def multi_tensor_sgd(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    wd: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float,
) -> None:
    """One SGD step on tensor_lists = [grads, weights, momentum_buffers] (+ [weight_copies]).

    In fp32 math, per element: g = grad * scale; g += wd * w (before momentum, or after it with
    wd_after_momentum); with momentum: buf = g on the first run, else momentum * buf +
    (1 - dampening) * g, and g = g + momentum * buf (nesterov) or buf; w -= lr * g. A fourth
    list receives a copy of the new weights (cast to its dtype). Nothing changes when noop_flag
    is set. Grads are not modified.
    """
    name = "multi_tensor_sgd"
    check_flag(noop_flag, name)
    n_lists = len(tensor_lists) if not isinstance(tensor_lists, torch.Tensor) else 0
    if n_lists not in (3, 4):
        raise ValueError(f"{name}: expected 3 or 4 tensor lists, got {n_lists}")
    lists = check_lists(tensor_lists, n_lists, name, floating=True)
    grads, weights, moms = lists[:3]
    if not grads:
        return
    found = noop_flag.reshape(1).to(device=grads[0].device, dtype=torch.float32)
    if float(scale) != 1.0:
        grads = torch._foreach_mul(working_fp32(grads), fp32(float(scale)))
    hyper = dict(weight_decay=wd, momentum=momentum, dampening=dampening, nesterov=nesterov)
    contiguous = all(t.is_contiguous() for t in (*grads, *weights, *moms))
    if wd_after_momentum or not contiguous:
        _sgd_reference(grads, weights, moms, lr, first_run, found, wd_after_momentum, **hyper)
    else:
        _sgd_fused(grads, weights, moms, lr, first_run, found, **hyper)
    if n_lists == 4:
        copies = lists[3]
        keep = [i for i in range(len(weights)) if not _same_memory(weights[i], copies[i])]
        if keep:
            torch._foreach_copy_([copies[i] for i in keep], [weights[i] for i in keep])


def _sgd_fused(grads, weights, moms, lr, first_run, found, **hyper) -> None:
    """torch's fused SGD (wd before momentum, TE's default), in fp32 working copies where the
    dtypes of a slot differ."""
    use_mom = hyper["momentum"] != 0
    work = [weights, grads, moms] if use_mom else [weights, grads]
    uniform = len({t.dtype for tensors in work for t in tensors}) == 1
    work_f = work if uniform else [working_fp32(tensors) for tensors in work]
    torch._fused_sgd_(
        work_f[0],
        work_f[1],
        work_f[2] if use_mom else [],
        weight_decay=hyper["weight_decay"],
        momentum=hyper["momentum"],
        lr=lr,
        dampening=hyper["dampening"],
        nesterov=hyper["nesterov"],
        maximize=False,
        is_first_step=first_run,
        found_inf=found,
    )
    if not uniform:
        _write_back(weights, work_f[0])
        if use_mom:
            _write_back(moms, work_f[2])


def _sgd_reference(grads, weights, moms, lr, first_run, found, wd_after, **hyper) -> None:
    """SGD in fp32 per tensor, for what torch's fused SGD does not do: weight decay after the
    momentum, non-contiguous tensors. Reads the flag (a synchronization on a GPU)."""
    if bool(found.item()):
        return
    wd, momentum, dampening = hyper["weight_decay"], hyper["momentum"], hyper["dampening"]
    for g_in, w, buf in zip(grads, weights, moms, strict=True):
        g = g_in.float()
        w32 = w.float()
        if wd != 0 and not wd_after:
            g = g + wd * w32
        if momentum != 0:
            m = g.clone() if first_run else buf.float() * momentum + (1.0 - dampening) * g
            g = g + momentum * m if hyper["nesterov"] else m
            buf.copy_(m)
        if wd != 0 and wd_after:
            g = g + wd * w32
        w.copy_(w32 - lr * g)


def _write_back(originals: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    """Copy each working copy back into its original where it is a different tensor."""
    pairs = [(o, c) for o, c in zip(originals, copies, strict=True) if o is not c]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [c for _, c in pairs])
