"""te.make_graphed_callables: forward and backward of modules captured into CUDA graphs.

Each forward pass becomes a replay of a captured forward graph inside one autograd Function
whose backward replays a captured backward graph (pass_graphs.py), with Transformer Engine's
arguments:
- each module runs under te.autocast(enabled, recipe, amax_reduction_group, calibrating) while
  warming up and capturing (`enabled` may be one bool per module), so the graphs hold the FP8
  work: the quantizations with their amax recording and the delayed-scaling updates (the one
  at the autocast exit of the captured forward, the one at the end of the captured backward).
  They work in place on the modules' scaling state, so every replay records amaxes and moves
  the scales as an eager step would;
- FP8 weights are quantized inside the graph (the weight cache is bypassed while capturing),
  so each replay requantizes the live weights that optimizer steps write in place; with
  cache_quantized_params (fp8_weight_caching) each call says is_first_microbatch, and a later
  microbatch's replay uses the FP8 weight the first one cast, as an eager step does
  (module/_graph_weights.py);
- sample_kwargs are captured and replayed as the positional sample_args are;
- the warm-up iterations (eager, on the sample arguments, between pre_warmup_hook and
  post_warmup_hook) leave no trace: the delayed-scaling states, main_grad buffers and the CUDA
  generator are put back as they were;
- `_order` captures the passes of interleaved pipeline-parallel chunks in a schedule's order
  (schedule.py) and returns one graphed function per forward pass.

A replay needs inputs of the sample arguments' shapes and dtypes; its outputs are the graph's
static buffers, valid until the next replay of the same pass. The module's training flag at
capture is kept: a module switched to the other mode runs eagerly under the same autocast.
`reset()` on a returned callable frees its graphs (a module gets its own forward back).
While it runs, is_graph_capturing() is True (state.py, with Transformer Engine's other
helpers of `transformer_engine.pytorch.graph`: save_fp8_tensors, restore_fp8_tensors, ...).
On a machine without a GPU (or with sample arguments not all on one) the modules run eagerly
under the autocast arguments (nothing is captured, the warm-up and capture-time hooks are not
called), so code using this runs unchanged; a UserWarning says so, once per process.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..autocast import autocast, default_recipe
from ..module._graph_weights import WeightCaching, caching_weights
from ..module._setattr_guard import SetattrGuard
from ..module.base import TransformerEngineBaseModule
from ..recipe import Recipe
from .hooks import capture_hooks
from .pass_graphs import PassGraphs, capture, every_module, state_kept, warm_up
from .schedule import Schedule, pipeline_schedule, plain_schedule, reused_samples
from .state import (
    capture_window,
    graph_pool_handle,
    is_graph_capturing,
    restore_fp8_tensors,
    save_fp8_tensors,
    set_capture_end,
    set_capture_start,
)

__all__ = [
    "graph_pool_handle",
    "is_graph_capturing",
    "make_graphed_callables",
    "restore_fp8_tensors",
    "save_fp8_tensors",
    "set_capture_end",
    "set_capture_start",
]


@dataclass(frozen=True)
class _Capture:
    """How the passes are warmed up and captured (the arguments that say it)."""

    num_warmup_iters: int
    allow_unused: bool
    retain_graph: bool
    clone_param_grads: bool
    reuse_buffers: bool
    warmup_hooks: tuple
    stream: object
    pool: object
    cache_weights: bool
    """cache_quantized_params: FP8 weights cast at a step's first microbatch only."""


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
    fp8_enabled: bool | tuple[bool, ...] | None = None,
    fp8_calibrating: bool | None = None,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching: bool | None = None,
    _order: list[int] | None = None,
    pool=None,
    retain_graph_in_backward: bool = False,
    *,
    enabled: bool | tuple[bool, ...] | None = None,
    calibrating: bool | None = None,
    recipe=None,
    amax_reduction_group=None,
    cache_quantized_params: bool | None = None,
    _num_layers_per_chunk: int | list[int] | None = None,
    _reuse_graph_input_output_buffers: bool = False,
    clone_param_grads_on_return: bool | None = None,
    _clone_param_grads_on_return: bool | None = None,
    pre_warmup_hook: Callable[[], None] | None = None,
    post_warmup_hook: Callable[[], None] | None = None,
    capture_time_hooks: list[dict | None] | None = None,
    capture_stream: torch.cuda.Stream | None = None,
):
    """Graphed versions of `modules` (one nn.Module or a tuple of them, in the order they run:
    forwards are captured in that order, backwards in reverse, all in one memory pool).

    sample_args: a tuple of tensors (one module) or one tuple per module (with `_order`: one
    per forward pass); sample_kwargs: a dict of tensors (or None values) per module likewise.
    enabled, calibrating, recipe, amax_reduction_group and cache_quantized_params are
    Transformer Engine 2.x's names of the fp8_* arguments (ValueError when both names are
    given, differently); `enabled` may be a tuple with one bool per module. Returns `modules`
    with their forward replaced, or with `_order` a tuple of one graphed function per forward
    pass; each has `reset()` and `backward_dw()`.
    """
    fp8_enabled = _one_of("enabled", enabled, "fp8_enabled", fp8_enabled, False)
    fp8_calibrating = _one_of("calibrating", calibrating, "fp8_calibrating", fp8_calibrating, False)
    fp8_recipe = _one_of("recipe", recipe, "fp8_recipe", fp8_recipe, None)
    fp8_group = _one_of("amax_reduction_group", amax_reduction_group, "fp8_group", fp8_group, None)
    fp8_weight_caching = _one_of(
        "cache_quantized_params", cache_quantized_params, "fp8_weight_caching",
        fp8_weight_caching, False,
    )  # fmt: skip
    clone = _one_of(
        "_clone_param_grads_on_return", _clone_param_grads_on_return,
        "clone_param_grads_on_return", clone_param_grads_on_return, True,
    )  # fmt: skip
    with capture_window():
        return _graphed_callables(
            modules, sample_args, sample_kwargs, fp8_enabled, fp8_calibrating, fp8_recipe,
            fp8_group, _order, _num_layers_per_chunk, capture_time_hooks,
            _settings(
                num_warmup_iters, allow_unused_input, retain_graph_in_backward, clone,
                _reuse_graph_input_output_buffers, (pre_warmup_hook, post_warmup_hook),
                capture_stream, pool, fp8_weight_caching,
            ),
        )  # fmt: skip


