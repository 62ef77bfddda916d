"""State dicts that Transformer Engine loads: `export_transformer_engine_state_dict`.

A te module's FP8 scaling state (`_extra_state`) is already in Transformer Engine 2.x's form in
torchte's state_dict (a uint8 tensor of pickled bytes; see module/_te_extra_state.py for the
format and the column layouts). This module writes a whole state_dict for Transformer Engine:
the extra state with a chosen recipe, torchte's older dict form (checkpoints written before)
turned into Transformer Engine's, the norms' entries Transformer Engine's norms carry, and a
clear refusal for te.ops operations, whose Transformer Engine format differs.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .module._te_extra_state import (
    from_te_extra_state,
    is_te_extra_state,
    te_payload_of,
    to_te_extra_state,
)
from .module.grouped_linear import GroupedLinear
from .module.layernorm_linear import LayerNormLinear
from .module.layernorm_mlp import LayerNormMLP
from .module.linear import Linear
from .module.norm import LayerNorm, RMSNorm
from .recipe import Recipe

__all__ = ["export_transformer_engine_state_dict"]

_EXTRA = "_extra_state"
_MODULES = (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear)


def export_transformer_engine_state_dict(
    model: nn.Module | Mapping[str, Any], *, recipe: Recipe | None = None
) -> OrderedDict[str, Any]:
    """`model`'s state_dict (or the state_dict `model` itself) with each te module's
    `_extra_state` in Transformer Engine 2.x's form: a uint8 tensor of pickled bytes (empty
    for a module without delayed-scaling state) that Transformer Engine's `load_state_dict`
    reads, also where a state_dict holds torchte's older dict form; the other entries are the
    same objects.

    recipe: the DelayedScaling written as the state's recipe (its amax_history_len must be the
    saved one); None writes DelayedScaling(amax_history_len=<saved length>).
    Given a module, its te.LayerNorm / te.RMSNorm also get the `_extra_state` entry that
    Transformer Engine's norms (operation-fuser ops) carry. Given a state_dict, the layout of a
    module of several GEMMs is told from its parameters (weight0.. or a 3-D weight: GroupedLinear;
    fc1_weight: LayerNormMLP). A te.ops operation's scaling state has a format of its own,
    which is not written (NotImplementedError); pass it without FP8 state.
    """
    if recipe is not None and not (isinstance(recipe, Recipe) and recipe.delayed()):
        raise ValueError(
            f"recipe must be a torchte.recipe.DelayedScaling (the recipe of the saved "
            f"delayed-scaling state) or None, got {recipe!r}"
        )
    if isinstance(model, nn.Module):
        state_dict, modules = model.state_dict(), _te_modules(model)
    elif isinstance(model, Mapping):
        state_dict, modules = model, None
    else:
        raise TypeError(
            f"model must be an nn.Module or a state_dict (a mapping), got {type(model).__name__}"
        )
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        is_extra = key == _EXTRA or key.endswith("." + _EXTRA)
        out[key] = _exported(key, value, state_dict, modules, recipe) if is_extra else value
    if modules is not None:
        for key, kind in modules.items():
            if kind == "norm" and key not in out:
                out[key] = _no_op_state()
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


def _te_modules(model: nn.Module) -> dict[str, Any]:
    """`_extra_state` key -> (name, num_gemms, slot_major) of each te GEMM module of `model`,
    "norm" for each te norm, "op" for each te.ops operation."""
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        key = f"{name}.{_EXTRA}" if name else _EXTRA
        if isinstance(module, _MODULES):
            label = f"te.{type(module).__name__} {name or '(the model)'}"
            found[key] = (label, module.num_gemms, module._slot_major)
        elif isinstance(module, (LayerNorm, RMSNorm)):
            found[key] = "norm"
        elif type(module).__module__.startswith("torchte.ops."):
            found[key] = "op"
    return found


def _exported(key: str, value: Any, state_dict: Mapping, modules: dict | None, recipe) -> Any:
    """The Transformer Engine form of the extra state `value` under `key` (torchte's uint8
    form, or its older dict form), written with `recipe`."""
    if modules is None:
        if isinstance(value, torch.Tensor) and recipe is None:
            return value  # already Transformer Engine's form
        if not isinstance(value, (dict, torch.Tensor)):
            return value  # not a te module's state
        layout = _layout(key, value, state_dict)
    else:
        layout = modules.get(key)
    if layout == "op" and _holds_state(value):
        raise NotImplementedError(
            f"{key}: this FP8 scaling state is a te.ops operation's, whose Transformer Engine "
            "format is per operation; exporting it is not implemented: export the model "
            "without FP8 state in its te.ops operations"
        )
    if layout == "op":
        return torch.empty(0, dtype=torch.uint8)
    if not isinstance(layout, tuple) or not isinstance(value, (dict, torch.Tensor)):
        return value  # not a te GEMM module's state
    name, num_gemms, slot_major = layout
    if is_te_extra_state(value):
        value = from_te_extra_state(value, name, num_gemms, slot_major) or {}
    return to_te_extra_state(value, name, num_gemms, slot_major, recipe)


def _holds_state(value: Any) -> bool:
    """Whether an extra state (either form) holds anything."""
    return bool(value.numel() if isinstance(value, torch.Tensor) else value)


def _layout(
    key: str, value: dict | torch.Tensor, state_dict: Mapping
) -> tuple[str, int | None, bool]:
    """(name, num_gemms, slot_major) of the module of `key` in a bare state_dict, told from its
    parameters when it has several GEMMs."""
    prefix = key[: -len(_EXTRA)]
    if isinstance(value, torch.Tensor):
        value = te_payload_of(value, key) or {}
    scale = value.get("fwd_scale", value.get("scale_fwd"))
    num_gemms = scale.numel() // 3 if isinstance(scale, torch.Tensor) else None
    weight = state_dict.get(prefix + "weight")
    grouped = prefix + "weight0" in state_dict or (
        isinstance(weight, torch.Tensor) and weight.dim() == 3
    )
    mlp = prefix + "fc1_weight" in state_dict
    if num_gemms is not None and num_gemms > 1 and not (grouped or mlp):
        raise ValueError(
            f"{key}: the state of {num_gemms} GEMMs belongs to neither a GroupedLinear "
            "(weight0..) nor a LayerNormMLP (fc1_weight) of this state_dict, so its column "
            "layout is unknown; pass the model instead of its state_dict"
        )
    return key, num_gemms, grouped


def _no_op_state() -> torch.Tensor:
    """What Transformer Engine's norm (an operation without quantizers) saves: pickled {}."""
    return torch.frombuffer(bytearray(pickle.dumps({})), dtype=torch.uint8)
