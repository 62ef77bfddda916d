"""Size arithmetic every layer shares (kernels, quantized storages, modules): no imports of
the package's own, so that any layer may use it."""

from __future__ import annotations

__all__ = ["check_splits", "round_up"]


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value."""
    return (value + multiple - 1) // multiple * multiple


def check_splits(m_splits, total: int) -> None:
    """ValueError unless the group sizes m_splits are non-negative and sum to total (the rows
    of the grouped tensor): the one check of a split for layers, kernels and storages."""
    if any(m < 0 for m in m_splits):
        raise ValueError(f"m_splits must be non-negative, got {list(m_splits)}")
    if sum(m_splits) != total:
        raise ValueError(
            f"m_splits sum to {sum(m_splits)}, not to the token count {total}: {list(m_splits)}"
        )
