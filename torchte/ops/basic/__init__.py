"""Basic operations, one per file (the activations and the two norms share theirs)."""

from .activation import (
    GEGLU,
    GELU,
    GLU,
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
from .all_gather import AllGather
from .all_reduce import AllReduce
from .basic_linear import BasicLinear
from .bias import Bias
from .constant_scale import ConstantScale
from .dropout import Dropout
from .grouped_linear import GroupedLinear
from .identity import Identity
from .l2_normalization import L2Normalization
from .linear import Linear
from .make_extra_output import MakeExtraOutput
from .norm import LayerNorm, RMSNorm
from .quantize import Quantize
from .reduce_scatter import ReduceScatter
from .reshape import Reshape
from .scaled_activation import (
    ScaledClampedQGeGLU,
    ScaledClampedSwiGLU,
    ScaledGEGLU,
    ScaledGELU,
    ScaledGLU,
    ScaledQGEGLU,
    ScaledQGELU,
    ScaledReGLU,
    ScaledReLU,
    ScaledSiLU,
    ScaledSReGLU,
    ScaledSReLU,
    ScaledSwiGLU,
)
from .situglu import ScaledSiTUGLU, SiTUGLU

__all__ = [
    "GEGLU",
    "GELU",
    "GLU",
    "QGEGLU",
    "QGELU",
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "Bias",
    "ClampedSwiGLU",
    "ConstantScale",
    "Dropout",
    "GroupedLinear",
    "Identity",
    "L2Normalization",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "Quantize",
    "RMSNorm",
    "ReGLU",
    "ReLU",
    "ReduceScatter",
    "Reshape",
    "SReGLU",
    "SReLU",
    "ScaledClampedQGeGLU",
    "ScaledClampedSwiGLU",
    "ScaledGEGLU",
    "ScaledGELU",
    "ScaledGLU",
    "ScaledQGEGLU",
    "ScaledQGELU",
    "ScaledReGLU",
    "ScaledReLU",
    "ScaledSReGLU",
    "ScaledSReLU",
    "ScaledSiLU",
    "ScaledSiTUGLU",
    "ScaledSwiGLU",
    "SiLU",
    "SiTUGLU",
    "SwiGLU",
]
