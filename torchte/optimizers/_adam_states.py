"""FusedAdam's optimizer states: the argument checks, making a state in its dtype, storing an
fp32 value into a scaled low-precision state and reading it back.

A state is kept in fp32, bf16 (rounded), fp16 or FP8 e4m3 (torch.uint8 names it, as in
Transformer Engine; a Float8Tensor holds it). fp16 and FP8 states are scaled: with scale =
max |x| / range (range: half the fp16 maximum, or 448), the state holds x / scale (FP8: the
Float8Tensor's quantizer casts with 1 / scale), and x = state * scale.
"""

from __future__ import annotations

import torch

from torchte.quantization.base import QuantizedTensor
from torchte.quantization.float8 import Float8Quantizer
from torchte.quantization.float8_tensor import Float8Tensor

from ._lists import DTensor

__all__ = [
    "STATE_DTYPES",
    "STATE_NAMES",
    "STATE_RANGES",
    "check_args",
    "like_param",
    "new_state",
    "read_unscaled",
    "store_scaled_",
]

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
# What a scaled state's max |x| maps to: half the fp16 range, the e4m3 maximum.
STATE_RANGES = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}


def check_args(lr, betas, eps, weight_decay, amsgrad, dtypes, capturable, master) -> None:
    """FusedAdam's arguments: Transformer Engine's checks (RuntimeError) and the value checks
    torch.optim makes (ValueError). dtypes: (master_weight, exp_avg, exp_avg_sq) dtypes."""
    if amsgrad:
        raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True).")
    if not float(lr) >= 0.0:
        raise ValueError(f"FusedAdam: lr must be >= 0, got {lr}")
    if not float(eps) >= 0.0:
        raise ValueError(f"FusedAdam: eps must be >= 0, got {eps}")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"FusedAdam: weight_decay must be >= 0, got {weight_decay}")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"FusedAdam: betas must be two values in [0, 1), got {betas}")
    master_dtype, exp_avg_dtype, exp_avg_sq_dtype = dtypes
    if master and master_dtype not in (torch.float32, torch.float16):
        raise RuntimeError(
            f"FusedAdam only supports fp32/fp16 master weights, got master_weight_dtype="
            f"{master_dtype}."
        )
    for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dtype not in STATE_DTYPES:
            raise RuntimeError(
                f"FusedAdam only supports fp32/fp16/bf16/fp8 (torch.uint8) {name}, got {dtype}."
            )
    if capturable and master and master_dtype != torch.float32:
        raise RuntimeError("FusedAdam: capturable mode only supports fp32 master weights.")
    both_fp32 = exp_avg_dtype == exp_avg_sq_dtype == torch.float32
    if capturable and not (both_fp32 or exp_avg_dtype == exp_avg_sq_dtype == torch.bfloat16):
        raise RuntimeError(
            "FusedAdam: capturable mode requires exp_avg_dtype and exp_avg_sq_dtype to be both "
            f"torch.float32 or both torch.bfloat16, got {exp_avg_dtype} and {exp_avg_sq_dtype}."
        )


def new_state(local_param: torch.Tensor, dtype: torch.dtype, remainders: bool) -> torch.Tensor:
    """A zero state for `local_param` (a plain or quantized tensor): int16 remainders, an FP8
    e4m3 Float8Tensor (dtype torch.uint8; rowwise bytes only, shape (1,) for a 0-dim param)
    with its own delayed-scaling quantizer, or a tensor of `dtype` with the param's layout."""
    device = local_param.device
    if isinstance(local_param, QuantizedTensor):
        template = torch.empty(local_param.shape, dtype=torch.float32, device=device)
    else:
        template = local_param.detach()
    if remainders:
        return torch.zeros_like(template, dtype=torch.int16)
    if dtype != torch.uint8:
        return torch.zeros_like(template, dtype=dtype)
    quantizer = Float8Quantizer(
        torch.ones(1, dtype=torch.float32, device=device),
        torch.zeros(1, dtype=torch.float32, device=device),
        torch.float8_e4m3fn,
        internal=False,
    )
    shape = template.shape if template.dim() > 0 else (1,)
    zeros = torch.zeros(shape, dtype=torch.float32, device=device)
    return quantizer.quantize(zeros, rowwise=True, columnwise=False)


def like_param(data: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """data as a DTensor laid out as `param` when param is one (checkpointing); else data."""
    if not isinstance(param, DTensor):
        return data
    return DTensor.from_local(
        data,
        device_mesh=param.device_mesh,
        placements=param.placements,
        shape=param.size(),
        stride=param.stride(),
    )


def store_scaled_(
    stored: torch.Tensor, unscaled: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor
) -> None:
    """Store fp32 `unscaled` (any shape of stored's element count) into the state `stored` of
    `dtype` (bf16: rounded; fp16 / uint8: scaled, the factor written to `scale` (1,) fp32).
    `unscaled` is not modified."""
    if unscaled.dtype != torch.float32:
        raise TypeError(f"FusedAdam: an unscaled state must be fp32, got {unscaled.dtype}")
    unscaled = unscaled.to(stored.device).reshape(stored.shape)
    if not isinstance(stored, Float8Tensor) and stored.dtype == torch.bfloat16:
        stored.copy_(unscaled)
        return
    absmax = unscaled.abs().amax() if unscaled.numel() else unscaled.new_zeros(())
    scale.copy_((absmax / STATE_RANGES[dtype]).reshape(scale.shape))
    fp32_max = torch.finfo(torch.float32).max
    if isinstance(stored, Float8Tensor):
        # A zero (or underflowed) factor casts with a scale of 1 (all values are ~0).
        rscale = torch.where(scale > 0, torch.reciprocal(scale), 1.0).clamp_max(fp32_max)
        stored._quantizer.scale.copy_(rscale)
        stored.quantize_(unscaled)
    else:
        rscale = torch.where(scale > 0, torch.reciprocal(scale), 0.0).clamp_max(fp32_max)
        stored.copy_(unscaled * rscale.reshape(()))


def read_unscaled(
    stored: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    shape: torch.Size,
    skip_unscale: bool,
) -> torch.Tensor:
    """The fp32 value of the state `stored` of `dtype` (the state itself when fp32, or bf16
    with skip_unscale; an int16 remainder state as it is), of `shape`."""
    if dtype == torch.uint8:
        return stored.dequantize(torch.float32).reshape(shape)
    if dtype == torch.float16:
        return stored.float() * scale.reshape(())
    if dtype == torch.bfloat16 and not skip_unscale:
        return stored.float()
    return stored
