"""The torch references of the MoE router fusions (kernels/router.py runs them on the CPU and
the tests hold the Triton kernels to them), with what both files share: the score-function
numbering and the RouterSpec of one call. Definitions: kernels/router.py's module doc."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .router_maps import pack_bitmap

__all__ = [
    "BITMAP_U8",
    "BYTEMAP",
    "EPSILON",
    "SCORE_FUNCTIONS",
    "SOFTPLUS_THRESHOLD",
    "RouterSpec",
    "aux_scores_backward_reference",
    "aux_scores_forward_reference",
    "aux_spec",
    "topk_backward_reference",
    "topk_forward_reference",
]

# Transformer Engine's numbering of the score functions (its kernels' `score_function`).
SCORE_FUNCTIONS: dict[str, int] = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}
BYTEMAP, BITMAP_U8 = 0, 1
EPSILON = 1e-20
SOFTPLUS_THRESHOLD = 20.0


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """What a top-k routing call computes, besides its tensors.

    topk: experts per token; score_function: "sigmoid", "softmax" or "sqrtsoftplus";
    use_pre_softmax: softmax before the top-k (softmax only); num_groups / group_topk: grouped
    top-k when group_topk > 0; scaling_factor: probs multiplier; routing_map_format: 0 bool map,
    1 bit map; dense_indices: the routing output is the (T, topk) index buffer; qb: quantile
    balancing (top-(k+1), cutoff per token).
    """

    topk: int
    score_function: str
    use_pre_softmax: bool = False
    num_groups: int = 0
    group_topk: int = 0
    scaling_factor: float = 1.0
    routing_map_format: int = BYTEMAP
    dense_indices: bool = False
    qb: bool = False

    def __post_init__(self) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            known = ", ".join(SCORE_FUNCTIONS)
            raise ValueError(f"score_function must be one of {known}; got {self.score_function!r}")
        if self.topk < 1:
            raise ValueError(f"topk must be at least 1, got {self.topk}")
        if self.group_topk > 0:
            if self.num_groups < 1:
                raise ValueError("num_groups must be a positive int when group_topk > 0")
            if self.topk % self.group_topk:
                raise ValueError(f"topk ({self.topk}) must be divisible by group_topk")
            if self.group_topk > self.num_groups:
                raise ValueError(f"group_topk ({self.group_topk}) must be <= num_groups")
        if self.routing_map_format not in (BYTEMAP, BITMAP_U8):
            raise ValueError(f"routing_map_format must be 0 or 1, got {self.routing_map_format}")

    @property
    def score_id(self) -> int:
        return SCORE_FUNCTIONS[self.score_function]

    @property
    def pre_softmax(self) -> bool:
        """Softmax before the top-k: only with softmax (ignored for the others, as in TE)."""
        return self.use_pre_softmax and self.score_function == "softmax"

    @property
    def grouped(self) -> bool:
        return self.group_topk > 0

    @property
    def routing_layout(self) -> str:
        """The routing output's layout, as router_maps.routing_to_mask takes it."""
        if self.dense_indices:
            return "indices"
        return "bitmap_u8" if self.routing_map_format == BITMAP_U8 else "bytemap"


def aux_spec(score_function: str) -> RouterSpec:
    """The backward of the aux-loss scores is the top-k backward with every expert routed,
    softmax as pre-softmax, sigmoid / sqrtsoftplus always normalized."""
    return RouterSpec(topk=2, score_function=score_function, use_pre_softmax=True)


# ----------------------------------------------------------------------------------------------
# Torch reference: the same functions, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _score_reference(x: torch.Tensor, score_function: str) -> torch.Tensor:
    """sigmoid or sqrtsoftplus of x in the formulas of the kernels."""
    if score_function == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-x))
    return torch.sqrt(torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x))))


