"""Transformer Engine's MoE token permutation (`transformer_engine.pytorch.permutation`), with
its names, arguments, defaults and outputs:

    moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask")
        -> (output, row_id_map)
    moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1)
        -> (output, permuted_probs, row_id_map)
    moe_permute_and_pad_with_probs(inp, probs, routing_map, tokens_per_expert, align_size)
        -> (output, permuted_probs, row_id_map, pad_offsets, target_tokens_per_expert)
    moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask",
        probs=None, pad_offsets=None) -> output
    moe_sort_chunks_by_index(inp, split_sizes, sorted_index) -> output
    moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index)
        -> (output, permuted_probs)

Shapes: inp (N, H); a "mask" routing_map (N, E) bool/integer, nonzero where a token goes to an
expert; an "index" routing_map (N, K) integer expert ids; probs (N, E). Permuted rows are
grouped by expert (expert 0's first), tokens in order within an expert. The row_id_map layouts
are Transformer Engine's (torchte/kernels/permutation_maps.py); moe_unpermute takes the map
moe_permute returned, with the same map_type.

num_out_tokens is the number of permuted rows. Mask maps: routes past it are dropped (not
written; unpermute reads them as zero) and rows past the routed ones are zero; negative (the
default) or None means all routed rows, which reads their count on the host (the one host sync
of these functions on CUDA, besides moe_permute_and_pad_with_probs, whose output size depends
on tokens_per_expert). Index maps: 0 or negative means N*K; routes are stably sorted by expert
id and those sorted past num_out_tokens are dropped. max_token_num (a workspace hint in
Transformer Engine) is accepted and unused. A num_out_tokens given as a CUDA tensor is read on
the host.

Every function is differentiable in inp and probs / merging_probs. CUDA tensors run Triton
kernels, CPU tensors the torch references (torchte/kernels/permutation.py); both give the same
maps and bytes. Bad arguments raise before any kernel runs, naming the argument.

Where torchte differs from Transformer Engine: num_out_tokens has a default (-1, as before
Transformer Engine 2.15, which made it required); rows no route writes are zero (Transformer
Engine leaves them unset); a mask map's unused slots hold -1; unpermute sums in fp32 also for
index maps (Transformer Engine: in the data's dtype there); num_out_tokens smaller than the
routed count drops routes under a mask map too; zero tokens give empty outputs of the right
shape; fp64 data is summed in fp64; restore_shape=None means (N, H) (Transformer Engine: inp's
shape, the same unless routes were dropped) and may have more than 2 dims; chunk sizes and
orders held on the CPU are checked (non-negative, at most N rows, a permutation). Per-tensor
FP8 (Float8Tensor) inputs move as bytes where Transformer Engine moves them (mask-map permutes,
chunk sorts, and the gradient of unpermute without merging probs); blockwise and MXFP8 tensors
do not exist in torchte.
"""

from __future__ import annotations

import math
import operator
import warnings

import torch

from ._permutation_functions import (
    IndexPermute,
    IndexUnpermute,
    MaskPermute,
    MaskUnpermute,
    Plan,
    SortChunks,
    refuse_quantized,
)

__all__ = [
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
]

_MAP_TYPES = ("mask", "index")


def moe_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int | torch.Tensor | None = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the rows of inp (N, H) by expert -> (output (num_out_tokens, H), row_id_map).

    routing_map: (N, E) bool/integer for map_type "mask", (N, K) integer expert ids for
    "index". row_id_map: (N, 2E+1) int32 ("mask") or (K*N,) int32 ("index").
    """
    _check_map_type(map_type)
    _check_int("max_token_num", max_token_num)
    num_out = _num_out_tokens(num_out_tokens)
    _check_rows(inp, routing_map, "routing_map", map_type)
    if map_type == "index":
        refuse_quantized(inp, "moe_permute with map_type='index'")
        n, k = routing_map.shape
        num_out = n * k if num_out <= 0 else num_out
        return IndexPermute.apply(inp, routing_map, Plan(num_out_tokens=num_out, topk=k))
    output, row_id_map, _ = _mask_permute(inp, routing_map, None, None, num_out)
    return output, row_id_map


def moe_permute_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int | torch.Tensor | None = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_permute (mask map) carrying probs (N, E) along -> (output (R, H), permuted_probs (R,)
    in probs' dtype, row_id_map (N, 2E+1) int32). A route whose prob is 0 (a padding route of
    Megatron's padded routing maps) gets a zero row."""
    num_out = _num_out_tokens(num_out_tokens)
    _check_rows(inp, routing_map, "routing_map", "mask")
    _check_probs(probs, routing_map)
    output, row_id_map, permuted_probs = _mask_permute(inp, routing_map, probs, None, num_out)
    return output, permuted_probs, row_id_map


