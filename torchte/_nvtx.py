"""NVTX ranges, only when TORCHTE_NVTX=1 (DESIGN.md rule 8); a no-op otherwise."""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("TORCHTE_NVTX", "0") == "1"
_open_ranges = [0]


def range_push(name: str) -> None:
    """Open a named range when NVTX is enabled."""
    if ENABLED:
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_push(name)
        _open_ranges[0] += 1


def range_pop() -> None:
    """Close the innermost range when NVTX is enabled."""
    if ENABLED:
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_pop()
        _open_ranges[0] -= 1


def open_ranges() -> int:
    """How many ranges are open now (0 outside any forward or backward)."""
    return _open_ranges[0]
