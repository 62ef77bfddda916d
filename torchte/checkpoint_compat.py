"""State dicts that Transformer Engine loads: `export_transformer_engine_state_dict`.

torchte's state_dict keeps a te module's FP8 scaling state (`_extra_state`) as a dict of
tensors, which torch.distributed.checkpoint and FSDP2 shard and load without pickle; that stays
the default. Transformer Engine keeps it as a uint8 tensor of pickled bytes, which torchte's
modules read as they are (load_state_dict). This module writes the other way: the same
state_dict with every te module's `_extra_state` in Transformer Engine's form (see
module/_te_extra_state.py for the format and the column layouts).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .module._te_extra_state import is_te_extra_state, to_te_extra_state
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
    reads; the other entries are the same objects.

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
    or "norm" for each te norm."""
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        key = f"{name}.{_EXTRA}" if name else _EXTRA
        if isinstance(module, _MODULES):
            label = f"te.{type(module).__name__} {name or '(the model)'}"
            found[key] = (label, module.num_gemms, module._slot_major)
        elif isinstance(module, (LayerNorm, RMSNorm)):
            found[key] = "norm"
    return found


def _exported(key: str, value: Any, state_dict: Mapping, modules: dict | None, recipe) -> Any:
    """The Transformer Engine form of the extra state `value` under `key`."""
    if is_te_extra_state(value) or not isinstance(value, dict):
        return value  # already Transformer Engine's, or not a te module's state
    layout = _layout(key, value, state_dict) if modules is None else modules.get(key)
    if not isinstance(layout, tuple):
        if value:
            raise NotImplementedError(
                f"{key}: this FP8 scaling state is not a te GEMM module's (a te.ops operation's, "
                "whose Transformer Engine format is per operation); exporting it is not "
                "implemented: export the model without FP8 state in its te.ops operations"
            )
        return torch.empty(0, dtype=torch.uint8)
    name, num_gemms, slot_major = layout
    return to_te_extra_state(value, name, num_gemms, slot_major, recipe)


def _layout(key: str, value: dict, state_dict: Mapping) -> tuple[str, int | None, bool]:
    """(name, num_gemms, slot_major) of the module of `key` in a bare state_dict, told from its
    parameters when it has several GEMMs."""
    prefix = key[: -len(_EXTRA)]
    scale = value.get("fwd_scale")
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
