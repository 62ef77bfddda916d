"""make_graphed_callables on a GPU: each forward pass's CUDA graphs, their warm-up and capture
in the schedule's order (schedule.py), and the autograd Function that replays them.

A pass's static inputs are its sample tensors: positional ones, then the keyword ones (None
keyword values are passed as None and must be None at replay). Its outputs are the forward
graph's static buffers, valid until the next replay of that pass. Parameter gradients are handed
to autograd as fresh tensors (one concatenation for all of a pass's parameters; the next
replay overwrites the static buffers, which would corrupt a .grad that kept them), unless
clone_param_grads_on_return=False asks for the static buffers themselves; parameters with a
`main_grad` (fuse_wgrad_accumulation) get the static buffer: Megatron ignores their .grad; so
do parameters marked `skip_backward_post_hook` (their gradient is accumulated elsewhere, as by
delay_wgrad_compute). Which parameters get fresh tensors is fixed when the graph is captured.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..module._graph_weights import WeightCaching
from ..module.base import TransformerEngineBaseModule
from .hooks import CaptureHooks

__all__ = ["PassGraphs", "capture", "every_module", "state_kept", "warm_up"]

# Keyword arguments a replay takes beyond the captured ones: is_first_microbatch (read by graphs
# captured with weight caching; ignored by the others, which cast the FP8 weights at every
# replay, as Transformer Engine ignores it without weight caching).
_IGNORED_AT_REPLAY = ("is_first_microbatch",)
_NOT_IMPLEMENTED_AT_REPLAY = ("cuda_graph_stream", "cuda_graph_event")


class PassGraphs:
    """One forward pass's captured forward and backward graphs, and the static tensors they read
    and write. module: the callable; forward: its forward under the pass's autocast region."""

    def __init__(
        self,
        module: nn.Module,
        forward,
        args: tuple,
        kwargs: dict,
        hooks: CaptureHooks,
        clone_param_grads: bool,
        caching: WeightCaching | None = None,
    ) -> None:
        self.module, self.forward, self.hooks = module, forward, hooks
        self.caching = caching  # FP8 weights kept across replays (cache_quantized_params)
        self.training = module.training
        self.n_args = len(args)
        self.tensor_keys = tuple(k for k, v in kwargs.items() if v is not None)
        self.none_keys = tuple(k for k, v in kwargs.items() if v is None)
        self.inputs = tuple(args) + tuple(kwargs[k] for k in self.tensor_keys)  # static
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        self.clone_param_grads = clone_param_grads
        self.fwd_graph = torch.cuda.CUDAGraph()
        self.bwd_graph = torch.cuda.CUDAGraph()
        self.outputs: tuple = ()
        self.spec = None
        self.differentiable: tuple = ()
        self.grad_outputs: tuple = ()
        self.input_grads: tuple = ()
        self.param_grads: tuple = ()
        # (indices into params, their static grads) of the grads handed out as fresh copies,
        # one pair per dtype (one copy kernel each)
        self.cloned: tuple[tuple[tuple[int, ...], list[torch.Tensor]], ...] = ()
        self.freed = False

    def call_args(self, inputs: tuple) -> tuple[tuple, dict]:
        """(args, kwargs) of the forward for `inputs` laid out as the static inputs are."""
        kwargs = dict(zip(self.tensor_keys, inputs[self.n_args :], strict=True))
        kwargs.update(dict.fromkeys(self.none_keys))
        return tuple(inputs[: self.n_args]), kwargs

    def differentiable_inputs(self) -> list[torch.Tensor]:
        return [t for t in (*self.inputs, *self.params) if t.requires_grad]

    def run_forward(self):
        """Eager forward on the static inputs (warm-up), between the capture-time hooks."""
        args, kwargs = self.call_args(self.inputs)
        self.hooks.before_forward(self.module, args, kwargs)
        output = self.forward(*args, **kwargs)
        self.hooks.after_forward(self.module, args, kwargs, output)
        return output

    def run_backward(self, output, allow_unused: bool) -> None:
        """Eager backward of run_forward's output (warm-up), between the capture-time hooks."""
        flat, _ = tree_flatten(output)
        flat = [o for o in flat if isinstance(o, torch.Tensor)]
        grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in flat)
        wanted = [o for o in flat if o.requires_grad]
        given = [g for g in grad_outputs if g is not None]
        self.hooks.before_backward(self.module, grad_outputs)
        grads = self._grads(wanted, given, allow_unused, retain_graph=False)
        self.hooks.after_backward(self.module, tuple(grads), grad_outputs)

    def _grads(self, outputs: list, grad_outputs: list, allow_unused: bool, retain_graph: bool):
        """Gradients of every input and parameter requiring grad, in order (None where none
        came). A parameter may get none (fuse_wgrad_accumulation writes main_grad instead);
        an input may only where allow_unused."""
        inputs = self.differentiable_inputs()
        if not (outputs and inputs):
            return [None] * len(inputs)
        grads = torch.autograd.grad(
            outputs, inputs, grad_outputs, allow_unused=True, retain_graph=retain_graph
        )
        # In the graph, each gradient in its tensor's dtype (autograd would otherwise cast
        # each one on every replay, outside the graph)
        grads = [
            g if g is None or g.dtype == t.dtype else g.to(t.dtype)
            for g, t in zip(grads, inputs, strict=True)
        ]
        user_inputs = sum(t.requires_grad for t in self.inputs)  # first in `inputs`
        if not allow_unused and any(g is None for g in grads[:user_inputs]):
            raise RuntimeError(
                "an input of the graphed module got no gradient (it was not used); pass "
                "allow_unused_input=True if this is intended"
            )
        return list(grads)

    def capture_forward(self, pool, stream) -> None:
        args, kwargs = self.call_args(self.inputs)
        self.hooks.before_forward(self.module, args, kwargs)
        with _capturing(self.fwd_graph, pool, stream):
            output = self.forward(*args, **kwargs)
        self.hooks.after_forward(self.module, args, kwargs, output)
        flat, self.spec = tree_flatten(output)
        if not all(isinstance(o, torch.Tensor) for o in flat):
            raise TypeError("a graphed module's outputs must be tensors (or tuples of them)")
        self.outputs = tuple(flat)
        self.differentiable = tuple(o.requires_grad for o in flat)

    def capture_backward(
        self, pool, stream, allow_unused: bool, retain_graph: bool, shared: dict | None
    ) -> None:
        """Capture the backward; `shared` (grad-output key -> buffers) lends the static output
        gradients of an earlier pass with outputs of the same shapes (buffer reuse)."""
        wanted = [o for o, d in zip(self.outputs, self.differentiable, strict=True) if d]
        given = self._grad_output_buffers(wanted, shared)
        slots = iter(given)
        self.grad_outputs = tuple(next(slots) if d else None for d in self.differentiable)
        self.hooks.before_backward(self.module, self.grad_outputs)
        with _capturing(self.bwd_graph, pool, stream):
            grads = self._grads(wanted, given, allow_unused, retain_graph)
        self.hooks.after_backward(self.module, tuple(grads), self.grad_outputs)
        grads = iter(grads)
        self.input_grads = tuple(
            next(grads, None) if t.requires_grad else None for t in self.inputs
        )
        self.param_grads = tuple(next(grads, None) for _ in self.params)
        cloned = [
            i for i, (p, g) in enumerate(zip(self.params, self.param_grads, strict=True))
            if g is not None and self.clone_param_grads and not _keeps_alias(p)
        ]  # fmt: skip
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in cloned:
            by_dtype.setdefault(self.param_grads[i].dtype, []).append(i)
        self.cloned = tuple(
            (tuple(group), [self.param_grads[i] for i in group]) for group in by_dtype.values()
        )
        if not retain_graph:  # the forward graph is kept; autograd's graph goes
            self.outputs = tuple(o.detach() for o in self.outputs)

    @staticmethod
    def _grad_output_buffers(wanted: list, shared: dict | None) -> list:
        key = tuple((tuple(o.shape), o.dtype, o.layout) for o in wanted)
        if shared is not None and key in shared:
            return shared[key]
        buffers = [torch.empty_like(o) for o in wanted]
        if shared is not None:
            shared[key] = buffers
        return buffers

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """The tensors a replay copies into the static inputs, from a call's arguments laid
        out as at capture (TypeError / ValueError naming what differs)."""
        if self.freed:
            raise RuntimeError(
                "this graphed callable's CUDA graphs were freed by reset(); call "
                "make_graphed_callables again to capture new ones"
            )
        if len(args) != self.n_args:
            raise TypeError(f"the graphed module takes {self.n_args} tensors, got {len(args)}")
        if not kwargs and len(self.inputs) == self.n_args and not self.none_keys:
            return args  # the common call: positional tensors only
        kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_AT_REPLAY}
        for name in _NOT_IMPLEMENTED_AT_REPLAY:
            if name in kwargs:
                raise NotImplementedError(
                    f"replaying a graphed callable with {name} is not implemented in torchte "
                    "yet; replay on the current stream"
                )
        expected = set(self.tensor_keys) | set(self.none_keys)
        if set(kwargs) != expected:
            missing, extra = sorted(expected - set(kwargs)), sorted(set(kwargs) - expected)
            raise TypeError(
                f"the graphed module was captured with keyword arguments {sorted(expected)}; "
                f"missing {missing}, unexpected {extra}"
            )
        for key in self.none_keys:
            if kwargs[key] is not None:
                raise ValueError(f"keyword argument {key!r} was None at capture; pass None")
        return tuple(args) + tuple(kwargs[k] for k in self.tensor_keys)

    def make_forward(self, eager_forward):
        """The module's graphed forward: a replay while the module's training flag is the one
        captured, else `eager_forward`."""
        graphs, module = self, self.module
        single = self.spec.is_leaf()
        caching = self.caching

        def forward(*args, **kwargs):
            if caching is not None:
                caching.set_first_microbatch(kwargs.get("is_first_microbatch"))
            if module.training != graphs.training:
                return eager_forward(*args, **kwargs)
            inputs = graphs.bind(args, kwargs)
            outputs = _Replay.apply(graphs, *inputs, *graphs.params)
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
        params = [None if g is None else g.detach() for g in self.param_grads]
        # Fresh tensors (autograd may keep them as .grad): one copy per dtype, in C++ (a cat
        # of mixed dtypes would promote, and autograd would launch a cast per gradient).
        for group, grads in self.cloned:
            if len(group) == 1:  # (flatten_dense_tensors would return a view, not a copy)
                params[group[0]] = grads[0].clone()
                continue
            flat = torch._C._nn.flatten_dense_tensors(grads)
            for i, part in zip(group, torch._C._nn.unflatten_dense_tensors(flat, grads),
                               strict=True):  # fmt: skip
                params[i] = part
        return inputs + tuple(params)

    def reset(self) -> None:
        """Free both graphs and drop the static tensors (their memory goes back to the pool);
        a later call raises."""
        self.fwd_graph.reset()
        self.bwd_graph.reset()
        self.inputs = self.outputs = self.grad_outputs = ()
        self.input_grads = self.param_grads = ()
        self.freed = True


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs into the static ones, replay the forward graph. Backward: copy
    the output gradients in, replay the backward graph, hand out the gradients."""

    @staticmethod
    def forward(ctx, graphs: PassGraphs, *args):
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


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool, stream):
    """torch.cuda.graph with Python's garbage collector paused: a collection during a capture
    could destroy another graph mid-capture."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    finally:
        if collecting:
            gc.enable()


