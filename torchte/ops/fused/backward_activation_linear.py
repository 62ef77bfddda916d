"""Backward fusion: BasicLinear [-> Bias] -> activation, under FP8 where the GEMM's output
gradient quantizer allows it (`fusable`: delayed scaling). Going backward, the activation's
gradient dh, the Bias's gradient (the column sums of dh) and the FP8 dh that the GEMM's dgrad
and wgrad read come from one kernel (quantization/fused.activation_grad_to_fp8), as in
te.LayerNormMLP's backward, instead of three: the activation's backward, the bias sum, the
cast.

Legend: x (..., K) the GEMM's input, h (..., M) its output (plus the bias), a = act(h),
da the gradient of a. Not fused: a row-parallel GEMM with sequence parallelism (its output
gradient is gathered before the GEMMs), an interleaved or input-caching activation.
"""

from __future__ import annotations

from torchte.module._norm_spec import rows_of
from torchte.quantization.fused import activation_grad_to_fp8

from ..basic.activation import _Activation
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..op import FusedOperation, RunSettings, backward_one_by_one
from ._runs import replace_runs

__all__ = ["BackwardActivationLinear", "fuse_backward_activation_linear"]


class BackwardActivationLinear(FusedOperation):
    """The backward of BasicLinear [-> Bias] -> activation (see the module docstring); the
    forward is never fused by this class."""

    def __init__(self, linear: BasicLinear, bias: Bias | None, activation: _Activation) -> None:
        super().__init__([op for op in (linear, bias, activation) if op is not None])
        self.linear, self.bias, self.activation = linear, bias, activation

    def fuser_backward(self, ctxs, da, extra_output_grads):
        ctx_linear, ctx_act = ctxs[0], ctxs[-1]
        record = ctx_linear.record
        if not (record.need_dgrad or record.need_wgrad):  # only the bias (or nothing) wanted
            return backward_one_by_one(self.basic_ops, ctxs, da, extra_output_grads)
        (h2d,) = ctx_act.saved
        da2d = rows_of(da).to(h2d.dtype)
        shape = (*record.inp_shape[:-1], h2d.shape[-1])
        usage = (record.need_dgrad, record.need_wgrad)
        quantizer = record.plan.grad_output_quantizer()
        dh_fp8, dbias = activation_grad_to_fp8(
            quantizer, da2d, h2d, *self.activation.activation(), usage, shape
        )
        dx, dw = self.linear.gemm_backward(ctx_linear, None, dy_fp8=dh_fp8)
        param_grads = [(dw,)]
        if self.bias is not None:
            wanted = self.bias.bias.requires_grad
            param_grads.append((dbias.to(self.bias.bias.dtype) if wanted else None,))
        param_grads.append(())
        return dx, [() for _ in self.basic_ops], param_grads


def fuse_backward_activation_linear(steps: list, settings: RunSettings) -> list:
    """The matcher: each unfused BasicLinear [Bias] activation whose GEMM's output gradient
    quantizer is fusable becomes one BackwardActivationLinear."""
    if not settings.fp8:
        return steps
    return replace_runs(steps, lambda ops: _match(ops, settings))


def _match(ops, settings):
    if len(ops) < 2 or not isinstance(ops[0], BasicLinear):
        return None
    linear, bias = ops[0], None
    if linear.tensor_parallel_mode == "row" and linear.sequence_parallel:
        return None
    rest = ops[1:]
    if isinstance(rest[0], Bias) and rest[0].local_size == linear.local_out_features:
        bias, rest = rest[0], rest[1:]
    if not rest or not isinstance(rest[0], _Activation) or rest[0].num_extra_inputs:
        return None
    if rest[0].glu_interleave_size is not None or rest[0].cache_quantized_input:
        return None
    quantizer = linear.linear_plan(settings).grad_output_quantizer()
    if quantizer is None or not quantizer.fusable:
        return None
    return BackwardActivationLinear(linear, bias, rest[0]), 2 + (bias is not None)
