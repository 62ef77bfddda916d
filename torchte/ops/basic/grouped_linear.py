"""te.ops.GroupedLinear: G linear maps over the consecutive row groups of one input, the group
sizes an extra input (a host list or an integer tensor, on the CPU or the op's GPU).

Legend: x (..., K) whose flattened rows T are stacked group by group (group g owns m_g rows),
W_g (N, K), b_g (N,), y (..., N) with y[rows of g] = x[rows of g] W_g^T + b_g.

The GEMMs are te.GroupedLinear's (module/grouped_linear.py): the same plans, paths ("grouped"
bf16 grouped GEMMs, "fp8" grouped quantization, "per_group" te.Linear per group), FP8 weight
cache, parameter layouts (module/_grouped_params.py) and deferred weight gradients, so the op
and the module give the same bits.

Keyword arguments of a call (Sequential's op_kwargs, Transformer Engine's keys):
OUTPUT_BUFFER_KEY, a (T, N) tensor the output is written to (and returned as);
GRAD_INPUT_BUFFER_KEY, a (T, K) tensor the input gradient is written to in backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchte._device import default_device
from torchte._group_splits import GroupSplits, group_splits
from torchte.gemm import hp_mm
from torchte.module._grouped_params import (
    add_deferred_group_grads,
    packed_grads,
    per_group_init,
    remap_checkpoint,
)
from torchte.module._lifecycle import ParameterInit, fill
from torchte.module._linear_core import default_init_method
from torchte.module.base import PlanKey
from torchte.module.grouped_linear import (
    GroupedCall,
    GroupedPlan,
    NoGradContext,
    exact_requested,
    grouped_linear_backward,
    grouped_linear_forward,
    grouped_plan,
    grouped_weights_fp8,
)
from torchte.quantization.grouped import GroupedTensor
from torchte.quantization.model_init import model_init_settings

from ..op import BasicOperation, OperationContext, RunSettings
from ._row_scales import check_row_scales

__all__ = ["GRAD_INPUT_BUFFER_KEY", "OUTPUT_BUFFER_KEY", "GroupedLinear"]

OUTPUT_BUFFER_KEY = "output"
GRAD_INPUT_BUFFER_KEY = "grad_input"


class GroupedLinear(BasicOperation):
    """y_g = x_g W_g^T (+ b_g) for G groups of rows; extra input: the split sizes.

    Parameters weight0..weight{G-1} (out_features, in_features) and bias0..bias{G-1}, views
    of one (G, N, K) and one (G, N) buffer, so grouped GEMMs read them in place; with
    single_grouped_weight one `weight` (G, N, K), with single_grouped_bias one `bias` (G, N)
    instead (the per-group names then hold None, as in Transformer Engine). A client may
    register its own parameters under these names (Megatron-Core gives the op its
    te.GroupedLinear's).
    accumulate_into_main_grad: each weight's gradient is added to its `main_grad` (fp32)
    instead of being returned, as te.GroupedLinear's fuse_wgrad_accumulation.
    delay_wgrad_compute: backward leaves the weight gradients to backward_dw().
    scale_bias (with bias): a second extra input s (one value per row) scales the bias, y_t =
    x_t W_g^T + s_t b_g, as an MoE layer whose router probabilities were applied before the
    GEMM needs to stay p (x W^T + b).
    On the meta device nothing is initialized; init_method (torchte's) is each weight's init,
    default te.GroupedLinear's (normal, std 0.023; Transformer Engine's op draws kaiming-uniform
    values instead).
    """

    num_extra_inputs = 1
    _slot_major = True
    # Megatron-Core marks the first GEMM of an MLP whose gated activation is interleaved.
    client_attributes = frozenset({"_glu_interleave_size"})

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        rng_state_tracker_function: Callable | None = None,
        accumulate_into_main_grad: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        delay_wgrad_compute: bool = False,
        scale_bias: bool = False,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        _check_args(
            num_groups, in_features, out_features, single_grouped_weight, single_grouped_bias
        )
        if model_init_settings() is not None and default_device(device).type != "meta":
            raise NotImplementedError(
                "quantized_model_init is not implemented for te.ops.GroupedLinear yet: build it "
                "outside the context (its weights are quantized per call under te.autocast), or "
                "on the meta device to be given high-precision weights"
            )
        super().__init__(device, dtype, num_gemms=num_groups)
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bias
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias and bias
        self.scale_bias = scale_bias and bias
        if self.scale_bias:
            self.num_extra_inputs = 2  # the split sizes, then the scales of the bias
        self.fuse_wgrad_accumulation = self._accumulate_into_main_grad = accumulate_into_main_grad
        self._rng_state_tracker_function = rng_state_tracker_function
        self._init_method = init_method or default_init_method
        self._make_parameters()
        self._defer_wgrad(delay_wgrad_compute, self.weight_names)
        self._finish_init()

    def _make_parameters(self) -> None:
        """One (G, N, K) and one (G, N) buffer, registered whole or as G views each."""
        num_groups, kw = self.num_groups, {"dtype": self.params_dtype, "device": self.device}
        weights = torch.empty(num_groups, self.out_features, self.in_features, **kw)
        if not weights.is_meta:
            per_group_init(self._init_weight)(weights)
        biases = torch.zeros(num_groups, self.out_features, **kw) if self.use_bias else None
        single_w, single_b = self.single_grouped_weight, self.single_grouped_bias
        if single_w:
            self.register_parameter("weight", nn.Parameter(weights))
        for g in range(num_groups):
            self.register_parameter(f"weight{g}", None if single_w else nn.Parameter(weights[g]))
        if single_b:
            self.register_parameter("bias", nn.Parameter(biases))
        for g in range(num_groups):
            per_group_bias = None if single_b or biases is None else nn.Parameter(biases[g])
            self.register_parameter(f"bias{g}", per_group_bias)
        groups = range(num_groups)
        self.weight_names = ["weight"] if single_w else [f"weight{g}" for g in groups]
        self.bias_names = (
            [] if not self.use_bias else ["bias"] if single_b else [f"bias{g}" for g in groups]
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A checkpoint of the other parameter layout (per group / single) loads too.
        remap_checkpoint(state_dict, prefix, "weight", self.num_groups, self.single_grouped_weight)
        if self.use_bias:
            remap_checkpoint(state_dict, prefix, "bias", self.num_groups, self.single_grouped_bias)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _init_weight(self, weight: torch.Tensor) -> None:
        """init_method on one group's (N, K), inside the RNG tracker's fork when one was given."""
        if self._rng_state_tracker_function is None:
            self._init_method(weight)
            return
        with self._rng_state_tracker_function().fork():
            self._init_method(weight)

    @property
    def input_features(self) -> int:
        return self.in_features

    @property
    def has_bias(self) -> bool:
        """Whether an additive bias is applied (Transformer Engine's name)."""
        return self.use_bias

    def output_features(self, features: int | None) -> int:
        return self.out_features

    def _parameter_inits(self) -> list[ParameterInit]:
        if self.single_grouped_weight:
            inits = [ParameterInit(("weight",), per_group_init(self._init_weight))]
        else:
            inits = [
                ParameterInit((name,), self._init_weight, gemm=g)
                for g, name in enumerate(self.weight_names)
            ]
        return inits + [ParameterInit((name,), fill(0.0)) for name in self.bias_names]

    def _check_parameter(self, name: str, param) -> None:
        expected = self._expected_shape(name)
        if expected is not None and tuple(param.shape) != expected:
            raise ValueError(
                f"te.ops.GroupedLinear: {name} must have shape {expected}, got {tuple(param.shape)}"
            )

    def _parameter_assigned(self, name: str, param) -> None:
        if param is not None and self._wgrad_store is not None and name in self.weight_names:
            param.skip_backward_post_hook = True  # its gradient comes from backward_dw
        super()._parameter_assigned(name, param)

    def _expected_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of the parameter `name` in this op's layout (None: not one of its)."""
        g, n, k = self.num_groups, self.out_features, self.in_features
        if name in self.weight_names:
            return (g, n, k) if self.single_grouped_weight else (n, k)
        if name in self.bias_names:
            return (g, n) if self.single_grouped_bias else (n,)
        return None

    def op_parameters(self) -> list[nn.Parameter]:
        p = self._parameters
        params = [p[name] for name in (*self.weight_names, *self.bias_names)]
        if any(param is None for param in params):
            missing = [n for n in (*self.weight_names, *self.bias_names) if p[n] is None]
            raise RuntimeError(
                f"te.ops.GroupedLinear: parameter(s) {', '.join(missing)} are None; this op's "
                f"layout (single_grouped_weight={self.single_grouped_weight}, "
                f"single_grouped_bias={self.single_grouped_bias}) needs them"
            )
        return params

    def weight_params(self) -> list[nn.Parameter]:
        """The weight parameters: G (N, K), or the one (G, N, K) of single_grouped_weight."""
        return self.op_parameters()[: len(self.weight_names)]

    def check_settings(self, settings: RunSettings) -> None:
        self.grouped_plan(settings)  # FP8 dims checked here, before any kernel runs

    def check_extra_inputs(self, extra_inputs: tuple, rows: int | None) -> None:
        if rows is not None:
            group_splits(extra_inputs[0], self.num_groups, rows, self.device)
            if self.scale_bias:
                self._check_scales(extra_inputs[1], rows, self.device)

    def grouped_plan(self, settings: RunSettings) -> GroupedPlan:
        """The GroupedPlan of this op under `settings` (built once per setting)."""
        plan = self._plans.get(settings)
        if plan is None:
            key = PlanKey(
                settings.fp8, settings.calibrating, settings.recipe, settings.group,
                settings.dtype, None, False, False,
            )  # fmt: skip
            plan = grouped_plan(self, key, self.weight_names, "te.ops.GroupedLinear")
            self._plans[settings] = plan
        return plan

    def grouped_call(self, x2d, split_sizes, settings: RunSettings, need_dgrad: bool):
        """(GroupedCall, parameters) of one call on x2d (T, K): the splits (as given, or a
        GroupSplits already checked) checked against x."""
        splits = split_sizes
        if not isinstance(splits, GroupSplits):
            splits = group_splits(split_sizes, self.num_groups, x2d.shape[0], self.device)
        plan = self.grouped_plan(settings)
        params = self.op_parameters()
        weights = params[: len(self.weight_names)]
        if self.single_grouped_weight:  # its G groups, cached by the parameter's version
            groups = list(weights[0].detach().unbind(0))
            w_fp8 = grouped_weights_fp8(self, plan, groups, None, need_dgrad, weights)
        else:
            w_fp8 = grouped_weights_fp8(self, plan, weights, None, need_dgrad)
        single = (self.single_grouped_weight, self.single_grouped_bias)
        exact = exact_requested()  # as te.GroupedLinear: te.Linear's GEMMs when deterministic
        call = GroupedCall(plan, splits, w_fp8, len(self.bias_names), *single, exact=exact)
        return call, params

    def gemm_forward(self, ctx: OperationContext, x, split_sizes, settings, scales=None):
        """y (T, N) from x (T, K) (a tensor, or a GroupedStorage / GroupedTensor a fused producer
        wrote under FP8 with this op's input quantizer); ctx filled for gemm_backward. scales:
        the (T,) bias scales (scale_bias only)."""
        need_dgrad = settings.requires_grad and ctx.input_requires_grad
        if isinstance(x, GroupedTensor):  # quantized by its producer (te.moe's permutation)
            x = x._storage
        if ctx.kwargs:
            self._check_buffers(ctx.kwargs, x, settings.dtype)
        call, params = self.grouped_call(x, split_sizes, settings, need_dgrad)
        if self.scale_bias:
            call.num_bias, params = 0, params[: len(self.weight_names)]  # the bias: below
        target = ctx if settings.requires_grad else NoGradContext()
        grads = (need_dgrad, False, *(p.requires_grad and settings.requires_grad for p in params))
        y = grouped_linear_forward(target, x, call, params, grads)
        if self.scale_bias:
            y = self._add_scaled_bias(ctx, y, call.splits, scales, settings)
        return _into_buffer(ctx.kwargs.get(OUTPUT_BUFFER_KEY), y)

    def _check_buffers(self, kwargs: dict, x, dtype: torch.dtype) -> None:
        """ValueError (before any kernel runs) unless the caller's buffers are the output's and
        the input gradient's shape, dtype and device; TypeError for an unknown keyword."""
        unknown = set(kwargs) - {OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY}
        if unknown:
            raise TypeError(
                f"te.ops.GroupedLinear: unknown op_kwargs {sorted(unknown)}; it takes "
                f"{OUTPUT_BUFFER_KEY!r} and {GRAD_INPUT_BUFFER_KEY!r}"
            )
        rows = x.shape[0]
        for key, features in ((OUTPUT_BUFFER_KEY, self.out_features),
                              (GRAD_INPUT_BUFFER_KEY, self.in_features)):  # fmt: skip
            buffer = kwargs.get(key)
            want = ((rows, features), dtype, self.device)
            if buffer is None:
                continue
            if (
                not isinstance(buffer, torch.Tensor)
                or (tuple(buffer.shape), buffer.dtype, buffer.device) != want
            ):
                got = (
                    f"{tuple(buffer.shape)} {buffer.dtype} on {buffer.device}"
                    if isinstance(buffer, torch.Tensor)
                    else repr(buffer)
                )
                raise ValueError(
                    f"te.ops.GroupedLinear: the {key!r} buffer must be a {want[0]} {dtype} "
                    f"tensor on {self.device}, got {got}"
                )

    def gemm_backward(self, ctx: OperationContext, dy, dbias: torch.Tensor | None = None):
        """(dx (T, K) or None, the gradients of the weight and bias parameters in op_parameters
        order, the bias ones only without scale_bias) of gemm_forward's GEMMs. dy (T, N), or
        a GroupedStorage a fused producer wrote with the bias gradients it summed (dbias)."""
        store = self._wgrad_store
        if store is None:
            dx, dws, dbs = grouped_linear_backward(ctx, dy, dbias)
        else:
            with store.one_backward():  # the groups' deferred wgrads: one backward_dw
                dx, dws, dbs = grouped_linear_backward(ctx, dy, dbias)
        if dx is not None:
            dx = _into_buffer(ctx.kwargs.get(GRAD_INPUT_BUFFER_KEY), dx)
        return dx, tuple(packed_grads(ctx, dws, dbs))

    def _add_scaled_bias(self, ctx, y, splits: GroupSplits, scales, settings: RunSettings):
        """y += s[:, None] * b[group of each row] as one GEMM of K = G: (s_t where row t is in
        group g) (T, G) @ b (G, N), s and b in y's dtype, products summed in fp32."""
        self._check_scales(scales, y.shape[0], y.device)
        s = scales.reshape(-1)
        if settings.requires_grad:
            ctx.bias_scales, ctx.scales_grad = s, scales.requires_grad
            ctx.scales_shape = scales.shape
        return y.addmm_(self._scaled_one_hot(splits, s, y.dtype).t(), self._biases(y.dtype))

    @staticmethod
    def _check_scales(scales, rows: int, device) -> None:
        """TypeError / ValueError unless the bias scales are one float per row on device."""
        who = "te.ops.GroupedLinear(scale_bias=True)"
        check_row_scales(who, "its second extra input (the bias scales)", scales, rows, device)

    def _biases(self, dtype: torch.dtype) -> torch.Tensor:
        """(G, N) in dtype."""
        params = [self._parameters[name] for name in self.bias_names]
        stacked = params[0] if self.single_grouped_bias else torch.stack(params)
        return stacked.to(dtype)

    @staticmethod
    def _scaled_one_hot(splits: GroupSplits, s: torch.Tensor, dtype) -> torch.Tensor:
        """(G, T) in dtype: s_t where row t belongs to group g, else 0."""
        return splits.one_hot(dtype) * s.to(dtype)[None, :]

    def op_forward(self, ctx, x, extra_inputs, settings):
        self._check_input(x, self.in_features)
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # a GroupedTensor: as is
        y = self.gemm_forward(ctx, x2d, extra_inputs[0], settings, *extra_inputs[1:])
        return y.view(*x.shape[:-1], self.out_features), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        dy2d = dy.reshape(-1, self.out_features)
        dx, grads = self.gemm_backward(ctx, dy2d)
        if dx is not None:
            dx = dx.view(*dy.shape[:-1], self.in_features)
        if not self.scale_bias:
            return dx, (None,), grads
        dbs, ds = self._scaled_bias_grads(ctx, dy2d)
        return dx, (None, ds), (*grads, *dbs)

    def _scaled_bias_grads(self, ctx, dy2d):
        """(the bias parameters' gradients (G of (N,), or one (G, N)), ds (the scales' shape)
        or None) of y += s b[group], as GEMMs with fp32 sums: db = (s one-hot) (G, T) @ dy,
        ds_t = (dy @ b^T)[t, group of t]."""
        s, splits = ctx.bias_scales, ctx.splits
        dtype, num_groups = dy2d.dtype, self.num_groups
        params = [self._parameters[name] for name in self.bias_names]
        dbs = [None] * len(params)
        if any(b.requires_grad for b in params):
            sums = torch.empty(num_groups, dy2d.shape[1], dtype=torch.float32, device=s.device)
            hp_mm(self._scaled_one_hot(splits, s, dtype), dy2d, out=sums)
            sums = sums.to(params[0].dtype)
            dbs = [sums] if self.single_grouped_bias else list(sums.unbind(0))
        ds = None
        if ctx.scales_grad:
            per_group = torch.empty(dy2d.shape[0], num_groups, dtype=torch.float32,
                                    device=s.device)  # fmt: skip
            hp_mm(dy2d, self._biases(dtype).t(), out=per_group)
            rows = splits.row_groups()[:, None]
            ds = per_group.gather(1, rows).to(s.dtype).view(ctx.scales_shape)
        return dbs, ds

    def _take_deferred_wgrad(self, gemm: int, wgrad) -> None:
        add_deferred_group_grads(self, gemm, wgrad)

    def extra_repr(self) -> str:
        single = ""
        if self.single_grouped_weight or self.single_grouped_bias:
            single = (
                f", single_grouped_weight={self.single_grouped_weight}, "
                f"single_grouped_bias={self.single_grouped_bias}"
            )
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}{single}"
        )


def _check_args(num_groups, in_features, out_features, single_weight, single_bias) -> None:
    """ValueError / TypeError for sizes and layout flags GroupedLinear cannot take."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if in_features <= 0 or out_features <= 0:
        raise ValueError(
            f"in_features and out_features must be positive, got {in_features}, {out_features}"
        )
    flags = (("single_grouped_weight", single_weight), ("single_grouped_bias", single_bias))
    for name, value in flags:
        if not isinstance(value, bool):
            raise TypeError(f"te.ops.GroupedLinear: {name} must be a bool, got {value!r}")


def _into_buffer(buffer: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """t written into the caller's buffer (checked by _check_buffers) and the buffer returned,
    or t where none was given."""
    return t if buffer is None else buffer.copy_(t)
