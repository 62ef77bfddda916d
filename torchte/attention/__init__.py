"""Attention with Transformer Engine's names: te.DotProductAttention (on PyTorch's own attention
kernels), te.MultiheadAttention, rotary position embeddings and te.InferenceParams (the KV
cache for generation)."""

from .dot_product_attention import DotProductAttention
from .inference import InferenceParams
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb

__all__ = [
    "DotProductAttention",
    "InferenceParams",
    "MultiheadAttention",
    "RotaryPositionEmbedding",
    "apply_fused_qkv_rotary_pos_emb",
    "apply_rotary_pos_emb",
]
