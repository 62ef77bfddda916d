"""GroupedQuantizer: quantizes the G row groups of one tensor at once into a GroupedStorage.

Legend: x (T, K) with group g owning m_g consecutive rows (m_splits, host ints summing to T).
Delayed scaling: group g uses GEMM g's scale of one slot of a slot-major DelayedScalingState
(a (G,) vector, read through views) and max-accumulates its amax there. Current scaling: each
group's scale comes from its own amax. One grouped cast kernel writes all groups.
"""

from __future__ import annotations

import torch

from torchte.kernels import grouped_cast
from torchte.kernels.cast_spec import CastSpec

from .grouped import GroupedStorage

__all__ = ["GroupedQuantizer"]


class GroupedQuantizer:
    """Quantizes grouped rows with one scale per group (see the module docstring)."""

    __slots__ = ("_specs", "amax_epsilon", "fp8_dtype", "power_2_scale", "slot", "state")

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        state=None,
        slot: str | None = None,
        amax_epsilon: float = 0.0,
        power_2_scale: bool = False,
    ) -> None:
        """Delayed scaling with `state` (slot-major, one entry per group) and `slot` given;
        current scaling (amax_epsilon, power_2_scale) without."""
        self.fp8_dtype = fp8_dtype
        self.state, self.slot = state, slot
        self.amax_epsilon, self.power_2_scale = amax_epsilon, power_2_scale
        # CastSpecs per usage: the state's (G,) views stay valid (it is updated in place).
        self._specs: dict[tuple[bool, bool], CastSpec] = {}

    def cast_spec(self, rowwise: bool, columnwise: bool) -> CastSpec:
        """How the grouped cast writes this quantizer's output (scale and amax (G,) views)."""
        spec = self._specs.get((rowwise, columnwise))
        if spec is None:
            if self.state is None:
                eps, power_2 = self.amax_epsilon, self.power_2_scale
                spec = CastSpec(self.fp8_dtype, rowwise, columnwise, None, None, eps, power_2)
            else:
                scale, amax = self.state.slot_vectors(self.slot)
                spec = CastSpec(self.fp8_dtype, rowwise, columnwise, scale, amax)
            self._specs[(rowwise, columnwise)] = spec
        return spec

    def quantize(
        self, x: torch.Tensor, m_splits: list[int], rowwise: bool = True, columnwise: bool = True
    ) -> GroupedStorage:
        """x (T, K) contiguous with groups of m_splits rows -> GroupedStorage, in one launch
        (delayed) or three (current: zero amax, amax, cast) on a GPU."""
        rows, cols = grouped_cast.grouped_offsets(m_splits, x.device)
        spec = self.cast_spec(rowwise, columnwise)
        data, data_t, scale_inv = grouped_cast.quantize_grouped(x, m_splits, rows, cols, spec)
        return GroupedStorage(data, data_t, scale_inv, self.fp8_dtype, m_splits, tuple(x.shape))
