"""The training example's mixture-of-experts MLP: te.moe.MoELayer with its te.LayerNorm (or
te.RMSNorm) first (router, dropless permutation padded to 16 rows an expert, te.ops' fused grouped
MLP with the router's probabilities as row scales, the weighted sum back).

Each token goes to the k experts with the largest router logits, weighted by the softmax over
those k logits (the router's softmax score function without pre-softmax). The experts have
biases, FC2's scaled by the probability like the activation (MoELayer's bias=True), so FC2's
output row is already p * expert(x) and a token's rows are only summed. Each expert GEMM keeps
its weights as one (E, N, K) parameter and its biases as one (E, N) (MoELayer's
single_grouped_weight): no per-step stacking of E parameters, one gradient per GEMM.

Where the experts' row counts live: on the host (a list, one synchronization a step), or on the
device (no step waits for the router: what CUDA graphs need). The model passes that choice
(`device_splits`: True where --cuda-graph captures the layer, see cuda_graph.py); a layer
built without it reads DEVICE_SPLITS, the example's default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchte.moe import MoELayer

# Whether the group sizes stay on the device, so that nothing in a step waits for the router
# (None: on a GPU). Off by default: on an H100 the large MoE example trained 5-6% faster with the
# sizes read back (cuBLAS per expert for the FP8 backward GEMMs, faster than the Triton grouped
# GEMMs that device sizes need; docs/benchmarks.md). Device sizes are what CUDA graphs need.
DEVICE_SPLITS: bool | None = False


class MoEMLP(MoELayer):
    """x (..., H) -> y (..., H): te.moe.MoELayer with its norm (top-k softmax routing,
    per-expert MLPs with biases, weighted sum). Gated activations (swiglu, geglu, ...) make
    FC1 2F wide."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
        init: Callable[[torch.Tensor], None],
        out_init: Callable[[torch.Tensor], None],
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        device_splits: bool | None = None,
        ep_group=None,
    ) -> None:
        """device_splits: the row counts on the device (True) or the host (False); None:
        DEVICE_SPLITS as it is now. ep_group: the experts split over its ranks (expert
        parallelism, ep_run.py; host row counts)."""
        if device_splits is None:
            device_splits = DEVICE_SPLITS
        super().__init__(
            hidden, ffn, num_experts, top_k, activation=activation, params_dtype=dtype,
            device=device, init_method=init, output_layer_init_method=out_init, bias=True,
            device_splits=device_splits, normalization=normalization,
            single_grouped_weight=True, ep_group=ep_group,
        )  # fmt: skip
