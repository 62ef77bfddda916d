"""NVFP4 (Transformer Engine's NVFP4BlockScaling, emulated exactly): NVFP4Quantizer and
NVFP4TensorStorage.

Shapes: a value of shape (..., K) with M = prod(...) rows, M and K multiples of 16, is kept as
rowwise data (M, K/2) uint8 (two E2M1 codes a byte, the first in the low nibble) with E4M3
scales (round_up(M, 128), round_up(K/16, 4)) uint8 and a per-tensor amax (1,) fp32, and/or
columnwise data (K, M/2) uint8 (the codes of x^T, of RHT(x^T) when the quantizer applies the
random Hadamard transform) with scales (round_up(K, 128), round_up(M/16, 4)) and its own amax.
The value of a code: e2m1 * e4m3 block scale * amax / (6 * 448). kernels/nvfp4_cast.py has the
bytes and the arithmetic (Transformer Engine's).

GEMMs take gemm_operand(usage): the exact products e2m1 * block scale in bf16 and the
per-tensor factor amax * fp32(1 / 2688). Both operands of the wgrad GEMM (dy and x, columnwise)
carry the same orthogonal transform along the reduced dimension, so it cancels in dy^T x.
On compute capability 10+ (untested here) gemm_operand hands out the FP4 bytes for torch's
NVFP4 matmul instead (quantization/mx_operand.py).
"""

from __future__ import annotations

import functools
import math

import torch

from torchte._device import block_gemm_native
from torchte.kernels import nvfp4_cast as nv
from torchte.kernels.hadamard import hadamard_matrix, rht16_reference, sign_mask

from ._block_common import BlockQuantizerMixin, SavedTensorsStorage
from .base import GemmOperand, Quantizer
from .mx_operand import nvfp4_native_fits, nvfp4_native_operand
from .quantizer_te import TEQuantizerMethods

__all__ = ["NVFP4Quantizer", "NVFP4TensorStorage"]

# The dtype naming the values (the data tensors themselves are uint8, as in Transformer Engine).
FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
_COPIES = ("rowwise", "columnwise")


