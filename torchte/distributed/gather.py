"""`gather_along_first_dim`: Transformer Engine's all-gather of tensor and sequence
parallelism, aware of torchte's quantized values.

High-precision inputs go through the plain gather of torchte/_collectives.py; a torchte per-tensor
quantizer casts the rows with a scale the ranks agree on and the FP8 bytes are gathered, and a
Float8Storage has its bytes gathered with its scale_inv. The gathers and all-reduces made here
go through te.distributed's names, as every caller's do, so that wrapping those (tests and
benchmarks count the bytes moved) sees them all.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

from torchte import distributed as te_dist
from torchte.quantization._block_common import BlockQuantizerMixin
from torchte.quantization.base import QuantizedTensor
from torchte.quantization.float8 import Float8Storage

from .._collectives import DoneHandle, gather_rows, world_size

__all__ = ["gather_along_first_dim"]


def gather_along_first_dim(
    inp,
    process_group=None,
    async_op: bool = False,
    quantizer=None,
    output_tensor: torch.Tensor | None = None,
    external_coalescing: bool = False,
) -> tuple[object, object | None]:
    """(the ranks' inputs stacked along dim 0, handle): inp (M, ...) on every rank -> (W M,
    ...), rank r's rows at [r M, (r + 1) M). With one rank, inp itself (quantized by
    `quantizer` when given).

    FP8: a torchte per-tensor quantizer (quantizer.quantize_gathered) casts the rows with a
    scale the ranks agree on and the FP8 bytes are gathered into a Float8Storage (rowwise);
    an inp that is a Float8Storage has its bytes gathered with its scale_inv (the ranks must
    share it). Other quantized inputs are gathered in high precision (with a warning), then
    quantized by `quantizer` if given. output_tensor: where a high-precision result goes
    ((W M, ...), inp's dtype and device). external_coalescing: accepted (the gathers here need
    no fix-up after a coalescing manager closes)."""
    world = world_size(process_group)
    if world == 1:
        if quantizer is not None and _is_high_precision(inp):
            inp = quantizer.quantize(inp)
        return inp, None
    if isinstance(inp, Float8Storage):
        return _gather_fp8_storage(inp, process_group), DoneHandle() if async_op else None
    if isinstance(inp, QuantizedTensor) or not isinstance(inp, torch.Tensor):
        warnings.warn(
            f"gather_along_first_dim: {type(inp).__name__} is gathered in high precision "
            "(dequantized first)",
            UserWarning,
            stacklevel=2,
        )
        inp = inp.dequantize()
    if quantizer is not None:
        gathered = _gather_quantized(inp, process_group, quantizer)
        return gathered, DoneHandle() if async_op else None
    return gather_rows(inp, process_group, world, async_op, output_tensor)


def _is_high_precision(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor)


def _gather_quantized(inp: torch.Tensor, group, quantizer):
    """inp's rows quantized with one scale the ranks agree on, gathered as FP8 bytes (a torchte
    per-tensor quantizer), or each rank's blocks cast and gathered (the block-scaled formats);
    other quantizers: gathered in high precision, then quantized."""
    if hasattr(quantizer, "quantize_gathered"):
        reduce_max = functools.partial(te_dist.allreduce, tp_group=group, op=dist.ReduceOp.MAX)

        def gather(t: torch.Tensor) -> torch.Tensor:
            return te_dist.gather_along_first_dim(t, group)[0]

        # The block-scaled formats' columnwise copy is its own cast (never made from the
        # gathered rowwise bytes): gathered too where the quantizer makes it.
        columnwise = isinstance(quantizer, BlockQuantizerMixin) and quantizer.columnwise_usage
        return quantizer.quantize_gathered(inp, reduce_max, gather, columnwise)
    if not hasattr(quantizer, "quantize"):
        raise TypeError(
            f"gather_along_first_dim: quantizer must be a torchte Quantizer, got {quantizer!r}"
        )
    return quantizer.quantize(te_dist.gather_along_first_dim(inp, group)[0])


def _gather_fp8_storage(inp: Float8Storage, group) -> Float8Storage:
    """inp's FP8 bytes (rowwise) gathered along dim 0 into a Float8Storage of its scale_inv."""
    if inp.rowwise_data is None:
        inp.update_usage(rowwise_usage=True)
    data = inp.rowwise_data.view(torch.uint8).reshape(inp.shape)
    gathered = te_dist.gather_along_first_dim(data, group)[0].view(inp.fp8_dtype)
    shape = tuple(gathered.shape)
    return Float8Storage(gathered.reshape(-1, shape[-1]), None, inp.scale_inv, inp.fp8_dtype, shape)
