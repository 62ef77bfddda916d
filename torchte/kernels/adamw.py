"""AdamW over many fp32 tensors in one launch, gradients scaled on the way in, and the
gradients' global norm in one launch: gradient clipping and the AdamW step in two passes over
the gradients instead of three.

torch's fused AdamW (`torch._fused_adamw_`) reads each element's parameter, gradient and two
moments and writes three of them back: 28 bytes an fp32 element, the whole step bound by
memory. At the training example's 2000M parameters it moved about 2.5 TB/s on an H200, about
60% of a device copy. This kernel reads and writes the same bytes with each program streaming
one long chunk of one tensor, the tensors found through a table of their addresses (so one
launch covers a parameter group, whatever its tensors' sizes), and multiplies every gradient by
a device scalar first: gradient clipping's factor, applied in registers instead of in a pass of
its own over the gradients (`torch.nn.utils.clip_grad_norm_` multiplies them in place, 12
bytes an element). The norm (`grad_norm`) reads the gradients through the same kind of table,
one fp32 sum of squares per chunk, summed in chunk order afterwards (deterministic).

The update per element, in fp32, in the order of torch's fused kernel:

    g = grad * grad_scale
    p = p - lr * weight_decay * p                         (decoupled weight decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

with bc1 = 1 - beta1 ** step and bc2 = 1 - beta2 ** step.

Layout: parameters, exp_avg and exp_avg_sq fp32 and contiguous; gradients contiguous, fp32 or
bf16 (one dtype per launch).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._triton import tl, triton

__all__ = [
    "ADAMW_CHUNK",
    "GRAD_DTYPES",
    "AdamWStep",
    "adamw_step_",
    "adamw_step_reference_",
    "grad_norm",
    "grad_norm_reference",
    "grad_sum_squares",
    "grad_sum_squares_reference",
    "grads_supported",
]

# Elements a program updates (read at each call; benchmarks/optimizer_step.py compares sizes):
# long enough that a program streams, short enough that the last wave of programs is not left
# short at the medium example's 140M parameters and a 1-element tensor wastes one program only.
ADAMW_CHUNK = 1 << 13
_BLOCK = 2048
_WARPS = 8

if triton is not None:

    @triton.jit
    def _chunk(chunk_tensor_ptr, chunk_start_ptr, numels_ptr, c):
        """(the tensor of chunk c, the chunk's first element in it, the tensor's elements)."""
        t = tl.load(chunk_tensor_ptr + c)
        return t, tl.load(chunk_start_ptr + c), tl.load(numels_ptr + t)

    @triton.jit
    def _adamw_kernel(
        addresses_ptr,  # (4, T) int64: each tensor's param, grad, exp_avg, exp_avg_sq address
        numels_ptr,  # (T,) int64: each tensor's elements
        chunk_tensor_ptr,  # (C,) int32: the tensor chunk c of the launch belongs to
        chunk_start_ptr,  # (C,) int64: the chunk's first element in its tensor
        grad_scale_ptr,  # (1,) fp32: every gradient is multiplied by it
        n_tensors,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step_size,  # lr / bc1
        bc2_sqrt,  # sqrt(bc2)
        GRAD_DTYPE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0)
        t, start, numel = _chunk(chunk_tensor_ptr, chunk_start_ptr, numels_ptr, c)
        p_ptr = tl.load(addresses_ptr + t).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(addresses_ptr + n_tensors + t).to(tl.pointer_type(GRAD_DTYPE))
        m_ptr = tl.load(addresses_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(addresses_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
        grad_scale = tl.load(grad_scale_ptr)
        for i in tl.range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            mask = offs < numel
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
            p = p - lr * weight_decay * p
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * g * g
            denom = tl.sqrt_rn(v) / bc2_sqrt + eps
            p = p - step_size * (m / denom)
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)

    @triton.jit
    def _sum_squares_kernel(
        addresses_ptr,  # (T,) int64: each gradient's address
        numels_ptr,  # (T,) int64
        chunk_tensor_ptr,  # (C,) int32
        chunk_start_ptr,  # (C,) int64
        partial_ptr,  # (C,) fp32: written, chunk c's sum of squares
        GRAD_DTYPE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0)
        t, start, numel = _chunk(chunk_tensor_ptr, chunk_start_ptr, numels_ptr, c)
        g_ptr = tl.load(addresses_ptr + t).to(tl.pointer_type(GRAD_DTYPE))
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in tl.range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            g = tl.load(g_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
            acc += g * g
        tl.store(partial_ptr + c, tl.sum(acc, 0))


GRAD_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class AdamWStep:
    """One AdamW step's hyperparameters; `step` counts this step (1 for the first)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    @property
    def bias_correction1(self) -> float:
        return 1.0 - self.beta1**self.step

    @property
    def bias_correction2(self) -> float:
        return 1.0 - self.beta2**self.step


_TRITON_DTYPES = {} if tl is None else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


