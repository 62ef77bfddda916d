"""Basic operations, one per file (the activations and the two norms share theirs)."""

from .activation import (
    GEGLU,
    GELU,
    QGEGLU,
    QGELU,
    ClampedSwiGLU,
    ReGLU,
    ReLU,
    SiLU,
    SReGLU,
    SReLU,
    SwiGLU,
)
from .add_extra_input import AddExtraInput
from .basic_linear import BasicLinear
from .bias import Bias
from .constant_scale import ConstantScale
from .dropout import Dropout
from .identity import Identity
from .linear import Linear
from .make_extra_output import MakeExtraOutput
from .norm import LayerNorm, RMSNorm
from .quantize import Quantize
from .reshape import Reshape

__all__ = [
    "GEGLU",
    "GELU",
    "QGEGLU",
    "QGELU",
    "AddExtraInput",
    "BasicLinear",
    "Bias",
    "ClampedSwiGLU",
    "ConstantScale",
    "Dropout",
    "Identity",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "Quantize",
    "RMSNorm",
    "ReGLU",
    "ReLU",
    "Reshape",
    "SReGLU",
    "SReLU",
    "SiLU",
    "SwiGLU",
]
