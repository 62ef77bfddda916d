"""The training example's optimizer: torch's AdamW whose step also clips the gradients' global
norm, both fused on a GPU.

`ClippedAdamW` is torch.optim.AdamW (same hyperparameters, same state, same state_dict, so
checkpoints carry over either way) with one more method, `clip_and_step(max_norm)`. On a CUDA
device, with fp32 parameters and plain (not DTensor) gradients, it runs two Triton launches
over all the gradients (kernels/adamw.py): their global L2 norm, then AdamW with each gradient
multiplied by the clipping factor as it is read. torch.nn.utils.clip_grad_norm_ followed by
AdamW.step reads the gradients three times and writes them once (the factor multiplied in
place); at the example's 2000M parameters on an H200 that is 5 ms of a 120 ms step
(docs/benchmarks.md). Elsewhere (the CPU, FSDP's DTensors, tensor parallelism, whose norm
sums over ranks) `clip` runs first and torch's step after it.

A model sharded by FSDP2 (`clip_and_step(..., shard_group=)`: every parameter a DTensor split
along its first dimension over the group's ranks, or a plain one of this rank's own, marked as
Megatron-Core marks experts, `allreduce = False`) steps on this rank's pieces: the pieces'
sums of squares, summed over the group by one all-reduce, make the global norm, and AdamW runs
over the local pieces of the parameters, gradients and moments (the moments stay DTensors in
the state, as torch's AdamW keeps them, so distributed checkpoints save them alike). On a GPU
that is the same two launches; on the CPU the kernels' torch references run instead, so the
path is the same on both. DTensor's dispatch of torch's clip and step (a sharding decision per
operation and tensor) is the host time this saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from torchte.distributed.fsdp import FP8GatheredWeight
from torchte.kernels import adamw

from .ep_run import is_expert

__all__ = ["ClippedAdamW", "clip_factor"]

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)): what clip_grad_norm_ multiplies the gradients by."""
    return (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)


class ClippedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW plus `clip_and_step` (the module docstring says how it runs)."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self._host_step: int | None = None  # steps taken, known without reading the device
        self.fused_steps = 0  # clip_and_step calls that took the fused path

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._host_step = None  # read from the loaded state at the next fused step

    def clip_and_step(
        self,
        max_norm: float,
        clip: Callable[[list, float], object],
        shard_group=None,
        split_group=None,
    ) -> None:
        """Scale the gradients to a global norm of at most `max_norm`, then take one AdamW
        step. Without `shard_group`, every gradient is whole on this process (no
        tensor-parallel or sharded pieces); with it, every parameter is an FSDP2 DTensor
        sharded over that group (see the module docstring), and with `split_group` too (FSDP
        over tensor-parallel pieces, 2-D) the pieces' squares (parameters marked
        `tensor_model_parallel`) are summed over split_group first, the others being the same
        on each of its ranks. `clip(params, max_norm)` (torch.nn.utils.clip_grad_norm_, or
        one that knows the pieces) clips them in place where the fused path does not apply,
        and torch's step follows."""
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        fusable = self._fusable(params) if shard_group is None else self._shards_fusable(params)
        if not fusable:
            clip(params, max_norm)
            self.step()
            self._host_step = None  # torch's step counted it on the device
            return
        kernels = _Kernels(params[0].is_cuda)
        squares = self._sum_squares(params, kernels, split_group)
        if shard_group is not None:
            dist.all_reduce(squares, group=shard_group)
        factor = clip_factor(squares.sqrt(), max_norm)
        step = self._next_step(params)
        for group in self.param_groups:
            self._group_step(group, step, factor, kernels)
        self.fused_steps += 1

    @staticmethod
    def _sum_squares(params: list[torch.Tensor], kernels, split_group) -> torch.Tensor:
        """The squares of this rank's gradient pieces, those of tensor-parallel pieces summed
        over split_group (where given) first."""
        grads = [_local(p.grad) for p in params]
        if split_group is None:
            return kernels.sum_squares(grads)
        split = [getattr(p, "tensor_model_parallel", False) for p in params]
        parts = []
        for wanted in (True, False):
            chosen = [g for g, s in zip(grads, split, strict=True) if s == wanted]
            zero = torch.zeros((), dtype=torch.float32, device=grads[0].device)
            parts.append(kernels.sum_squares(chosen) if chosen else zero)
        dist.all_reduce(parts[0], group=split_group)
        return parts[0] + parts[1]

    def _fusable(self, params: list[torch.Tensor]) -> bool:
        grads = [p.grad for p in params]
        if not all(p.is_cuda and p.dtype == torch.float32 for p in params):
            return False
        if any(isinstance(t, DTensor) for t in (*params, *grads)):
            return False
        return self._plain_update(params, grads)

    def _shards_fusable(self, params: list[torch.Tensor]) -> bool:
        """Whether every parameter and gradient is a DTensor sharded along dim 0 over one 1-D
        mesh (FSDP2's layout), or a parameter of this rank's own (Megatron-Core's
        `allreduce = False`: expert parallelism's experts, left out of FSDP) with a plain
        gradient, and the kernels take the local pieces."""
        sharded = [p for p in params if isinstance(p, DTensor)]
        tensors = (*sharded, *(p.grad for p in sharded))
        if not all(isinstance(t, DTensor) and t.placements == (Shard(0),) for t in tensors):
            return False
        own = [p for p in params if not isinstance(p, DTensor)]
        if not all(is_expert(p) and not isinstance(p.grad, DTensor) for p in own):
            return False
        if len({t.device_mesh for t in tensors}) > 1 or len({p.is_cuda for p in params}) != 1:
            return False
        grads = [p.grad for p in params]
        local = [_local(p) for p in params]
        if not all(p.dtype == torch.float32 for p in local):
            return False
        return self._plain_update(local, [_local(g) for g in grads])

    def _plain_update(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        """Whether the kernels take these (local) tensors and the groups' options."""
        if not all(t.is_contiguous() for t in (*params, *grads)):
            return False
        if not adamw.grads_supported(grads):
            return False
        plain = ("amsgrad", "maximize", "capturable", "differentiable")
        return not any(g[k] for g in self.param_groups for k in plain) and not any(
            torch.is_tensor(g["lr"]) for g in self.param_groups
        )

    def _next_step(self, params: list[torch.Tensor]) -> int:
        """The step count after this step (1-based), kept on the host; read from the state
        once after construction or a load (one sync)."""
        if self._host_step is None:
            state = self.state.get(params[0], {})
            self._host_step = int(state["step"].item()) if "step" in state else 0
        self._host_step += 1
        return self._host_step

    def _group_step(self, group: dict, step: int, factor: torch.Tensor, kernels) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        steps, exp_avgs, exp_avg_sqs = [], [], []
        for p in params:
            state = self.state[p]
            if not state:  # as torch's fused AdamW makes it: the step a device fp32 scalar
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            steps.append(state["step"])
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = group["betas"]
        hyper = adamw.AdamWStep(
            group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step
        )
        local = [_local(p) for p in params]
        grads = [_local(p.grad) for p in params]
        with torch.no_grad():  # the parameters are leaves that require grad
            kernels.step_(local, grads, exp_avgs, exp_avg_sqs, hyper, factor)
        # Written through their addresses: in-place as far as version counters tell (FP8
        # weight caches and te.fsdp's agreed scales key on them).
        torch.autograd.graph.increment_version(local)


class _Kernels:
    """The fused path's two passes: the Triton kernels on a GPU, their torch references
    (the same math in the same order) on the CPU."""

    __slots__ = ("step_", "sum_squares")

    def __init__(self, cuda: bool) -> None:
        if cuda:
            self.sum_squares, self.step_ = adamw.grad_sum_squares, adamw.adamw_step_
        else:
            self.sum_squares = adamw.grad_sum_squares_reference
            self.step_ = adamw.adamw_step_reference_


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's elements of t: a DTensor's local piece, the master
    data of an FP8-gathered weight (te.fsdp), else t itself."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t._data if isinstance(t, FP8GatheredWeight) else t
