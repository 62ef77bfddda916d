"""FP8 scaling recipes: dataclasses with Transformer Engine's names and defaults.

A recipe says how tensors are scaled into FP8; `te.autocast(recipe=...)` makes one active.
Recipes are mutable, as in Transformer Engine: a field set after construction is validated
(an invalid value is refused and the old one kept). Modules work from a frozen snapshot that
te.autocast (and quantized_model_init, make_graphed_callables) takes of the recipe it is given
(`_frozen()`, one per recipe and change), so a change takes effect at the next region and never
alters state built under the old values. Recipes compare and hash by their values.
Every recipe runs except CustomRecipe and the MXFP4 quantization-aware-training variants (and
the few options `_unsupported` names): modules used under one raise NotImplementedError
naming it. QParams and MMParams
(recipe_params.py) hold the per-role quantization and per-GEMM accumulation options.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from .recipe_params import (
    _BLOCK_DEFAULTS,
    _CURRENT_DEFAULTS,
    _GEMM_ACCUMULATION,
    _SLOT_QPARAMS,
    MMParams,
    QParams,
    _check_params,
    _fill_defaults,
    _note_ignored,
)

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP4QATFloat8BlockScaling",
    "MXFP4QATMXFP8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
]


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 formats: E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward, E5M2 backward);
    and E2M1, NVFP4's 4-bit format."""

    E2M1 = _FormatHelper(max_fwd=6.0, max_bwd=6.0)
    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)

    @property
    def fwd_dtype(self) -> torch.dtype:
        """The torch dtype of forward tensors (activations, weights); E2M1's packs two values
        in a byte."""
        if self is Format.E2M1:
            return torch.float4_e2m1fn_x2
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        """The torch dtype of backward tensors (gradients)."""
        if self is Format.E2M1:
            return torch.float4_e2m1fn_x2
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


class Recipe:
    """Base of all recipes: validation on assignment, value equality, frozen snapshots (see the
    module docstring); the predicates (class methods, as in Transformer Engine) say which
    scaling family a recipe belongs to."""

    # Per class, set at its first construction: the field names, and those compared.
    _FIELDS: frozenset[str] = frozenset()
    _COMPARED: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        cls = type(self)
        if "_COMPARED" not in cls.__dict__:
            cls._FIELDS = frozenset(f.name for f in dataclasses.fields(cls))
            cls._COMPARED = tuple(f.name for f in dataclasses.fields(cls) if f.compare)
        self._validate()
        object.__setattr__(self, "_ready", True)

    def _validate(self) -> None:
        """ValueError / TypeError for a field value the recipe cannot take."""

    def _unsupported(self) -> str | None:
        """Why modules cannot run under this recipe's current values in torchte (their first
        forward raises NotImplementedError with it), or None."""
        return None

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, "_is_snapshot", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r}: this {type(self).__name__} is the snapshot "
                "that te.autocast took; set it on the recipe you built (the next region uses it)"
            )
        if not getattr(self, "_ready", False):  # the dataclass's __init__
            object.__setattr__(self, name, value)
            return
        if name not in self._FIELDS:
            if isinstance(getattr(type(self), name, None), property):  # a settable view
                object.__setattr__(self, name, value)
                return
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        old = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self._validate()
        except Exception:
            object.__setattr__(self, name, old)
            raise
        object.__setattr__(self, "_generation", getattr(self, "_generation", 0) + 1)

    def _values(self) -> tuple:
        return tuple(getattr(self, n) for n in self._COMPARED)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._values() == self._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def _frozen(self) -> Recipe:
        """The frozen snapshot of the recipe's current values (the same object until a field
        changes)."""
        if getattr(self, "_is_snapshot", False):
            return self
        generation = getattr(self, "_generation", 0)
        cached = getattr(self, "_snapshot", None)
        if cached is not None and cached[0] == generation:
            return cached[1]
        snapshot = copy.copy(self)
        snapshot.__dict__.pop("_snapshot", None)
        object.__setattr__(snapshot, "_is_snapshot", True)
        object.__setattr__(self, "_snapshot", (generation, snapshot))
        return snapshot

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        return issubclass(cls, CustomRecipe)

    @classmethod
    def mxfp4_qat(cls) -> bool:
        return issubclass(cls, (MXFP4QATMXFP8BlockScaling, MXFP4QATFloat8BlockScaling))


BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
# The default backward_override of the recipes that take one: NVTE_BACKWARD_OVERRIDE, read at
# import (unset: None), as Transformer Engine reads it.
_BACKWARD_OVERRIDE_DEFAULT = os.environ.get("NVTE_BACKWARD_OVERRIDE") or None


