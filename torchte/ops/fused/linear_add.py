"""Fusion: BasicLinear -> AddExtraInput in high precision (no bias between them): the GEMM adds
the residual itself (torch.addmm, cuBLAS's beta = 1), so y = x W^T + residual is one launch
instead of a GEMM and an add. On the CPU that is also one rounding instead of two; cuBLAS in
bf16 (measured on an H100) rounds the product before adding, the same bits as unfused. Under
FP8 (where the scaled GEMM takes no addend) and calibration the ops run unfused, and so do
tensor-parallel GEMMs (their output is reduced or gathered after the GEMM). Backward is
unchanged: the GEMM's as BasicLinear's, the residual's gradient dy itself."""

from __future__ import annotations

from ..basic.add_extra_input import AddExtraInput
from ..basic.basic_linear import BasicLinear
from ..op import FusedOperation, RunSettings
from ._runs import replace_runs

__all__ = ["ForwardLinearAdd", "fuse_linear_add"]


class ForwardLinearAdd(FusedOperation):
    """BasicLinear -> AddExtraInput in one forward GEMM (see the module docstring)."""

    def __init__(self, linear: BasicLinear, add: AddExtraInput) -> None:
        super().__init__([linear, add])
        self.linear, self.add = linear, add

    def fuser_forward(self, ctxs, x, extra_inputs, settings):
        (residual,) = extra_inputs[1]
        out_shape = (*x.shape[:-1], self.linear.local_out_features)
        if residual.shape != out_shape:
            raise ValueError(
                f"te.ops.AddExtraInput: the extra input has shape {tuple(residual.shape)}, but "
                f"the op's input has {out_shape}; they must match"
            )
        if residual.dtype != settings.dtype:
            residual = residual.to(settings.dtype)
        residual2d = residual.reshape(-1, out_shape[-1])
        y = self.linear.gemm_forward(ctxs[0], x, None, settings, residual2d)
        return y.view(out_shape), [(), ()]


def fuse_linear_add(steps: list, settings: RunSettings) -> list:
    """The matcher: each unfused BasicLinear directly followed by AddExtraInput, in high
    precision, becomes one ForwardLinearAdd."""
    if settings.fp8 or settings.calibrating:
        return steps
    return replace_runs(steps, _match)


def _match(ops):
    if len(ops) < 2 or type(ops[0]) is not BasicLinear or not isinstance(ops[1], AddExtraInput):
        return None
    if ops[0].tensor_parallel_mode is None:
        return ForwardLinearAdd(ops[0], ops[1]), 2
    return None
