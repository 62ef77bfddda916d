"""FP8 casts of many tensors in two launches: their amaxes, then their bytes, each tensor with
its own scale. What te.fsdp casts once a step for every weight it gathers as FP8, where one
cast (and one amax) per weight cost a launch each and host time per weight.

The tensors (1-D views of any contiguous shape, one dtype: fp32 or bf16, on one CUDA device)
are found through a table of their addresses and cut in chunks of MULTI_CAST_CHUNK elements,
one program a chunk (kernels/adamw.py's layout):
- `amaxes(tensors)`: (T,) fp32, max |x| of each tensor (0 for an empty one; NaN where it holds
  a NaN). Each program max-accumulates its chunk's int32 bit pattern of |x| into its tensor's
  slot with an atomic max (NaN's pattern is above every other, so a NaN wins).
- `quantize(tensors, scales, fp8_dtype)`: the bytes of x * scale[t], clamped to the FP8 range
  (NaN kept), rounded to nearest even, as the single-tensor cast makes them, written into one
  flat FP8 buffer; returns each tensor's bytes as a view of it in the tensor's shape.
The `_reference` functions compute the same in torch operations on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._fp8_codec import FP8_MAX, cast_reference, check_fp8_dtype
from ._triton import tl, triton
from .adamw import _launch_args

__all__ = ["MULTI_CAST_CHUNK", "amaxes", "amaxes_reference", "quantize", "quantize_reference"]

MULTI_CAST_CHUNK = 1 << 14
_BLOCK = 2048
_WARPS = 8
_DTYPES = (torch.float32, torch.bfloat16)

if triton is not None:
    from ._fp8_codec import _abs_bits, _fp8_code
    from .adamw import _chunk

    @triton.jit
    def _amax_kernel(
        addresses_ptr,  # (T,) int64: each tensor's address
        numels_ptr,  # (T,) int64
        chunk_tensor_ptr,  # (C,) int32
        chunk_start_ptr,  # (C,) int64
        amax_bits_ptr,  # (T,) int32, zeroed: max-accumulated |x| bit patterns
        DTYPE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0)
        t, start, numel = _chunk(chunk_tensor_ptr, chunk_start_ptr, numels_ptr, c)
        x_ptr = tl.load(addresses_ptr + t).to(tl.pointer_type(DTYPE))
        bits = tl.zeros((BLOCK,), tl.int32)
        for i in tl.range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
            bits = tl.maximum(bits, _abs_bits(x))
        tl.atomic_max(amax_bits_ptr + t, tl.max(bits, 0))

    @triton.jit
    def _cast_kernel(
        addresses_ptr,  # (2, T) int64: each tensor's address, then its output's
        numels_ptr,
        chunk_tensor_ptr,
        chunk_start_ptr,
        scales_ptr,  # (T,) fp32
        n_tensors,
        DTYPE: tl.constexpr,
        FP8_MAX: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0)
        t, start, numel = _chunk(chunk_tensor_ptr, chunk_start_ptr, numels_ptr, c)
        x_ptr = tl.load(addresses_ptr + t).to(tl.pointer_type(DTYPE))
        out_ptr = tl.load(addresses_ptr + n_tensors + t).to(tl.pointer_type(tl.uint8))
        scale = tl.load(scales_ptr + t)
        for i in tl.range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            mask = offs < numel
            y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
            # the clamp, then the conversion (NaN fails both comparisons and stays NaN)
            y = tl.where(y > FP8_MAX, FP8_MAX, y)
            y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
            tl.store(out_ptr + offs, _fp8_code(y, FP8_MAX).to(tl.uint8), mask=mask)


_TRITON_DTYPES = {} if tl is None else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


def _check(tensors: Sequence[torch.Tensor], who: str) -> None:
    if not tensors:
        raise ValueError(f"{who}: no tensors")
    if len({t.dtype for t in tensors}) != 1 or tensors[0].dtype not in _DTYPES:
        raise ValueError(
            f"{who}: tensors must share one dtype, fp32 or bf16; got "
            f"{sorted({str(t.dtype) for t in tensors})}"
        )
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{who}: tensors must be on one device")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"{who}: every tensor must be contiguous")


def amaxes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """(T,) fp32 max |x| of each of `tensors` (on one CUDA device), in one launch after a
    zero fill; no sync."""
    _check(tensors, "amaxes")
    bits = torch.zeros(len(tensors), dtype=torch.int32, device=tensors[0].device)
    args = _launch_args((tensors,), MULTI_CAST_CHUNK)
    if args is not None:
        addresses, numels, tensor_of, start = args
        _amax_kernel[(tensor_of.numel(),)](
            addresses, numels, tensor_of, start, bits,
            DTYPE=_TRITON_DTYPES[tensors[0].dtype], CHUNK=MULTI_CAST_CHUNK, BLOCK=_BLOCK,
            num_warps=_WARPS,
        )  # fmt: skip
    return bits.view(torch.float32)


def amaxes_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """amaxes in torch operations (any device): NaN where a tensor holds one."""
    _check(tensors, "amaxes")
    zero = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    return torch.stack([t.abs().max().float() if t.numel() else zero for t in tensors])


def _outputs(tensors, fp8_dtype) -> list[torch.Tensor]:
    """Each tensor's FP8 output: views, in its shape, of one flat buffer for all."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=fp8_dtype, device=tensors[0].device)
    views = flat.split([t.numel() for t in tensors])
    return [v.view(t.shape) for v, t in zip(views, tensors, strict=True)]


def _check_scales(tensors, scales: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    _check(tensors, "quantize")
    check_fp8_dtype(fp8_dtype, ValueError)
    if scales.shape != (len(tensors),) or scales.dtype != torch.float32:
        raise ValueError(
            f"quantize: scales must be ({len(tensors)},) fp32, got {tuple(scales.shape)} "
            f"{scales.dtype}"
        )
    if not scales.is_contiguous() or scales.device != tensors[0].device:
        raise ValueError("quantize: scales must be contiguous, on the tensors' device")


def quantize(
    tensors: Sequence[torch.Tensor], scales: torch.Tensor, fp8_dtype: torch.dtype
) -> list[torch.Tensor]:
    """The FP8 bytes of each of `tensors` (on one CUDA device) times its scale (`scales`: (T,)
    fp32 on their device), one launch; views of one flat buffer, in the tensors' shapes."""
    _check_scales(tensors, scales, fp8_dtype)
    outputs = _outputs(tensors, fp8_dtype)
    args = _launch_args((tensors, outputs), MULTI_CAST_CHUNK)
    if args is not None:
        addresses, numels, tensor_of, start = args
        _cast_kernel[(tensor_of.numel(),)](
            addresses, numels, tensor_of, start, scales, len(tensors),
            DTYPE=_TRITON_DTYPES[tensors[0].dtype], FP8_MAX=FP8_MAX[fp8_dtype],
            CHUNK=MULTI_CAST_CHUNK, BLOCK=_BLOCK, num_warps=_WARPS,
        )  # fmt: skip
    return outputs


def quantize_reference(
    tensors: Sequence[torch.Tensor], scales: torch.Tensor, fp8_dtype: torch.dtype
) -> list[torch.Tensor]:
    """quantize in torch operations (any device): the same bytes, in views of one buffer."""
    _check_scales(tensors, scales, fp8_dtype)
    outputs = _outputs(tensors, fp8_dtype)
    for t, out, scale in zip(tensors, outputs, scales, strict=True):
        out.copy_(cast_reference(t, scale, fp8_dtype))
    return outputs
