"""Whether Triton can be used: imported once, checked once."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """True when triton imports and a CUDA device is present (computed once)."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
