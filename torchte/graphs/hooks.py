"""make_graphed_callables' capture_time_hooks: per-callable hooks that run around each warm-up
and capture pass, outside the CUDA graph (they are never captured and never replayed), for
framework bookkeeping that cannot be captured (Transformer Engine's keys and signatures):

- "forward_pre_hooks": {id: hook(module, args)}, or hook(module, args, kwargs) for the ids in
  "forward_pre_hooks_with_kwargs";
- "forward_hooks": {id: hook(module, args, output)}, or hook(module, args, kwargs, output)
  for the ids in "forward_hooks_with_kwargs";
- "backward_pre_hooks": {id: hook(module, grad_outputs)};
- "backward_hooks": {id: hook(module, grad_inputs, grad_outputs)}.

A hook that takes one positional argument is called with the module alone, as newer
Transformer Engine releases call every capture-time hook. A hook must return None: replacing
arguments, outputs or gradients is refused (RuntimeError).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

from torch import nn

__all__ = ["CaptureHooks", "capture_hooks"]

_KEYS = (
    "forward_pre_hooks",
    "forward_pre_hooks_with_kwargs",
    "forward_hooks",
    "forward_hooks_with_kwargs",
    "backward_pre_hooks",
    "backward_hooks",
)
_WITH_KWARGS = ("forward_pre_hooks_with_kwargs", "forward_hooks_with_kwargs")


class CaptureHooks:
    """One callable's capture-time hooks (empty: none)."""

    __slots__ = ("_hooks",)

    def __init__(self, hooks: Mapping[str, dict] | None = None) -> None:
        self._hooks = {key: dict((hooks or {}).get(key) or {}) for key in _KEYS}

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        with_kwargs = self._hooks["forward_pre_hooks_with_kwargs"]
        for hook_id, hook in self._hooks["forward_pre_hooks"].items():
            extra = (kwargs,) if hook_id in with_kwargs else ()
            _call(hook, "forward_pre_hooks", module, args, *extra)

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        with_kwargs = self._hooks["forward_hooks_with_kwargs"]
        for hook_id, hook in self._hooks["forward_hooks"].items():
            extra = (kwargs,) if hook_id in with_kwargs else ()
            _call(hook, "forward_hooks", module, args, *extra, output)

    def before_backward(self, module: nn.Module, grad_outputs: tuple) -> None:
        for hook in self._hooks["backward_pre_hooks"].values():
            _call(hook, "backward_pre_hooks", module, grad_outputs)

    def after_backward(self, module: nn.Module, grad_inputs: tuple, grad_outputs: tuple) -> None:
        for hook in self._hooks["backward_hooks"].values():
            _call(hook, "backward_hooks", module, grad_inputs, grad_outputs)


def _call(hook: Callable, key: str, module: nn.Module, *rest) -> None:
    """hook(module, *rest), or hook(module) where the hook takes the module alone."""
    value = hook(module) if _takes_module_only(hook) else hook(module, *rest)
    if value is not None:
        raise RuntimeError(
            f"capture_time_hooks {key} must return None: arguments, outputs and gradients "
            "cannot be replaced through a capture-time hook"
        )


def _takes_module_only(hook: Callable) -> bool:
    """Whether `hook` takes exactly one positional argument (no *args)."""
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the full form
        return False
    positional = [
        p for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]  # fmt: skip
    return len(positional) == 1 and positional[0].kind != inspect.Parameter.VAR_POSITIONAL


def capture_hooks(hooks: Sequence | None, num_callables: int) -> list[CaptureHooks]:
    """One CaptureHooks per callable from capture_time_hooks (None, or a list with one dict
    or None per callable), checked: TypeError / ValueError naming what is wrong."""
    if hooks is None:
        return [CaptureHooks() for _ in range(num_callables)]
    if not isinstance(hooks, Sequence) or isinstance(hooks, str | Mapping):
        raise TypeError(
            f"capture_time_hooks must be a list (one entry per callable), got {hooks!r}"
        )
    if len(hooks) != num_callables:
        raise ValueError(
            f"capture_time_hooks has {len(hooks)} entries for {num_callables} callables"
        )
    return [CaptureHooks(_checked(entry, i)) for i, entry in enumerate(hooks)]


def _checked(entry, index: int) -> Mapping | None:
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise TypeError(
            f"capture_time_hooks[{index}] must be a dict or None, got {type(entry).__name__}"
        )
    unknown = sorted(set(entry) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"capture_time_hooks[{index}] has unknown keys {unknown}; the keys are {list(_KEYS)}"
        )
    for key, value in entry.items():
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(
                f"capture_time_hooks[{index}][{key!r}] must be a dict (hook id -> hook), got "
                f"{type(value).__name__}"
            )
        if key not in _WITH_KWARGS:
            for hook_id, hook in (value or {}).items():
                _check_callable(hook, f"capture_time_hooks[{index}][{key!r}][{hook_id!r}]")
    return entry


def _check_callable(hook: Callable, name: str) -> None:
    if not callable(hook):
        raise TypeError(f"{name} must be callable, got {type(hook).__name__}")
