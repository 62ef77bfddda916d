"""Transformer Engine's per-tensor and per-GEMM options of a recipe: QParams (how one role's
tensors are quantized) and MMParams (how one GEMM accumulates). Frozen, compared by value,
validated on construction; recipe.py holds them in its recipes' fields. Also the defaults
a recipe's None fields stand for, and the checks of those fields.
"""

from __future__ import annotations

import math
import warnings
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


# The QParams / MMParams a None field stands for (frozen: shared by every recipe). The fields'
# dataclass defaults are None, filled in by _validate: torch.compile cannot trace a constructor
# whose default values are such objects (a step that builds its recipe inside a compiled region).
_QUANT = QParams()
_QUANT_POWER_2 = QParams(power_2_scale=True)
_FAST_ACCUMULATION = MMParams(use_split_accumulator=False)
_SPLIT_ACCUMULATION = MMParams(use_split_accumulator=True)
_CURRENT_DEFAULTS = {
    "fp8_quant_fwd_inp": _QUANT,
    "fp8_quant_fwd_weight": _QUANT,
    "fp8_quant_bwd_grad": _QUANT,
    "fp8_gemm_fprop": _FAST_ACCUMULATION,
    "fp8_gemm_dgrad": _SPLIT_ACCUMULATION,
    "fp8_gemm_wgrad": _SPLIT_ACCUMULATION,
}
_BLOCK_DEFAULTS = {
    "fp8_quant_fwd_inp": _QUANT_POWER_2,
    "fp8_quant_fwd_weight": _QUANT_POWER_2,
    "fp8_quant_bwd_grad": _QUANT_POWER_2,
    "fp8_gemm_fprop": _SPLIT_ACCUMULATION,
    "fp8_gemm_dgrad": _SPLIT_ACCUMULATION,
    "fp8_gemm_wgrad": _SPLIT_ACCUMULATION,
}
# Transformer Engine's GEMM accumulation under per-tensor FP8, which torchte's GEMMs use:
# fast accumulation in the forward GEMM, split accumulation in the two backward GEMMs.
_GEMM_ACCUMULATION = {"fp8_gemm_fprop": False, "fp8_gemm_dgrad": True, "fp8_gemm_wgrad": True}
# The QParams field that sets each quantizer slot of a module (setup.py's slot names).
_SLOT_QPARAMS = {
    "input": "fp8_quant_fwd_inp",
    "weight": "fp8_quant_fwd_weight",
    "grad_output": "fp8_quant_bwd_grad",
}


def _fill_defaults(recipe, defaults: dict) -> None:
    """Each field of `defaults` left None takes its default QParams / MMParams."""
    for name, value in defaults.items():
        if getattr(recipe, name) is None:
            object.__setattr__(recipe, name, value)


def _check_params(recipe, names, cls) -> None:
    for name in names:
        value = getattr(recipe, name)
        if not isinstance(value, cls):
            raise TypeError(
                f"{type(recipe).__name__}.{name} must be a recipe.{cls.__name__}, got {value!r}"
            )


_NOTED: set[str] = set()


def _note_ignored(recipe: str, names: list[str]) -> None:
    """Say once per process that Transformer Engine fields without a meaning here are ignored."""
    fresh = [n for n in names if f"{recipe}.{n}" not in _NOTED]
    if fresh:
        _NOTED.update(f"{recipe}.{n}" for n in fresh)
        warnings.warn(
            f"{recipe}: {', '.join(fresh)} has no effect in torchte (ignored)",
            UserWarning,
            stacklevel=4,
        )
