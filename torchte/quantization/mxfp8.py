"""MXFP8 (Transformer Engine's MXFP8BlockScaling): MXFP8TensorStorage and MXFP8Quantizer.

Shapes: a value of shape (..., K) with M = prod(...) rows (M and K multiples of 32) is kept as
rowwise data (M, K) with E8M0 codes (round_up(M, 128), round_up(K / 32, 4)) uint8, one per row
and 32 columns, and/or columnwise data (M, K), the same layout (not transposed), with codes
(round_up(M / 32, 4), round_up(K, 128)) uint8, one per column and 32 rows. Both copies hold
FP8 values in one dtype; value = data * 2**(code - 127). The scale buffers are Transformer
Engine's compact (unswizzled) layout with its padding, the padding zero (kernels/mxfp8_cast.py
says how the GEMM-swizzled form differs). With 2-D quantization (`with_2d_quantization`) each
32x32 block has one code and the two copies are the same bytes.

Hopper has no MXFP8 GEMM: a GEMM takes the exact dequantized values (gemm_operand, bf16). On
compute capability 10+ (untested here) gemm_operand hands out the bytes for torch's MX-scaled
matmul instead (quantization/mx_operand.py).
"""

from __future__ import annotations

import math

import torch

from torchte._device import block_gemm_native
from torchte._sizes import check_splits
from torchte.constants import TE_DType, TE_DType_To_Torch
from torchte.kernels import mxfp8_cast as mx

from ._block_common import BlockQuantizerMixin, SavedTensorsStorage
from .base import GemmOperand, Quantizer
from .mx_operand import mxfp8_native_operand
from .quantizer_te import TEQuantizerMethods

__all__ = ["MXFP8Quantizer", "MXFP8TensorStorage"]

