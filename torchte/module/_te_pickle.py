"""Transformer Engine's pickled `_extra_state`, read and written without Transformer Engine.

Transformer Engine 2.x keeps a module's FP8 state in the state_dict as a uint8 tensor of
`pickle.dumps` bytes (its 1.x releases also wrote an io.BytesIO of `torch.save`). The payload
names Transformer Engine's recipe classes by their module path, `transformer_engine.common.recipe`.

Reading never runs plain pickle on checkpoint bytes: `te_unpickle` / `te_torch_load` resolve
only the globals that format uses, and refuse any other with ExtraStateError naming it:

- the recipe classes (DelayedScaling, Float8CurrentScaling, ..., and their QParams / MMParams
  values) become `TERecord`s: the class name and the fields, nothing run;
- `Format` members become torchte's `recipe.Format` (E2M1, which torchte has not, its name);
- tensors are rebuilt by torch's own function, their storages read by
  torch.load(weights_only=True), on the CPU; OrderedDict and _codecs.encode (bytes under
  pickle protocol 2) are the only other globals.
- Megatron-Core's two spellings, as a Megatron process writes them: the storages of tensors
  through `megatron.core.safe_globals.safe_load_from_bytes` (Megatron puts it in place of
  torch's `_load_from_bytes`; read here as torch's is, weights_only) and the recipe as
  `megatron.core.extensions.transformer_engine.TEDelayedScaling` (its DelayedScaling, read as
  a DelayedScaling record). Megatron is never imported.

`te_pickle` writes the same form: a `TERecord` and a torchte `Format` are written as the
Transformer Engine objects they stand for (the class referenced by its Transformer Engine path,
then its fields), as Transformer Engine's own pickle.dumps writes them. A tensor is written as
pickle writes one (torch's `_rebuild_tensor_v2` of `torch.storage._load_from_bytes`), with one
difference: its storage's bytes are torch.save's zip format, not the legacy format that
pickle.dumps uses, which names a storage by its memory address. So the same values always give
the same bytes, and the length of the bytes depends only on the tensors' shapes and dtypes
(torch.distributed.checkpoint loads into tensors of the saved size). Both formats read the same.
"""

from __future__ import annotations

import codecs
import collections
import copyreg
import io
import pickle
import types
from typing import Any

import torch

from torchte.recipe import Format, _FormatHelper

from ._lifecycle import ExtraStateError

__all__ = ["TE_RECIPE_MODULE", "TERecord", "te_pickle", "te_record", "te_torch_load", "te_unpickle"]

TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# Transformer Engine's recipe classes and the frozen records some of them hold as fields.
_TE_RECORD_NAMES = (
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
    "MXFP4QATMXFP8BlockScaling",
    "MXFP4QATFloat8BlockScaling",
    "QParams",
    "MMParams",
)


class TERecord:
    """An object of Transformer Engine's class `te_class` (of transformer_engine.common.recipe),
    held as its fields. Unpickling makes one without running anything; pickling writes it back as
    that class's object (Transformer Engine's dataclasses pickle as class + field dict)."""

    __slots__ = ("fields",)
    te_class = ""  # set on each subclass, one per Transformer Engine class

    def __init__(self, fields: dict[str, Any] | None = None) -> None:
        self.fields = dict(fields or {})

    def __setstate__(self, state) -> None:
        # A dataclass pickles its __dict__; a slotted one (dict or None, slots) as a pair.
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{self.te_class}'s state is not a field dict")
        self.fields = dict(state)

    def __reduce_ex__(self, protocol):
        return (copyreg.__newobj__, (type(self),), dict(self.fields))

    def delayed(self) -> bool:
        """Whether the record is a DelayedScaling recipe (Transformer Engine's recipe.delayed())."""
        return self.te_class == "DelayedScaling"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.fields == self.fields

    __hash__ = None

    def __repr__(self) -> str:
        return f"TERecord({self.te_class}, {self.fields!r})"


