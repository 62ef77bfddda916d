"""te.MultiheadAttention's checks and the calls it makes into attention and RoPE, kept apart from
the module so that it stays short: head counts under GQA and tensor parallelism, the options
torchte does not implement, the keyword arguments handed to te.DotProductAttention."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from torchte._options import check_options

__all__ = [
    "HeadShape",
    "attention_kwargs",
    "check_choices",
    "check_inference",
    "check_userbuffers",
    "dot_product_attention",
    "heads",
    "rotate",
]

_QKV_FORMATS = ("sbhd", "bshd", "thd")
_USERBUFFERS = (
    "ub_overlap_ag",
    "ub_overlap_rs",
    "ub_overlap_rs_dgrad",
    "ub_bulk_dgrad",
    "ub_bulk_wgrad",
)
# te.DotProductAttention.forward's defaults: arguments at these values are not passed on.
_ATTENTION_DEFAULTS = {
    "checkpoint_core_attention": False,
    "core_attention_bias_type": "no_bias",
    "fast_zero_fill": True,
}


@dataclass(frozen=True, slots=True)
class HeadShape:
    """Head counts and projection sizes: whole (`q_size` = np hn, `kv_size` = ng hn) and this
    rank's (`local_*`, divided by tp_size)."""

    heads: int
    groups: int
    head_dim: int
    tp_size: int

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp_size

    @property
    def local_groups(self) -> int:
        return self.groups // self.tp_size

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.groups * self.head_dim

    @property
    def local_q_size(self) -> int:
        return self.local_heads * self.head_dim

    @property
    def local_kv_size(self) -> int:
        return self.local_groups * self.head_dim


