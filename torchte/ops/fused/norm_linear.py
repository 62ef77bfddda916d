"""Fusion: LayerNorm / RMSNorm -> BasicLinear [-> Bias] under FP8 with a fusable input
quantizer (delayed scaling): the norm kernel writes the GEMM's FP8 input (norm -> quantize),
as te.LayerNormLinear does."""

from __future__ import annotations

from ._forward_linear import NORM_PRODUCERS, fuse_forward_linear

__all__ = ["fuse_norm_linear"]


def fuse_norm_linear(steps: list, settings) -> list:
    """The matcher: see the module docstring."""
    return fuse_forward_linear(steps, settings, NORM_PRODUCERS)
