"""te.distributed's recompute names: `checkpoint` (activation recompute under the forward's FP8
settings and scales; also `te.checkpoint`) and Transformer Engine's recompute flags for
clients that recompute by themselves. They live in torchte/recompute.py."""

from __future__ import annotations

from torchte.recompute import (
    activation_recompute_forward,
    checkpoint,
    get_activation_recompute_contexts,
    in_fp8_activation_recompute_phase,
    is_fp8_activation_recompute_enabled,
)

__all__ = [
    "activation_recompute_forward",
    "checkpoint",
    "get_activation_recompute_contexts",
    "in_fp8_activation_recompute_phase",
    "is_fp8_activation_recompute_enabled",
]
