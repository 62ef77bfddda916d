"""Device defaults and capability checks, each computed once per device."""

from __future__ import annotations

import os

import torch

__all__ = [
    "block_gemm_native",
    "default_device",
    "fp8_support",
    "get_device_compute_capability",
    "graph_capturing",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
]


def default_device(device: torch.device | str | int | None) -> torch.device:
    """The device a module is built on: the one given; else torch's default device if the user
    set one; else CUDA where there is a GPU and the CPU where there is none."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if _user_set_default_device():
        return default_device(torch.get_default_device())
    return default_device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _user_set_default_device() -> bool:
    """Whether torch.set_default_device or a `with torch.device(...)` block is in force."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None) is not None:
        return True
    return any(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


def fp8_support(device: torch.device) -> tuple[bool, str]:
    """(supported, reason) for FP8 on `device`: native on compute capability >= 8.9, emulated
    with the same bytes on the CPU, unavailable on older GPUs. Computed once per device (a
    plain dict, which torch.compile traces without warning, unlike functools.cache)."""
    answer = _FP8_SUPPORT.get(device)
    if answer is None:
        answer = _FP8_SUPPORT[device] = _fp8_support(device)
    return answer


_FP8_SUPPORT: dict[torch.device, tuple[bool, str]] = {}


def _fp8_support(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return True, "FP8 is emulated on the CPU (same bytes as on a GPU, computed in fp32)"
    if device.type != "cuda":
        return False, f"FP8 is not supported on device type {device.type!r}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, (
            f"FP8 needs a GPU of compute capability 8.9 or higher; {device} has {major}.{minor}"
        )
    return True, ""


def _answer(available: bool, reason: str, return_reason: bool) -> bool | tuple[bool, str]:
    """Transformer Engine's convention: a bool, or (bool, reason) with return_reason."""
    return (available, reason) if return_reason else available


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether FP8 (delayed and current scaling) runs on the device modules are built on by
    default: natively on compute capability >= 8.9, emulated on the CPU; with return_reason,
    (available, why)."""
    return _answer(*fp8_support(default_device(None)), return_reason)


# The block-scaled recipes, by the name their availability functions use: (the compute
# capability range whose tensor cores run their GEMMs natively, what the GEMM is).
_BLOCK_NATIVE = {
    "Float8BlockScaling": ((9, 0), (10, 0), "cuBLAS 1x128/128x128 block-scaled FP8 (Hopper)"),
    "MXFP8BlockScaling": ((10, 0), None, "MX-scaled FP8 (E8M0 scales per 32 values)"),
    "NVFP4BlockScaling": ((10, 0), None, "NVFP4 (E4M3 scales per 16 values, a per-tensor scale)"),
}
# What torch needs for the MX formats' native GEMMs: its scaling type, the scale and data
# dtypes (quantization/mx_operand.py views the stored bytes as these).
_MX_TORCH = {
    "MXFP8BlockScaling": ("BlockWise1x32", ("float8_e8m0fnu",)),
    "NVFP4BlockScaling": ("BlockWise1x16", ("float4_e2m1fn_x2", "float8_e4m3fn")),
}
# Set to 1 to emulate MXFP8 / NVFP4 GEMMs on compute capability 10+ as well (the native path
# is untested on such hardware here); read once per (recipe, device).
_MX_EMULATE_ENV = "TORCHTE_MX_EMULATE"
_UNTESTED = (
    "untested: torchte's tests have not run on a GPU of compute capability 10 or higher "
    f"(set {_MX_EMULATE_ENV}=1 to emulate instead)"
)


def block_gemm_native(recipe: str, device: torch.device) -> tuple[bool, str]:
    """(native, how) for the GEMMs of block-scaled `recipe` ("Float8BlockScaling",
    "MXFP8BlockScaling", "NVFP4BlockScaling") on `device`: native where torch runs them on
    this GPU's tensor cores (Float8BlockScaling on compute capability 9.x; MXFP8 and NVFP4 on
    10+ through torch.nn.functional.scaled_mm, a path UNTESTED on such hardware here, unless
    TORCHTE_MX_EMULATE=1), else emulated: the operands dequantized exactly and multiplied in
    bf16/fp32 (the format's numerics, not its speed). Computed once per (recipe, device)."""
    key = (recipe, device)
    answer = _BLOCK_GEMM.get(key)
    if answer is None:
        answer = _BLOCK_GEMM[key] = _block_gemm_native(recipe, device)
    return answer


_BLOCK_GEMM: dict[tuple[str, torch.device], tuple[bool, str]] = {}
_EMULATED = (
    "emulated (dequantized operands, bf16 GEMM, fp32 accumulation): the format's numerics, not "
    "its speed"
)


def _block_gemm_native(recipe: str, device: torch.device) -> tuple[bool, str]:
    low, high, what = _BLOCK_NATIVE[recipe]
    if device.type == "cpu":
        return False, f"{recipe} is emulated on the CPU (same bytes, GEMMs in fp32)"
    supported, reason = fp8_support(device)
    if not supported:
        return False, reason
    capability = torch.cuda.get_device_capability(device)
    major, minor = capability
    if not (low <= capability and (high is None or capability < high)):
        if recipe == "Float8BlockScaling":
            return False, (
                f"{recipe}: native {what} GEMMs are not implemented for compute capability "
                f"{major}.{minor} in torchte; {_EMULATED}"
            )
        return False, (
            f"{recipe}: native {what} GEMMs need compute capability {low[0]}.{low[1]} or "
            f"higher; {device} has {major}.{minor}: {_EMULATED}"
        )
    missing = _torch_lacks(recipe)
    if missing:
        return False, f"this torch has no {missing}; {recipe} is {_EMULATED}"
    if recipe == "Float8BlockScaling":
        return True, f"{what} through torch.nn.functional.scaled_mm"
    if os.environ.get(_MX_EMULATE_ENV, "0") not in ("", "0"):
        return False, f"{recipe}: {_MX_EMULATE_ENV} is set; {_EMULATED}"
    scaling = _MX_TORCH[recipe][0]
    return True, (
        f"{what} through torch.nn.functional.scaled_mm ({scaling}, SWIZZLE_32_4_4 scales); "
        + _UNTESTED
    )


def _torch_lacks(recipe: str) -> str:
    """What this torch lacks for recipe's native GEMMs ("" when nothing)."""
    import torch.nn.functional as F

    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return "torch.nn.functional.scaled_mm"
    if recipe not in _MX_TORCH:
        return ""
    scaling, dtypes = _MX_TORCH[recipe]
    if not hasattr(F.ScalingType, scaling):
        return f"torch.nn.functional.ScalingType.{scaling}"
    if not hasattr(getattr(F, "SwizzleType", None), "SWIZZLE_32_4_4"):
        return "torch.nn.functional.SwizzleType.SWIZZLE_32_4_4"
    lacking = [f"torch.{name}" for name in dtypes if not hasattr(torch, name)]
    return ", ".join(lacking)


def _block_available(recipe: str, return_reason: bool) -> bool | tuple[bool, str]:
    device = default_device(None)
    supported, reason = fp8_support(device)
    if not supported:
        return _answer(False, reason, return_reason)
    native, how = block_gemm_native(recipe, device)
    return _answer(True, ("native: " if native else "emulated: ") + how, return_reason)


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether MXFP8BlockScaling runs on the default device (natively on compute capability
    10+, untested here; emulated on Hopper and the CPU: exact MXFP8 numerics); with
    return_reason, (available, "native: ..." | "emulated: ...")."""
    return _block_available("MXFP8BlockScaling", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether Float8BlockScaling runs on the default device (natively on Hopper, emulated on
    the CPU and other FP8 GPUs); with return_reason, (available, "native: ..." |
    "emulated: ...")."""
    return _block_available("Float8BlockScaling", return_reason)


def is_nvfp4_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether NVFP4BlockScaling runs on the default device (natively on compute capability
    10+, untested here; emulated on Hopper and the CPU: exact NVFP4 numerics); with
    return_reason, (available, "native: ..." | "emulated: ...")."""
    return _block_available("NVFP4BlockScaling", return_reason)


def is_bf16_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether bf16 runs on the default device: the CPU, or a GPU of compute capability >= 8.0
    (with return_reason, why not)."""
    device = default_device(None)
    if device.type != "cuda":
        return _answer(True, "", return_reason)
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        reason = (
            f"bf16 needs a GPU of compute capability 8.0 or higher; {device} has {major}.{minor}"
        )
        return _answer(False, reason, return_reason)
    return _answer(True, "", return_reason)


def get_device_compute_capability() -> tuple[int, int]:
    """(major, minor) of the current CUDA device; (0, 0) on a machine without one (the CPU,
    where torchte emulates FP8)."""
    if not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability()


def graph_capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream (tensor on a GPU)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()
