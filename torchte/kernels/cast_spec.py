"""CastSpec: how an FP8-writing kernel writes its output, as the quantizer of that output says.

Every kernel that writes FP8 (cast/transpose, grouped cast, norm -> FP8, activation -> FP8)
takes one CastSpec instead of loose scale/amax/dtype/usage arguments, and returns the FP8 data
with the scale_inv it wrote. Two scalings:
- delayed: `scale` (G,) fp32 is given (G = 1 except for grouped casts, one per group); the
  kernel multiplies by it and max-accumulates max |y| into `amax` (G,) fp32 in place.
- current: `scale` is None; the kernel computes the scale from the tensor's own amax
  (fp8_max / max(amax, amax_epsilon), rounded down to a power of 2 if power_2_scale). A given
  `amax` (G,) is overwritten with the amax it found (grouped casts only).
Under torch.compile a CastSpec argument travels through a kernel's custom op as its fields,
in the order of SCHEMA (see _compile.compiled_as_op).
"""

from __future__ import annotations

import torch

__all__ = ["CastSpec"]


class CastSpec:
    """What an FP8-writing kernel needs to know about its output: the FP8 dtype, which copies
    to write (rowwise (M, N), columnwise (N, Mp)) and the scale (see the module docstring)."""

    __slots__ = (
        "amax",
        "amax_epsilon",
        "columnwise",
        "fp8_dtype",
        "power_2_scale",
        "rowwise",
        "scale",
    )

    # The fields as custom-op arguments, in the order of `fields()`.
    SCHEMA = (
        "Tensor? scale, Tensor(a!)? amax, ScalarType fp8_dtype, float amax_epsilon, "
        "bool power_2_scale, bool rowwise, bool columnwise"
    )

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        rowwise: bool = True,
        columnwise: bool = True,
        scale: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
        amax_epsilon: float = 0.0,
        power_2_scale: bool = False,
    ) -> None:
        self.fp8_dtype = fp8_dtype
        self.rowwise, self.columnwise = rowwise, columnwise
        self.scale, self.amax = scale, amax
        self.amax_epsilon, self.power_2_scale = amax_epsilon, power_2_scale

    @property
    def delayed(self) -> bool:
        """Whether the scale is given (delayed scaling) rather than computed (current)."""
        return self.scale is not None

    def fields(self) -> tuple:
        """The fields in SCHEMA's order (a custom op's arguments)."""
        return (
            self.scale, self.amax, self.fp8_dtype, self.amax_epsilon, self.power_2_scale,
            self.rowwise, self.columnwise,
        )  # fmt: skip

    @classmethod
    def from_fields(cls, scale, amax, fp8_dtype, amax_epsilon, power_2_scale, rowwise, columnwise):
        """The CastSpec whose fields() these are."""
        return cls(fp8_dtype, rowwise, columnwise, scale, amax, amax_epsilon, power_2_scale)

    def __repr__(self) -> str:
        how = (
            "delayed"
            if self.delayed
            else f"current(eps={self.amax_epsilon}, p2={self.power_2_scale})"
        )
        return (
            f"CastSpec({self.fp8_dtype}, rowwise={self.rowwise}, columnwise={self.columnwise}, "
            f"{how})"
        )
