"""Delayed-scaling state: the scales and amax history of a module's forward or backward tensors.

Shapes: amax_history (L, n) fp32, scale (n,) fp32, nonfinite (n,) int32, n = slots per GEMM x
GEMMs, on the module's device. Slot j is one tensor (forward: input, weight, output; backward:
grad_output, grad_input), ordered GEMM by GEMM, or, for a grouped module (slot_major), slot by
slot so that one slot's values for all GEMMs are one contiguous (G,) vector a grouped kernel can
take.
Quantizers hold views into row 0 of the history and into the scale, so both are only ever
updated in place. A NaN or inf amax is never taken into the history: the update skips that slot
(history and scale stay as they were) and counts it in `nonfinite` (see kernels/scaling.py).
"""

from __future__ import annotations

import torch

from torchte.kernels.scaling import (
    nonfinite_row0,
    roll_history_reference,
    scale_from_amax_reference,
    update_delayed_scaling,
)
from torchte.recipe import DelayedScaling

from .float8 import Float8Quantizer

__all__ = ["BACKWARD_SLOTS", "DEFAULT_HISTORY_LEN", "FORWARD_SLOTS", "DelayedScalingState"]

# The history length of DelayedScaling(): a module makes that state at construction.
DEFAULT_HISTORY_LEN = DelayedScaling().amax_history_len
FORWARD_SLOTS = ("input", "weight", "output")
BACKWARD_SLOTS = ("grad_output", "grad_input")


class DelayedScalingState:
    """Scales and amax history of one direction (forward or backward) of one module."""

    __slots__ = (
        "amax_history",
        "forward",
        "generation",
        "nonfinite",
        "num_gemms",
        "scale",
        "slot_major",
        "slots",
    )

    def __init__(
        self,
        forward: bool,
        history_len: int,
        device: torch.device,
        num_gemms: int = 1,
        slot_major: bool = False,
    ) -> None:
        self.forward = forward
        self.num_gemms, self.slot_major = num_gemms, slot_major
        self.slots = FORWARD_SLOTS if forward else BACKWARD_SLOTS
        n = len(self.slots) * num_gemms
        self.amax_history = torch.zeros(history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        # Per slot: the updates skipped because the recorded amax was NaN or inf.
        self.nonfinite = torch.zeros(n, dtype=torch.int32, device=device)
        # Bumped at each update: a cached FP8 weight made with an older scale is stale.
        self.generation = 0

    def quantizer(
        self, slot: str, fp8_dtype: torch.dtype, internal: bool = True, gemm: int = 0
    ) -> Float8Quantizer:
        """A Float8Quantizer for `slot` of GEMM number `gemm`: it reads this state's scale and
        records into its amax history."""
        return Float8Quantizer.of_slot(self, self._index(slot, gemm), fp8_dtype, internal)

    def _index(self, slot: str, gemm: int) -> int:
        if self.slot_major:
            return self.slots.index(slot) * self.num_gemms + gemm
        return gemm * len(self.slots) + self.slots.index(slot)

    def slot_vectors(self, slot: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale (G,), current amax (G,)) of `slot` for all GEMMs: views (slot_major only)."""
        if not self.slot_major:
            raise ValueError("slot_vectors needs a slot-major state (a grouped module's)")
        j = self.slots.index(slot) * self.num_gemms
        return self.scale[j : j + self.num_gemms], self.amax_history[0, j : j + self.num_gemms]

    def update(self, recipe: DelayedScaling) -> None:
        """New scales from the history, then roll it (done once per step for each direction)."""
        fmt = recipe.fp8_format.value
        fp8_max = fmt.max_fwd if self.forward else fmt.max_bwd
        custom_amax = callable(recipe.amax_compute_algo)
        if not custom_amax and recipe.scaling_factor_compute_algo is None:
            update_delayed_scaling(
                self.amax_history,
                self.scale,
                self.nonfinite,
                fp8_max,
                recipe.margin,
                recipe.amax_compute_algo,
            )
        else:
            self._update_custom(recipe, fp8_max)
        if not torch.compiler.is_compiling():
            # Only eager weight caches read it; traced, the count would be a guard that fails
            # (recompiles) at every step.
            self.generation += 1

    def _update_custom(self, recipe: DelayedScaling, fp8_max: float) -> None:
        skip = nonfinite_row0(self.amax_history)
        # The custom functions see a history without this iteration's non-finite amaxes.
        self.amax_history[0].masked_fill_(skip, 0.0)
        algo = recipe.amax_compute_algo
        if callable(algo):
            amax = algo(self.amax_history)
        elif algo == "max":
            amax = self.amax_history.amax(dim=0)
        else:
            amax = self.amax_history[0].clone()
        if recipe.scaling_factor_compute_algo is not None:
            new_scale = recipe.scaling_factor_compute_algo(amax, self.scale, fp8_max, recipe)
        else:
            new_scale = scale_from_amax_reference(amax, self.scale, fp8_max, recipe.margin)
        self.scale.copy_(torch.where(skip, self.scale, new_scale))
        roll_history_reference(self.amax_history, skip, self.nonfinite)

    def discard_pending(self) -> None:
        """Forget the amax values recorded since the last update (row 0). A weight cached in
        the meantime is made stale, so that its amax is recorded again."""
        self.amax_history[0].zero_()
        self.generation += 1

    def load(self, scale: torch.Tensor, amax_history: torch.Tensor) -> None:
        """Copy saved values in place (views held by quantizers stay valid)."""
        for name, saved, mine in (
            ("amax history", amax_history, self.amax_history),
            ("scale", scale, self.scale),
        ):
            if not isinstance(saved, torch.Tensor) or saved.shape != mine.shape:
                got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else repr(saved)
                raise ValueError(
                    f"saved {name} has shape {got}, this module's has {tuple(mine.shape)}"
                )
        self.scale.copy_(scale)
        self.amax_history.copy_(amax_history)
        self.generation += 1