def _graphed_callables(
    modules, sample_args, sample_kwargs, fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group,
    order, layers_per_chunk, capture_time_hooks, settings: _Capture,
):  # fmt: skip
    """make_graphed_callables past its argument names (inside the capture window)."""
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    if not all(isinstance(c, nn.Module) for c in callables):
        raise TypeError("make_graphed_callables takes nn.Modules (their parameters get grads)")
    per_module = _per_module(fp8_enabled, len(callables))
    schedule = _schedule(order, layers_per_chunk, callables, sample_args)
    samples = _samples(sample_args, sample_kwargs, single and order is None, schedule)
    hooks = capture_hooks(capture_time_hooks, len(callables))
    if settings.reuse_buffers:
        _check_reuse(order, callables)
        samples = reused_samples(schedule, samples)
    recipe = fp8_recipe if fp8_recipe is not None else default_recipe()
    if isinstance(recipe, Recipe):  # the snapshot te.autocast takes (recipe.py)
        recipe = recipe._frozen()
    eager = [
        _under(functools.partial(autocast, on, fp8_calibrating, recipe, fp8_group), c.forward)
        for c, on in zip(callables, per_module, strict=True)
    ]
    if not _on_gpu(samples):
        return _eager_result(modules, callables, eager, schedule, order is not None)
    for root, on in zip(callables, per_module, strict=True):
        _prepare(root, recipe if on or fp8_calibrating else None)
    caching = WeightCaching(torch.device("cuda")) if settings.cache_weights else None
    passes = [
        PassGraphs(
            callables[c], eager[c], *samples[p], hooks[c], settings.clone_param_grads, caching
        )
        for p, c in enumerate(schedule.callable_of)
    ]
    _warm_up_and_capture(passes, callables, schedule, settings, caching)
    return _graphed_result(modules, passes, eager, schedule, order is not None)


def _per_module(enabled, count: int) -> tuple[bool, ...]:
    """`enabled` as one bool per module (a bool for all, or a tuple of `count` bools)."""
    if isinstance(enabled, bool):
        return (enabled,) * count
    if not isinstance(enabled, tuple) or not all(isinstance(e, bool) for e in enabled):
        raise TypeError(f"enabled must be a bool or a tuple of bools, got {enabled!r}")
    if len(enabled) != count:
        raise ValueError(f"enabled has {len(enabled)} entries for {count} modules")
    return enabled


