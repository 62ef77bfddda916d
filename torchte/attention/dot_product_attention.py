"""te.DotProductAttention: Transformer Engine's core attention (softmax(Q K^T * scale) V with
its masks, sliding windows, GQA, dropout, ALiBi and bias) on PyTorch's own attention kernels.

Legend: s sequence, b batch, h query heads of this rank, hg key/value heads of this rank,
d / dv head sizes (kv_channels), t total tokens of a packed (thd) batch.

    attn = te.DotProductAttention(num_attention_heads=16, kv_channels=64, num_gqa_groups=4)
    out = attn(q, k, v)        # q [s, b, 16, 64], k / v [s, b, 4, 64] -> out [s, b, 1024]

Backends (backends.py): SDPA, flex_attention and a math path, chosen once per signature.
FP8 attention is not offered: under te.autocast the attention computes in the input dtype.
Attention sinks (softmax_type "off-by-one" / "learnable", _sinks.py) run on flex or math.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .._device import default_device
from ..distributed import context_parallel as cp_attention
from ..module._setattr_guard import SetattrGuard
from ..recompute import checkpoint
from ._cp_call import check_cp_call, cp_group_for, group_size
from ._dpa_cached import forward_cached
from ._sinks import SOFTMAX_TYPES
from .backends import (
    AttentionInputs,
    BackendKey,
    check_backend,
    choose_backend,
    env_backend,
    max_logits,
    run_backend,
)
from .formats import Shapes, check_qkv, check_qkv_format, from_bhsd, to_bhsd
from .inference import InferenceParams
from .masks import (
    alibi_bias,
    check_alibi_slopes,
    check_bias,
    check_window_size,
    default_alibi_slopes,
    dense_plan,
    normalize_mask_type,
    plan_mask,
)
from .packed import BACKENDS as PACKED_BACKENDS
from .packed import packed_attention

__all__ = ["DotProductAttention"]

_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


def _channels(kv_channels) -> tuple[int, int]:
    """kv_channels as (key channels, value channels)."""
    pair = (kv_channels, kv_channels) if isinstance(kv_channels, int) else tuple(kv_channels)
    if len(pair) != 2 or not all(isinstance(c, int) and c > 0 for c in pair):
        raise ValueError(
            f"kv_channels must be a positive int or a (k, v) pair, got {kv_channels!r}"
        )
    return pair


class DotProductAttention(SetattrGuard):
    """Transformer Engine's DotProductAttention: q, k, v in qkv_format ("sbhd", "bshd" or
    "thd") -> the attention output [s, b, h * dv], [b, s, h * dv] or [t, h * dv].

    The constructor and forward take Transformer Engine 2.x's arguments in its order (see
    docs/compat.md for what each does here); `attention_backend` (torchte only: "auto",
    "sdpa", "flex" or "math", default TORCHTE_ATTN_BACKEND or "auto") forces a backend.
    Heads are this rank's: num_attention_heads / tp_size and num_gqa_groups / tp_size.
    softmax_type "off-by-one" or "learnable" adds a sink to every softmax denominator:
    `softmax_offset` [heads of this rank] float32, zeros (a non-persistent buffer for
    "off-by-one", a Parameter for "learnable", as Transformer Engine names it; None when
    "vanilla").
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        tp_group=None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks: list[int] | None = None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool = False,
        bottom_right_diagonal: bool | None = None,
        name: str | None = None,
        *,
        attention_backend: str | None = None,
    ) -> None:
        super().__init__()
        self.__dict__["_initialized"] = False
        self.kv_channels = _channels(kv_channels)
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = (
            self.kv_channels
        )
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.tp_group = tp_group
        self.tp_size = tp_size if tp_group is None else group_size(tp_group)
        self._check_heads()
        self.num_attention_heads_per_partition = num_attention_heads // self.tp_size
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = check_qkv_format(qkv_format)
        self.attn_mask_type = normalize_mask_type(attn_mask_type)
        self.window_size = check_window_size(self.attn_mask_type, window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type must be 'self' or 'cross', got {attention_type!r}")
        self.attention_type = attention_type
        self.layer_number = 1 if layer_number is None else layer_number
        self._layer_number_given = layer_number is not None  # the KV cache needs it given
        self.sequence_parallel = sequence_parallel
        self._cp = cp_group_for(cp_group, cp_comm_type, cp_stream)
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type
        self.softmax_scale = (
            1.0 / math.sqrt(self.kv_channels[0]) if softmax_scale is None else float(softmax_scale)
        )
        self._check_unsupported(softmax_type, return_max_logit)
        self.softmax_type, self.return_max_logit, self.name = softmax_type, return_max_logit, name
        self._make_softmax_offset(softmax_type)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_states_tracker = None
        if get_rng_state_tracker is not None and not sequence_parallel:
            self.rng_states_tracker = get_rng_state_tracker()
        self.attention_backend = (
            env_backend() if attention_backend is None else check_backend(attention_backend)
        )
        self.__dict__["_initialized"] = True

    def _check_heads(self) -> None:
        heads, groups, tp = self.num_attention_heads, self.num_gqa_groups, self.tp_size
        for name, value in (("num_attention_heads", heads), ("num_gqa_groups", groups)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if heads % groups != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) must be divisible by num_gqa_groups ({groups})"
            )
        if not isinstance(tp, int) or tp <= 0 or heads % tp != 0 or groups % tp != 0:
            raise ValueError(
                f"tp_size ({tp}) must divide num_attention_heads ({heads}) and num_gqa_groups "
                f"({groups})"
            )

    @staticmethod
    def _check_unsupported(softmax_type: str, return_max_logit: bool) -> None:
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
        if not isinstance(return_max_logit, bool):
            raise TypeError(f"return_max_logit must be a bool, got {return_max_logit!r}")

    def _make_softmax_offset(self, softmax_type: str) -> None:
        """The sink logits of this rank's heads: zeros, float32 (torch's default dtype), on the
        module's default device; a Parameter when learnable."""
        if softmax_type == "vanilla":
            self.softmax_offset = None
            return
        zeros = torch.zeros(
            self.num_attention_heads_per_partition,
            dtype=torch.get_default_dtype(),
            device=default_device(None),
        )
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(zeros)
        else:  # off-by-one: a fixed 0 logit, moved with the module, not in the state dict
            self.register_buffer("softmax_offset", zeros, persistent=False)

    def _sink(self, heads: int, q: torch.Tensor) -> torch.Tensor | None:
        """softmax_offset as fp32 [heads] for the backends (None for "vanilla"), checked."""
        offset = self.softmax_offset
        if offset is None:
            return None
        if offset.shape != (heads,):
            raise ValueError(
                f"softmax_offset must have one logit per query head of this rank ({heads}), got "
                f"shape {list(offset.shape)}"
            )
        if offset.device != q.device:
            raise ValueError(
                f"softmax_offset is on {offset.device}, query_layer on {q.device}: move the "
                "module with .to()"
            )
        return offset.float()

    def set_context_parallel_group(
        self, cp_group, cp_global_ranks: list[int] | None, cp_stream, cp_comm_type: str = "p2p"
    ) -> None:
        """Transformer Engine's context-parallel setup: the inputs of forward are then this
        rank's load-balanced share of each sequence (torchte.distributed.context_parallel)."""
        self._fast_setattr("_cp", cp_group_for(cp_group, cp_comm_type, cp_stream))
        for key, value in (
            ("cp_group", cp_group),
            ("cp_global_ranks", cp_global_ranks),
            ("cp_stream", cp_stream),
            ("cp_comm_type", cp_comm_type),
        ):
            self._fast_setattr(key, value)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel group (its size must be the tp_size the heads were split by)."""
        if tp_group is not None and group_size(tp_group) != self.tp_size:
            raise ValueError(
                f"tp_group has {group_size(tp_group)} ranks but the module was built for "
                f"tp_size={self.tp_size}"
            )
        self._fast_setattr("tp_group", tp_group)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_attention_heads_per_partition}, "
            f"gqa_groups={self.num_gqa_groups_per_partition}, kv_channels={self.kv_channels}, "
            f"qkv_format={self.qkv_format}, attn_mask_type={self.attn_mask_type}, "
            f"window_size={self.window_size}, attention_dropout={self.attention_dropout}"
        )

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        fast_zero_fill: bool = True,
        inference_params: Any = None,
        pad_between_seqs: bool | None = None,
        fp8_output: bool = False,
        num_splits: int | None = 1,
        bottom_right_diagonal: bool | None = None,
        *,
        attention_backend: str | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of query_layer over key_layer / value_layer.

        sbhd: q [sq, b, h, d], k [skv, b, hg, d], v [skv, b, hg, dv] -> [sq, b, h * dv];
        bshd: the same with b first -> [b, sq, h * dv]; thd: q [t, h, d], k [t_kv, hg, d],
        v [t_kv, hg, dv] with cu_seqlens_q / cu_seqlens_kv (int32 [b + 1]) -> [t, h * dv].
        attention_mask is True where masked out: [b, 1, 1, s] (or a (q, kv) pair) for padding
        types, [b|1, h|1, sq, skv] for "arbitrary"; padding may come as cu_seqlens instead.
        core_attention_bias: [1|b, 1|h, sq, skv]; alibi_slopes: fp32 [h] or [b, h].
        Query rows that see no key (padding) give zeros. fast_zero_fill and num_splits are
        accepted with no effect; pad_between_seqs follows from cu_seqlens_*_padded.
        With return_max_logit (sbhd, bshd): (out, max_logit), max_logit fp32 [h] the largest
        masked logit Q K^T * scale + bias of each head over the batch (no gradient).
        inference_params (te.InferenceParams, after its pre_step): q, k, v are the step's new
        tokens; k, v join the cache of layer_number, whose tokens the queries attend to
        (cu_seqlens_*, max_seqlen_* and attention_mask then come from the cache).
        """
        self._check_call(inference_params, fp8_output, core_attention_bias_type)
        fmt = self.qkv_format if qkv_format is None else check_qkv_format(qkv_format)
        mask_type, window = self._mask_options(attn_mask_type, window_size)
        shapes = check_qkv(
            query_layer,
            key_layer,
            value_layer,
            fmt,
            self.num_gqa_groups_per_partition,
            *self.kv_channels,
        )
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        dropout_p = self.attention_dropout if self.training else 0.0
        forced = self.attention_backend
        if attention_backend is not None:
            forced = check_backend(attention_backend)
        bias, slopes = self._check_bias(
            core_attention_bias_type, core_attention_bias, alibi_slopes, shapes, query_layer
        )
        if self._cp is not None:
            return self._forward_cp(
                (query_layer, key_layer, value_layer),
                fmt,
                (mask_type, window, core_attention_bias_type),
                (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded),
                (attention_mask, inference_params),
                dropout_p,
                checkpoint_core_attention,
                forced,
            )
        if self.return_max_logit and (inference_params is not None or fmt == "thd"):
            where = "a KV cache" if inference_params is not None else "qkv_format='thd'"
            raise NotImplementedError(
                f"DotProductAttention: return_max_logit=True with {where} is not implemented "
                "in torchte yet (sbhd and bshd are)"
            )
        if inference_params is not None:
            return self._forward_cached(
                inference_params,
                (query_layer, key_layer, value_layer),
                fmt,
                (mask_type, window, bottom_right_diagonal, core_attention_bias_type),
                dropout_p,
                checkpoint_core_attention,
                forced,
            )
        if fmt == "thd":
            if core_attention_bias_type != "no_bias":
                raise NotImplementedError(
                    f"DotProductAttention: core_attention_bias_type={core_attention_bias_type!r} "
                    "with qkv_format='thd' is not implemented in torchte yet"
                )
            return self._forward_thd(
                query_layer,
                key_layer,
                value_layer,
                mask_type,
                window,
                bottom_right_diagonal,
                (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded),
                (max_seqlen_q, max_seqlen_kv),
                dropout_p,
                checkpoint_core_attention,
                forced,
            )
        return self._forward_dense(
            (query_layer, key_layer, value_layer),
            fmt,
            shapes,
            (mask_type, window, bottom_right_diagonal, core_attention_bias_type),
            (attention_mask, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv),
            (bias, slopes),
            dropout_p,
            checkpoint_core_attention,
            forced,
        )

    def _forward_dense(
        self, qkv, fmt, shapes, mask, padding, biases, dropout_p, recompute, forced
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """sbhd / bshd: qkv as forward's, mask (mask type, window, bottom_right_diagonal, bias
        type), padding (attention_mask, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
        max_seqlen_kv), biases (the post-scale bias, ALiBi slopes) -> forward's output."""
        query_layer, key_layer, value_layer = qkv
        mask_type, window, bottom_right_diagonal, core_attention_bias_type = mask
        bias, slopes = biases
        plan = dense_plan(
            mask_type, window, shapes, *padding, bottom_right_diagonal, query_layer.device
        )
        q, k, v = (to_bhsd(x, fmt) for x in (query_layer, key_layer, value_layer))
        sink = self._sink(shapes.h, query_layer)
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, bias, sink)
        )
        shifted = plan.bottom_right and shapes.sq != shapes.skv
        shifted = shifted and (plan.windowed or core_attention_bias_type == "alibi")
        backend = choose_backend(
            BackendKey(
                q.dtype,
                q.device.type,
                fmt,
                mask_type,
                dropout_p > 0,
                window,
                core_attention_bias_type,
                shapes.h != shapes.hg,
                shifted,
                needs_grad,
                forced,
                sink is not None,
            )
        )
        inputs = self._inputs(backend, plan, bias, slopes, dropout_p, sink)
        attend = partial(run_backend, backend, inputs=inputs)
        out = from_bhsd(self._attend(attend, q, k, v, dropout_p, recompute), fmt)
        if self.return_max_logit:
            return out, max_logits(q, k, inputs)
        return out

    def _forward_cp(
        self, qkv, fmt, mask, cu_seqlens, others, dropout_p, recompute, forced
    ) -> torch.Tensor:
        """Context parallelism (torchte/distributed/context_parallel.py): qkv this rank's
        load-balanced rows, cu_seqlens those of the whole sequences (thd); mask (mask type,
        window, bias type); others (attention_mask, inference_params) must be None."""
        cp = self._cp
        mask_type, window, _ = mask
        check_cp_call(self, cp, qkv, fmt, mask, cu_seqlens, others, dropout_p)
        local = partial(self._cp_local, mask_type, window, dropout_p, recompute, forced)
        q, k, v = qkv
        cu = cu_seqlens if fmt == "thd" else None
        return cp_attention.context_parallel_attention(
            q, k, v, cp, fmt, "causal" in mask_type, self.softmax_scale, cu, local
        )

    def _cp_local(self, given_mask, window, dropout_p, recompute, forced, q, k, v, mask_type, cu):
        """One rank's attention for all_gather / a2a: q [N, b, h, d] (sbhd) or [N, h, d] (thd,
        cu = (cu_q, cu_kv, cu_q_padded, cu_kv_padded)) -> [N, b, h dv] or [N, h dv]."""
        if mask_type != given_mask:
            window = (-1, 0) if "causal" in mask_type else (-1, -1)
        if cu is not None:
            return self._forward_thd(
                q, k, v, mask_type, window, None, cu, (None, None), dropout_p, recompute, forced
            )
        shapes = Shapes(
            q.shape[1], q.shape[0], k.shape[0], q.shape[2], k.shape[2], *self.kv_channels
        )
        return self._forward_dense(
            (q, k, v),
            "sbhd",
            shapes,
            (mask_type, window, None, "no_bias"),
            (None, None, None, None, None),
            (None, None),
            dropout_p,
            recompute,
            forced,
        )

    def _check_call(self, inference_params, fp8_output, core_attention_bias_type) -> None:
        if inference_params is not None and not isinstance(inference_params, InferenceParams):
            raise TypeError(
                "inference_params must be a te.InferenceParams, got "
                f"{type(inference_params).__name__}"
            )
        if fp8_output:
            raise NotImplementedError(
                "DotProductAttention: fp8_output=True (FP8 attention) is not implemented in "
                "torchte; attention computes in the input dtype"
            )
        if core_attention_bias_type not in _BIAS_TYPES:
            raise ValueError(
                f"core_attention_bias_type must be one of {_BIAS_TYPES}, got "
                f"{core_attention_bias_type!r}"
            )

    def _mask_options(self, attn_mask_type, window_size) -> tuple[str, tuple[int, int]]:
        """The call's mask type and window: the module's unless overridden, then checked."""
        if attn_mask_type is None and window_size is None:
            return self.attn_mask_type, self.window_size
        mask_type = (
            self.attn_mask_type if attn_mask_type is None else normalize_mask_type(attn_mask_type)
        )
        if window_size is None and self.window_size not in ((-1, -1), (-1, 0)):
            window_size = self.window_size  # the module's sliding window, kept
        return mask_type, check_window_size(mask_type, window_size)

    def _check_bias(self, bias_type, bias, alibi_slopes, shapes: Shapes, q: torch.Tensor):
        """(bias scaled to post-scale, or None; ALiBi slopes fp32 [h] or [b, h], or None)."""
        if alibi_slopes is not None and bias_type != "alibi":
            raise ValueError(
                f"alibi_slopes needs core_attention_bias_type='alibi', got {bias_type!r}"
            )
        if bias_type in ("pre_scale_bias", "post_scale_bias"):
            bias = check_bias(bias, shapes, q)
            return (bias * self.softmax_scale if bias_type == "pre_scale_bias" else bias), None
        if bias is not None:
            raise ValueError(
                f"core_attention_bias must be None for core_attention_bias_type={bias_type!r}"
            )
        if bias_type != "alibi":
            return None, None
        if alibi_slopes is None:
            return None, default_alibi_slopes(shapes.h, q.device)
        return None, check_alibi_slopes(alibi_slopes, shapes, q)

    def _inputs(self, backend, plan, bias, slopes, dropout_p, sink) -> AttentionInputs:
        """What the backend takes besides q, k, v: flex computes ALiBi itself, the others
        take it as a bias tensor."""
        if slopes is not None and backend != "flex":
            bias, slopes = alibi_bias(plan, slopes), None
        return AttentionInputs(plan, bias, slopes, self.softmax_scale, dropout_p, sink)

    def _attend(self, fn, q, k, v, dropout_p: float, recompute: bool) -> torch.Tensor:
        """fn(q, k, v) inside the dropout RNG fork, recomputed in backward if asked."""
        if recompute:
            return checkpoint(
                self._core,
                fn,
                q,
                k,
                v,
                dropout_p,
                get_rng_state_tracker=self.get_rng_state_tracker,
            )
        return self._core(fn, q, k, v, dropout_p)

    def _core(self, fn, q, k, v, dropout_p: float) -> torch.Tensor:
        tracker = self.rng_states_tracker
        fork = tracker.fork() if tracker is not None and dropout_p > 0 else contextlib.nullcontext()
        with fork:
            return fn(q, k, v)

    def _forward_cached(
        self, params, qkv, fmt, mask, dropout_p: float, recompute: bool, forced: str
    ) -> torch.Tensor:
        """With inference_params (_dpa_cached.forward_cached)."""
        return forward_cached(self, params, qkv, fmt, mask, dropout_p, recompute, forced)

    def _forward_thd(
        self,
        q,
        k,
        v,
        mask_type,
        window,
        bottom_right_diagonal,
        cu_seqlens,
        max_seqlens,
        dropout_p: float,
        recompute: bool,
        forced: str,
    ) -> torch.Tensor:
        """qkv_format="thd": q [t, h, d], k [t_kv, hg, d], v [t_kv, hg, dv] -> [t, h * dv]
        through packed.packed_attention (which checks cu_seqlens_* and finds max_seqlen_*)."""
        if "padding" not in mask_type:
            raise ValueError(
                "qkv_format='thd' needs a padding attn_mask_type ('padding', 'padding_causal' "
                f"or 'padding_causal_bottom_right'), got {mask_type!r}"
            )
        cu_q, cu_kv, cu_q_padded, cu_kv_padded = cu_seqlens
        if cu_q is None or cu_kv is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
        plan = plan_mask(mask_type, window, 0, 0, bottom_right_diagonal=bottom_right_diagonal)
        options = dict(
            causal="causal" in mask_type,
            bottom_right=plan.bottom_right,
            window=(plan.left, plan.right),
            scale=self.softmax_scale,
            dropout_p=dropout_p,
            cu_seqlens_q_padded=cu_q_padded,
            cu_seqlens_kv_padded=cu_kv_padded,
            backend=forced if forced in PACKED_BACKENDS else None,
            softmax_offset=self._sink(q.shape[1], q),
        )
        attend = partial(_packed_call, (cu_q, cu_kv, *max_seqlens), options)
        out = self._attend(attend, q, k, v, dropout_p, recompute)
        return out.reshape(out.shape[0], -1)


def _packed_call(lengths, options, q, k, v) -> torch.Tensor:
    """packed_attention(q (t, h, d), k, v, cu_q, cu_kv, max_q, max_kv, **options)."""
    return packed_attention(q, k, v, *lengths, **options)
