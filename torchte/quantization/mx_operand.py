"""The GEMM operands of MXFP8 and NVFP4 values where torch runs their GEMMs natively (compute
capability 10+, `_device.block_gemm_native`): the layout torch.nn.functional.scaled_mm reads.

UNTESTED ON SUCH HARDWARE: torchte's GPUs are Hopper (9.0), where these formats are emulated
(their storages hand out GemmOperand("values", ...)). The layouts below follow torch's
documented and checked contract; the CPU tests check them against a stand-in for
F.scaled_mm (tests/test_mx_native.py), not against cuBLAS.

Every operand is K-major (logically (R, K), R the rows of the GEMM's output side, K reduced):
- kind "mx": data (R, K) FP8 (E4M3 / E5M2) row-major; scale (round_up(R, 128),
  round_up(K / 32, 4)) float8_e8m0fnu, SWIZZLE_32_4_4 (kernels/mx_swizzle.py), one code per
  row and 32 values along K; factor None.
- kind "nvfp4": data (R, K / 2) float4_e2m1fn_x2 (two E2M1 codes a byte, the first in the low
  nibble) row-major; scale (round_up(R, 128), round_up(K / 16, 4)) float8_e4m3fn,
  SWIZZLE_32_4_4; factor (1,) fp32 the per-tensor decode factor (value = e2m1 * block scale *
  factor), which torch takes as a second, TensorWise scale.

MXFP8's columnwise copy is not transposed (Transformer Engine's layout: data (M, K) with one
code per 32 rows of a column), while F.scaled_mm reads both operands K-major (mat_a row-major,
mat_b column-major; Transformer Engine reaches the other layouts by calling cuBLAS itself,
which torch does not expose). So its operand is a transposed copy: data (K, M) and the codes
(round_up(K, 128), round_up(M / 32, 4)), the columnwise buffer transposed, swizzled. NVFP4's
columnwise copy is stored transposed already. What an operand derives from a storage's
tensors (the transposed data, the swizzled scales, the NVFP4 factor) is cached per source
tensor while that tensor lives and is not written (its version counter), so a weight's
operands are made once per weight update, not once per GEMM; never while a CUDA graph is
captured (the graph must contain the copies) or under torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from torchte._device import graph_capturing
from torchte._sizes import round_up
from torchte.kernels.mx_swizzle import swizzle_block_scales, swizzled_rows
from torchte.kernels.nvfp4_cast import tensor_factor

from .base import GemmOperand

__all__ = [
    "MX_KINDS",
    "MXGemmOperand",
    "mxfp8_native_operand",
    "nvfp4_native_fits",
    "nvfp4_native_operand",
]

# The GemmOperand kinds of this module (gemm.operand_gemm sends them to F.scaled_mm).
MX_KINDS = ("mx", "nvfp4")
_MX_BLOCK, _NVFP4_BLOCK = 32, 16
# cuBLAS reads the operands' rows and the scales from 16-byte aligned addresses.
_ALIGN = 16


@dataclass(frozen=True, slots=True)
class MXGemmOperand(GemmOperand):
    """A GemmOperand of kind "mx" or "nvfp4" (module docstring), plus `factor`: NVFP4's (1,)
    fp32 per-tensor decode factor, None for "mx"."""

    factor: torch.Tensor | None = None

    def rows(self, rows: slice) -> MXGemmOperand:
        """The operand of rows `rows` (a slice of R, step 1) only: the data rows and the
        swizzled scales of those rows (kernels/mx_swizzle.swizzled_rows)."""
        if rows == slice(None):
            return self
        start, stop, step = rows.indices(self.data.shape[0])
        if step != 1:
            raise ValueError(f"{self.kind} operand: rows must be a slice of step 1, got {rows}")
        stop = max(start, stop)
        scale = swizzled_rows(self.scale, start, stop)
        return MXGemmOperand(self.kind, _aligned(self.data[start:stop]), scale, self.factor)


def _k_major(data: torch.Tensor) -> torch.Tensor:
    """data (R, C) as a row-major tensor at an aligned address: itself, or a copy (cached)."""
    if data.is_contiguous():
        return _aligned(data)
    return _derived(data, ("contiguous",), _byte_copy)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where its first byte is not 16-byte aligned (a view into a flat
    buffer, a row slice)."""
    return t if t.data_ptr() % _ALIGN == 0 else _byte_copy(t)


