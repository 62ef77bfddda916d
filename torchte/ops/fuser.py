"""OperationFuser: one contiguous run of basic ops computed as one autograd Function.

Per setting (the autocast state, the compute dtype, whether a backward runs) the fuser builds a
Pipeline once: the settings every op reads, and the forward and backward op lists after the
registered fusions (ops/fused/__init__.py, and those users registered: _plan.py) replaced runs
of basic ops. A call looks the pipeline up by a tuple key and runs it: no pattern matching on
the hot path.

The Function takes x, the extra inputs and every parameter of the run as tensor arguments (so
autograd hands their gradients back), plus one _Call object; it returns y and the extra
outputs. Backward walks the backward list in reverse with the contexts the forward filled.
Extra tensors bound to channels between the ops (_channels.py) stay inside the Function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchte.autocast import autocast_state
from torchte.module._common import no_view, restore_saved, save_for_backward
from torchte.module._functorch import apply, transforms_active
from torchte.module.base import SUPPORTED_DTYPES

from . import _plan
from ._channels import Routing, routing_of
from ._plan import (
    register_backward_fusion,
    register_forward_backward_fusion,
    register_forward_fusion,
)
from .fused import BACKWARD_FUSIONS, FORWARD_FUSIONS
from .op import BasicOperation, FusibleOperation, OperationContext, RunSettings

__all__ = [
    "OperationFuser",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
]

_STATE = autocast_state()


@dataclass(frozen=True, slots=True, eq=False)
class Pipeline:
    """The ops of one setting: forward and backward lists of (op, indices of its basic ops)."""

    settings: RunSettings
    forward: list[tuple[FusibleOperation, list[int]]]
    backward: list[tuple[FusibleOperation, list[int]]]


class _Call:
    """The one non-tensor argument of the Function: the pipeline, how the flat tensor
    arguments split into extra inputs and parameters per basic op, and the keyword arguments
    of each basic op (None: none given)."""

    __slots__ = ("extra_counts", "fuser", "op_kwargs", "param_counts", "pipeline", "routing")

    def __init__(self, fuser: OperationFuser, pipeline: Pipeline, op_kwargs=None) -> None:
        self.fuser, self.pipeline, self.op_kwargs = fuser, pipeline, op_kwargs
        self.extra_counts, self.param_counts = fuser.extra_counts, fuser.param_counts
        self.routing = fuser.routing


def _split(flat, counts: list[int]) -> list[tuple]:
    out, start = [], 0
    for count in counts:
        out.append(tuple(flat[start : start + count]))
        start += count
    return out


def _run_forward(
    pipeline: Pipeline,
    ops,
    x,
    extra_inputs: list,
    x_requires_grad: bool,
    op_kwargs=None,
    routing: Routing | None = None,
):
    """(y, extra outputs per basic op, contexts per basic op): the forward list run in order;
    op_kwargs: a dict per basic op (ctx.kwargs), or None. With channels (routing), the
    extra inputs are per-op lists whose bound slots are filled as their producers run."""
    settings = pipeline.settings
    ctxs = [OperationContext() for _ in ops]
    if op_kwargs is not None:
        for ctx, kwargs in zip(ctxs, op_kwargs, strict=True):
            ctx.kwargs = kwargs
    extra_outputs: list[tuple] = [() for _ in ops]
    needs_grad = x_requires_grad
    for op, indices in pipeline.forward:
        if routing is not None:
            routing.fill_inputs(extra_inputs, indices, extra_outputs)
        for i in indices:
            ctxs[i].input_requires_grad = needs_grad
            needs_grad = needs_grad or any(p.requires_grad for p in ops[i].op_parameters())
            needs_grad = needs_grad or any(
                t.requires_grad for t in extra_inputs[i] if isinstance(t, torch.Tensor)
            )
        op_ctxs = [ctxs[i] for i in indices]
        x, extras = op.fuser_forward(op_ctxs, x, [extra_inputs[i] for i in indices], settings)
        for i, extra in zip(indices, extras, strict=True):
            extra_outputs[i] = tuple(extra)
    return x, extra_outputs, ctxs


class _FuserFunction(torch.autograd.Function):
    """The whole run: forward list in order, backward list in reverse."""

    @staticmethod
    def forward(autograd_ctx, x, call: _Call, *tensors):
        fuser, pipeline = call.fuser, call.pipeline
        ops = fuser.ops
        num_extra = fuser.num_extra_inputs
        extra_inputs = fuser.place_extra_inputs(tensors[:num_extra])
        y, extra_outputs, ctxs = _run_forward(
            pipeline,
            ops,
            x,
            extra_inputs,
            autograd_ctx.needs_input_grad[0],
            call.op_kwargs,
            call.routing,
        )
        saved = [value for ctx in ctxs for value in ctx.saved]
        save_for_backward(autograd_ctx, *saved)
        for ctx in ctxs:
            ctx.num_saved, ctx.saved = len(ctx.saved), ()
        autograd_ctx.op_ctxs, autograd_ctx.call = ctxs, call
        autograd_ctx.x_shape = x.shape
        y = no_view(y)  # a module output (FSDP2 warns about views)
        return (y, *fuser.public_extra_outputs(extra_outputs))

    @staticmethod
    def backward(autograd_ctx, dy, *extra_output_grads):
        call: _Call = autograd_ctx.call
        ctxs = autograd_ctx.op_ctxs
        values = restore_saved(autograd_ctx)
        start = 0
        for ctx in ctxs:
            ctx.saved = tuple(values[start : start + ctx.num_saved])
            start += ctx.num_saved
        routing = call.routing
        if routing is None:
            out_grads = _split(extra_output_grads, call.fuser.extra_output_counts)
        else:
            out_grads, channel_grads = routing.place_output_grads(extra_output_grads), {}
        extra_grads: list[tuple] = [() for _ in ctxs]
        param_grads: list[tuple] = [() for _ in ctxs]
        for op, indices in reversed(call.pipeline.backward):
            op_ctxs = [ctxs[i] for i in indices]
            if routing is not None:
                routing.add_channel_grads(out_grads, indices, channel_grads)
            dy, extras, params = op.fuser_backward(op_ctxs, dy, [out_grads[i] for i in indices])
            for i, extra, grads in zip(indices, extras, params, strict=True):
                extra_grads[i], param_grads[i] = tuple(extra), tuple(grads)
                if routing is not None:
                    routing.take_input_grads(i, extra_grads[i], indices, channel_grads)
        for ctx in ctxs:
            ctx.saved = ()
        if routing is None:
            flat_extra = _flat(extra_grads, call.extra_counts)
        else:
            flat_extra = routing.public_input_grads(extra_grads)
        flat_params = _flat(param_grads, call.param_counts)
        return (dy, None, *flat_extra, *flat_params)


def _transformed(x, call: _Call, extra_inputs, params, settings: RunSettings) -> tuple:
    """The run under a torch.func transform (grad, vjp): the Function through module/
    _functorch's adapter, in high precision only."""
    if settings.fp8 or settings.calibrating:
        raise NotImplementedError(
            "te.ops under torch.func (grad, vjp) runs in high precision only: its FP8 path "
            "quantizes weights and records amaxes inside the fused Function; run it outside "
            "te.autocast there"
        )
    out = apply(_FuserFunction, x, call, *extra_inputs, *params)
    return out if isinstance(out, tuple) else (out,)


