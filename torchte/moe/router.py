"""Transformer Engine's fused MoE router functions (`transformer_engine.pytorch.router`), with
its names, arguments, defaults and outputs:

    fused_topk_with_score_function(logits, topk, use_pre_softmax, num_groups, group_topk,
        scaling_factor, score_function, expert_bias, routing_map_format=BYTEMAP,
        topk_indices=None, qb_histogram=None, qb_bin_bounds=None, qb_histogram_mode=None)
        -> (probs, routing_map)
    fused_compute_score_for_moe_aux_loss(logits, topk, score_function,
        routing_map_format=BYTEMAP) -> (routing_map, scores)
    fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)
        -> aux_loss

Each is an autograd Function: probs, scores and aux_loss are differentiable (in logits and
probs), routing maps are not. The math and layouts are described in torchte/kernels/router.py
and torchte/kernels/moe_aux_loss.py. CUDA tensors run Triton kernels, CPU tensors the torch
references. Bad arguments raise before any kernel runs, naming the argument.

Where torchte differs from Transformer Engine: zero tokens give empty outputs (Transformer
Engine refuses them); among equal scores the lower expert index is chosen (Transformer Engine's
kernels for topk < 16 may choose another of the tied experts); dense indices come largest score
first; total_num_tokens may be a tensor of any real dtype (Transformer Engine: int64 only), and
a CPU one with CUDA probs is read on the host.
"""

from __future__ import annotations

import enum
import functools
import math
import operator

import torch

from torchte.kernels.moe_aux_loss import aux_loss_backward, aux_loss_forward
from torchte.kernels.router import (
    SCORE_FUNCTIONS,
    RouterSpec,
    aux_scores_backward,
    aux_scores_forward,
    topk_backward,
    topk_forward,
)
from torchte.kernels.router_maps import qb_histogram_accumulate, routing_to_mask

