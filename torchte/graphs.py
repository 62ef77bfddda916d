"""te.make_graphed_callables: forward and backward of modules captured into CUDA graphs.

Each module's forward becomes a replay of a captured forward graph inside one autograd
Function whose backward replays a captured backward graph, with Transformer Engine's arguments:
- each module runs under te.autocast(fp8_enabled, recipe, group, calibrating) while warming up
  and capturing, so the graphs hold the FP8 work: the quantizations with their amax recording
  and the delayed-scaling updates (the one at the autocast exit of the captured forward, the
  one at the end of the captured backward). They work in place on the modules' scaling state,
  so every replay records amaxes and moves the scales as an eager step would;
- FP8 weights are quantized inside the graph (the weight cache is bypassed while capturing),
  so each replay requantizes the live weights that optimizer steps write in place;
- the warm-up iterations (eager, on the sample arguments) leave no trace: the delayed-scaling
  states and main_grad buffers are put back as they were;
- parameter gradients are handed to autograd as fresh tensors (one concatenation for all of a
  module's parameters), never as the graph's static buffers: the next replay overwrites those,
  which would corrupt a .grad that kept them (gradient accumulation). Parameters with a
  `main_grad` (fuse_wgrad_accumulation) get the static buffer: Megatron ignores their .grad.

A replay needs inputs of the sample arguments' shapes and dtypes; its outputs are the graph's
static buffers, valid until the next replay of the same module. The module's training flag at
capture is kept: a module switched to the other mode runs eagerly under the same autocast.
On a machine without a GPU the modules are returned running eagerly under the autocast
arguments, so code using this runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._options import check_options
from .autocast import autocast, default_recipe
from .module.base import TransformerEngineBaseModule
from .recipe import Recipe

__all__ = ["make_graphed_callables"]


# Transformer Engine 2.x's capture options torchte does not implement, and their "off" value
# (_options.check_options).
_OFF_OPTIONS = {
    "clone_param_grads_on_return": False,
    "_clone_param_grads_on_return": False,
    "capture_time_hooks": None,
    "_reuse_graph_input_output_buffers": False,
    "_num_layers_per_chunk": None,
    "pre_warmup_hook": None,
    "post_warmup_hook": None,
    "capture_stream": None,
}


def _one_of(new_name: str, new, old_name: str, old, default):
    """The value of an argument Transformer Engine 2.x renamed: the new name's, the old
    name's (None: not given), the default, or (both given, differently) a ValueError."""
    if new is None:
        return default if old is None else old
    if old is not None and old != new:
        raise ValueError(
            f"make_graphed_callables: {new_name}={new!r} and {old_name}={old!r} disagree "
            f"(the same argument); give {new_name}"
        )
    return new


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    fp8_enabled: bool | None = None,
    fp8_calibrating: bool | None = None,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching: bool | None = None,
    _order=None,
    pool=None,
    retain_graph_in_backward: bool = False,
    *,
    enabled: bool | None = None,
    calibrating: bool | None = None,
    recipe=None,
    amax_reduction_group=None,
    cache_quantized_params: bool | None = None,
    **off_options,
):
    """Graphed versions of `modules` (one nn.Module or a tuple of them, in the order they run:
    forwards are captured in that order, backwards in reverse, all in one memory pool).
    sample_args: a tuple of tensors (one module) or a tuple of such tuples. enabled,
    calibrating, recipe, amax_reduction_group and cache_quantized_params are Transformer Engine
    2.x's names of the fp8_* arguments (ValueError when both names are given, differently)."""
    fp8_enabled = _one_of("enabled", enabled, "fp8_enabled", fp8_enabled, False)
    fp8_calibrating = _one_of("calibrating", calibrating, "fp8_calibrating", fp8_calibrating, False)
    fp8_recipe = _one_of("recipe", recipe, "fp8_recipe", fp8_recipe, None)
    fp8_group = _one_of("amax_reduction_group", amax_reduction_group, "fp8_group", fp8_group, None)
    fp8_weight_caching = _one_of(
        "cache_quantized_params", cache_quantized_params, "fp8_weight_caching",
        fp8_weight_caching, False,
    )  # fmt: skip
    check_options("make_graphed_callables", off_options, _OFF_OPTIONS)
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
    if not all(isinstance(t, torch.Tensor) for a in args for t in a):
        raise TypeError("sample_args may hold only tensors")
    if num_warmup_iters < 1:
        raise ValueError("num_warmup_iters must be at least 1 (lazy setup must not be captured)")
    recipe = fp8_recipe if fp8_recipe is not None else default_recipe()
    if isinstance(recipe, Recipe):  # the snapshot te.autocast takes (recipe.py)
        recipe = recipe._frozen()
    region = functools.partial(
        autocast,
        enabled=fp8_enabled,
        calibrating=fp8_calibrating,
        recipe=recipe,
        amax_reduction_group=fp8_group,
    )
    eager = [_under(region, module.forward) for module in callables]
    if not all(t.is_cuda for a in args for t in a) or not any(a for a in args):
        for module, forward in zip(callables, eager, strict=True):
            _set_attr(module, "forward", forward)  # no GPU: eager, under the autocast arguments
        return modules
    if fp8_enabled or fp8_calibrating:  # the scaling state exists before the warm-up
        for root in callables:
            for module in root.modules():
                if isinstance(module, TransformerEngineBaseModule):
                    module._fp8_setup(recipe)
    graphs = [_Graphs(*entry) for entry in zip(callables, eager, args, strict=True)]
    with _state_kept(callables):
        _warm_up(graphs, num_warmup_iters, allow_unused_input)
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    for graph in graphs:
        graph.capture_forward(pool)
    for graph in reversed(graphs):
        graph.capture_backward(pool, allow_unused_input)
    for module, forward, graph in zip(callables, eager, graphs, strict=True):
        _set_attr(module, "forward", graph.make_forward(module, forward))
    return modules