@functools.lru_cache(maxsize=32)
def _chunks(
    numels: tuple[int, ...], device: torch.device, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the numels (T,) int64, the tensor of each chunk (C,) int32, its first element (C,)
    int64) on `device`, for tensors of `numels` elements cut in chunks of `chunk`: computed once
    per list of sizes."""
    counts = torch.tensor([math.ceil(n / chunk) for n in numels])
    tensor_of = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    first = torch.cumsum(counts, 0) - counts
    start = (torch.arange(len(tensor_of)) - first[tensor_of.long()]) * chunk
    numels_t = torch.tensor(numels, dtype=torch.int64)
    return numels_t.to(device), tensor_of.to(device), start.to(device)


def _check(params, grads, exp_avgs, exp_avg_sqs) -> None:
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adamw_step_: list lengths differ: {[len(x) for x in lists]}")
    for p, g, m, v in zip(*lists, strict=True):
        if not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(
                f"adamw_step_: shapes differ: param {tuple(p.shape)}, grad {tuple(g.shape)}, "
                f"exp_avg {tuple(m.shape)}, exp_avg_sq {tuple(v.shape)}"
            )
        if not all(x.is_contiguous() for x in (p, m, v)):
            raise ValueError("adamw_step_: every tensor must be contiguous")
        if not p.dtype == m.dtype == v.dtype == torch.float32:
            raise ValueError(
                f"adamw_step_: params and moments must be fp32 (got {p.dtype}, {m.dtype}, "
                f"{v.dtype})"
            )
    _check_grads(grads, "adamw_step_")


def _device_table(values: list[int], device: torch.device) -> torch.Tensor:
    """values as an int64 tensor on device, copied from pinned memory without a sync."""
    table = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True)


def _launch_args(lists: tuple[Sequence[torch.Tensor], ...], chunk: int):
    """(the addresses table, the numels, the chunks' tensors and starts) of equally shaped
    lists of tensors, or None when they hold no element."""
    first = lists[0]
    device = first[0].device
    numels, tensor_of, start = _chunks(tuple(t.numel() for t in first), device, chunk)
    if tensor_of.numel() == 0:
        return None
    addresses = _device_table([t.data_ptr() for lst in lists for t in lst], device)
    return addresses, numels, tensor_of, start


def grads_supported(grads: Sequence[torch.Tensor]) -> bool:
    """Whether the kernels take these gradients: one dtype of GRAD_DTYPES."""
    return len({g.dtype for g in grads}) == 1 and grads[0].dtype in GRAD_DTYPES


def _check_grads(grads: Sequence[torch.Tensor], who: str) -> None:
    if not all(g.is_contiguous() for g in grads):
        raise ValueError(f"{who}: every gradient must be contiguous")
    if not grads_supported(grads):
        raise ValueError(
            f"{who}: gradients must share one dtype, fp32 or bf16; got "
            f"{sorted({str(g.dtype) for g in grads})}"
        )


def grad_sum_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of all of `grads` (contiguous, one dtype: fp32 or bf16, on one
    CUDA device), a () fp32 tensor on their device; no sync. Its square root is grad_norm;
    sharded gradients sum theirs over the ranks first."""
    if not grads:
        raise ValueError("grad_norm: no gradients")
    _check_grads(grads, "grad_norm")
    chunk = ADAMW_CHUNK
    args = _launch_args((grads,), chunk)
    if args is None:
        return torch.zeros((), dtype=torch.float32, device=grads[0].device)
    addresses, numels, tensor_of, start = args
    partial = torch.empty(tensor_of.numel(), dtype=torch.float32, device=grads[0].device)
    _sum_squares_kernel[(tensor_of.numel(),)](
        addresses, numels, tensor_of, start, partial,
        GRAD_DTYPE=_TRITON_DTYPES[grads[0].dtype], CHUNK=chunk, BLOCK=_BLOCK,
        num_warps=_WARPS,
    )  # fmt: skip
    return partial.sum()


def grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of `grads` together (grad_sum_squares' square root)."""
    return grad_sum_squares(grads).sqrt()


def grad_sum_squares_reference(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """grad_sum_squares in torch operations (any device): fp32 squares summed chunk by chunk,
    the chunks' sums then summed."""
    _check_grads(grads, "grad_norm")
    parts = [
        chunk.float().square().sum() for g in grads for chunk in g.reshape(-1).split(ADAMW_CHUNK)
    ]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=grads[0].device)
    return torch.stack(parts).sum()


def grad_norm_reference(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """grad_norm in torch operations (grad_sum_squares_reference's square root)."""
    return grad_sum_squares_reference(grads).sqrt()


def adamw_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWStep,
    grad_scale: torch.Tensor,
) -> None:
    """One AdamW step in place over equally shaped fp32 params / moments and fp32 or bf16
    grads (all contiguous, on one CUDA device), each grad multiplied by `grad_scale` (a
    one-element fp32 tensor) first."""
    if not params:
        return
    _check(params, grads, exp_avgs, exp_avg_sqs)
    chunk = ADAMW_CHUNK
    args = _launch_args((params, grads, exp_avgs, exp_avg_sqs), chunk)
    if args is None:
        return
    addresses, numels, tensor_of, start = args
    h = hyper
    _adamw_kernel[(tensor_of.numel(),)](
        addresses, numels, tensor_of, start, grad_scale, len(params),
        float(h.lr), float(h.beta1), float(h.beta2), float(h.eps), float(h.weight_decay),
        float(h.lr / h.bias_correction1), float(math.sqrt(h.bias_correction2)),
        GRAD_DTYPE=_TRITON_DTYPES[grads[0].dtype], CHUNK=chunk, BLOCK=_BLOCK,
        num_warps=_WARPS,
    )  # fmt: skip


def adamw_step_reference_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWStep,
    grad_scale: torch.Tensor,
) -> None:
    """adamw_step_ in torch operations (any device), the same math in the same order."""
    _check(params, grads, exp_avgs, exp_avg_sqs)
    h = hyper
    step_size, bc2_sqrt = h.lr / h.bias_correction1, math.sqrt(h.bias_correction2)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g32 = g.float() * grad_scale
        p.sub_(h.lr * h.weight_decay * p)
        m.copy_(h.beta1 * m + (1.0 - h.beta1) * g32)
        v.copy_(h.beta2 * v + (1.0 - h.beta2) * g32 * g32)
        p.sub_(step_size * (m / (v.sqrt() / bc2_sqrt + h.eps)))