def _check_backward_override(recipe) -> None:
    """ValueError unless backward_override is one of Transformer Engine's values (None,
    'high_precision', 'dequantized'); delayed scaling takes None only, as there."""
    allowed = (None,) if isinstance(recipe, DelayedScaling) else BACKWARD_OVERRIDES
    if recipe.backward_override not in allowed:
        raise ValueError(
            f"{type(recipe).__name__}.backward_override must be one of {allowed}, got "
            f"{recipe.backward_override!r}"
        )


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


@dataclass(eq=False)
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
    backward_override: str | None = None  # takes None only: the variable is not read
    # Older Transformer Engine fields, accepted as clients pass them: interval (ignored, a
    # one-time note), override_linear_precision ((fprop, dgrad, wgrad) high-precision flags:
    # all False runs; any True raises NotImplementedError at use), params_dtype and device
    # (ignored, a one-time note).
    interval: int = 1
    override_linear_precision: tuple = (False, False, False)
    params_dtype: object = field(default=None, compare=False, repr=False)
    device: object = field(default=None, compare=False, repr=False)

    def _validate(self) -> None:
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID), "DelayedScaling")
        _check_backward_override(self)
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"DelayedScaling.interval must be an int >= 1, got {self.interval!r}")
        precision = tuple(self.override_linear_precision)
        if len(precision) != 3 or not all(isinstance(v, bool) for v in precision):
            raise ValueError(
                "DelayedScaling.override_linear_precision must be three bools (fprop, dgrad, "
                f"wgrad), got {self.override_linear_precision!r}"
            )
        object.__setattr__(self, "override_linear_precision", precision)
        ignored = [n for n in ("params_dtype", "device") if getattr(self, n) is not None]
        _note_ignored("DelayedScaling", ignored + (["interval"] if self.interval != 1 else []))
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


@dataclass(eq=False)
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the amax of the tensor being quantized, computed on the device.

    use_power_2_scales rounds every scale down to a power of two; amax_epsilon is a floor on
    the amax used to compute every scale. fp8_quant_fwd_inp, fp8_quant_fwd_weight and
    fp8_quant_bwd_grad (QParams) add the same two options for the GEMM inputs, the weights and
    the output gradients: a role's scale is a power of two when either asks for it, and its
    floor is the larger of the two. fp8_gemm_fprop / _dgrad / _wgrad (MMParams) say how the
    forward, input-gradient and weight-gradient GEMMs accumulate; torchte runs only
    Transformer Engine's defaults (fast, split, split), others raise NotImplementedError at
    the first forward.
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _BACKWARD_OVERRIDE_DEFAULT
    fp8_quant_fwd_inp: QParams | None = None  # None: QParams()
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams | None = None  # None: MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams | None = None  # None: MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams | None = None

    def _validate(self) -> None:
        _fill_defaults(self, _CURRENT_DEFAULTS)
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID), "Float8CurrentScaling")
        _check_backward_override(self)
        if not isinstance(self.use_power_2_scales, bool):
            raise TypeError(
                "Float8CurrentScaling.use_power_2_scales must be a bool, got "
                f"{self.use_power_2_scales!r}"
            )
        if self.amax_epsilon < 0:
            raise ValueError(
                f"Float8CurrentScaling.amax_epsilon must be >= 0, got {self.amax_epsilon!r}"
            )
        _check_params(self, _SLOT_QPARAMS.values(), QParams)
        _check_params(self, _GEMM_ACCUMULATION, MMParams)

    def _slot_scaling(self, slot: str) -> tuple[bool, float]:
        """(power_2_scale, amax_epsilon) of a module's quantizer of `slot` ("input", "weight",
        "output", "grad_output", "grad_input"): the recipe-wide values joined with the QParams
        of the slot's role (outputs and input gradients have none, as in Transformer Engine)."""
        name = _SLOT_QPARAMS.get(slot)
        if name is None:
            return self.use_power_2_scales, self.amax_epsilon
        params = getattr(self, name)
        power_2 = self.use_power_2_scales or params.power_2_scale
        return power_2, max(self.amax_epsilon, params.amax_epsilon)

    def _unsupported(self) -> str | None:
        changed = [
            f"{name}=MMParams(use_split_accumulator={getattr(self, name).use_split_accumulator})"
            for name, split in _GEMM_ACCUMULATION.items()
            if getattr(self, name).use_split_accumulator != split
        ]
        if not changed:
            return None
        return (
            f"Float8CurrentScaling({', '.join(changed)}): choosing a GEMM's accumulation is not "
            "implemented in torchte yet; its GEMMs accumulate as Transformer Engine's defaults "
            "say (fprop fast, dgrad and wgrad split)"
        )


