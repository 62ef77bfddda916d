"""The sequence-parallel GEMMs of te.Linear, te.LayerNormLinear and te.LayerNormMLP with their
collectives hidden under them (te.distributed's overlap.py), where the GEMM's operands allow.

Legend: P ranks, M rows of this rank's sequence shard, K / N the GEMM's inner / output
features.
- Column + SP forward: the input's rows (under per-tensor FP8 cast by each rank with the scale
  the ranks agree on, then moved as FP8 bytes) are gathered asynchronously; the GEMM of this
  rank's rows runs while they travel (`start_gather_input`, `forward_gathered`).
- Row + SP forward: the partial output is reduce-scattered chunk by chunk in a ring, each
  chunk's transfer under the next chunk's GEMM (`scatter_gemm`).
- Row + SP backward: the output gradient's gather runs under the dgrad GEMM of this rank's
  rows (`start_gather_grad`, `dgrad_gathered`); under per-tensor FP8 it moves as FP8 bytes.
Elsewhere (block-scaled formats, backward_override, calibration, save_original_input, FP8
outputs or gradients, the switch off: te.distributed.overlap_tp_comm(False); FP8 GEMMs unless
overlap_tp_comm(fp8=True)) the plain path runs: the collective, then the GEMM.
"""

from __future__ import annotations

import functools

import torch

from torchte import distributed as te_dist
from torchte.distributed.overlap import (
    RowsInFlight,
    gather_in_flight,
    gemm_reduce_scatter,
    tp_overlap_enabled,
)
from torchte.distributed.symmetric_memory import symmetric_group, symmetric_memory_enabled
from torchte.quantization.base import QuantizedTensor
from torchte.quantization.float8 import Float8Storage

from ._common import as_output
from ._linear_core import LinearPlan, cast_to, linear_forward, quantized_gemm

__all__ = [
    "dgrad_gathered",
    "forward_gathered",
    "gather_grad_output",
    "gather_then_forward",
    "overlapped_scatter",
    "start_gather_input",
]


def _overlaps(tp, plan: LinearPlan) -> bool:
    """Whether this GEMM's sequence-parallel collective may run under it (module docstring)."""
    plain = plan.backward_override is None and not plan.calibrating
    plain = plain and not (plan.save_original_input or plan.fp8_output or plan.fp8_grad)
    return plain and tp.sequence_parallel and tp.size > 1 and tp_overlap_enabled(plan.fp8)


def start_gather_input(tp, z: torch.Tensor, quantizer, plan: LinearPlan) -> RowsInFlight | None:
    """Column + SP forward: the gather of the GEMM input z (M, ..., K) started (per-tensor FP8:
    cast first with the ranks' agreed scale, its bytes gathered), or None where the plain path
    runs. The transpose for the wgrad GEMM is made by forward_gathered, after the GEMMs."""
    if not _overlaps(tp, plan) or isinstance(z, QuantizedTensor):
        return None
    if quantizer is not None and not hasattr(quantizer, "cast_for_gather"):
        return None
    return _start_gather(tp, z, quantizer)


def _start_gather(tp, t: torch.Tensor, quantizer) -> RowsInFlight:
    """t (M, ..., N) gathered along dim 0 over tp's group, started: as it is (quantizer None),
    or as the FP8 bytes each rank casts with the scale the ranks agree on (a per-tensor
    quantizer's cast_for_gather)."""
    group = tp.group_or_raise()
    t = t.contiguous()
    if quantizer is None:
        return gather_in_flight(t, group, t.reshape(-1, t.shape[-1]), _rows_2d)
    local, local_bytes, make_whole = quantizer.cast_for_gather(t, tp.reduce_max)
    whole = functools.partial(make_whole, columnwise=False)
    return gather_in_flight(local_bytes, group, local, whole)