def _record_class(name: str) -> type[TERecord]:
    """The TERecord subclass standing for Transformer Engine's recipe class `name`."""
    attrs = {"__slots__": (), "te_class": name, "__module__": TE_RECIPE_MODULE}
    return type(name, (TERecord,), attrs | {"__qualname__": name})


_RECORDS: dict[str, type[TERecord]] = {name: _record_class(name) for name in _TE_RECORD_NAMES}


def te_record(te_class: str, fields: dict[str, Any]) -> TERecord:
    """A record of Transformer Engine's recipe class `te_class` with `fields` (for te_pickle)."""
    return _RECORDS[te_class](fields)


class _TEFormatHelper:
    """Writes Transformer Engine's Format value, recipe._FormatHelper(max_fwd, max_bwd)."""

    __slots__ = ("values",)

    def __init__(self, max_fwd, max_bwd) -> None:
        self.values = (max_fwd, max_bwd)

    def __reduce_ex__(self, protocol):
        return (copyreg.__newobj__, (type(self), *self.values))


class _TEFormat:
    """Writes Transformer Engine's Format enum (a member pickles as Format(value))."""


class _RebuildTensor:
    """Written as torch._utils._rebuild_tensor_v2 (never called here)."""


class _LoadFromBytes:
    """Written as torch.storage._load_from_bytes (never called here)."""


class _StorageBytes:
    """A tensor's storage, written as _load_from_bytes(torch.save bytes, zip format)."""

    __slots__ = ("data",)

    def __init__(self, tensor: torch.Tensor) -> None:
        storage = torch.TypedStorage(
            wrap_storage=tensor.untyped_storage(), dtype=tensor.dtype, _internal=True
        )
        buffer = io.BytesIO()
        torch.save(storage, buffer)
        self.data = buffer.getvalue()

    def __reduce_ex__(self, protocol):
        return (_LoadFromBytes, (self.data,))


def _reduce_tensor(tensor: torch.Tensor):
    """A tensor as pickle writes one (a CPU copy of its values, no autograd flag or hooks)."""
    dense = tensor.detach().to("cpu", copy=True).contiguous()
    args = (_StorageBytes(dense), 0, tuple(dense.shape), dense.stride(), False)
    return (_RebuildTensor, (*args, collections.OrderedDict()))


# The stand-ins te_pickle writes as references to Transformer Engine's classes and torch's
# tensor functions.
_TE_PATHS: dict[type, tuple[str, str]] = {
    cls: (TE_RECIPE_MODULE, name) for name, cls in _RECORDS.items()
} | {
    _TEFormatHelper: (TE_RECIPE_MODULE, "_FormatHelper"),
    _TEFormat: (TE_RECIPE_MODULE, "Format"),
    _RebuildTensor: ("torch._utils", "_rebuild_tensor_v2"),
    _LoadFromBytes: ("torch.storage", "_load_from_bytes"),
}


def _as_te_number(value: float) -> int | float:
    """Transformer Engine's Format values are ints (448, 57344)."""
    return int(value) if float(value).is_integer() else value