class _Graphs:
    """One module's captured forward and backward, and the static tensors they read and write."""

    def __init__(self, module: nn.Module, forward, sample_args: tuple) -> None:
        self.forward = forward
        self.training = module.training
        self.inputs = tuple(sample_args)  # the static inputs a replay copies into
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        self.fwd_graph = torch.cuda.CUDAGraph()
        self.bwd_graph = torch.cuda.CUDAGraph()
        self.outputs: tuple = ()
        self.spec = None
        self.differentiable: tuple = ()
        self.grad_outputs: tuple = ()
        self.input_grads: tuple = ()
        self.param_grads: tuple = ()
        self.cloned: tuple = ()  # indices into params whose grads are cloned
        self.numels: tuple = ()

    def differentiable_inputs(self) -> list[torch.Tensor]:
        return [t for t in (*self.inputs, *self.params) if t.requires_grad]

    def run_eager(self, allow_unused: bool) -> None:
        outputs, _ = tree_flatten(self.forward(*self.inputs))
        outputs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        self._grads(outputs, [torch.empty_like(o) for o in outputs], allow_unused)

    def _grads(self, outputs: list, grad_outputs: list, allow_unused: bool) -> list:
        """Gradients of every input and parameter requiring grad, in order (None where none
        came). A parameter may get none (fuse_wgrad_accumulation writes main_grad instead);
        an input may only where allow_unused."""
        inputs = self.differentiable_inputs()
        if not (outputs and inputs):
            return [None] * len(inputs)
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
        user_inputs = sum(t.requires_grad for t in self.inputs)  # first in `inputs`
        if not allow_unused and any(g is None for g in grads[:user_inputs]):
            raise RuntimeError(
                "an input of the graphed module got no gradient (it was not used); pass "
                "allow_unused_input=True if this is intended"
            )
        return list(grads)

    def capture_forward(self, pool) -> None:
        with torch.cuda.graph(self.fwd_graph, pool=pool):
            outputs = self.forward(*self.inputs)
        flat, self.spec = tree_flatten(outputs)
        if not all(isinstance(o, torch.Tensor) for o in flat):
            raise TypeError("a graphed module's outputs must be tensors (or tuples of them)")
        self.outputs = tuple(flat)
        self.differentiable = tuple(o.requires_grad for o in flat)

    def capture_backward(self, pool, allow_unused: bool) -> None:
        self.grad_outputs = tuple(
            torch.empty_like(o) if d else None
            for o, d in zip(self.outputs, self.differentiable, strict=True)
        )
        outputs = [o for o, d in zip(self.outputs, self.differentiable, strict=True) if d]
        given = [g for g in self.grad_outputs if g is not None]
        with torch.cuda.graph(self.bwd_graph, pool=pool):
            grads = iter(self._grads(outputs, given, allow_unused))
        self.input_grads = tuple(
            next(grads, None) if t.requires_grad else None for t in self.inputs
        )
        self.param_grads = tuple(next(grads, None) for _ in self.params)
        self.cloned = tuple(
            i for i, (p, g) in enumerate(zip(self.params, self.param_grads, strict=True))
            if g is not None and getattr(p, "main_grad", None) is None
        )  # fmt: skip
        self.numels = tuple(self.param_grads[i].numel() for i in self.cloned)
        self.outputs = tuple(o.detach() for o in self.outputs)  # the forward graph is kept

    def make_forward(self, module: nn.Module, eager_forward):
        graphs, n_inputs = self, len(self.inputs)
        single = self.spec.is_leaf()

        def forward(*args):
            if module.training != graphs.training:
                return eager_forward(*args)
            if len(args) != n_inputs:
                raise TypeError(f"the graphed module takes {n_inputs} tensors, got {len(args)}")
            outputs = _Replay.apply(graphs, *args, *graphs.params)
            return outputs[0] if single else tree_unflatten(list(outputs), graphs.spec)

        return functools.wraps(eager_forward)(forward)

    def replay_forward(self, args) -> tuple:
        for static, given in zip(self.inputs, args, strict=False):
            if static.data_ptr() != given.data_ptr():
                if static.shape != given.shape or static.dtype != given.dtype:
                    raise ValueError(
                        f"a graphed module was captured with an input of shape "
                        f"{tuple(static.shape)} and dtype {static.dtype}; got "
                        f"{tuple(given.shape)} and {given.dtype}"
                    )
                static.copy_(given)
        self.fwd_graph.replay()
        return tuple(o.detach() for o in self.outputs)

    def replay_backward(self, grads, leaves) -> tuple:
        for static, grad in zip(self.grad_outputs, grads, strict=True):
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        self.bwd_graph.replay()
        inputs = tuple(
            None if g is None else g.clone() if leaf else g.detach()
            for g, leaf in zip(self.input_grads, leaves, strict=True)
        )
        params = list(self.param_grads)
        if self.cloned:  # fresh tensors: autograd may keep them as .grad
            flat = torch.cat([params[i].reshape(-1) for i in self.cloned])
            for i, part in zip(self.cloned, flat.split(self.numels), strict=True):
                params[i] = part.view(params[i].shape)
        return inputs + tuple(params)


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs into the static ones, replay the forward graph. Backward: copy
    the output gradients in, replay the backward graph, hand out the gradients."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, *args):
        ctx.graphs = graphs
        inputs = args[: len(graphs.inputs)]
        ctx.leaves = tuple(t.requires_grad and t.grad_fn is None for t in inputs)
        outputs = graphs.replay_forward(args)
        ctx.mark_non_differentiable(
            *(o for o, d in zip(outputs, graphs.differentiable, strict=True) if not d)
        )
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.graphs.replay_backward(grads, ctx.leaves))


def _warm_up(graphs: list[_Graphs], iterations: int, allow_unused: bool) -> None:
    """Eager forwards and backwards on a side stream: kernels compiled, caches and workspaces
    made before the capture."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            for graph in graphs:
                graph.run_eager(allow_unused)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


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
                        kept += [state.scale, state.amax_history, state.nonfinite]
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
