"""te.make_graphed_callables: forward and backward of modules captured into CUDA graphs.

The capture is torch.cuda.make_graphed_callables's; what it adds for torchte's layers:
- each module runs under te.autocast(fp8_enabled, recipe, group, calibrating) during warm-up
  and capture, so the graphs hold the FP8 work: quantizations with their amax recording, and
  the delayed-scaling updates (launched at the autocast exit of the captured forward and at
  the end of the captured backward), which work in place on the modules' scaling state, so
  every replay records amaxes and moves the scales as an eager step would;
- FP8 weights are quantized at every call while capturing (not taken from the cache), so the
  graph requantizes the live weights at each replay (optimizer steps write them in place);
- the delayed-scaling states and main_grad buffers are put back as they were before the
  warm-up iterations (which run eagerly on the sample arguments);
- the setattr guard of te modules is lifted for the one assignment of `forward` torch makes.

Inputs of a replay must have the shapes of the sample arguments; fuse_wgrad_accumulation
works when the main_grad buffers stay where they were at capture (as Megatron's do).
On a machine without a GPU the modules are returned running eagerly under the same autocast
arguments, so code using this runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from .autocast import autocast, autocast_state
from .module.base import TransformerEngineBaseModule
from .recipe import DelayedScaling

__all__ = ["make_graphed_callables"]

_STATE = autocast_state()


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    fp8_enabled: bool = False,
    fp8_calibrating: bool = False,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching: bool = False,
    _order=None,
    pool=None,
    retain_graph_in_backward: bool = False,
):
    """Graphed versions of `modules` (one nn.Module or a tuple of them, in the order they run),
    with Transformer Engine's arguments. sample_args: a tuple of tensors (one module) or a tuple
    of such tuples."""
    if sample_kwargs or _order is not None or fp8_weight_caching or retain_graph_in_backward:
        raise NotImplementedError(
            "make_graphed_callables: sample_kwargs, _order, fp8_weight_caching and "
            "retain_graph_in_backward are not implemented in torchte yet"
        )
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    if len(args) != len(callables) or not all(isinstance(a, tuple) for a in args):
        raise ValueError("sample_args must give one tuple of tensors per callable")
    if not all(isinstance(c, nn.Module) for c in callables):
        raise TypeError("make_graphed_callables takes nn.Modules (their parameters get grads)")
    recipe = fp8_recipe if fp8_recipe is not None else DelayedScaling()
    region = functools.partial(
        autocast,
        enabled=fp8_enabled,
        calibrating=fp8_calibrating,
        recipe=recipe,
        amax_reduction_group=fp8_group,
    )
    for module in callables:
        _set_attr(module, "forward", _under(region, module.forward))
    tensors = [t for a in args for t in a if isinstance(t, torch.Tensor)]
    if not tensors or not all(t.is_cuda for t in tensors):
        return modules  # no GPU: eager, under the same autocast arguments
    if fp8_enabled or fp8_calibrating:  # the scaling state exists before the warm-up
        for root in callables:
            for module in root.modules():
                if isinstance(module, TransformerEngineBaseModule):
                    module._fp8_setup(recipe)
    with _capturing(), _setattr_allowed(callables), _state_kept(callables):
        graphed = torch.cuda.make_graphed_callables(
            callables, args, num_warmup_iters, allow_unused_input, pool
        )
    return graphed[0] if single else graphed


def _under(region, forward):
    """forward run inside a fresh autocast region made by `region`."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with region():
            return forward(*args, **kwargs)

    return run


def _set_attr(module: nn.Module, name: str, value) -> None:
    if isinstance(module, TransformerEngineBaseModule):
        module._fast_setattr(name, value)
    else:
        setattr(module, name, value)


@contextlib.contextmanager
def _capturing():
    _STATE.capturing = True
    try:
        yield
    finally:
        _STATE.capturing = False


@contextlib.contextmanager
def _setattr_allowed(modules):
    """Lift te modules' setattr guard (torch assigns each module's `forward` once)."""
    guarded = [
        m for root in modules for m in root.modules()
        if isinstance(m, TransformerEngineBaseModule) and m.__dict__.get("_initialized")
    ]  # fmt: skip
    for module in guarded:
        module.__dict__["_initialized"] = False
    try:
        yield
    finally:
        for module in guarded:
            module.__dict__["_initialized"] = True


@contextlib.contextmanager
def _state_kept(modules):
    """Undo what the warm-up iterations (eager forwards and backwards on the sample arguments)
    wrote into the modules' delayed-scaling states and parameters' main_grad buffers: in
    place, so the captured graphs keep pointing at the same memory."""
    kept = []
    for root in modules:
        for module in root.modules():
            if isinstance(module, TransformerEngineBaseModule):
                for pair in module._delayed_states.values():
                    for state in pair:
                        kept += [state.scale, state.amax_history]
        for param in root.parameters():
            if getattr(param, "main_grad", None) is not None:
                kept.append(param.main_grad)
    saved = [t.clone() for t in kept]
    try:
        yield
    finally:
        torch.cuda.synchronize()
        with torch.no_grad():
            for t, value in zip(kept, saved, strict=True):
                t.copy_(value)
