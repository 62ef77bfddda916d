"""ForwardLinear: a BasicLinear with what the fuser folds into its forward GEMM: the Bias after
it (added in the GEMM's epilogue) and, under FP8 where the GEMM's input quantizer allows it
(`fusable`: delayed scaling), the norm or activation before it, which then writes the GEMM's
FP8 input itself (one launch instead of a high-precision write, a read and a cast).

Each basic op's context is filled as its own op_forward would fill it, so backward runs the
basic ops (or a backward fusion) unchanged. Not fused: a bias after a row-parallel GEMM (it
goes in after the reduction), a producer before a GEMM that gathers its input (column +
sequence parallel: the gather takes a tensor), a producer with extra inputs (a scaled
activation), an interleaved or input-caching activation.
"""

from __future__ import annotations

from torchte.module._norm_spec import rows_of
from torchte.quantization.fused import activation_to_fp8

from ..basic.activation import _Activation
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.norm import _NormOp
from ..op import BasicOperation, FusedOperation, RunSettings
from ._runs import replace_runs

__all__ = ["ForwardLinear", "producer_fusable"]


def producer_fusable(linear: BasicLinear, settings: RunSettings) -> bool:
    """Whether a norm or activation before `linear` may write its FP8 input under settings."""
    if not settings.fp8 or linear.gathers_input:
        return False
    quantizer = linear.linear_plan(settings).input_quantizer()
    return quantizer is not None and quantizer.fusable


class ForwardLinear(FusedOperation):
    """[producer] -> BasicLinear -> [Bias] in one forward (see the module docstring)."""

    def __init__(self, producer: BasicOperation | None, linear: BasicLinear, bias: Bias | None):
        ops = [op for op in (producer, linear, bias) if op is not None]
        super().__init__(ops)
        self.producer, self.linear, self.bias = producer, linear, bias

    def fuser_forward(self, ctxs, x, extra_inputs, settings):
        ctxs = list(ctxs)
        if self.producer is not None:
            x = self._produce(ctxs.pop(0), x, settings)
        bias = None
        if self.bias is not None:
            bias = self.bias.bias
        y = self.linear.gemm_forward(ctxs[0], x, bias, settings)
        return y, [() for _ in self.basic_ops]

    def _produce(self, ctx, x, settings: RunSettings):
        """The producer's output as the GEMM's input: written in FP8 by the producer."""
        producer, linear = self.producer, self.linear
        plan = linear.linear_plan(settings)
        quantizer = plan.input_quantizer()
        columnwise = settings.requires_grad and linear.weight.requires_grad and plan.fp8_backward
        if isinstance(producer, _NormOp):
            bias = producer._parameters.get("bias")
            x2d, z_fp8, _, mean, rstd = producer.norm.run(
                x, producer.weight, bias, settings.dtype, quantizer, columnwise
            )
            if settings.requires_grad:
                ctx.save_for_backward(x2d, mean, rstd)
            return z_fp8
        x2d = rows_of(x if x.dtype == settings.dtype else x.to(settings.dtype))
        name, limit, alpha = producer.activation()
        out_cols = x2d.shape[-1] // 2 if producer.gated else x2d.shape[-1]
        shape = (*x.shape[:-1], out_cols)
        a_fp8 = activation_to_fp8(quantizer, x2d, name, limit, alpha, columnwise, shape)
        if settings.requires_grad:
            ctx.save_for_backward(x2d)
        return a_fp8


def fuse_forward_linear(steps: list, settings: RunSettings, producers: tuple) -> list:
    """Replace each unfused [producer of `producers` types] BasicLinear [Bias] with one
    ForwardLinear; with producers == () only BasicLinear [Bias] (the bias epilogue)."""
    return replace_runs(steps, lambda ops: _match(ops, settings, producers))


def _match(ops, settings, producers):
    """(ForwardLinear, steps it takes) for the run starting at ops[0], or None."""
    if any(op.is_fused_op for op in ops):
        ops = ops[: next(k for k, op in enumerate(ops) if op.is_fused_op)]
    producer = None
    if producers:
        if len(ops) < 2 or not isinstance(ops[0], producers) or not _plain_producer(ops[0]):
            return None
        producer, ops = ops[0], ops[1:]
    if not ops or not isinstance(ops[0], BasicLinear):
        return None
    linear = ops[0]
    if producer is not None and not producer_fusable(linear, settings):
        return None
    bias = ops[1] if len(ops) > 1 and isinstance(ops[1], Bias) else None
    if bias is not None and (
        bias.local_size != linear.local_out_features or linear.tensor_parallel_mode == "row"
    ):
        bias = None
    count = (producer is not None) + 1 + (bias is not None)
    return ForwardLinear(producer, linear, bias), count


def _plain_producer(op: BasicOperation) -> bool:
    """Whether a producer writes the GEMM's input from x alone, in the standard layout."""
    return (
        op.num_extra_inputs == 0
        and getattr(op, "glu_interleave_size", None) is None
        and not getattr(op, "cache_quantized_input", False)
        and getattr(op, "over_last_dim", True)  # a norm over several dims makes no GEMM rows
    )


NORM_PRODUCERS = (_NormOp,)
ACTIVATION_PRODUCERS = (_Activation,)
