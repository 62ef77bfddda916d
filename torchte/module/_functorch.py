"""te modules under torch.func (grad, vjp, jacrev, functional_call with them).

torch.func runs a custom autograd.Function only if it is written as forward(*args) plus
setup_context(ctx, inputs, output). te's Functions take ctx in forward (what they save depends
on which inputs need gradients), which is also the cheaper form on the hot path. So they keep
it, and `apply` runs them through `FuncAdapter` only while a torch.func transform is active:
the Function's forward runs against a recorder standing in for ctx, and setup_context moves
what it recorded (saved tensors, attributes) onto the real ctx; backward is the Function's own,
run below the transform on the plain gradients (through torch's functorch internals).

While a transform is active the FP8 weight is quantized afresh at each call (a cache would keep
the transform's tensors), as under torch.compile, and inside the adapted forward: a module
passes a `Deferred` quantization, which FuncAdapter runs below the transforms, where the
tensors it reads and makes are plain ones that the kernels (reading data pointers) can take.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._C import _functorch
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

__all__ = ["Deferred", "FuncAdapter", "apply", "plain", "transforms_active"]


def transforms_active() -> bool:
    """Whether a torch.func transform (grad, vjp, vmap, ...) is running."""
    return torch._C._are_functorch_transforms_active()


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a torch.func transform's wrappers (the same values): what a value
    that no gradient flows through, such as an FP8 copy of a weight, is made from, so that
    kernels reading data pointers can take it."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


class Deferred:
    """A value an adapted Function's input stands for, made by `make()` when its forward runs
    (below the transforms). Only ever passed through `apply` while a transform is active."""

    __slots__ = ("make",)

    def __init__(self, make) -> None:
        self.make = make


def apply(function: type[torch.autograd.Function], *args: Any):
    """function.apply(*args), through FuncAdapter where a torch.func transform is running."""
    if not transforms_active():
        return function.apply(*args)
    needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    out = FuncAdapter.apply(*args, function, needs)
    outputs = out[:-1]
    return outputs[0] if len(outputs) == 1 else outputs


class _Recorder:
    """Stands in for ctx while a Function's forward runs under FuncAdapter: it records what
    forward saves and sets, for setup_context to move onto the real ctx."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved: tuple = ()
        self.materialize_grads = True
        self.attributes: dict[str, Any] = {}

    def save_for_backward(self, *tensors) -> None:
        self.saved = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("needs_input_grad", "saved", "materialize_grads", "attributes"):
            object.__setattr__(self, name, value)
        else:
            self.attributes[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["attributes"][name]
        except KeyError:
            raise AttributeError(name) from None


class FuncAdapter(torch.autograd.Function):
    """Runs a ctx-style Function in the forward + setup_context form torch.func needs. Inputs:
    the Function's own inputs, then the Function and the inputs' needs_input_grad; outputs:
    the Function's outputs, then the recorder (not differentiable)."""

    @staticmethod
    def forward(*args):
        *inputs, function, needs = args
        inputs = [a.make() if isinstance(a, Deferred) else a for a in inputs]
        recorder = _Recorder(needs)
        out = function.forward(recorder, *inputs)
        return (*out, recorder) if isinstance(out, tuple) else (out, recorder)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        recorder: _Recorder = output[-1]
        ctx.function = inputs[-2]
        for name, value in recorder.attributes.items():
            setattr(ctx, name, value)
        ctx.save_for_backward(*recorder.saved)
        ctx.set_materialize_grads(recorder.materialize_grads)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise NotImplementedError(
            f"torch.func.vmap over a te module ({args[-2].__name__}) is not supported: its kernels "
            "and FP8 scales work on whole tensors, not per sample; loop over the samples, or "
            "use torch.func.grad / vjp without vmap"
        )

    @staticmethod
    def backward(ctx, *grads):
        # Like the forward, the Function's backward runs below the transform: on the plain
        # gradients, making plain tensors (kernels read their data pointers), and without a
        # graph of itself, as autograd runs a backward; the results are wrapped back. (vjp's
        # pullback runs after its transform returned: no transform is active then.)
        level = None
        if transforms_active():
            interpreter = retrieve_current_functorch_interpreter()
            level = interpreter.level()
            grads = [None if g is None else _functorch._unwrap_for_grad(g, level) for g in grads]
        below = interpreter.lower() if level is not None else contextlib.nullcontext()
        with below, torch.no_grad():
            grads_in = ctx.function.backward(ctx, *grads[:-1])
        if not isinstance(grads_in, tuple):
            grads_in = (grads_in,)
        if level is not None:
            grads_in = [
                None if g is None else _functorch._wrap_for_grad(g, level) for g in grads_in
            ]
        return (*grads_in, None, None)
