"""The per-module FP8 attributes Transformer Engine's modules carry and its clients read
(Megatron-Core's TE wrappers: `fp8_meta`, `fp8`, `fp8_calibration`, `init_fp8_metadata`), and
the form of `_extra_state` a Transformer Engine client expects.

torchte keeps no per-module FP8 metadata to initialize (quantizers and delayed-scaling state
are made when a forward needs them), so these answer from what the module did last:
`fp8` / `fp8_calibration` are the last forward's autocast state, and `fp8_meta` is a dict
holding Transformer Engine's keys ("recipe", "fp8_checkpoint", "num_gemms", ...) that a client
may read and write; torchte's own computations never read it.

`get_extra_state()` gives Transformer Engine 2.x's form of `_extra_state` (a uint8 tensor of
pickled bytes, see _te_extra_state.py), with or without torchte.alias: clients split, merge and
re-pickle it themselves (Megatron-Core's TEGroupedLinear does). set_extra_state also reads
torchte's older dict form.
"""

from __future__ import annotations

from typing import Any

from ._fp8_meta import refresh_fp8_meta, warn_on_recipe_type_change

__all__ = ["SaveOriginalInputMixin", "TEMetadataMixin"]


# Positions in the plan key (base.PlanKey's fields, kept as a plain tuple in _last_plan).
_FP8, _CALIBRATING, _RECIPE, _GROUP = 0, 1, 2, 3


class TEMetadataMixin:
    """Transformer Engine's per-module FP8 attributes for a te module (see the module doc).
    Needs `_last_plan` ((plan key, plan) or None), `_saved_history_len` and `num_gemms`."""

    @property
    def fp8(self) -> bool:
        """Whether the last forward ran in FP8 (Transformer Engine's module.fp8)."""
        last = self.__dict__.get("_last_plan")
        return bool(last is not None and last[0][_FP8])

    @property
    def fp8_calibration(self) -> bool:
        """Whether the last forward recorded amaxes for calibration (module.fp8_calibration)."""
        last = self.__dict__.get("_last_plan")
        return bool(last is not None and last[0][_CALIBRATING])

    @property
    def fp8_meta(self) -> dict[str, Any]:
        """Transformer Engine's fp8_meta dict (the same dict every time), brought up to date at
        each read (module/_fp8_meta.py): "recipe" (the last FP8 forward's, or what a client
        set), "fp8_group", "num_gemms", "fp8_checkpoint" (whether the module holds
        delayed-scaling state to save), "fp8_max_fwd" / "fp8_max_bwd", and under delayed
        scaling "scaling_fwd" / "scaling_bwd", views of the module's scales and amax
        histories."""
        meta = self.__dict__.get("_te_fp8_meta")
        if meta is None:
            recipe = self.__dict__.get("_te_fp8_recipe")
            meta = {"recipe": recipe, "fp8_group": None, "num_gemms": self.num_gemms}
            self.__dict__["_te_fp8_meta"] = meta
        last = self.__dict__.get("_last_plan")
        group = last[0][_GROUP] if last is not None and last[0][_RECIPE] is not None else None
        refresh_fp8_meta(meta, self, meta.get("recipe"), group)
        return meta

    def _note_fp8_recipe(self, recipe) -> None:
        """Called by a forward whose plan changed (never while the settings stay the same):
        `recipe` (None: not FP8) becomes fp8_meta's "recipe", with a UserWarning where its type
        differs from the previous one's (warn_on_recipe_type_change)."""
        if recipe is None:
            return
        meta = self.__dict__.get("_te_fp8_meta")
        old = meta.get("recipe") if meta is not None else self.__dict__.get("_te_fp8_recipe")
        warn_on_recipe_type_change(self, old, recipe)
        self.__dict__["_te_fp8_recipe"] = recipe
        if meta is not None:
            meta["recipe"] = recipe

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Transformer Engine's hook to set up FP8 metadata before a forward or a load: nothing
        to set up in torchte (its FP8 state is made when a forward needs it); checks num_gemms."""
        if num_gemms != self.num_gemms:
            raise ValueError(
                f"init_fp8_metadata: num_gemms={num_gemms}, but te.{type(self).__name__} has "
                f"{self.num_gemms} GEMMs"
            )


class SaveOriginalInputMixin:
    """Transformer Engine's public `save_original_input` attribute (Linear, GroupedLinear), which
    Megatron-Core sets after construction: the plans are made anew, and a module with a
    `_plain_path()` (te.Linear's nn.Linear shortcut) decides its shortcut again."""

    @property
    def save_original_input(self) -> bool:
        """Whether backward casts the input kept as given again instead of saving it in FP8."""
        return self._save_original_input

    @save_original_input.setter
    def save_original_input(self, value: bool) -> None:
        self.__dict__.update(_save_original_input=bool(value), _plans={}, _last_plan=None)
        plain_path = getattr(self, "_plain_path", None)
        if plain_path is not None:
            self.__dict__["_plain"] = plain_path()
