"""The m_splits of a grouped call: checked, and turned into what the grouped GEMMs take.

m_splits gives the rows of each of G groups in a stacked (T, K) input: a list of ints, or a
1-D integer tensor (on the CPU, or on the module's GPU, where reading it would make the host
wait for the device).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from torchte._sizes import check_splits
from torchte.kernels.host_values import to_device_async

__all__ = ["GroupSplits", "group_splits"]


class GroupSplits:
    """One call's group sizes: a host list, a device tensor, or both. offsets() (int32 (G,)
    cumulative ends) and row_groups() (int64 (T,), the group of each row) live on the device;
    from a device tensor they are computed there, with no synchronization; sizes() reads a
    device tensor back (one synchronization) and checks it."""

    __slots__ = (
        "_offsets",
        "_row_groups",
        "_sizes",
        "_tensor",
        "device",
        "kernel_offsets",
        "num_groups",
        "total",
    )

    def __init__(self, sizes, tensor, num_groups: int, total: int, device: torch.device) -> None:
        self._sizes: list[int] | None = sizes
        self._tensor: torch.Tensor | None = tensor
        self.num_groups, self.total, self.device = num_groups, total, device
        self._offsets: torch.Tensor | None = None
        self._row_groups: torch.Tensor | None = None
        # (o_g, c_g) int32 (G + 1,) as the grouped FP8 kernels read them, made once per call by
        # the quantization layer (quantization/grouped_quantizer.split_offsets).
        self.kernel_offsets: tuple[torch.Tensor, torch.Tensor] | None = None

    def host_sizes(self) -> list[int] | None:
        """The sizes when the host has them (given as a list, or read already), else None:
        never synchronizes."""
        return self._sizes

    @property
    def tensor(self) -> torch.Tensor | None:
        """The device tensor of sizes, when they were given as one."""
        return self._tensor

    def sizes(self) -> list[int]:
        if self._sizes is None:
            sizes = [int(v) for v in self._tensor.tolist()]
            check_sizes(sizes, self.num_groups, self.total)
            self._sizes = sizes
        return self._sizes

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            if self._sizes is not None:
                self._offsets, self._row_groups = _host_split_tensors(
                    tuple(self._sizes), self.device
                )
            else:
                self._offsets = torch.cumsum(self._tensor, 0).to(torch.int32)
        return self._offsets

    def one_hot(self, dtype: torch.dtype) -> torch.Tensor:
        """(G, T) in dtype: 1 where row t belongs to group g (for per-group sums as a GEMM)."""
        if self._sizes is not None:
            return _host_one_hot(tuple(self._sizes), self.device, dtype)
        groups = torch.arange(self.num_groups, device=self.device)
        return (groups[:, None] == self.row_groups()[None, :]).to(dtype)

    def row_groups(self) -> torch.Tensor:
        if self._row_groups is None:
            offsets = self.offsets()
            if self._row_groups is None:
                rows = torch.arange(self.total, device=self.device, dtype=torch.int32)
                self._row_groups = torch.searchsorted(offsets, rows, right=True)
        return self._row_groups


# A split tensor on the CPU is read on the host (free there). Tests set this False to run the
# path for sizes known only on the device (no reading back) on the CPU.
READ_CPU_SPLITS = True

# Device tensors built from host sizes are kept for the last few distinct splits (a layer called
# with the same splits again, as in gradient accumulation or evaluation, skips the host-to-device
# copies); a few entries only, since each holds O(tokens) device memory.
SPLIT_CACHE_SIZE = 8


@functools.lru_cache(maxsize=SPLIT_CACHE_SIZE)
def _host_split_tensors(sizes: tuple[int, ...], device: torch.device):
    """(offsets int32 (G,), row groups int64 (T,)) on `device` for host sizes (copies the host
    does not wait for)."""
    counts = torch.tensor(sizes, dtype=torch.int64)
    offsets = counts.cumsum(0)
    row_groups = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    return to_device_async(offsets, torch.int32, device), to_device_async(
        row_groups, torch.int64, device
    )


@functools.lru_cache(maxsize=SPLIT_CACHE_SIZE)
def _host_one_hot(sizes: tuple[int, ...], device: torch.device, dtype: torch.dtype):
    row_groups = _host_split_tensors(sizes, device)[1]
    groups = torch.arange(len(sizes), device=device)
    return (groups[:, None] == row_groups[None, :]).to(dtype)


def check_sizes(sizes: Sequence[int], num_groups: int, total: int) -> None:
    """Raise ValueError unless sizes are num_groups non-negative ints summing to total."""
    if len(sizes) != num_groups:
        raise ValueError(f"m_splits has {len(sizes)} entries, but the layer has {num_groups} GEMMs")
    check_splits(sizes, total)


def group_splits(m_splits, num_groups: int, total: int, device: torch.device) -> GroupSplits:
    """Check m_splits against the layer and the input (before any kernel runs) and wrap them.
    A tensor on the GPU is checked for shape and dtype only here: its values are checked where
    a path reads them on the host (the per-group path), never by a synchronization of its own.
    """
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.is_complex():
            raise TypeError(
                f"m_splits must be a 1-D integer tensor or a list of ints, got a "
                f"{m_splits.dim()}-D {m_splits.dtype} tensor"
            )
        if m_splits.device.type == "cpu" and READ_CPU_SPLITS:
            return group_splits(m_splits.tolist(), num_groups, total, device)
        if m_splits.device != device:
            raise ValueError(f"m_splits is on {m_splits.device}, the layer on {device}")
        if m_splits.numel() != num_groups:
            raise ValueError(
                f"m_splits has {m_splits.numel()} entries, but the layer has {num_groups} GEMMs"
            )
        return GroupSplits(None, m_splits, num_groups, total, device)
    if not isinstance(m_splits, (list, tuple)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in m_splits
    ):
        raise TypeError(f"m_splits must be a list of ints or an integer tensor, got {m_splits!r}")
    check_sizes(m_splits, num_groups, total)
    return GroupSplits(list(m_splits), None, num_groups, total, device)
