"""te.ops.Linear: y = x W^T + b as two basic ops, BasicLinear then Bias, which the fuser
computes as one GEMM with the bias in its epilogue (ops/fused/linear_bias.py).

The module shows the two ops' parameters as its own `weight` and `bias` (Transformer Engine's
names) and passes moves and extra state through to them. With tensor parallelism the
BasicLinear runs the collectives; the bias is this rank's part of the output (column), or the
whole bias added once after the reduction (row: unlike Transformer Engine's te.ops.Linear,
whose ranks each add a bias before the reduction, so that their sum is the layer's bias).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .basic_linear import BasicLinear
from .bias import Bias

__all__ = ["Linear"]


class Linear(nn.Module):
    """y = x W^T + b (see BasicLinear and Bias); `basic_ops` are what a Sequential runs."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        tensor_parallel_mode: str | None = None,
        tensor_parallel_group=None,
        sequence_parallel: bool = False,
        rng_state_tracker_function: Callable | None = None,
        accumulate_into_main_grad: bool = False,
        userbuffers_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        linear = BasicLinear(
            in_features, out_features, device=device, dtype=dtype,
            tensor_parallel_mode=tensor_parallel_mode, tensor_parallel_group=tensor_parallel_group,
            sequence_parallel=sequence_parallel,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=accumulate_into_main_grad,
            userbuffers_options=userbuffers_options,
        )  # fmt: skip
        ops: list[nn.Module] = [linear]
        if bias:
            column = linear.tensor_parallel_mode == "column"
            bias_op = Bias(
                out_features, device=device, dtype=linear.params_dtype,
                tensor_parallel=column, tensor_parallel_group=linear.tensor_parallel_group,
            )  # fmt: skip
            ops.append(bias_op)
        # A plain list, not submodules: the parameters are this module's (weight, bias).
        self.__dict__["basic_ops"] = ops
        self.in_features, self.out_features = in_features, out_features
        self._register_op_parameters()

    def _register_op_parameters(self) -> None:
        ops = self.basic_ops
        self.register_parameter("weight", ops[0].weight)
        self.register_parameter("bias", ops[1].bias if len(ops) > 1 else None)

    def sync_op_parameters(self) -> None:
        """Hand this module's `weight` and `bias` to the ops again where something replaced
        them here (torch.func.functional_call and load_state_dict(assign=True) swap this
        module's entries, not the ops'): a few identity checks per call."""
        params, ops = self._parameters, self.basic_ops
        weight = params["weight"]
        if weight.is_meta and not ops[0]._parameters["weight"].is_meta:
            self._register_op_parameters()  # the ops were given parameters: show them
            return
        if weight.is_meta:  # never given values: made on the default device (as the ops do)
            self.reset_parameters()
            return
        if ops[0]._parameters["weight"] is not weight:
            ops[0]._parameters["weight"] = weight
        if len(ops) > 1 and ops[1]._parameters["bias"] is not params["bias"]:
            ops[1]._parameters["bias"] = params["bias"]

    def _apply(self, fn, recurse: bool = True):
        # The ops own the parameters and the FP8 state: they move, then are shown again.
        for op in self.basic_ops:
            op._apply(fn, recurse)
        self._register_op_parameters()
        return self

    def train(self, mode: bool = True) -> Linear:
        for op in self.basic_ops:
            op.train(mode)
        return super().train(mode)

    def get_extra_state(self) -> torch.Tensor:
        return self.basic_ops[0].get_extra_state()

    def set_extra_state(self, state: Any) -> None:
        self.basic_ops[0].set_extra_state(state)

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """The ops' reset_parameters (parameters on the meta device are made first)."""
        for op in self.basic_ops:
            op.reset_parameters(defer_init)
        self._register_op_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features)."""
        from ..sequential import Sequential

        self.sync_op_parameters()
        return Sequential._run_ops(self.basic_ops, x, ())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={len(self.basic_ops) > 1}"
        )
