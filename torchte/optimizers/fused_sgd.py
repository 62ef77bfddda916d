"""FusedSGD: Transformer Engine's SGD (momentum, dampening, Nesterov, weight decay), on torch's
fused SGD kernel through `multi_tensor_sgd`.

As in Transformer Engine (and torch.optim.SGD): with momentum, buf = grad at the first step,
then buf = momentum * buf + (1 - dampening) * grad; the update is lr * buf (or lr * (grad +
momentum * buf) with Nesterov). Weight decay adds wd * w to the gradient before the momentum,
or after it with `wd_after_momentum=True`. Params of any float dtype (fp32, bf16, fp16; bf16 is
skipped by Transformer Engine's, updated here) are updated in fp32 math; a momentum buffer has
its param's dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import required

from ._lists import FLOAT_DTYPES, local_tensor
from .multi_tensor import multi_tensor_applier, multi_tensor_sgd

__all__ = ["FusedSGD"]


class FusedSGD(torch.optim.Optimizer):
    """SGD with momentum, Transformer Engine's `te.optimizers.FusedSGD`, a drop-in
    replacement for torch.optim.SGD.

    Arguments: params, lr (required), momentum=0, dampening=0, weight_decay=0, nesterov=False,
    and keyword-only wd_after_momentum=False, materialize_master_grads=True (kept for apex
    amp's master params, which torchte does not have), set_grad_none (deprecated). Every param
    gets a momentum buffer (as Transformer Engine's does, also without momentum).
    `most_recent_scale`: the gradients are multiplied by 1 / most_recent_scale (reset to 1
    after each step).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float | Any = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool | None = None,
    ) -> None:
        if lr is not required and not float(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr} (FusedSGD: lr must be >= 0)")
        if not float(momentum) >= 0.0:
            raise ValueError(f"Invalid momentum value: {momentum} (FusedSGD: must be >= 0)")
        if not float(weight_decay) >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (FusedSGD: must be >= 0)")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        first = [g["params"][0] for g in self.param_groups if g["params"]]
        device = local_tensor(first[0]).device if first else torch.device("cpu")
        # Always 0: the SGD update is never skipped by this optimizer.
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.multi_tensor_sgd = multi_tensor_sgd
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn(
                "set_grad_none kwarg in FusedSGD constructor is deprecated. "
                "Use set_to_none kwarg in zero_grad instead.",
                DeprecationWarning,
                stacklevel=2,
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Reset the gradients: to None (default, or the deprecated set_grad_none) or zeros."""
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(
                    f"Called zero_grad with set_to_none={set_to_none}, but FusedSGD was "
                    f"initialized with set_grad_none={self.set_grad_none}"
                )
            set_to_none = self.set_grad_none
        super().zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    def get_momentums(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
        """(momentum buffers of params, made (zeros) where missing; whether the last param's
        buffer was just made) - Transformer Engine's helper, kept for its callers."""
        momentums = []
        first_run = True
        for p in params:
            state = self.state[p]
            first_run = "momentum_buffer" not in state
            if first_run:
                state["momentum_buffer"] = torch.zeros_like(p.detach())
            momentums.append(state["momentum_buffer"])
        return momentums, first_run

    @torch.no_grad()
    def step(self, closure=None):
        """One SGD step of every param with a gradient; returns closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        """One call per (param dtype, first step or not) of the group's params with grads."""
        launches: dict[tuple[torch.dtype, bool], list[list[torch.Tensor]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedSGD does not support sparse gradients.")
            if p.dtype not in FLOAT_DTYPES:
                raise RuntimeError(f"FusedSGD supports fp32, bf16 and fp16 params, got {p.dtype}")
            state = self.state[p]
            first_run = "momentum_buffer" not in state
            if first_run:
                state["momentum_buffer"] = torch.zeros_like(p.detach())
            lists = launches.setdefault((p.dtype, first_run), [[], [], []])
            lists[0].append(p.grad)
            lists[1].append(p.detach())
            lists[2].append(state["momentum_buffer"])
        for (_, first_run), lists in launches.items():
            multi_tensor_applier(
                self.multi_tensor_sgd,
                self._dummy_overflow_buf,
                lists,
                group["weight_decay"],
                group["momentum"],
                group["dampening"],
                group["lr"],
                group["nesterov"],
                first_run,
                self.wd_after_momentum,
                1.0 / self.most_recent_scale,
            )