_USAGES = ("rowwise", "columnwise")
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MXFP8TensorStorage(SavedTensorsStorage):
    """An MXFP8 value inside autograd: data tensors and E8M0 scale codes, no Tensor subclass.

    rowwise_data / columnwise_data: (M, K) FP8 (fp8_dtype) or None; rowwise_scale_inv /
    columnwise_scale_inv: their uint8 codes (see the module docstring) or None; shape: the
    logical shape (..., K); two_d: whether the codes are per 32x32 block.
    """

    __slots__ = (
        "columnwise_data",
        "columnwise_scale_inv",
        "fp8_dtype",
        "rowwise_data",
        "rowwise_scale_inv",
        "shape",
        "two_d",
    )
    # The data tensors, in get_data_tensors' order (Transformer Engine's order of saving).
    _SAVED = ("rowwise_data", "columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv")

    # The scales are always in the compact layout (Transformer Engine's attribute name).
    with_gemm_swizzled_scales = False

    def __init__(
        self,
        rowwise_data: torch.Tensor | None,
        rowwise_scale_inv: torch.Tensor | None,
        columnwise_data: torch.Tensor | None,
        columnwise_scale_inv: torch.Tensor | None,
        fp8_dtype: torch.dtype,
        shape: tuple[int, ...],
        two_d: bool = False,
    ) -> None:
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.fp8_dtype = fp8_dtype
        self.shape = tuple(shape)
        self.two_d = two_d

    def _copy(self, usage: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(data, scale_inv) of `usage` ("rowwise" or "columnwise")."""
        return getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The high-precision value (shape `self.shape`, `dtype`), from the rowwise copy if
        present, else the columnwise one."""
        for usage in _USAGES:
            data, scale = self._copy(usage)
            if data is not None:
                values = mx.mxfp8_dequantize(data, scale, usage == "rowwise", dtype)
                return values.reshape(self.shape)
        raise RuntimeError("MXFP8TensorStorage holds no data (emptied by prepare_for_saving?)")

    def gemm_operand(self, usage: str) -> GemmOperand:
        """The GEMM operand of copy `usage`: "rowwise" (num_rows, K) from the rowwise copy,
        "columnwise" (K, num_rows) from the columnwise copy. Where MXFP8 GEMMs run natively
        (compute capability 10+, _device.block_gemm_native; untested on such hardware here):
        an "mx" operand (quantization/mx_operand.py: the FP8 bytes, K-major, the columnwise
        copy transposed, the codes swizzled); elsewhere GemmOperand("values", v, None), v the
        exact dequantized operand in bf16 (of the columnwise copy: a transposed view)."""
        if usage not in _USAGES:
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        data, scale = self._copy(usage)
        if data is None:
            raise RuntimeError(
                f"MXFP8TensorStorage has no {usage} data for a {usage} GEMM operand (quantize "
                f"with {usage}=True, or keep it with update_usage)"
            )
        if block_gemm_native("MXFP8BlockScaling", data.device)[0]:
            return mxfp8_native_operand(data, scale, usage == "columnwise")
        values = mx.mxfp8_dequantize(data, scale, usage == "rowwise", torch.bfloat16)
        return GemmOperand("values", values if usage == "rowwise" else values.t(), None)

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Drop (False) the rowwise / columnwise copy; None leaves one as is. True keeps a copy
        that is there; a missing one can be made from the other only under 2-D quantization
        (the same bytes, the codes laid out again); otherwise RuntimeError: its 1x32 and 32x1
        blocks have different scales, so one copy's values cannot give the other's."""
        if rowwise_usage and self.rowwise_data is None:
            self._make("rowwise")
        if columnwise_usage and self.columnwise_data is None:
            self._make("columnwise")
        if rowwise_usage is False:
            self.rowwise_data = self.rowwise_scale_inv = None
        if columnwise_usage is False:
            self.columnwise_data = self.columnwise_scale_inv = None

    def _make(self, usage: str) -> None:
        other = "columnwise" if usage == "rowwise" else "rowwise"
        data, scale = self._copy(other)
        if data is None:
            raise RuntimeError(f"cannot make {usage} MXFP8 data: the MXFP8TensorStorage holds none")
        if not self.two_d:
            raise RuntimeError(
                f"cannot make {usage} MXFP8 data from the {other} copy: rowwise scales cover "
                "1x32 blocks and columnwise scales 32x1 blocks, so the two copies hold different "
                "values and neither is made from the other (as in Transformer Engine); quantize "
                "with both usages instead"
            )
        rows, cols = data.shape
        mb, nb = rows // mx.BLOCK, cols // mx.BLOCK
        if usage == "rowwise":  # one code per 32x32 block, at every row of its block
            codes = scale[:mb, :cols:32].repeat_interleave(mx.BLOCK, dim=0)
        else:  # at every column of its block
            codes = scale[:rows:32, :nb].repeat_interleave(mx.BLOCK, dim=1)
        padded = torch.zeros(
            mx.scale_shape(rows, cols, usage == "columnwise"), dtype=torch.uint8, device=data.device
        )
        padded[: codes.shape[0], : codes.shape[1]] = codes
        setattr(self, f"{usage}_data", data.clone())
        setattr(self, f"{usage}_scale_inv", padded)

    def copy_from_(self, src: MXFP8TensorStorage) -> None:
        """Overwrite this value's bytes with src's (same shape and FP8 dtype), keeping every
        tensor's address; each copy this value holds must be in src too."""
        if not isinstance(src, MXFP8TensorStorage):
            raise TypeError(f"copy_from_ expects an MXFP8TensorStorage, got {type(src).__name__}")
        if (src.fp8_dtype, src.shape) != (self.fp8_dtype, self.shape):
            raise RuntimeError(
                f"copy_from_: source {src.shape} {src.fp8_dtype} does not match "
                f"{self.shape} {self.fp8_dtype}"
            )
        names = ("rowwise_data", "columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv")
        pairs = [(getattr(self, n), getattr(src, n), n) for n in names]
        for dst_t, src_t, name in pairs:
            if dst_t is not None and src_t is None:
                raise RuntimeError(f"cannot copy MXFP8 {name}: the source has none")
        for dst_t, src_t, _ in pairs:
            if dst_t is not None:
                dst_t.copy_(src_t)
        self.two_d = src.two_d

    def __repr__(self) -> str:
        usage = [u for u in _USAGES if self._copy(u)[0] is not None]
        blocks = "32x32" if self.two_d else "1x32/32x1"
        return (
            f"MXFP8TensorStorage(shape={self.shape}, dtype={self.fp8_dtype}, usage={usage}, "
            f"blocks={blocks})"
        )


def _torch_fp8_dtype(fp8_dtype) -> torch.dtype:
    """The torch FP8 dtype of `fp8_dtype`, a torch dtype or a Transformer Engine DType tag."""
    if not isinstance(fp8_dtype, torch.dtype):
        fp8_dtype = TE_DType_To_Torch.get(fp8_dtype, fp8_dtype)
    if fp8_dtype not in mx.FP8_MAX:
        raise TypeError(
            f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 (or DType.kFloat8E4M3 "
            f"/ kFloat8E5M2), got {fp8_dtype!r}"
        )
    return fp8_dtype


class MXFP8Quantizer(BlockQuantizerMixin, TEQuantizerMethods, Quantizer):
    """Quantizes to MXFP8: FP8 values with one E8M0 scale per 32 values, from the values
    themselves (no amax history). Transformer Engine's constructor: fp8_dtype (a torch FP8
    dtype or DType tag), rowwise / columnwise (the usages quantize makes by default),
    with_2d_quantization (one scale per 32x32 block); plus internal (True: a Storage; False:
    the MXFP8Tensor form, not implemented yet)."""

    __slots__ = ("amax_reduction", "columnwise_usage", "rowwise_usage", "with_2d_quantization")

    # Producers (norm -> FP8, activation -> FP8) do not write this format.
    fusable = False

    def __init__(
        self,
        fp8_dtype,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        with_2d_quantization: bool = False,
        internal: bool = True,
    ) -> None:
        super().__init__(_torch_fp8_dtype(fp8_dtype), internal)
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.with_2d_quantization = with_2d_quantization
        # Block scales need no agreement across ranks: kept for the quantizer protocol.
        self.amax_reduction = None

    @property
    def dtype(self):
        """The FP8 dtype as Transformer Engine's DType tag."""
        return TE_DType[self.fp8_dtype]

    def copy(self) -> MXFP8Quantizer:
        """A quantizer with the same settings."""
        return MXFP8Quantizer(
            self.fp8_dtype,
            rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage,
            with_2d_quantization=self.with_2d_quantization,
            internal=self.internal,
        )

    def quantize(
        self, x_hp: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> MXFP8TensorStorage:
        """x_hp (..., K) fp32 / bf16 / fp16, K and prod(...) multiples of 32 -> an
        MXFP8TensorStorage with the rowwise / columnwise copies asked for (None: this
        quantizer's usages), both made from x_hp in one pass; with internal=False wrapped as
        an MXFP8Tensor."""
        rowwise = self.rowwise_usage if rowwise is None else rowwise
        columnwise = self.columnwise_usage if columnwise is None else columnwise
        if not isinstance(x_hp, torch.Tensor):
            raise TypeError(f"x_hp must be a torch.Tensor, got {type(x_hp).__name__}")
        if x_hp.dtype not in _HP_DTYPES:
            raise TypeError(f"x_hp must be fp32, bf16 or fp16, got {x_hp.dtype}")
        mx.check_mxfp8_shape(tuple(x_hp.shape), "x_hp")
        x2d = x_hp.detach().reshape(-1, x_hp.shape[-1])
        outputs = mx.mxfp8_quantize(
            x2d, self.fp8_dtype, rowwise, columnwise, self.with_2d_quantization
        )
        storage = MXFP8TensorStorage(
            *outputs, self.fp8_dtype, tuple(x_hp.shape), self.with_2d_quantization
        )
        return self._output(storage, x_hp.dtype)

    def __call__(self, x_hp: torch.Tensor) -> MXFP8TensorStorage:
        """quantize(x_hp) with this quantizer's usages (Transformer Engine's call form)."""
        return self.quantize(x_hp)

    def quantize_grouped(
        self,
        x_hp: torch.Tensor,
        m_splits: list[int],
        *,
        rowwise: bool | None = None,
        columnwise: bool | None = None,
    ) -> list[MXFP8TensorStorage]:
        """The groups of rows of x_hp (T, K) (group g: m_splits[g] rows, each a multiple of 32,
        summing to T) quantized one by one: a list of MXFP8TensorStorage, the columnwise 32-row
        blocks starting again at each group's first row (Transformer Engine's split
        quantization). One launch per non-empty group."""
        if not isinstance(x_hp, torch.Tensor) or x_hp.dim() != 2:
            shape = tuple(x_hp.shape) if isinstance(x_hp, torch.Tensor) else type(x_hp).__name__
            raise ValueError(f"x_hp must be a 2-D tensor (T, K), got {shape}")
        m_splits = [int(m) for m in m_splits]
        check_splits(m_splits, x_hp.shape[0])
        for g, m in enumerate(m_splits):
            if m % mx.BLOCK:
                raise ValueError(
                    f"m_splits[{g}] = {m}: every group's rows must be a multiple of the MXFP8 "
                    f"block of {mx.BLOCK} (pad the groups, e.g. with te.Fp8Padding)"
                )
        groups = torch.split(x_hp, m_splits) if m_splits else ()
        return [self.quantize(g, rowwise=rowwise, columnwise=columnwise) for g in groups]

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether inp can be quantized: at least 2-D, its last dim and its number of rows
        multiples of 32."""
        if inp.dim() < 2:
            return False
        return inp.shape[-1] % mx.BLOCK == 0 and math.prod(inp.shape[:-1]) % mx.BLOCK == 0

    def get_scale_shape(self, shape, columnwise: bool) -> tuple[int, int]:
        """The shape of the (padded) scale_inv of a value of `shape` (..., K)."""
        shape = tuple(shape)
        return mx.scale_shape(math.prod(shape[:-1]), shape[-1], columnwise)

    def get_columnwise_shape(self, shape) -> tuple[int, ...]:
        """The shape of the columnwise data: the same as the rowwise data's (not transposed)."""
        return tuple(shape)

    def calibrate(self, tensor: torch.Tensor) -> None:
        """MXFP8 keeps no statistics: nothing to calibrate."""

    def __repr__(self) -> str:
        return (
            f"MXFP8Quantizer(fp8_dtype={self.fp8_dtype}, rowwise={self.rowwise_usage}, "
            f"columnwise={self.columnwise_usage}, "
            f"with_2d_quantization={self.with_2d_quantization}, internal={self.internal})"
        )
