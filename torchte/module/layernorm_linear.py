"""te.LayerNormLinear: a LayerNorm or RMSNorm followed by a Linear, as one module.

Legend: x (..., K) input, z = norm(x) (..., K), W (N, K) weight, b (N,) bias, y (..., N).
The norm's output is what the GEMM quantizes for FP8 (under delayed scaling the norm kernel
writes it in FP8 itself, unless return_layernorm_output asks for it in high precision);
backward runs the GEMM backward, then the norm backward on dz (plus the gradient of z where
return_layernorm_output hands z out).

Tensor parallelism (parallel_mode "column", _tensor_parallel.py): the weight's rows split over
the ranks. Without sequence parallelism every rank norms the whole input and dz, a partial sum
per rank, is all-reduced before the norm backward (so the norm's weight gradients are whole on
every rank). With it the norm runs on this rank's sequence shard and z is all-gathered before
the GEMM (under FP8 as FP8 bytes, cast by each rank with the scale of the whole z; in high
precision where z is handed out), dz reduce-scattered back (overlapping the wgrad GEMM), and
the norm's weight gradients are partial sums (marked sequence_parallel, for Megatron-Core to
all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from . import _tp_gemm as tp_gemm
from ._common import absent_output, restore_saved, save_for_backward
from ._functorch import apply
from ._lifecycle import ParameterInit, norm_inits
from ._linear_backward import gemm_record, linear_backward, zero_grad_output
from ._linear_core import (
    LinearCore,
    LinearPlan,
    cast_to,
    check_unknown,
    linear_forward,
)
from ._norm_spec import NormSpec
from ._tensor_parallel import check_divides, forked_init, tensor_parallel

__all__ = ["LayerNormLinear"]


def _ln_linear_forward(
    inp, ln_weight, ln_bias, weight, bias, w_fp8, plan, norm, need_dgrad, need_wgrad
):
    """(y (..., N), z (..., K) or None where the norm wrote FP8 directly (the gathered z under
    sequence parallelism), and what backward needs)."""
    tp = plan.tp
    gather = tp.gathers_sequence
    quantizer = plan.input_quantizer()
    columnwise = need_wgrad and plan.fp8_backward  # z's transposed FP8 copy, for wgrad
    x2d, z_in, z, mean, rstd = norm.run(
        inp, ln_weight, ln_bias, plan.dtype, None if gather else quantizer, columnwise
    )
    if gather:  # under FP8 the gathered z moves as FP8 bytes (unless it is handed out)
        gemm, needs = (weight, bias, w_fp8, plan), (need_dgrad, need_wgrad)
        y, z, z_saved, w_saved, _ = tp_gemm.gather_then_forward(
            tp, z, quantizer, columnwise, norm.keep_output, gemm, needs
        )
        return y, z, (x2d, mean, rstd, z_saved, w_saved)
    y, z_saved, w_saved = linear_forward(z_in, weight, bias, w_fp8, plan, need_dgrad, need_wgrad)
    return y, z, (x2d, mean, rstd, z_saved, w_saved)


class _LayerNormLinearFunction(torch.autograd.Function):
    """Norm + Linear forward and backward; outputs (y, z): z is the norm's output."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, w_fp8, plan: LinearPlan, norm):
        ctx.set_materialize_grads(False)  # an unused norm output gets no zero-filled gradient
        need_dgrad = any(ctx.needs_input_grad[:3])
        need_wgrad = ctx.needs_input_grad[3] or plan.main_grad is not None
        tp = plan.tp
        y, z, (x2d, mean, rstd, z_saved, w_saved) = _ln_linear_forward(
            inp, ln_weight, ln_bias, weight, bias, w_fp8, plan, norm, need_dgrad, need_wgrad
        )
        save_for_backward(ctx, x2d, ln_weight, mean, rstd, z_saved, w_saved)
        grads = ctx.needs_input_grad[3:5]
        gemm_shape = (y.shape[0], *inp.shape[1:]) if tp.gathers_sequence else inp.shape
        ctx.gemm = gemm_record(gemm_shape, weight, bias, plan, need_dgrad, need_wgrad, grads)
        ctx.norm, ctx.inp_shape = norm, inp.shape
        return y, (absent_output(y) if z is None else z)

    @staticmethod
    def backward(ctx, grad_y, grad_z):
        x2d, ln_weight, mean, rstd, z_saved, w_saved = restore_saved(ctx)
        if grad_y is None:  # only the norm output was used
            grad_y = zero_grad_output(ctx.gemm, x2d.device)
        tp = ctx.gemm.plan.tp
        gathered_grad = grad_z if tp.gathers_sequence else None  # the gathered z handed out
        reduction = tp.input_grad_reduction(gathered_grad)  # overlaps the wgrad GEMM
        dz, wgrad, dbias = linear_backward(
            ctx.gemm, grad_y, z_saved, w_saved, start_reduction=reduction
        )
        dx = d_ln_weight = d_ln_bias = None
        if dz is not None:
            if gathered_grad is not None:
                grad_z = None  # added before the reduction
            dx, d_ln_weight, d_ln_bias = ctx.norm.backward_after_gemm(
                dz, grad_z, x2d, ln_weight, mean, rstd, ctx.inp_shape, ctx.needs_input_grad[2]
            )
        return dx, d_ln_weight, d_ln_bias, wgrad, dbias, None, None, None


