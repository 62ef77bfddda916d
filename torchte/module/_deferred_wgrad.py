"""Deferred weight gradients (delay_wgrad_compute=True, as in Transformer Engine).

A pipeline schedule (zero-bubble, Megatron-Core's delay_wgrad_compute) splits a layer's backward
in two: the autograd backward makes the input gradient only, so it reaches the previous stage
sooner, and `module.backward_dw()` later runs the weight-gradient GEMMs it left behind.

Here a module with delay_wgrad_compute owns one `WgradStore`. Its backward puts each weight
gradient GEMM it would have run, as a closure over the saved operands (the GEMM input's
columnwise FP8 bytes or high-precision values, the output gradient), into the store; one entry
per backward call, holding all of the call's GEMMs (LayerNormMLP has two). backward_dw takes the
oldest entry and runs it: with fuse_wgrad_accumulation into each weight's main_grad (as the
backward would have, same `is_first_microbatch` rule), otherwise into the weights' `.grad`
(added to what is there, as autograd accumulates). Bias gradients are made in the backward
itself. The operands stay alive until backward_dw: that memory is the price of the overlap.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch

__all__ = ["ALL_GROUPS", "WgradStore", "add_to_grads", "group_wgrads", "run_deferred"]

ALL_GROUPS = -1
"""The GEMM number of a deferred step that makes every group's weight gradient at once (a
grouped module's grouped wgrad GEMM): its result is the list of the G gradients."""

WgradStep = Callable[[], "torch.Tensor | None"]
"""A deferred weight-gradient GEMM: returns the gradient, or None once added to main_grad."""


class WgradStore:
    """The weight-gradient GEMMs one module's backward calls deferred, oldest call first."""

    __slots__ = ("_entries", "_open")

    def __init__(self) -> None:
        self._entries: deque[list[tuple[int, WgradStep]]] = deque()
        self._open: list[tuple[int, WgradStep]] | None = None

    @contextlib.contextmanager
    def one_backward(self) -> Iterator[None]:
        """Within: every put joins one entry (a backward that defers several GEMMs). An
        exception drops the steps put so far (the backward failed; nothing is left half)."""
        entry: list[tuple[int, WgradStep]] = []
        self._open = entry
        try:
            yield
        finally:
            self._open = None
        if entry:
            self._entries.append(entry)

    def put(self, gemm: int, step: WgradStep) -> None:
        """Defer GEMM number `gemm`'s weight gradient (its own entry outside one_backward)."""
        if self._open is not None:
            self._open.append((gemm, step))
        else:
            self._entries.append([(gemm, step)])

    def pop(self) -> list[tuple[int, WgradStep]] | None:
        """The oldest backward's deferred GEMMs (None when none is waiting)."""
        return self._entries.popleft() if self._entries else None

    def __len__(self) -> int:
        """How many backward calls wait for backward_dw."""
        return len(self._entries)

    def clear(self) -> None:
        """Drop every deferred GEMM (and the operands they hold)."""
        self._entries.clear()


def add_to_grads(params: list[torch.nn.Parameter], wgrad: torch.Tensor) -> None:
    """Add wgrad (rows of all params stacked along dim 0) to the params' .grad, as autograd
    would (the first gradient is set, later ones added)."""
    start = 0
    for param in params:
        rows = param.shape[0]
        part = wgrad if len(params) == 1 else wgrad[start : start + rows]
        start += rows
        if part.dtype != param.dtype:
            part = part.to(param.dtype)
        if param.grad is None:
            param.grad = part.detach()
        else:
            param.grad.add_(part)


def run_deferred(
    store: WgradStore | None,
    take: Callable[[int, torch.Tensor | list], None],
    hooks: list[Callable[[], None]],
) -> None:
    """backward_dw: run the oldest deferred entry of `store` (nothing when none waits), hand
    each GEMM's gradient to take(gemm, wgrad) (a step that filled main_grad hands none), then
    call the hooks."""
    entry = None if store is None else store.pop()
    if entry is None:
        return
    with torch.no_grad():
        for gemm, step in entry:
            wgrad = step()
            if wgrad is not None:
                take(gemm, wgrad)
    for hook in hooks:
        hook()


def group_wgrads(ctx, compute: Callable[[], list], device: torch.device) -> list:
    """The G weight gradients a grouped Function's backward gives autograd: compute()'s, or
    with delay_wgrad_compute compute put into the store as one ALL_GROUPS step and, for now,
    None per group (with fused wgrad accumulation the dummies that mark the weights, as the
    GEMMs into main_grad would give). ctx: the grouped Function's (plan.gemms, weight_grads,
    weight_dtype)."""
    gemms = ctx.plan.gemms
    store = gemms[0].wgrad_store
    if store is None:
        return compute()
    if gemms[0].main_grad is None:
        store.put(ALL_GROUPS, compute)
        return [None] * len(gemms)
    store.put(ALL_GROUPS, lambda: compute() and None)  # into main_grad: nothing to hand out
    dws = []
    for g, gemm in enumerate(gemms):
        ((param, _, _),) = gemm.main_grad.params()
        dummy = gemm.main_grad.finish(param.shape, ctx.weight_dtype, device)
        dws.append(dummy if ctx.weight_grads[g] else None)
    return dws
