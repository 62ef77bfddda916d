"""Attention with Transformer Engine's names: te.DotProductAttention (on PyTorch's own attention
kernels), rotary position embeddings, and the inference KV cache."""

from .dot_product_attention import DotProductAttention
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__: list[str] = []
__all__ += ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]
__all__ += ["DotProductAttention"]

from .multi_head_attention import MultiheadAttention  # noqa: E402

__all__ += ["MultiheadAttention"]