def _softmax_reference(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of x (of its `mask`ed entries; 0 elsewhere)."""
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e * (1.0 / e.sum(-1, keepdim=True))


def _select_reference(score: torch.Tensor, k: int) -> torch.Tensor:
    """(T, k) int64 indices of each row's k largest scores, largest first, lower index first
    among equal ones."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]


def _group_mask_reference(score: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """(T, E) bool: the experts of each row's group_topk best groups."""
    t, e = score.shape
    groups, per = spec.num_groups, spec.topk // spec.group_topk
    top = torch.sort(score.view(t, groups, e // groups), dim=-1, descending=True).values
    group_sum = torch.zeros(t, groups, dtype=score.dtype, device=score.device)
    for j in range(per):  # largest first, as the kernels add them
        group_sum = group_sum + top[..., j]
    best = _select_reference(group_sum, spec.group_topk)
    kept = torch.zeros(t, groups, dtype=torch.bool, device=score.device).scatter_(1, best, True)
    return kept.repeat_interleave(e // groups, dim=1)


def topk_forward_reference(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    spec: RouterSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of topk_forward (same outputs)."""
    shape, e = logits.shape, logits.shape[-1]
    x = logits.reshape(-1, e).to(_compute_dtype(logits))
    bias = None if expert_bias is None else expert_bias.to(x.dtype)
    if spec.score_function == "softmax":
        y = _softmax_reference(x) if spec.pre_softmax else x
        score = inter = y
    else:
        y = _score_reference(x, spec.score_function)
        inter = y if spec.score_function == "sigmoid" else x
        score = y if bias is None else y + bias
    pick_from = score
    if spec.grouped:
        pick_from = score.masked_fill(~_group_mask_reference(score, spec), float("-inf"))
    order = _select_reference(pick_from, spec.topk + spec.qb)
    index = order[:, : spec.topk]
    chosen = torch.zeros_like(x, dtype=torch.bool).scatter_(1, index, True)
    if spec.score_function == "softmax":
        p = y
        if not spec.pre_softmax:
            p = _softmax_reference(x, chosen)
            inter = p.masked_fill(~chosen, float("-inf"))
    else:
        p = y if bias is None else score - bias
        if spec.topk > 1:
            p = p / (p.masked_fill(~chosen, 0.0).sum(-1, keepdim=True) + EPSILON)
    probs = torch.where(chosen, spec.scaling_factor * p, 0.0).to(logits.dtype).reshape(shape)
    cutoff = torch.empty(0, dtype=torch.float32, device=x.device)
    if spec.qb:
        cutoff = pick_from.gather(1, order[:, spec.topk :]).reshape(shape[:-1])
    if spec.dense_indices:
        routing = topk_indices.copy_(index.reshape(topk_indices.shape))
    elif spec.routing_map_format == BITMAP_U8:
        routing = pack_bitmap(chosen).reshape(*shape[:-1], -(-e // 8))
    else:
        routing = chosen.reshape(shape)
    return probs, routing, inter.reshape(shape), cutoff


def aux_scores_forward_reference(
    logits: torch.Tensor, topk: int, score_function: str, routing_map_format: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of aux_scores_forward (same outputs)."""
    shape, e = logits.shape, logits.shape[-1]
    x = logits.reshape(-1, e).to(_compute_dtype(logits))
    if score_function == "softmax":
        scores = inter = _softmax_reference(x)
    else:
        y = _score_reference(x, score_function)
        inter = y if score_function == "sigmoid" else x
        scores = y / (y.sum(-1, keepdim=True) + EPSILON)
    index = _select_reference(scores, topk)
    chosen = torch.zeros_like(x, dtype=torch.bool).scatter_(1, index, True)
    routing = pack_bitmap(chosen) if routing_map_format == BITMAP_U8 else chosen
    routing = routing.reshape(*shape[:-1], routing.shape[-1])
    return scores.reshape(shape), routing, inter.reshape(shape)


def _backward_math(
    routed: torch.Tensor, act: torch.Tensor, g: torch.Tensor, spec: RouterSpec, normalize: bool
) -> torch.Tensor:
    """d loss / d logits from g = d loss / d probs (times the scaling factor), all (T, E)."""
    if spec.score_function == "softmax":
        if spec.pre_softmax:
            g = torch.where(routed, g, 0.0)
            return act * (g - (g * act).sum(-1, keepdim=True))
        a = torch.where(routed, act, 0.0)
        dot = torch.where(routed, g * a, 0.0).sum(-1, keepdim=True)
        return torch.where(routed, a * (g - dot), 0.0)
    v = act if spec.score_function == "sigmoid" else _score_reference(act, "sqrtsoftplus")
    if normalize:
        d = torch.where(routed, v, 0.0).sum(-1, keepdim=True) + EPSILON
        dot = torch.where(routed, g * v, 0.0).sum(-1, keepdim=True)
        g = torch.where(routed, g / d - dot / (d * d), 0.0)
    else:
        g = torch.where(routed, g, 0.0)
    if spec.score_function == "sigmoid":
        return g * act * (1.0 - act)
    slope = torch.where(act > SOFTPLUS_THRESHOLD, 1.0, 1.0 / (1.0 + torch.exp(-act)))
    return g * (slope / (2.0 * v + EPSILON))


def topk_backward_reference(
    routing_mask: torch.Tensor,
    intermediate: torch.Tensor,
    grad_probs: torch.Tensor,
    spec: RouterSpec,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference of topk_backward."""
    e = grad_probs.shape[-1]
    act = intermediate.reshape(-1, e)
    g = grad_probs.reshape(-1, e).to(act.dtype) * spec.scaling_factor
    routed = routing_mask.reshape(-1, e)
    normalize = spec.score_function != "softmax" and spec.topk > 1
    return _backward_math(routed, act, g, spec, normalize).to(dtype).reshape(grad_probs.shape)


def aux_scores_backward_reference(
    intermediate: torch.Tensor, grad_scores: torch.Tensor, score_function: str, dtype: torch.dtype
) -> torch.Tensor:
    """Torch reference of aux_scores_backward."""
    e = grad_scores.shape[-1]
    act = intermediate.reshape(-1, e)
    g = grad_scores.reshape(-1, e).to(act.dtype)
    routed = torch.ones_like(act, dtype=torch.bool)
    out = _backward_math(routed, act, g, aux_spec(score_function), True)
    return out.to(dtype).reshape(grad_scores.shape)
