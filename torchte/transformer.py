"""te.TransformerLayer: self attention, optional cross attention (decoder), and an MLP, each
added to the residual stream, with Transformer Engine's arguments and submodule names
(`self_attention`, `inter_attention`, `layernorm_mlp`, `layernorm`), so checkpoints load.

Legend: x (s, b, h) for attn_input_format "sbhd", (b, s, h) for "bshd", (t, h) for "thd";
every block's output and bias (..., h) in the compute dtype. The default layer is pre-norm:
    x = x + dropout(self_attention(norm(x)) + b_proj)          (norm inside layernorm_qkv)
    x = x + dropout(inter_attention(norm(x), encoder_output))  (decoder only)
    y = x + dropout(layernorm_mlp(x))                           (its norm inside)
apply_residual_connection_post_layernorm takes each residual from the block's norm output;
output_layernorm moves the attention norm to the end (y = layernorm(y)); parallel_attention_mlp
computes attention and MLP from the same x: y = x + dropout(attention + mlp).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchte._transformer_parts import (
    DropPath,
    bias_dropout_add,
    check_layer_options,
    check_userbuffers,
)
from torchte.attention.formats import check_hidden_states
from torchte.attention.multi_head_attention import MultiheadAttention
from torchte.module.layernorm_mlp import LayerNormMLP
from torchte.module.norm import LayerNorm, RMSNorm

__all__ = ["TransformerLayer"]


class TransformerLayer(nn.Module):
    """An attention block and an MLP with residual connections, Transformer Engine's layer.

    hidden_states (..., hidden_size) -> (..., hidden_size); FP8 GEMMs under te.autocast.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Callable[[torch.Tensor], None] | None = None,
        output_layer_init_method: Callable[[torch.Tensor], None] | None = None,
        layer_number: int | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_window_size: tuple[int, int] | None = None,
        tp_group=None,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        get_rng_state_tracker=None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        device: torch.device | str | None = None,
        attn_input_format: str = "sbhd",
        name: str | None = None,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
        activation_params: dict | None = None,
    ) -> None:
        super().__init__()
        check_userbuffers(ub_tp_comm_overlap)
        check_layer_options(
            layer_type,
            attn_input_format,
            parallel_attention_mlp,
            apply_residual_connection_post_layernorm,
            output_layernorm,
            fuse_qkv_params,
            fuse_wgrad_accumulation,
            hidden_dropout,
        )
        if tp_group is not None and torch.distributed.is_initialized():
            tp_size = torch.distributed.get_world_size(tp_group)
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and sequence_parallel
        self.layer_type, self.layer_number = layer_type, layer_number
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = enc_dec_window_size
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.output_layernorm, self.parallel_attention_mlp = (
            output_layernorm,
            parallel_attention_mlp,
        )
        self.hidden_dropout, self.seq_length = hidden_dropout, seq_length
        self.attn_input_format, self.name = attn_input_format, name
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        post_ln = apply_residual_connection_post_layernorm
        attention_args = (
            hidden_size,
            num_attention_heads,
            self.kv_channels,
            attention_dropout,
            layernorm_epsilon,
            init_method,
            output_layer_init_method,
        )
        attention_kw = {
            "layer_number": layer_number,
            "tp_group": tp_group,
            "tp_size": tp_size,
            "num_gqa_groups": num_gqa_groups,
            "fuse_wgrad_accumulation": fuse_wgrad_accumulation,
            "get_rng_state_tracker": get_rng_state_tracker,
            "sequence_parallel": self.sequence_parallel,
            "params_dtype": params_dtype,
            "return_layernorm_output": post_ln,
            "set_parallel_mode": set_parallel_mode,
            "fuse_qkv_params": fuse_qkv_params,
            "zero_centered_gamma": zero_centered_gamma,
            "qkv_weight_interleaved": qkv_weight_interleaved,
            "qkv_format": attn_input_format,
            "bias": bias,
            "normalization": normalization,
            "device": device,
            "qk_norm_type": qk_norm_type,
            "qk_norm_eps": qk_norm_eps,
            "qk_norm_before_rope": qk_norm_before_rope,
            "softmax_type": softmax_type,
        }
        self.self_attention = MultiheadAttention(
            *attention_args,
            **attention_kw,
            attn_mask_type=self_attn_mask_type,
            window_size=window_size,
            input_layernorm=not output_layernorm,
            attention_type="self",
            return_bias=not parallel_attention_mlp,
            name=None if name is None else name + ".self_attention",
        )
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args,
                **attention_kw,
                attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size,
                input_layernorm=True,
                attention_type="cross",
                return_bias=True,
                name=None if name is None else name + ".inter_attention",
            )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            tp_group=tp_group,
            tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            bias=bias,
            return_bias=not parallel_attention_mlp,
            sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype,
            return_layernorm_output=post_ln,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma,
            activation=activation,
            activation_params=activation_params,
            normalization=normalization,
            device=device,
            name=None if name is None else name + ".layernorm_mlp",
        )
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        if output_layernorm:
            norm = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[normalization]
            self.layernorm = norm(
                hidden_size,
                eps=layernorm_epsilon,
                sequence_parallel=self.sequence_parallel,
                params_dtype=params_dtype,
                zero_centered_gamma=zero_centered_gamma,
                device=device,
            )

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group of every submodule that has one (each
        attention block passes it on to its own projections and attention, once)."""
        for module in self.children():
            if hasattr(module, "set_tensor_parallel_group"):
                module.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """Context parallelism of the self-attention block (te.MultiheadAttention's: its core
        attention's group and RoPE at this rank's positions)."""
        self.self_attention.set_context_parallel_group(
            cp_group, cp_global_ranks, cp_stream, cp_comm_type
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        self_attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        encoder_output: torch.Tensor | None = None,
        enc_dec_attn_mask=None,
        enc_dec_attn_mask_type: str | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
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
    ) -> torch.Tensor:
        """hidden_states (..., hidden_size) -> (..., hidden_size).

        encoder_output (..., hidden_size): the keys and values of the decoder's cross
        attention; the other arguments go to the attention blocks as in
        te.MultiheadAttention.forward.
        """
        hidden_states = self._checked_input(hidden_states)
        attn_out = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type or self.self_attn_mask_type,
            window_size=self.window_size if window_size is None else window_size,
            inference_params=inference_params,
            is_first_microbatch=is_first_microbatch,
            checkpoint_core_attention=checkpoint_core_attention,
            rotary_pos_emb=rotary_pos_emb,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            fast_zero_fill=fast_zero_fill,
            pad_between_seqs=pad_between_seqs,
        )
        if self.parallel_attention_mlp:
            mlp_out = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
            return self._residual(attn_out, mlp_out, hidden_states, self.drop_path)
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            out, out_bias, residual = attn_out
        else:
            (out, out_bias), residual = attn_out, hidden_states
        hidden_states = self._residual(out, out_bias, residual, self.drop_path)
        if self.layer_type == "decoder":
            hidden_states = self._cross_attention(
                hidden_states,
                encoder_output,
                enc_dec_attn_mask,
                enc_dec_attn_mask_type or self.enc_dec_attn_mask_type,
                self.enc_dec_window_size if enc_dec_window_size is None else enc_dec_window_size,
                (is_first_microbatch, checkpoint_core_attention, fast_zero_fill),
                (core_attention_bias_type, core_attention_bias, alibi_slopes),
            )
        mlp_outputs = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            out, out_bias, residual = mlp_outputs
        else:
            (out, out_bias), residual = mlp_outputs, hidden_states
        output = self._residual(out, out_bias, residual, self.drop_path)
        if self.output_layernorm:
            output = self.layernorm(output)
        return output

    def _checked_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states, contiguous, in torch.autocast's dtype where it is on; ValueError when
        its layout is not attn_input_format's with hidden_size features, or a sequence-parallel
        input does not hold this rank's seq_length / tp_size rows."""
        check_hidden_states(
            "te.TransformerLayer",
            "hidden_states",
            hidden_states,
            self.self_attention.hidden_size,
            self.attn_input_format,
            "attn_input_format",
        )
        if self.sequence_parallel and self.seq_length is not None:
            rows = self.seq_length // self.tp_size
            if hidden_states.shape[0] != rows:
                raise ValueError(
                    f"te.TransformerLayer: with sequence_parallel, hidden_states must hold this "
                    f"rank's {rows} of seq_length={self.seq_length} rows in dim 0, got "
                    f"{hidden_states.shape[0]}"
                )
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))
        return hidden_states.contiguous()

    def _cross_attention(self, x, encoder_output, mask, mask_type, window, flags, bias_args):
        """x + dropout(inter_attention(x, encoder_output)): the decoder's cross-attention block
        (no drop path, as in Transformer Engine)."""
        if encoder_output is None:
            raise ValueError("te.TransformerLayer: layer_type='decoder' needs encoder_output")
        is_first_microbatch, checkpoint_core_attention, fast_zero_fill = flags
        bias_type, bias, alibi_slopes = bias_args
        outputs = self.inter_attention(
            x,
            attention_mask=mask,
            attn_mask_type=mask_type,
            window_size=window,
            encoder_output=encoder_output,
            is_first_microbatch=is_first_microbatch,
            checkpoint_core_attention=checkpoint_core_attention,
            core_attention_bias_type=bias_type,
            core_attention_bias=bias,
            alibi_slopes=alibi_slopes,
            fast_zero_fill=fast_zero_fill,
        )
        if self.apply_residual_connection_post_layernorm:
            out, out_bias, residual = outputs
        else:
            (out, out_bias), residual = outputs, x
        return self._residual(out, out_bias, residual, None)

    def _residual(self, x, bias, residual, drop_path):
        return bias_dropout_add(x, bias, residual, self.hidden_dropout, self.training, drop_path)
