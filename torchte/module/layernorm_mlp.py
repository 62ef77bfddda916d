"""te.LayerNormMLP: norm -> fc1 -> activation -> fc2, as one module and one autograd.Function.

Legend: x (..., H) input, z = norm(x) (..., H), h = z W1^T + b1 (..., F1) with F1 = 2F for
gated activations (else F), a = act(h) (..., F), y = a W2^T + b2 (..., H).
Under delayed scaling the norm writes z in FP8 for fc1 and the activation writes a in FP8 for
fc2 (one launch each), and its backward
writes dh in FP8 for fc1 with fc1's bias gradient (one launch).
With checkpoint=True, h (the largest intermediate) is not kept: backward recomputes it from
the saved z with the same bytes and GEMM, so the gradients are the same as without.

Tensor parallelism (set_parallel_mode=True, _tensor_parallel.py): fc1 column-parallel (rank r
holds its rows of W1 and b1; for gated activations its rows of each half, [act_r; gate_r]),
fc2 row-parallel (its columns of W2), the collectives inside the one Function: the norm's
output all-gathered before fc1 (sequence parallel), fc2's partial output all-reduced or
reduce-scattered before fc2's bias is added, and in backward fc2's output gradient all-gathered
(sequence parallel) and fc1's input gradient reduced before the norm backward, as te.Linear and
te.LayerNormLinear do.

Without FP8 a plain MLP (see `LayerNormMLP._plain_path`) whose activation torch has as one op
takes torch's own ops instead of the Function: F.layer_norm (or F.rms_norm), F.linear, the
activation, F.linear, under torch's C++ autograd, whose host time per call is lower than a
Python autograd.Function's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from torchte.autocast import refuse_recipe
from torchte.kernels import activation as act_kernels
from torchte.quantization.fused import (
    activation_grad_to_fp8,
    activation_to_fp8,
    writes_activation,
)
from torchte.quantization.model_init import make_fp8_parameter, model_init_settings

from . import _tp_gemm as tp_gemm
from ._common import absent_output, restore_saved, save_for_backward
from ._functorch import apply
from ._lifecycle import ParameterInit, fill, norm_inits
from ._linear_backward import GemmRecord, gemm_record, linear_backward
from ._linear_core import (
    LinearPlan,
    cast_to,
    check_unknown,
    default_init_method,
    fprop,
    gemm_plan,
    linear_forward,
)
from ._norm_spec import NormSpec
from ._tensor_parallel import (
    TensorParallel,
    check_divides,
    forked_init,
    set_group,
    tensor_parallel,
)
from .base import PlanKey, TransformerEngineBaseModule, check_fp8_dims
from .layernorm_linear import (
    norm_module_outputs,
    plain_module,
    torch_forward_applies,
    torch_norm,
)

__all__ = ["LayerNormMLP"]


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated form of `act`: h (..., 2F) = [x1, x2] -> act(x1) * x2 (..., F)."""

    def gated(h: torch.Tensor) -> torch.Tensor:
        x1, x2 = h.chunk(2, dim=-1)
        return act(x1) * x2

    return gated


_gelu = partial(F.gelu, approximate="tanh")  # activation.py's gelu is the tanh approximation
# The activations torch computes as kernels/activation.py defines them, one torch op each (a
# gated one: that op of h's first half, times the second half; glu's sigmoid of the first half,
# as Transformer Engine's, not F.glu): the `_plain` shortcut's. qgelu, srelu and their gated
# forms take more ops, clamped_swiglu more still: they keep the fused kernel.
_TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu,
    "relu": F.relu,
    "silu": F.silu,
    "geglu": _gated(_gelu),
    "reglu": _gated(F.relu),
    "swiglu": _gated(F.silu),
    "glu": _gated(torch.sigmoid),
}

# Gated activations take the shortcut only while rows * ffn_hidden_size (the elements of the
# activation's output) is at most this. Torch's composition runs two elementwise kernels
# forward (act, mul) and more backward (the mul's two products, the act's gradient, the halves
# joined into dh) where the fused kernel runs one each way, and it keeps act(x1) for backward:
# device time and memory that grow with rows * ffn, while the host time the shortcut saves is
# the same at every size. Few-token MLPs, whose step waits for the host (what the shortcut is
# for), stay far below it; toward 2**24 elements (32 MiB per bf16 copy of the activation) the
# GEMMs and these passes keep the GPU busy longer than the host takes to launch them, so from
# there on the fused kernel's single pass is kept (a bound set by this reasoning, not a
# measured crossover).
GATED_TORCH_MAX_ELEMENTS = 2**24


