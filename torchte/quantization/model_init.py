"""quantized_model_init: build modules whose weights exist only in FP8.

While the context manager is active, modules read `model_init_settings()` at construction and
keep each weight only as a quantized parameter (a Float8Tensor, or the block-scaled recipes'
Float8BlockwiseQTensor / MXFP8Tensor / NVFP4Tensor, made by `make_fp8_parameter`), never in high
precision. With `preserve_high_precision_init_val=True` the high-precision initial value is also
kept on the CPU, reachable through `param.get_high_precision_init_val()` (an optimizer may seed
its fp32 master weights from it) and freed by `param.clear_high_precision_init_val()`, as in
Transformer Engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MethodType

import torch

from torchte.offload import mark_not_offload
from torchte.recipe import DelayedScaling, Recipe

from .base import Quantizer
from .block_tensor import block_tensor_class
from .float8 import Float8Storage
from .float8_tensor import Float8Tensor

__all__ = [
    "ModelInitSettings",
    "attach_high_precision_init_val",
    "fp8_model_init",
    "make_fp8_parameter",
    "model_init_settings",
    "quantized_model_init",
]


@dataclass(frozen=True)
class ModelInitSettings:
    """What an active `quantized_model_init` asks of the modules built under it.

    recipe: the scaling recipe the FP8 weights are made with (DelayedScaling() when the user
    gave none). preserve_high_precision_init_val: also keep each weight's high-precision
    initial value on the CPU.
    """

    recipe: Recipe = field(default_factory=DelayedScaling)
    preserve_high_precision_init_val: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe):
            raise TypeError(
                f"quantized_model_init: recipe must be a torchte.recipe.Recipe or None, "
                f"got {type(self.recipe).__name__}"
            )
        if not isinstance(self.preserve_high_precision_init_val, bool):
            raise TypeError(
                "quantized_model_init: preserve_high_precision_init_val must be a bool, "
                f"got {self.preserve_high_precision_init_val!r}"
            )


_SETTINGS: ContextVar[ModelInitSettings | None] = ContextVar(
    "torchte_model_init_settings", default=None
)


def model_init_settings() -> ModelInitSettings | None:
    """The settings of the innermost active `quantized_model_init`; None when none is enabled."""
    return _SETTINGS.get()


@contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
) -> Iterator[None]:
    """Modules built inside keep their weights only in FP8 (as Float8Tensor parameters).

    enabled=False turns it off inside an enclosing enabled block. recipe: the scaling recipe of
    the weights (None: DelayedScaling()). preserve_high_precision_init_val: keep each weight's
    initial high-precision value on the CPU (see the module docstring). The previous state is
    restored on exit, also when the block raises.
    """
    if recipe is None:
        recipe = DelayedScaling()
    if isinstance(recipe, Recipe):  # a frozen snapshot: the modules keep it (recipe.py)
        recipe = recipe._frozen()
    settings = ModelInitSettings(recipe, preserve_high_precision_init_val)
    token = _SETTINGS.set(settings if enabled else None)
    try:
        yield
    finally:
        _SETTINGS.reset(token)


fp8_model_init = quantized_model_init
"""Transformer Engine's older name of `quantized_model_init` (same arguments)."""


def make_fp8_parameter(
    weight_hp: torch.Tensor,
    quantizer: Quantizer,
    preserve_high_precision_init_val: bool,
    *,
    requires_grad: bool = True,
) -> torch.nn.Parameter:
    """Quantize weight_hp (any shape, fp32/bf16/fp16) into an FP8 parameter.

    Returns an nn.Parameter that is the quantized tensor of the quantizer's format
    (Float8Tensor; Float8BlockwiseQTensor, MXFP8Tensor or NVFP4Tensor under the block-scaled
    recipes) of weight_hp's shape and nominal dtype, holding `quantizer` for later in-place
    updates (optimizer steps, checkpoint loads). With preserve_high_precision_init_val, a CPU
    copy of weight_hp is attached with the methods `get_high_precision_init_val()` and
    `clear_high_precision_init_val()`.
    """
    with torch.no_grad():
        weight_hp = weight_hp.detach()
        value = quantizer.quantize(weight_hp)
        if isinstance(value, Float8Storage):
            value = Float8Tensor.from_storage(value, weight_hp.dtype, quantizer)
        elif (block_class := block_tensor_class(value)) is not None:
            value = block_class.from_storage(value, weight_hp.dtype, quantizer)
        elif not isinstance(value, torch.Tensor):
            raise TypeError(
                f"make_fp8_parameter: {type(quantizer).__name__}.quantize returned "
                f"{type(value).__name__}, which is neither a known Storage nor a tensor"
            )
    param = torch.nn.Parameter(value, requires_grad=requires_grad)
    # A parameter's data: saving it for backward moves nothing, so it is never offloaded.
    mark_not_offload(getattr(value, "_storage", None))
    if preserve_high_precision_init_val:
        attach_high_precision_init_val(param, weight_hp.to(device="cpu", copy=True))
    return param


def _get_high_precision_init_val(self: torch.Tensor) -> torch.Tensor | None:
    """The high-precision initial value (on the CPU); None once cleared."""
    return self._high_precision_init_val


def _clear_high_precision_init_val(self: torch.Tensor) -> None:
    """Free the high-precision initial value."""
    self._high_precision_init_val = None


def attach_high_precision_init_val(param: torch.Tensor, value_cpu: torch.Tensor) -> None:
    """Give `param` get_/clear_high_precision_init_val() methods over `value_cpu`."""
    param._high_precision_init_val = value_cpu
    param.get_high_precision_init_val = MethodType(_get_high_precision_init_val, param)
    param.clear_high_precision_init_val = MethodType(_clear_high_precision_init_val, param)
