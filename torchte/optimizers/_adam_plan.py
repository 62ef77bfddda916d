"""What FusedAdam's step gathers before its update: the lists of each route (`Route`, `Batch`),
and what it keeps from one step to the next (`Entry`).

A param's route and states do not change between steps, only its gradient does; FusedAdam
keeps an Entry per param (its route, the tensors the update reads and writes, whether the
one-launch kernel takes them) and on later steps adds the new gradient to it. An Entry is
used only while the param's stored states are the very tensors it was made from (anything
that replaces one, loading a state dict or set_scaled_state included, makes FusedAdam route
the param again) and the gradient looks as before (dense, of the param's shape, a DTensor
exactly when the param is one); anything else takes FusedAdam's full route, with its errors.
Params whose update works on per-step copies (fp16 / FP8 states), FP8 params and fp32 params
with masters have no Entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchte.kernels.adam_states import takes as kernel_takes

from ._lists import DTensor

__all__ = ["Batch", "Entry", "Route", "kernel_takes"]


@dataclass(slots=True)
class Route:
    """The lists of one update route: grads, the weights the math updates, moments, and
    (per route) the params that receive the result or their int16 remainders; whether the
    one-launch kernel takes all of them."""

    grads: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    remainders: list[torch.Tensor] = field(default_factory=list)
    kernel_ok: bool = True

    def add(self, grad, target, exp_avg, exp_avg_sq, param=None, remainder=None) -> None:
        self.grads.append(grad)
        if target is not None:
            self.targets.append(target)
        self.exp_avgs.append(exp_avg)
        self.exp_avg_sqs.append(exp_avg_sq)
        if param is not None:
            self.params.append(param)
        if remainder is not None:
            self.remainders.append(remainder)
        if self.kernel_ok:
            self.kernel_ok = kernel_takes(grad, target, exp_avg, exp_avg_sq, param)


@dataclass(slots=True)
class Batch:
    """One group's step: the routes, and what to do after the update."""

    direct: Route = field(default_factory=Route)  # params updated in place
    mastered: Route = field(default_factory=Route)  # masters updated, params copy them
    remainder: Route = field(default_factory=Route)  # bf16 params + int16 remainders
    requantize: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    rescale: list[tuple[torch.Tensor, str, torch.Tensor]] = field(default_factory=list)
    sync_masters: list[torch.Tensor] = field(default_factory=list)
    devices: set[torch.device] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class Entry:
    """A param's route kept between steps: the route's name in Batch, the tensors it adds
    beside the gradient, the stored states they came from, and what the gradient must be."""

    route: str
    target: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    param: torch.Tensor | None
    remainder: torch.Tensor | None
    stored: tuple[torch.Tensor, ...]  # the state dict's tensors, in STATE order
    shape: torch.Size
    device: torch.device
    dtensor: bool
    kernel_ok: bool

    def current(self, state: dict) -> bool:
        """Whether the param's stored states are still the ones this entry was made from."""
        stored = self.stored
        if state.get("exp_avg") is not stored[0] or state.get("exp_avg_sq") is not stored[1]:
            return False
        return len(stored) == 2 or state.get("master_param") is stored[2]

    def add(self, grad: torch.Tensor, batch: Batch) -> bool:
        """Add this step's gradient (the param's .grad or .decoupled_grad) to the route; False
        (nothing added) where it does not look as before."""
        if grad.is_sparse or isinstance(grad, DTensor) is not self.dtensor:
            return False
        local = grad._local_tensor if self.dtensor else grad
        if local.shape != self.shape:
            return False
        route = getattr(batch, self.route)
        route.grads.append(local)
        if self.target is not None:
            route.targets.append(self.target)
        route.exp_avgs.append(self.exp_avg)
        route.exp_avg_sqs.append(self.exp_avg_sq)
        if self.param is not None:
            route.params.append(self.param)
        if self.remainder is not None:
            route.remainders.append(self.remainder)
        if route.kernel_ok:
            route.kernel_ok = self.kernel_ok and kernel_takes(local)
        batch.devices.add(self.device)
        return True
