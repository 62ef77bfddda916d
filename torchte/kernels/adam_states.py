"""Adam / AdamW over many tensors in one launch, each state in its own dtype: what
te.optimizers.FusedAdam runs on a CUDA device for its fp32 and bf16 states, with master weights
written back to their params in the same pass.

Per element, in fp32, in Transformer Engine's order (optimizers/_adam.py's reference):

    g = grad (* inv_scale: the grad is written back unscaled)    g += wd * p       (Adam, L2)
    m = beta1 * m + (1 - beta1) * g                              v = beta2 * v + (1 - beta2) * g * g
    update = (m / bc1) / (sqrt(v / bc2) + eps)                   update += wd * p  (AdamW)
    p = p - lr * update

p is the tensor the math updates (the param, or its fp32 master); each of p, m and v is read in
its dtype (fp32, bf16 or fp16) and written back rounded to nearest; with a param copy (master
weights) the new p is also written, rounded, into the param. lr, bc1 and bc2 are read from a
(3,) fp32 device tensor, so a CUDA graph can replay the step with new values (capturable); a
set found_inf (1,) skips the step (nothing is written).

The tensors are found through a table of their addresses and cut in chunks (kernels/adamw.py's
layout): one launch per combination of dtypes. `adam_step_reference_` computes the same in
torch operations on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._triton import tl, triton
from .adamw import _launch_args

__all__ = [
    "STATE_DTYPES",
    "AdamStates",
    "adam_step_",
    "adam_step_reference_",
    "supported",
    "takes",
]

_CHUNK = 1 << 13
_BLOCK = 1024
_WARPS = 4
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:
    from .adamw import _chunk

    @triton.jit
    def _adam_kernel(
        addresses_ptr,  # (5, T) int64: target, grad, exp_avg, exp_avg_sq, param copy
        numels_ptr,  # (T,) int64
        chunk_tensor_ptr,  # (C,) int32
        chunk_start_ptr,  # (C,) int64
        hyper_ptr,  # (3,) fp32: lr, bc1, bc2
        found_inf_ptr,  # (1,) fp32 (HAS_FOUND_INF)
        inv_scale_ptr,  # (1,) fp32 (HAS_INV_SCALE)
        n_tensors,
        beta1,
        beta2,
        eps,
        weight_decay,
        P_DTYPE: tl.constexpr,
        G_DTYPE: tl.constexpr,
        M_DTYPE: tl.constexpr,
        V_DTYPE: tl.constexpr,
        COPY_DTYPE: tl.constexpr,
        HAS_COPY: tl.constexpr,
        ADAMW: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
        HAS_INV_SCALE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0)
        t, start, numel = _chunk(chunk_tensor_ptr, chunk_start_ptr, numels_ptr, c)
        if HAS_FOUND_INF:  # a skipped step writes nothing
            numel = tl.where(tl.load(found_inf_ptr) != 0, 0, numel)
        p_ptr = tl.load(addresses_ptr + t).to(tl.pointer_type(P_DTYPE))
        g_ptr = tl.load(addresses_ptr + n_tensors + t).to(tl.pointer_type(G_DTYPE))
        m_ptr = tl.load(addresses_ptr + 2 * n_tensors + t).to(tl.pointer_type(M_DTYPE))
        v_ptr = tl.load(addresses_ptr + 3 * n_tensors + t).to(tl.pointer_type(V_DTYPE))
        lr = tl.load(hyper_ptr)
        bc1 = tl.load(hyper_ptr + 1)
        bc2 = tl.load(hyper_ptr + 2)
        for i in tl.range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            mask = offs < numel
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_INV_SCALE:
                g = g * tl.load(inv_scale_ptr)
                tl.store(g_ptr + offs, g.to(G_DTYPE), mask=mask)
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if not ADAMW:
                g = g + weight_decay * p
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * g * g
            denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
            update = tl.div_rn(tl.div_rn(m, bc1), denom)
            if ADAMW:
                update = update + weight_decay * p
            p = p - lr * update
            tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
            tl.store(m_ptr + offs, m.to(M_DTYPE), mask=mask)
            tl.store(v_ptr + offs, v.to(V_DTYPE), mask=mask)
            if HAS_COPY:
                c_ptr = tl.load(addresses_ptr + 4 * n_tensors + t).to(tl.pointer_type(COPY_DTYPE))
                tl.store(c_ptr + offs, p.to(COPY_DTYPE), mask=mask)


_TRITON_DTYPES = (
    {}
    if tl is None
    else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
)


@dataclass(frozen=True, slots=True)
class AdamStates:
    """The constants of one step: betas, eps, weight decay, AdamW (decoupled) or Adam (L2)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool


def takes(*tensors: torch.Tensor | None) -> bool:
    """Whether adam_step_ takes these tensors (None: absent): contiguous, of STATE_DTYPES."""
    for t in tensors:
        if t is not None and (t.dtype not in STATE_DTYPES or not t.is_contiguous()):
            return False
    return True


