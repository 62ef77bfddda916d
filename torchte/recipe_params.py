"""Transformer Engine's per-tensor and per-GEMM options of a recipe: QParams (how one role's
tensors are quantized) and MMParams (how one GEMM accumulates). Frozen, compared by value,
validated on construction; recipe.py holds them in its recipes' fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MMParams", "QParams"]


def _check_bools(owner: str, **flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{owner}.{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class QParams:
    """How the tensors of one role (inputs, weights or output gradients) are quantized.

    power_2_scale: round each scale down to a power of two. amax_epsilon: a floor on the amax
    a scale is computed from (>= 0). random_hadamard_transform, stochastic_rounding and
    fp4_2d_quantization are NVFP4's options (no meaning for FP8 tensors, as in Transformer
    Engine).
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_bools(
            "QParams",
            power_2_scale=self.power_2_scale,
            random_hadamard_transform=self.random_hadamard_transform,
            stochastic_rounding=self.stochastic_rounding,
            fp4_2d_quantization=self.fp4_2d_quantization,
        )
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, int | float):
            raise TypeError(f"QParams.amax_epsilon must be a float, got {eps!r}")
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"QParams.amax_epsilon must be finite and >= 0, got {eps!r}")
        object.__setattr__(self, "amax_epsilon", float(eps))


@dataclass(frozen=True)
class MMParams:
    """How one GEMM (forward, input gradient or weight gradient) accumulates FP8 products.

    use_split_accumulator: True accumulates in full precision (split accumulation); False lets
    Hopper's fast FP8 accumulation run (fewer mantissa bits in the running sum).
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_bools("MMParams", use_split_accumulator=self.use_split_accumulator)