def _byte_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t (one byte an element), copied as uint8: torch's copy kernels do
    not take every 1-byte float dtype (float4_e2m1fn_x2)."""
    return t.view(torch.uint8).clone(memory_format=torch.contiguous_format).view(t.dtype)


def mxfp8_native_operand(
    data: torch.Tensor, scale: torch.Tensor, columnwise: bool
) -> MXGemmOperand:
    """The "mx" operand of one MXFP8 copy: rowwise data (R, K) FP8 with codes (>= round_up(R,
    128), >= round_up(K / 32, 4)) uint8; or columnwise (columnwise=True) data (M, K') FP8, one
    code per 32 rows, codes (>= round_up(M / 32, 4), >= round_up(K', 128)) uint8, whose operand
    is (K', M) (module docstring). The codes as mxfp8_cast writes them (compact, padded)."""
    if columnwise:
        rows, k = data.shape[1], data.shape[0]
        data = _derived(data, ("transposed",), _transposed)
    else:
        rows, k = data.shape
    padded = (round_up(rows, 128), round_up(k // _MX_BLOCK, 4))
    make = _swizzler(padded, columnwise, torch.float8_e8m0fnu)
    swizzled = _derived(scale, ("mx", padded, columnwise), make)
    return MXGemmOperand("mx", _k_major(data), swizzled)


def nvfp4_native_fits(k: int) -> bool:
    """Whether an NVFP4 GEMM reducing over k runs natively: its packed rows (k / 2 bytes) a
    multiple of 16 bytes, as cuBLAS reads them (k a multiple of 32); else it is emulated."""
    return k % (2 * _ALIGN) == 0


def nvfp4_native_operand(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor
) -> MXGemmOperand:
    """The "nvfp4" operand of one NVFP4 copy (either copy: both are stored K-major), data (R,
    K / 2) uint8 with E4M3 scales (>= round_up(R, 128), >= round_up(K / 16, 4)) uint8 and
    per-tensor amax (1,) fp32."""
    rows, k = data.shape[0], data.shape[1] * 2
    padded = (round_up(rows, 128), round_up(k // _NVFP4_BLOCK, 4))
    swizzled = _derived(scale, ("nvfp4", padded), _swizzler(padded, False, torch.float8_e4m3fn))
    factor = _derived(amax, ("factor",), tensor_factor)
    data = _k_major(data).view(torch.float4_e2m1fn_x2)
    return MXGemmOperand("nvfp4", data, swizzled, factor)


def _transposed(data: torch.Tensor) -> torch.Tensor:
    """data (M, K) FP8 as a new contiguous (K, M) tensor (copied as bytes)."""
    return _byte_copy(data.t())


def _swizzler(
    padded: tuple[int, int], transpose: bool, dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of a compact scale buffer (uint8) that gives its swizzled (padded) region
    as `dtype`, read transposed first when `transpose`."""

    def swizzle(scale: torch.Tensor) -> torch.Tensor:
        compact = scale.t() if transpose else scale
        return swizzle_block_scales(compact[: padded[0], : padded[1]]).view(dtype)

    return swizzle


# source tensor -> {what: (source._version, derived tensor)}; an entry goes with its source.
# `what` names the derivation and everything it depends on besides the source's bytes.
_DERIVED = WeakTensorKeyDictionary()


def _derived(
    source: torch.Tensor, what: tuple, make: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """make(source), cached per source tensor object and `what` while source lives and its
    version counter is unchanged; uncached while a CUDA graph is captured, under
    torch.compile, for inference tensors (no version counter) and where the result shares
    source's memory (an empty tensor: the cache must hold nothing that keeps source alive)."""
    if source.numel() == 0 or source.is_inference() or graph_capturing(source):
        return make(source)
    if torch.compiler.is_compiling():
        return make(source)
    entries = _DERIVED.get(source)
    version = source._version
    if entries is not None and what in entries and entries[what][0] == version:
        return entries[what][1]
    result = make(source)
    if result.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
        if entries is None:
            entries = _DERIVED[source] = {}
        entries[what] = (version, result)
    return result
