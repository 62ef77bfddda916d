"""The attention backends and the choice among them: PyTorch's scaled_dot_product_attention
(flash / cuDNN / memory-efficient, torch picks), flex_attention for masks SDPA only takes as a
dense tensor (sliding windows, bottom-right causal with sq != skv, ALiBi) on CUDA, and a plain
math path (softmax(Q K^T * scale + bias + mask) V in fp32) that runs everywhere.

Legend: b batch, h query heads, hg key/value heads, sq / skv sequence lengths, d / dv head
sizes. Every backend takes q [b, h, sq, d], k [b, hg, skv, d], v [b, hg, skv, dv] (any strides)
and returns [b, h, sq, dv] in q's dtype. A query row that sees no key gives zeros.

The choice is made once per signature (see `BackendKey`) and cached; TORCHTE_ATTN_BACKEND
(math, sdpa, flex or auto) or the module's `attention_backend` argument forces one. Each new
choice is logged at DEBUG level on logging.getLogger("torchte.attention").

Attention sinks (softmax_type "off-by-one" / "learnable", see _sinks.py): the math path adds
the sink to its softmax's denominator; flex rescales its output by the logsumexp it returns;
SDPA returns no logsumexp, so "auto" takes flex (CUDA, no dropout, no bias tensor) or math.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._flex import flex_function, lse_request, split_lse
from ._sinks import rescale_by_sink, sink_softmax
from .masks import MaskPlan, alibi_bias, allowed_mask, mask_mod

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "AttentionInputs",
    "BackendKey",
    "choose_backend",
    "env_backend",
    "run_backend",
]

BACKENDS = ("auto", "math", "sdpa", "flex")
ENV_BACKEND = "TORCHTE_ATTN_BACKEND"
_LOG = logging.getLogger("torchte.attention")


def env_backend() -> str:
    """TORCHTE_ATTN_BACKEND, checked (auto when unset)."""
    return check_backend(os.environ.get(ENV_BACKEND, "auto"), ENV_BACKEND)


def check_backend(name: str, argument: str = "attention_backend") -> str:
    """A backend name; ValueError naming `argument` otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"{argument} must be one of {BACKENDS}, got {name!r}")
    return name


class BackendKey(NamedTuple):
    """What the backend choice depends on (no sizes): one cached choice per key."""

    dtype: torch.dtype
    device_type: str
    qkv_format: str
    mask_type: str
    dropout: bool
    window: tuple[int, int]
    bias_type: str
    gqa: bool
    shifted_diagonal: bool  # bottom-right alignment with sq != skv
    needs_grad: bool
    forced: str
    sink: bool = False  # softmax_type "off-by-one" or "learnable"


@dataclass(frozen=True)
class AttentionInputs:
    """Everything but q, k, v: the mask plan, the additive post-scale bias (fp32
    [b|1, h|1, sq, skv], or None), ALiBi slopes for flex (fp32 [h] or [b, h], or None),
    the softmax scale, the dropout probability in effect, and the sink logits (fp32 [h], or
    None for the vanilla softmax)."""

    plan: MaskPlan
    bias: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    scale: float
    dropout_p: float
    sink: torch.Tensor | None = None


_CHOICES: dict[BackendKey, str] = {}


def choose_backend(key: BackendKey) -> str:
    """The backend for `key`, chosen once and cached; NotImplementedError naming the option
    when a forced backend cannot take it."""
    name = _CHOICES.get(key)
    if name is None:
        name = _CHOICES[key] = _choose(key)
        _LOG.debug("DotProductAttention: backend %r for %s", name, key)
    return name


