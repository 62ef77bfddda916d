"""te.GroupedLinear: one Linear per mixture-of-experts group, over the groups' stacked tokens.

Legend: x (T, K) the tokens of G groups stacked (group g owns m_g consecutive rows, the
m_splits), W_g (N, K) and b_g (N,) group g's weight and bias, y (T, N) with
y[rows of g] = x[rows of g] W_g^T + b_g.

Four paths, chosen per setting (the plan's mode):
- "grouped" (_grouped_hp.py): bf16 on a GPU where torch._grouped_mm works
  (gemm.grouped_mm_supported), without FP8 or fused wgrad accumulation: one grouped GEMM each
  for fprop, dgrad and wgrad, whatever G is, and no host-device synchronization when m_splits
  is a device tensor. The weights are views of one (G, N, K) buffer, so the GEMM reads them in
  place; the weight gradients come out of one (G, N, K) buffer as views.
- "fp8": FP8 recipes (_grouped_fp8.py): x and dy quantized for all groups in one launch
  (delayed scaling; three under current scaling) into a GroupedStorage, the GEMMs per group as
  te.Linear runs them (fprop as one grouped GEMM where one runs: see _grouped_fp8.py), the weight
  gradients accumulated into each weight's main_grad with fuse_wgrad_accumulation. Sizes in a
  device tensor are never read back: the casts and Triton grouped GEMMs find the groups on the
  device (see _grouped_fp8.py).
- "block": Float8BlockScaling (_grouped_block.py): 1x128 / 128x128 block-scaled FP8, every
  GEMM one grouped launch reading the group sizes on the device.
- "per_group" (_grouped_hp.py): everything else (fp32/fp16, calibration, bf16 main_grad, bf16
  off the GPU): group g goes through te.Linear's own forward and backward
  (module/_linear_core.py) with GEMM g's quantizers. The weight gradients are stacked into one
  buffer and handed out as views.
Outside the grouped fprop GEMMs, results equal a stack of te.Linear layers bit for bit; when
determinism is asked for (torch.use_deterministic_algorithms(True), or TORCHTE_DETERMINISTIC=1
at import) everywhere: "grouped" runs "per_group", the FP8 GEMMs run per group, and split sizes
given on the device are read back once (exact_requested).

Parameters (_grouped_params.py): weight0.. and bias0.. per group, or with single_grouped_weight
/ single_grouped_bias one `weight` (G, N, K) / `bias` (G, N); FP8 weights under
quantized_model_init.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchte._group_splits import GroupSplits, group_splits
from torchte.autocast import autocast_state, refuse_recipe
from torchte.gemm import (
    grouped_mm_supported,
)
from torchte.quantization.base import QuantizedTensor
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.model_init import make_fp8_parameter, model_init_settings

from ._common import (
    as_output,
)
from ._functorch import apply, transforms_active
from ._grouped_block import block_backward, block_forward, block_weights
from ._grouped_fp8 import fp8_backward, fp8_forward, grouped_fp8_weights
from ._grouped_hp import grouped_backward, grouped_forward, per_group_backward, per_group_forward
from ._grouped_params import (
    GroupMainGrad,
    add_deferred_group_grads,
    check_layout_flags,
    fp8_weight_group,
    pack_fp8_weights,
    packed_grads,
    per_group_init,
    regroup_fp8_weights,
    remap_checkpoint,
    unpack_parameters,
)
from ._lifecycle import ParameterInit, fill
from ._linear_core import (
    LinearPlan,
    cast_to,
    check_save_original_input,
    check_unknown,
    default_init_method,
    gemm_plan,
)
from ._te_compat import SaveOriginalInputMixin
from ._tensor_parallel import check_divides, forked_init, set_group, tensor_parallel
from .base import PlanKey, TransformerEngineBaseModule, check_fp8_dims

__all__ = ["GroupedLinear", "exact_requested"]

_STATE = autocast_state()
# TORCHTE_DETERMINISTIC=1: grouped layers run as a stack of te.Linear (read at import).
DETERMINISTIC_ENV = os.environ.get("TORCHTE_DETERMINISTIC", "0") == "1"


def exact_requested() -> bool:
    """Whether grouped layers must give a stack of te.Linear's bits (every GEMM per group, in
    te.Linear's order): torch.use_deterministic_algorithms(True) or TORCHTE_DETERMINISTIC=1."""
    return DETERMINISTIC_ENV or torch.are_deterministic_algorithms_enabled()


