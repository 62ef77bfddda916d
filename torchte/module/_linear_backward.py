"""The backward of one GEMM y = x W^T + b (te.Linear, te.LayerNormLinear, te.LayerNormMLP and
te.ops' linear): the dgrad and wgrad GEMMs in FP8 or high precision, the wgrad fused into
main_grad or deferred (delay_wgrad_compute), a tensor-parallel reduction of the dgrad run while
the wgrad GEMM does. The forward side is _linear_core.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchte.gemm import hp_mm
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.fused import grad_output_with_dbias
from torchte.quantization.setup import FP8Setup

from ._common import MainGradTarget, should_overwrite
from ._linear_core import LinearPlan, cast_to, high_precision, quantized_gemm

__all__ = ["GemmRecord", "gemm_record", "linear_backward", "zero_grad_output"]


@dataclass(slots=True, eq=False)
class GemmRecord:
    """What linear_backward needs to know about one forward GEMM (kept on the Function's ctx)."""

    plan: LinearPlan
    inp_shape: torch.Size
    weight_shape: torch.Size
    weight_dtype: torch.dtype
    weight_device: torch.device
    weight_requires_grad: bool
    has_bias: bool
    bias_requires_grad: bool
    need_dgrad: bool
    need_wgrad: bool


def gemm_record(
    inp_shape, weight, bias, plan: LinearPlan, need_dgrad: bool, need_wgrad: bool, param_grads
) -> GemmRecord:
    """The GemmRecord of a forward GEMM. param_grads: (weight, bias) needs_input_grad of the
    Function (from ctx, not from the tensors: under torch.func a forward sees tensors that do
    not require grad)."""
    has_bias = bias is not None
    return GemmRecord(
        plan, inp_shape, weight.shape, weight.dtype, weight.device, bool(param_grads[0]),
        has_bias, has_bias and bool(param_grads[1]), need_dgrad, need_wgrad,
    )  # fmt: skip


def zero_grad_output(record: GemmRecord, device: torch.device) -> torch.Tensor:
    """A zero gradient for the GEMM's output, (..., N) in the compute dtype: for a Function
    whose other output (the norm's) alone was used, so autograd gave this one none."""
    shape = (*record.inp_shape[:-1], record.weight_shape[0])
    return torch.zeros(shape, dtype=record.plan.dtype, device=device)


def linear_backward(
    ctx: GemmRecord, grad_out, x_saved, w_saved, dy_fp8=None, dbias=None, start_reduction=None,
    dgrad=None,
):  # fmt: skip
    """(dgrad of ctx.inp_shape | None, wgrad | None, dbias | None) of y = x W^T + b.

    A fused producer of the output gradient may hand it over already quantized (dy_fp8, a
    Float8Storage, FP8 only) with its bias gradient (dbias); grad_out is then None.
    start_reduction (tensor parallelism): called with the dgrad (M, K) as soon as it is made,
    it starts the collective that reduces it over the ranks and returns a function that waits
    for the result; the wgrad GEMM runs in between (the overlap), and the reduced dgrad comes
    back, with rows (-1, *ctx.inp_shape[1:]). dgrad: the dgrad GEMM's result where the caller
    made it already (_tp_gemm.dgrad_gathered).
    """
    plan: LinearPlan = ctx.plan
    if isinstance(grad_out, Float8Tensor):
        dy_fp8, grad_out = grad_out._storage, grad_out.dequantize()
    dy2d = None
    if grad_out is not None:
        dy2d = grad_out.reshape(-1, grad_out.shape[-1])
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
    fp8_backward = plan.fp8_backward
    if fp8_backward and dy_fp8 is None and dy2d is not None and ctx.bias_requires_grad:
        usage = (ctx.need_dgrad, ctx.need_wgrad)
        fused = grad_output_with_dbias(plan.setup.grad_output[plan.gemm], dy2d, usage)
        if fused is not None:  # the cast also sums the columns (1x128 blocks)
            dy_fp8, dbias = fused
    if fp8_backward:
        dgrad, wgrad = _backward_fp8(
            ctx, plan, dy2d, dy_fp8, x_saved, w_saved, start_reduction, dgrad
        )
    else:
        if plan.fp8:  # backward_override: the saved operands in high precision
            dy2d, x_saved, w_saved = _high_precision_operands(plan, dy2d, dy_fp8, x_saved, w_saved)
        dgrad, wgrad = _backward_hp(ctx, plan, dy2d, x_saved, w_saved, start_reduction, dgrad)
    if not ctx.bias_requires_grad:
        dbias = None
    elif dbias is None:
        dbias = dy2d.sum(0).to(plan.dtype)
    else:
        dbias = dbias.to(plan.dtype)
    if dgrad is not None:
        dgrad = dgrad.view(-1, *ctx.inp_shape[1:]) if start_reduction else dgrad.view(ctx.inp_shape)
        if plan.fp8_grad and fp8_backward:  # a backward_override gives it in high precision
            dgrad = plan.setup.grad_input[plan.gemm].quantize(dgrad, rowwise=True, columnwise=True)
    return dgrad, wgrad, dbias


def _high_precision_operands(plan: LinearPlan, dy2d, dy_fp8, x_saved, w_saved):
    """(dy (M, N), x (M, K) | None, W (N, K) | None) in the compute dtype for a backward
    under backward_override, from what forward saved (quantized values dequantize to their
    original (..., K) shapes) and the output gradient (dy_fp8 where a producer quantized it)."""
    if dy2d is None:
        dy2d = _rows(high_precision(dy_fp8, plan.dtype))
    x_hp = high_precision(x_saved, plan.dtype)
    return dy2d, (None if x_hp is None else _rows(x_hp)), high_precision(w_saved, plan.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _backward_fp8(ctx, plan, dy2d, dy_fp8, x_saved, w_fp8, start_reduction, dgrad=None):
    setup: FP8Setup = plan.setup
    x_fp8 = _columnwise_input(x_saved, plan) if ctx.need_wgrad else None
    if dy_fp8 is None:
        dy_fp8 = setup.grad_output[plan.gemm].quantize(
            dy2d, rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad
        )
    else:
        dy_fp8.update_usage(
            rowwise_usage=ctx.need_dgrad or None, columnwise_usage=ctx.need_wgrad or None
        )
    if plan.backward_hook is not None:
        plan.backward_hook()
    if ctx.need_dgrad and dgrad is None:
        dgrad = quantized_gemm(dy_fp8, "rowwise", w_fp8, "columnwise", plan.dtype)

    def wgrad_gemm(rows: slice, out: torch.Tensor | None, accumulate: bool):
        out_dtype = torch.float32 if out is not None else ctx.weight_dtype
        return quantized_gemm(
            dy_fp8, "columnwise", x_fp8, "columnwise", out_dtype, out=out,
            accumulate=accumulate, rows=rows,
        )  # fmt: skip

    return _overlapped(dgrad, start_reduction, lambda: _wgrad(ctx, plan, wgrad_gemm))


def _backward_hp(ctx, plan, dy2d, x_saved, w_hp, start_reduction, dgrad=None):
    dy_hp = dy2d if dy2d.dtype == plan.dtype else dy2d.to(plan.dtype)
    x_hp = cast_to(x_saved, plan.dtype)  # the input as given with save_original_input
    if ctx.need_dgrad and dgrad is None:
        dgrad = hp_mm(dy_hp, w_hp)

    def wgrad_gemm(rows: slice, out: torch.Tensor | None, accumulate: bool):
        result = hp_mm(dy_hp[:, rows].t(), x_hp, out=out, accumulate=accumulate)
        return result if out is not None else result.to(ctx.weight_dtype)

    return _overlapped(dgrad, start_reduction, lambda: _wgrad(ctx, plan, wgrad_gemm))


def _columnwise_input(x_saved, plan: LinearPlan):
    """The wgrad GEMM's input operand: the saved FP8 value, or (save_original_input) the
    input kept as given, cast now with the forward's quantizer (current scaling makes the
    forward's bytes again from the same values)."""
    if isinstance(x_saved, torch.Tensor):
        return plan.setup.input[plan.gemm].quantize(x_saved, rowwise=False, columnwise=True)
    return x_saved


def _overlapped(dgrad, start_reduction, wgrad_step):
    """(dgrad, wgrad): wgrad_step() run while dgrad's reduction (when started) is in flight."""
    if dgrad is None or start_reduction is None:
        return dgrad, wgrad_step()
    finish = start_reduction(dgrad)
    wgrad = wgrad_step()
    return finish(), wgrad


def _wgrad(ctx, plan: LinearPlan, wgrad_gemm: Callable) -> torch.Tensor | None:
    """The weight gradient for autograd: made now, or deferred to backward_dw (None then);
    with main_grad, accumulated into it through weakrefs (the dummy grad is returned)."""
    if not ctx.need_wgrad:
        return None
    target: MainGradTarget | None = plan.main_grad
    store = plan.wgrad_store
    if store is not None:
        store.put(plan.gemm, lambda: _weight_gradient(plan, wgrad_gemm))
        if target is None:
            return None
    else:
        wgrad = _weight_gradient(plan, wgrad_gemm)
        if target is None:
            return wgrad
    if not ctx.weight_requires_grad:
        return None
    return target.finish(ctx.weight_shape, ctx.weight_dtype, ctx.weight_device)


def _weight_gradient(plan: LinearPlan, wgrad_gemm: Callable) -> torch.Tensor | None:
    """The wgrad GEMM: its result, or None once accumulated into main_grad."""
    target: MainGradTarget | None = plan.main_grad
    if target is None:
        return wgrad_gemm(slice(None), None, False)
    for param, start, end in target.params():
        overwrite = should_overwrite(param, plan.is_first_microbatch)
        wgrad_gemm(slice(start, end), param.main_grad, not overwrite)
    return None
