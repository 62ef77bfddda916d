"""te.ops.Sequential: a container of operations whose consecutive fusible ops run fused.

    block = te.ops.Sequential(te.ops.RMSNorm(4096), te.ops.Linear(4096, 11008),
                              te.ops.SwiGLU(), te.ops.Linear(5504, 4096), te.ops.AddExtraInput())
    y = block(x, residual)

It holds basic ops, composite ops (te.ops.Linear: BasicLinear then Bias), fused ops (run as
their basic ops) and plain nn.Modules.
Each run of consecutive basic ops is one OperationFuser (one autograd Function); a plain module
runs as itself between runs. Extra inputs are handed to the ops that take them in op order, and
the call returns y alone, or (y, extra outputs in op order) when some op makes one.
`op_kwargs={op or its index: {name: value}}` hands keyword arguments to basic ops (as
Transformer Engine's: e.g. te.ops.GroupedLinear's caller-provided output buffer).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .fuser import OperationFuser
from .op import BasicOperation

__all__ = ["Sequential"]


def _basic_ops(module: nn.Module) -> list[BasicOperation] | None:
    """The basic ops a module stands for (a composite op's, in order); None: not fusible."""
    if isinstance(module, BasicOperation):
        return [module]
    ops = getattr(module, "basic_ops", None)
    return list(ops) if ops is not None else None


class Sequential(nn.Module):
    """Operations applied in order; runs of fusible ops are fused (see the module docstring)."""

    def __init__(self, *args: nn.Module | OrderedDict) -> None:
        super().__init__()
        items = args[0].items() if len(args) == 1 and isinstance(args[0], OrderedDict) else None
        if items is None:
            items = ((str(i), m) for i, m in enumerate(args))
        for name, module in items:
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"te.ops.Sequential takes nn.Modules (operations), got {type(module).__name__}"
                )
            self.add_module(name, module)
        _check_features(list(self._modules.values()))
        self._stages = None

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def append(self, module: nn.Module) -> Sequential:
        """Add an operation at the end."""
        self.add_module(str(len(self._modules)), module)
        _check_features(list(self._modules.values()))
        self.__dict__["_stages"] = None
        return self

    def _build_stages(self) -> list:
        """[OperationFuser | nn.Module] in order, the ops' sizes checked end to end; also the
        composite ops (te.ops.Linear), whose parameters are handed to their ops per call."""
        stages, run = [], []
        self.__dict__["_composites"] = [
            m for m in self._modules.values() if hasattr(m, "sync_op_parameters")
        ]
        for module in self._modules.values():
            ops = _basic_ops(module)
            if ops is None:
                if run:
                    stages.append(OperationFuser(run))
                    run = []
                stages.append(module)
            else:
                run += ops
        if run:
            stages.append(OperationFuser(run))
        return stages

    def _current_stages(self) -> list:
        """The stages, built at the first call after a change (kept in __dict__: no
        nn.Module.__setattr__ per call)."""
        stages = self._stages
        if stages is None:
            stages = self._build_stages()
            self.__dict__["_stages"] = stages
        return stages

    def first_run_settings(self, x: torch.Tensor, requires_grad: bool):
        """The RunSettings the first fused run of ops would call its ops with, for an input like
        x under the current autocast state (what the ops' plans are keyed by), or None when
        the first stage is not a run of ops."""
        stages = self._current_stages()
        first = stages[0] if stages else None
        if not isinstance(first, OperationFuser):
            return None
        return first._pipeline(x, requires_grad).settings

    def forward(
        self,
        x: torch.Tensor,
        *extra_inputs: torch.Tensor,
        op_kwargs: dict[nn.Module | int, dict[str, Any]] | None = None,
    ):
        """x (..., features) and the extra inputs in op order -> y [, extra outputs].
        op_kwargs: keyword arguments per basic op, keyed by the op or its index here."""
        stages = self._current_stages()
        stage_kwargs = self._resolve_op_kwargs(op_kwargs, stages) if op_kwargs else {}
        for composite in self.__dict__["_composites"]:
            composite.sync_op_parameters()
        expected = sum(s.num_extra_inputs for s in stages if isinstance(s, OperationFuser))
        if len(extra_inputs) != expected:
            raise ValueError(
                f"te.ops.Sequential takes {expected} extra input(s) (for the ops that take them, "
                f"in op order), got {len(extra_inputs)}"
            )
        extra_outputs: list[torch.Tensor] = []
        start = 0
        for index, stage in enumerate(stages):
            if isinstance(stage, OperationFuser):
                count = stage.num_extra_inputs
                out = stage(x, extra_inputs[start : start + count], stage_kwargs.get(index))
                start += count
                x = out[0]
                extra_outputs += out[1:]
            else:
                x = stage(x)
        return (x, *extra_outputs) if extra_outputs else x

    def _resolve_op_kwargs(self, op_kwargs: dict, stages: list) -> dict[int, list[dict]]:
        """{stage index: [kwargs of each basic op of that run]} from {op or index: kwargs}:
        ValueError for a key that is no basic op of this Sequential."""
        wanted: dict[int, dict] = {}
        for key, kwargs in op_kwargs.items():
            module = self[key] if isinstance(key, int) else key
            if not isinstance(module, BasicOperation):
                raise ValueError(
                    f"te.ops.Sequential: op_kwargs go to basic operations only, got a key for "
                    f"{type(module).__name__}"
                )
            if not isinstance(kwargs, dict):
                raise TypeError(
                    f"te.ops.Sequential: op_kwargs values must be dicts, got {kwargs!r}"
                )
            wanted[id(module)] = kwargs
        resolved = {}
        for index, stage in enumerate(stages):
            if isinstance(stage, OperationFuser) and any(id(op) in wanted for op in stage.ops):
                resolved[index] = [wanted.pop(id(op), {}) for op in stage.ops]
        if wanted:
            raise ValueError("te.ops.Sequential: op_kwargs has a key for an op not in it")
        return resolved

    @staticmethod
    def _run_ops(
        ops: list[BasicOperation],
        x: torch.Tensor,
        extra_inputs: tuple,
        owner: nn.Module | None = None,
        op_kwargs: list[dict[str, Any]] | None = None,
    ):
        """One op (or a composite or fused op's basic ops) called on its own; its fuser is kept
        on `owner` (default: the first op). op_kwargs: None or a dict per basic op."""
        owner = ops[0] if owner is None else owner
        holder, who = owner.__dict__, type(owner).__name__
        fuser = holder.get("_own_fuser")
        if fuser is None or fuser.ops != ops:
            _check_features(ops)
            fuser = OperationFuser(ops)
            holder["_own_fuser"] = fuser
        if len(extra_inputs) != fuser.num_extra_inputs:
            raise ValueError(
                f"{who} takes {fuser.num_extra_inputs} extra input(s), got {len(extra_inputs)}"
            )
        if op_kwargs is not None and len(op_kwargs) != len(ops):
            raise ValueError(
                f"{who}: basic_op_kwargs needs one dict per basic "
                f"op ({len(ops)}), got {len(op_kwargs)}"
            )
        out = fuser(x, tuple(extra_inputs), op_kwargs)
        return out if len(out) > 1 else out[0]


def _check_features(modules: list[nn.Module]) -> None:
    """ValueError naming the op and its position where an op's input size cannot be what the
    ops before it make (sizes known from the ops' in/out features; a plain module or an op of
    unknown size stops the check until the next op that says its size)."""
    features = None
    for position, module in enumerate(modules):
        for op in _basic_ops(module) or []:
            wanted = getattr(op, "input_features", None)
            if features is not None and wanted is not None and wanted != features:
                raise ValueError(
                    f"te.ops.Sequential: op {position} ({type(module).__name__}) takes "
                    f"{wanted} features, but the ops before it make {features}"
                )
            features = op.output_features(features)
        if _basic_ops(module) is None:
            features = None