def moe_permute_and_pad_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    align_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """moe_permute_with_probs with each expert's rows padded by zero rows to a multiple of
    align_size -> (output, permuted_probs, row_id_map, pad_offsets (E,) int64 or None when no
    expert needs padding, target_tokens_per_expert (E,) int64).

    tokens_per_expert (E,): the routes of each expert (routing_map's column sums). Expert e's
    rows start pad_offsets[e] rows later than unpadded; moe_unpermute takes pad_offsets back.
    The output's size is read on the host (no sync when tokens_per_expert is on the CPU).
    """
    if tokens_per_expert is None:
        raise ValueError("tokens_per_expert must be given to moe_permute_and_pad_with_probs")
    _check_int("align_size", align_size)
    if align_size <= 0:
        raise ValueError(f"align_size must be positive, got {align_size}")
    _check_rows(inp, routing_map, "routing_map", "mask")
    _check_probs(probs, routing_map)
    _check_tokens_per_expert(tokens_per_expert, routing_map)
    counts = tokens_per_expert
    if counts.is_floating_point():
        target = (torch.ceil(counts / align_size) * align_size).long()
    else:
        target = (counts.long() + align_size - 1) // align_size * align_size
    pads = target - counts.long()
    total, padded = torch.stack([target.sum(), (pads != 0).any().long()]).tolist()
    pad_offsets = None
    if padded:
        pad_offsets = (torch.cumsum(pads, 0) - pads).to(inp.device)
    output, row_id_map, permuted_probs = _mask_permute(inp, routing_map, probs, pad_offsets, total)
    return output, permuted_probs, row_id_map, pad_offsets, target.to(inp.device)


def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    restore_shape: torch.Size | tuple[int, ...] | None = None,
    map_type: str = "mask",
    probs: torch.Tensor | None = None,
    pad_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Put the permuted rows inp (R, H) back in token order, summing each token's routes (times
    merging_probs, (N, E) "mask" / (N, K) "index", when given) -> output.

    "mask": output (N, H), or restore_shape (default (N, H)). "index": restore_shape is unused
    (as in Transformer Engine); with merging_probs the output is (N, H) (bf16 / fp16 probs
    taken as float32), without it (K*N, H), row k*N + t holding route k of token t. `probs`
    is the old name of merging_probs; pad_offsets (mask maps) is
    moe_permute_and_pad_with_probs's.
    """
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("give merging_probs or its deprecated name probs, not both")
        warnings.warn(
            "moe_unpermute: probs is deprecated, use merging_probs", DeprecationWarning, 2
        )
        merging_probs = probs
    _check_map_type(map_type)
    refuse_quantized(inp, "moe_unpermute")
    _check_2d("inp", inp)
    _check_same_device(inp, row_id_map=row_id_map, merging_probs=merging_probs)
    if map_type == "index":
        return _index_unpermute(inp, row_id_map, merging_probs, pad_offsets)
    n, experts = _check_mask_map(row_id_map)
    if merging_probs is not None:
        _check_float("merging_probs", merging_probs, (n, experts))
    if pad_offsets is not None:
        _check_pad_offsets(pad_offsets, experts, inp)
    hidden = inp.shape[1]
    shape = (n, hidden) if restore_shape is None else tuple(restore_shape)
    if len(shape) < 2 or math.prod(shape[:-1]) != n or shape[-1] != hidden:
        raise ValueError(
            f"restore_shape {shape} must have {n} rows (row_id_map's tokens) of {hidden} "
            "(inp's hidden size)"
        )
    plan = Plan(num_permuted=inp.shape[0])
    output = MaskUnpermute.apply(inp, row_id_map, merging_probs, pad_offsets, plan)
    return output if len(shape) == 2 else output.view(shape)


def moe_sort_chunks_by_index(
    inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> torch.Tensor:
    """Split inp (N, H) into chunks of split_sizes (S,) rows and put them in sorted_index's (S,)
    order -> output (N, H); rows past sum(split_sizes) stay where they are."""
    return _sort_chunks(inp, None, split_sizes, sorted_index)[0]


def moe_sort_chunks_by_index_with_probs(
    inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_sort_chunks_by_index carrying probs (N,) along -> (output (N, H), permuted_probs
    (N,))."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs must be a tensor, got {type(probs).__name__}")
    return _sort_chunks(inp, probs, split_sizes, sorted_index)


# ----------------------------------------------------------------------------------------------
# Calls and checks
# ----------------------------------------------------------------------------------------------


def _mask_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    num_out: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The mask-map permute after the checks: (output, row_id_map, permuted_probs)."""
    if inp.shape[0] == 0:
        num_out = 0  # zero tokens: empty outputs, whatever num_out_tokens says
    elif num_out == 0:
        raise ValueError(
            "num_out_tokens must be positive for map_type='mask' (the permuted rows, e.g. "
            "routing_map.sum() or num_tokens * topk), or negative to count the routed rows"
        )
    plan = Plan(num_out_tokens=num_out)
    return MaskPermute.apply(inp, routing_map, probs, pad_offsets, plan)