def supported(*lists: Sequence[torch.Tensor]) -> bool:
    """Whether adam_step_ takes these lists (`takes` of every tensor)."""
    return all(takes(*lst) for lst in lists)


def _check(targets, grads, exp_avgs, exp_avg_sqs, copies, hyper) -> None:
    lists = [targets, grads, exp_avgs, exp_avg_sqs] + ([copies] if copies is not None else [])
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adam_step_: list lengths differ: {[len(x) for x in lists]}")
    for tensors in zip(*lists, strict=True):
        if len({t.shape for t in tensors}) != 1:
            raise ValueError(f"adam_step_: shapes differ: {[tuple(t.shape) for t in tensors]}")
    if not supported(*lists):
        raise ValueError(f"adam_step_: every tensor must be contiguous and of {STATE_DTYPES}")
    if hyper.dtype != torch.float32 or hyper.numel() != 3:
        raise ValueError("adam_step_: hyper must be a (3,) fp32 tensor: lr, bc1, bc2")


def adam_step_(
    targets: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    copies: Sequence[torch.Tensor] | None,
    hyper: torch.Tensor,
    states: AdamStates,
    found_inf: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
    checked: bool = False,
) -> None:
    """One Adam(W) step in place (module docstring) over equally shaped tensors on one CUDA
    device; copies (None: none) receive the updated targets, rounded (master weights). hyper:
    (3,) fp32 (lr, bc1, bc2); found_inf, inv_scale: (1,) fp32 or None. One launch per
    combination of dtypes. checked: the caller made sure of the lists' lengths, shapes and
    `supported` (FusedAdam: the per-tensor checks cost host time each step)."""
    if not checked:
        _check(targets, grads, exp_avgs, exp_avg_sqs, copies, hyper)
    lists = [targets, grads, exp_avgs, exp_avg_sqs] + ([copies] if copies is not None else [])
    keys = [(p.dtype, g.dtype, m.dtype, v.dtype) for p, g, m, v in zip(*lists[:4], strict=True)]
    if copies is not None:
        keys = [(*key, c.dtype) for key, c in zip(keys, copies, strict=True)]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    for dtypes, index in groups.items():
        whole = len(index) == len(targets)
        picked = tuple(lst if whole else [lst[i] for i in index] for lst in lists)
        args = _launch_args(picked, _CHUNK)
        if args is None:
            continue
        addresses, numels, tensor_of, start = args
        flag = found_inf if found_inf is not None else hyper
        scale = inv_scale if inv_scale is not None else hyper
        has_copy = copies is not None
        _adam_kernel[(tensor_of.numel(),)](
            addresses, numels, tensor_of, start, hyper, flag, scale, len(index),
            float(states.beta1), float(states.beta2), float(states.eps),
            float(states.weight_decay),
            P_DTYPE=_TRITON_DTYPES[dtypes[0]], G_DTYPE=_TRITON_DTYPES[dtypes[1]],
            M_DTYPE=_TRITON_DTYPES[dtypes[2]], V_DTYPE=_TRITON_DTYPES[dtypes[3]],
            COPY_DTYPE=_TRITON_DTYPES[dtypes[4] if has_copy else dtypes[0]],
            HAS_COPY=has_copy, ADAMW=states.adamw, HAS_FOUND_INF=found_inf is not None,
            HAS_INV_SCALE=inv_scale is not None, CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=_WARPS,
        )  # fmt: skip


def adam_step_reference_(
    targets: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    copies: Sequence[torch.Tensor] | None,
    hyper: torch.Tensor,
    states: AdamStates,
    found_inf: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
) -> None:
    """adam_step_ in torch operations (any device), the same math in the same order."""
    _check(targets, grads, exp_avgs, exp_avg_sqs, copies, hyper)
    if found_inf is not None and bool(found_inf.reshape(()) != 0):
        return
    lr, bc1, bc2 = (x.reshape(()) for x in hyper.unbind())
    s = states
    copies = copies if copies is not None else [None] * len(targets)
    for p_t, g_t, m_t, v_t, c_t in zip(targets, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        g = g_t.float()
        if inv_scale is not None:
            g = g * inv_scale.float().reshape(())
            g_t.copy_(g)
        p, m, v = p_t.float(), m_t.float(), v_t.float()
        if not s.adamw:
            g = g + s.weight_decay * p
        m = s.beta1 * m + (1.0 - s.beta1) * g
        v = s.beta2 * v + (1.0 - s.beta2) * g * g
        update = (m / bc1) / (torch.sqrt(v / bc2) + s.eps)
        if s.adamw:
            update = update + s.weight_decay * p
        p = p - lr * update
        p_t.copy_(p)
        m_t.copy_(m)
        v_t.copy_(v)
        if c_t is not None:
            c_t.copy_(p)