@dataclass(frozen=True, slots=True, eq=False)
class GroupedPlan:
    """The per-GEMM LinearPlans of one setting, and which path runs: "grouped" (bf16 grouped
    GEMMs), "fp8" (grouped quantization, _grouped_fp8.py) or "per_group"."""

    gemms: list[LinearPlan]
    mode: str


@dataclass(slots=True, eq=False)
class GroupedCall:
    """The one non-tensor argument of the Function: the plan, this call's splits, the FP8
    weights (a GroupedStorage, a list per GEMM, or None), how many bias tensors follow the
    weights among the tensor arguments, whether the weights (biases) come as one stacked
    tensor (single_weight / single_bias) and whether every GEMM must run as te.Linear's
    (exact: exact_requested())."""

    plan: GroupedPlan
    splits: GroupSplits
    w_fp8: Any
    num_bias: int
    single_weight: bool = False
    single_bias: bool = False
    exact: bool = False


def grouped_linear_forward(ctx, inp, call: GroupedCall, params, grads):
    """y (T, N); what backward needs goes on ctx. grads: needs_input_grad of the Function's
    inputs (inp, call, *weights, *biases)."""
    plan, splits, w_fp8 = call.plan, call.splits, call.w_fp8
    num_gemms = len(plan.gemms)
    weights, biases, weight_grads, bias_grads = unpack_parameters(
        call, num_gemms, params, grads[2:]
    )
    first = plan.gemms[0]
    mode = plan.mode
    if call.exact:
        splits.sizes()  # GEMMs per group need the sizes on the host: read back once
        mode = "per_group" if mode == "grouped" else mode
    need_dgrad = grads[0]
    need_wgrad = any(weight_grads) or first.main_grad is not None
    ctx.splits, ctx.plan, ctx.num_gemms, ctx.num_bias = splits, plan, num_gemms, len(biases)
    ctx.mode, ctx.exact = mode, call.exact
    ctx.single_weight, ctx.single_bias = call.single_weight, call.single_bias
    ctx.need_dgrad, ctx.need_wgrad = need_dgrad, need_wgrad
    ctx.bias_grad = any(bias_grads)
    ctx.weight_grads = weight_grads
    ctx.weight_dtype = weights[0].dtype
    needs = (need_dgrad, need_wgrad)
    if mode == "grouped":
        return grouped_forward(ctx, inp, splits, plan, weights, biases, needs)
    if mode == "fp8":
        return fp8_forward(ctx, inp, splits, plan, biases, w_fp8, needs)
    if mode == "block":
        return block_forward(ctx, inp, splits, plan, biases, w_fp8, needs)
    bias_grads = bias_grads if biases else (False,) * num_gemms
    param_grads = list(zip(weight_grads, bias_grads, strict=True))
    return per_group_forward(ctx, inp, splits, plan, (weights, biases), w_fp8, needs, param_grads)


class NoGradContext:
    """Stands in for the Function's ctx when autograd is off: nothing is saved."""

    def save_for_backward(self, *tensors) -> None:
        pass


