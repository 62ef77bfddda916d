"""Fusion: an activation -> BasicLinear [-> Bias] under FP8 with a fusable input quantizer
(delayed scaling): the activation kernel writes the GEMM's FP8 input, as te.LayerNormMLP does
between its two GEMMs."""

from __future__ import annotations

from ._forward_linear import ACTIVATION_PRODUCERS, fuse_forward_linear

__all__ = ["fuse_activation_linear"]


def fuse_activation_linear(steps: list, settings) -> list:
    """The matcher: see the module docstring."""
    return fuse_forward_linear(steps, settings, ACTIVATION_PRODUCERS)
