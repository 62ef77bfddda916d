"""GroupedMLP: te.ops.GroupedLinear -> an activation (scaled or not) -> te.ops.GroupedLinear
under FP8, the mixture-of-experts MLP: the activation, its per-row scales (the router's
probabilities) and the quantization of the second GEMM's input are one kernel
(quantization/fused.py: one launch under delayed scaling, an amax pass and the cast under
current), so the activation's output never exists in high precision.

Legend: x (T, K) the tokens stacked expert by expert (the split sizes of the first op), h the
first GEMM's output ((T, 2F) for a gated activation, else (T, F)), s (T,) the scales,
a = act(h) * s (T, F), y (T, N).

Backward (its own fusion, fuse_grouped_mlp_backward): FC2's grouped FP8 dgrad and wgrad, then
one kernel computes the activation's gradient dh, writes it in FP8 group by group for FC1's
GEMMs (current scaling: an amax pass first, which also makes the sums), ds = d(scales) and
FC1's bias gradients (each group's column sums of dh); then FC1's grouped FP8 dgrad and wgrad.
Each basic op's context is filled as its own op_forward would fill it, so either direction
also runs the basic ops unchanged. An activation with glu_interleave_size gets its input
reordered to [a, b] first (forward only: its backward then runs unfused, since the fused
gradient would come out in the reordered layout, not FC1's).
"""

from __future__ import annotations

import torch

from torchte._group_splits import group_splits
from torchte.quantization.fused import (
    scaled_activation_grad_to_grouped_fp8,
    scaled_activation_to_grouped_fp8,
)

from ..basic.activation import _Activation
from ..basic.grouped_linear import GroupedLinear
from ..op import FusedOperation, RunSettings, backward_one_by_one
from ._runs import replace_runs

__all__ = ["GroupedMLP", "fuse_grouped_mlp", "fuse_grouped_mlp_backward"]


class GroupedMLP(FusedOperation):
    """fc1 -> act -> fc2 in one forward (see the module docstring)."""

    def __init__(self, fc1: GroupedLinear, act: _Activation, fc2: GroupedLinear) -> None:
        super().__init__([fc1, act, fc2])
        self.fc1, self.act, self.fc2 = fc1, act, fc2

    def fuser_forward(self, ctxs, x, extra_inputs, settings):
        ctx1, ctx_act, ctx2 = ctxs
        fc1, act, fc2 = self.fc1, self.act, self.fc2
        fc1._check_input(x, fc1.in_features)
        x2d = x if x.dim() == 2 else x.reshape(-1, fc1.in_features)  # a GroupedTensor: as is
        tokens = x2d.shape[0]
        h = fc1.gemm_forward(ctx1, x2d, extra_inputs[0][0], settings)
        splits = group_splits(extra_inputs[2][0], fc2.num_groups, tokens, fc2.device)
        scaled = act.num_extra_inputs == 1
        if scaled:
            s = act.scales_of(h.view(*x.shape[:-1], h.shape[-1]), extra_inputs[1][0])
        else:
            s = torch.ones(tokens, dtype=torch.float32, device=h.device)  # times 1: exact
        h = act.kernel_input(h, h.dtype)  # [a, b] halves (an interleaved input reordered)
        quantizer = fc2.grouped_plan(settings).gemms[0].setup.grouped_input
        columnwise = settings.requires_grad and any(w.requires_grad for w in fc2.weight_params())
        name, limit, alpha = act.activation()
        a_fp8 = scaled_activation_to_grouped_fp8(
            quantizer, h, s, name, limit, alpha, splits, columnwise
        )
        if settings.requires_grad:
            if scaled:
                ctx_act.save_for_backward(h, s)
                act.save_scales(ctx_act, extra_inputs[1][0])
            else:
                ctx_act.save_for_backward(h)
        y = fc2.gemm_forward(ctx2, a_fp8, splits, settings, *extra_inputs[2][1:])
        return y.view(*x.shape[:-1], fc2.out_features), [(), (), ()]

    def fuser_backward(self, ctxs, dy, extra_output_grads):
        ctx1, ctx_act, ctx2 = ctxs
        fc1, act, fc2 = self.fc1, self.act, self.fc2
        da, extra2, grads2 = fc2.op_backward(ctx2, dy, extra_output_grads[2])
        usage = (ctx1.need_dgrad, ctx1.need_wgrad)
        scaled = act.num_extra_inputs == 1
        if not any(usage):  # only d(scales) is wanted: nothing to quantize
            dx, extras, grads = backward_one_by_one(
                [fc1, act], [ctx1, ctx_act], da, extra_output_grads[:2]
            )
            return dx, [*extras, extra2], [*grads, grads2]
        if scaled:
            h, s = ctx_act.saved
            need_ds = ctx_act.scales_grad
        else:
            (h,) = ctx_act.saved
            s, need_ds = torch.ones(h.shape[0], dtype=torch.float32, device=h.device), False
        quantizer = ctx1.plan.gemms[0].setup.grouped_grad_output
        name, limit, alpha = act.activation()
        need = (need_ds, bool(ctx1.num_bias and ctx1.bias_grad))
        dh_fp8, ds, dbias = scaled_activation_grad_to_grouped_fp8(
            quantizer, da.reshape(h.shape[0], da.shape[-1]), h, s, name, limit, alpha,
            ctx1.splits, usage, need,
        )  # fmt: skip
        dx, grads1 = fc1.gemm_backward(ctx1, dh_fp8, dbias)
        if dx is not None:
            dx = dx.view(*dy.shape[:-1], fc1.in_features)
        extra_act = (act.scales_grad(ctx_act, ds),) if scaled else ()
        return dx, [(None,), extra_act, extra2], [grads1, (), grads2]


def fuse_grouped_mlp(steps: list, settings: RunSettings) -> list:
    """Forward: replace each unfused GroupedLinear, gated activation, GroupedLinear whose second
    GEMM runs the grouped FP8 path with one GroupedMLP."""
    return _fuse(steps, settings, backward=False)


def fuse_grouped_mlp_backward(steps: list, settings: RunSettings) -> list:
    """Backward: the same, when the first GEMM also runs the grouped FP8 path."""
    return _fuse(steps, settings, backward=True)


def _fuse(steps: list, settings: RunSettings, backward: bool) -> list:
    if not settings.fp8:
        return steps

    def match(ops):
        if len(ops) == 3 and _matches(*ops, settings, backward):
            return GroupedMLP(*ops), 3
        return None

    return replace_runs(steps, match)


def _matches(fc1, act, fc2, settings: RunSettings, backward: bool) -> bool:
    if not (isinstance(fc1, GroupedLinear) and isinstance(fc2, GroupedLinear)):
        return False
    if not isinstance(act, _Activation) or fc1.num_groups != fc2.num_groups:
        return False
    if act.cache_quantized_input or fc1.scale_bias or fc2.grouped_plan(settings).mode != "fp8":
        return False
    if not backward:
        return True
    return act.glu_interleave_size is None and fc1.grouped_plan(settings).mode == "fp8"
