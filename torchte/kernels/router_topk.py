"""The MoE router's selection on packed keys: each pick of a top-k is ONE max reduction.

A lane's key is an int64: the high 32 bits are its fp32 score mapped to an int32 whose signed
order is the float order, the low 32 bits are INDEX_BASE - index, so that among equal scores
the lowest index has the largest key. Keys of distinct lanes differ, the max key names the
pick (value and index decode from it), and "the next pick" is the max of the keys below the
last one. kernels/router.py selects with these helpers; the key packing runs alone in
`pack_keys` (for the tests).

The score -> int32 map takes the sign-magnitude bits to two's complement: x >= 0 keeps its bits,
x < 0 becomes -(bits & 0x7FFFFFFF). Order is kept for every non-NaN fp32 (denormals included),
-inf maps to -0x7F800000, and -0.0 and +0.0 both map to 0: they tie, and the lower index wins,
as they compare equal in the float max / `==` of the kernels before and in torch.sort. (Flipping
the magnitude bits of negatives instead would order -0.0 below +0.0.) Decoding gives back the
score, with +0.0 for either zero.

Lanes that cannot be picked get KEY_NONE: padded lanes, lanes already picked, and NaN scores.
KEY_NONE is the key of a -inf score with a low half of 0, below the key of every lane (a -inf
lane's low half is INDEX_BASE - index > 0), and it decodes to what the kernels before the packed
keys saw where no lane was left: the value -inf and the index INDEX_BASE = 2**31 - 1, the
sentinel they wrote. A NaN is never picked: on a GPU those kernels' max reduction skipped NaN
(fmax) and a NaN never equalled the max; where every lane of that reduction held a NaN, the
max was NaN, which the callers here restore (`group_sum`, the QB cutoff). The torch reference
sorts NaN first: NaN rows differ between CPU and CUDA, as they did.

Reduction count, per top-k pick and per step of the group-limited selection (a "reduction" is
one tl.max / tl.min / tl.sum call: a tree of shuffles and, across warps, shared memory):

                                        before (float max + index min)    packed key
    top-k pick, tile (BT, BG, BS)       4: max and min, each over axis    1: max over axis 1
                                           2 then axis 1                     of (BT, BG * BS)
    group score step (PER per call)     2: max and min over axis 2        1: max over axis 2
    group choice step (GK per call)     2: max and min over axis 1        1: max over axis 1

Group-limited top-8 of 64 experts in 8 groups, group_topk 4: 8 * 4 + 2 * 2 + 4 * 2 = 44
reductions before, 8 + 2 + 4 = 14 now (plus the softmax's, unchanged). An int64 combine or
shuffle is two 32-bit ones, so fewer reductions are not fewer instructions everywhere. SASS
instructions per thread, per loop step, for sm_90 (Triton 3.6 compiling offline, no timing; 64
rows x 64 experts, 8 warps, fp32 logits, E divisible by 16 as the launch specializes it):

                                        before    packed key
    top-k pick, no groups                 278        143
    top-k pick, 8 groups of 8             439        167
    group score step (8 groups of 8)      340        435     (the same 96 shuffles, in 64 bits)
    group choice step                     244        131
    one program, top-8, no groups        3149       2200    (every step of its loops)
    one program, top-8 of 8 groups,      6493       4432
      group_topk 4

The key tile of the picks is the (BT, BG, BS) tile reshaped to (BT, BG * BS) (the compiler
relabels the layout: no data moves). The scores themselves stay on the 3-D tile, whose compiled
layout is the one it had before, so the softmax's fp32 sums add in the same order. A 2-D load
tile with the group as eidx // GS would make the softmax's max and sum one reduction each, but
it would change that order, so the probs would no longer be bit-identical to the kernels
before; and a group's reduction needs the groups on an axis of their own, which a 2-D tile gets
back only by the same reshape when GS is a power of 2.
"""

from __future__ import annotations

import torch

from ._triton import FastLaunch, int_key, tl, triton, triton_available

__all__ = [
    "INDEX_BASE",
    "KEY_NONE",
    "key_index_reference",
    "key_value_reference",
    "pack_keys",
    "pack_keys_reference",
]

KEY_NONE = -(0x7F800000 << 32)  # the key of -inf at low half 0: below every lane's key
KEY_TOP = 2**63 - 1  # above every key: "the last pick" before the first
INDEX_BASE = 2**31 - 1  # low half = INDEX_BASE - index; KEY_NONE decodes to this index