def _schedule(order, layers_per_chunk, callables, sample_args) -> Schedule:
    if order is None:
        if layers_per_chunk is not None:
            raise ValueError("_num_layers_per_chunk is given without _order")
        return plain_schedule(len(callables))
    if not isinstance(sample_args, Sequence):
        raise ValueError("with _order, sample_args must give one tuple per forward pass")
    return pipeline_schedule(order, layers_per_chunk, len(callables), len(sample_args))


def _samples(sample_args, sample_kwargs, single: bool, schedule: Schedule) -> list:
    """(args, kwargs) per forward pass, checked: tuples of tensors, dicts of tensors or None."""
    count = len(schedule.callable_of)
    if single:
        sample_args, sample_kwargs = (sample_args,), (sample_kwargs,)
    elif sample_kwargs is None:
        sample_kwargs = (None,) * count
    if not isinstance(sample_args, Sequence) or len(sample_args) != count:
        raise ValueError(f"sample_args must give one tuple of tensors per callable ({count})")
    if not isinstance(sample_kwargs, Sequence) or len(sample_kwargs) != count:
        raise ValueError(f"sample_kwargs must give one dict (or None) per callable ({count})")
    samples = []
    for args, kwargs in zip(sample_args, sample_kwargs, strict=True):
        if not isinstance(args, tuple | list):
            raise ValueError("sample_args must give one tuple of tensors per callable")
        if not all(isinstance(t, torch.Tensor) for t in args):
            raise TypeError("sample_args may hold only tensors")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"sample_kwargs must be dicts, got {type(kwargs).__name__}")
        for key, value in kwargs.items():
            if not isinstance(key, str) or not (value is None or isinstance(value, torch.Tensor)):
                raise TypeError(f"sample_kwargs may hold only tensors or None, got {key!r}")
        samples.append((tuple(args), dict(kwargs)))
    return samples


def _settings(
    iters, allow_unused, retain, clone, reuse, warmup_hooks, stream, pool, cache_weights
) -> _Capture:
    if not isinstance(iters, int) or iters < 1:
        raise ValueError("num_warmup_iters must be at least 1 (lazy setup must not be captured)")
    for name, hook in zip(("pre_warmup_hook", "post_warmup_hook"), warmup_hooks, strict=True):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable, got {type(hook).__name__}")
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"capture_stream must be a torch.cuda.Stream, got {stream!r}")
    flags = {"allow_unused_input": allow_unused, "retain_graph_in_backward": retain}
    flags |= {"_clone_param_grads_on_return": clone, "_reuse_graph_input_output_buffers": reuse}
    flags["cache_quantized_params"] = cache_weights
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    return _Capture(
        iters, allow_unused, retain, clone, reuse, warmup_hooks, stream, pool, cache_weights
    )


def _check_reuse(order, callables) -> None:
    if order is None:
        raise ValueError("_reuse_graph_input_output_buffers=True needs _order")
    if not all(c.training for c in callables):
        raise ValueError("_reuse_graph_input_output_buffers=True needs modules in training mode")


def _on_gpu(samples) -> bool:
    tensors = [t for args, kwargs in samples for t in (*args, *kwargs.values()) if t is not None]
    return bool(tensors) and all(t.is_cuda for t in tensors)


def _prepare(root: nn.Module, recipe) -> None:
    """Refuse what cannot be captured; make the FP8 scaling state before the warm-up."""
    for module in every_module(root):
        deferred = getattr(module, "need_backward_dw", None)
        if callable(deferred) and deferred():
            raise NotImplementedError(
                f"make_graphed_callables: {type(module).__name__} defers its weight gradients "
                "(delay_wgrad_compute=True); capturing a separate weight-gradient graph is not "
                "implemented in torchte yet"
            )
        # (a te.ops bias or activation keeps no FP8 state)
        if (
            recipe is not None
            and isinstance(module, TransformerEngineBaseModule)
            and module.num_gemms
        ):
            module._fp8_setup(recipe)


