"""GroupedQuantizer: quantizes the G row groups of one tensor at once into a GroupedStorage.

Legend: x (T, K) with group g owning m_g consecutive rows (m_splits, host ints summing to T, or
a GroupSplits whose sizes may be on the device only: then nothing is read back, the kernels
take the offsets on the device and the GroupedStorage has room for the worst case).
Delayed scaling: group g uses GEMM g's scale of one slot of a slot-major DelayedScalingState
(a (G,) vector, read through views) and max-accumulates its amax there. Current scaling: each
group's scale comes from its own amax; with amax_reduction (tensor parallelism: a function
all-reducing the (G,) amaxes with MAX over the ranks holding pieces of the groups) from the
amax over the ranks, so every rank casts its piece of a group with the same scale. One grouped
cast kernel writes all groups.
"""

from __future__ import annotations

import torch

from torchte._group_splits import GroupSplits
from torchte.kernels import grouped_cast
from torchte.kernels.cast_spec import CastSpec

from .grouped import GroupedStorage

__all__ = ["GroupedQuantizer", "split_offsets"]


def split_offsets(splits, device) -> tuple[list[int] | None, torch.Tensor, torch.Tensor]:
    """(host sizes or None, o_g, c_g) for host ints or a GroupSplits: the offsets the grouped
    kernels read, int32 (G + 1,) on device; from a device split tensor computed there (once per
    GroupSplits, no synchronization)."""
    if not isinstance(splits, GroupSplits):
        return list(splits), *grouped_cast.grouped_offsets(splits, device)
    sizes = splits.host_sizes()
    if sizes is not None:
        return sizes, *grouped_cast.grouped_offsets(sizes, device)
    if splits.kernel_offsets is None:
        splits.kernel_offsets = grouped_cast.device_grouped_offsets(splits.tensor)
    return None, *splits.kernel_offsets


class GroupedQuantizer:
    """Quantizes grouped rows with one scale per group (see the module docstring)."""

    __slots__ = (
        "_specs",
        "amax_epsilon",
        "amax_reduction",
        "fp8_dtype",
        "power_2_scale",
        "slot",
        "state",
    )

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
        self.amax_reduction = None
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
        self,
        x: torch.Tensor,
        m_splits,
        rowwise: bool = True,
        columnwise: bool = True,
        src_rows: torch.Tensor | None = None,
    ) -> GroupedStorage:
        """x (T, K) contiguous with groups of m_splits rows (host ints or a GroupSplits) ->
        GroupedStorage, in one launch (delayed) or three (current: zero amax, amax, cast) on a
        GPU (current scaling with amax_reduction: one all-reduce more). src_rows (T,) int32:
        the rows quantized are x[src_rows] (zeros where < 0), read from x (T_src, K) by the
        cast itself (grouped_cast.quantize_grouped)."""
        sizes, rows, cols = split_offsets(m_splits, x.device)
        spec = self.cast_spec(rowwise, columnwise)
        data, data_t, scale_inv = grouped_cast.quantize_grouped(
            x, sizes, rows, cols, spec, self.amax_reduction, src_rows
        )
        shape = tuple(x.shape) if src_rows is None else (src_rows.numel(), x.shape[1])
        return GroupedStorage(data, data_t, scale_inv, self.fp8_dtype, sizes, shape, (rows, cols))
