"""Transformer Engine's `get_dummy_wgrad`: one cached placeholder weight gradient per shape and
dtype, what a backward hands autograd for a weight whose gradient already went into `main_grad`
(`from transformer_engine.pytorch.module.base import get_dummy_wgrad`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchte._device import default_device

__all__ = ["get_dummy_wgrad"]

# (shape, dtype, device) -> the tensor handed out; a plain dict (torch.compile traces it).
_DUMMY_WGRADS: dict[tuple, torch.Tensor] = {}


def get_dummy_wgrad(shape: Sequence[int], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """A cached tensor of `shape` and `dtype` (zeros when made; `zero=True` fills it with zeros
    again, in case a caller wrote into it), on the default device (CUDA where there is a GPU,
    else the CPU, unless torch's default device is set). The same storage each call for the same
    shape, dtype and device; it never requires grad."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"get_dummy_wgrad: dtype must be a torch.dtype, got {dtype!r}")
    shape = tuple(int(size) for size in shape)
    if any(size < 0 for size in shape):
        raise ValueError(f"get_dummy_wgrad: shape must hold non-negative sizes, got {shape}")
    device = default_device(None)
    key = (shape, dtype, device)
    dummy = _DUMMY_WGRADS.get(key)
    if dummy is None:
        dummy = _DUMMY_WGRADS[key] = torch.zeros(shape, dtype=dtype, device=device)
    elif zero:
        dummy.zero_()
    return dummy.detach()