def _choose(key: BackendKey) -> str:
    if key.forced == "flex":
        _check_flex(key)
        return "flex"
    if key.forced == "sdpa" and key.sink:
        raise NotImplementedError(
            "attention_backend='sdpa' has no attention sinks (softmax_type 'off-by-one' or "
            "'learnable'): scaled_dot_product_attention returns no logsumexp; use 'auto', "
            "'flex' or 'math'"
        )
    if key.forced != "auto":
        return key.forced
    wants_flex = (
        (key.window != (-1, -1) and key.window != (-1, 0))
        or key.shifted_diagonal
        or key.bias_type == "alibi"
        or key.sink
    )
    flex_ok = key.device_type == "cuda" and not key.dropout and key.bias_type != "post_scale_bias"
    flex_ok = flex_ok and key.bias_type != "pre_scale_bias"
    if wants_flex and flex_ok:
        return "flex"
    return "math" if key.sink else "sdpa"


def _check_flex(key: BackendKey) -> None:
    if key.dropout:
        raise NotImplementedError(
            "attention_backend='flex': flex_attention has no dropout; use attention_dropout=0 "
            "or the 'sdpa' / 'math' backend"
        )
    if key.bias_type in ("pre_scale_bias", "post_scale_bias"):
        raise NotImplementedError(
            f"attention_backend='flex' does not take core_attention_bias_type="
            f"{key.bias_type!r}; use the 'sdpa' or 'math' backend"
        )
    if key.device_type == "cpu" and key.needs_grad:
        raise NotImplementedError(
            "attention_backend='flex': flex_attention has no backward on the CPU; use the "
            "'sdpa' or 'math' backend, or inputs that do not require grad"
        )


def run_backend(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs
) -> torch.Tensor:
    """Attention through backend `name`: q [b, h, sq, d], k [b, hg, skv, d], v [b, hg, skv, dv]
    -> [b, h, sq, dv] in q's dtype."""
    if name == "sdpa":
        return sdpa_attention(q, k, v, inputs)
    if name == "flex":
        return flex_attention(q, k, v, inputs)
    return math_attention(q, k, v, inputs)


def _masks(q: torch.Tensor, plan: MaskPlan):
    """(allowed-or-row-empty mask, rows-with-a-key mask), both None when nothing is masked."""
    allowed = allowed_mask(plan, q.shape[1], q.device)
    if allowed is None:
        return None, None
    row_ok = allowed.any(-1, keepdim=True)
    return allowed | ~row_ok, row_ok


def math_attention(q, k, v, inputs: AttentionInputs) -> torch.Tensor:
    """softmax(Q K^T * scale + bias + mask) V with fp32 matmuls and softmax, then dropout on the
    probabilities: the reference every other backend is held to."""
    group = q.shape[1] // k.shape[1]
    v32 = v.float().repeat_interleave(group, dim=1)
    keep, row_ok = _masks(q, inputs.plan)
    scores = _logits(q, k, inputs.scale, inputs.bias, keep)
    if inputs.sink is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = sink_softmax(scores, inputs.sink.view(1, -1, 1, 1))
    if row_ok is not None:
        probs = probs.masked_fill(~row_ok, 0.0)
    if inputs.dropout_p > 0:
        probs = F.dropout(probs, inputs.dropout_p)
    return torch.matmul(probs, v32).to(q.dtype)


@torch.no_grad()
def max_logits(q, k, inputs: AttentionInputs) -> torch.Tensor:
    """max over batch, query and key of the masked logits Q K^T * scale + bias, per head:
    q [b, h, sq, d], k [b, hg, skv, d] -> fp32 [h] (-inf for a head whose every logit is
    masked). Transformer Engine's return_max_logit (qk-clip); no gradient, one batch row at a
    time so that no [b, h, sq, skv] tensor is made."""
    keep, _ = _masks(q, inputs.plan)
    slopes = inputs.alibi_slopes
    bias = inputs.bias if slopes is None else alibi_bias(inputs.plan, slopes)
    best = torch.full((q.shape[1],), float("-inf"), device=q.device)
    for i in range(q.shape[0]):
        row = slice(i, i + 1)
        scores = _logits(q[row], k[row], inputs.scale, _batch_row(bias, i), _batch_row(keep, i))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