def gather_then_forward(tp, z, quantizer, columnwise: bool, keep_output: bool, gemm, needs,
                        keep_rowwise: bool = False):  # fmt: skip
    """Column + SP forward of z (M, ..., K), this rank's sequence shard: (y (P M, ..., N), the
    gathered z to hand out or None, x_saved, w_saved, the GEMM input's shape (P M, ..., K));
    gemm = (weight, bias, w_fp8, plan), needs = (dgrad, wgrad). The gather runs under the GEMM
    of this rank's rows where it can (keep_output: the plain gather, whose result is handed
    out)."""
    weight, bias, w_fp8, plan = gemm
    name = None if keep_output else _symmetric(tp, z, quantizer, plan)
    if name is not None:  # torch's fused all-gather-matmul (copy engines, symmetric memory)
        return _symmetric_forward(name, tp, z, gemm, needs)
    pending = None if keep_output else start_gather_input(tp, z, quantizer, plan)
    if pending is None:
        z_in, z_out = tp.gather_gemm_input(z, quantizer, columnwise, keep_output)
        y, x_saved, w_saved = linear_forward(z_in, weight, bias, w_fp8, plan, *needs, keep_rowwise)
        return y, z_out, x_saved, w_saved, z_in.shape
    shape = torch.Size((z.shape[0] * tp.size, *z.shape[1:]))
    y, x_saved, w_saved = forward_gathered(
        pending, shape, weight, bias, w_fp8, plan, needs, columnwise, keep_rowwise
    )
    return y, None, x_saved, w_saved, shape


def _symmetric(tp, x, quantizer, plan: LinearPlan) -> str | None:
    """The symmetric-memory group name where torch's fused sequence-parallel GEMMs take this
    one (te.distributed.use_symmetric_memory on, CUDA, NCCL, high precision), else None. FP8
    GEMMs keep te's own paths: torch's scaled fused ops measured slower than the plain path on
    2 H100s and are not checked against it here."""
    if plan.fp8 or not (_overlaps(tp, plan) and symmetric_memory_enabled()):
        return None
    return None if isinstance(x, QuantizedTensor) else symmetric_group(x, tp.group_or_raise())


def _symmetric_forward(name, tp, z, gemm, needs):
    """gather_then_forward through torch's fused all-gather-matmul (high precision)."""
    weight, bias, _, plan = gemm
    need_dgrad, need_wgrad = needs
    shape = torch.Size((z.shape[0] * tp.size, *z.shape[1:]))
    w = cast_to(weight, plan.dtype)
    x2d = cast_to(z.reshape(-1, z.shape[-1]), plan.dtype)
    whole, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(x2d, [w.t()], 0, name)
    if bias is not None:
        y = y + cast_to(bias, plan.dtype)
    x_saved = whole if need_wgrad else None
    return as_output(y, (*shape[:-1], w.shape[0])), None, x_saved, w if need_dgrad else None, shape


def _rows_2d(gathered: torch.Tensor) -> torch.Tensor:
    return gathered.reshape(-1, gathered.shape[-1])


def _gemm_rows(w, bias, plan: LinearPlan, x, rows: slice, out: torch.Tensor) -> None:
    """Forward GEMM of x's rows `rows` (FP8 storage or a (M, K) tensor) into out."""
    if plan.fp8:
        quantized_gemm(x, "rowwise", w, "rowwise", plan.dtype, bias=bias, out=out, rows=rows,
                       fast=True)  # fmt: skip
    elif bias is None:
        torch.mm(x[rows], w.t(), out=out)
    else:
        torch.addmm(bias, x[rows], w.t(), out=out)


def forward_gathered(inp: RowsInFlight, shape, weight, bias, w_fp8, plan: LinearPlan, needs,
                     columnwise: bool, keep_rowwise: bool = False):  # fmt: skip
    """linear_forward of a gathered input still in flight: (y (P M, ..., N), x_saved,
    w_saved); shape is the gathered input's (P M, ..., K); needs = (dgrad, wgrad)."""
    need_dgrad, need_wgrad = needs
    bias = cast_to(bias, plan.dtype)
    w = w_fp8 if plan.fp8 else cast_to(weight, plan.dtype)
    n = w.shape[0]
    gemm = functools.partial(_gemm_rows, w, bias, plan)
    device = weight.device if w_fp8 is None else w_fp8.device
    y, whole = inp.gemm(gemm, n, plan.dtype, device)
    x_saved = whole if need_wgrad else None
    if plan.fp8 and x_saved is not None:
        if columnwise:
            whole.update_usage(columnwise_usage=True)
        if not keep_rowwise:
            whole.update_usage(rowwise_usage=False)  # only the transpose is used in wgrad
    w_saved = w if need_dgrad else None
    return as_output(y, (*shape[:-1], n)), x_saved, w_saved


