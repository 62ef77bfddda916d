"""FP8 values written by the kernel that produces them: norm -> FP8, activation -> FP8.

Each function takes the quantizer of the value, which must be `fusable`: its scale is known
before the values exist (delayed scaling: the kernel asks the quantizer for its CastSpec and
hands what it wrote back to the quantizer, which makes the Float8Storage), or every scale
comes from values one tile holds (Float8BlockScaling's 1x128 blocks: fused_block_act.py
writes a Float8BlockwiseQTensorStorage). The activation's kernels also take current scaling
of large inputs (writes_activation): an amax pass first, then the fused kernel.

Under 1x128 blocks only what measured faster fused is fused (benchmarks/fused_block.py, H100):
the activation's forward, and an output gradient's cast with its bias gradient (also after the
activation's backward); the norm runs in high precision, then the cast (a fused norm -> 1x128
kernel, statistics pass then tiles, took 1.3-1.6x the pair's time), as does the activation's
backward (the fused one took 1.07-1.13x). Under one scale per tensor the norm -> FP8 kernel
runs only for small inputs (NORM_FUSED_MAX), the one-launch form where host time is the bound;
larger ones, where the pair takes less GPU time, run the norm then the cast. An output
gradient's cast sums its columns into the bias gradient under either scaling
(kernels/cast_dbias).

Modules reach these kernels only through here. Shapes: x, z (M, K); h (M, K) with K = 2N for
gated activations (else N); a (M, N); `shape` is the value's shape as the module sees it.
"""

from __future__ import annotations

import torch

from torchte.kernels import activation as act_kernels
from torchte.kernels import (
    activation_fp8,
    cast_dbias,
    cast_transpose,
    grouped_activation_fp8,
    norm_fp8,
)
from torchte.kernels import norm as norm_kernels

from .blockwise import Float8BlockwiseQTensorStorage
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Storage
from .fused_block_act import activation_to_block, fusable_1x128, quantize_with_dbias
from .grouped import GroupedStorage
from .grouped_quantizer import split_offsets

# Elements of x up to which norm_to_fp8 runs the fused norm -> FP8 kernel (one launch): past
# it the norm then the cast take less GPU time (H200, `benchmarks/norm.py --fp8-sweep`:
# 16384 x 2048 0.087 ms against the fused kernel's best tile 0.102 ms, 16384 x 8192 0.326 ms
# against 0.450 ms), while below it the GPU time is a few microseconds and one launch fewer
# saves more host time than that.
NORM_FUSED_MAX = 1 << 20

# Elements of an activation's input up to which current scaling keeps the activation, then the
# cast (one launch fewer: the cast of a tensor this small reads its own amax, cast_transpose's
# small_tile); past it the amax pass and the fused kernel move fewer bytes (kernels/activation_fp8).
CURRENT_FUSED_MIN = cast_transpose.SMALL_TILE * cast_transpose.SMALL_MAX_TILES

__all__ = [
    "CURRENT_FUSED_MIN",
    "activation_grad_to_fp8",
    "activation_to_fp8",
    "grad_output_with_dbias",
    "norm_to_fp8",
    "scaled_activation_grad_to_grouped_fp8",
    "scaled_activation_to_grouped_fp8",
    "writes_activation",
]


def norm_to_fp8(
    quantizer, x, weight, bias, rms: bool, eps: float, zero_centered_gamma: bool, columnwise, shape
) -> tuple[Float8Storage, torch.Tensor | None, torch.Tensor]:
    """z = LayerNorm(x) (rms False) or RMSNorm(x) written in FP8 by the norm kernel, x (M, K):
    (z as a Float8Storage of `shape`, mean (M,) fp32 or None for RMSNorm, rstd (M,) fp32).
    Past NORM_FUSED_MAX elements the norm runs in high precision and the cast after it."""
    if fusable_1x128(quantizer) or x.numel() > NORM_FUSED_MAX:  # (module docstring)
        if rms:
            z, rstd = norm_kernels.rmsnorm_forward(x, weight, eps, zero_centered_gamma)
            mean = None
        else:
            norm = (eps, zero_centered_gamma)
            z, mean, rstd = norm_kernels.layernorm_forward(x, weight, bias, *norm)
        z_q = quantizer.quantize(z.view(shape), rowwise=True, columnwise=bool(columnwise))
        return z_q, mean, rstd
    spec = quantizer.cast_spec(True, columnwise)
    if rms:
        data, data_t, scale_inv, rstd = norm_fp8.rmsnorm_forward_fp8(
            x, weight, eps, zero_centered_gamma, spec
        )
        mean = None
    else:
        data, data_t, scale_inv, mean, rstd = norm_fp8.layernorm_forward_fp8(
            x, weight, bias, eps, zero_centered_gamma, spec
        )
    return quantizer.fused_output(data, data_t, scale_inv, shape), mean, rstd


def writes_activation(quantizer, elements: int) -> bool:
    """Whether activation_to_fp8 / activation_grad_to_fp8 write this quantizer's values, for an
    activation input of `elements`: always where the scale is known before the values
    (`fusable`: delayed scaling, 1x128 blocks); under current scaling (one scale for the
    tensor, no reduction over ranks) past CURRENT_FUSED_MIN elements."""
    if quantizer.fusable:  # (a delayed quantizer is, so one-scale here means current)
        return True
    return _one_scale_fusable(quantizer) and elements > CURRENT_FUSED_MIN


