"""Transformer Engine 2.x's quantizer methods that every torchte quantizer family answers the
same way, over its own `quantize`: `q(x)`, `make_empty` (a quantized value of a nominal shape, its
contents unspecified) and `update_quantized` (quantize into an existing value, in place,
optionally skipped by a device-side `noop_flag`), and the default `is_quantizable`.

None of it is on a module's hot path: clients call these to set up buffers and to refresh FP8
parameters. In-place updates keep the address of every data tensor (CUDA graphs, cached
weights): the new bytes are copied into the destination's tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["TEQuantizerMethods"]

_NOMINAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as a uint8 view (copying bytes, not converting values); others as is."""
    return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t


def _storage_of(value):
    return getattr(value, "_storage", value)


class TEQuantizerMethods:
    """Mixin of the quantizers: make_empty, update_quantized, is_quantizable (see the module
    docstring). A quantizer whose quantize writes state of its own (delayed scaling's amax)
    names those tensors in `_written_state`, so that a skipped update leaves them as they were."""

    __slots__ = ()

    def _written_state(self) -> tuple[torch.Tensor, ...]:
        """The tensors quantize writes besides its output (none by default)."""
        return ()

    def __call__(self, x_hp: torch.Tensor):
        """quantize(x_hp) with this quantizer's usages (Transformer Engine's call form)."""
        return self.quantize(x_hp)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether `inp`'s shape can be quantized by this quantizer (any shape by default)."""
        return True

    def make_empty(
        self,
        shape: Iterable[int] | int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ):
        """A quantized value of `shape` and nominal `dtype` on `device` (default: where a
        module would go) with this quantizer's usages, as quantize makes it (a Tensor, or a
        Storage when `internal`); its values are unspecified (zeros here), and the
        quantizer's own state (delayed scaling's amax) is left as it was."""
        from torchte._device import default_device

        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if dtype not in _NOMINAL_DTYPES:
            raise ValueError(f"make_empty: dtype must be one of {_NOMINAL_DTYPES}, got {dtype}")
        if pin_memory:
            raise NotImplementedError(
                "make_empty(pin_memory=True): torchte allocates quantized values with torch's "
                "default allocator only; pin the data tensors after making the value"
            )
        placeholder = torch.zeros(shape, dtype=dtype, device=default_device(device))
        saved = [t.clone() for t in self._written_state()]
        with torch.no_grad():
            value = self.quantize(placeholder)
            for before, now in zip(saved, self._written_state(), strict=True):
                now.copy_(before)
        if requires_grad and isinstance(value, torch.Tensor):
            value.requires_grad_(True)
        return value

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: torch.Tensor | None = None):
        """Quantize `src` (dst's shape, or broadcastable to it) with this quantizer into `dst`
        (a quantized Tensor or Storage of this quantizer's format and layout) in place,
        keeping the address of each of its data tensors and making the copies (rowwise /
        columnwise) dst holds. `noop_flag`: a one-element tensor; where it holds 1 nothing
        changes (decided on the device, without waiting for it). Returns dst."""
        storage = _storage_of(dst)
        src = self._source_for(src, storage)
        skip = None if noop_flag is None else _skip_flag(noop_flag, storage.device)
        saved = [t.clone() for t in self._written_state()] if skip is not None else []
        with torch.no_grad():
            fresh = _storage_of(
                self.quantize(
                    src,
                    rowwise=getattr(storage, "rowwise_data", None) is not None,
                    columnwise=getattr(storage, "columnwise_data", None) is not None,
                )
            )
            self._check_destination(storage, fresh, skip)
            if storage.fp8_dtype != fresh.fp8_dtype:
                _retype(storage, fresh.fp8_dtype)
            _copy_data(storage, fresh, skip)
            if skip is not None:
                for before, now in zip(saved, self._written_state(), strict=True):
                    now.copy_(torch.where(skip, before, now))
        if isinstance(dst, torch.Tensor):
            torch.autograd.graph.increment_version(dst)
        return dst

    def _source_for(self, src: torch.Tensor, storage) -> torch.Tensor:
        """src as a plain tensor on dst's device, of dst's shape (ValueError naming both)."""
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"update_quantized: src must be a torch.Tensor, got {type(src)}")
        if hasattr(src, "dequantize") and hasattr(src, "_storage"):
            src = src.dequantize()
        src = src.detach().to(device=storage.device)
        shape = tuple(storage.shape)
        if tuple(src.shape) != shape:
            try:
                src = src.expand(shape)
            except RuntimeError:
                raise ValueError(
                    f"update_quantized: src of shape {tuple(src.shape)} does not fit dst of "
                    f"shape {shape}"
                ) from None
        return src.contiguous()

    def _check_destination(self, storage, fresh, skip) -> None:
        """ValueError unless `storage` holds what this quantizer makes (`fresh`): the same
        Storage class, and data and scales of the same shapes."""
        name = type(self).__name__
        if type(storage) is not type(fresh):
            raise ValueError(
                f"{name}.update_quantized: dst holds a {type(storage).__name__}, but this "
                f"quantizer makes {type(fresh).__name__} values"
            )
        if storage.fp8_dtype != fresh.fp8_dtype and (
            skip is not None or not hasattr(storage, "scale_inv")
        ):
            raise ValueError(
                f"{name}.update_quantized: dst holds {storage.fp8_dtype}, this quantizer makes "
                f"{fresh.fp8_dtype} (a per-tensor FP8 dst takes the quantizer's dtype, but "
                "not under noop_flag)"
            )
        pairs = zip(storage.get_data_tensors(), fresh.get_data_tensors(), strict=True)
        for mine, new in pairs:
            if mine is not None and (new is None or mine.shape != new.shape):
                raise ValueError(
                    f"{name}.update_quantized: dst's layout differs from what this quantizer "
                    f"makes (a tensor of shape {tuple(mine.shape)} against "
                    f"{None if new is None else tuple(new.shape)}): quantize with the "
                    "quantizer dst was made with"
                )


def _skip_flag(noop_flag: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1:
        raise ValueError("update_quantized: noop_flag must be a one-element tensor (or None)")
    return noop_flag.to(device=device).reshape(()) == 1


def _retype(storage, fp8_dtype: torch.dtype) -> None:
    """A per-tensor FP8 storage takes another FP8 dtype: its data tensors are reinterpreted
    (the bytes are overwritten next)."""
    for name in ("rowwise_data", "columnwise_data"):
        data = getattr(storage, name)
        if data is not None:
            setattr(storage, name, data.view(fp8_dtype))
    storage.fp8_dtype = fp8_dtype


def _copy_data(storage, fresh, skip: torch.Tensor | None) -> None:
    """Copy fresh's data tensors into storage's, byte for byte (where `skip` is False)."""
    pairs = zip(storage.get_data_tensors(), fresh.get_data_tensors(), strict=True)
    for mine, new in pairs:
        if mine is None:
            continue
        mine_b, new_b = _as_bytes(mine), _as_bytes(new)
        mine_b.copy_(new_b if skip is None else torch.where(skip, mine_b, new_b))