def _index_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
) -> torch.Tensor:
    if pad_offsets is not None:
        raise ValueError("pad_offsets applies to map_type='mask' only")
    if row_id_map.dim() != 1 or row_id_map.dtype != torch.int32:
        raise ValueError(
            "row_id_map must be moe_permute's (K*N,) int32 map for map_type='index', got "
            f"{row_id_map.dtype} {tuple(row_id_map.shape)}"
        )
    if merging_probs is None:
        plan = Plan(topk=1, num_permuted=inp.shape[0])
        return IndexUnpermute.apply(inp, row_id_map, None, plan)
    if merging_probs.dim() != 2 or merging_probs.numel() != row_id_map.numel():
        raise ValueError(
            f"merging_probs must be (N, K) with N*K = row_id_map's {row_id_map.numel()} "
            f"entries, got {tuple(merging_probs.shape)}"
        )
    if not merging_probs.is_floating_point():
        raise TypeError(f"merging_probs must be floating point, got {merging_probs.dtype}")
    if merging_probs.dtype not in (torch.float32, torch.float64):
        merging_probs = merging_probs.float()  # as Transformer Engine takes them
    plan = Plan(topk=merging_probs.shape[1], num_permuted=inp.shape[0])
    return IndexUnpermute.apply(inp, row_id_map, merging_probs, plan)


