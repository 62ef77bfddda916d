"""Quantizers and the quantized values they make (Storage inside autograd, Tensor outside)."""

from .base import QuantizedStorage, QuantizedTensor, Quantizer
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Storage

__all__ = [
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Storage",
    "QuantizedStorage",
    "QuantizedTensor",
    "Quantizer",
]
