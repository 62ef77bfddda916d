"""MoE router fusions: top-k with a score function, and the scores of the auxiliary loss.

Shapes: logits (T, E), contiguous, fp32 / bf16 / fp16 (the launchers take any leading dims and
flatten them into T). Everything is computed in fp32 (in fp64 for fp64 input, which only the
references take: the tests' gradcheck). Definitions follow Transformer Engine's fused router:

  score functions   sigmoid(x) = 1 / (1 + exp(-x));  sqrtsoftplus(x) = sqrt(softplus(x)) with
                    softplus(x) = x for x > 20, else log1p(exp(x));  softmax over the row.
  top-k             the k largest selection scores of a row; among equal scores the lower
                    expert index wins (the order of torch.sort(stable=True, descending=True)).
  softmax           pre-softmax: probs = softmax(x) at the chosen experts (chosen on it);
                    post-softmax: chosen on x, probs = softmax of the k chosen logits.
  sigmoid /         chosen on y + expert_bias (y the score); probs = v / (sum of the k v + 1e-20)
  sqrtsoftplus      when k > 1, else v, where v = (y + bias) - bias as the fused kernel forms
                    it (y itself when there is no bias).
  grouped top-k     experts in num_groups equal groups; a group's score is the sum of its
                    topk / group_topk largest selection scores (added largest first); the
                    group_topk best groups are kept, the others' experts score -inf; then top-k.
  scaling_factor    probs *= scaling_factor (in fp32, before the cast to the logits' dtype).
  quantile balancing (QB, sigmoid with a bias, no groups): the top-(k+1) set is chosen; its
  last member (the smallest score, the highest index among equal ones) is dropped and its score
  is the token's cutoff, from which router_maps.qb_histogram_accumulate counts bins.
  aux-loss scores   softmax(x), or y / (sum of the row's y + 1e-20) for sigmoid /
                    sqrtsoftplus; routing map = top-k of these scores.

The routing output is a bool map (T, E), a bit map uint8 (T, ceil(E / 8)) with bit e % 8 of
byte e // 8 set for expert e, or dense indices (T, k) in the caller's buffer, in selection
order (largest score first). `intermediate` (T, E) fp32 is what the backward reads: the
sigmoid, the raw logits (sqrtsoftplus), or the softmax output (-inf off the chosen experts
after post-softmax).

On CUDA with Triton one kernel runs per call (the bit map is packed with torch ops after it);
elsewhere the torch reference (router_reference.py), the same function in torch ops. The
kernels select on packed int64 keys, one max reduction a pick (router_topk.py); there a NaN
score is never chosen (a row short of non-NaN scores gets index 2**31 - 1 cast to the index
dtype), where the reference sorts NaN first.
"""

from __future__ import annotations

import torch

from ._triton import FastLaunch, int_key, tl, triton, triton_available
from .router_maps import pack_bitmap
from .router_reference import (
    BITMAP_U8,
    SCORE_FUNCTIONS,
    RouterSpec,
    aux_scores_backward_reference,
    aux_scores_forward_reference,
    aux_spec,
    topk_backward_reference,
    topk_forward_reference,
)

__all__ = [
    "SCORE_FUNCTIONS",
    "RouterSpec",
    "aux_scores_backward",
    "aux_scores_backward_reference",
    "aux_scores_forward",
    "aux_scores_forward_reference",
    "topk_backward",
    "topk_backward_reference",
    "topk_forward",
    "topk_forward_reference",
]

# Elements of one program's tile (rows x padded experts). Not yet tuned on a GPU.
TILE = 4096


