"""te.DotProductAttention with a KV cache (inference_params): the step's new tokens join the
layer's cache and its queries attend to it."""

from __future__ import annotations

from functools import partial

import torch

from .backends import AttentionInputs, BackendKey, choose_backend, run_backend
from .inference import cache_mask_type
from .masks import plan_mask

__all__ = ["forward_cached"]


def forward_cached(
    module, params, qkv, fmt, mask, dropout_p: float, recompute: bool, forced: str
) -> torch.Tensor:
    """DotProductAttention `module` with inference_params: the new k, v go into this layer's
    cache and the new queries attend to the cache (bottom-right causal, each sequence's own
    length). qkv: the new tokens as in forward; mask: (mask type, window,
    bottom_right_diagonal, bias type)."""
    mask_type, window, bottom_right_diagonal, bias_type = mask
    if bias_type != "no_bias":
        raise NotImplementedError(
            f"DotProductAttention: core_attention_bias_type={bias_type!r} with "
            "inference_params is not implemented in torchte yet"
        )
    if not module._layer_number_given:
        raise ValueError(
            "DotProductAttention: inference_params needs the module's layer_number (the "
            "layer's cache in inference_params); build it with layer_number=..."
        )
    q, k, v = qkv
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            "with inference_params, query_layer and key_layer must hold the same new tokens, "
            f"got shapes {list(q.shape)} and {list(k.shape)}"
        )
    mask_type = cache_mask_type(mask_type)
    step = params.cached_step(module.layer_number, q, k, v, fmt)
    sq, skv = step.q.shape[2], step.k.shape[2]
    plan = plan_mask(
        mask_type, window, sq, skv, step.pad_q, step.pad_kv, None, bottom_right_diagonal
    )
    sink = module._sink(step.q.shape[1], q)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, sink)
    )
    key = BackendKey(
        q.dtype,
        q.device.type,
        fmt,
        mask_type,
        dropout_p > 0,
        window,
        "no_bias",
        step.q.shape[1] != step.k.shape[1],
        plan.bottom_right and plan.windowed,
        needs_grad,
        forced,
        sink is not None,
    )
    inputs = AttentionInputs(plan, None, None, module.softmax_scale, dropout_p, sink)
    attend = partial(run_backend, choose_backend(key), inputs=inputs)
    out = module._attend(attend, step.q, step.k, step.v, dropout_p, recompute)
    return params.step_output(out, fmt, q.shape[0])
