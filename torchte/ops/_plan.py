"""Planning a run of basic ops: which fusions replace which ops, forward and backward.

torchte's own fusions (ops/fused/__init__.py) are matchers over [(op, indices of its basic
ops)]. Fusions registered by users (Transformer Engine's register_forward_fusion,
register_backward_fusion, register_forward_backward_fusion) are functions
`func(ops, *, recipe) -> ops` over the list of ops (basic or fused), which return it with runs
replaced by FusedOperations holding those basic ops, in order. Passes, as in Transformer
Engine: the joint (forward and backward) fusions first, on the basic ops; then, from their
result, forward and backward separately: the user's prepended fusions, torchte's, the user's
others. The result of each user fusion is checked against the run's basic ops (RuntimeError
naming both lists where it does not cover them exactly, in order).

Steps whose op has Transformer Engine's signatures become TEStyleSteps (_te_signatures.py).
"""

from __future__ import annotations

from .op import RunSettings

__all__ = [
    "BACKWARD_FUNCTIONS",
    "FORWARD_BACKWARD_FUNCTIONS",
    "FORWARD_FUNCTIONS",
    "plan",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
]

FORWARD_BACKWARD_FUNCTIONS: list = []
FORWARD_FUNCTIONS: list = []
BACKWARD_FUNCTIONS: list = []
_PREPENDED: set[int] = set()  # ids of the functions registered with prepend=True


def _register(functions: list, func, prepend: bool) -> None:
    if not callable(func):
        raise TypeError(f"te.ops: a fusion is a function func(ops, *, recipe), got {func!r}")
    if prepend:
        functions.insert(0, func)
        _PREPENDED.add(id(func))
    else:
        functions.append(func)


def register_forward_fusion(op_fusion_func, prepend: bool = False) -> None:
    """Add a forward-only fusion `func(ops, *, recipe) -> ops`: its fused ops' fuser_forward
    fills each basic op's context as the op's own forward would (backward fuses on its own).
    prepend: run it before torchte's fusions and the other registered ones."""
    _register(FORWARD_FUNCTIONS, op_fusion_func, prepend)


def register_backward_fusion(op_fusion_func, prepend: bool = False) -> None:
    """Add a backward-only fusion `func(ops, *, recipe) -> ops`: its fused ops' fuser_backward
    reads the contexts the basic ops' (or a forward fusion's) forward filled."""
    _register(BACKWARD_FUNCTIONS, op_fusion_func, prepend)


def register_forward_backward_fusion(op_fusion_func, prepend: bool = False) -> None:
    """Add a joint fusion `func(ops, *, recipe) -> ops`: its fused ops run both directions
    (their forward may save what only their backward reads); applied before the others."""
    _register(FORWARD_BACKWARD_FUNCTIONS, op_fusion_func, prepend)


def plan(ops: list, settings: RunSettings, forward_fusions, backward_fusions) -> tuple[list, list]:
    """(forward steps, backward steps) of the basic ops `ops` under settings, with torchte's
    fusions (matchers) of each direction; each step is (op, indices of its basic ops). No
    backward steps where no backward runs."""
    from ._te_signatures import TEStyleStep, te_style

    recipe = settings.recipe if settings.fp8 else None
    basic_steps = [(op, [i]) for i, op in enumerate(ops)]
    joint = _steps(ops, _apply(basic_steps, ops, FORWARD_BACKWARD_FUNCTIONS, recipe))
    forward = _direction(joint, ops, forward_fusions, FORWARD_FUNCTIONS, settings, recipe)
    backward = []
    if settings.requires_grad:
        backward = _direction(joint, ops, backward_fusions, BACKWARD_FUNCTIONS, settings, recipe)

    def wrap(steps):
        return [
            (TEStyleStep(op, ops, idx, settings) if te_style(type(op)) != (None, None) else op, idx)
            for op, idx in steps
        ]

    return wrap(forward), wrap(backward)


def _direction(steps, ops, builtin, registered: list, settings, recipe) -> list:
    first = [f for f in registered if id(f) in _PREPENDED]
    steps = _steps(ops, _apply(steps, ops, first, recipe))
    for fusion in builtin:
        steps = fusion(steps, settings)
    last = [f for f in registered if id(f) not in _PREPENDED]
    return _steps(ops, _apply(steps, ops, last, recipe))


def _apply(steps: list, ops: list, functions: list, recipe) -> list:
    """The ops of `steps` after each registered function in turn (the steps' ops if none)."""
    fused = [op for op, _ in steps]
    for func in functions:
        fused = list(func(fused, recipe=recipe))
    return fused


def _steps(basic_ops: list, fused: list) -> list:
    """[(op, indices of its basic ops)] of a list of ops covering basic_ops exactly, in
    order; RuntimeError where it does not."""
    out, next_index = [], 0
    for op in fused:
        covered = op.basic_ops if op.is_fused_op else [op]
        indices = list(range(next_index, next_index + len(covered)))
        if not covered or indices[-1] >= len(basic_ops):
            _mismatch(basic_ops, fused)
        if any(b is not basic_ops[i] for b, i in zip(covered, indices, strict=True)):
            _mismatch(basic_ops, fused)
        out.append((op, indices))
        next_index += len(covered)
    if next_index != len(basic_ops):
        _mismatch(basic_ops, fused)
    return out


def _mismatch(basic_ops: list, fused: list):
    raise RuntimeError(
        "te.ops: a fusion returned ops that do not cover the run's basic ops in order "
        f"(basic ops {[type(o).__name__ for o in basic_ops]}, "
        f"after the fusion {[type(o).__name__ for o in fused]})"
    )