def heads(hidden_size, num_attention_heads, kv_channels, num_gqa_groups, tp_group, tp_size):
    """The checked HeadShape: kv_channels defaults to hidden_size / num_attention_heads,
    num_gqa_groups to num_attention_heads; ValueError naming the argument otherwise."""
    for name, value in (("hidden_size", hidden_size), ("num_attention_heads", num_attention_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"te.MultiheadAttention: {name} must be a positive int, got {value!r}")
    head_dim = kv_channels if kv_channels else hidden_size // num_attention_heads
    if head_dim <= 0:
        raise ValueError(
            f"te.MultiheadAttention: kv_channels must be positive (hidden_size={hidden_size} "
            f"over num_attention_heads={num_attention_heads} gives {head_dim})"
        )
    groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
    if groups <= 0 or num_attention_heads % groups:
        raise ValueError(
            f"te.MultiheadAttention: num_gqa_groups={num_gqa_groups} must divide "
            f"num_attention_heads={num_attention_heads}"
        )
    if tp_group is not None and dist.is_initialized():
        tp_size = dist.get_world_size(tp_group)
    if groups % tp_size:
        raise ValueError(
            f"te.MultiheadAttention: tp_size={tp_size} must divide num_gqa_groups={groups}"
        )
    return HeadShape(num_attention_heads, groups, head_dim, tp_size)


def check_choices(attention_type, qkv_format, layer_number, set_parallel_mode, shape) -> None:
    """ValueError naming the argument for a value outside Transformer Engine's choices."""
    if attention_type not in ("self", "cross"):
        raise ValueError(
            f"te.MultiheadAttention: attention_type must be 'self' or 'cross', got "
            f"{attention_type!r}"
        )
    if qkv_format not in _QKV_FORMATS:
        raise ValueError(
            f"te.MultiheadAttention: qkv_format must be one of {_QKV_FORMATS}, got {qkv_format!r}"
        )
    if layer_number is not None and layer_number <= 0:
        raise ValueError(
            f"te.MultiheadAttention: layer_number must be a positive int, got {layer_number}"
        )
    if shape.tp_size > 1 and not set_parallel_mode:
        raise ValueError(
            f"te.MultiheadAttention: tp_size={shape.tp_size} splits the heads over the ranks, "
            "which needs set_parallel_mode=True (column-parallel QKV, row-parallel proj)"
        )


def check_userbuffers(owner: str, **flags: bool) -> None:
    """Userbuffers overlap: accepted off, NotImplementedError naming the flag when on."""
    check_options(owner, flags, dict.fromkeys(_USERBUFFERS, False))


def dot_product_attention(*args, softmax_type: str = "vanilla", **kwargs):
    """te.DotProductAttention(*args, **kwargs); softmax_type passed on only when not vanilla."""
    from .dot_product_attention import DotProductAttention  # written beside this package

    if softmax_type != "vanilla":
        kwargs["softmax_type"] = softmax_type
    return DotProductAttention(*args, **kwargs)


def attention_kwargs(given: dict) -> dict:
    """The keyword arguments for te.DotProductAttention.forward: those of `given` that differ
    from its defaults (None, or the value in _ATTENTION_DEFAULTS)."""
    kwargs = {}
    for name, value in given.items():
        if value is None or (name in _ATTENTION_DEFAULTS and value == _ATTENTION_DEFAULTS[name]):
            continue
        kwargs[name] = value
    return kwargs


def check_inference(inference_params, core_attention) -> None:
    """With inference_params: TypeError unless it is a te.InferenceParams, ValueError without a
    layer_number; allocates the layer's cache on first use (as Transformer Engine)."""
    if inference_params is None:
        return
    from .inference import InferenceParams  # written beside this package

    if not isinstance(inference_params, InferenceParams):
        raise TypeError(
            "te.MultiheadAttention: inference_params must be a te.InferenceParams, got "
            f"{type(inference_params).__name__}"
        )
    if not core_attention._layer_number_given:
        raise ValueError(
            "te.MultiheadAttention: inference_params needs layer_number (which names the "
            "layer's KV cache); build the module with layer_number=..."
        )
    if core_attention.layer_number not in inference_params.cache_manager.cache:
        inference_params.allocate_memory(core_attention.layer_number)


def rotate(
    q, k, rotary_pos_emb, qkv_format: str, interleaved: bool, cu_seqlens, inference=None, cp=(1, 0)
):
    """(q, k) with rotary position embeddings applied: rotary_pos_emb one tensor of
    frequencies for both, or a (q, k) pair; cu_seqlens (for q, for kv) under "thd". With
    inference params, each sequence's positions start at its length before the step. cp:
    (cp_size, cp_rank) of context parallelism (the rank's load-balanced positions)."""
    from .rope import apply_rotary_pos_emb  # written beside this package

    if not isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
    if len(rotary_pos_emb) != 2:
        raise ValueError(
            "te.MultiheadAttention: rotary_pos_emb must be a tensor or a (query, key) pair, got "
            f"{len(rotary_pos_emb)} tensors"
        )
    start = None
    if inference is not None:
        cu_seqlens, start = _inference_positions(inference, q, qkv_format, cu_seqlens)
    out = []
    for t, freqs, cu in zip((q, k), rotary_pos_emb, cu_seqlens, strict=True):
        kwargs = {"interleaved": interleaved, "fused": True}  # the Triton kernel on CUDA
        if cp[0] > 1:
            kwargs["cp_size"], kwargs["cp_rank"] = cp
        if cu is not None:
            kwargs["cu_seqlens"] = cu
        if start is not None:
            kwargs["start_positions"] = start
        out.append(apply_rotary_pos_emb(t, freqs, qkv_format, **kwargs))
    return out[0], out[1]


def _inference_positions(inference, q, qkv_format: str, cu_seqlens):
    """(cu_seqlens, start positions int32 [rows]) of a step: thd packs the step's sequences
    (cu_seqlens default to the step's), sbhd / bshd have one row per batch entry."""
    if qkv_format == "thd":
        rows = inference.batch_size
        step_cu = inference.cu_seqlens_q[: rows + 1]
        cu_seqlens = tuple(step_cu if cu is None else cu for cu in cu_seqlens)
    else:
        rows = q.shape[1] if qkv_format == "sbhd" else q.shape[0]
    return cu_seqlens, inference.start_positions(rows)
