"""Context parallelism's checks for te.DotProductAttention: the group it is given, and what a
call under context parallelism takes (torchte/distributed/context_parallel.py does the work)."""

from __future__ import annotations

import math

import torch

from ..distributed import context_parallel as cp_attention

__all__ = ["CP_COMM_TYPES", "check_cp_call", "cp_group_for", "group_size"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def group_size(group) -> int:
    """Ranks of a process group, or the product over a list of groups (1 without one)."""
    if group is None or not torch.distributed.is_initialized():
        return 1
    if isinstance(group, list | tuple):
        return math.prod(torch.distributed.get_world_size(g) for g in group)
    return torch.distributed.get_world_size(group)


def cp_group_for(cp_group, cp_comm_type: str, cp_stream=None):
    """The CPGroup of a context-parallel group (None for one rank or none), checked."""
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {cp_comm_type!r}")
    if group_size(cp_group) == 1:
        return None
    if isinstance(cp_group, list | tuple) or cp_comm_type == "a2a+p2p":
        raise NotImplementedError(
            "DotProductAttention: cp_comm_type='a2a+p2p' (a list of two cp groups) is not "
            "implemented in torchte; 'p2p', 'all_gather' and 'a2a' over one group are"
        )
    return cp_attention.cp_group_of(cp_group, cp_comm_type, cp_stream)


def check_cp_call(module, cp, qkv, fmt, mask, cu_seqlens, others, dropout_p) -> None:
    """What context parallelism takes in te.DotProductAttention, refused (NotImplementedError
    naming the option, or ValueError) before any collective: module the DotProductAttention,
    cp its CPGroup, the rest as its _forward_cp takes them."""
    mask_type, window, bias_type = mask
    refused = [
        (others[1] is not None, "inference_params"),
        (module.return_max_logit, "return_max_logit=True"),
        (module.softmax_type != "vanilla", f"softmax_type={module.softmax_type!r}"),
        (bias_type != "no_bias", f"core_attention_bias_type={bias_type!r}"),
        (others[0] is not None, "an attention_mask (thd takes padding as cu_seqlens)"),
    ]
    masks = ("padding", "padding_causal") if fmt == "thd" else ("causal", "no_mask")
    refused.append((mask_type not in masks, f"attn_mask_type={mask_type!r} with {fmt}"))
    default = (-1, 0) if "causal" in mask_type else (-1, -1)
    if window != default and cp.comm_type != "a2a":
        refused.append((True, f"a sliding window with cp_comm_type={cp.comm_type!r} (a2a)"))
    if dropout_p > 0 and cp.comm_type == "p2p":
        refused.append((True, "dropout with cp_comm_type='p2p' (a2a and all_gather)"))
    for bad, what in refused:
        if bad:
            raise NotImplementedError(
                f"DotProductAttention: {what} under context parallelism is not implemented "
                f"in torchte (it takes masks {masks} for {fmt}, no bias, no sinks)"
            )
    q, k, _ = qkv
    if fmt == "thd" and (cu_seqlens[0] is None or cu_seqlens[1] is None):
        raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
    s_dim = 0 if fmt == "sbhd" else 1
    if fmt != "thd" and "causal" in mask_type and q.shape[s_dim] != k.shape[s_dim]:
        raise ValueError(
            "context parallelism with a causal mask needs as many key rows as query rows, "
            f"got {k.shape[s_dim]} and {q.shape[s_dim]}"
        )