def overlapped_scatter(tp, plan: LinearPlan):
    """Row + SP forward: the function linear_forward's GEMM becomes (scatter(x, w, bias) ->
    this rank's rows of the reduced output), or None where the plain path runs."""
    if not _overlaps(tp, plan):
        return None
    return functools.partial(scatter_gemm, tp.group_or_raise(), plan)


def _symmetric_scatter(group, plan: LinearPlan, x, w, bias) -> torch.Tensor | None:
    """scatter_gemm through torch's fused matmul-reduce-scatter (use_symmetric_memory on, high
    precision, no bias), or None where it does not apply."""
    if plan.fp8 or bias is not None or not symmetric_memory_enabled():
        return None
    if symmetric_group(x, group) is None:
        return None
    return te_dist.matmul_reduce_scatter(x, w.t(), group)


def scatter_gemm(group, plan: LinearPlan, x, w, bias) -> torch.Tensor:
    """(M, N): this rank's rows of the sum over ranks of x (P M, K) w^T (+ bias, added by each
    rank as the plain path's GEMM adds it), the reduction under the GEMMs."""
    fused = _symmetric_scatter(group, plan, x, w, bias)
    if fused is not None:
        return fused
    if plan.fp8 and type(x) is not Float8Storage:  # a block-scaled operand: the plain path
        from ._linear_core import fprop

        y = fprop(x, w, bias, plan)
        return te_dist.reduce_scatter_along_first_dim(y, group)[0]
    rows = x.shape[0] if isinstance(x, torch.Tensor) else x.rowwise_data.shape[0]
    gemm = functools.partial(_gemm_rows, w, bias, plan, x)
    return gemm_reduce_scatter(gemm, rows, w.shape[0], plan.dtype, w.device, group)


def gather_grad_output(tp, grad: torch.Tensor, record, w_saved):
    """Row + SP backward: the output gradient (M, ..., N) gathered along the sequence, as
    linear_backward takes it: (grad_out, dy_fp8, dgrad). Where the overlap applies, the dgrad
    GEMM (of w_saved) of this rank's rows runs under the gather (dgrad_gathered) and comes back
    made, with
    the gathered gradient in high precision (grad_out) or FP8 (dy_fp8); else (the gathered
    tensor, None, None)."""
    plan: LinearPlan = record.plan
    if not (_overlaps(tp, plan) and record.need_dgrad):
        return tp.gather_sequence(grad), None, None
    quantizer = None
    if plan.fp8_backward:
        quantizer = plan.setup.grad_output[plan.gemm]
        if record.bias_requires_grad or not hasattr(quantizer, "cast_for_gather"):
            return tp.gather_sequence(grad), None, None
    pending = _start_gather(tp, grad, quantizer)
    dgrad, grad_out, dy_fp8 = dgrad_gathered(pending, record, w_saved)
    return grad_out, dy_fp8, dgrad


def dgrad_gathered(grad: RowsInFlight, record, w_saved):
    """(dgrad (P M, K) of the gathered output gradient, that gradient as linear_backward takes
    it: (grad_out (P M, N) high precision, None) or (None, its FP8 storage))."""
    plan: LinearPlan = record.plan
    k = w_saved.shape[-1]
    if plan.fp8_backward:

        def gemm(dy, rows, out):
            quantized_gemm(dy, "rowwise", w_saved, "columnwise", plan.dtype, out=out, rows=rows)

        dgrad, whole = grad.gemm(gemm, k, plan.dtype, w_saved.device)
        return dgrad, None, whole

    def hp_gemm(dy, rows, out):
        torch.mm(cast_to(dy[rows], plan.dtype), w_saved, out=out)

    dgrad, whole = grad.gemm(hp_gemm, k, plan.dtype, w_saved.device)
    return dgrad, whole, None
