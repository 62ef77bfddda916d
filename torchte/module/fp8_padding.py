"""Transformer Engine's `Fp8Padding` and `Fp8Unpadding`: the rows of each group of a
mixture-of-experts split padded with zero rows to a multiple of the FP8 alignment (so that every
group's GEMM has a token count FP8 accepts), and the padding taken off again.

Shapes: T tokens in G groups of m_splits[g] rows, H hidden; padded, group g has
round_up(m_splits[g], align) rows and P = their sum. Fp8Padding maps (T, H) -> (P, H) and
Fp8Unpadding (P, H) -> (T, H); each is differentiable (the gradient of one is the other).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from torchte._group_splits import SPLIT_CACHE_SIZE
from torchte._sizes import check_splits, round_up
from torchte.autocast import autocast_state, default_recipe
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.recipe import Recipe

__all__ = ["Fp8Padding", "Fp8Unpadding", "get_align_size_for_quantization"]

_STATE = autocast_state()


def get_align_size_for_quantization(recipe: Recipe) -> int:
    """The row multiple a recipe's grouped GEMMs need: 32 for MXFP8, 128 for NVFP4, else 16."""
    if recipe.mxfp8():
        return 32
    if recipe.nvfp4():
        return 128
    return 16


@functools.lru_cache(maxsize=SPLIT_CACHE_SIZE)
def _padded_rows(sizes: tuple[int, ...], padded: tuple[int, ...], device) -> torch.Tensor:
    """int64 (T,): the row of the padded (P, H) tensor that each of the T rows occupies."""
    counts = torch.tensor(sizes, dtype=torch.int64)
    gaps = torch.tensor(padded, dtype=torch.int64) - counts
    gaps_before = torch.cumsum(gaps, 0) - gaps  # padding rows of the groups before each group
    rows = torch.arange(sum(sizes), dtype=torch.int64)
    return (rows + torch.repeat_interleave(gaps_before, counts)).to(device)


class _RowPadding(nn.Module):
    """What padding and unpadding share: the group count, the alignment, the split checks."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"num_gemms must be a positive int, got {num_gemms!r}")
        if align_size is not None and (
            isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 1
        ):
            raise ValueError(f"align_size must be a positive int or None, got {align_size!r}")
        self.num_gemms = num_gemms
        self.align_size = align_size

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"

    def _align(self) -> int:
        """align_size, or (first call without one, as Transformer Engine) the active recipe's."""
        if self.align_size is None:
            recipe = _STATE.recipe if _STATE.depth else default_recipe()
            # A plain attribute: __dict__ skips nn.Module.__setattr__ (DESIGN.md, hot path).
            self.__dict__["align_size"] = get_align_size_for_quantization(recipe)
        return self.align_size

    def _splits(self, inp: torch.Tensor, m_splits) -> tuple[list[int], list[int]]:
        """(m_splits, padded m_splits) as lists, after checking inp and the split's form."""
        if not isinstance(inp, torch.Tensor) or isinstance(inp, Float8Tensor):
            raise TypeError(
                f"{type(self).__name__}: inp must be a high-precision torch.Tensor (pad before "
                f"quantizing), got {type(inp).__name__}"
            )
        if inp.dim() < 2:
            raise ValueError(
                f"{type(self).__name__}: inp must have a row and a hidden dimension, got shape "
                f"{tuple(inp.shape)}"
            )
        sizes = _host_sizes(m_splits)
        if len(sizes) != self.num_gemms:
            raise ValueError(
                f"m_splits has {len(sizes)} entries, but the layer has {self.num_gemms} GEMMs"
            )
        align = self._align()
        return sizes, [round_up(m, align) for m in sizes]


def _host_sizes(m_splits) -> list[int]:
    """m_splits as a list of ints: from a list or tuple of ints, or a 1-D integer CPU tensor."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.is_floating_point() or m_splits.is_complex():
            raise TypeError(f"m_splits must be a list of ints, got a {m_splits.dtype} tensor")
        if m_splits.device.type != "cpu":
            raise TypeError(
                f"m_splits must be on the host (a list of ints or a CPU tensor): the padded "
                f"output's size depends on its values; got a tensor on {m_splits.device}"
            )
        return [int(m) for m in m_splits.tolist()]
    if not isinstance(m_splits, (list, tuple)) or not all(
        isinstance(m, int) and not isinstance(m, bool) for m in m_splits
    ):
        raise TypeError(f"m_splits must be a list of ints, got {m_splits!r}")
    return list(m_splits)


class Fp8Padding(_RowPadding):
    """Pad each group of rows with zero rows up to a multiple of `align_size` (None: the active
    recipe's alignment at the first call, 32 for MXFP8, 128 for NVFP4, else 16).

    forward(inp (T, H) or (..., H), m_splits: G ints summing to T) -> (out (P, H), padded
    m_splits). When no group needs padding, returns `inp` itself and m_splits unchanged.
    """

    def forward(self, inp: torch.Tensor, m_splits) -> tuple[torch.Tensor, list[int]]:
        sizes, padded = self._splits(inp, m_splits)
        x = inp.reshape(-1, inp.shape[-1])
        check_splits(sizes, x.shape[0])
        if padded == sizes:
            return inp, sizes
        rows = _padded_rows(tuple(sizes), tuple(padded), x.device)
        out = x.new_zeros(sum(padded), x.shape[-1])
        return out.index_copy(0, rows, x), padded


class Fp8Unpadding(_RowPadding):
    """Take off the padding Fp8Padding added: keep the first m_splits[g] rows of each group.

    forward(inp (P, H) or (..., H), m_splits: the G unpadded sizes) -> out (T, H). When no group
    was padded, returns `inp` itself.
    """

    def forward(self, inp: torch.Tensor, m_splits) -> torch.Tensor:
        sizes, padded = self._splits(inp, m_splits)
        x = inp.reshape(-1, inp.shape[-1])
        if any(m < 0 for m in sizes):
            raise ValueError(f"m_splits must be non-negative, got {sizes}")
        if sum(padded) != x.shape[0]:
            raise ValueError(
                f"inp has {x.shape[0]} rows, but m_splits {sizes} padded to multiples of "
                f"{self.align_size} give {sum(padded)}"
            )
        if padded == sizes:
            return inp
        rows = _padded_rows(tuple(sizes), tuple(padded), x.device)
        return x.index_select(0, rows)
