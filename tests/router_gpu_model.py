"""A GPU's top-k selection in torch ops: what the router's kernels (torchte/kernels/router.py,
router_topk.py) choose on a GPU, where NaN scores make the torch reference differ (it sorts NaN
first) and so does Triton's interpreter (its max propagates NaN).

It models a GPU's float max: NaN is skipped unless every lane is NaN (then the max is NaN and no
lane equals it, so nothing is picked and the index is 2**31 - 1); among equal scores the lowest
expert index wins (-0.0 ties +0.0). Scores sit in the kernels' (rows, padded groups, padded
experts) tile, padded lanes -inf; a grouped selection first keeps the group_topk groups of the
largest sums of their topk / group_topk largest scores (added largest first, in fp32). Test
helper only (tests/test_moe_router_packed.py); not part of the package.
"""

from __future__ import annotations

import torch

_NO_LANE = 2**31 - 1  # the index the kernels write where no lane is left


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fmax(c: torch.Tensor, dim: int) -> torch.Tensor:
    """max along `dim` as a GPU's fmax reduction gives it: NaN skipped, NaN where all are."""
    nan = c.isnan()
    m = c.masked_fill(nan, float("-inf")).amax(dim)
    return torch.where(nan.all(dim), float("nan"), m)


def _model_tile(
    score: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' (T, BG, BS) tile of fp32 scores (T, E): (scores, -inf on padded lanes;
    valid lanes; expert index of each lane)."""
    t, e = score.shape
    g, gs = (groups, e // groups) if groups else (1, e)
    bg, bs = _pow2(g), _pow2(gs)
    tile = torch.full((t, bg, bs), float("-inf"))
    valid = torch.zeros(t, bg, bs, dtype=torch.bool)
    tile[:, :g, :gs] = score.reshape(t, g, gs)
    valid[:, :g, :gs] = True
    eidx = (torch.arange(bg)[:, None] * gs + torch.arange(bs)).expand(t, bg, bs)
    return tile, valid, eidx


def _model_pick(tile, avail, eidx):
    """One pick among the `avail` lanes of each row: (max score (T,), its lowest expert index
    (T,), the picked lane (T, BG, BS) bool)."""
    c = torch.where(avail, tile, float("-inf"))
    m = _fmax(c.flatten(1), 1)
    hit = avail & (c == m[:, None, None])
    first = torch.where(hit, eidx, _NO_LANE).flatten(1).amin(1)
    return m, first, avail & (eidx == first[:, None, None])


def _model_group_mask(tile, valid, eidx, groups, group_topk, per):
    """(T, BG, 1) bool: the group_topk groups of the largest sums of their `per` largest
    scores (lower group first among equal sums)."""
    t, bg, _ = tile.shape
    avail, total = valid.clone(), torch.zeros(t, bg)
    for _ in range(per):
        c = torch.where(avail, tile, float("-inf"))
        m = _fmax(c, 2)
        hit = avail & (c == m[..., None])
        first = torch.where(hit, eidx, _NO_LANE).amin(2)
        avail &= eidx != first[..., None]
        total = total + m  # fp32, largest first, as the kernels add
    gidx = torch.arange(bg).expand(t, bg)
    gavail, kept = gidx < groups, torch.zeros(t, bg, dtype=torch.bool)
    for _ in range(group_topk):
        c = torch.where(gavail, total, float("-inf"))
        m = _fmax(c, 1)
        hit = gavail & (c == m[:, None])
        chosen = gidx == torch.where(hit, gidx, _NO_LANE).amin(1)[:, None]
        kept |= chosen
        gavail &= ~chosen
    return kept[..., None]


def select_like_gpu(
    score: torch.Tensor, topk: int, groups: int = 0, group_topk: int = 0, qb: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' selection on a GPU, from fp32 selection scores (T, E): (indices
    (T, topk) int64, 2**31 - 1 where no lane was left; chosen (T, E) bool; QB cutoff (T,) fp32,
    empty unless qb). NaN is never picked; the torch reference (which sorts NaN first) differs
    there, and Triton's interpreter too (its max propagates NaN)."""
    t, e = score.shape
    tile, valid, eidx = _model_tile(score.float(), groups)
    if group_topk:
        kept = _model_group_mask(tile, valid, eidx, groups, group_topk, topk // group_topk)
        tile = torch.where(kept, tile, float("-inf"))
    avail, chosen, index = valid.clone(), torch.zeros_like(valid), []
    for _ in range(topk):
        _, first, hit = _model_pick(tile, avail, eidx)
        chosen |= hit
        avail &= ~hit
        index.append(first)
    cutoff = _model_pick(tile, avail, eidx)[0] if qb else torch.empty(0)
    g, gs = (groups, e // groups) if groups else (1, e)
    return torch.stack(index, 1), chosen[:, :g, :gs].reshape(t, e), cutoff