def _warm_up_and_capture(passes, callables, schedule: Schedule, settings: _Capture, caching):
    stream = settings.stream if settings.stream is not None else torch.cuda.Stream()
    unique = list({id(c): c for c in callables}.values())
    with state_kept(unique), caching_weights(caching):
        warm_up(
            passes, schedule.steps, settings.num_warmup_iters, settings.allow_unused, stream,
            settings.warmup_hooks,
        )  # fmt: skip
    pool = torch.cuda.graph_pool_handle() if settings.pool is None else settings.pool
    with caching_weights(caching):
        capture(
            passes, schedule.steps, pool, stream, settings.allow_unused, settings.retain_graph,
            settings.reuse_buffers,
        )  # fmt: skip


def _graphed_result(modules, passes, eager, schedule: Schedule, ordered: bool):
    """Modules with their forward replaced by the replay (or, with _order, one function per
    pass), each with reset() and backward_dw()."""
    made = []
    for graphs, c in zip(passes, schedule.callable_of, strict=True):
        forward = graphs.make_forward(eager[c])
        if ordered:
            made.append(_with_methods(forward, graphs.reset, _nothing_deferred))
        else:
            _install(graphs.module, forward, graphs.reset, _nothing_deferred)
    return tuple(made) if ordered else modules


@functools.cache  # once per process
def _warn_eager() -> None:
    """The UserWarning that nothing is captured here (said once per process)."""
    why = "no CUDA" if not torch.cuda.is_available() else "sample arguments not all on the GPU"
    warnings.warn(
        f"{why}: make_graphed_callables runs the callables eagerly (nothing is captured; "
        "each call runs under the given autocast arguments). Said once per process.",
        UserWarning,
        stacklevel=5,  # make_graphed_callables' caller
    )


def _eager_result(modules, callables, eager, schedule: Schedule, ordered: bool):
    """No GPU: the same result as on one, running eagerly under the autocast arguments."""
    _warn_eager()
    if not ordered:
        for module, forward in zip(callables, eager, strict=True):
            _install(module, forward, None, functools.partial(_run_deferred, module))
        return modules
    made = []
    for c in schedule.callable_of:
        state = {"reset": False}
        reset = functools.partial(state.__setitem__, "reset", True)
        backward_dw = functools.partial(_run_deferred, callables[c])
        made.append(_with_methods(_checked_reset(eager[c], state), reset, backward_dw))
    return tuple(made)


def _checked_reset(forward, state: dict):
    """forward, refused once state["reset"] is set (an eager pass function after reset())."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if state["reset"]:
            raise RuntimeError("this graphed callable was reset(); call make_graphed_callables")
        return forward(*args, **kwargs)

    return run


def _with_methods(function, reset: Callable[[], None], backward_dw: Callable[[], None]):
    """function, given Transformer Engine's `reset` and `backward_dw` attributes."""
    function.reset, function.backward_dw = reset, backward_dw
    return function


_MISSING = object()


def _install(module: nn.Module, forward, reset_graphs, backward_dw) -> None:
    """module.forward = forward, with module.reset() (reset_graphs() frees the graphs, if any;
    the module's previous forward comes back) and module.backward_dw()."""
    previous = module.__dict__.get("forward", _MISSING)

    def reset() -> None:
        if reset_graphs is not None:
            reset_graphs()
        if module.__dict__.get("forward") is forward:
            if previous is _MISSING:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous

    _set_attr(module, "forward", forward)
    _set_attr(module, "reset", reset)
    _set_attr(module, "backward_dw", backward_dw)


def _nothing_deferred() -> None:
    """backward_dw of a captured pass: no weight-gradient graph exists (modules that defer
    their weight gradients are refused), every backward replay made them all."""


def _run_deferred(root: nn.Module) -> None:
    """backward_dw of an eager (no GPU) callable: the deferred weight-gradient GEMMs of the
    modules under root that defer them (delay_wgrad_compute), as a replay would run them."""
    for module in root.modules():
        deferred = getattr(module, "need_backward_dw", None)
        if callable(deferred) and deferred():
            type(module).backward_dw(module)  # the instance attribute may be this function


def _under(region, forward):
    """forward run inside a fresh autocast region made by `region`."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with region():
            return forward(*args, **kwargs)

    return run


def _set_attr(module: nn.Module, name: str, value) -> None:
    """module.name = value; through _fast_setattr on modules that guard their attributes (te
    modules, DotProductAttention, ...), whose plain assignment after construction warns."""
    if isinstance(module, SetattrGuard):
        module._fast_setattr(name, value)
    else:
        setattr(module, name, value)