def grouped_plan(module, key: PlanKey, weight_names: list[str], who: str) -> GroupedPlan:
    """The GroupedPlan of `module` (a te module with in/out_features, num_gemms and
    fuse_wgrad_accumulation) for the plan key: one LinearPlan per GEMM and the path to run.
    weight_names: one per GEMM, or (single_grouped_weight) the one (G, N, K) weight."""
    fp8, dtype = key.fp8, key.dtype
    if fp8:
        check_fp8_dims(who, in_features=module.in_features, out_features=module.out_features)
    if module._save_original_input:
        check_save_original_input(who, key, module._tp)
    p = module._parameters
    if getattr(module, "single_grouped_weight", False):
        gemms = _single_weight_gemms(module, key, p[weight_names[0]])
    else:
        gemms = [gemm_plan(module, key, [p[name]], g) for g, name in enumerate(weight_names)]
    fp8_params = isinstance(p[weight_names[0]], Float8Tensor)  # read per group in high precision
    mode = "per_group"
    # Plain high precision (deferred wgrads included: the grouped path defers its own).
    plain = all(not (g.fp8 or g.calibrating) and g.main_grad is None for g in gemms)
    if plain and not fp8_params:
        if dtype == torch.bfloat16 and grouped_mm_supported(module.device, dtype, True):
            mode = "grouped"
    elif fp8 and gemms[0].setup.grouped_mode is not None and gemms[0].fp8_backward:
        # (a backward_override runs per group: te.Linear's high-precision backward)
        mode = gemms[0].setup.grouped_mode  # "fp8" (per-tensor scales) or "block"
        if mode == "block" and isinstance(p[weight_names[0]], QuantizedTensor):
            mode = "per_group"  # block-scaled weight parameters: each read as it is
    return GroupedPlan(gemms, mode)


def _single_weight_gemms(module, key: PlanKey, weight: nn.Parameter) -> list[LinearPlan]:
    """The G LinearPlans of a single grouped weight (G, N, K): with fused wgrad accumulation
    GEMM g accumulates into slice g of its main_grad (GroupMainGrad)."""
    gemms = [gemm_plan(module, key, [weight], g) for g in range(module.num_gemms)]
    if not module.fuse_wgrad_accumulation:
        return gemms
    shared = GroupMainGrad.shared_dummy()
    return [
        dataclasses.replace(gemm, main_grad=GroupMainGrad(weight, g, shared))
        for g, gemm in enumerate(gemms)
    ]


def grouped_weights_fp8(
    module, plan: GroupedPlan, weights, is_first_microbatch, columnwise, version_params=None
):
    """The FP8 weights the plan's path reads: one GroupedStorage ("fp8"), a Float8Storage per
    GEMM (FP8 "per_group"), or None (high precision). weights: one (N, K) per GEMM, FP8
    parameters (quantized_model_init: their bytes are read as they are) or not (quantized
    once per change, cached by the version of version_params, the parameters they are views
    of: default `weights`)."""
    first = plan.gemms[0]
    if not first.fp8:
        return None
    columnwise = columnwise and first.fp8_backward  # the transposes serve FP8 dgrad only
    if transforms_active():
        raise NotImplementedError(
            f"{type(module).__name__} under torch.func runs in high precision only: its FP8 "
            "path quantizes the experts' weights and splits outside its autograd Function; run "
            "it outside te.autocast there, or use te.Linear per expert"
        )
    if plan.mode == "fp8" and isinstance(weights[0], Float8Tensor):
        cache = module.__dict__.setdefault("_fp8_weight_group", [None])
        return fp8_weight_group(cache, weights, columnwise)
    if plan.mode in ("fp8", "block"):
        setup = first.setup
        version = module._weight_version(weights if version_params is None else version_params)
        key = (version, (_STATE.step, setup.weight_generation()))
        quantize = grouped_fp8_weights if plan.mode == "fp8" else block_weights
        return quantize(weights, setup, key, is_first_microbatch, columnwise)
    return [
        module._fp8_weight(w, gemm, is_first_microbatch, columnwise, (w,))
        for w, gemm in zip(weights, plan.gemms, strict=True)
    ]