@dataclass(frozen=True, slots=True)
class MLPSpec:
    """The module's fixed choices: norm, activation (with clamped_swiglu's limit and alpha),
    and whether backward recomputes h."""

    norm: NormSpec
    activation: str
    limit: float
    alpha: float
    checkpoint: bool

    def activate(self, h2d, quantizer, columnwise: bool, shape):
        """a = act(h), h2d (M, K) -> a of `shape`: in FP8 straight from the activation kernel
        where fc2's input quantizer allows it (writes_activation), else in h's dtype."""
        act = (self.activation, self.limit, self.alpha)
        if quantizer is not None and writes_activation(quantizer, h2d.numel()):
            return activation_to_fp8(quantizer, h2d, *act, columnwise, shape)  # one launch
        return act_kernels.activation_forward(h2d, *act).view(shape)

    def activation_grad(self, da2d, h2d, record: GemmRecord, quantizer):
        """(dh, dbias) from da2d (M, N) = the gradient of a: dh in FP8 with fc1's bias
        gradient, from the activation's backward kernel, where fc1's gradient quantizer allows it
        (writes_activation); else (dh (..., K) in h's dtype, None)."""
        act = (self.activation, self.limit, self.alpha)
        shape = (*record.inp_shape[:-1], h2d.shape[-1])
        if quantizer is not None and writes_activation(quantizer, h2d.numel()):
            usage = (record.need_dgrad, record.need_wgrad)
            return activation_grad_to_fp8(quantizer, da2d, h2d, *act, usage, shape)
        return act_kernels.activation_backward(da2d, h2d, *act).view(shape), None


@dataclass(frozen=True, slots=True, eq=False)
class MLPPlan:
    """The plans of the two GEMMs for one setting (autocast state, dtype, flags)."""

    fc1: LinearPlan
    fc2: LinearPlan


def _mlp_forward(inp, params, w_fp8, plans: MLPPlan, spec: MLPSpec, needs):
    """(y (..., H), z (..., H), saved values). needs = (dgrad1, wgrad1, dgrad2, wgrad2); the
    tensor-parallel setting is fc1's plan's (fc2 is then row-parallel)."""
    tp = plans.fc1.tp
    ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias = params
    need_d1, need_w1, need_d2, need_w2 = needs
    fc1 = plans.fc1
    # Recompute h from z in backward; not from the input as given (backward_override
    # "high_precision"): its FP8 cast would be made again.
    keep = spec.checkpoint and (need_d1 or need_w1) and fc1.backward_override != "high_precision"
    gather = tp.gathers_sequence
    quantizer = fc1.input_quantizer()
    columnwise = (need_w1 or keep) and fc1.fp8_backward  # z's transposed FP8 copy
    x2d, z_in, z, mean, rstd = spec.norm.run(
        inp, ln_weight, ln_bias, fc1.dtype, None if gather else quantizer, columnwise
    )
    needs1 = (need_d1 or keep, need_w1 or keep)
    if gather:  # under FP8 the gathered z moves as FP8 bytes (unless it is handed out)
        gemm = (fc1_weight, fc1_bias, w_fp8[0], fc1)
        h, z, z_saved, w1_saved, _ = tp_gemm.gather_then_forward(
            tp, z, quantizer, columnwise, spec.norm.keep_output, gemm, needs1, keep
        )
    else:
        h, z_saved, w1_saved = linear_forward(
            z_in, fc1_weight, fc1_bias, w_fp8[0], fc1, *needs1, keep
        )
    h2d = h.reshape(-1, h.shape[-1])
    a_shape = (*h.shape[:-1], fc2_weight.shape[1])
    a = spec.activate(h2d, plans.fc2.input_quantizer(), need_w2 and plans.fc2.fp8_backward, a_shape)
    split = tp.split  # fc2 row-parallel: its bias goes in once, after the reduction
    scatter = tp_gemm.overlapped_scatter(tp, plans.fc2) if split else None
    y, a_saved, w2_saved = linear_forward(
        a, fc2_weight, None if split else fc2_bias, w_fp8[1], plans.fc2, need_d2, need_w2,
        scatter=scatter,
    )  # fmt: skip
    if split:
        if scatter is None:
            y = tp.reduce_partial(y)
        if fc2_bias is not None:
            y = y + cast_to(fc2_bias, y.dtype)
    saved = (x2d, mean, rstd, z_saved, w1_saved, None if keep else h2d, a_saved, w2_saved)
    return y, z, saved


