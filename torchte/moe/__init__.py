"""Mixture-of-experts helpers under Transformer Engine's names: the router fusions
(`transformer_engine.pytorch.router`) and token permutation
(`transformer_engine.pytorch.permutation`), and torchte's own whole MoE layer, MoELayer."""

from .layer import MoELayer
from .permutation import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from .router import (
    QBHistogramMode,
    RoutingMapFormat,
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

__all__ = [
    "MoELayer",
    "QBHistogramMode",
    "RoutingMapFormat",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
]