def warm_up(passes, steps, iterations: int, allow_unused: bool, stream, hooks) -> None:
    """Eager forwards and backwards in the schedule's order on the capture stream: kernels
    compiled, caches and workspaces made before the capture. hooks: (pre_warmup_hook,
    post_warmup_hook), each None or called once around all iterations."""
    pre_hook, post_hook = hooks
    torch.cuda.synchronize()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if pre_hook is not None:
            pre_hook()
        for _ in range(iterations):
            outputs = {}
            for forward, p in steps:
                if forward:
                    outputs[p] = passes[p].run_forward()
                else:
                    passes[p].run_backward(outputs.pop(p), allow_unused)
            del outputs
        if post_hook is not None:
            post_hook()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def capture(passes, steps, pool, stream, allow_unused: bool, retain_graph: bool, reuse: bool):
    """Capture every pass's forward and backward graph in the schedule's order, all in `pool`
    (reuse: backward graphs of equal output shapes share their static output gradients)."""
    shared = {} if reuse else None
    for forward, p in steps:
        if forward:
            passes[p].capture_forward(pool, stream)
        else:
            passes[p].capture_backward(pool, stream, allow_unused, retain_graph, shared)


def every_module(root: nn.Module):
    """root.modules(), and the basic operations that te.ops' composite operations (te.ops.Linear)
    hold outside the module tree (their FP8 state is theirs)."""
    for module in root.modules():
        yield module
        for op in module.__dict__.get("basic_ops", ()):
            if isinstance(op, nn.Module) and op not in module._modules.values():
                yield from every_module(op)


@contextlib.contextmanager
def state_kept(modules):
    """Undo what the warm-up iterations (eager forwards and backwards on the sample arguments)
    wrote into the modules' delayed-scaling states, parameters' main_grad buffers and the CUDA
    generator: in place, so the captured graphs keep pointing at the same memory."""
    kept = []
    for root in modules:
        for module in every_module(root):
            if isinstance(module, TransformerEngineBaseModule):
                for pair in module._delayed_states.values():
                    for state in pair:
                        kept += [state.scale, state.amax_history, state.nonfinite]
        for param in root.parameters():
            if getattr(param, "main_grad", None) is not None:
                kept.append(param.main_grad)
    saved = [t.clone() for t in kept]
    rng = torch.cuda.get_rng_state()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.set_rng_state(rng)
        with torch.no_grad():
            for t, value in zip(kept, saved, strict=True):
                t.copy_(value)


def _keeps_alias(param: torch.Tensor) -> bool:
    """Whether a parameter's gradient is handed out as the graph's static buffer (not copied):
    fused wgrad accumulation (main_grad) or skip_backward_post_hook."""
    return getattr(param, "main_grad", None) is not None or bool(
        getattr(param, "skip_backward_post_hook", False)
    )