class LayerNormLinear(LinearCore):
    """y = norm(x) W^T + b with Transformer Engine's arguments; FP8 under `te.autocast`.

    x (..., in_features) -> y (..., out_features). Parameters: layer_norm_weight,
    layer_norm_bias (LayerNorm only), weight (or `{name}_weight` per parameters_split), bias.
    Returns y, then the bias if return_bias, then the norm's output if
    return_layernorm_output.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        init_method: Callable[[torch.Tensor], None] | None = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Sequence[str] | dict[str, int] | None = None,
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        name: str | None = None,
        delay_wgrad_compute: bool = False,
        **unsupported,
    ) -> None:
        super().__init__(device, params_dtype)
        module = "te.LayerNormLinear"
        check_unknown(module, unsupported)
        tp = tensor_parallel(module, tp_group, tp_size, parallel_mode, sequence_parallel)
        if tp.mode == "row":
            raise NotImplementedError(
                f"{module}: parallel_mode='row' (a norm over a feature shard) is not "
                "implemented; use 'column' or te.LayerNorm + a row-parallel te.Linear"
            )
        check_divides(module, tp, in_features, out_features)
        self._tp = tp
        self.parallel_mode, self.sequence_parallel, self.tp_size = (
            parallel_mode,
            tp.sequence_parallel,
            tp.size,
        )
        self.normalization = normalization
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        # The gathered norm output is what the GEMM read: handed out as the norm output.
        self.return_layernorm_output = return_layernorm_output or return_layernorm_output_gathered
        self._norm = NormSpec(
            normalization, float(eps), zero_centered_gamma, self.return_layernorm_output
        )
        kw = {"dtype": self.params_dtype, "device": self.device}
        gamma = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = nn.Parameter(gamma(in_features, **kw))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, **kw))
        else:
            self.register_parameter("layer_norm_bias", None)
        if return_layernorm_output_gathered and not tp.gathers_sequence:
            raise ValueError(
                f"{module}: return_layernorm_output_gathered needs parallel_mode='column' with "
                "sequence_parallel=True over more than one rank"
            )
        self._init_linear(
            in_features,
            tp.local_features(in_features, out_features)[1],
            bias,
            forked_init(init_method, get_rng_state_tracker, None),
            return_bias,
            fuse_wgrad_accumulation,
            parameters_split,
            name,
        )
        tp.mark(
            [getattr(self, n) for n in self.weight_names],
            [getattr(self, n) for n in self.bias_names],
        )
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = tp.sequence_parallel
        self._defer_wgrad(delay_wgrad_compute, self.weight_names)
        self._finish_init()

    def _wgrad_parameters(self, gemm: int) -> list[nn.Parameter]:
        return self._weight_params()

    def _parameter_inits(self) -> list[ParameterInit]:
        norm = norm_inits("layer_norm_weight", "layer_norm_bias", self.zero_centered_gamma)
        return norm + super()._parameter_inits()

    def _needs_dgrad(self, inp: torch.Tensor) -> bool:
        params = self._parameters
        ln_bias = params["layer_norm_bias"]
        return torch.is_grad_enabled() and (
            inp.requires_grad
            or params["layer_norm_weight"].requires_grad
            or (ln_bias is not None and ln_bias.requires_grad)
        )

    def _apply_function(self, inp, weight, bias, w_fp8, plan: LinearPlan):
        params = self._parameters
        args = (params["layer_norm_weight"], params["layer_norm_bias"], weight, bias, w_fp8)
        if torch.is_grad_enabled():
            return apply(_LayerNormLinearFunction, inp, *args, plan, self._norm)
        y, z, _ = _ln_linear_forward(inp, *args, plan, self._norm, False, False)
        return y, z

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
    ):
        """inp (..., in_features) -> y (..., out_features) [, bias] [, norm output]."""
        dtype = self._compute_dtype()
        self._check_input(inp, self.in_features)
        if self._tp.gathers_sequence:
            self._tp.group_or_raise()
        plan = self._plan(dtype, is_first_microbatch, fp8_output, False)
        weight = self._full(self.weight_names)
        bias = self._full(self.bias_names) if self.use_bias else None
        fused_bias = None if self.return_bias else bias
        y, z = self._forward_function(inp, weight, fused_bias, plan, is_first_microbatch)
        out = (y,)
        if self.return_bias:
            out += (cast_to(bias, dtype),)
        if self.return_layernorm_output:
            out += (z,)
        return out if len(out) > 1 else y

    def extra_repr(self) -> str:
        return f"normalization={self.normalization}, eps={self.eps}, " + super().extra_repr()
