"""Operations written against Transformer Engine's op API, run by torchte's fuser.

A user's BasicOperation or FusedOperation may define Transformer Engine's methods instead of
torchte's:
  op_forward(ctx, input_, *, prev_op_grad_output_quantizer, next_op_input_quantizer, **kwargs)
      -> y                          (2.6: prev_op_grad_input_quantizer; 2.0-2.5: prev_op, next_op)
  op_backward(ctx, grad_output) -> (dx, param grads)
  fuser_forward(ctxs, x, *, basic_op_extra_inputs, prev_op_grad_output_quantizer,
                next_op_input_quantizer, basic_op_kwargs) -> (y, extra outputs per op)
                                    (2.0-2.5: basic_op_prev_ops, basic_op_next_ops)
  fuser_backward(ctxs, dy, *, basic_op_grad_extra_outputs)
      -> (dx, param grads per op, extra input grads per op)
Which ones a class defines is read from the signatures once per class. When the fuser plans a
run it puts a TEStyleStep, which takes torchte's arguments, in place of such an op; the
neighbours' quantizers are looked up then, once per setting, so a call pays nothing extra.
"""

from __future__ import annotations

import inspect

from .op import BasicOperation, RunSettings

__all__ = ["TEStyleStep", "te_style"]

_NEIGHBOUR_ARGS = frozenset(
    {
        "prev_op_grad_output_quantizer",
        "prev_op_grad_input_quantizer",
        "next_op_input_quantizer",
        "prev_op",
        "next_op",
        "basic_op_prev_ops",
        "basic_op_next_ops",
    }
)


def _parameters(function) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(function).parameters)


_STYLES: dict[type, tuple[str | None, str | None]] = {}


def te_style(cls: type) -> tuple[str | None, str | None]:
    """(forward, backward) of an op class: "fuser" where its fuser_forward / fuser_backward has
    Transformer Engine's signature, "op" where (a basic op) its op_forward / op_backward has,
    None where torchte's are used (read once per class)."""
    style = _STYLES.get(cls)
    if style is None:
        style = _STYLES[cls] = _read_style(cls)
    return style


def _read_style(cls: type) -> tuple[str | None, str | None]:
    forward = backward = None
    if "basic_op_extra_inputs" in _parameters(cls.fuser_forward):
        forward = "fuser"
    elif issubclass(cls, BasicOperation) and _te_op_forward(cls.op_forward):
        forward = "op"
    if "basic_op_grad_extra_outputs" in _parameters(cls.fuser_backward):
        backward = "fuser"
    elif issubclass(cls, BasicOperation) and _te_op_backward(cls.op_backward):
        backward = "op"
    return forward, backward


def _te_op_forward(function) -> bool:
    params = _parameters(function)
    if _NEIGHBOUR_ARGS & params.keys():
        return True
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return var_keyword and "settings" not in params


def _te_op_backward(function) -> bool:
    params = [p for p in _parameters(function).values() if p.name != "self"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 2


def _neighbour_kwargs(function, ops: list, indices: list[int], settings: RunSettings) -> dict:
    """The neighbour arguments `function` takes, for the run's ops around `indices`."""
    recipe = settings.recipe if settings.fp8 else None
    prev_op = ops[indices[0] - 1] if indices[0] > 0 else None
    next_op = ops[indices[-1] + 1] if indices[-1] + 1 < len(ops) else None
    grad_q = _quantizer(prev_op, recipe, "backward")
    values = {
        "prev_op_grad_output_quantizer": grad_q,
        "prev_op_grad_input_quantizer": grad_q,
        "next_op_input_quantizer": _quantizer(next_op, recipe, "forward"),
        "prev_op": prev_op,
        "next_op": next_op,
        "basic_op_prev_ops": [ops[i - 1] if i > 0 else None for i in indices],
        "basic_op_next_ops": [ops[i + 1] if i + 1 < len(ops) else None for i in indices],
    }
    params = _parameters(function)
    return {name: value for name, value in values.items() if name in params}


def _quantizer(op, recipe, mode: str):
    """The op's first quantizer of `mode` under recipe (its input / output-gradient one)."""
    if op is None or recipe is None or not op.num_quantizers(mode):
        return None
    return op.quantizer_under(recipe, mode, 0)


class TEStyleStep:
    """One step of a planned run whose op uses Transformer Engine's signatures, with
    torchte's fuser_forward / fuser_backward."""

    __slots__ = ("backward", "forward", "forward_kwargs", "op", "params")

    def __init__(self, op, ops: list, indices: list[int], settings: RunSettings) -> None:
        self.op = op
        self.forward, self.backward = te_style(type(op))
        function = op.fuser_forward if self.forward == "fuser" else op.op_forward
        self.forward_kwargs = _neighbour_kwargs(function, ops, indices, settings)
        self.params = [ops[i].op_parameters() for i in indices]

    def fuser_forward(self, ctxs, x, extra_inputs, settings):
        for ctx, params, extra in zip(ctxs, self.params, extra_inputs, strict=True):
            ctx.requires_grad = settings.requires_grad and (
                ctx.input_requires_grad
                or any(p.requires_grad for p in params)
                or any(getattr(t, "requires_grad", False) for t in extra)
            )
        if self.forward is None:
            return self.op.fuser_forward(ctxs, x, extra_inputs, settings)
        if self.forward == "op":
            ctx = ctxs[0]
            return self.op.op_forward(ctx, x, **self.forward_kwargs, **ctx.kwargs), [()]
        y, extras = self.op.fuser_forward(
            ctxs,
            x,
            basic_op_extra_inputs=[tuple(e) for e in extra_inputs],
            basic_op_kwargs=[dict(ctx.kwargs) for ctx in ctxs],
            **self.forward_kwargs,
        )
        return y, [() if e is None else tuple(e) for e in extras]

    def fuser_backward(self, ctxs, dy, extra_output_grads):
        if self.backward is None:
            return self.op.fuser_backward(ctxs, dy, extra_output_grads)
        if self.backward == "op":
            dx, param_grads = self.op.op_backward(ctxs[0], dy)
            return dx, [()], [() if param_grads is None else tuple(param_grads)]
        dx, param_grads, extra_grads = self.op.fuser_backward(
            ctxs, dy, basic_op_grad_extra_outputs=[list(g) for g in extra_output_grads]
        )
        extra_grads = [() if e is None else tuple(e) for e in extra_grads]
        return dx, extra_grads, [() if p is None else tuple(p) for p in param_grads]