def grouped_linear_backward(ctx, dy, dbias: torch.Tensor | None = None):
    """(dx, [dw_g], [db_g]) of the path grouped_linear_forward took. On the "fp8" path dy may
    be a GroupedStorage a fused producer wrote, with the bias gradients it summed (dbias)."""
    if ctx.mode == "fp8":
        return fp8_backward(ctx, dy, dbias)
    if ctx.mode == "block":
        return block_backward(ctx, dy)
    if ctx.mode == "grouped":
        return grouped_backward(ctx, dy)
    return per_group_backward(ctx, dy)


class _GroupedLinearFunction(torch.autograd.Function):
    """inp (T, K), the call's context, then the G weights (or one (G, N, K)) and the G biases
    (or one (G, N); or none) -> y (T, N)."""

    @staticmethod
    def forward(ctx, inp, call: GroupedCall, *params):
        return grouped_linear_forward(ctx, inp, call, params, ctx.needs_input_grad)

    @staticmethod
    def backward(ctx, dy):
        store = ctx.plan.gemms[0].wgrad_store
        if store is None:
            dx, dws, dbs = grouped_linear_backward(ctx, dy)
        else:
            with store.one_backward():  # the groups' deferred wgrads: one backward_dw
                dx, dws, dbs = grouped_linear_backward(ctx, dy)
        return dx, None, *packed_grads(ctx, dws, dbs)


