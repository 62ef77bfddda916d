"""A te module's `fp8_meta`, Transformer Engine's per-module dict of FP8 settings and
delayed-scaling state, built from torchte's own state when a client reads it (never by a
forward), a te.ops operation's `_fp8_metas` (the same views, per direction), and the warning a
module gives when its FP8 recipe changes type between forwards.

Keys: "recipe" (the last FP8 forward's, or what a client or a checkpoint set), "fp8_group",
"num_gemms", "fp8_checkpoint", "fp8_max_fwd" / "fp8_max_bwd" (the recipe's format), and under a
delayed-scaling recipe (or none yet, where the module has that state) "scaling_fwd" /
"scaling_bwd": ScalingStateView objects whose `scale` (n,) and `amax_history` (L, n) are the
very tensors of the module's DelayedScalingState of the recipe's history length (n = 3 slots a
GEMM forward, 2 backward, GEMM by GEMM), so that a write through them changes what the next
forward quantizes with.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from torchte.constants import TE_DType
from torchte.quantization.delayed import DelayedScalingState

__all__ = [
    "ScalingStateView",
    "refresh_fp8_meta",
    "refresh_op_fp8_metas",
    "warn_on_recipe_type_change",
]


class ScalingStateView:
    """fp8_meta["scaling_fwd"] / ["scaling_bwd"]: a view of one DelayedScalingState with
    Transformer Engine's attribute names. `scale` and `amax_history` are the state's tensors
    (assigning one copies into them, same shape only); `scale_inv` is 1 / scale, computed at
    each read (torchte keeps no scale_inv between steps).

    `columns` (a te.ops operation's view): the state's columns of the quantizers Transformer
    Engine counts, in its order; `scale` and `amax_history` are then views of those columns
    (strided slices of the state's tensors), where they form an evenly spaced run."""

    __slots__ = ("columns", "delayed_state", "recipe")

    def __init__(
        self, delayed_state: DelayedScalingState, recipe, columns: tuple[int, ...] | None = None
    ) -> None:
        self.delayed_state = delayed_state
        self.recipe = recipe
        self.columns = columns

    @property
    def mode(self) -> str:
        return "forward" if self.delayed_state.forward else "backward"

    @property
    def num_quantizers(self) -> int:
        if self.columns is not None:
            return len(self.columns)
        return self.delayed_state.scale.numel()

    @property
    def dtype(self):
        """The FP8 dtype of this direction as Transformer Engine's DType tag."""
        if self.recipe is None:
            return None
        fmt = self.recipe.fp8_format
        return TE_DType[fmt.fwd_dtype if self.delayed_state.forward else fmt.bwd_dtype]

    @property
    def scale(self) -> torch.Tensor:
        """(n,) fp32: the state's scales (the same tensor)."""
        return self._tensor("scale")

    @scale.setter
    def scale(self, value: torch.Tensor) -> None:
        self._assign("scale", value)

    @property
    def amax_history(self) -> torch.Tensor:
        """(L, n) fp32: the state's amax history, newest row first (the same tensor)."""
        return self._tensor("amax_history")

    @amax_history.setter
    def amax_history(self, value: torch.Tensor) -> None:
        self._assign("amax_history", value)

    @property
    def scale_inv(self) -> torch.Tensor:
        """(n,) fp32: 1 / scale, a new tensor."""
        return 1.0 / self._tensor("scale")

    def _tensor(self, name: str) -> torch.Tensor:
        state = self.delayed_state
        if self.columns is not None:
            return _columns_view(getattr(state, name), self.columns, name)
        if state.slot_major:
            raise NotImplementedError(
                f"fp8_meta[...].{name} of te.GroupedLinear: torchte keeps its delayed-scaling "
                "columns slot by slot (one slot's values for all GEMMs together), Transformer "
                "Engine GEMM by GEMM, and no view of one is the other; read the module's state "
                "through get_extra_state() (Transformer Engine's layout)"
            )
        return getattr(state, name)

    def _assign(self, name: str, value: torch.Tensor) -> None:
        mine = self._tensor(name)
        if not isinstance(value, torch.Tensor) or value.shape != mine.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(
                f"fp8_meta[...].{name} = value: value must have shape {tuple(mine.shape)} "
                f"(torchte keeps one state per amax_history_len: use a recipe of that length), "
                f"got {got}"
            )
        with torch.no_grad():
            mine.copy_(value)
        self.delayed_state.generation += 1  # FP8 weights cached under the old scale are stale


def _columns_view(tensor: torch.Tensor, columns: tuple[int, ...], name: str) -> torch.Tensor:
    """tensor[..., columns] as a view (a strided slice of its last dim): NotImplementedError
    where the columns are not evenly spaced and increasing (no view holds them)."""
    start = columns[0]
    step = columns[1] - columns[0] if len(columns) > 1 else 1
    if step <= 0 or columns != tuple(range(start, start + step * len(columns), step)):
        raise NotImplementedError(
            f"_fp8_metas[...].{name} of te.ops.GroupedLinear's forward: torchte keeps its "
            "delayed-scaling columns slot by slot (all inputs, then all weights), Transformer "
            "Engine interleaves them (input, weight of each group), and no view of one is the "
            "other; get_quantizer('forward', i).scale / .amax are the views of each one"
        )
    return tensor[..., start : start + step * (len(columns) - 1) + 1 : step]


def refresh_fp8_meta(meta: dict[str, Any], module, recipe, group) -> None:
    """Bring `meta` up to date with the module: recipe-derived keys and the scaling views of
    the state the recipe (a delayed one, or None: the last saved history length) uses."""
    meta["fp8_checkpoint"] = module.__dict__.get("_saved_history_len") is not None
    if group is not None:
        meta["fp8_group"] = group
    fmt = getattr(recipe, "fp8_format", None)
    if fmt is not None:
        meta["fp8_max_fwd"], meta["fp8_max_bwd"] = fmt.value.max_fwd, fmt.value.max_bwd
    if recipe is None:
        history_len = module.__dict__.get("_saved_history_len")
    else:
        history_len = recipe.amax_history_len if recipe.delayed() else None
    pair = module.__dict__["_delayed_states"].get(history_len)
    for key, state in zip(("scaling_fwd", "scaling_bwd"), pair or (None, None), strict=True):
        view = meta.get(key)
        if state is None:
            if isinstance(view, ScalingStateView):
                del meta[key]
        elif not isinstance(view, ScalingStateView) or view.delayed_state is not state:
            meta[key] = ScalingStateView(state, recipe)
        else:
            view.recipe = recipe


def refresh_op_fp8_metas(metas: dict[str, Any], op, recipe, recipe_changed: bool) -> None:
    """Bring a te.ops operation's `_fp8_metas` ({"forward": ..., "backward": ...}) up to date
    for `recipe` (the last it was set up for): per mode with quantizers, a dict holding
    "recipe", "fp8_group" and, under delayed scaling, "scaling_fwd" / "scaling_bwd" (a
    ScalingStateView of the op's quantizer columns, Transformer Engine's order); None for a
    mode without quantizers. "recipe" and "fp8_group" a client wrote are kept until the op is
    set up for another recipe (`recipe_changed`)."""
    history_len = recipe.amax_history_len if recipe.delayed() else None
    pair = op.__dict__["_delayed_states"].get(history_len)
    for forward, mode in ((True, "forward"), (False, "backward")):
        slots = op.quantizer_slots(mode)
        if not slots:
            metas[mode] = None
            continue
        meta = metas.get(mode)
        if meta is None:
            meta = metas[mode] = {"recipe": recipe, "fp8_group": None}
        elif recipe_changed:
            meta["recipe"] = recipe
        key = "scaling_fwd" if forward else "scaling_bwd"
        state = None if pair is None else pair[0 if forward else 1]
        view = meta.get(key)
        if state is None:
            if isinstance(view, ScalingStateView):
                del meta[key]
        elif not isinstance(view, ScalingStateView) or view.delayed_state is not state:
            columns = tuple(state._index(name, gemm) for name, gemm in slots)
            meta[key] = ScalingStateView(state, recipe, columns)
        else:
            view.recipe = recipe


def warn_on_recipe_type_change(module, old, new) -> None:
    """UserWarning when a module's FP8 recipe changes type between forwards (neither class
    derives from the other, e.g. DelayedScaling -> Float8CurrentScaling): the module now
    quantizes differently, which may change how it trains."""
    if old is None or new is None or old is new:
        return
    if isinstance(new, type(old)) or isinstance(old, type(new)):
        return
    warnings.warn(
        f"Recipe type changed from {type(old).__name__} to {type(new).__name__} in "
        f"te.{type(module).__name__}: its forwards now quantize under the new recipe, which "
        "may change the model's behavior",
        UserWarning,
        stacklevel=4,
    )
