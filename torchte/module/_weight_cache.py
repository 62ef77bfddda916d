"""The FP8 copies of weights, kept between calls: a one-element cache [(key, value)] per GEMM
weight, requantized only when the weight or its scale changed (see base.py's docstring), the
columnwise copy of a quantized parameter, and how CUDA graphs that keep weights across replays
(_graph_weights.py) see them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchte._device import graph_capturing
from torchte.offload import mark_not_offload
from torchte.quantization.base import QuantizedTensor
from torchte.quantization.float8 import Float8Storage

from ._graph_weights import active_caching
from ._lifecycle import keeping_out_of_inference

__all__ = ["cached_quantization", "cached_value", "columnwise_weight", "fp8_weight_cached"]


def cached_value(cache: list, key, is_first_microbatch: bool | None, capturing: bool):
    """The value in the one-element cache [(key, value)] if it may be reused: always when
    is_first_microbatch is False (the weights did not change), never when True or while a CUDA
    graph is `capturing` (the graph must hold the quantization, so that each replay
    requantizes the live weights), else when its key equals `key`; None otherwise."""
    entry = cache[0]
    if (
        entry is not None
        and not capturing
        and (is_first_microbatch is False or (is_first_microbatch is None and entry[0] == key))
    ):
        return entry[1]
    return None


def fp8_weight_cached(
    cache: list,
    weight: torch.Tensor,
    quantizer,
    version,
    generation,
    is_first_microbatch: bool | None,
    columnwise: bool,
) -> Float8Storage:
    """The FP8 copy of `weight`, requantized only when the weight or its scale changed.

    cache is a one-element list [(key, storage)] owned by the caller. is_first_microbatch=True
    forces a requantize; False reuses any cached copy; None decides by `version` (the weight
    parameters' identities and _version counters, see weight_version) and `generation` (the
    autocast step and the delayed scale's generation).
    """
    key = (version, generation)

    def quantize() -> Float8Storage:
        return quantizer.quantize(weight, rowwise=True, columnwise=columnwise)

    capturing = graph_capturing(weight)
    return cached_quantization(cache, key, is_first_microbatch, capturing, quantize, columnwise)


def columnwise_weight(weight: QuantizedTensor, quantizer):
    """The storage of the quantized parameter `weight`, given a columnwise copy it lacks: made
    in the parameter's own storage where the format makes it exactly from the rowwise copy;
    else (1x128 or MXFP8 blocks: separate quantizations) a new value, quantized with both
    usages from the dequantized weight with its `_quantizer` (or `quantizer`), not kept."""
    storage = weight._storage
    with keeping_out_of_inference():
        try:
            storage.update_usage(columnwise_usage=True)
        except RuntimeError:
            quantizer = weight._quantizer or quantizer
            with torch.no_grad():
                value_hp = storage.dequantize(weight.dtype)
                fresh = quantizer.quantize(value_hp, rowwise=True, columnwise=True)
            return getattr(fresh, "_storage", fresh)
    mark_not_offload(storage)  # a parameter's data: saving it moves nothing
    return storage


def cached_quantization(
    cache: list, key, is_first_microbatch, capturing: bool, quantize: Callable, columnwise: bool
):
    """The quantized value in the one-element cache [(key, value)] if it may be reused (see
    cached_value), given columnwise data when `columnwise` asks for it; else quantize() made
    now and cached (while a graph is captured with weight caching, kept across its replays:
    _graph_weights.py). Either way it is marked not to be offloaded (the cache keeps it alive) and
    made of normal tensors even under torch.inference_mode()."""
    storage = cached_value(cache, key, is_first_microbatch, capturing)
    caching = active_caching()  # a graph that keeps the weight across replays (or None)
    if storage is not None and caching is not None and not capturing:
        caching.prepare(cache, storage)
    if storage is None:
        with torch.no_grad(), keeping_out_of_inference():
            storage = quantize()
            if caching is not None:
                (caching.keep if capturing else caching.prepare)(cache, storage)
        cache[0] = (key, storage)
    elif columnwise and storage.columnwise_data is None:
        with keeping_out_of_inference():
            try:
                storage.update_usage(columnwise_usage=True)
            except RuntimeError:  # a format whose copies are cast apart (1x128 blocks)
                with torch.no_grad():
                    storage = quantize()
                cache[0] = (key, storage)
    else:
        return storage
    mark_not_offload(storage)
    return storage