class _TEPickler(pickle._Pickler):
    """pickle.dumps that writes the stand-ins above as Transformer Engine's classes. The
    Python pickler, because only it lets save_global reference a module not installed here."""

    def save_global(self, obj, name=None) -> None:
        path = _TE_PATHS.get(obj) if isinstance(obj, type) else None
        if path is None:
            super().save_global(obj, name)
            return
        if self.proto < 4:
            raise pickle.PicklingError("Transformer Engine's format is written with protocol 4+")
        self.save(path[0])
        self.save(path[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def reducer_override(self, obj):
        if isinstance(obj, Format):
            fwd, bwd = (_as_te_number(v) for v in obj.value)
            return (_TEFormat, (_TEFormatHelper(fwd, bwd),))
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            return _reduce_tensor(obj)
        return NotImplemented


def te_pickle(obj: Any) -> bytes:
    """pickle.dumps(obj) with TERecords and torchte Formats written as Transformer Engine's, and
    tensors with their storages in torch.save's zip format (see the module doc)."""
    buffer = io.BytesIO()
    _TEPickler(buffer, protocol=max(4, pickle.DEFAULT_PROTOCOL)).dump(obj)
    return buffer.getvalue()


# -- reading ----------------------------------------------------------------------------------


def _format_of(value) -> Format | str:
    """Transformer Engine's Format(value): torchte's member with the same (max_fwd, max_bwd);
    Transformer Engine's FP4 format E2M1, which torchte has not, as its name."""
    for member in Format:
        if tuple(member.value) == tuple(value):
            return member
    if tuple(value) == (6, 6):
        return "E2M1"
    raise pickle.UnpicklingError(f"no Transformer Engine Format has the value {value!r}")


def _storage_from_bytes(data: bytes):
    """A tensor storage from the torch.save bytes a pickled tensor carries (torch's own
    _load_from_bytes runs an unrestricted torch.load; this one weights_only, on the CPU)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, meta=None):
    """torch._utils._rebuild_tensor_v2 for a plain tensor of `storage` (the saved values): no
    autograd flag, hooks or metadata are taken from the payload."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"a tensor's storage is a {type(storage).__name__}")
    return torch._utils._rebuild_tensor_v2(
        storage, offset, size, stride, False, collections.OrderedDict()
    )


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("megatron.core.safe_globals", "safe_load_from_bytes"): _storage_from_bytes,
    ("megatron.core.extensions.transformer_engine", "TEDelayedScaling"): _RECORDS["DelayedScaling"],
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): codecs.encode,  # bytes under pickle protocol 2 (torch.save's)
    (TE_RECIPE_MODULE, "Format"): _format_of,
    (TE_RECIPE_MODULE, "_FormatHelper"): _FormatHelper,
} | {(TE_RECIPE_MODULE, name): cls for name, cls in _RECORDS.items()}


class _TEUnpickler(pickle.Unpickler):
    """Resolves only the globals of _ALLOWED; any other is refused."""

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"it references {module}.{name}, which is not part of Transformer Engine's "
                "extra state format (torchte loads only its recipe classes and tensors)"
            )
        return found


def _unpickle_error(what: str, err: Exception) -> ExtraStateError:
    return ExtraStateError(f"this {what} does not read as Transformer Engine's format: {err}")


def te_unpickle(data: bytes) -> Any:
    """The object Transformer Engine pickled into `data`, read with the restricted unpickler."""
    try:
        return _TEUnpickler(io.BytesIO(data)).load()
    except ExtraStateError:
        raise
    except Exception as err:  # any malformed payload: bad opcodes, refused globals, bad tensors
        raise _unpickle_error(f"extra state ({len(data)} bytes)", err) from None


# torch.load's pickle_module: its Unpickler and load, restricted as te_unpickle is.
_RESTRICTED_PICKLE = types.ModuleType("torchte_te_restricted_pickle")
_RESTRICTED_PICKLE.Unpickler = _TEUnpickler
_RESTRICTED_PICKLE.load = lambda file, **kwargs: _TEUnpickler(file, **kwargs).load()


def te_torch_load(buffer: io.BytesIO) -> Any:
    """The object in the torch.save bytes of `buffer` (Transformer Engine 1.x's io.BytesIO
    extra state), read on the CPU with the restricted unpickler."""
    buffer.seek(0)
    try:  # not weights_only: every global goes through _TEUnpickler.find_class instead
        return torch.load(
            buffer, map_location="cpu", pickle_module=_RESTRICTED_PICKLE, weights_only=False
        )
    except ExtraStateError:
        raise
    except Exception as err:
        raise _unpickle_error("io.BytesIO extra state", err) from None
