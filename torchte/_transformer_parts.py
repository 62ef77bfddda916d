"""What te.TransformerLayer adds between its blocks: bias + dropout + residual add, stochastic
depth (DropPath), and its constructor's checks.

Legend: x, bias, residual (..., h) in the compute dtype; drop path draws one keep/drop per
sample along dim 0 (the batch of "bshd", the sequence of "sbhd", as Transformer Engine draws
it). Dropout and drop path draw from torch's default generator, as Transformer Engine's do
(attention dropout, inside te.DotProductAttention, forks get_rng_state_tracker's state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DropPath", "bias_dropout_add", "check_layer_options", "check_userbuffers"]

_LAYER_TYPES = ("encoder", "decoder")
_FORMATS = ("sbhd", "bshd", "thd")


class DropPath(nn.Module):
    """Stochastic depth: in training, each sample (dim 0) is zeroed with probability
    drop_prob and the others scaled by 1 / (1 - drop_prob); the identity in eval. No
    parameters. x (n, ...) -> (n, ...). drop_prob 1 (which Transformer Engine accepts) drops
    every sample: the branch contributes zeros, where 1 / (1 - drop_prob) would make NaN."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= drop_prob <= 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1], got {drop_prob}")
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, ...) -> x with whole samples dropped (training) or x (eval)."""
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        # The same draw at every rate, as Transformer Engine's: the RNG streams stay aligned.
        mask = (keep + torch.rand(shape, dtype=x.dtype, device=x.device)).floor_()
        if keep == 0.0:
            return x * mask  # all zeros
        return x.div(keep) * mask

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    drop_path: DropPath | None = None,
) -> torch.Tensor:
    """residual + drop_path(dropout(x + bias, p)): x, residual (..., h), bias (h,) or None."""
    if bias is not None:
        x = x + bias
    out = F.dropout(x, p=p, training=training)
    if drop_path is not None:
        out = drop_path(out)
    return residual + out


def check_layer_options(
    layer_type: str,
    attn_input_format: str,
    parallel_attention_mlp: bool,
    apply_residual_connection_post_layernorm: bool,
    output_layernorm: bool,
    fuse_qkv_params: bool,
    fuse_wgrad_accumulation: bool,
    hidden_dropout: float,
) -> None:
    """ValueError naming the argument where Transformer Engine refuses a combination."""
    owner = "te.TransformerLayer"
    if layer_type not in _LAYER_TYPES:
        raise ValueError(f"{owner}: layer_type must be one of {_LAYER_TYPES}, got {layer_type!r}")
    if attn_input_format not in _FORMATS:
        raise ValueError(
            f"{owner}: attn_input_format must be one of {_FORMATS}, got {attn_input_format!r}"
        )
    if parallel_attention_mlp:
        if layer_type != "encoder":
            raise ValueError(f"{owner}: parallel_attention_mlp needs layer_type='encoder'")
        if apply_residual_connection_post_layernorm or output_layernorm:
            raise ValueError(
                f"{owner}: parallel_attention_mlp cannot be combined with "
                "apply_residual_connection_post_layernorm or output_layernorm"
            )
    if fuse_wgrad_accumulation and not fuse_qkv_params:
        raise ValueError(f"{owner}: fuse_wgrad_accumulation=True needs fuse_qkv_params=True")
    if not 0.0 <= hidden_dropout <= 1.0:
        raise ValueError(f"{owner}: hidden_dropout must be in [0, 1], got {hidden_dropout}")


def check_userbuffers(ub_tp_comm_overlap: bool) -> None:
    """Transformer Engine's layer turns its ub_* flags on only with ub_tp_comm_overlap (so they
    have no effect while it is off): NotImplementedError when it is on."""
    if ub_tp_comm_overlap:
        raise NotImplementedError(
            "te.TransformerLayer: ub_tp_comm_overlap=True (userbuffers overlap) is not "
            "implemented in torchte yet; leave it off"
        )
