"""te.Linear: y = x W^T + b, in high precision or FP8, with fused main_grad accumulation and
tensor/sequence parallelism.

Legend: x (..., K) input, W (N, K) weight, b (N,) bias, y (..., N). The GEMM machinery shared
with the other modules that end in a GEMM is in _linear_core.py; the collectives of tensor and
sequence parallelism (parallel_mode "column" / "row") in _tensor_parallel.py, run inside the
GEMM's autograd Function: the sequence-parallel input gathered before the GEMM (under FP8 as
FP8 bytes), a row GEMM's output reduced after it, a column GEMM's input gradient reduced while
the wgrad GEMM runs. in_features and out_features become this rank's (as in Transformer
Engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from torchte import distributed as te_dist
from torchte.autocast import autocast_state, refuse_recipe
from torchte.quantization.float8_tensor import Float8Tensor

from . import _tp_gemm as tp_gemm
from ._common import restore_saved, save_for_backward
from ._functorch import apply
from ._linear_backward import gemm_record, linear_backward
from ._linear_core import (
    LinearCore,
    LinearPlan,
    cast_to,
    check_save_original_input,
    check_unknown,
    linear_forward,
)
from ._te_compat import SaveOriginalInputMixin
from ._tensor_parallel import check_divides, forked_init, tensor_parallel

__all__ = ["Linear"]

_STATE = autocast_state()


def _split_forward(inp, weight, bias, w_fp8, plan: LinearPlan, tp, needs):
    """linear_forward between the collectives of a split layer (tp.split): the input gathered
    along the sequence first (column + SP; under FP8 as FP8 bytes), the partial output reduced
    after (row). Returns (y, x_saved, w_saved, the GEMM's input shape)."""
    need_dgrad, need_wgrad = needs
    if _fuses_symmetric(plan, tp):
        return _symmetric_forward(inp, weight, bias, plan, tp, needs)
    if tp.gathers_sequence:
        columnwise = need_wgrad and plan.fp8_backward
        gemm = (weight, bias, w_fp8, plan)
        y, _, x_saved, w_saved, shape = tp_gemm.gather_then_forward(
            tp, inp, plan.input_quantizer(), columnwise, False, gemm, needs
        )
        return y, x_saved, w_saved, shape
    scatter = tp_gemm.overlapped_scatter(tp, plan) if tp.mode == "row" else None
    y, x_saved, w_saved = linear_forward(
        inp, weight, bias, w_fp8, plan, need_dgrad, need_wgrad, scatter=scatter
    )
    if tp.mode == "row" and scatter is None:
        y = tp.reduce_partial(y)
    return y, x_saved, w_saved, inp.shape


def _fuses_symmetric(plan: LinearPlan, tp) -> bool:
    """Whether a split layer's GEMM runs fused with its sequence-parallel collective
    (te.distributed.use_symmetric_memory; high precision only: FP8 gathers move FP8 bytes)."""
    plain = not (plan.fp8 or plan.calibrating or plan.fp8_output or plan.fp8_grad)
    return plain and tp.sequence_parallel and te_dist.symmetric_memory_enabled()


def _symmetric_forward(inp, weight, bias, plan: LinearPlan, tp, needs):
    """_split_forward's high-precision sequence-parallel GEMM with its collective fused
    (te.distributed.all_gather_matmul: column; matmul_reduce_scatter: row)."""
    need_dgrad, need_wgrad = needs
    x = cast_to(inp.reshape(-1, inp.shape[-1]), plan.dtype)
    w = cast_to(weight, plan.dtype)
    group = tp.group_or_raise()
    if tp.mode == "column":
        x, y = te_dist.all_gather_matmul(x, w.t(), group)
        rows = inp.shape[0] * tp.size
    else:
        y = te_dist.matmul_reduce_scatter(x, w.t(), group)
        rows = inp.shape[0] // tp.size
    if bias is not None:
        y.add_(cast_to(bias, plan.dtype))
    y = y.view(rows, *inp.shape[1:-1], y.shape[-1])
    shape = torch.Size((rows, *inp.shape[1:])) if tp.mode == "column" else inp.shape
    return y, x if need_wgrad else None, w if need_dgrad else None, shape


def _symmetric_dgrad(tp, grad_out, w, inp_shape):
    """The fused backward GEMM of _symmetric_forward: (the input gradient of inp_shape, the
    output gradient the wgrad GEMM reads): column, the dgrad reduce-scattered; row, the output
    gradient gathered."""
    group = tp.group_or_raise()
    dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
    if tp.mode == "column":
        dgrad = te_dist.matmul_reduce_scatter(dy, w, group)
    else:
        dy, dgrad = te_dist.all_gather_matmul(dy, w, group)
    return dgrad.view(inp_shape), dy


class _LinearFunction(torch.autograd.Function):
    """Linear forward and backward; `plan` is the module's reused context object (with plan.tp,
    its tensor-parallel setting, whose collectives run inside where the GEMM is split)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, w_fp8, plan: LinearPlan):
        need_dgrad = ctx.needs_input_grad[0]
        need_wgrad = ctx.needs_input_grad[1] or plan.main_grad is not None
        needs = (need_dgrad, need_wgrad)
        tp = plan.tp if plan.tp.split else None
        # With the collective fused (symmetric memory), backward makes the dgrad itself.
        ctx.symmetric = tp is not None and _fuses_symmetric(plan, tp)
        if tp is None:
            y, x_saved, w_saved = linear_forward(inp, weight, bias, w_fp8, plan, *needs)
            shape = inp.shape
        else:
            y, x_saved, w_saved, shape = _split_forward(inp, weight, bias, w_fp8, plan, tp, needs)
        if ctx.symmetric:
            ctx.inp_shape, needs = inp.shape, (False, need_wgrad)
        save_for_backward(ctx, x_saved, w_saved)
        grads = ctx.needs_input_grad[1:3]
        ctx.gemm = gemm_record(shape, weight, bias, plan, *needs, grads)
        ctx.tp = tp
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, w_saved = restore_saved(ctx)
        tp, reduction, dgrad = ctx.tp, None, None
        dy_fp8 = made = None
        if ctx.symmetric and w_saved is not None:
            dgrad, grad_out = _symmetric_dgrad(tp, grad_out, w_saved, ctx.inp_shape)
        elif tp is not None:
            if tp.mode == "row" and tp.sequence_parallel:  # the output was reduce-scattered
                # (where it overlaps, the dgrad GEMM runs under the gather: `made`)
                grad_out, dy_fp8, made = tp_gemm.gather_grad_output(tp, grad_out, ctx.gemm, w_saved)
            reduction = tp.input_grad_reduction()  # column: overlaps the wgrad GEMM
        gemm_dgrad, wgrad, dbias = linear_backward(
            ctx.gemm, grad_out, x_saved, w_saved, dy_fp8, start_reduction=reduction, dgrad=made
        )
        return gemm_dgrad if dgrad is None else dgrad, wgrad, dbias, None, None


class Linear(SaveOriginalInputMixin, LinearCore):
    """y = x W^T + b with Transformer Engine's arguments; FP8 under `te.autocast`.

    x (..., in_features) -> y (..., out_features). Parameters: `weight` (out_features,
    in_features) and `bias` (out_features,), or with parameters_split `{name}_weight` and
    `{name}_bias` per split (views of one buffer).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: Callable[[torch.Tensor], None] | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        parameters_split: Sequence[str] | dict[str, int] | None = None,
        name: str | None = None,
        sequence_parallel: bool = False,
        tp_group=None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
        get_rng_state_tracker=None,
        rng_tracker_name: str | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        **unsupported,
    ) -> None:
        refuse_recipe(
            "te.Linear",
            bias=bias,
            return_bias=return_bias,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            sequence_parallel=sequence_parallel,
            delay_wgrad_compute=delay_wgrad_compute,
            save_original_input=save_original_input,
        )
        super().__init__(device, params_dtype)
        check_unknown("te.Linear", unsupported)
        tp = tensor_parallel("te.Linear", tp_group, tp_size, parallel_mode, sequence_parallel)
        check_divides("te.Linear", tp, in_features, out_features)
        self._tp = tp
        self._split, self._row_split = tp.split, tp.split and tp.mode == "row"
        self.parallel_mode, self.sequence_parallel = parallel_mode, tp.sequence_parallel
        self.tp_size = tp.size
        local_in, local_out = tp.local_features(in_features, out_features)
        self._init_linear(
            local_in,
            local_out,
            bias,
            forked_init(init_method, get_rng_state_tracker, rng_tracker_name),
            return_bias,
            fuse_wgrad_accumulation,
            parameters_split,
            name,
        )
        tp.mark(
            [getattr(self, n) for n in self.weight_names],
            [getattr(self, n) for n in self.bias_names],
        )
        self._defer_wgrad(delay_wgrad_compute, self.weight_names)
        self._save_original_input = bool(save_original_input)
        self._plain = self._plain_path()
        self._finish_init()

    def _plain_path(self) -> bool:
        """One plain weight, fused bias, high-precision parameters, no collective, the weight
        gradient made in backward: nn.Linear's path applies."""
        return (
            self.weight_names == ["weight"]  # one split named by the user is `{name}_weight`
            and not self.return_bias
            and not self.fuse_wgrad_accumulation
            and not isinstance(self.weight, Float8Tensor)
            and not self._tp.split
            and not self.delay_wgrad_compute
            and not self._save_original_input
        )

    def _build_plan(self, key):
        if self._save_original_input:
            check_save_original_input("te.Linear", key, self._tp)
        return super()._build_plan(key)

    def _wgrad_parameters(self, gemm: int) -> list[torch.nn.Parameter]:
        return self._weight_params()

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
        fp8_grad: bool = False,
    ):
        """inp (..., in_features) -> (..., out_features) [, bias if return_bias]."""
        if is_first_microbatch is not None and is_first_microbatch.__class__ is not bool:
            refuse_recipe("te.Linear.forward", is_first_microbatch=is_first_microbatch)
        dtype = self._compute_dtype()
        state = _STATE
        if (
            self._plain
            and inp.dtype is dtype
            and not (state.enabled or state.calibrating or fp8_output or fp8_grad)
        ):
            # nn.Linear's own path: F.linear and torch's autograd, nothing else.
            params = self._parameters
            try:
                return F.linear(inp, params["weight"], params["bias"])
            except RuntimeError:
                self._check_input(inp, self.in_features)
                raise
        self._check_input(inp, self.in_features)
        if self._split:
            self._tp.check_output_rows(inp)
            self._tp.group_or_raise()
        plan = self._plan(dtype, is_first_microbatch, fp8_output, fp8_grad)
        weight = self._full(self.weight_names)
        bias = self._full(self.bias_names) if self.use_bias else None
        # Row-parallel GEMMs make partial sums: the bias goes in once, after the reduction.
        fused_bias = None if self.return_bias or self._row_split else bias
        if plan.fast and not self._split and not isinstance(weight, Float8Tensor):
            out = F.linear(inp.to(dtype), weight.to(dtype), cast_to(fused_bias, dtype))
        else:
            out = self._forward_function(inp, weight, fused_bias, plan, is_first_microbatch)
        if self.return_bias:
            return out, cast_to(bias, dtype)
        if self._row_split and bias is not None:
            out = out + cast_to(bias, dtype)
        return out

    def _apply_function(self, inp, weight, bias, w_fp8, plan: LinearPlan):
        if torch.is_grad_enabled():
            return apply(_LinearFunction, inp, weight, bias, w_fp8, plan)
        if plan.tp.split:
            return _split_forward(inp, weight, bias, w_fp8, plan, plan.tp, (False, False))[0]
        return linear_forward(inp, weight, bias, w_fp8, plan, False, False)[0]
