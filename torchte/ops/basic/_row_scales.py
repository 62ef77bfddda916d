"""The check of an extra input holding one scale per row (a scaled activation's scales, a
grouped linear's bias scales), shared by the ops that take one."""

from __future__ import annotations

import torch

__all__ = ["check_row_scales"]


def check_row_scales(who: str, what: str, scales, rows: int, device=None) -> None:
    """TypeError unless `scales` is a floating-point tensor; ValueError unless it has `rows`
    elements and (where `device` is given) sits on `device`. `who` names the op, `what` the
    extra input, in the messages."""
    if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
        raise TypeError(f"{who}: {what} must be a floating-point tensor, got {scales!r:.80}")
    if scales.numel() != rows:
        raise ValueError(
            f"{who}: {what} has shape {tuple(scales.shape)}, but the input has {rows} rows: "
            "one scale per row"
        )
    if device is not None and scales.device != device:
        raise ValueError(f"{who}: {what} is on {scales.device}, the input on {device}")