__all__ = [
    "QBHistogramMode",
    "RoutingMapFormat",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
_VALIDATED_VERSION = "_torchte_qb_bounds_version"


class RoutingMapFormat(enum.IntEnum):
    """Layout of a routing map: BYTEMAP bool (..., E); BITMAP_U8 uint8 (..., ceil(E / 8)), bit
    e % 8 of byte e // 8 for expert e."""

    BYTEMAP = 0
    BITMAP_U8 = 1


class QBHistogramMode(enum.IntEnum):
    """How Transformer Engine accumulates the quantile-balancing histogram (torchte: the same
    counts either way)."""

    TWO_KERNEL = 0
    FUSED_ATOMIC = 1


_FORMAT_NAMES = {"bytemap": RoutingMapFormat.BYTEMAP, "bitmap_u8": RoutingMapFormat.BITMAP_U8}
_QB_MODES = {"two_kernel": QBHistogramMode.TWO_KERNEL, "fused_atomic": QBHistogramMode.FUSED_ATOMIC}

# One validated spec per setting (specs are immutable).
_router_spec = functools.lru_cache(maxsize=256)(RouterSpec)


class FusedTopkScoreFunction(torch.autograd.Function):
    """Top-k routing with a score function: (probs, routing output, the QB histogram or None)."""

    @staticmethod
    def forward(ctx, logits, expert_bias, topk_indices, qb_histogram, qb_bin_bounds, spec):
        probs, routing, inter, cutoff = topk_forward(logits, expert_bias, topk_indices, spec)
        if spec.qb:
            qb_histogram_accumulate(inter, cutoff, qb_bin_bounds, qb_histogram)
        # the index buffer and the histogram are written in place and handed back, as in TE
        ctx.mark_dirty(*[t for t in (topk_indices, qb_histogram) if t is not None])
        ctx.mark_non_differentiable(*[t for t in (routing, qb_histogram) if t is not None])
        ctx.save_for_backward(routing, inter)
        ctx.spec, ctx.dtype, ctx.num_experts = spec, logits.dtype, logits.shape[-1]
        return probs, routing, qb_histogram

    @staticmethod
    def backward(ctx, grad_probs, _grad_routing, _grad_histogram):
        routing, inter = ctx.saved_tensors
        mask = routing_to_mask(routing, ctx.spec.routing_layout, ctx.num_experts)
        grad = topk_backward(mask, inter, grad_probs, ctx.spec, ctx.dtype)
        return grad, None, None, None, None, None


class FusedComputeScoresForMoEAuxLoss(torch.autograd.Function):
    """Scores of the auxiliary loss and their routing map: (routing_map, scores fp32)."""

    @staticmethod
    def forward(ctx, logits, topk, score_function, routing_map_format):
        scores, routing, inter = aux_scores_forward(
            logits, topk, score_function, routing_map_format
        )
        ctx.mark_non_differentiable(routing)
        ctx.save_for_backward(inter)
        ctx.score_function, ctx.dtype = score_function, logits.dtype
        return routing, scores

    @staticmethod
    def backward(ctx, _grad_routing, grad_scores):
        (inter,) = ctx.saved_tensors
        grad = aux_scores_backward(inter, grad_scores, ctx.score_function, ctx.dtype)
        return grad, None, None, None


class FusedAuxLoss(torch.autograd.Function):
    """The load-balancing loss: a scalar in probs' dtype."""

    @staticmethod
    def forward(ctx, probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
        loss, coefficient = aux_loss_forward(
            probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff
        )
        ctx.save_for_backward(coefficient, tokens_per_expert)
        ctx.rows, ctx.dtype = probs.shape[0], probs.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        coefficient, tokens_per_expert = ctx.saved_tensors
        grad = aux_loss_backward(coefficient, tokens_per_expert, grad_loss, ctx.rows, ctx.dtype)
        return grad, None, None, None, None, None


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    scaling_factor: float | None,
    score_function: str,
    expert_bias: torch.Tensor | None,
    routing_map_format: str | RoutingMapFormat | int = RoutingMapFormat.BYTEMAP,
    topk_indices: torch.Tensor | None = None,
    qb_histogram: torch.Tensor | None = None,
    qb_bin_bounds: torch.Tensor | None = None,
    qb_histogram_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert routing of logits (..., E) fp32 / bf16 / fp16.

    Returns probs (..., E) in the logits' dtype (zero off the chosen experts) and the routing
    output: a bool map (..., E), a bit map uint8 (..., ceil(E / 8)) for routing_map_format
    "bitmap_u8", or `topk_indices` (..., topk) int16 / int32 / int64 filled in (no map) when
    given. score_function: "softmax", "sigmoid" or "sqrtsoftplus"; use_pre_softmax: softmax
    before the top-k (softmax only); grouped top-k when group_topk > 0; expert_bias (E,) fp32
    (sigmoid / sqrtsoftplus) shifts the choice, not the probs. Quantile balancing: qb_histogram
    (E, bins) int32 is accumulated in place, with qb_bin_bounds (2,) fp32 [lower, upper] and
    qb_histogram_mode "two_kernel" or "fused_atomic" (sigmoid, with expert_bias, no groups).
    """
    _check_logits(logits, "fused_topk_with_score_function")
    experts = logits.shape[-1]
    topk = _positive_int(topk, "topk")
    if topk > experts:
        raise ValueError(f"topk must be in [1, num_experts={experts}], got {topk}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"score_function must be softmax, sigmoid or sqrtsoftplus, got {score_function!r}"
        )
    groups, group_k = _check_groups(num_groups, group_topk, topk, experts)
    fmt = _routing_map_format(routing_map_format)
    qb = _check_qb(qb_histogram, qb_bin_bounds, qb_histogram_mode, score_function, expert_bias)
    if qb and (num_groups is not None or group_topk is not None):
        raise ValueError(
            "quantile balancing does not support grouped top-k (num_groups, group_topk)"
        )
    if qb and topk >= experts:
        raise ValueError(f"quantile balancing needs topk < num_experts ({experts}), got {topk}")
    expert_bias = _check_expert_bias(expert_bias, score_function, logits)
    if topk_indices is not None:
        _check_topk_indices(topk_indices, logits, topk, fmt)
    if qb:
        _check_histogram(qb_histogram, qb_bin_bounds, logits)
    spec = _router_spec(
        topk=topk,
        score_function=score_function,
        use_pre_softmax=bool(use_pre_softmax),
        num_groups=groups,
        group_topk=group_k,
        scaling_factor=1.0 if scaling_factor is None else _real(scaling_factor, "scaling_factor"),
        routing_map_format=fmt,
        dense_indices=topk_indices is not None,
        qb=qb,
    )
    probs, routing, _ = FusedTopkScoreFunction.apply(
        logits, expert_bias, topk_indices, qb_histogram, qb_bin_bounds, spec
    )
    return probs, routing


def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    routing_map_format: str | RoutingMapFormat | int = RoutingMapFormat.BYTEMAP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores for the auxiliary loss of logits (..., E) fp32 / bf16 / fp16: returns the routing
    map (bool (..., E), or uint8 (..., ceil(E / 8)) for "bitmap_u8") of the top-k scores, and
    the scores (..., E) fp32: softmax(logits), or the row-normalized sigmoid / sqrtsoftplus."""
    _check_logits(logits, "fused_compute_score_for_moe_aux_loss")
    topk = _positive_int(topk, "topk")
    if topk > logits.shape[-1]:
        raise ValueError(f"topk must be in [1, num_experts={logits.shape[-1]}], got {topk}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"score_function must be softmax, sigmoid or sqrtsoftplus, got {score_function!r}"
        )
    fmt = _routing_map_format(routing_map_format)
    return FusedComputeScoresForMoEAuxLoss.apply(logits.contiguous(), topk, score_function, fmt)


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int | torch.Tensor,
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Load-balancing loss num_experts * coeff / (topk * total_num_tokens^2) *
    sum_j tokens_per_expert[j] * sum_i probs[i, j]: a scalar in probs' dtype.

    probs (R, C) fp32 / bf16 / fp16 with C a multiple of num_experts; tokens_per_expert (C,)
    integer or float; total_num_tokens a positive int, or a one-element tensor (on probs'
    device its value is read on the device, so it may change between CUDA graph replays)."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError("fused_moe_aux_loss: probs must be a 2-D tensor (num_tokens, num_cols)")
    if probs.dtype not in _DTYPES:
        raise TypeError(
            f"fused_moe_aux_loss: probs must be float32, bfloat16 or float16, got {probs.dtype}"
        )
    num_experts = _positive_int(num_experts, "num_experts")
    topk = _positive_int(topk, "topk")
    coeff = _real(coeff, "coeff")
    cols = probs.shape[1]
    if cols == 0 or cols % num_experts:
        raise ValueError(
            f"probs' columns ({cols}) must be a positive multiple of num_experts ({num_experts})"
        )
    _check_tokens_per_expert(tokens_per_expert, probs)
    total = _total_tokens(total_num_tokens, probs)
    return FusedAuxLoss.apply(probs, tokens_per_expert, total, num_experts, topk, coeff)


# ----------------------------------------------------------------------------------------------
# Argument checks (Transformer Engine's rules, raised before any kernel runs)
# ----------------------------------------------------------------------------------------------


def _check_logits(logits, where: str) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{where}: logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() < 1:
        raise ValueError(
            f"{where}: logits must have at least 1 dim (..., num_experts), got a scalar"
        )
    if logits.dtype == torch.float64:
        raise ValueError(f"{where}: float64 logits are not supported (as in Transformer Engine)")
    if logits.dtype not in _DTYPES:
        raise TypeError(f"{where}: logits must be float32, bfloat16 or float16, got {logits.dtype}")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {value!r}")
    return float(value)


def _check_groups(num_groups, group_topk, topk: int, experts: int) -> tuple[int, int]:
    """(num_groups, group_topk) for the spec: (0, 0) when group_topk is None or <= 0 (plain
    top-k, whatever num_groups is, as Transformer Engine)."""
    if group_topk is None or operator.index(group_topk) <= 0:
        return 0, 0
    group_topk = operator.index(group_topk)
    if num_groups is None or operator.index(num_groups) < 1:
        raise ValueError(
            f"num_groups must be a positive int when group_topk > 0, got {num_groups!r}"
        )
    num_groups = operator.index(num_groups)
    if topk % group_topk:
        raise ValueError(f"topk ({topk}) must be divisible by group_topk ({group_topk})")
    if group_topk > num_groups:
        raise ValueError(f"group_topk ({group_topk}) must be <= num_groups ({num_groups})")
    if experts % num_groups:
        raise ValueError(f"num_experts ({experts}) must be divisible by num_groups ({num_groups})")
    if topk // group_topk > experts // num_groups:
        raise ValueError(
            f"topk / group_topk ({topk // group_topk}) must be <= the group size "
            f"num_experts / num_groups ({experts // num_groups})"
        )
    return num_groups, group_topk


def _routing_map_format(value) -> int:
    """Transformer Engine's accepted forms: the enum, 0 / 1, "bytemap" / "bitmap_u8"."""
    if isinstance(value, str):
        if value not in _FORMAT_NAMES:
            raise ValueError(
                "routing_map_format string must be 'bytemap' or 'bitmap_u8' (lowercase); got "
                f"{value!r}"
            )
        return int(_FORMAT_NAMES[value])
    if isinstance(value, int) and not isinstance(value, bool):
        if value not in (0, 1):
            raise ValueError(f"routing_map_format int must be one of [0, 1]; got {value!r}")
        return int(value)
    raise TypeError(
        "routing_map_format must be an int, a RoutingMapFormat or 'bytemap' / 'bitmap_u8'; got "
        f"{value!r}"
    )


def _check_expert_bias(expert_bias, score_function: str, logits: torch.Tensor):
    if expert_bias is None:
        return None
    if score_function == "softmax":
        raise ValueError("expert_bias needs score_function sigmoid or sqrtsoftplus, got softmax")
    if not isinstance(expert_bias, torch.Tensor) or expert_bias.dtype != torch.float32:
        got = getattr(expert_bias, "dtype", type(expert_bias))
        raise TypeError(f"expert_bias must be a float32 tensor, got {got}")
    if expert_bias.dim() != 1 or expert_bias.numel() != logits.shape[-1]:
        raise ValueError(
            f"expert_bias must have shape ({logits.shape[-1]},), got {tuple(expert_bias.shape)}"
        )
    _same_device(expert_bias, logits, "expert_bias")
    return expert_bias.contiguous()


def _check_topk_indices(topk_indices, logits: torch.Tensor, topk: int, fmt: int) -> None:
    if fmt != RoutingMapFormat.BYTEMAP:
        raise ValueError("topk_indices cannot be combined with routing_map_format bitmap_u8")
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dtype not in _INDEX_DTYPES:
        got = getattr(topk_indices, "dtype", type(topk_indices))
        raise TypeError(f"topk_indices dtype must be int16, int32 or int64, got {got}")
    want = (*logits.shape[:-1], topk)
    if tuple(topk_indices.shape) != want:
        raise ValueError(f"topk_indices shape must be {want}, got {tuple(topk_indices.shape)}")
    if not topk_indices.is_contiguous():
        raise ValueError("topk_indices must be contiguous")
    if topk_indices.dtype == torch.int16 and logits.shape[-1] > 32767:
        raise ValueError(f"int16 topk_indices need num_experts <= 32767, got {logits.shape[-1]}")
    _same_device(topk_indices, logits, "topk_indices")


def _check_qb(histogram, bin_bounds, mode, score_function: str, expert_bias) -> bool:
    """Whether quantile balancing is asked for (all three QB arguments, or none)."""
    given = [v is not None for v in (histogram, bin_bounds, mode)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError(
            "qb_histogram, qb_bin_bounds, and qb_histogram_mode must be provided together"
        )
    if score_function != "sigmoid":
        raise ValueError("quantile balancing only supports score_function='sigmoid'")
    if expert_bias is None:
        raise ValueError("quantile balancing requires expert_bias")
    if mode not in _QB_MODES:
        raise ValueError(f"qb_histogram_mode must be 'two_kernel' or 'fused_atomic', got {mode!r}")
    return True


def _check_histogram(histogram, bin_bounds, logits: torch.Tensor) -> None:
    experts = logits.shape[-1]
    if not isinstance(histogram, torch.Tensor) or histogram.dtype != torch.int32:
        raise TypeError("qb_histogram must be an int32 tensor")
    if histogram.dim() != 2 or histogram.shape[0] != experts or histogram.shape[1] < 1:
        raise ValueError(
            f"qb_histogram must have shape ({experts}, num_bins >= 1), got {tuple(histogram.shape)}"
        )
    if not histogram.is_contiguous():
        raise ValueError("qb_histogram must be contiguous")
    _same_device(histogram, logits, "qb_histogram")
    if not isinstance(bin_bounds, torch.Tensor) or bin_bounds.dtype != torch.float32:
        raise TypeError("qb_bin_bounds must be a float32 tensor")
    if tuple(bin_bounds.shape) != (2,):
        raise ValueError(f"qb_bin_bounds must have shape (2,), got {tuple(bin_bounds.shape)}")
    _same_device(bin_bounds, logits, "qb_bin_bounds")
    _check_bin_bound_values(bin_bounds)


def _check_bin_bound_values(bin_bounds: torch.Tensor) -> None:
    """lower < upper, both finite: read once per version of the tensor (a host sync on CUDA),
    refused inside CUDA graph capture before a first eager check, as Transformer Engine."""
    if getattr(bin_bounds, _VALIDATED_VERSION, None) == bin_bounds._version:
        return
    if bin_bounds.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "qb_bin_bounds must be checked by an eager call before CUDA graph capture"
        )
    lower, upper = bin_bounds.detach().cpu().tolist()
    if not (math.isfinite(lower) and math.isfinite(upper) and lower < upper):
        raise ValueError(f"qb_bin_bounds must be finite with lower < upper, got [{lower}, {upper}]")
    setattr(bin_bounds, _VALIDATED_VERSION, bin_bounds._version)


def _check_tokens_per_expert(tokens_per_expert, probs: torch.Tensor) -> None:
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError("fused_moe_aux_loss: tokens_per_expert must be a tensor")
    if tokens_per_expert.dtype == torch.bool or tokens_per_expert.is_complex():
        raise TypeError(
            f"tokens_per_expert must be an integer or float tensor, got {tokens_per_expert.dtype}"
        )
    if tokens_per_expert.dim() != 1 or tokens_per_expert.numel() != probs.shape[1]:
        raise ValueError(
            f"tokens_per_expert must have shape ({probs.shape[1]},) (probs' columns), got "
            f"{tuple(tokens_per_expert.shape)}"
        )
    _same_device(tokens_per_expert, probs, "tokens_per_expert")


def _total_tokens(total_num_tokens, probs: torch.Tensor) -> int | torch.Tensor:
    """A positive int, or a one-element tensor on probs' device; a CPU tensor with GPU probs is
    read on the host."""
    if isinstance(total_num_tokens, torch.Tensor):
        if total_num_tokens.numel() != 1 or total_num_tokens.dtype == torch.bool:
            raise ValueError("total_num_tokens tensor must hold exactly one number")
        if total_num_tokens.device == probs.device:
            return total_num_tokens
        if total_num_tokens.device.type != "cpu":
            raise ValueError(
                f"total_num_tokens is on {total_num_tokens.device}, probs on {probs.device}"
            )
        total_num_tokens = total_num_tokens.item()
    total = int(total_num_tokens)
    if total < 1:
        raise ValueError(f"total_num_tokens must be greater than 0, got {total_num_tokens}")
    return total


def _same_device(tensor: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    if tensor.device != ref.device:
        raise ValueError(f"{name} is on {tensor.device}, the router input on {ref.device}")