def _flat(per_op: list[tuple], counts: list[int]) -> list:
    """The gradients of every op, each op's as exactly its `count` entries (an op may return
    () for "no gradients")."""
    flat = []
    for grads, count in zip(per_op, counts, strict=True):
        flat += [*grads, *([None] * (count - len(grads)))]
    return flat


class OperationFuser:
    """Runs `ops` (consecutive BasicOperations of a Sequential) as one autograd Function."""

    # The fusions users registered (Transformer Engine's class attributes; see _plan.py).
    forward_backward_fusion_functions = _plan.FORWARD_BACKWARD_FUNCTIONS
    forward_fusion_functions = _plan.FORWARD_FUNCTIONS
    backward_fusion_functions = _plan.BACKWARD_FUNCTIONS

    def __init__(self, ops: list[BasicOperation]) -> None:
        self.ops = list(ops)
        self.extra_counts = [op.num_extra_inputs for op in self.ops]
        self.extra_output_counts = [op.num_extra_outputs for op in self.ops]
        self.param_counts = [len(op.op_parameters()) for op in self.ops]
        # Channels between the ops (None: none bound); taken now, so they cannot change.
        self.routing = routing_of(self.ops)
        for op in self.ops:
            op.__dict__["_channels_locked"] = True
        routing = self.routing
        self.num_extra_inputs = (
            sum(self.extra_counts) if routing is None else len(routing.public_in)
        )
        self._pipelines: dict[tuple, Pipeline] = {}
        # The op whose parameters set the compute dtype (None: no op of the run has any).
        self._dtype_owner = next((op for op in self.ops if op.op_parameters()), None)

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """torch.autocast's dtype where it is on; else the params_dtype of the first op with
        parameters; else (a run of ops without parameters) x's dtype."""
        owner = self._dtype_owner
        if owner is not None:
            return owner._compute_dtype()
        first = self.ops[0]
        device_type = first._autocast_type
        if device_type is not None and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return x.dtype if x.dtype in SUPPORTED_DTYPES else first.params_dtype

    def _pipeline(self, x: torch.Tensor, requires_grad: bool) -> Pipeline:
        state = _STATE
        fp8, calibrating = state.enabled, state.calibrating and not state.enabled
        recipe = state.recipe if (fp8 or calibrating) else None
        group = state.group if recipe is not None else None
        dtype = self._compute_dtype(x)
        key = (fp8, calibrating, recipe, group, dtype, requires_grad)
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            settings = RunSettings(fp8, calibrating, recipe, group, dtype, requires_grad)
            for op in self.ops:
                op.check_settings(settings)
            forward, backward = _plan.plan(self.ops, settings, FORWARD_FUSIONS, BACKWARD_FUSIONS)
            pipeline = self._pipelines[key] = Pipeline(settings, forward, backward)
        return pipeline

    def _check_extra_inputs(self, x: torch.Tensor, extra_inputs: tuple) -> None:
        """Each op's extra inputs against the rows its input will have: a bad one is an error
        before any op of the run computes."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else None
        for op, extra in zip(self.ops, self.place_extra_inputs(extra_inputs), strict=True):
            if not any(t is None for t in extra):  # a channel's input is checked by its op
                op.check_extra_inputs(tuple(extra), rows)
            rows = op.output_rows(rows)

    def place_extra_inputs(self, flat) -> list:
        """The call's extra inputs per basic op (tuples; with channels, lists whose bound
        slots are None until their producers run)."""
        if self.routing is None:
            return _split(flat, self.extra_counts)
        return self.routing.place_inputs(flat)

    def public_extra_outputs(self, extra_outputs: list[tuple]) -> list:
        """The extra outputs the call returns, in op order."""
        if self.routing is None:
            return [t for extra in extra_outputs for t in extra]
        return self.routing.public_outputs(extra_outputs)

    def __call__(self, x: torch.Tensor, extra_inputs: tuple, op_kwargs=None) -> tuple:
        """(y, extra outputs in op order); op_kwargs: None, or a dict per op (its ctx.kwargs)."""
        params = [p for op in self.ops for p in op.params_for_call()]
        requires_grad = torch.is_grad_enabled() and (
            x.requires_grad
            or any(p.requires_grad for p in params)
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in extra_inputs)
        )
        pipeline = self._pipeline(x, requires_grad)
        settings = pipeline.settings
        if self.num_extra_inputs:
            self._check_extra_inputs(x, extra_inputs)
        try:
            call = _Call(self, pipeline, op_kwargs)
            if requires_grad and transforms_active():
                out = _transformed(x, call, extra_inputs, params, settings)
            elif requires_grad:
                out = _FuserFunction.apply(x, call, *extra_inputs, *params)
            else:
                extra = self.place_extra_inputs(extra_inputs)
                y, extra_outputs, _ = _run_forward(
                    pipeline, self.ops, x, extra, False, op_kwargs, self.routing
                )
                out = (y, *self.public_extra_outputs(extra_outputs))
        except BaseException:
            for op in self.ops:
                op.forward_failed(settings)
            raise
        for op in self.ops:
            op.forward_done(settings)
        return out