class GroupedLinear(SaveOriginalInputMixin, TransformerEngineBaseModule):
    """G Linear layers applied to the consecutive row groups of one input, with Transformer
    Engine's arguments; FP8 under te.autocast.

    forward(inp (T, in_features), m_splits, is_first_microbatch=None) -> (T, out_features).
    Parameters weight0..weight{G-1} (out_features, in_features) and bias0..bias{G-1}
    (out_features,), as in Transformer Engine, so state_dicts carry over; with
    single_grouped_weight one `weight` (G, out_features, in_features), with single_grouped_bias
    one `bias` (G, out_features) instead (either layout loads the other's state_dict). With
    return_bias the biases are not added but returned, cast to the compute dtype, after the
    output: a list, or the (G, out_features) tensor of a single grouped bias.
    """

    _slot_major = True

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        use_grouped_tensor: bool | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        **unsupported,
    ) -> None:
        module = "te.GroupedLinear"
        refuse_recipe(
            module,
            sequence_parallel=sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            bias=bias,
            return_bias=return_bias,
            single_grouped_weight=single_grouped_weight,
            single_grouped_bias=single_grouped_bias,
            use_grouped_tensor=use_grouped_tensor,
            delay_wgrad_compute=delay_wgrad_compute,
            save_original_input=save_original_input,
        )
        if not isinstance(num_gemms, int) or num_gemms <= 0:
            raise ValueError(f"num_gemms must be a positive int, got {num_gemms!r}")
        super().__init__(device, params_dtype, num_gemms=num_gemms)
        check_unknown(module, unsupported)
        check_layout_flags(single_grouped_weight, single_grouped_bias, use_grouped_tensor)
        if single_grouped_weight and model_init_settings() is not None:
            raise NotImplementedError(
                f"{module}(single_grouped_weight=True) inside quantized_model_init is not "
                "implemented: its (G, N, K) weight would need one FP8 scale per group; build it "
                "with single_grouped_weight=False (G FP8 weights) or outside the context"
            )
        tp = tensor_parallel(module, tp_group, tp_size, parallel_mode, sequence_parallel)
        if tp.sequence_parallel and tp.split:
            raise NotImplementedError(
                f"{module}: sequence_parallel over more than one rank is not implemented (the "
                "experts' tokens are permuted, not a sequence to split)"
            )
        check_divides(module, tp, in_features, out_features)
        self._tp, self.parallel_mode, self.tp_size = tp, parallel_mode, tp.size
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        in_features, out_features = tp.local_features(in_features, out_features)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation, self.name = fuse_wgrad_accumulation, name
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias
        self.use_grouped_tensor = use_grouped_tensor
        self._nvtx_name = f"te.GroupedLinear.forward {name or ''}"
        self._init_method = forked_init(
            init_method or default_init_method, get_rng_state_tracker, rng_tracker_name
        )
        self._fp8_weight_group = [None]  # fp8_weight_group's cache (quantized_model_init)
        self._make_parameters()
        tp.mark(
            [getattr(self, n) for n in self.weight_names],
            [getattr(self, n) for n in self.bias_names],
        )
        self._defer_wgrad(delay_wgrad_compute, self.weight_names)
        self._save_original_input = bool(save_original_input)
        self._finish_init()

    def _take_deferred_wgrad(self, gemm: int, wgrad) -> None:
        add_deferred_group_grads(self, gemm, wgrad)

    def _make_parameters(self) -> None:
        """The weights (G, N, K) and biases (G, N), one buffer each, initialized group by group
        and registered as G views each (weight0, bias0, weight1, ...) or one parameter each
        (under quantized_model_init each weight FP8, made by its GEMM's weight quantizer)."""
        num_gemms, use_bias = self.num_gemms, self.use_bias
        kw = {"dtype": self.params_dtype, "device": self.device}
        weights = torch.empty(num_gemms, self.out_features, self.in_features, **kw)
        per_group_init(self._init_method)(weights)
        biases = torch.zeros(num_gemms, self.out_features, **kw)
        settings = model_init_settings()
        if self.single_grouped_weight:
            self.register_parameter("weight", nn.Parameter(weights))
        elif settings is not None:
            weight_params = self._fp8_weights(weights, settings)
        else:
            weight_params = [nn.Parameter(w) for w in weights.unbind(0)]
        single_bias = self.single_grouped_bias
        for g in range(num_gemms):
            if not self.single_grouped_weight:
                self.register_parameter(f"weight{g}", weight_params[g])
            if not single_bias:
                self.register_parameter(f"bias{g}", nn.Parameter(biases[g]) if use_bias else None)
        if single_bias:
            self.register_parameter("bias", nn.Parameter(biases) if use_bias else None)
        per_group = range(num_gemms)
        self.weight_names = (
            ["weight"] if self.single_grouped_weight else [f"weight{g}" for g in per_group]
        )
        self.bias_names = (
            [] if not use_bias else ["bias"] if single_bias else [f"bias{g}" for g in per_group]
        )

    def _fp8_weights(self, weights: torch.Tensor, settings) -> list[nn.Parameter]:
        """quantized_model_init: weight g (N, K) as a Float8Tensor parameter made by GEMM g's
        weight quantizer (its delayed scale primed from it first, as te.Linear's), the G
        parameters' bytes then moved into one grouped buffer (pack_fp8_weights)."""
        setup = self._fp8_setup(settings.recipe)
        preserve = settings.preserve_high_precision_init_val
        params = []
        for g, weight in enumerate(weights.unbind(0)):
            setup.prime_weight(weight, g)
            params.append(make_fp8_parameter(weight, setup.weight[g], preserve))
        if isinstance(params[0], Float8Tensor):  # block-scaled weights stay one by one
            pack_fp8_weights(params)
        return params

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group (when the module was built before it), as in
        Transformer Engine; its size must be tp_size."""
        self._fast_setattr("_tp", set_group("te.GroupedLinear", self._tp, tp_group))
        self.__dict__.update(_plans={}, _last_plan=None)  # the plans hold the old setting

    def _parameter_inits(self) -> list[ParameterInit]:
        if self.single_grouped_weight:
            inits = [ParameterInit(("weight",), per_group_init(self._init_method))]
        else:
            inits = [
                ParameterInit((f"weight{g}",), self._init_method, gemm=g)
                for g in range(self.num_gemms)
            ]
        return inits + [ParameterInit((name,), fill(0.0)) for name in self.bias_names]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A checkpoint of the other parameter layout (per group / single) loads too.
        remap_checkpoint(state_dict, prefix, "weight", self.num_gemms, self.single_grouped_weight)
        if self.use_bias:
            remap_checkpoint(state_dict, prefix, "bias", self.num_gemms, self.single_grouped_bias)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        result = super()._apply(fn, recurse)
        regroup_fp8_weights([self._parameters[n] for n in self.weight_names])
        return result

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_fp8_weight_group"] = [None]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        regroup_fp8_weights([self._parameters[n] for n in self.weight_names])

    def _build_plan(self, key: PlanKey) -> GroupedPlan:
        return grouped_plan(self, key, self.weight_names, "te.GroupedLinear")

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: bool | None = None):
        """inp (..., in_features) with the groups' rows stacked -> y (..., out_features)
        [, the biases]."""
        if is_first_microbatch is not None and is_first_microbatch.__class__ is not bool:
            refuse_recipe("te.GroupedLinear.forward", is_first_microbatch=is_first_microbatch)
        dtype = self._compute_dtype()
        self._check_input(inp, self.in_features)
        tp = self._tp
        x = inp.reshape(-1, self.in_features)
        splits = group_splits(m_splits, self.num_gemms, x.shape[0], self.device)
        if tp.split:  # column: dx all-reduced in backward; row: y all-reduced, biases after
            x = tp.gemm_input(x)
        plan: GroupedPlan = self._plan(dtype, is_first_microbatch, False, False)
        p = self._parameters
        weights = [p[n] for n in self.weight_names]
        biases = [] if self.return_bias else [p[n] for n in self.bias_names]
        row_biases = biases if tp.split and tp.mode == "row" else []
        if row_biases:
            biases = []
        first = plan.gemms[0]
        single = self.single_grouped_weight, self.single_grouped_bias

        def run():
            w_fp8 = self._weights_fp8(
                plan, weights, is_first_microbatch, torch.is_grad_enabled() and inp.requires_grad
            )
            call = GroupedCall(plan, splits, w_fp8, len(biases), *single, exact_requested())
            params = (*weights, *biases)
            if torch.is_grad_enabled():
                return apply(_GroupedLinearFunction, x, call, *params)
            return grouped_linear_forward(
                NoGradContext(), x, call, params, (False,) * (len(params) + 2)
            )

        y = self._guarded_forward(first.setup, first.group, run)
        if tp.split:
            y = tp.gemm_output(y)
        if row_biases:  # under autograd: stacked by torch.stack, not group_bias_rows' view
            whole = row_biases[0] if self.single_grouped_bias else torch.stack(row_biases)
            y = y + cast_to(whole, dtype).index_select(0, splits.row_groups())
        y = as_output(y, (*inp.shape[:-1], self.out_features))
        if self.return_bias:
            return y, self._returned_bias(dtype)
        return y

    def _weights_fp8(self, plan: GroupedPlan, weights, is_first_microbatch, columnwise):
        """grouped_weights_fp8 of the weight parameters (a single one: its G groups)."""
        if not self.single_grouped_weight:
            return grouped_weights_fp8(self, plan, weights, is_first_microbatch, columnwise)
        groups = list(weights[0].detach().unbind(0))
        return grouped_weights_fp8(
            self, plan, groups, is_first_microbatch, columnwise, version_params=weights
        )

    def _returned_bias(self, dtype: torch.dtype):
        """return_bias: the biases in dtype, a list (per group) or one (G, N) tensor."""
        p = self._parameters
        if self.single_grouped_bias:
            return cast_to(p["bias"], dtype) if self.use_bias else None
        return [cast_to(p[n], dtype) for n in self.bias_names]

    def extra_repr(self) -> str:
        single = ""
        if self.single_grouped_weight or self.single_grouped_bias:
            single = (
                f", single_grouped_weight={self.single_grouped_weight}, "
                f"single_grouped_bias={self.single_grouped_bias}"
            )
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}, "
            f"params_dtype={self.params_dtype}, device={self.device}{single}"
        )
