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

Without FP8 a plain layer (see `plain_module` and `LayerNormLinear._plain_path`) takes torch's
own ops instead of the Function: F.layer_norm (or F.rms_norm), then F.linear, under torch's
C++ autograd, whose host time per call is lower than a Python autograd.Function's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from torchte import _nvtx
from torchte.autocast import autocast_state, refuse_recipe
from torchte.quantization.base import QuantizedTensor

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

__all__ = [
    "LayerNormLinear",
    "norm_module_outputs",
    "plain_module",
    "torch_forward_applies",
    "torch_norm",
]

_STATE = autocast_state()


def plain_module(module) -> bool:
    """What a norm-in-front module (LayerNormLinear, LayerNormMLP) needs for torch's own ops to
    do what its Function does: no collective (no tensor-parallel split), the weight gradients
    made in backward (no delay_wgrad_compute), high-precision parameters (none quantized, none
    made under quantized_model_init) and no NVTX range to open (TORCHTE_NVTX=1)."""
    return (
        not module._tp.split
        and module._wgrad_store is None
        and module._model_init_recipe is None
        and not any(isinstance(p, QuantizedTensor) for p in module._parameters.values())
        and not _nvtx.ENABLED
    )


def torch_forward_applies(module, inp, dtype: torch.dtype) -> bool:
    """Per call, for a module whose flag `_plain` is set: no FP8 autocast nor calibration,
    `inp` already in the compute dtype `dtype`, no torch.autocast (the Function norms with the
    parameters as they are, in the autocast dtype; torch's autocast would run its norm in fp32),
    and two public settings a client may write at any time, read here: no fused wgrad
    accumulation, and no norm output handed out (return_layernorm_output: where only that is
    used, the Function gives the GEMM weights zero gradients, torch's autograd none)."""
    state = _STATE
    autocast = module._autocast_type
    return (
        getattr(inp, "dtype", None) is dtype
        and not (state.enabled or state.calibrating)
        and not (module.fuse_wgrad_accumulation or module.return_layernorm_output)
        and not (autocast is not None and torch.is_autocast_enabled(autocast))
    )


def norm_module_outputs(module, y, bias, z, dtype: torch.dtype):
    """What a norm-in-front module returns: y, then the bias (in the compute dtype) if
    module.return_bias, then the norm's output z if module.return_layernorm_output; one tensor
    or a tuple, as Transformer Engine returns."""
    out = (y,)
    if module.return_bias:
        out += (cast_to(bias, dtype),)
    if module.return_layernorm_output:
        out += (z,)
    return out if len(out) > 1 else y


def torch_norm(inp: torch.Tensor, norm: NormSpec, weight, bias) -> torch.Tensor:
    """z = norm(inp) by torch's own op (F.layer_norm, F.rms_norm), for a norm without
    zero_centered_gamma: inp (..., K) -> z (..., K) in inp's dtype; weight, bias (K,)."""
    if norm.rms:
        return F.rms_norm(inp, weight.shape, weight, norm.eps)
    if inp.is_cpu and inp.dtype is not torch.float32:
        # Torch's CPU LayerNorm backward sums the weight and bias gradients in bf16 / fp16
        # (their error grows with the rows): there the norm runs in fp32 and its affine part
        # is an fp32 addcmul of the parameters as they are (no copies of them saved), as the
        # kernels' math does, z and each gradient rounded once.
        xhat = F.layer_norm(inp.float(), weight.shape, eps=norm.eps)
        z = xhat * weight if bias is None else torch.addcmul(bias, xhat, weight)
        return z.to(inp.dtype)
    return F.layer_norm(inp, weight.shape, weight, bias, norm.eps)


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
        module = "te.LayerNormLinear"
        refuse_recipe(
            module,
            eps=eps,
            sequence_parallel=sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            bias=bias,
            return_bias=return_bias,
            return_layernorm_output=return_layernorm_output,
            return_layernorm_output_gathered=return_layernorm_output_gathered,
            zero_centered_gamma=zero_centered_gamma,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        super().__init__(device, params_dtype)
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
        self._plain = self._plain_path()
        self._finish_init()

    def _plain_path(self) -> bool:
        """One plain weight and a norm torch has (no zero-centered gamma) on a plain module
        (plain_module): torch's own ops apply (recomputed where a setting it reads changes)."""
        return (
            self.weight_names == ["weight"]
            and not self._norm.zero_centered_gamma
            and plain_module(self)
        )

    def set_tensor_parallel_group(self, tp_group) -> None:
        super().set_tensor_parallel_group(tp_group)
        self._fast_setattr("_plain", self._plain_path())

    def _parameters_replaced(self) -> None:
        super()._parameters_replaced()
        if self.__dict__.get("_initialized"):
            self._fast_setattr("_plain", self._plain_path())

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
        if is_first_microbatch is not None and is_first_microbatch.__class__ is not bool:
            refuse_recipe("te.LayerNormLinear.forward", is_first_microbatch=is_first_microbatch)
        dtype = self._compute_dtype()
        if self._plain and not fp8_output and torch_forward_applies(self, inp, dtype):
            bias = self._parameters["bias"]
            y, z = self._torch_forward(inp, None if self.return_bias else bias)
            return norm_module_outputs(self, y, bias, z, dtype)
        self._check_input(inp, self.in_features)
        if self._tp.gathers_sequence:
            self._tp.group_or_raise()
        plan = self._plan(dtype, is_first_microbatch, fp8_output, False)
        weight = self._full(self.weight_names)
        bias = self._full(self.bias_names) if self.use_bias else None
        fused_bias = None if self.return_bias else bias
        y, z = self._forward_function(inp, weight, fused_bias, plan, is_first_microbatch)
        return norm_module_outputs(self, y, bias, z, dtype)

    def _torch_forward(self, inp: torch.Tensor, bias):
        """(y, z) by torch's own ops under torch's autograd (the `_plain` shortcut): the same
        function as _LayerNormLinearFunction's; `bias` the one added to y (None: none)."""
        params = self._parameters
        try:
            z = torch_norm(inp, self._norm, params["layer_norm_weight"], params["layer_norm_bias"])
            return F.linear(z, params["weight"], bias), z
        except RuntimeError:
            self._check_input(inp, self.in_features)  # a clearer error where it has one
            raise

    def extra_repr(self) -> str:
        return f"normalization={self.normalization}, eps={self.eps}, " + super().extra_repr()
