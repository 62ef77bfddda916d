"""te.MultiheadAttention: the query/key/value projections (with an optional input norm),
te.DotProductAttention, and the output projection, with Transformer Engine's arguments and
submodule names, so that its checkpoints load.

Legend: h = hidden_size, np query heads, ng key/value groups, hn = kv_channels per head,
hq = np hn, hkv = ng hn. hidden_states (s, b, h) for qkv_format "sbhd", (b, s, h) for "bshd",
(t, h) for "thd"; q (..., np, hn), k and v (..., ng, hn); the context (..., hq); the output
(..., h). Under tensor parallelism (set_parallel_mode) np, ng, hq and hkv are this rank's.

Submodules, as Transformer Engine names them:
- self attention: `layernorm_qkv` (te.LayerNormLinear, input_layernorm) or `qkv` (te.Linear),
  one weight of hq + 2 hkv rows (`weight` with fuse_qkv_params, else `query_weight`,
  `key_weight`, `value_weight`; _qkv_layout.py has the row order);
- cross attention: `layernorm_query` (parameters `query_weight`, ... unless fused) or
  `query_layer`, and `key_value` over encoder_output (`key_weight`, `value_weight` unless
  fused);
- `core_attention` (te.DotProductAttention), `proj` (te.Linear, row-parallel under
  set_parallel_mode); `q_norm` / `k_norm` with qk_norm_type.
The GEMMs run in FP8 under te.autocast; attention runs in high precision.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchte._device import default_device
from torchte.autocast import autocast_state
from torchte.module._linear_core import default_init_method
from torchte.module.layernorm_linear import LayerNormLinear
from torchte.module.linear import Linear
from torchte.module.norm import LayerNorm, RMSNorm

from . import _mha_config as config
from ._qkv_layout import split_kv, split_qkv
from .formats import check_hidden_states

__all__ = ["MultiheadAttention"]

_STATE = autocast_state()


class MultiheadAttention(nn.Module):
    """Multi-head attention with Transformer Engine's arguments: projections, attention, output.

    hidden_states (..., hidden_size) -> (..., hidden_size) [, the output bias if return_bias]
    [, the input norm's output if input_layernorm and return_layernorm_output].
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Callable[[torch.Tensor], None] | None = None,
        output_layer_init_method: Callable[[torch.Tensor], None] | None = None,
        layer_number: int | None = None,
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        tp_group=None,
        tp_size: int = 1,
        num_gqa_groups: int | None = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker=None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: torch.device | str | None = None,
        qkv_format: str = "sbhd",
        name: str | None = None,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        config.check_userbuffers(
            "te.MultiheadAttention",
            ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad,
            ub_bulk_wgrad=ub_bulk_wgrad,
        )
        shape = config.heads(
            hidden_size, num_attention_heads, kv_channels, num_gqa_groups, tp_group, tp_size
        )
        config.check_choices(attention_type, qkv_format, layer_number, set_parallel_mode, shape)
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = shape.groups
        self.hidden_size_per_attention_head = shape.head_dim
        self.num_attention_heads_per_partition = shape.local_heads
        self.num_gqa_groups_per_partition = shape.local_groups
        self.tp_size, self.tp_group = shape.tp_size, tp_group
        self.sequence_parallel = shape.tp_size > 1 and sequence_parallel
        self.attention_type, self.qkv_format = attention_type, qkv_format
        self.attn_mask_type, self.window_size = attn_mask_type, window_size
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm = input_layernorm
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        # The interleaved layout exists only for the one fused parameter.
        self.qkv_weight_interleaved = qkv_weight_interleaved and fuse_qkv_params
        self.rotary_pos_interleaved = rotary_pos_interleaved
        self.qk_norm_before_rope = qk_norm_before_rope
        self.__dict__["_cp_size_rank"] = (1, 0)  # context parallelism's (cp_size, cp_rank)
        self.softmax_type, self.name = softmax_type, name
        init_method = init_method or default_init_method
        output_layer_init_method = output_layer_init_method or default_init_method
        gemm_kw = {
            "fuse_wgrad_accumulation": fuse_wgrad_accumulation,
            "tp_group": tp_group,
            "tp_size": shape.tp_size,
            "get_rng_state_tracker": get_rng_state_tracker,
            "sequence_parallel": sequence_parallel,
            "params_dtype": self.params_dtype,
            "device": device,
        }
        self.q_norm, self.k_norm = _qk_norms(
            qk_norm_type, qk_norm_eps, shape.head_dim, device, params_dtype,
            (seq_length, micro_batch_size),
        )  # fmt: skip
        column = "column" if set_parallel_mode else None
        proj_kw = {"init_method": init_method, "bias": bias, "parallel_mode": column}
        norm_kw = {
            "eps": layernorm_epsilon,
            "return_layernorm_output": return_layernorm_output,
            "zero_centered_gamma": zero_centered_gamma,
            "normalization": normalization,
        }
        if attention_type == "self":
            self._make_qkv(shape, fuse_qkv_params, name, proj_kw, norm_kw, gemm_kw)
        else:
            self._make_query_key_value(shape, fuse_qkv_params, name, proj_kw, norm_kw, gemm_kw)
        self.core_attention = config.dot_product_attention(
            num_attention_heads,
            shape.head_dim,
            num_gqa_groups=shape.groups,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            tp_size=shape.tp_size,
            get_rng_state_tracker=get_rng_state_tracker,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            layer_number=layer_number,
            attention_type=attention_type,
            softmax_type=softmax_type,
        )
        if device is not None and self.core_attention.softmax_offset is not None:
            self.core_attention.to(default_device(device))  # the sink logits go with the layer
        self.proj = Linear(
            shape.q_size,
            hidden_size,
            init_method=output_layer_init_method,
            bias=bias,
            return_bias=return_bias,
            parallel_mode="row" if set_parallel_mode else None,
            name=None if name is None else name + ".proj",
            **gemm_kw,
        )

    def _make_qkv(self, shape, fused: bool, name, proj_kw, norm_kw, gemm_kw) -> None:
        """Self attention's one projection to q, k and v: layernorm_qkv or qkv."""
        split = None
        if not fused:  # this rank's rows of each (te.Linear splits its local rows)
            local = shape.local_q_size, shape.local_kv_size, shape.local_kv_size
            split = dict(zip(("query", "key", "value"), local, strict=True))
        out_features = shape.q_size + 2 * shape.kv_size
        if self.input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                self.hidden_size,
                out_features,
                parameters_split=split,
                name=None if name is None else name + ".layernorm_linear_qkv",
                **proj_kw,
                **norm_kw,
                **gemm_kw,
            )
        else:
            self.qkv = Linear(
                self.hidden_size,
                out_features,
                parameters_split=split,
                name=None if name is None else name + ".linear_qkv",
                **proj_kw,
                **gemm_kw,
            )

    def _make_query_key_value(self, shape, fused: bool, name, proj_kw, norm_kw, gemm_kw) -> None:
        """Cross attention's projections: layernorm_query or query_layer, and key_value."""
        if self.input_layernorm:
            self.layernorm_query = LayerNormLinear(
                self.hidden_size,
                shape.q_size,
                parameters_split=None if fused else ("query",),
                name=None if name is None else name + ".layernorm_linear_q",
                **proj_kw,
                **norm_kw,
                **gemm_kw,
            )
        else:
            self.query_layer = Linear(self.hidden_size, shape.q_size, **proj_kw, **gemm_kw)
        self.key_value = Linear(
            self.hidden_size,
            2 * shape.kv_size,
            parameters_split=None if fused else ("key", "value"),
            name=None if name is None else name + ".linear_kv",
            **proj_kw,
            **gemm_kw,
        )

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group of every projection (when the module was built
        before the group existed); its size must be tp_size."""
        self.__dict__["tp_group"] = tp_group
        for module in self.children():
            if hasattr(module, "set_tensor_parallel_group"):
                module.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """Context parallelism: the core attention's group (see te.DotProductAttention), and
        RoPE at this rank's positions (cp_size / cp_rank of the group)."""
        self.core_attention.set_context_parallel_group(
            cp_group, cp_global_ranks, cp_stream, cp_comm_type
        )
        cp = self.core_attention._cp
        self.__dict__["_cp_size_rank"] = (1, 0) if cp is None else (cp.size, cp.rank)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_output: torch.Tensor | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        is_first_microbatch: bool | None = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb=None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: bool | None = None,
    ):
        """hidden_states (..., hidden_size) -> out (..., hidden_size) [, bias] [, norm output].

        encoder_output (..., hidden_size) feeds key_value in cross attention. rotary_pos_emb:
        one tensor of frequencies (s, 1, 1, hn) for q and k, or a (q, k) pair.
        """
        if _STATE.enabled and _STATE.recipe.fp8_mha:
            raise NotImplementedError(
                "te.MultiheadAttention: the recipe's fp8_mha=True (FP8 between the projections "
                "and attention) is not implemented; attention runs in high precision"
            )
        self._check_inputs(hidden_states, encoder_output)
        config.check_inference(inference_params, self.core_attention)
        q, k, v, norm_out = self._query_key_value(
            hidden_states, encoder_output, is_first_microbatch
        )
        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self._normed(q, k, v.dtype)
        if rotary_pos_emb is not None:
            cu_q, cu_kv = (
                (cu_seqlens_q_padded, cu_seqlens_kv_padded)
                if pad_between_seqs
                else (cu_seqlens_q, cu_seqlens_kv)
            )
            q, k = config.rotate(
                q, k, rotary_pos_emb, self.qkv_format, self.rotary_pos_interleaved,
                (cu_q, cu_kv), inference_params, self._cp_size_rank,
            )  # fmt: skip
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self._normed(q, k, v.dtype)
        given = {
            "qkv_format": self.qkv_format,
            "attention_mask": attention_mask,
            "attn_mask_type": self.attn_mask_type if attn_mask_type is None else attn_mask_type,
            "window_size": self.window_size if window_size is None else window_size,
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_kv": cu_seqlens_kv,
            "cu_seqlens_q_padded": cu_seqlens_q_padded,
            "cu_seqlens_kv_padded": cu_seqlens_kv_padded,
            "max_seqlen_q": max_seqlen_q,
            "max_seqlen_kv": max_seqlen_kv,
            "checkpoint_core_attention": checkpoint_core_attention,
            "core_attention_bias_type": core_attention_bias_type,
            "core_attention_bias": core_attention_bias,
            "alibi_slopes": alibi_slopes,
            "fast_zero_fill": fast_zero_fill,
            "inference_params": inference_params,
            "pad_between_seqs": pad_between_seqs,
        }
        context = self.core_attention(q, k, v, **config.attention_kwargs(given))
        out = self.proj(context, is_first_microbatch=is_first_microbatch)
        outputs = out if self.return_bias else (out,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs += (norm_out,)
        return outputs if len(outputs) > 1 else outputs[0]

    def _normed(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype):
        """(q_norm(q), k_norm(k)) in `dtype`, the value's. Each norm computes in torch.autocast's
        dtype where it is on, else in its parameters' dtype; norms kept in another dtype than
        the projections (fp32 q_norm / k_norm in a bf16 model) would otherwise hand attention q
        and k of another dtype than v."""
        q, k = self.q_norm(q), self.k_norm(k)
        if q.dtype is not dtype:
            q = q.to(dtype)
        if k.dtype is not dtype:
            k = k.to(dtype)
        return q, k

    def _check_inputs(self, hidden_states, encoder_output) -> None:
        """hidden_states (and cross attention's encoder_output, where given) in qkv_format's
        layout with hidden_size features: ValueError naming the layout otherwise."""
        owner, size, fmt = "te.MultiheadAttention", self.hidden_size, self.qkv_format
        check_hidden_states(owner, "hidden_states", hidden_states, size, fmt, "qkv_format")
        if encoder_output is not None and self.attention_type == "cross":
            check_hidden_states(owner, "encoder_output", encoder_output, size, fmt, "qkv_format")

    def _query_key_value(self, hidden_states, encoder_output, is_first_microbatch):
        """(q (..., np, hn), k, v (..., ng, hn), the input norm's output or None)."""
        norm_out = None
        hn = self.hidden_size_per_attention_head
        groups = self.num_gqa_groups_per_partition
        if self.attention_type == "self":
            layer = self.layernorm_qkv if self.input_layernorm else self.qkv
            mixed = layer(hidden_states, is_first_microbatch=is_first_microbatch)
            if self.input_layernorm and self.return_layernorm_output:
                mixed, norm_out = mixed
            heads = self.num_attention_heads_per_partition
            q, k, v = split_qkv(mixed, heads, groups, hn, self.qkv_weight_interleaved)
            return q, k, v, norm_out
        if encoder_output is None:
            raise ValueError(
                "te.MultiheadAttention: encoder_output is required with attention_type='cross'"
            )
        mixed_kv = self.key_value(encoder_output, is_first_microbatch=is_first_microbatch)
        k, v = split_kv(mixed_kv, groups, hn, self.qkv_weight_interleaved)
        layer = self.layernorm_query if self.input_layernorm else self.query_layer
        q = layer(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.input_layernorm and self.return_layernorm_output:
            q, norm_out = q
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, hn)
        return q, k, v, norm_out


def _qk_norms(qk_norm_type: str | None, eps: float, head_dim: int, device, params_dtype, sizes):
    """(q_norm, k_norm) over the head dim hn for qk_norm_type, or (None, None): norms with
    parameters in params_dtype, as Transformer Engine builds them (its parameter-free
    L2Normalization is one module under both names; here two, each with its own hooks).
    sizes: (seq_length, micro_batch_size)."""
    if qk_norm_type is None:
        return None, None
    norms = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}
    if qk_norm_type == "L2Normalization":
        from torchte.ops import L2Normalization

        seq_length, micro_batch_size = sizes
        l2 = {"eps": eps, "seq_length": seq_length, "micro_batch_size": micro_batch_size}
        return L2Normalization(**l2, device=device), L2Normalization(**l2, device=device)
    if qk_norm_type not in norms:
        raise ValueError(
            "te.MultiheadAttention: qk_norm_type must be None, 'L2Normalization', 'RMSNorm' or "
            f"'LayerNorm', got {qk_norm_type!r}"
        )
    kwargs = {"normalized_shape": head_dim, "eps": eps, "device": device}
    cls = norms[qk_norm_type]
    return cls(params_dtype=params_dtype, **kwargs), cls(params_dtype=params_dtype, **kwargs)