def _sort_chunks(
    inp: torch.Tensor,
    probs: torch.Tensor | None,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_2d("inp", inp)
    n = inp.shape[0]
    for name, t in (("split_sizes", split_sizes), ("sorted_index", sorted_index)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not _is_integer(t):
            raise ValueError(f"{name} must be a 1-D integer tensor, got {_describe(t)}")
    if split_sizes.shape != sorted_index.shape:
        raise ValueError(
            f"split_sizes {tuple(split_sizes.shape)} and sorted_index "
            f"{tuple(sorted_index.shape)} must have one entry per chunk each"
        )
    if probs is not None:
        _check_float("probs", probs, (n,))
        _check_same_device(inp, probs=probs)
    if split_sizes.device.type == "cpu" and sorted_index.device.type == "cpu":
        _check_chunks_on_host(split_sizes, sorted_index, n)
    # Sizes and order kept on the host travel to the device (a small copy).
    split_sizes = split_sizes.to(inp.device)
    sorted_index = sorted_index.to(inp.device)
    return SortChunks.apply(inp, split_sizes, sorted_index, probs)


def _check_chunks_on_host(split_sizes: torch.Tensor, sorted_index: torch.Tensor, n: int) -> None:
    """What can be checked without a device sync: sizes >= 0 summing to at most N, and
    sorted_index a permutation of range(S)."""
    if (split_sizes < 0).any():
        raise ValueError(f"split_sizes must be >= 0, got {split_sizes.tolist()}")
    if int(split_sizes.sum()) > n:
        raise ValueError(f"split_sizes sum to {int(split_sizes.sum())}, more than inp's {n} rows")
    s = sorted_index.shape[0]
    if not torch.equal(torch.sort(sorted_index.long()).values, torch.arange(s)):
        raise ValueError(f"sorted_index must be a permutation of range({s}), got {sorted_index}")


def _num_out_tokens(value) -> int:
    """num_out_tokens as an int (negative: not given); a tensor is read on the host."""
    if value is None:
        return -1
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(f"num_out_tokens must be an integer, got {_describe(value)}")
        return int(value.reshape(()))
    _check_int("num_out_tokens", value)
    return operator.index(value)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _check_map_type(map_type: str) -> None:
    if map_type not in _MAP_TYPES:
        raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")


def _is_integer(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def _check_2d(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (num_tokens, hidden), got {_describe(t)}")


def _check_same_device(inp: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != inp.device:
            raise ValueError(f"{name} is on {t.device}, inp on {inp.device}: use one device")


def _check_rows(inp, routing_map, name: str, map_type: str) -> None:
    """inp (N, H) and a routing map (N, E) bool/integer ("mask") or (N, K) integer ("index")."""
    _check_2d("inp", inp)
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {_describe(routing_map)}")
    integer = _is_integer(routing_map)
    if map_type == "mask" and not (integer or routing_map.dtype == torch.bool):
        raise TypeError(
            f"{name} must be bool or integer for map_type='mask', got {routing_map.dtype}"
        )
    if map_type == "index" and not integer:
        raise TypeError(
            f"{name} must hold integer expert ids for map_type='index', got {routing_map.dtype}"
        )
    if routing_map.shape[0] != inp.shape[0]:
        raise ValueError(
            f"{name} has {routing_map.shape[0]} rows, inp {inp.shape[0]}: one per token each"
        )
    if map_type == "index" and routing_map.shape[1] == 0 and inp.shape[0]:
        raise ValueError(f"{name} must have at least one route per token (K >= 1)")
    _check_same_device(inp, **{name: routing_map})


def _check_float(name: str, t, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {_describe(t)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {t.dtype}")


def _check_probs(probs, routing_map: torch.Tensor) -> None:
    _check_float("probs", probs, tuple(routing_map.shape))
    _check_same_device(routing_map, probs=probs)


def _check_mask_map(row_id_map) -> tuple[int, int]:
    """(N, E) of a mask row_id_map (N, 2E+1) int32."""
    ok = isinstance(row_id_map, torch.Tensor) and row_id_map.dim() == 2
    if not (ok and row_id_map.dtype == torch.int32 and row_id_map.shape[1] % 2 == 1):
        raise ValueError(
            "row_id_map must be moe_permute's (N, 2E+1) int32 map for map_type='mask', got "
            f"{_describe(row_id_map)}"
        )
    return row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2


def _check_pad_offsets(pad_offsets, experts: int, inp: torch.Tensor) -> None:
    if not isinstance(pad_offsets, torch.Tensor) or tuple(pad_offsets.shape) != (experts,):
        raise ValueError(f"pad_offsets must have shape ({experts},), got {_describe(pad_offsets)}")
    if not _is_integer(pad_offsets):
        raise TypeError(f"pad_offsets must be an integer tensor, got {pad_offsets.dtype}")
    _check_same_device(inp, pad_offsets=pad_offsets)


def _check_tokens_per_expert(tokens_per_expert, routing_map: torch.Tensor) -> None:
    experts = routing_map.shape[1]
    t = tokens_per_expert
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (experts,) or t.is_complex():
        raise ValueError(f"tokens_per_expert must have shape ({experts},), got {_describe(t)}")
    if t.device.type == "cpu" and routing_map.device.type == "cpu":
        routed = (routing_map != 0).sum(0)
        if not torch.equal(routed, t.to(routed.dtype)):
            raise ValueError(
                f"tokens_per_expert {t.tolist()} must be routing_map's routes per expert "
                f"{routed.tolist()}"
            )