class NVFP4TensorStorage(SavedTensorsStorage):
    """An NVFP4 value inside autograd: data tensors, E4M3 block scales and per-tensor amaxes of
    its rowwise and columnwise copies (module docstring); no Tensor subclass.

    rht_sign_mask: the sign mask of the transform the columnwise copy holds, None without one.
    with_2d_quantization: 16 x 16 blocks, so one copy is the other's exact transpose.
    """

    __slots__ = (
        "amax_columnwise",
        "amax_rowwise",
        "columnwise_data",
        "columnwise_scale_inv",
        "fp8_dtype",
        "rht_sign_mask",
        "rowwise_data",
        "rowwise_scale_inv",
        "shape",
        "with_2d_quantization",
    )
    # The data tensors, in get_data_tensors' order (Transformer Engine's saving order).
    _SAVED = (
        "rowwise_data",
        "columnwise_data",
        "rowwise_scale_inv",
        "columnwise_scale_inv",
        "amax_rowwise",
        "amax_columnwise",
    )

    def __init__(
        self,
        rowwise_data: torch.Tensor | None,
        rowwise_scale_inv: torch.Tensor | None,
        columnwise_data: torch.Tensor | None,
        columnwise_scale_inv: torch.Tensor | None,
        amax_rowwise: torch.Tensor | None,
        amax_columnwise: torch.Tensor | None,
        shape: tuple[int, ...],
        *,
        rht_sign_mask: int | None = None,
        with_2d_quantization: bool = False,
    ) -> None:
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.amax_rowwise = amax_rowwise
        self.amax_columnwise = amax_columnwise
        self.fp8_dtype = FP4_DTYPE
        self.shape = tuple(shape)
        self.rht_sign_mask = rht_sign_mask
        self.with_2d_quantization = with_2d_quantization

    def _copy(self, usage: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(data, scales, amax) of copy `usage`; RuntimeError when it is missing."""
        data = getattr(self, f"{usage}_data")
        scale = getattr(self, f"{usage}_scale_inv")
        amax = getattr(self, f"amax_{usage}")
        if data is None or scale is None or amax is None:
            raise RuntimeError(f"NVFP4TensorStorage has no {usage} data (usage dropped or saved)")
        return data, scale, amax

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The high-precision value (shape `self.shape`, `dtype`), from the rowwise copy as
        Transformer Engine's dequantize computes it, else from the columnwise copy, its
        transform undone (the transpose of an orthogonal matrix) when it holds one."""
        if self.rowwise_data is not None:
            data, scale, amax = self._copy("rowwise")
            return nv.dequantize(data, scale, amax, dtype).reshape(self.shape)
        if self.columnwise_data is None:
            raise RuntimeError("NVFP4TensorStorage holds no data (emptied by prepare_for_saving?)")
        data, scale, amax = self._copy("columnwise")
        if self.rht_sign_mask is None:
            return nv.dequantize(data, scale, amax, dtype).t().reshape(self.shape)
        values_t = nv.dequantize(data, scale, amax, torch.float32)
        values = rht16_reference(values_t.t(), self.rht_sign_mask, inverse=True)
        return values.to(dtype).reshape(self.shape)

    def gemm_operand(self, usage: str) -> GemmOperand:
        """The GEMM operand of copy `usage`: "rowwise" (num_rows, K), "columnwise" (K,
        num_rows) (transformed along num_rows when the copy holds RHT values). Where NVFP4
        GEMMs run natively (compute capability 10+, _device.block_gemm_native; untested on
        such hardware here) and the packed rows are a multiple of 16 bytes: an "nvfp4" operand
        (quantization/mx_operand.py: the FP4 bytes, the scales swizzled, the per-tensor
        factor); else GemmOperand("values", v, factor), v the bf16 exact products e2m1 * block
        scale, factor (1,) fp32 the per-tensor decode factor."""
        if usage not in _COPIES:
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        data, scale, amax = self._copy(usage)
        native = block_gemm_native("NVFP4BlockScaling", data.device)[0]
        if native and nvfp4_native_fits(data.shape[1] * 2):
            return nvfp4_native_operand(data, scale, amax)
        values = nv.dequantize_values(data, scale, torch.bfloat16)
        return GemmOperand("values", values, nv.tensor_factor(amax))

    def update_usage(
        self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None
    ) -> None:
        """Drop (False) or make (True) the rowwise / columnwise copy; None leaves it as is. A
        missing copy is made from the other only with 2-D blocks and no RHT (an exact
        transpose, as Transformer Engine makes it); otherwise RuntimeError."""
        if rowwise_usage and self.rowwise_data is None:
            self._transpose_from("columnwise", "rowwise")
        if columnwise_usage and self.columnwise_data is None:
            self._transpose_from("rowwise", "columnwise")
        for usage, wanted in zip(_COPIES, (rowwise_usage, columnwise_usage), strict=True):
            if wanted is False:
                setattr(self, f"{usage}_data", None)
                setattr(self, f"{usage}_scale_inv", None)
                setattr(self, f"amax_{usage}", None)

    def _transpose_from(self, source: str, target: str) -> None:
        """Make copy `target` as the exact transpose of copy `source` (2-D blocks, no RHT)."""
        if getattr(self, f"{source}_data") is None:
            raise RuntimeError(f"cannot make {target} NVFP4 data: the storage holds none at all")
        if not self.with_2d_quantization:
            raise RuntimeError(
                f"cannot make the {target} NVFP4 copy from the {source} one: with 1 x 16 blocks "
                "the two copies scale different blocks, and requantizing the dequantized values "
                "is not exact (Transformer Engine makes a copy only for 2-D quantization)"
            )
        if self.rht_sign_mask is not None:
            raise RuntimeError(
                f"cannot make the {target} NVFP4 copy from the {source} one: the columnwise copy "
                "holds Hadamard-transformed values"
            )
        data, scale, amax = self._copy(source)
        rows, cols = data.shape[0], data.shape[1] * 2
        tiles = scale[: rows : nv.FP4_BLOCK, : cols // nv.FP4_BLOCK]
        new_scale = torch.zeros(nv.scale_shape(cols, rows), dtype=scale.dtype, device=scale.device)
        new_scale[:cols, : rows // nv.FP4_BLOCK] = tiles.t().repeat_interleave(nv.FP4_BLOCK, 0)
        setattr(self, f"{target}_data", nv.fp4_transpose(data))
        setattr(self, f"{target}_scale_inv", new_scale)
        setattr(self, f"amax_{target}", amax.clone())

    def copy_from_(self, src: NVFP4TensorStorage) -> None:
        """Overwrite this value's bytes with src's (same shape and kind), keeping every data
        tensor's address; RuntimeError where src lacks a tensor this value holds."""
        if not isinstance(src, NVFP4TensorStorage) or src.shape != self.shape:
            raise TypeError(f"copy_from_ needs an NVFP4TensorStorage of shape {self.shape}")
        if (src.rht_sign_mask, src.with_2d_quantization) != (
            self.rht_sign_mask,
            self.with_2d_quantization,
        ):
            raise RuntimeError("copy_from_: the source is quantized differently (RHT / 2-D)")
        names = type(self).__slots__
        for name, dst_t, src_t in zip(names, self._slots(), src._slots(), strict=True):
            if not isinstance(dst_t, torch.Tensor):
                continue
            if src_t is None:
                raise RuntimeError(f"cannot copy NVFP4 {name}: the source has none")
            dst_t.copy_(src_t)

    def _slots(self) -> tuple:
        return tuple(getattr(self, name) for name in type(self).__slots__)

    def __repr__(self) -> str:
        usage = [u for u in _COPIES if getattr(self, f"{u}_data") is not None]
        extra = ", 2d" if self.with_2d_quantization else ""
        extra += ", rht" if self.rht_sign_mask is not None else ""
        return f"NVFP4TensorStorage(shape={self.shape}, usage={usage}{extra})"


def _all_reduce_max(amax: torch.Tensor, group) -> None:
    """All-reduce amax in place with MAX over `group` (TE's amax_reduction_group)."""
    import torch.distributed as dist

    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def _check_fp4_dtype(fp4_dtype) -> None:
    """TypeError unless fp4_dtype names E2M1 (torch.float4_e2m1fn_x2 or TE's kFloat4E2M1)."""
    if fp4_dtype is None or fp4_dtype is FP4_DTYPE or str(fp4_dtype).endswith("kFloat4E2M1"):
        return
    raise TypeError(f"fp4_dtype must be E2M1 ({FP4_DTYPE} or DType.kFloat4E2M1), got {fp4_dtype}")


class NVFP4Quantizer(BlockQuantizerMixin, TEQuantizerMethods, Quantizer):
    """Quantizes to NVFP4 with Transformer Engine's keywords and numerics: per-tensor amax
    (all-reduced with amax_reduction when set), E4M3 scales over blocks of 16 (16 x 16 tiles
    with with_2d_quantization), the random Hadamard transform of the columnwise copy
    (with_rht; its amax taken after the transform, with_post_rht_amax), stochastic rounding.

    amax_reduction: None, or a function all-reducing a (1,) fp32 tensor in place with MAX over
    the ranks that hold pieces of one tensor; with_amax_reduction=True and
    amax_reduction_group set it to torch.distributed's all-reduce over that group. Not
    implemented (NotImplementedError): row_scaled_nvfp4, nvfp4_use_4over6, and the Tensor form
    (internal=False).
    """

    __slots__ = (
        "_specs",
        "amax_reduction",
        "amax_reduction_group",
        "columnwise_usage",
        "dtype",
        "nvfp4_4over6_err_mode",
        "nvfp4_e4m3_max",
        "nvfp4_use_4over6",
        "rht_matrix_random_sign_mask_t",
        "row_scaled_nvfp4",
        "rowwise_usage",
        "stochastic_rounding",
        "with_2d_quantization",
        "with_amax_reduction",
        "with_post_rht_amax",
        "with_rht",
    )

    # Producer kernels (norm -> FP8, activation -> FP8) do not write NVFP4.
    fusable = False

    def __init__(
        self,
        fp4_dtype=None,
        rowwise: bool = True,
        columnwise: bool = True,
        with_amax_reduction: bool = False,
        amax_reduction_group=None,
        with_rht: bool = False,
        with_post_rht_amax: bool = False,
        with_2d_quantization: bool = False,
        stochastic_rounding: bool = False,
        row_scaled_nvfp4: bool = False,
        nvfp4_use_4over6: bool = False,
        nvfp4_e4m3_max: int = 448,
        nvfp4_4over6_err_mode: str = "MAE",
        with_random_sign_mask: bool = True,
        internal: bool = True,
    ) -> None:
        _check_fp4_dtype(fp4_dtype)
        if nvfp4_e4m3_max not in (448, 256):
            raise ValueError(f"nvfp4_e4m3_max must be 448 or 256, got {nvfp4_e4m3_max}")
        if str(nvfp4_4over6_err_mode).upper() not in ("MAE", "MSE"):
            raise ValueError(
                f"nvfp4_4over6_err_mode must be 'MAE' or 'MSE', got {nvfp4_4over6_err_mode!r}"
            )
        for name, value in (
            ("row_scaled_nvfp4", row_scaled_nvfp4),
            ("nvfp4_use_4over6", nvfp4_use_4over6),
        ):
            if value:
                raise NotImplementedError(
                    f"NVFP4Quantizer({name}=True) is not implemented in torchte yet"
                )
        super().__init__(FP4_DTYPE, internal)
        self.dtype = FP4_DTYPE
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise
        self.with_amax_reduction = with_amax_reduction
        self.amax_reduction_group = amax_reduction_group
        self.amax_reduction = None
        if with_amax_reduction:
            self.amax_reduction = functools.partial(_all_reduce_max, group=amax_reduction_group)
        self.with_rht, self.with_post_rht_amax = with_rht, with_post_rht_amax
        self.with_2d_quantization = with_2d_quantization
        self.stochastic_rounding = stochastic_rounding
        self.row_scaled_nvfp4, self.nvfp4_use_4over6 = row_scaled_nvfp4, nvfp4_use_4over6
        self.nvfp4_e4m3_max = 448  # as in Transformer Engine without 4over6
        self.nvfp4_4over6_err_mode = str(nvfp4_4over6_err_mode).upper()
        self.rht_matrix_random_sign_mask_t = sign_mask(with_random_sign_mask)
        self._specs: dict[tuple, nv.NVFP4Spec] = {}

    @property
    def rht_matrix(self) -> torch.Tensor:
        """(16, 16) bf16 diag(signs) @ H / 4, the matrix of the transform (on the CPU)."""
        return hadamard_matrix(self.rht_matrix_random_sign_mask_t, torch.bfloat16)

    def spec(self, rowwise: bool, columnwise: bool) -> nv.NVFP4Spec:
        """How the NVFP4 kernels write this quantizer's output with these copies (cached per
        setting: the attributes stay mutable, as in Transformer Engine)."""
        key = (
            rowwise, columnwise, self.with_rht, self.with_post_rht_amax,
            self.with_2d_quantization, self.stochastic_rounding,
            self.rht_matrix_random_sign_mask_t,
        )  # fmt: skip
        spec = self._specs.get(key)
        if spec is None:
            if self.with_rht and not self.with_post_rht_amax:
                raise NotImplementedError(
                    "NVFP4 RHT needs with_post_rht_amax=True (the columnwise amax taken after "
                    "the transform); a pre-RHT amax is not supported, as in Transformer Engine"
                )
            spec = nv.NVFP4Spec(rowwise, columnwise, *key[2:3], *key[4:])
            self._specs[key] = spec
        return spec

    def quantize(
        self, x_hp: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> NVFP4TensorStorage:
        """x_hp (..., K) fp32 / bf16 / fp16, prod(...) and K multiples of 16 -> the
        NVFP4TensorStorage of its copies (None: the quantizer's rowwise / columnwise usage);
        with internal=False wrapped as an NVFP4Tensor."""
        rowwise = self.rowwise_usage if rowwise is None else rowwise
        columnwise = self.columnwise_usage if columnwise is None else columnwise
        x2d = self._as_2d(x_hp)
        spec = self.spec(rowwise, columnwise)
        amax = nv.compute_amax(x2d, spec)
        if self.amax_reduction is not None:
            self._reduce(amax, spec)
        rng = self._rng_state(x2d.device) if spec.stochastic else None
        data, scale, data_t, scale_t = nv.quantize(x2d, amax, spec, rng)
        storage = NVFP4TensorStorage(
            data, scale, data_t, scale_t,
            amax[0:1] if rowwise else None, amax[1:2] if columnwise else None,
            tuple(x_hp.shape),
            rht_sign_mask=spec.sign_mask if spec.rht else None,
            with_2d_quantization=spec.two_d,
        )  # fmt: skip
        return self._output(storage, x_hp.dtype)

    @staticmethod
    def _as_2d(x_hp: torch.Tensor) -> torch.Tensor:
        """x_hp (..., K) as (M, K); ValueError (naming the dimension, its size and the block of
        16) where M or K is not a multiple of 16, TypeError for another dtype."""
        if not isinstance(x_hp, torch.Tensor) or x_hp.dim() == 0:
            raise ValueError("NVFP4Quantizer.quantize needs a tensor x_hp of shape (..., K)")
        rows = math.prod(x_hp.shape[:-1])
        if rows % nv.FP4_BLOCK:
            raise ValueError(
                f"NVFP4 needs the rows M = prod(x_hp.shape[:-1]) divisible by its block of "
                f"{nv.FP4_BLOCK}: got M = {rows} (x_hp of shape {tuple(x_hp.shape)})"
            )
        x2d = x_hp.reshape(rows, x_hp.shape[-1])
        nv.check_shape(x2d)
        return x2d

    def _reduce(self, amax: torch.Tensor, spec: nv.NVFP4Spec) -> None:
        """All-reduce the per-tensor amaxes with amax_reduction: both with RHT (they differ),
        else one, copied to the other."""
        self.amax_reduction(amax[0:1])
        if spec.rht and spec.columnwise:
            self.amax_reduction(amax[1:2])
        else:
            amax[1:2].copy_(amax[0:1])

    @staticmethod
    def _rng_state(device: torch.device) -> torch.Tensor:
        """(2,) int64 Philox seed and offset drawn from torch's generator of `device` (on the
        device: no host sync; a CUDA graph replays a fresh draw)."""
        return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)

    def is_quantizable(self, x_hp: torch.Tensor) -> bool:
        """Whether x_hp has the shape NVFP4 needs (at least 2-D, rows and K multiples of 16)."""
        rows = math.prod(x_hp.shape[:-1])
        return x_hp.dim() >= 2 and rows % nv.FP4_BLOCK == 0 and x_hp.shape[-1] % nv.FP4_BLOCK == 0

    def get_scale_shape(self, shape, columnwise: bool) -> tuple[int, int]:
        """The scale shape of a value of `shape`'s rowwise or columnwise copy (TE's padding)."""
        rows, cols = math.prod(shape[:-1]), shape[-1]
        return nv.scale_shape(cols, rows) if columnwise else nv.scale_shape(rows, cols)

    def copy(self) -> NVFP4Quantizer:
        """A quantizer with the same settings (and the same amax_reduction)."""
        quantizer = NVFP4Quantizer(
            None, self.rowwise_usage, self.columnwise_usage, False, self.amax_reduction_group,
            self.with_rht, self.with_post_rht_amax, self.with_2d_quantization,
            self.stochastic_rounding, internal=self.internal,
            with_random_sign_mask=self.rht_matrix_random_sign_mask_t != 0,
        )  # fmt: skip
        quantizer.with_amax_reduction = self.with_amax_reduction
        quantizer.amax_reduction = self.amax_reduction
        return quantizer

    def __repr__(self) -> str:
        flags = [
            n
            for n in ("with_rht", "with_2d_quantization", "stochastic_rounding")
            if getattr(self, n)
        ]
        return f"NVFP4Quantizer(usage=({self.rowwise_usage}, {self.columnwise_usage}), {flags})"