if triton is not None:
    _KEY_NONE = tl.constexpr(KEY_NONE)
    _KEY_TOP = tl.constexpr(KEY_TOP)
    _INDEX_BASE = tl.constexpr(INDEX_BASE)

    @triton.jit
    def _pack_key(score, pickable, index):
        """int64 keys of fp32 `score` at int32 `index` (same shapes, broadcast); KEY_NONE where
        not `pickable` or NaN."""
        bits = score.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        ordered = tl.where(bits < 0, -magnitude, magnitude)  # -0.0 and +0.0: both 0
        # tensor first: under the interpreter, constexpr - tensor is no tensor
        low = -index + _INDEX_BASE
        key = (ordered.to(tl.int64) << 32) | low.to(tl.int64)
        return tl.where(pickable & (magnitude <= 0x7F800000), key, _KEY_NONE)

    @triton.jit
    def _key_value(key):
        """The fp32 score of a key (+0.0 for either zero; -inf for KEY_NONE)."""
        ordered = (key >> 32).to(tl.int32)
        bits = tl.where(ordered < 0, (0 - ordered) | -2147483648, ordered)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _key_index(key):
        """The int32 index of a key; INDEX_BASE for KEY_NONE (no lane left)."""
        return -key.to(tl.int32) + _INDEX_BASE

    @triton.jit
    def _next_key(keys, last, AXIS: tl.constexpr):
        """The next pick along AXIS: the largest key below `last` (keys with AXIS removed);
        KEY_NONE when none is left. One reduction."""
        below = keys < tl.expand_dims(last, AXIS)
        return tl.max(tl.where(below, keys, _KEY_NONE), axis=AXIS)

    @triton.jit
    def _chosen(keys, last, AXIS: tl.constexpr):
        """Whether each key was picked by the picks that ended at `last`: keys are distinct,
        so the picked ones are those >= last (every pickable one when last is KEY_NONE)."""
        return keys >= tl.expand_dims(tl.maximum(last, _KEY_NONE + 1), AXIS)

    @triton.jit
    def _group_mask(
        key, row_ok, G, GS, GK, PER,
        BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """(BT, BG, 1) mask of the experts in each row's GK best groups, from the keys
        (BT, BG, BS) of the selection scores: a group scores the sum of its PER largest scores,
        added largest first; among equal group scores the lower group wins. One reduction a
        step (PER over axis 2, then GK over axis 1)."""
        # A step that finds no lane adds -inf (KEY_NONE's value), as the float max did where an
        # earlier pick or a padded lane held -inf; a group of NaN only and no padded lane
        # summed NaN.
        last = tl.max(key, axis=2)
        group_sum = _key_value(last)  # = 0.0 + the value: decoding gives no -0.0
        all_nan = (last == _KEY_NONE) & (GS == BLOCK_S)
        for _ in range(1, PER):
            last = _next_key(key, last, 2)
            group_sum += _key_value(last)
        group_sum = tl.where(all_nan, float("nan"), group_sum)
        gidx = tl.arange(0, BLOCK_G)[None, :]
        group_key = _pack_key(group_sum, row_ok[:, None] & (gidx < G), gidx)
        group_last = tl.full((BLOCK_T,), _KEY_TOP, tl.int64)
        for _ in range(GK):
            group_last = _next_key(group_key, group_last, 1)
        return _chosen(group_key, group_last, 1)[:, :, None]

    @triton.jit
    def _pack_keys_kernel(
        score_ptr,  # (N,) fp32
        index_ptr,  # (N,) int32
        key_ptr,  # (N,) int64
        N, BLOCK: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = n < N
        score = tl.load(score_ptr + n, mask=ok, other=0.0)
        index = tl.load(index_ptr + n, mask=ok, other=0)
        tl.store(key_ptr + n, _pack_key(score, ok, index), mask=ok)

    _launch_pack_keys = FastLaunch(_pack_keys_kernel)


def pack_keys(score: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys (N,) of fp32 scores (N,) at int32 indices (N,) in [0, INDEX_BASE): the keys the
    router kernels pick by (KEY_NONE for NaN). Triton on CUDA, else pack_keys_reference. The
    index range is not checked (that would read the indices on the host)."""
    if score.dtype != torch.float32 or index.dtype != torch.int32:
        raise TypeError(f"score must be fp32 and index int32, got {score.dtype}, {index.dtype}")
    if score.dim() != 1 or score.shape != index.shape:
        shapes = f"{tuple(score.shape)}, {tuple(index.shape)}"
        raise ValueError(f"score and index must be 1-D of one shape, got {shapes}")
    if score.device != index.device:
        raise ValueError(
            f"score and index must be on one device, got {score.device}, {index.device}"
        )
    if score.is_cuda and triton_available():
        return _pack_keys_triton(score, index)
    return pack_keys_reference(score, index)


def _pack_keys_triton(score: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Launch _pack_keys_kernel (none for N = 0)."""
    score, index = score.contiguous(), index.contiguous()
    keys = torch.empty(score.shape, dtype=torch.int64, device=score.device)
    n = score.numel()
    if n:
        key = (int_key(n), *[p.data_ptr() & 15 for p in (score, index, keys)])
        _launch_pack_keys(key, (-(-n // 1024), 1, 1), 4, score, index, keys, n, 1024)
    return keys


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------


def pack_keys_reference(score: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Torch reference of pack_keys (any shapes that broadcast)."""
    bits = score.to(torch.float32).view(torch.int32).to(torch.int64)
    magnitude = bits & 0x7FFFFFFF
    ordered = torch.where(bits < 0, -magnitude, magnitude)
    key = (ordered << 32) | (INDEX_BASE - index.to(torch.int64))
    return torch.where(magnitude <= 0x7F800000, key, KEY_NONE)


def key_value_reference(key: torch.Tensor) -> torch.Tensor:
    """The fp32 scores of int64 keys (-inf for KEY_NONE)."""
    ordered = key >> 32
    bits = torch.where(ordered < 0, (-ordered) | -(2**31), ordered).to(torch.int32)
    return bits.view(torch.float32)


def key_index_reference(key: torch.Tensor) -> torch.Tensor:
    """The int32 indices of int64 keys (INDEX_BASE for KEY_NONE)."""
    return (INDEX_BASE - (key & 0xFFFFFFFF)).to(torch.int32)
