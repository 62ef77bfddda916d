"""Transformer Engine's weight initializers (`transformer_engine.pytorch.utils`): functions
that make an `init_method` for a module's `init_method` / `output_layer_init_method`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["init_method_normal", "scaled_init_method_normal"]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init_method filling a tensor in place from N(0, sigma**2)."""
    _check_sigma(sigma)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(
    sigma: float, num_layers: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init_method filling a tensor in place from N(0, (sigma / sqrt(2 num_layers))**2): the
    output layers of a residual stack of num_layers blocks."""
    _check_sigma(sigma)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def _check_sigma(sigma: float) -> None:
    if isinstance(sigma, bool) or not isinstance(sigma, int | float):
        raise ValueError(f"sigma must be a number >= 0, got {sigma!r}")
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be a number >= 0, got {sigma!r}")