_NVFP4_SCOPES = ("none", "weights", "activations", "all")


def _check_choice(recipe, name: str, allowed: tuple) -> None:
    value = getattr(recipe, name)
    if value not in allowed:
        raise ValueError(f"{type(recipe).__name__}.{name} must be one of {allowed}, got {value!r}")


@dataclass(eq=False)
class Float8BlockScaling(Recipe):
    """1x128 (activations, gradients) and 128x128 (weights) block scaling.

    Validated as Transformer Engine validates it: block dims 1 or 2, never two 2-D operands in
    one GEMM, split accumulation in every GEMM, no FP8 attention, no E5M2.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _BACKWARD_OVERRIDE_DEFAULT
    use_f32_scales: bool = False
    fp8_quant_fwd_inp: QParams | None = None  # None: QParams(power_2_scale=True)
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams | None = None  # None: MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams | None = None
    fp8_gemm_wgrad: MMParams | None = None

    def _validate(self) -> None:
        _fill_defaults(self, _BLOCK_DEFAULTS)
        name = type(self).__name__
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID), name)
        _check_backward_override(self)
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for dim in dims:
            _check_choice(self, dim, (1, 2))
        if sum(getattr(self, dim) == 2 for dim in dims) > 1:
            raise ValueError(f"{name}: at most one of {', '.join(dims)} may be 2 (2D x 2D GEMM)")
        _check_params(self, _SLOT_QPARAMS.values(), QParams)
        _check_params(self, _GEMM_ACCUMULATION, MMParams)
        if not all(getattr(self, gemm).use_split_accumulator for gemm in _GEMM_ACCUMULATION):
            raise ValueError(f"{name}: every GEMM needs use_split_accumulator=True")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError(f"{name}: FP8 attention (fp8_dpa, fp8_mha) is not supported")


@dataclass(eq=False)
class MXFP8BlockScaling(Recipe):
    """MXFP8: E8M0 scales over blocks of 32 values (emulated exactly off Blackwell)."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    enable_2d_quantization: bool = False
    backward_override: str | None = _BACKWARD_OVERRIDE_DEFAULT

    def _validate(self) -> None:
        _check_format(self.fp8_format, (Format.E4M3, Format.HYBRID), type(self).__name__)
        _check_backward_override(self)


_QAT_UNSUPPORTED = (
    "{}: MXFP4 quantization-aware training (weights rounded onto the MXFP4 grid) is not "
    "implemented in torchte yet"
)


@dataclass(eq=False)
class MXFP4QATMXFP8BlockScaling(MXFP8BlockScaling):
    """MXFP8 with the weights first rounded onto the MXFP4 grid (quantization-aware training).
    Not yet runnable."""

    def _unsupported(self) -> str | None:
        return _QAT_UNSUPPORTED.format(type(self).__name__)


@dataclass(eq=False)
class MXFP4QATFloat8BlockScaling(Float8BlockScaling):
    """Float8BlockScaling with the weights first rounded onto the MXFP4 grid. Needs 128x128
    weight blocks and power-of-two weight scales. Not yet runnable."""

    def _unsupported(self) -> str | None:
        return _QAT_UNSUPPORTED.format(type(self).__name__)

    def _validate(self) -> None:
        super()._validate()
        if self.w_block_scaling_dim != 2 or not self.fp8_quant_fwd_weight.power_2_scale:
            raise ValueError(
                "MXFP4QATFloat8BlockScaling needs w_block_scaling_dim=2 and "
                "fp8_quant_fwd_weight.power_2_scale=True"
            )


