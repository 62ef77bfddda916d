"""NormSpec: which normalization a module runs and how, for te.LayerNorm / te.RMSNorm and for
the norm in front of a GEMM (te.LayerNormLinear, te.LayerNormMLP).

Legend: x (..., K) input, x2d (M, K) its rows, z = norm(x); weight, bias (K,) in the
parameters' dtype; mean, rstd (M,) fp32 (mean None for RMSNorm).
In front of a GEMM under FP8, the norm writes z in FP8 itself where the GEMM's input
quantizer allows it (`fusable`: delayed scaling) and the module does not hand z out in high
precision (keep_output); otherwise z is computed in high precision and quantized by the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchte.kernels import norm as norm_kernels
from torchte.quantization.fused import norm_to_fp8

from ._common import given_grad

__all__ = ["NORMALIZATIONS", "NormSpec", "rows_of"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """t (..., K) as a contiguous (M, K)."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.is_contiguous() else t2d.contiguous()


@dataclass(frozen=True, slots=True)
class NormSpec:
    """A module's normalization: one per module, built at construction, reused by every call."""

    kind: str
    """"LayerNorm" or "RMSNorm"."""
    eps: float
    """Added to the variance (LayerNorm) or the mean square (RMSNorm) before the square root."""
    zero_centered_gamma: bool
    """Scale by 1 + weight instead of weight."""
    keep_output: bool = False
    """In front of a GEMM: the module hands z out in high precision (return_layernorm_output)."""

    def __post_init__(self) -> None:
        if self.kind not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.kind!r}"
            )
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")

    @property
    def rms(self) -> bool:
        return self.kind == "RMSNorm"

    def forward(self, x2d, weight, bias):
        """x2d (M, K) -> (z (M, K) in x's dtype, mean (M,) fp32 | None, rstd (M,) fp32)."""
        if self.rms:
            z, rstd = norm_kernels.rmsnorm_forward(x2d, weight, self.eps, self.zero_centered_gamma)
            return z, None, rstd
        return norm_kernels.layernorm_forward(x2d, weight, bias, self.eps, self.zero_centered_gamma)

    def backward(self, dz, x2d, weight, mean, rstd, has_bias: bool = True):
        """(dx (M, K), dweight (K,), dbias (K,) | None (RMSNorm, or not has_bias))."""
        zcg = self.zero_centered_gamma
        if self.rms:
            dx, dweight = norm_kernels.rmsnorm_backward(dz, x2d, weight, rstd, zcg)
            return dx, dweight, None
        return norm_kernels.layernorm_backward(dz, x2d, weight, mean, rstd, zcg, has_bias=has_bias)

    def run(self, inp, weight, bias, dtype: torch.dtype, quantizer, columnwise: bool):
        """The norm in front of a GEMM computing in `dtype`, whose input quantizer (None without
        FP8) is `quantizer`: inp (..., K) -> (x2d (M, K) in dtype, the GEMM's input (a
        Float8Storage where the norm writes FP8, else z), z (..., K) or None, mean, rstd)."""
        x2d = inp.reshape(-1, inp.shape[-1])
        if x2d.dtype != dtype:
            x2d = x2d.to(dtype)  # the norm runs in the compute dtype, as the GEMM does
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        if quantizer is not None and quantizer.fusable and not self.keep_output:
            norm = (self.rms, self.eps, self.zero_centered_gamma)
            z_fp8, mean, rstd = norm_to_fp8(
                quantizer, x2d, weight, bias, *norm, columnwise, inp.shape
            )
            return x2d, z_fp8, None, mean, rstd
        z2d, mean, rstd = self.forward(x2d, weight, bias)
        z = z2d.view(inp.shape)
        return x2d, z, z, mean, rstd

    def backward_after_gemm(self, dz, grad_z, x2d, weight, mean, rstd, inp_shape, bias_grad):
        """The norm backward from the GEMM's input gradient dz (plus grad_z, the gradient of a
        handed-out norm output): (dx of inp_shape, dweight, dbias if bias_grad else None)."""
        dz = dz.reshape(x2d.shape)
        grad_z = given_grad(grad_z)
        if grad_z is not None:
            dz = dz + grad_z.reshape(x2d.shape)
        dz = dz.to(x2d.dtype).contiguous()
        dx, dweight, dbias = self.backward(dz, x2d, weight, mean, rstd)
        return dx.view(inp_shape), dweight, dbias if bias_grad else None
