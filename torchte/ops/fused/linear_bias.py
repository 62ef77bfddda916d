"""Fusion: BasicLinear -> Bias becomes one GEMM with the bias in its epilogue (as te.Linear
computes it), in high precision and in FP8."""

from __future__ import annotations

from ._forward_linear import fuse_forward_linear

__all__ = ["fuse_linear_bias"]


def fuse_linear_bias(steps: list, settings) -> list:
    """The matcher: see the module docstring."""
    return fuse_forward_linear(steps, settings, ())