@dataclass(eq=False)
class NVFP4BlockScaling(Recipe):
    """NVFP4: FP4 E2M1 values with FP8 scales over blocks of 16 (emulated exactly off
    Blackwell).

    fp4_quant_fwd_inp, fp4_quant_fwd_weight and fp4_quant_bwd_grad (QParams) say what the
    disable_* fields leave on: random Hadamard transforms for inputs and gradients, 2-D blocks
    for weights, stochastic rounding for gradients. Assigning one (as Transformer Engine's
    clients do) sets that role's options alone; the disable_* fields keep their values.
    """

    fp4_format: Format = Format.E2M1
    fp8_dpa: bool = False
    fp8_mha: bool = False
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    backward_override: str | None = _BACKWARD_OVERRIDE_DEFAULT
    fp8_format: Format = Format.E4M3
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"

    def _validate(self) -> None:
        if self.fp4_format == "E2M1":  # the string older torchte took
            object.__setattr__(self, "fp4_format", Format.E2M1)
        if self.fp4_format is not Format.E2M1:
            raise ValueError(
                f"NVFP4BlockScaling.fp4_format must be Format.E2M1, got {self.fp4_format!r}"
            )
        if self.fp8_format is not Format.E4M3:
            raise ValueError(
                f"NVFP4BlockScaling.fp8_format must be Format.E4M3, got {self.fp8_format!r}"
            )
        _check_backward_override(self)
        _check_choice(self, "nvfp4_4over6", _NVFP4_SCOPES)
        _check_choice(self, "nvfp4_4over6_e4m3_use_256", _NVFP4_SCOPES)
        _check_choice(self, "nvfp4_4over6_err_mode", ("MAE", "MSE"))

    def _unsupported(self) -> str | None:
        options = []
        if self.row_scaled_activation:
            options.append("row_scaled_activation=True")
        if self.nvfp4_4over6 != "none":
            options.append(f"nvfp4_4over6={self.nvfp4_4over6!r}")
        inp, weight, grad = (
            self.fp4_quant_fwd_inp,
            self.fp4_quant_fwd_weight,
            self.fp4_quant_bwd_grad,
        )
        if inp.random_hadamard_transform != grad.random_hadamard_transform:
            # wgrad multiplies the two transposed copies: both transformed, or neither.
            options.append("a random Hadamard transform on inputs or gradients alone")
        if weight.random_hadamard_transform:
            options.append("fp4_quant_fwd_weight with a random Hadamard transform")
        if not options:
            return None
        return f"NVFP4BlockScaling({', '.join(options)}) is not implemented in torchte yet"

    def _role_params(self, role: str) -> QParams | None:
        """The QParams assigned to `role` (None: derived from the disable_* fields)."""
        return self.__dict__.get("_assigned_params", {}).get(role)

    def _assign_params(self, role: str, params: QParams) -> None:
        if not isinstance(params, QParams):
            raise TypeError(f"NVFP4BlockScaling.{role} must be a QParams, got {params!r}")
        if getattr(self, "_is_snapshot", False):
            Recipe.__setattr__(self, role, params)  # FrozenInstanceError, saying why
        assigned = {**self.__dict__.get("_assigned_params", {}), role: params}
        object.__setattr__(self, "_assigned_params", assigned)
        object.__setattr__(self, "_generation", getattr(self, "_generation", 0) + 1)

    def _values(self) -> tuple:
        roles = ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")
        return super()._values() + tuple(self._role_params(r) for r in roles)

    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        assigned = self._role_params("fp4_quant_fwd_inp")
        return assigned or QParams(random_hadamard_transform=not self.disable_rht)

    @fp4_quant_fwd_inp.setter
    def fp4_quant_fwd_inp(self, params: QParams) -> None:
        self._assign_params("fp4_quant_fwd_inp", params)

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        assigned = self._role_params("fp4_quant_fwd_weight")
        return assigned or QParams(fp4_2d_quantization=not self.disable_2d_quantization)

    @fp4_quant_fwd_weight.setter
    def fp4_quant_fwd_weight(self, params: QParams) -> None:
        self._assign_params("fp4_quant_fwd_weight", params)

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        return self._role_params("fp4_quant_bwd_grad") or QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
        )

    @fp4_quant_bwd_grad.setter
    def fp4_quant_bwd_grad(self, params: QParams) -> None:
        self._assign_params("fp4_quant_bwd_grad", params)


@dataclass(eq=False)
class CustomRecipe(Recipe):
    """Transformer Engine's recipe of user-supplied quantizer factories (qfactory: a callable
    (role) -> quantizer). Not yet runnable: modules raise NotImplementedError under it."""

    qfactory: Callable | None = None
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = _BACKWARD_OVERRIDE_DEFAULT

    def _validate(self) -> None:
        if self.qfactory is not None and not callable(self.qfactory):
            raise TypeError(f"CustomRecipe.qfactory must be callable, got {self.qfactory!r}")
        if not isinstance(self.fp8_format, Format):
            raise TypeError(
                f"CustomRecipe.fp8_format must be a recipe.Format, got {self.fp8_format!r}"
            )
        _check_backward_override(self)
