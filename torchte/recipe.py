"""FP8 scaling recipes: frozen dataclasses with Transformer Engine's names and defaults.

A recipe says how tensors are scaled into FP8; `te.autocast(recipe=...)` makes one active.
Only `DelayedScaling` and `Float8CurrentScaling` run in this release; modules used under the
block-scaling recipes raise NotImplementedError naming the recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

__all__ = [
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
]


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 formats: E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward, E5M2 backward)."""

    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)

    @property
    def fwd_dtype(self) -> torch.dtype:
        """The torch dtype of forward tensors (activations, weights)."""
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        """The torch dtype of backward tensors (gradients)."""
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


class Recipe:
    """Base of all recipes; the predicates say which scaling family a recipe belongs to."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)


def max_margin(fp8_format: Format) -> int:
    """The largest DelayedScaling margin under which a tensor's amax, scaled to
    fp8_max / 2**margin, is still a normal number of every FP8 dtype the format uses."""
    limits = []
    for dtype, fp8_max in (
        (fp8_format.fwd_dtype, fp8_format.value.max_fwd),
        (fp8_format.bwd_dtype, fp8_format.value.max_bwd),
    ):
        limits.append(math.floor(math.log2(fp8_max / torch.finfo(dtype).tiny)))
    return min(limits)


def _check_format(fp8_format: Format, allowed: tuple[Format, ...], recipe: str) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"{recipe}.fp8_format must be a recipe.Format, got {fp8_format!r}")
    if fp8_format not in allowed:
        names = ", ".join(f.name for f in allowed)
        raise ValueError(f"{recipe}.fp8_format={fp8_format.name} is not supported; use {names}")


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scaling from a history of amax values recorded in earlier iterations.

    margin: the scale is divided by 2**margin (at most 14 for E4M3 and HYBRID: beyond, every
    value would fall below the format's normal range). fp8_format: E4M3 or HYBRID. amax_history_len:
    how many past amax values are kept. amax_compute_algo: "max" (of the history),
    "most_recent", or a callable(amax_history) -> amax. scaling_factor_compute_algo: None, or a
    callable(amax, scale, fp8_max, recipe) -> scale. reduce_amax: all-reduce amax values over
    the autocast's amax_reduction_group when torch.distributed is initialized.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    scaling_factor_compute_algo: Callable | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID), "DelayedScaling")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be an int >= 0, got {self.margin!r}")
        limit = max_margin(self.fp8_format)
        if self.margin > limit:
            raise ValueError(
                f"DelayedScaling.margin={self.margin} scales every tensor's largest value below "
                f"the smallest normal number of {self.fp8_format.name}'s formats, so the values "
                f"would flush to zero or subnormals; margin must be at most {limit} (usually 0 "
                "to 2)"
            )
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(
                f"DelayedScaling.amax_history_len must be an int >= 1, "
                f"got {self.amax_history_len!r}"
            )
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable, "
                f"got {algo!r}"
            )
        if self.scaling_factor_compute_algo is not None and not callable(
            self.scaling_factor_compute_algo
        ):
            raise ValueError("DelayedScaling.scaling_factor_compute_algo must be None or callable")


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the amax of the tensor being quantized, computed on the device.

    use_power_2_scales rounds each scale down to a power of two; amax_epsilon is a floor on
    the amax used to compute the scale.
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID), "Float8CurrentScaling")
        if self.amax_epsilon < 0:
            raise ValueError(
                f"Float8CurrentScaling.amax_epsilon must be >= 0, got {self.amax_epsilon!r}"
            )


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """1x128 (activations, gradients) and 128x128 (weights) block scaling. Not yet runnable."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: E8M0 scales over blocks of 32 values. Not yet runnable."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: FP4 E2M1 values with FP8 scales over blocks of 16. Not yet runnable."""

    fp4_format: str = "E2M1"
    fp8_dpa: bool = False
    fp8_mha: bool = False
