"""te.LayerNormLinear: a LayerNorm or RMSNorm followed by a Linear, as one module.

Legend: x (..., K) input, z = norm(x) (..., K), W (N, K) weight, b (N,) bias, y (..., N).
The norm's output is what the GEMM quantizes for FP8 (under delayed scaling the norm kernel
writes it in FP8 itself, unless return_layernorm_output asks for it in high precision);
backward runs the GEMM backward, then the norm backward on dz (plus the gradient of z where
return_layernorm_output hands z out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from torchte.kernels import norm as norm_kernels
from torchte.kernels import norm_fp8 as norm_fp8_kernels
from torchte.quantization.float8 import Float8Storage

from ._common import absent_output, given_grad, restore_saved, save_for_backward
from ._functorch import apply
from ._lifecycle import ParameterInit, norm_inits
from ._linear_core import (
    GemmRecord,
    LinearCore,
    LinearPlan,
    cast_to,
    check_unsupported,
    linear_backward,
    linear_forward,
    zero_grad_output,
)

__all__ = ["LayerNormLinear", "NormSpec"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class NormSpec:
    """Which normalization, with what eps and gamma convention (zero-centered: g = 1 + w), and
    whether the module hands the high-precision norm output out (return_layernorm_output)."""

    kind: str
    eps: float
    zero_centered_gamma: bool
    keep_output: bool = False

    def __post_init__(self) -> None:
        if self.kind not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.kind!r}"
            )
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")

    def forward(self, x, weight, bias):
        """x (M, K) -> (z (M, K) in x's dtype, mean (M,) fp32 | None, rstd (M,) fp32)."""
        if self.kind == "LayerNorm":
            return norm_kernels.layernorm_forward(
                x, weight, bias, self.eps, self.zero_centered_gamma
            )
        z, rstd = norm_kernels.rmsnorm_forward(x, weight, self.eps, self.zero_centered_gamma)
        return z, None, rstd

    def fuses_quantization(self, plan: LinearPlan) -> bool:
        """Whether the norm writes the GEMM's FP8 input itself (delayed scaling, and no
        high-precision output wanted)."""
        return plan.fp8 and plan.setup.fwd_state is not None and not self.keep_output

    def forward_fp8(self, x, weight, bias, plan: LinearPlan, columnwise: bool, shape):
        """x (M, K) -> (z as a Float8Storage of `shape`, quantized with the GEMM's delayed input
        scale (amax recorded), mean (M,) fp32 | None, rstd (M,) fp32), in one launch."""
        quantizer = plan.setup.input[plan.gemm]
        q = (quantizer.scale, quantizer.amax)
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        fp8 = (scale_inv, quantizer.fp8_dtype, columnwise)
        zcg = self.zero_centered_gamma
        if self.kind == "LayerNorm":
            data, data_t, mean, rstd = norm_fp8_kernels.layernorm_forward_fp8(
                x, weight, bias, self.eps, zcg, *q, *fp8
            )
        else:
            data, data_t, rstd = norm_fp8_kernels.rmsnorm_forward_fp8(
                x, weight, self.eps, zcg, *q, *fp8
            )
            mean = None
        return Float8Storage(data, data_t, scale_inv, quantizer.fp8_dtype, shape), mean, rstd

    def run(self, inp, weight, bias, plan: LinearPlan, columnwise: bool):
        """The norm in front of a GEMM: inp (..., K) -> (x2d (M, K) in the compute dtype, the
        GEMM's input (the FP8 Float8Storage where the norm writes it, else z), z (..., K) or
        None, mean (M,) | None, rstd (M,))."""
        x2d = inp.reshape(-1, inp.shape[-1])
        if x2d.dtype != plan.dtype:
            x2d = x2d.to(plan.dtype)  # the norm runs in the compute dtype, as the GEMM does
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        if self.fuses_quantization(plan):
            z_in, mean, rstd = self.forward_fp8(x2d, weight, bias, plan, columnwise, inp.shape)
            return x2d, z_in, None, mean, rstd
        z2d, mean, rstd = self.forward(x2d, weight, bias)
        z = z2d.view(inp.shape)
        return x2d, z, z, mean, rstd

    def backward_after_gemm(self, dz, grad_z, x2d, weight, mean, rstd, inp_shape, bias_grad):
        """The norm backward from the GEMM's input gradient dz (plus grad_z, the gradient of a
        handed-out norm output): (dx of inp_shape, dweight, dbias if bias_grad else None)."""
        dz = dz.reshape(x2d.shape)
        grad_z = given_grad(grad_z)
        if grad_z is not None:
            dz = dz + grad_z.reshape(x2d.shape)
        dz = dz.to(x2d.dtype).contiguous()
        dx, dweight, dbias = self.backward(dz, x2d, weight, mean, rstd)
        return dx.view(inp_shape), dweight, dbias if bias_grad else None

    def backward(self, dz, x, weight, mean, rstd):
        """(dx (M, K), dweight (K,), dbias (K,) | None)."""
        if self.kind == "LayerNorm":
            return norm_kernels.layernorm_backward(
                dz, x, weight, mean, rstd, self.zero_centered_gamma
            )
        dx, dweight = norm_kernels.rmsnorm_backward(dz, x, weight, rstd, self.zero_centered_gamma)
        return dx, dweight, None


def _ln_linear_forward(
    inp, ln_weight, ln_bias, weight, bias, w_fp8, plan, norm, need_dgrad, need_wgrad
):
    """(y (..., N), z (..., K) or None where the norm wrote FP8 directly, and what backward
    needs)."""
    x2d, z_in, z, mean, rstd = norm.run(inp, ln_weight, ln_bias, plan, need_wgrad)
    y, z_saved, w_saved = linear_forward(z_in, weight, bias, w_fp8, plan, need_dgrad, need_wgrad)
    return y, z, (x2d, mean, rstd, z_saved, w_saved)


class _LayerNormLinearFunction(torch.autograd.Function):
    """Norm + Linear forward and backward; outputs (y, z): z is the norm's output."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, w_fp8, plan: LinearPlan, norm):
        ctx.set_materialize_grads(False)  # an unused norm output gets no zero-filled gradient
        need_dgrad = any(ctx.needs_input_grad[:3])
        need_wgrad = ctx.needs_input_grad[3] or plan.main_grad is not None
        y, z, (x2d, mean, rstd, z_saved, w_saved) = _ln_linear_forward(
            inp, ln_weight, ln_bias, weight, bias, w_fp8, plan, norm, need_dgrad, need_wgrad
        )
        save_for_backward(ctx, x2d, ln_weight, mean, rstd, z_saved, w_saved)
        grads = ctx.needs_input_grad[3:5]
        ctx.gemm = GemmRecord(inp.shape, weight, bias, plan, need_dgrad, need_wgrad, grads)
        ctx.norm = norm
        return y, (absent_output(y) if z is None else z)

    @staticmethod
    def backward(ctx, grad_y, grad_z):
        x2d, ln_weight, mean, rstd, z_saved, w_saved = restore_saved(ctx)
        if grad_y is None:  # only the norm output was used
            grad_y = zero_grad_output(ctx.gemm, x2d.device)
        dz, wgrad, dbias = linear_backward(ctx.gemm, grad_y, z_saved, w_saved)
        dx = d_ln_weight = d_ln_bias = None
        if dz is not None:
            dx, d_ln_weight, d_ln_bias = ctx.norm.backward_after_gemm(
                dz, grad_z, x2d, ln_weight, mean, rstd, ctx.gemm.inp_shape, ctx.needs_input_grad[2]
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
        **unsupported,
    ) -> None:
        super().__init__(device, params_dtype)
        check_unsupported(
            "te.LayerNormLinear", unsupported, tp_group, tp_size, parallel_mode, sequence_parallel
        )
        if return_layernorm_output_gathered:
            raise NotImplementedError(
                "return_layernorm_output_gathered needs sequence parallelism, which torchte "
                "does not implement yet"
            )
        self.normalization = normalization
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self._norm = NormSpec(
            normalization, float(eps), zero_centered_gamma, return_layernorm_output
        )
        kw = {"dtype": self.params_dtype, "device": self.device}
        gamma = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = nn.Parameter(gamma(in_features, **kw))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, **kw))
        else:
            self.register_parameter("layer_norm_bias", None)
        self._init_linear(
            in_features,
            out_features,
            bias,
            init_method,
            return_bias,
            fuse_wgrad_accumulation,
            parameters_split,
            name,
        )
        self._finish_init()

    def _parameter_inits(self) -> list[ParameterInit]:
        norm = norm_inits("layer_norm_weight", "layer_norm_bias", self.zero_centered_gamma)
        return norm + super()._parameter_inits()

    def _needs_dgrad(self, inp: torch.Tensor) -> bool:
        params = self._parameters
        ln_bias = params["layer_norm_bias"]
        return (
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
