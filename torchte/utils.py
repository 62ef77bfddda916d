"""Transformer Engine's helpers of `transformer_engine.pytorch.utils` that clients import:

- weight initializers: functions that make an `init_method` for a module's `init_method` /
  `output_layer_init_method`;
- integer helpers: `round_up_to_nearest_multiple`, `ceil_div`;
- NVTX ranges named by a message, with a stack that checks pushes and pops match
  (`nvtx_range_push`, `nvtx_range_pop`): on when TORCHTE_NVTX=1 or Transformer Engine's
  NVTE_NVTX_ENABLED=1 (read once), no-ops otherwise;
- `is_non_tn_fp8_gemm_supported`: whether the current GPU's FP8 GEMMs take operands in any
  layout (Blackwell and later) rather than only "TN" (Hopper);
- `make_weak_ref`: CUDA tensors (alone or in tuples, lists, dicts) seen through tensors that
  alias their memory without keeping it allocated (CUDA-graph buffers whose memory the graph
  pool keeps).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch

from . import _nvtx

__all__ = [
    "ceil_div",
    "init_method_normal",
    "is_non_tn_fp8_gemm_supported",
    "make_weak_ref",
    "nvtx_range_pop",
    "nvtx_range_push",
    "round_up_to_nearest_multiple",
    "scaled_init_method_normal",
]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init_method filling a tensor in place from N(0, sigma**2)."""
    _check_sigma(sigma)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(
    sigma: float, num_layers: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init_method filling a tensor in place from N(0, (sigma / sqrt(2 num_layers))**2): the
    output layers of a residual stack of num_layers blocks."""
    _check_sigma(sigma)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def _check_sigma(sigma: float) -> None:
    if isinstance(sigma, bool) or not isinstance(sigma, int | float):
        raise ValueError(f"sigma must be a number >= 0, got {sigma!r}")
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be a number >= 0, got {sigma!r}")


# -- integers -------------------------------------------------------------------------------------


def ceil_div(numerator: int, denominator: int) -> int:
    """ceil(numerator / denominator) for integers; ValueError when denominator is 0."""
    if denominator == 0:
        raise ValueError("ceil_div: denominator cannot be zero")
    return (numerator + denominator - 1) // denominator


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value (integers); ValueError when
    multiple is 0."""
    if multiple == 0:
        raise ValueError("round_up_to_nearest_multiple: multiple cannot be zero")
    return ceil_div(value, multiple) * multiple


# -- devices --------------------------------------------------------------------------------------


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether the current CUDA device's FP8 GEMMs take non-TN operand layouts: compute
    capability 10.x and 11.x, and 13.0 on (not 12.x, the consumer Blackwell parts, nor
    Hopper); False without a GPU. Answered once per device."""
    if not torch.cuda.is_available():
        return False
    return _non_tn_fp8_gemm(torch.cuda.current_device())


@functools.cache
def _non_tn_fp8_gemm(device: int) -> bool:
    capability = tuple(torch.cuda.get_device_capability(device))
    return (10, 0) <= capability < (12, 0) or capability >= (13, 0)


# -- NVTX -----------------------------------------------------------------------------------------

# The messages of the ranges open now, innermost last.
_NVTX_MESSAGES: list[str] = []


@functools.cache
def _nvtx_enabled() -> bool:
    return _nvtx.ENABLED or os.environ.get("NVTE_NVTX_ENABLED", "0") == "1"


def nvtx_range_push(msg: str) -> None:
    """Open an NVTX range named `msg` (when enabled: see the module docstring)."""
    if not _nvtx_enabled():
        return
    _NVTX_MESSAGES.append(msg)
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(msg)


def nvtx_range_pop(msg: str | None = None) -> None:
    """Close the innermost range opened by nvtx_range_push (when enabled). RuntimeError when
    none is open; ValueError when `msg` is given and is not the innermost range's."""
    if not _nvtx_enabled():
        return
    if not _NVTX_MESSAGES:
        raise RuntimeError("nvtx_range_pop: no NVTX range is open")
    if msg is not None and msg != _NVTX_MESSAGES[-1]:
        raise ValueError(
            f"nvtx_range_pop: msg={msg!r} is not the innermost open range ({_NVTX_MESSAGES[-1]!r})"
        )
    _NVTX_MESSAGES.pop()
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_pop()


# -- weak references ------------------------------------------------------------------------------


class _DeviceMemory:
    """A span of CUDA memory by address, as `__cuda_array_interface__` (bytes): what
    torch.as_tensor wraps without taking ownership. Holds no reference to any tensor."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def _weak_tensor(x: torch.Tensor) -> torch.Tensor:
    """A tensor of x's shape, strides and dtype over x's memory that does not keep it
    allocated (x itself when not on CUDA)."""
    if not x.is_cuda:
        return x
    if x.numel() == 0:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    span = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride(), strict=True))
    nbytes = span * x.element_size()
    raw = torch.as_tensor(_DeviceMemory(x.data_ptr(), nbytes), device=x.device)
    flat = raw.view(x.dtype)
    weak = flat.as_strided(x.shape, x.stride())
    if weak.data_ptr() != x.data_ptr():
        raise RuntimeError("make_weak_ref: the weak tensor does not start at the tensor's address")
    return weak


def make_weak_ref(x):
    """x with every CUDA tensor in it replaced by a tensor over the same memory (same shape,
    strides, dtype, address) that does not keep that memory allocated: once the original
    tensors are gone the caching allocator may reuse it, so the weak tensors are valid only as
    long as something else (a CUDA graph's memory pool) keeps it. Tensors not on CUDA come back
    as they are; tuples, lists and dicts are rebuilt around their converted items; ints, floats,
    bools and None pass through; anything else raises TypeError."""
    if isinstance(x, torch.Tensor):
        return _weak_tensor(x)
    if isinstance(x, tuple):
        return tuple(make_weak_ref(item) for item in x)
    if isinstance(x, list):
        return [make_weak_ref(item) for item in x]
    if isinstance(x, dict):
        return {key: make_weak_ref(value) for key, value in x.items()}
    if x is None or isinstance(x, int | float | bool):
        return x
    raise TypeError(
        f"make_weak_ref: cannot make a weak reference to a {type(x).__name__}; it takes "
        "tensors, tuples, lists, dicts, ints, floats, bools and None"
    )