if triton is not None:
    from .router_topk import (
        _KEY_NONE,
        _KEY_TOP,
        _chosen,
        _group_mask,
        _key_index,
        _key_value,
        _next_key,
        _pack_key,
    )

    @triton.jit
    def _score(x, SCORE: tl.constexpr):
        """sigmoid (SCORE 0) or sqrtsoftplus (2) of fp32 x. log1p(e) is log(1 + e) e / ((1 + e)
        - 1), exact to a few ulp where 1 + e rounds (e tiny)."""
        if SCORE == 0:
            y = 1.0 / (1.0 + tl.exp(-x))
        else:
            e = tl.exp(x)
            u = 1.0 + e
            log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
            y = tl.sqrt_rn(tl.where(x > 20.0, x, log1p))
        return y

    @triton.jit
    def _softmax(x, valid):
        """Softmax over axes 1 and 2 of the valid entries of a 3-D fp32 x (0 elsewhere)."""
        m = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=2), axis=1)
        e = tl.where(valid, tl.exp(x - m[:, None, None]), 0.0)
        total = tl.sum(tl.sum(e, axis=2), axis=1)
        total = tl.where(total > 0.0, total, 1.0)  # rows past T: no 0 * inf
        return e * (1.0 / total)[:, None, None]

    @triton.jit
    def _topk_forward_kernel(
        logits_ptr,  # (T, E) fp32 / bf16 / fp16, contiguous
        bias_ptr,  # (E,) fp32; read when HAS_BIAS
        probs_ptr,  # (T, E) the logits' dtype
        map_ptr,  # (T, E) uint8 (a bool map's bytes); written when WRITE_MAP
        index_ptr,  # (T, K) int16 / int32 / int64; written when WRITE_INDEX
        inter_ptr,  # (T, E) fp32: what the backward reads
        cutoff_ptr,  # (T,) fp32; written when QB
        T, E, K, G, GS, GK, PER, scaling,
        SCORE: tl.constexpr, PRE_SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
        GROUPED: tl.constexpr, WRITE_MAP: tl.constexpr, WRITE_INDEX: tl.constexpr,
        QB: tl.constexpr, NORMALIZE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        # The tile is (rows, groups, experts of a group); (rows, 1, experts) without groups.
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        g = tl.arange(0, BLOCK_G)[None, :, None]
        s = tl.arange(0, BLOCK_S)[None, None, :]
        eidx = g * GS + s
        row_ok = t < T
        valid = row_ok[:, None, None] & (g < G) & (s < GS)
        offs = t.to(tl.int64)[:, None, None] * E + eidx
        x = tl.load(logits_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        if SCORE == 1:
            if PRE_SOFTMAX:
                y = _softmax(x, valid)
                inter = y
                score = y
            else:
                score = x
        else:
            y = _score(x, SCORE)
            inter = y if SCORE == 0 else x
            score = y
            if HAS_BIAS:
                bias = tl.load(bias_ptr + eidx, mask=eidx < E, other=0.0)
                score = y + bias
        key = _pack_key(score, valid, eidx)
        if GROUPED:
            kept = _group_mask(key, row_ok, G, GS, GK, PER, BLOCK_T, BLOCK_G, BLOCK_S)
            # the other groups' experts score -inf: still picked, after every kept one
            key = _pack_key(tl.where(kept, score, float("-inf")), valid, eidx)
        # one reduction a pick (router_topk.py); `last` is the key of the latest pick
        keys = tl.reshape(key, (BLOCK_T, BLOCK_G * BLOCK_S))
        last = tl.full((BLOCK_T,), _KEY_TOP, tl.int64)
        any_pick = row_ok & (t < 0)
        for k in range(K):
            last = _next_key(keys, last, 1)
            if QB:
                any_pick = any_pick | (last != _KEY_NONE)
            if WRITE_INDEX:
                index = _key_index(last).to(index_ptr.dtype.element_ty)
                tl.store(index_ptr + t.to(tl.int64) * K + k, index, mask=row_ok)
        chosen = _chosen(key, last[:, None], 2)
        if QB:
            # the top-(k+1)-th score; NaN where the row has NaN only and no padded lane (QB has
            # no groups), as the float max gave (router_topk.py)
            cutoff = _key_value(_next_key(keys, last, 1))
            all_nan = ~any_pick & (E == BLOCK_S)
            tl.store(cutoff_ptr + t, tl.where(all_nan, float("nan"), cutoff), mask=row_ok)
        if SCORE == 1:
            if PRE_SOFTMAX:
                p = y
            else:
                p = _softmax(x, chosen)
                inter = tl.where(chosen, p, float("-inf"))
        else:
            p = score - bias if HAS_BIAS else y
            if NORMALIZE:
                total = tl.sum(tl.sum(tl.where(chosen, p, 0.0), axis=2), axis=1)
                p = p / (total + 1e-20)[:, None, None]
        probs = tl.where(chosen, scaling * p, 0.0)
        tl.store(probs_ptr + offs, probs.to(probs_ptr.dtype.element_ty), mask=valid)
        tl.store(inter_ptr + offs, inter, mask=valid)
        if WRITE_MAP:
            tl.store(map_ptr + offs, chosen.to(tl.uint8), mask=valid)

    @triton.jit
    def _aux_scores_kernel(
        logits_ptr,  # (T, E) fp32 / bf16 / fp16, contiguous
        scores_ptr,  # (T, E) fp32
        map_ptr,  # (T, E) uint8 (a bool map's bytes)
        inter_ptr,  # (T, E) fp32: what the backward reads
        T, E, K,
        SCORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        eidx = tl.arange(0, BLOCK_E)[None, None, :]
        valid = (t < T)[:, None, None] & (eidx < E)
        offs = t.to(tl.int64)[:, None, None] * E + eidx
        x = tl.load(logits_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        if SCORE == 1:
            score = _softmax(x, valid)
            inter = score
        else:
            y = tl.where(valid, _score(x, SCORE), 0.0)
            inter = y if SCORE == 0 else x
            total = tl.sum(tl.sum(y, axis=2), axis=1)
            score = y / (total + 1e-20)[:, None, None]
        key = _pack_key(score, valid, eidx)
        keys = tl.reshape(key, (BLOCK_T, BLOCK_E))
        last = tl.full((BLOCK_T,), _KEY_TOP, tl.int64)
        for _ in range(K):
            last = _next_key(keys, last, 1)
        tl.store(scores_ptr + offs, score, mask=valid)
        tl.store(inter_ptr + offs, inter, mask=valid)
        tl.store(map_ptr + offs, _chosen(key, last[:, None], 2).to(tl.uint8), mask=valid)

    @triton.jit
    def _backward_kernel(
        map_ptr,  # (T, E) uint8 routing map; read when HAS_MAP (else every expert counts)
        inter_ptr,  # (T, E) fp32, the forward's intermediate
        grad_ptr,  # (T, E) fp32 / bf16 / fp16: d loss / d probs (or scores)
        out_ptr,  # (T, E) d loss / d logits, the logits' dtype
        T, E, scaling,
        SCORE: tl.constexpr, PRE_SOFTMAX: tl.constexpr, HAS_MAP: tl.constexpr,
        NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.arange(0, BLOCK_E)[None, :]
        valid = (t < T)[:, None] & (e < E)
        offs = t.to(tl.int64)[:, None] * E + e
        g = tl.load(grad_ptr + offs, mask=valid, other=0.0).to(tl.float32) * scaling
        act = tl.load(inter_ptr + offs, mask=valid, other=0.0)
        routed = valid
        if HAS_MAP:
            routed = valid & (tl.load(map_ptr + offs, mask=valid, other=0) != 0)
        if SCORE == 1:
            if PRE_SOFTMAX:
                g = tl.where(routed, g, 0.0)
                dot = tl.sum(g * act, axis=1)
                g = act * (g - dot[:, None])
            else:
                a = tl.where(routed, act, 0.0)
                dot = tl.sum(tl.where(routed, g * a, 0.0), axis=1)
                g = tl.where(routed, a * (g - dot[:, None]), 0.0)
        else:
            v = act if SCORE == 0 else _score(act, SCORE)
            if NORMALIZE:
                total = tl.sum(tl.where(routed, v, 0.0), axis=1)
                dot = tl.sum(tl.where(routed, g * v, 0.0), axis=1)
                d = (total + 1e-20)[:, None]
                g = tl.where(routed, g / d - dot[:, None] / (d * d), 0.0)
            else:
                g = tl.where(routed, g, 0.0)
            if SCORE == 0:
                g = g * act * (1.0 - act)
            else:
                slope = tl.where(act > 20.0, 1.0, 1.0 / (1.0 + tl.exp(-act)))
                g = g * (slope / (2.0 * v + 1e-20))
        tl.store(out_ptr + offs, g.to(out_ptr.dtype.element_ty), mask=valid)

    _launch_topk = FastLaunch(_topk_forward_kernel)
    _launch_aux_scores = FastLaunch(_aux_scores_kernel)
    _launch_backward = FastLaunch(_backward_kernel)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------


def topk_forward(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    spec: RouterSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of logits (..., E): (probs (..., E) in the logits' dtype, routing output,
    intermediate (..., E) fp32, cutoff (...) fp32 under QB else an empty tensor).

    The routing output is a bool map (..., E), a bit map uint8 (..., ceil(E / 8)), or, with
    spec.dense_indices, `topk_indices` (..., topk) filled in. expert_bias: (E,) fp32 or None.
    Arguments are taken as checked (torchte.moe.router checks them).
    """
    if logits.is_cuda and triton_available():
        return _topk_forward_triton(logits, expert_bias, topk_indices, spec)
    return topk_forward_reference(logits, expert_bias, topk_indices, spec)


def topk_backward(
    routing_mask: torch.Tensor,
    intermediate: torch.Tensor,
    grad_probs: torch.Tensor,
    spec: RouterSpec,
    dtype: torch.dtype,
) -> torch.Tensor:
    """d loss / d logits (..., E) in `dtype`, from the bool routing mask (..., E) (see
    router_maps.routing_to_mask), topk_forward's intermediate and d loss / d probs (..., E)."""
    if grad_probs.is_cuda and triton_available():
        return _backward_triton(routing_mask, intermediate, grad_probs, spec, dtype)
    return topk_backward_reference(routing_mask, intermediate, grad_probs, spec, dtype)


def aux_scores_forward(
    logits: torch.Tensor, topk: int, score_function: str, routing_map_format: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores of the auxiliary loss: (scores (..., E) fp32, routing map (bool (..., E) or bit
    map), intermediate (..., E) fp32)."""
    if logits.is_cuda and triton_available():
        return _aux_scores_triton(logits, topk, score_function, routing_map_format)
    return aux_scores_forward_reference(logits, topk, score_function, routing_map_format)


def aux_scores_backward(
    intermediate: torch.Tensor, grad_scores: torch.Tensor, score_function: str, dtype: torch.dtype
) -> torch.Tensor:
    """d loss / d logits (..., E) in `dtype` from d loss / d scores (..., E)."""
    if grad_scores.is_cuda and triton_available():
        spec = aux_spec(score_function)
        return _backward_triton(None, intermediate, grad_scores, spec, dtype)
    return aux_scores_backward_reference(intermediate, grad_scores, score_function, dtype)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _rows_per_program(rows: int, width: int, tile: int) -> int:
    return max(1, min(tile // width, _pow2(rows)))


def _topk_forward_triton(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    spec: RouterSpec,
    tile: int = TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch _topk_forward_kernel (none for zero tokens); `tile` caps rows x padded experts."""
    x = logits.contiguous()
    shape, e = x.shape, x.shape[-1]
    t = x.numel() // e
    probs = torch.empty_like(x)
    inter = torch.empty(shape, dtype=torch.float32, device=x.device)
    cutoff = torch.empty(shape[:-1] if spec.qb else (0,), dtype=torch.float32, device=x.device)
    byte_map = None if spec.dense_indices else torch.empty(shape, dtype=torch.bool, device=x.device)
    if t > 0:
        g, gs = (spec.num_groups, e // spec.num_groups) if spec.grouped else (1, e)
        per = spec.topk // spec.group_topk if spec.grouped else 0
        block_g, block_s = _pow2(g), _pow2(gs)
        block_t = _rows_per_program(t, block_g * block_s, tile)
        bias = inter if expert_bias is None else expert_bias
        index = inter if topk_indices is None else topk_indices
        map_u8 = inter if byte_map is None else byte_map.view(torch.uint8)
        cut = cutoff if spec.qb else inter
        flags = (
            spec.score_id, spec.pre_softmax, expert_bias is not None, spec.grouped,
            byte_map is not None, topk_indices is not None, spec.qb,
            spec.score_function != "softmax" and spec.topk > 1,
        )  # fmt: skip
        ints = (t, e, spec.topk, g, gs, spec.group_topk, per)
        num_warps = 4 if block_t * block_g * block_s <= 2048 else 8
        key = (
            x.dtype, index.dtype, *flags, block_t, block_g, block_s, num_warps,
            *[int_key(v) for v in ints],
            *[p.data_ptr() & 15 for p in (x, bias, probs, map_u8, index, inter, cut)],
        )  # fmt: skip
        _launch_topk(
            key, (-(-t // block_t), 1, 1), num_warps, x, bias, probs, map_u8, index, inter, cut,
            *ints, float(spec.scaling_factor), *flags, block_t, block_g, block_s,
        )  # fmt: skip
    return probs, _routing_output(byte_map, topk_indices, spec), inter, cutoff


def _routing_output(
    byte_map: torch.Tensor | None, topk_indices: torch.Tensor | None, spec: RouterSpec
) -> torch.Tensor:
    if spec.dense_indices:
        return topk_indices
    if spec.routing_map_format == BITMAP_U8:
        return pack_bitmap(byte_map)
    return byte_map


def _aux_scores_triton(
    logits: torch.Tensor, topk: int, score_function: str, routing_map_format: int, tile: int = TILE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch _aux_scores_kernel (none for zero tokens)."""
    x = logits.contiguous()
    shape, e = x.shape, x.shape[-1]
    t = x.numel() // e
    scores = torch.empty(shape, dtype=torch.float32, device=x.device)
    inter = torch.empty_like(scores)
    byte_map = torch.empty(shape, dtype=torch.bool, device=x.device)
    if t > 0:
        block_e = _pow2(e)
        block_t = _rows_per_program(t, block_e, tile)
        num_warps = 4 if block_t * block_e <= 2048 else 8
        score_id, map_u8 = SCORE_FUNCTIONS[score_function], byte_map.view(torch.uint8)
        key = (
            x.dtype, score_id, block_t, block_e, num_warps, int_key(t), int_key(e),
            int_key(topk), *[p.data_ptr() & 15 for p in (x, scores, map_u8, inter)],
        )  # fmt: skip
        _launch_aux_scores(
            key, (-(-t // block_t), 1, 1), num_warps, x, scores, map_u8, inter, t, e, topk,
            score_id, block_t, block_e,
        )  # fmt: skip
    routing = pack_bitmap(byte_map) if routing_map_format == BITMAP_U8 else byte_map
    return scores, routing, inter


def _backward_triton(
    routing_mask: torch.Tensor | None,
    intermediate: torch.Tensor,
    grad: torch.Tensor,
    spec: RouterSpec,
    dtype: torch.dtype,
    tile: int = TILE,
) -> torch.Tensor:
    """Launch _backward_kernel; routing_mask None: every expert is routed (aux-loss scores)."""
    grad = grad.contiguous()
    e = grad.shape[-1]
    t = grad.numel() // e
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    if t == 0:
        return out
    block_e = _pow2(e)
    block_t = _rows_per_program(t, block_e, tile)
    num_warps = 4 if block_t * block_e <= 2048 else 8
    map_u8 = intermediate if routing_mask is None else routing_mask.view(torch.uint8)
    has_map = routing_mask is not None
    normalize = spec.score_function != "softmax" and (spec.topk > 1 or not has_map)
    flags = (spec.score_id, spec.pre_softmax or not has_map, has_map, normalize)
    scaling = float(spec.scaling_factor) if has_map else 1.0
    key = (
        grad.dtype, dtype, *flags, block_t, block_e, num_warps, int_key(t), int_key(e),
        *[p.data_ptr() & 15 for p in (map_u8, intermediate, grad, out)],
    )  # fmt: skip
    _launch_backward(
        key, (-(-t // block_t), 1, 1), num_warps, map_u8, intermediate, grad, out, t, e,
        scaling, *flags, block_t, block_e,
    )  # fmt: skip
    return out