def _logits(q, k, scale: float, bias, keep) -> torch.Tensor:
    """fp32 Q K^T * scale + bias, -inf where `keep` is False: q [b, h, sq, d], k [b, hg, skv, d]
    -> [b, h, sq, skv] (bias and keep broadcast to it, either may be None)."""
    k32 = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q.float(), k32.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _batch_row(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Batch row i of a [b|1, ...] tensor, kept 4-D (row 0 of a broadcast one)."""
    if t is None:
        return None
    j = i if t.shape[0] > 1 else 0
    return t[j : j + 1]


def sdpa_attention(q, k, v, inputs: AttentionInputs) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention: is_causal for a plain top-left causal
    mask, else the mask (and bias) as one attn_mask tensor."""
    plan = inputs.plan
    if inputs.sink is not None:
        raise NotImplementedError("sdpa_attention has no attention sinks (see _choose)")
    common = dict(dropout_p=inputs.dropout_p, scale=inputs.scale, enable_gqa=_gqa(q, k))
    if inputs.bias is None and plan.is_empty:
        return F.scaled_dot_product_attention(q, k, v, **common)
    if inputs.bias is None and plan.is_plain_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **common)
    keep, row_ok = _masks(q, plan)
    attn_mask = keep
    if inputs.bias is not None:
        attn_mask = inputs.bias.to(q.dtype)
        if keep is not None:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **common)
    return out if row_ok is None else out.masked_fill(~row_ok, 0.0)


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[1] != k.shape[1]


def flex_attention(q, k, v, inputs: AttentionInputs) -> torch.Tensor:
    """torch.nn.attention.flex_attention with the plan as a block mask and ALiBi as a score_mod
    (no dropout, no bias tensor: the choice never sends those here); with a sink, its output
    rescaled by the logsumexp it returns."""
    from torch.nn.attention.flex_attention import create_block_mask

    plan = inputs.plan
    block_mask = None
    if not plan.is_empty:
        arbitrary = plan.arbitrary
        per_batch = plan.pad_q is not None or (arbitrary is not None and arbitrary.shape[0] > 1)
        per_head = arbitrary is not None and arbitrary.shape[1] > 1
        block_mask = create_block_mask(
            mask_mod(plan, plan.offset()),
            q.shape[0] if per_batch else None,
            q.shape[1] if per_head else None,
            plan.sq,
            plan.skv,
            device=q.device,
        )
    score_mod = None if inputs.alibi_slopes is None else _alibi_score_mod(plan, inputs.alibi_slopes)
    flex = flex_function(q.device.type)
    if not torch.is_grad_enabled():  # flex refuses inputs that require grad on the CPU
        q, k, v = q.detach(), k.detach(), v.detach()
    extra = {} if inputs.sink is None else lse_request()
    with warnings.catch_warnings():
        # Eager flex_attention (CPU) warns that it is unfused on every call.
        warnings.simplefilter("ignore", UserWarning)
        result = flex(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=inputs.scale,
            enable_gqa=_gqa(q, k),
            **extra,
        )
    if inputs.sink is None:
        return result
    out, lse = split_lse(result)
    return rescale_by_sink(out, lse, inputs.sink.view(1, -1, 1))


def _alibi_score_mod(plan: MaskPlan, slopes: torch.Tensor):
    """score - slope * |i - j + off|, the ALiBi bias of masks.alibi_bias."""
    offset = plan.offset()
    per_batch_offset = isinstance(offset, torch.Tensor)
    off_b = offset.view(-1) if per_batch_offset else None
    per_batch_slopes = slopes.dim() == 2

    def score_mod(score, b, h, qi, kj):
        off = off_b[b] if per_batch_offset else offset
        slope = slopes[b, h] if per_batch_slopes else slopes[h]
        return score - slope * (qi - kj + off).abs().to(score.dtype)

    return score_mod
