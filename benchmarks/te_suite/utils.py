"""The few helpers Transformer Engine's test files import from their utils module, written
for running those files against torchte through the alias."""

import random

import pytest
import torch
from transformer_engine.common.recipe import Recipe

_SAVED = None


class ModelConfig:
    def __init__(
        self,
        batch_size,
        max_seqlen_q,
        num_heads,
        head_dim_qk,
        max_seqlen_kv=None,
        num_gqa_groups=None,
        head_dim_v=None,
        dropout_p=0.0,
        attn_mask_type="no_mask",
        attn_bias_type="no_bias",
        num_layers=1,
        eps=1e-5,
        **rest,
    ):
        self.batch_size, self.max_seqlen_q = batch_size, max_seqlen_q
        self.max_seqlen_kv = max_seqlen_kv or max_seqlen_q
        self.num_heads = num_heads
        self.num_gqa_groups = num_gqa_groups or num_heads
        self.head_dim_qk = head_dim_qk
        self.head_dim_v = head_dim_v or head_dim_qk
        self.kv_channels = (
            self.head_dim_qk
            if self.head_dim_qk == self.head_dim_v
            else (self.head_dim_qk, self.head_dim_v)
        )
        self.hidden_size = num_heads * head_dim_qk
        self.hidden_size_kv = self.num_gqa_groups * self.head_dim_v
        self.dropout_p, self.attn_mask_type, self.attn_bias_type = (
            dropout_p,
            attn_mask_type,
            attn_bias_type,
        )
        self.attn_type = "self" if self.max_seqlen_q == self.max_seqlen_kv else "cross"
        self.num_layers, self.eps = num_layers, eps
        self.window_size = (-1, -1)
        for k, v in rest.items():
            setattr(self, k, v)


def recipe_id(r):
    return type(r).__name__ if isinstance(r, Recipe) else "None"


def skip_unsupported_backward_override(layer_type, quant_recipe, backward_override):
    if backward_override is None:
        return
    if quant_recipe is None:
        pytest.skip("no quantized recipe")
    if quant_recipe.delayed():
        pytest.skip("delayed scaling takes no backward override")
    if layer_type in (
        "layernorm_mlp",
        "layernorm_mlp_nocheckpoint",
        "layernorm_mlp_checkpoint",
        "transformer",
        "transformer_layer",
    ):
        pytest.skip("skipped by the original suite for this layer")


def reset_rng_states():
    global _SAVED
    if _SAVED is None:
        torch.manual_seed(1234)
        torch.cuda.manual_seed(1234)
        random.seed(1234)
        _SAVED = (torch.get_rng_state(), torch.cuda.get_rng_state(), random.getstate())
    else:
        torch.set_rng_state(_SAVED[0])
        torch.cuda.set_rng_state(_SAVED[1])
        random.setstate(_SAVED[2])