def activation_to_fp8(
    quantizer, h, activation: str, limit: float, alpha: float, columnwise: bool, shape
) -> Float8Storage:
    """a = activation(h) written in FP8 by the activation kernel (under current scaling after an
    amax pass): a Float8Storage of `shape`."""
    if fusable_1x128(quantizer):
        return activation_to_block(quantizer, h, activation, limit, alpha, columnwise, shape)
    spec = quantizer.cast_spec(True, columnwise)
    data, data_t, scale_inv = activation_fp8.activation_forward_fp8(
        h, activation, limit, alpha, spec
    )
    return quantizer.fused_output(data, data_t, scale_inv, shape)


def activation_grad_to_fp8(
    quantizer, da, h, activation: str, limit: float, alpha: float, usage, shape
) -> tuple[Float8Storage, torch.Tensor]:
    """dh = da * activation'(h) written in FP8 by the activation's backward kernel, da (M, N),
    with its column sums (the bias gradient of the GEMM that made h): (dh as a Float8Storage
    of `shape`, dbias (K,) in da's dtype). usage = (rowwise, columnwise)."""
    if fusable_1x128(quantizer):  # the activation's backward, then the cast with the sums
        dh = act_kernels.activation_backward(da, h, activation, limit, alpha)
        return quantize_with_dbias(quantizer, dh, usage, shape)
    spec = quantizer.cast_spec(*usage)
    data, data_t, scale_inv, dbias = activation_fp8.activation_backward_fp8(
        da, h, activation, limit, alpha, spec
    )
    return quantizer.fused_output(data, data_t, scale_inv, shape), dbias


def grad_output_with_dbias(
    quantizer, dy2d, usage
) -> tuple[Float8Storage | Float8BlockwiseQTensorStorage, torch.Tensor] | None:
    """(dy2d (M, N) quantized with usage (rowwise, columnwise), its column sums (N,) in dy2d's
    dtype) from one pass where the quantizer's format allows it (1x128 blocks; one scale for
    the tensor, delayed or current, without an amax reduction over ranks), else None."""
    if fusable_1x128(quantizer):
        return quantize_with_dbias(quantizer, dy2d, usage, dy2d.shape)
    if not _one_scale_fusable(quantizer):
        return None
    data, data_t, scale_inv, dbias = cast_dbias.quantize_dbias(dy2d, quantizer.cast_spec(*usage))
    return quantizer.fused_output(data, data_t, scale_inv, tuple(dy2d.shape)), dbias


def _one_scale_fusable(quantizer) -> bool:
    """Whether cast_dbias writes this quantizer's output: an internal Float8Quantizer (delayed)
    or Float8CurrentScalingQuantizer whose amax is its own (no reduction over ranks between
    the amax and the cast); exact classes, so a subclass's own quantize is never bypassed."""
    kind = type(quantizer)
    if kind is Float8CurrentScalingQuantizer:
        return quantizer.internal and quantizer.amax_reduction is None
    return kind is Float8Quantizer and quantizer.internal


def scaled_activation_to_grouped_fp8(
    quantizer, h, s, activation: str, limit: float, alpha: float, m_splits, columnwise: bool
) -> GroupedStorage:
    """a = activation(h) * s[:, None] written group by group in FP8 by one kernel (delayed
    scaling; current scaling: an amax pass first), h (T, K), s (T,), quantizer a
    GroupedQuantizer (any scaling: the grouped kernel computes current scales itself);
    m_splits host ints or a GroupSplits (sizes maybe on the device only)."""
    sizes, rows, cols = split_offsets(m_splits, h.device)
    spec = quantizer.cast_spec(True, columnwise)
    data, data_t, scale_inv = grouped_activation_fp8.scaled_activation_grouped_fp8(
        h, s, activation, limit, alpha, sizes, rows, cols, spec
    )
    shape = (h.shape[0], data.shape[1])
    return GroupedStorage(data, data_t, scale_inv, quantizer.fp8_dtype, sizes, shape, (rows, cols))


def scaled_activation_grad_to_grouped_fp8(
    quantizer, dy, h, s, activation: str, limit: float, alpha: float, m_splits, usage, need
) -> tuple[GroupedStorage, torch.Tensor | None, torch.Tensor | None]:
    """dh, the gradient of h for a = activation(h) * s[:, None] and da = dy (T, N), written
    group by group in FP8 by one kernel (current scaling: an amax pass first): (dh as a
    GroupedStorage (T, K), ds (T,) in s's dtype or None, dbias (G, K) in dy's dtype or None).
    usage = (rowwise, columnwise) of dh; need = (ds, dbias): which sums to make."""
    sizes, rows, cols = split_offsets(m_splits, h.device)
    spec = quantizer.cast_spec(*usage)
    data, data_t, scale_inv, ds, dbias = (
        grouped_activation_fp8.scaled_activation_backward_grouped_fp8(
            dy, h, s, activation, limit, alpha, sizes, rows, cols, spec, need
        )
    )
    offsets = (rows, cols)
    dh = GroupedStorage(data, data_t, scale_inv, quantizer.fp8_dtype, sizes, h.shape, offsets)
    return dh, ds, dbias