class _LayerNormMLPFunction(torch.autograd.Function):
    """The whole MLP forward and backward; outputs (y, z): z is the norm's output."""

    @staticmethod
    def forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_b, fc2_w, fc2_b, w1_fp8, w2_fp8, plans, spec):
        ctx.set_materialize_grads(False)  # an unused norm output gets no zero-filled gradient
        grads = ctx.needs_input_grad
        need_d1 = any(grads[:3])
        need_w1 = grads[3] or plans.fc1.main_grad is not None
        need_d2 = need_d1 or need_w1 or grads[4]
        need_w2 = grads[5] or plans.fc2.main_grad is not None
        params = (ln_w, ln_b, fc1_w, fc1_b, fc2_w, fc2_b)
        needs = (need_d1, need_w1, need_d2, need_w2)
        y, z, saved = _mlp_forward(inp, params, (w1_fp8, w2_fp8), plans, spec, needs)
        tp = plans.fc1.tp
        save_for_backward(ctx, ln_w, fc1_b, *saved)
        rows = tuple(y.shape[:1]) if not tp.gathers_sequence else (inp.shape[0] * tp.size,)
        z_shape = (*rows, *inp.shape[1:])
        ctx.gemm1 = gemm_record(z_shape, fc1_w, fc1_b, plans.fc1, need_d1, need_w1, grads[3:5])
        a_shape = (*z_shape[:-1], fc2_w.shape[1])
        bias2 = None if tp.split else fc2_b
        ctx.gemm2 = gemm_record(a_shape, fc2_w, bias2, plans.fc2, need_d2, need_w2, grads[5:7])
        ctx.plans, ctx.spec, ctx.inp_shape = plans, spec, inp.shape
        ctx.split_bias_grad = tp.split and fc2_b is not None and grads[6]
        return y, (absent_output(y) if z is None else z)

    @staticmethod
    def backward(ctx, grad_y, grad_z):
        store = ctx.plans.fc1.wgrad_store
        if store is None:
            return _mlp_backward(ctx, grad_y, grad_z)
        with store.one_backward():  # both GEMMs' deferred wgrads: one backward_dw
            return _mlp_backward(ctx, grad_y, grad_z)


def _mlp_backward(ctx, grad_y, grad_z):
    """_LayerNormMLPFunction.backward: the gradients of its forward's inputs."""
    ln_w, fc1_b, x2d, mean, rstd, z_saved, w1_saved, h2d, a_saved, w2_saved = restore_saved(ctx)
    spec: MLPSpec = ctx.spec
    tp = ctx.plans.fc1.tp
    if grad_y is None:  # only the norm output was used
        rows = ctx.gemm2.inp_shape[0] // (tp.size if tp.sequence_parallel else 1)
        shape = (rows, *ctx.gemm2.inp_shape[1:-1], ctx.gemm2.weight_shape[0])
        grad_y = torch.zeros(shape, dtype=ctx.plans.fc2.dtype, device=x2d.device)
    db2 = None
    if ctx.split_bias_grad:  # this rank's rows (a partial sum under sequence parallelism)
        db2 = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(ctx.plans.fc2.dtype)
    dy_fp8 = made = None
    if tp.split and tp.sequence_parallel:  # (fc2's dgrad GEMM under the gather where it can)
        grad_y, dy_fp8, made = tp_gemm.gather_grad_output(tp, grad_y, ctx.gemm2, w2_saved)
    da, dw2, db2_gemm = linear_backward(ctx.gemm2, grad_y, a_saved, w2_saved, dy_fp8, dgrad=made)
    db2 = db2_gemm if db2 is None else db2
    dx = d_ln_w = d_ln_b = dw1 = db1 = None
    if da is not None:
        if h2d is None:
            h2d = fprop(z_saved, w1_saved, cast_to(fc1_b, ctx.plans.fc1.dtype), ctx.plans.fc1)
        da2d = da.reshape(-1, da.shape[-1])
        quantizer = ctx.plans.fc1.grad_output_quantizer()
        dh, dh_bias = spec.activation_grad(da2d, h2d, ctx.gemm1, quantizer)
        gathered_grad = grad_z if tp.gathers_sequence else None  # the gathered z handed out
        reduction = tp.input_grad_reduction(gathered_grad)  # overlaps fc1's wgrad GEMM
        fp8_dh = (None, None) if dh_bias is None else (dh, dh_bias)
        dz, dw1, db1 = linear_backward(
            ctx.gemm1, dh if dh_bias is None else None, z_saved, w1_saved, *fp8_dh,
            start_reduction=reduction,
        )  # fmt: skip
        if dz is not None:
            if gathered_grad is not None:
                grad_z = None  # added before the reduction
            dx, d_ln_w, d_ln_b = spec.norm.backward_after_gemm(
                dz, grad_z, x2d, ln_w, mean, rstd, ctx.inp_shape, ctx.needs_input_grad[2]
            )
    return dx, d_ln_w, d_ln_b, dw1, db1, dw2, db2, None, None, None, None


