"""The native MXFP8 / NVFP4 GEMM (gemm.py's part for compute capability 10+): two operands of
kind "mx" or "nvfp4" (quantization/mx_operand.py) through torch.nn.functional.scaled_mm, with
torch's MX-scaled (BlockWise1x32) or NVFP4 (BlockWise1x16 + TensorWise) recipes and swizzled
(SWIZZLE_32_4_4) scales. Reached from gemm_block.operand_gemm.

UNTESTED ON SUCH HARDWARE: torchte's GPUs are Hopper, where these formats are emulated and
this code never runs. The CPU tests (tests/test_mx_native.py) run it against a stand-in for
F.scaled_mm that checks what it receives and computes the product from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quantization.mx_operand import MX_KINDS

__all__ = ["MX_KINDS", "mx_operand_mm"]

# The output dtypes whose GEMM adds a bias in its epilogue (torch takes a bf16 / fp16 bias for
# a bf16 / fp16 output and none for fp32).
_FUSED_BIAS = (torch.bfloat16, torch.float16)


def mx_operand_mm(a, b, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, N) out_dtype = a (M, K) @ b (N, K)^T (+ bias (N,)) for two operands of the same
    kind, "mx" or "nvfp4" (NVFP4: times both per-tensor factors); ValueError for any other
    pair. The bias is added in the GEMM's epilogue for a bf16 / fp16 output, after it in fp32
    otherwise."""
    if a.kind != b.kind or a.kind not in MX_KINDS:
        raise ValueError(
            f"a native MX GEMM needs two operands of one kind, both 'mx' (MXFP8) or both "
            f"'nvfp4' (NVFP4); got a {a.kind!r} and a {b.kind!r} operand (operands of two "
            "formats, or of a format emulated on one side only, cannot be multiplied)"
        )
    scaling, swizzle = F.ScalingType, F.SwizzleType
    if a.kind == "mx":
        recipe = [scaling.BlockWise1x32]
        swizzles = [swizzle.SWIZZLE_32_4_4]
        scale_a, scale_b = [a.scale], [b.scale]
    else:
        recipe = [scaling.BlockWise1x16, scaling.TensorWise]
        swizzles = [swizzle.SWIZZLE_32_4_4, swizzle.NO_SWIZZLE]
        scale_a, scale_b = [a.scale, a.factor], [b.scale, b.factor]
    fused = bias.to(out_dtype) if bias is not None and out_dtype in _FUSED_BIAS else None
    result = F.scaled_mm(
        a.data, b.data.t(), scale_a, recipe, scale_b, recipe, swizzle_a=swizzles,
        swizzle_b=swizzles, bias=fused, output_dtype=out_dtype,
    )  # fmt: skip
    if bias is not None and fused is None:
        result = result.add_(bias)
    return result
