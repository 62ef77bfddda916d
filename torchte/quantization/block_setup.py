"""The quantizers of the block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling,
NVFP4BlockScaling), slot by slot, as Transformer Engine's recipe states make them.

Slots: "input", "weight", "output" (forward) and "grad_output", "grad_input" (backward). None
keeps amax state between steps: each block's scale comes from its own values.
"""

from __future__ import annotations

import torch

from torchte.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, Recipe

__all__ = ["BLOCK_RECIPES", "block_quantizer", "grouped_block_mode"]

BLOCK_RECIPES = (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)
# The recipe field giving a slot's block dimension (Float8BlockScaling) and its QParams.
_BLOCK_DIM = {
    "input": "x_block_scaling_dim",
    "output": "x_block_scaling_dim",
    "weight": "w_block_scaling_dim",
    "grad_output": "grad_block_scaling_dim",
    "grad_input": "grad_block_scaling_dim",
}
_QPARAMS = {
    "input": "fp8_quant_fwd_inp",
    "output": "fp8_quant_fwd_inp",
    "weight": "fp8_quant_fwd_weight",
    "grad_output": "fp8_quant_bwd_grad",
    "grad_input": "fp8_quant_bwd_grad",
}
_NVFP4_QPARAMS = {
    "input": "fp4_quant_fwd_inp",
    "output": "fp4_quant_fwd_inp",
    "weight": "fp4_quant_fwd_weight",
    "grad_output": "fp4_quant_bwd_grad",
    "grad_input": "fp4_quant_bwd_grad",
}


def block_quantizer(recipe: Recipe, slot: str, dtype: torch.dtype, internal: bool):
    """The quantizer of `slot` under block-scaled `recipe`, writing `dtype` (the recipe
    format's forward or backward dtype)."""
    if isinstance(recipe, Float8BlockScaling):
        from .blockwise import Float8BlockQuantizer

        params = getattr(recipe, _QPARAMS[slot])
        return Float8BlockQuantizer(
            dtype,
            rowwise=True,
            columnwise=True,
            amax_epsilon=params.amax_epsilon,
            force_pow_2_scales=params.power_2_scale,
            block_scaling_dim=getattr(recipe, _BLOCK_DIM[slot]),
            internal=internal,
        )
    if isinstance(recipe, MXFP8BlockScaling):
        from .mxfp8 import MXFP8Quantizer

        two_d = recipe.enable_2d_quantization and slot == "weight"  # 32x32 weight blocks
        return MXFP8Quantizer(
            dtype, rowwise=True, columnwise=True, with_2d_quantization=two_d, internal=internal
        )
    if isinstance(recipe, NVFP4BlockScaling):
        from .nvfp4 import NVFP4Quantizer

        params = getattr(recipe, _NVFP4_QPARAMS[slot])
        return NVFP4Quantizer(
            rowwise=True,
            columnwise=True,
            with_rht=params.random_hadamard_transform,
            with_post_rht_amax=params.random_hadamard_transform,
            with_2d_quantization=params.fp4_2d_quantization,
            stochastic_rounding=params.stochastic_rounding,
            internal=internal,
        )
    raise TypeError(f"{type(recipe).__name__} is not a block-scaled recipe")


def grouped_block_mode(recipe: Recipe) -> str | None:
    """ "block" where a grouped module runs the grouped block-scaled path under `recipe`
    (Float8BlockScaling with its default 1x128 inputs and gradients and 128x128 weights, the
    layouts the grouped GEMMs take), else None (its GEMMs then run group by group)."""
    if not isinstance(recipe, Float8BlockScaling):
        return None
    dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
    return "block" if dims == (1, 2, 1) else None
