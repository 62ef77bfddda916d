"""Per-tensor FP8: Float8Storage and the delayed / current scaling quantizers.

Shapes: a value of shape (..., N) with M = prod(...) rows is kept as rowwise data (M, N) and/or
columnwise data (N, Mp) (the transpose, Mp = M rounded up to 16, zero padding), both in one
FP8 dtype, with one fp32 scale_inv of shape (1,): value = data * scale_inv.
"""

from __future__ import annotations

import math

import torch

from torchte.constants import TE_DType, TE_DType_To_Torch
from torchte.kernels import cast_transpose as ct
from torchte.kernels.cast_spec import CastSpec

from .base import Quantizer, TwoUsageStorage
from .quantizer_te import TEQuantizerMethods

__all__ = ["Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8Storage"]


class Float8Storage(TwoUsageStorage):
    """An FP8 value inside autograd: data tensors and a scale_inv, no Tensor subclass."""

    __slots__ = ("columnwise_data", "fp8_dtype", "rowwise_data", "scale_inv", "shape")

    def __init__(
        self,
        rowwise_data: torch.Tensor | None,
        columnwise_data: torch.Tensor | None,
        scale_inv: torch.Tensor,
        fp8_dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> None:
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        self.scale_inv = scale_inv
        self.fp8_dtype = fp8_dtype
        self.shape = tuple(shape)

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def device(self) -> torch.device:
        return self.scale_inv.device

    # Transformer Engine's names of the fields (Float8TensorStorage), for its clients: the
    # fields stay torchte's (__slots__), these only map to them.

    @property
    def _data(self) -> torch.Tensor | None:
        """The rowwise FP8 bytes (M, N) as a uint8 view; None without rowwise data. Assigning
        a contiguous uint8 (or FP8) tensor of prod(shape) elements on the storage's device
        makes its memory the rowwise data (aliased); None drops the rowwise data."""
        row = self.rowwise_data
        return None if row is None else row.view(torch.uint8)

    @_data.setter
    def _data(self, data: torch.Tensor | None) -> None:
        if data is None:
            self.rowwise_data = None
            return
        from .float8_tensor_te import as_fp8_bytes

        flat = as_fp8_bytes(
            data, self.fp8_dtype, math.prod(self.shape), "Float8TensorStorage._data", self.device
        )
        self.rowwise_data = flat.view(self.num_rows, self.shape[-1])

    @property
    def _transpose(self) -> torch.Tensor | None:
        """The transposed FP8 bytes (N, M) as a uint8 view of the columnwise data (whose rows
        are padded to 16 underneath); None without it. Assigning None drops it; a tensor
        (N, M) or padded (N, Mp), uint8 or FP8, becomes it (aliased where the layout allows)."""
        cols = self.columnwise_data
        return None if cols is None else cols[:, : self.num_rows].view(torch.uint8)

    @_transpose.setter
    def _transpose(self, transpose: torch.Tensor | None) -> None:
        if transpose is None:
            self.columnwise_data = None
            return
        from .float8_tensor_te import columnwise_of

        self.columnwise_data = columnwise_of(
            transpose,
            self.fp8_dtype,
            self.num_rows,
            self.shape[-1],
            "Float8TensorStorage._transpose",
        )

    @property
    def _scale_inv(self) -> torch.Tensor:
        """scale_inv (1,) fp32 (assignable)."""
        return self.scale_inv

    @_scale_inv.setter
    def _scale_inv(self, scale_inv: torch.Tensor) -> None:
        self.scale_inv = scale_inv

    @property
    def _fp8_dtype(self):
        """The FP8 dtype as Transformer Engine's DType tag (fp8_dtype is the torch dtype)."""
        return TE_DType[self.fp8_dtype]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The high-precision value (shape `self.shape`, `dtype`)."""
        if self.rowwise_data is not None:
            data = self.rowwise_data
        elif self.columnwise_data is not None:
            data = self.columnwise_data[:, : self.num_rows].t()
        else:
            raise RuntimeError("Float8Storage holds no data (emptied by prepare_for_saving?)")
        return (data.float() * self.scale_inv).to(dtype).reshape(self.shape)

    def _rowwise_from_columnwise(self) -> torch.Tensor:
        cols = self.columnwise_data[:, : self.num_rows]
        return cols.view(torch.uint8).t().contiguous().view(self.fp8_dtype)

    def _columnwise_from_rowwise(self) -> torch.Tensor:
        return ct.fp8_transpose(self.rowwise_data)

    def copy_from_(self, src: Float8Storage) -> None:
        """Overwrite this value's bytes with src's, keeping every data tensor's address."""
        for name in ("rowwise_data", "columnwise_data", "scale_inv"):
            dst_t, src_t = getattr(self, name), getattr(src, name)
            if dst_t is None:
                continue
            if src_t is None:
                raise RuntimeError(f"cannot copy FP8 {name}: the source has none")
            dst_t.copy_(src_t)

    def __repr__(self) -> str:
        usage = [n for n in ("rowwise", "columnwise") if getattr(self, f"{n}_data") is not None]
        return f"Float8Storage(shape={self.shape}, dtype={self.fp8_dtype}, usage={usage})"


def _one_value(value: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """A one-element fp32 tensor as the (1,) tensor a CastSpec reads (a view: writes through it
    reach the caller's tensor). ValueError naming `name` otherwise."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.dtype != torch.float32:
        if isinstance(value, torch.Tensor):
            got = f"{value.dtype} of shape {tuple(value.shape)}"
        else:
            got = repr(value)
        raise ValueError(f"Float8Quantizer: {name} must be a one-element float32 tensor, got {got}")
    return value if value.dim() == 1 else value.view(1)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2d if x2d.is_contiguous() else x2d.contiguous()


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_torch_dtype(fp8_dtype) -> torch.dtype:
    """The torch FP8 dtype of `fp8_dtype`: torch.float8_e4m3fn / float8_e5m2, or Transformer
    Engine's DType tag of one (DType.kFloat8E4M3 / kFloat8E5M2). TypeError otherwise."""
    if not isinstance(fp8_dtype, torch.dtype):
        fp8_dtype = TE_DType_To_Torch.get(fp8_dtype, fp8_dtype)
    if fp8_dtype not in _FP8_DTYPES:
        raise TypeError(
            f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 (or DType.kFloat8E4M3 / "
            f"DType.kFloat8E5M2), got {fp8_dtype!r}"
        )
    return fp8_dtype


class _Float8Quantizer(TEQuantizerMethods, Quantizer):
    """What both per-tensor quantizers share: the cast through cast_transpose with their
    CastSpec, turning what a kernel wrote into a Float8Storage (or Float8Tensor), and
    Transformer Engine's quantizer API: the usages quantize makes when not told
    (`rowwise_usage`, `columnwise_usage`, `set_usage`), `q(x)`, `dtype` (the DType tag),
    `copy()`, `calibrate(x)`, `create_tensor_from_data`, `get_columnwise_shape`, and
    TEQuantizerMethods' `make_empty` / `update_quantized`."""

    __slots__ = ("_specs", "columnwise_usage", "rowwise_usage")

    # Whether an FP8-writing producer kernel (norm -> FP8, activation -> FP8) can write this
    # quantizer's output: it needs the scale before the values exist.
    fusable = False

    def __init__(
        self, fp8_dtype, internal: bool, rowwise: bool = True, columnwise: bool = True
    ) -> None:
        super().__init__(fp8_torch_dtype(fp8_dtype), bool(internal))
        self.rowwise_usage, self.columnwise_usage = bool(rowwise), bool(columnwise)
        # CastSpec per usage (rowwise * 2 + columnwise), made on first use.
        self._specs: list[CastSpec | None] = [None] * 4

    @property
    def dtype(self):
        """The FP8 dtype as Transformer Engine's DType tag (`fp8_dtype` is the torch dtype)."""
        return TE_DType[self.fp8_dtype]

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Set the copies quantize (and q(x)) makes when not told; None leaves one as is."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def get_usages(self) -> dict[str, bool]:
        """{"rowwise": ..., "columnwise": ...}: the copies quantize makes when not told."""
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}

    def __call__(self, x_hp: torch.Tensor):
        """quantize(x_hp) with this quantizer's usages."""
        return self.quantize(x_hp)

    def calibrate(self, x_hp: torch.Tensor) -> None:
        """Transformer Engine's name: take x_hp's amax as quantizing it would, no cast."""
        self.record_amax(x_hp)

    def create_tensor_from_data(
        self,
        data: torch.Tensor,
        fake_dtype: torch.dtype = torch.float32,
        requires_grad: bool = False,
        internal: bool = False,
    ):
        """A Float8Tensor (a Float8Storage with `internal`) of data's shape over `data` (FP8
        bytes as uint8 or this quantizer's FP8 dtype, contiguous: aliased) as rowwise data,
        of nominal `fake_dtype`, holding this quantizer; scale_inv as _data_scale_inv says."""
        from .float8_tensor import Float8Tensor
        from .float8_tensor_te import te_storage

        if not isinstance(data, torch.Tensor) or data.dtype not in (torch.uint8, *_FP8_DTYPES):
            got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
            raise ValueError(
                f"create_tensor_from_data: data must hold FP8 bytes (torch.uint8 or an FP8 "
                f"dtype), got {got}"
            )
        if data.dtype in _FP8_DTYPES:
            data = data.view(torch.uint8)
        storage = te_storage(
            tuple(data.shape),
            data=data,
            fp8_scale_inv=self._data_scale_inv(data.device),
            fp8_dtype=self.fp8_dtype,
            device=data.device,
        )
        if internal:
            return storage
        return Float8Tensor(storage, fake_dtype, self, requires_grad=requires_grad)

    def _data_scale_inv(self, device: torch.device) -> torch.Tensor:
        """(1,) fp32: the scale_inv create_tensor_from_data gives its value."""
        raise NotImplementedError

    @staticmethod
    def get_columnwise_shape(rowwise_data_shape) -> list[int]:
        """The columnwise (transposed) data's shape for rowwise data of `rowwise_data_shape`
        as Transformer Engine states it: [N, *leading dims] (torchte pads the rows to 16)."""
        shape = list(rowwise_data_shape)
        return shape[-1:] + shape[:-1]

    def _copy_usage_to(self, other: _Float8Quantizer) -> _Float8Quantizer:
        other.rowwise_usage, other.columnwise_usage = self.rowwise_usage, self.columnwise_usage
        return other

    def cast_spec(self, rowwise: bool = True, columnwise: bool = True) -> CastSpec:
        """How a kernel writes this quantizer's output with these usages (see CastSpec)."""
        if torch.compiler.is_compiling():
            return self._new_spec(rowwise, columnwise)  # fresh views in a traced graph
        index = rowwise * 2 + columnwise
        spec = self._specs[index]
        if spec is None:
            spec = self._specs[index] = self._new_spec(rowwise, columnwise)
        return spec

    def _new_spec(self, rowwise: bool, columnwise: bool) -> CastSpec:
        raise NotImplementedError

    def fused_output(self, data, data_t, scale_inv, shape) -> Float8Storage:
        """The Float8Storage of `shape` made of what a kernel wrote with this quantizer's
        CastSpec: rowwise data (M, N) | None, columnwise (N, Mp) | None, scale_inv (1,)."""
        return Float8Storage(data, data_t, scale_inv, self.fp8_dtype, shape)

    def quantize_gathered(self, x_hp, reduce_max, gather, columnwise: bool) -> Float8Storage:
        """Sequence parallelism under FP8: x_hp (M, ..., N) is this rank's piece, along dim 0,
        of a tensor split over P ranks; the result is that whole tensor (P M, ..., N) in FP8,
        cast by each rank for its rows with one scale the ranks agree on and gathered as FP8
        bytes (one byte a value on the wire), the transpose made from the gathered bytes when
        columnwise. reduce_max(t) all-reduces t in place with MAX over the ranks; gather(t)
        all-gathers t along dim 0 (uint8 here). The same bytes as quantizing the gathered
        tensor: see _group_scale."""
        _, local_bytes, make_whole = self.cast_for_gather(x_hp, reduce_max)
        return make_whole(gather(local_bytes), columnwise)

    def cast_for_gather(self, x_hp, reduce_max):
        """quantize_gathered in parts, for a gather the caller runs (asynchronously): (this
        rank's rows as a Float8Storage (rowwise), their bytes uint8 of x_hp's shape to gather,
        make_whole(gathered bytes (P M, ..., N), columnwise) -> the whole Float8Storage)."""
        data, _, scale_inv = self._cast_agreed(_as_2d(x_hp), reduce_max, True, False)
        local = Float8Storage(data, None, scale_inv, self.fp8_dtype, tuple(x_hp.shape))

        def make_whole(gathered: torch.Tensor, columnwise: bool) -> Float8Storage:
            shape = tuple(gathered.shape)
            rows = gathered.view(self.fp8_dtype).reshape(-1, shape[-1])
            storage = Float8Storage(rows, None, scale_inv, self.fp8_dtype, shape)
            if columnwise:
                storage.update_usage(columnwise_usage=True)
            return storage

        return local, data.view(torch.uint8).view(x_hp.shape), make_whole

    def _cast_agreed(self, x2d, reduce_max, rowwise: bool, columnwise: bool):
        """(rowwise, columnwise, scale_inv) of x2d cast with the scale the ranks agree on
        (_group_scale; reduce_max all-reduces with MAX over them)."""
        scale, scale_inv = self._group_scale(x2d, reduce_max)
        spec = CastSpec(self.fp8_dtype, rowwise, columnwise, scale, torch.zeros_like(scale))
        data, data_t, own_scale_inv = ct.quantize(x2d, spec)
        return data, data_t, own_scale_inv if scale_inv is None else scale_inv

    def _group_scale(self, x2d, reduce_max) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale (1,), scale_inv (1,) or None for 1 / scale) every rank casts its rows with."""
        raise NotImplementedError

    def quantize(self, x_hp, *, rowwise=None, columnwise=None):
        """x_hp (..., N) -> Float8Storage (or Float8Tensor when not internal); a usage left
        None is the quantizer's (rowwise_usage / columnwise_usage)."""
        if rowwise is None:
            rowwise = self.rowwise_usage
        if columnwise is None:
            columnwise = self.columnwise_usage
        cast = ct.quantize(_as_2d(x_hp), self.cast_spec(rowwise, columnwise))
        return self._output(*cast, x_hp)

    def _output(self, data, data_t, scale_inv, x_hp):
        """What quantize returns for the bytes a kernel wrote from x_hp."""
        storage = Float8Storage(data, data_t, scale_inv, self.fp8_dtype, tuple(x_hp.shape))
        if self.internal:
            return storage
        from .float8_tensor import Float8Tensor

        return Float8Tensor.from_storage(storage, dtype=x_hp.dtype, quantizer=self)


class Float8Quantizer(_Float8Quantizer):
    """Delayed scaling: quantize with a scale computed earlier; record amax for later.

    scale (1,) fp32 and amax (1,) fp32 are views into a DelayedScalingState (its scale and row 0
    of its amax history), so updating the state moves them too. A quantizer made with
    `of_slot` takes those views from the state on first use (cached; under torch.compile taken
    afresh at each use, so that a traced graph never outputs a view of a tensor it mutates).

    Also Transformer Engine's constructor `Float8Quantizer(scale, amax, fp8_dtype, *,
    rowwise=True, columnwise=True)`: scale and amax one-element fp32 tensors it reads and
    writes in place (a 0-d one is taken as a (1,) view), fp8_dtype a torch FP8 dtype or a
    DType tag.
    """

    __slots__ = ("_amax", "_scale", "_slot")

    fusable = True

    def __init__(
        self,
        scale: torch.Tensor | None,
        amax: torch.Tensor | None,
        fp8_dtype,
        internal: bool = True,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> None:
        super().__init__(fp8_dtype, internal, rowwise, columnwise)
        self._scale, self._amax = _one_value(scale, "scale"), _one_value(amax, "amax")
        self._slot = None

    def copy(self) -> Float8Quantizer:
        """A quantizer of the same class and settings over the same scale and amax tensors."""
        twin = type(self)(self.scale, self.amax, self.fp8_dtype, internal=self.internal)
        return self._copy_usage_to(twin)

    def calibrate(self, x_hp: torch.Tensor) -> None:
        """Set amax to x_hp's amax (Transformer Engine's calibrate), no cast."""
        with torch.no_grad():
            self.amax.zero_()
            self.record_amax(x_hp)

    @classmethod
    def of_slot(cls, state, index: int, fp8_dtype: torch.dtype, internal: bool = True):
        """The quantizer of slot `index` of `state` (an object with `scale` (n,) and
        `amax_history` (L, n))."""
        quantizer = cls(None, None, fp8_dtype, internal)
        quantizer._slot = (state, index)
        return quantizer

    @property
    def scale(self) -> torch.Tensor:
        """(1,) fp32: the scale this quantizer multiplies by."""
        return self._scale if self._scale is not None else self._slot_views()[0]

    @property
    def amax(self) -> torch.Tensor:
        """(1,) fp32: where this quantizer max-accumulates the amax it sees."""
        return self._amax if self._amax is not None else self._slot_views()[1]

    def _slot_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        state, j = self._slot
        views = state.scale[j : j + 1], state.amax_history[0, j : j + 1]
        if not torch.compiler.is_compiling():
            self._scale, self._amax = views
        return views

    def _new_spec(self, rowwise: bool, columnwise: bool) -> CastSpec:
        return CastSpec(self.fp8_dtype, rowwise, columnwise, self.scale, self.amax)

    def _written_state(self) -> tuple[torch.Tensor, ...]:
        """quantize max-accumulates into amax."""
        return (self.amax,)

    def _data_scale_inv(self, device: torch.device) -> torch.Tensor:
        """1 / scale (a new tensor), as Transformer Engine gives it."""
        return (1.0 / self.scale.detach()).to(device)

    def record_amax(self, x_hp: torch.Tensor) -> None:
        ct.record_amax(_as_2d(x_hp), self.amax)

    def _group_scale(self, x2d, reduce_max):
        """The smallest of the ranks' scales (their MAX of -scale: exact), which is every rank's
        own when their amax histories agree (the amaxes reduced over a group holding these
        ranks, the default); the rows' amax recorded here, as quantize records it."""
        self.record_amax(x2d)
        negated = -self.scale
        reduce_max(negated)
        return -negated, None

    def prime_scale(self, x_hp: torch.Tensor, fp8_max: float, margin: int) -> None:
        """Set the scale to what x_hp's own amax asks for (fp8_max / amax / 2**margin), x_hp's
        amax then alone in this step's slot: before a weight is first quantized, instead of the
        initial 1.0 that would flush a small-valued weight into FP8 subnormals."""
        with torch.no_grad():
            self.amax.zero_()
            self.record_amax(x_hp)
            scale = ct.compute_scale_reference(self.amax, fp8_max, 0.0, False) / float(2**margin)
            self.scale.copy_(scale)


class Float8CurrentScalingQuantizer(_Float8Quantizer):
    """Current scaling: the scale comes from the amax of the tensor being quantized. With
    amax_reduction (a function all-reducing a (1,) tensor with MAX over the ranks that hold the
    pieces of one tensor, tensor parallelism), each piece is cast with the scale of the whole
    tensor's amax: every rank uses the same scale for the same tensor."""

    __slots__ = ("amax_epsilon", "amax_reduction", "amax_reduction_group", "power_2_scale")

    def __init__(
        self,
        fp8_dtype,
        device: torch.device | str | int | None = None,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        power_2_scale: bool = False,
        amax_epsilon: float = 0.0,
        internal: bool = True,
        force_pow_2_scales: bool | None = None,
        with_amax_reduction: bool = False,
        amax_reduction_group=None,
        use_existing_amax: bool = False,
        scale: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
    ) -> None:
        """fp8_dtype: a torch FP8 dtype or a DType tag. Transformer Engine's arguments:
        `device` (unused: the scale comes with each input), `force_pow_2_scales` (torchte's
        `power_2_scale`), `with_amax_reduction` + `amax_reduction_group` (the amax all-reduced
        with MAX over that group); `use_existing_amax`, `scale`, `amax` are accepted and
        unused, as in Transformer Engine."""
        super().__init__(fp8_dtype, internal, rowwise, columnwise)
        del device, use_existing_amax, scale, amax
        if force_pow_2_scales is not None:
            power_2_scale = force_pow_2_scales
        self.power_2_scale = bool(power_2_scale)
        self.amax_epsilon = float(amax_epsilon)
        self.amax_reduction = None
        self.amax_reduction_group = None
        if with_amax_reduction:
            from .float8_fsdp import max_over

            self.amax_reduction_group = amax_reduction_group
            self.amax_reduction = max_over(amax_reduction_group)

    @property
    def force_pow_2_scales(self) -> bool:
        """Transformer Engine's name of power_2_scale."""
        return self.power_2_scale

    @property
    def with_amax_reduction(self) -> bool:
        """Whether the amax is all-reduced over the ranks holding pieces of the tensor."""
        return self.amax_reduction is not None

    def copy(self) -> Float8CurrentScalingQuantizer:
        """A quantizer of the same class and settings (amax reduction included)."""
        twin = type(self)(
            self.fp8_dtype,
            power_2_scale=self.power_2_scale,
            amax_epsilon=self.amax_epsilon,
            internal=self.internal,
        )
        twin.amax_reduction, twin.amax_reduction_group = (
            self.amax_reduction,
            self.amax_reduction_group,
        )
        return self._copy_usage_to(twin)

    def _data_scale_inv(self, device: torch.device) -> torch.Tensor:
        """Current scaling keeps no scale: 1 (Transformer Engine leaves it uninitialized)."""
        return torch.ones(1, dtype=torch.float32, device=device)

    def _new_spec(self, rowwise: bool, columnwise: bool) -> CastSpec:
        eps, power_2 = self.amax_epsilon, self.power_2_scale
        return CastSpec(self.fp8_dtype, rowwise, columnwise, None, None, eps, power_2)

    def record_amax(self, x_hp: torch.Tensor) -> None:
        """Current scaling keeps no amax between calls: nothing to record."""

    def quantize(self, x_hp, *, rowwise=None, columnwise=None):
        """x_hp (..., N) -> Float8Storage (or Float8Tensor when not internal); with
        amax_reduction, scaled by the amax over the ranks (one more launch, one all-reduce).
        A usage left None is the quantizer's."""
        if self.amax_reduction is None:
            return super().quantize(x_hp, rowwise=rowwise, columnwise=columnwise)
        if rowwise is None:
            rowwise = self.rowwise_usage
        if columnwise is None:
            columnwise = self.columnwise_usage
        cast = self._cast_agreed(_as_2d(x_hp), self.amax_reduction, rowwise, columnwise)
        return self._output(*cast, x_hp)

    def _group_scale(self, x2d, reduce_max):
        """The scale of the whole tensor's amax (the MAX of the ranks' amaxes), and its
        scale_inv, as quantize computes them from the gathered tensor."""
        amax = torch.zeros(1, dtype=torch.float32, device=x2d.device)
        ct.record_amax(x2d, amax)
        reduce_max(amax)
        fp8_max = ct.FP8_MAX[self.fp8_dtype]
        scale = ct.compute_scale_reference(amax, fp8_max, self.amax_epsilon, self.power_2_scale)
        return scale, ct.current_scale_inv_reference(amax, scale)

    def prime_scale(self, x_hp: torch.Tensor, fp8_max: float, margin: int) -> None:
        """Current scaling has no stored scale: nothing to prime."""