class LayerNormMLP(TransformerEngineBaseModule):
    """y = fc2(act(fc1(norm(x)))) with Transformer Engine's arguments; FP8 under te.autocast.

    x (..., hidden_size) -> y (..., hidden_size). Parameters: layer_norm_weight,
    layer_norm_bias (LayerNorm only), fc1_weight (F1, hidden_size), fc1_bias (F1,), fc2_weight
    (hidden_size, ffn_hidden_size), fc2_bias (hidden_size,); F1 = 2 * ffn_hidden_size for gated
    activations. Returns y, then fc2's bias if return_bias, then the norm's output if
    return_layernorm_output.
    """

    _state_at_init = True

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker=None,
        tp_group=None,
        tp_size: int = 1,
        init_method: Callable[[torch.Tensor], None] | None = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: dict | None = None,
        output_layer_init_method: Callable[[torch.Tensor], None] | None = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        checkpoint: bool = False,
        name: str | None = None,
        delay_wgrad_compute: bool = False,
        **unsupported,
    ) -> None:
        module = "te.LayerNormMLP"
        refuse_recipe(
            module,
            eps=eps,
            sequence_parallel=sequence_parallel,
            return_bias=return_bias,
            bias=bias,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            return_layernorm_output=return_layernorm_output,
            return_layernorm_output_gathered=return_layernorm_output_gathered,
            set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma,
            checkpoint=checkpoint,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        super().__init__(device, params_dtype, num_gemms=2)
        check_unknown(module, unsupported)
        mode = "column" if set_parallel_mode else None  # fc1's; fc2 is then row-parallel
        tp = tensor_parallel(module, tp_group, tp_size, mode, sequence_parallel)
        check_divides(module, tp, hidden_size, ffn_hidden_size)
        self._tp = tp
        self.set_parallel_mode, self.sequence_parallel = set_parallel_mode, tp.sequence_parallel
        self.tp_size = tp.size
        if return_layernorm_output_gathered and not tp.gathers_sequence:
            raise ValueError(
                f"{module}: return_layernorm_output_gathered needs set_parallel_mode=True with "
                "sequence_parallel=True over more than one rank"
            )
        return_layernorm_output = return_layernorm_output or return_layernorm_output_gathered
        if activation not in act_kernels.ACTIVATIONS:
            known = ", ".join(act_kernels.ACTIVATIONS)
            raise ValueError(f"activation must be one of {known}, got {activation!r}")
        if hidden_size <= 0 or ffn_hidden_size <= 0:
            raise ValueError(
                f"hidden_size and ffn_hidden_size must be positive, got {hidden_size}, "
                f"{ffn_hidden_size}"
            )
        act_params = dict(activation_params or {})
        unknown = set(act_params) - {"limit", "alpha"}
        if unknown:
            raise ValueError(
                f"activation_params accepts 'limit' and 'alpha', got {sorted(unknown)}"
            )
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.normalization, self.activation, self.eps = normalization, activation, eps
        self.zero_centered_gamma = zero_centered_gamma
        self.use_bias, self.return_bias = bias, return_bias
        self.return_layernorm_output = return_layernorm_output
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.checkpoint, self.name = checkpoint, name
        self._spec = MLPSpec(
            NormSpec(normalization, float(eps), zero_centered_gamma, return_layernorm_output),
            activation,
            float(act_params.get("limit", 7.0)),
            float(act_params.get("alpha", 1.702)),
            checkpoint,
        )
        self._nvtx_name = f"te.LayerNormMLP.forward {name or ''}"
        self._init_fc1 = forked_init(
            init_method or default_init_method, get_rng_state_tracker, None
        )
        self._init_fc2 = forked_init(
            output_layer_init_method or default_init_method, get_rng_state_tracker, None
        )
        self._make_parameters(self._init_fc1, self._init_fc2)
        p = self._parameters
        fc1 = TensorParallel("column", tp.group, tp.size, tp.sequence_parallel)
        fc1.mark([p["fc1_weight"]], [b for b in (p["fc1_bias"],) if b is not None])
        fc2 = TensorParallel("row", tp.group, tp.size, tp.sequence_parallel)
        fc2.mark([p["fc2_weight"]], [b for b in (p["fc2_bias"],) if b is not None])
        for param in (p["layer_norm_weight"], p["layer_norm_bias"]):
            if param is not None:
                param.sequence_parallel = tp.sequence_parallel
        self._defer_wgrad(delay_wgrad_compute, ["fc1_weight", "fc2_weight"])
        # The largest input (elements) the shortcut takes: gated activations up to
        # GATED_TORCH_MAX_ELEMENTS elements of a (rows * ffn), others any.
        self._plain_max_numel = (
            GATED_TORCH_MAX_ELEMENTS // ffn_hidden_size * hidden_size
            if act_kernels.is_gated(activation)
            else math.inf
        )
        self._plain = self._plain_path()
        self._finish_init()

    def _plain_path(self) -> bool:
        """A norm torch has (no zero-centered gamma), an activation torch has as one op
        (_TORCH_ACTIVATIONS), h kept (no checkpoint), on a plain module (plain_module): torch's
        own ops apply (recomputed where a setting it reads changes)."""
        spec = self._spec
        return (
            spec.activation in _TORCH_ACTIVATIONS
            and not spec.norm.zero_centered_gamma
            and not spec.checkpoint
            and plain_module(self)
        )

    def _parameters_replaced(self) -> None:
        super()._parameters_replaced()
        if self.__dict__.get("_initialized"):
            self._fast_setattr("_plain", self._plain_path())

    def _wgrad_parameters(self, gemm: int) -> list[nn.Parameter]:
        return [self._parameters["fc2_weight" if gemm else "fc1_weight"]]

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group (when the module was built before it), as in
        Transformer Engine; its size must be tp_size."""
        self._fast_setattr("_tp", set_group("te.LayerNormMLP", self._tp, tp_group))
        self.__dict__.update(_plans={}, _last_plan=None)  # the plans hold the old setting
        self._fast_setattr("_plain", self._plain_path())

    def _parameter_inits(self) -> list[ParameterInit]:
        return [
            *norm_inits("layer_norm_weight", "layer_norm_bias", self.zero_centered_gamma),
            ParameterInit(("fc1_weight",), self._init_fc1, gemm=0),
            ParameterInit(("fc1_bias",), fill(0.0)),
            ParameterInit(("fc2_weight",), self._init_fc2, gemm=1),
            ParameterInit(("fc2_bias",), fill(0.0)),
        ]

    def _make_parameters(self, init_fc1: Callable, init_fc2: Callable) -> None:
        kw = {"dtype": self.params_dtype, "device": self.device}
        hidden, ffn = self.hidden_size, self._tp.local_features(0, self.ffn_hidden_size)[1]
        fc1_rows = 2 * ffn if act_kernels.is_gated(self.activation) else ffn
        gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = nn.Parameter(gamma(hidden, **kw))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(hidden, **kw))
        else:
            self.register_parameter("layer_norm_bias", None)
        settings = model_init_settings()
        for gemm, (name, shape, init) in enumerate(
            (("fc1", (fc1_rows, hidden), init_fc1), ("fc2", (hidden, ffn), init_fc2))
        ):
            weight = torch.empty(shape, **kw)
            init(weight)
            if settings is not None:
                setup = self._fp8_setup(settings.recipe)
                setup.prime_weight(weight, gemm)
                param = make_fp8_parameter(
                    weight, setup.weight[gemm], settings.preserve_high_precision_init_val
                )
            else:
                param = nn.Parameter(weight)
            self.register_parameter(f"{name}_weight", param)
            bias = nn.Parameter(torch.zeros(shape[0], **kw)) if self.use_bias else None
            self.register_parameter(f"{name}_bias", bias)

    def _build_plan(self, key: PlanKey) -> MLPPlan:
        if key.fp8:
            check_fp8_dims(
                "te.LayerNormMLP",
                hidden_size=self.hidden_size,
                ffn_hidden_size=self.ffn_hidden_size,
            )
        p = self._parameters
        return MLPPlan(
            gemm_plan(self, key, [p["fc1_weight"]], 0), gemm_plan(self, key, [p["fc2_weight"]], 1)
        )

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        """inp (..., hidden_size) -> y (..., hidden_size) [, fc2 bias] [, norm output]."""
        if is_first_microbatch is not None and is_first_microbatch.__class__ is not bool:
            refuse_recipe("te.LayerNormMLP.forward", is_first_microbatch=is_first_microbatch)
        dtype = self._compute_dtype()
        fc2_bias = self._parameters["fc2_bias"]
        bias = None if self.return_bias else fc2_bias  # the bias added to y
        if (
            self._plain
            and torch_forward_applies(self, inp, dtype)
            and inp.numel() <= self._plain_max_numel
        ):
            y, z = self._torch_forward(inp, bias)
        else:
            y, z = self._function_forward(inp, bias, dtype, is_first_microbatch)
        return norm_module_outputs(self, y, fc2_bias, z, dtype)

    def _torch_forward(self, inp: torch.Tensor, fc2_bias):
        """(y, z) by torch's own ops under torch's autograd (the `_plain` shortcut): the same
        function as _LayerNormMLPFunction's; fc2_bias the one added to y (None: none)."""
        p, spec = self._parameters, self._spec
        try:
            z = torch_norm(inp, spec.norm, p["layer_norm_weight"], p["layer_norm_bias"])
            a = _TORCH_ACTIVATIONS[spec.activation](F.linear(z, p["fc1_weight"], p["fc1_bias"]))
            return F.linear(a, p["fc2_weight"], fc2_bias), z
        except RuntimeError:
            self._check_input(inp, self.hidden_size, "hidden_size")  # a clearer error
            raise

    def _function_forward(self, inp, fc2_bias, dtype, is_first_microbatch):
        """(y, z) from _LayerNormMLPFunction (FP8, calibration, fused kernels and the rest),
        exception-safe; fc2_bias the one added to y (None: none)."""
        self._check_input(inp, self.hidden_size, "hidden_size")
        if self._tp.split:
            self._tp.group_or_raise()
            self._tp.check_output_rows(inp)
        plans: MLPPlan = self._plan(dtype, is_first_microbatch, False, False)
        p = self._parameters
        params = (
            p["layer_norm_weight"],
            p["layer_norm_bias"],
            p["fc1_weight"],
            p["fc1_bias"],
            p["fc2_weight"],
            fc2_bias,
        )

        def run():
            # The weights' transposes serve backward only: none without autograd.
            grad = torch.is_grad_enabled()
            need_dgrad = grad and (
                inp.requires_grad or any(t is not None and t.requires_grad for t in params[:2])
            )
            w1 = self._fp8_weight(
                params[2], plans.fc1, is_first_microbatch, need_dgrad, params[2:3]
            )
            w2 = self._fp8_weight(params[4], plans.fc2, is_first_microbatch, grad, params[4:5])
            if torch.is_grad_enabled():
                return apply(_LayerNormMLPFunction, inp, *params, w1, w2, plans, self._spec)
            needs = (False, False, False, False)
            return _mlp_forward(inp, params, (w1, w2), plans, self._spec, needs)[:2]

        return self._guarded_forward(plans.fc1.setup, plans.fc1.group, run)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"normalization={self.normalization}, activation={self.activation}, "
            f"checkpoint={self.checkpoint}, params_dtype={self.params_dtype}, device={self.device}"
        )
