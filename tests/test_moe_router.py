"""MoE router fusions (torchte.moe.router, Transformer Engine's `router` module): the public
functions on the CPU (the torch references) against a float64 derivation of Transformer Engine's
math written from its definition (torch.topk, softmax, gather, autograd), gradcheck of the
autograd Functions in float64, the Triton kernels against the references under Triton's CPU
interpreter, and CUDA against the CPU on the GPU.

Ties (documented behaviour): among equal selection scores the lower expert index is chosen, and
among equal group scores the lower group (torch.sort(stable=True) order). Transformer Engine's
radix kernels (topk >= 16) choose the same; its kernels for smaller topk pick a tied expert by
warp-lane order, which is not always the lowest. Logits elsewhere are drawn without ties.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close

from torchte.kernels import router as kernels
from torchte.moe import (
    QBHistogramMode,
    RoutingMapFormat,
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)
from torchte.moe import router as moe_router

SCORES = ["softmax", "sigmoid", "sqrtsoftplus"]
# (topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, with bias)
OPTIONS = [
    (3, False, None, None, None, "softmax", False),
    (3, True, None, None, 2.5, "softmax", False),
    (4, True, 4, 2, None, "softmax", False),
    (4, False, 4, 2, 1.5, "softmax", False),
    (1, False, None, None, None, "sigmoid", False),
    (3, False, None, None, 2.5, "sigmoid", True),
    (4, False, 4, 2, None, "sigmoid", True),
    (1, True, None, None, None, "sqrtsoftplus", True),  # use_pre_softmax: ignored
    (3, False, 8, 3, 1.5, "sqrtsoftplus", False),
    (4, False, 4, 2, None, "sqrtsoftplus", True),
]


def distinct_logits(t: int, e: int, dtype: torch.dtype, step: float = 0.125) -> torch.Tensor:
    """Rows of e distinct values (k - e/2) * step, exact in bf16 / fp16 for e <= 64."""
    perm = torch.argsort(torch.rand(t, e), dim=-1).float()
    return ((perm - e // 2) * step).to(dtype)


def bias_for(e: int) -> torch.Tensor:
    return torch.randn(e) * 0.25


# ----------------------------------------------------------------------------------------------
# Transformer Engine's math in float64, written from its definition
# ----------------------------------------------------------------------------------------------


def derived_topk(logits, topk, pre, num_groups, group_topk, scaling, score, bias):
    """(probs, routing map) in float64: selection on the scores (+ bias), probs at the chosen
    experts; differentiable in logits."""
    x = logits.double()
    if score == "softmax":
        scores = torch.softmax(x, -1) if pre else x
        choose_on = scores
    else:
        scores = torch.sigmoid(x) if score == "sigmoid" else F.softplus(x).sqrt()
        choose_on = scores if bias is None else scores + bias.double()
    if group_topk:
        t, e = x.shape
        per = topk // group_topk
        grouped = choose_on.detach().view(t, num_groups, e // num_groups)
        group_scores = grouped.topk(per, dim=-1).values.sum(-1)
        best = group_scores.topk(group_topk, dim=-1).indices
        kept = torch.zeros(t, num_groups, dtype=torch.bool).scatter(1, best, True)
        kept = kept.repeat_interleave(e // num_groups, dim=1)
        choose_on = choose_on.masked_fill(~kept, float("-inf"))
    index = choose_on.detach().topk(topk, dim=-1).indices
    if score == "softmax":
        chosen = scores.gather(1, index) if pre else torch.softmax(x.gather(1, index), -1)
    else:
        chosen = scores.gather(1, index)
        if topk > 1:
            chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
    if scaling is not None:
        chosen = chosen * scaling
    probs = torch.zeros_like(x).scatter(1, index, chosen)
    routing = torch.zeros_like(x, dtype=torch.bool).scatter(1, index, True)
    return probs, routing


def derived_aux_scores(logits, topk, score):
    x = logits.double()
    if score == "softmax":
        scores = torch.softmax(x, -1)
    else:
        y = torch.sigmoid(x) if score == "sigmoid" else F.softplus(x).sqrt()
        scores = y / (y.sum(-1, keepdim=True) + 1e-20)
    index = scores.detach().topk(topk, dim=-1).indices
    return torch.zeros_like(x, dtype=torch.bool).scatter(1, index, True), scores


def call(logits, option, **extra):
    """fused_topk_with_score_function with the keywords Megatron-Core's
    topk_routing_with_score_function passes (and TE's newer ones in `extra`)."""
    topk, pre, groups, group_topk, scaling, score, with_bias = option
    bias = extra.pop("bias", bias_for(logits.shape[-1]) if with_bias else None)
    return fused_topk_with_score_function(
        logits=logits,
        topk=topk,
        use_pre_softmax=pre,
        num_groups=groups,
        group_topk=group_topk,
        scaling_factor=scaling,
        score_function=score,
        expert_bias=bias,
        **extra,
    ), bias


# ----------------------------------------------------------------------------------------------
# The public functions (CPU: the references) against the derivation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", OPTIONS, ids=str)
@pytest.mark.parametrize("shape", [(37, 16), (5, 64)])
def test_topk_forward_and_backward_match_float64_derivation(option, shape):
    logits = torch.randn(*shape).requires_grad_()
    (probs, routing), bias = call(logits, option)
    x64 = logits.detach().double().requires_grad_()
    want_probs, want_routing = derived_topk(x64, *option[:6], bias)
    assert probs.dtype == torch.float32 and routing.dtype == torch.bool
    assert torch.equal(routing, want_routing)
    assert_close(probs, want_probs, torch.float32)
    weights = torch.randn(shape)
    (probs * weights).sum().backward()
    (want_probs * weights.double()).sum().backward()
    assert_close(logits.grad, x64.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score", SCORES)
def test_topk_low_precision_logits(dtype, score):
    logits = distinct_logits(37, 13, dtype).requires_grad_()
    option = (3, False, None, None, 1.5, score, score != "softmax")
    (probs, routing), bias = call(logits, option)
    want_probs, want_routing = derived_topk(logits.detach(), *option[:6], bias)
    assert probs.dtype == dtype and torch.equal(routing, want_routing)
    assert_close(probs, want_probs, dtype)
    probs.float().sum().backward()
    assert logits.grad.dtype == dtype


@pytest.mark.parametrize("score", SCORES)
def test_aux_scores_and_loss_match_float64_derivation(score):
    logits = torch.randn(37, 13).requires_grad_()
    routing, scores = fused_compute_score_for_moe_aux_loss(
        logits=logits, topk=3, score_function=score
    )
    x64 = logits.detach().double().requires_grad_()
    want_routing, want_scores = derived_aux_scores(x64, 3, score)
    assert scores.dtype == torch.float32 and torch.equal(routing, want_routing)
    assert_close(scores, want_scores, torch.float32)
    tokens = routing.sum(0)
    loss = fused_moe_aux_loss(
        probs=scores,
        tokens_per_expert=tokens,
        total_num_tokens=37,
        topk=3,
        num_experts=13,
        coeff=0.01,
    )
    want = (want_scores.sum(0) * tokens.double()).sum() * (13 * 0.01 / (3 * 37 * 37))
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, want, torch.float32)
    loss.backward()
    want.backward()
    assert_close(logits.grad, x64.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "total",
    [lambda: 40, lambda: torch.tensor(40), lambda: torch.tensor(40.0), lambda: 40.9],
    ids=["int", "int64-tensor", "float-tensor", "float-truncated"],
)
def test_aux_loss_totals_columns_and_grad(dtype, total):
    """Megatron-Core's per-sequence loss folds 2 sequences into the columns (C = 2 E); its
    padding-mask path passes a float tensor as total_num_tokens."""
    probs = (torch.rand(37, 26) / 8).to(dtype).requires_grad_()
    tokens = torch.randint(0, 30, (26,)).float()
    loss = fused_moe_aux_loss(probs, tokens, total(), 13, 2, 0.1)
    c = 13 * 0.1 / 2 / 40 / 40
    want = (probs.detach().double().sum(0) * tokens.double()).sum() * c
    assert loss.dtype == dtype
    assert_close(loss, want, dtype)
    loss.backward(torch.tensor(3.0, dtype=dtype))
    assert probs.grad.dtype == dtype and probs.grad.shape == probs.shape
    assert_close(probs.grad, (3.0 * c * tokens.double()).expand(37, 26), dtype)


def test_routing_map_formats_and_dense_indices_agree():
    logits = torch.randn(2, 3, 21).requires_grad_()  # leading dims: T = 6
    option = (6, False, 3, 2, None, "sigmoid", True)
    (probs, routing), bias = call(logits, option)
    assert routing.shape == (2, 3, 21) and probs.shape == (2, 3, 21)
    grads = [torch.autograd.grad(probs.sum(), logits)[0]]
    for fmt in ["bitmap_u8", RoutingMapFormat.BITMAP_U8, 1]:
        (p, bits), _ = call(logits, option, bias=bias, routing_map_format=fmt)
        assert bits.dtype == torch.uint8 and bits.shape == (2, 3, 3)
        for byte in range(3):
            want = sum(
                int(1 << b) * routing[..., 8 * byte + b].to(torch.int32)
                for b in range(8)
                if 8 * byte + b < 21
            )
            assert torch.equal(bits[..., byte].to(torch.int32), want)
        assert torch.equal(p, probs)
        grads.append(torch.autograd.grad(p.sum(), logits)[0])
    for dtype in [torch.int16, torch.int32, torch.int64]:
        buffer = torch.full((2, 3, 6), -1, dtype=dtype)
        (p, index), _ = call(logits, option, bias=bias, topk_indices=buffer)
        assert index is buffer and torch.equal(p, probs)
        chosen = probs.detach().gather(-1, index.long())
        assert torch.equal(torch.zeros_like(routing).scatter(-1, index.long(), True), routing)
        # dense indices come largest selection score first
        score = torch.sigmoid(logits.detach()) + bias
        assert (score.gather(-1, index.long()).diff(dim=-1) <= 0).all() and (chosen > 0).all()
        grads.append(torch.autograd.grad(p.sum(), logits)[0])
    for g in grads[1:]:
        assert torch.equal(g, grads[0])


def derived_qb(logits, topk, bias, lower, upper, bins):
    """Quantile balancing from its definition: top-(k+1) of sigmoid + bias, the (k+1)-th score is
    the cutoff, the first k are routed; bin of (cutoff - raw) in bins equal steps."""
    raw = torch.sigmoid(logits.double())
    order = (raw + bias.double()).topk(topk + 1, dim=-1)
    index, cutoff = order.indices[:, :topk], order.values[:, topk:]
    chosen = raw.gather(1, index)
    chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) if topk > 1 else chosen
    probs = torch.zeros_like(raw).scatter(1, index, chosen)
    where = torch.floor((cutoff - raw - lower) * bins / (upper - lower)).clamp(0, bins - 1)
    histogram = torch.zeros(raw.shape[1], bins, dtype=torch.int64)
    for e in range(raw.shape[1]):
        histogram[e] = torch.bincount(where[:, e].long(), minlength=bins)
    return probs, probs > 0, histogram


@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
def test_quantile_balancing(mode):
    logits, bias = torch.randn(37, 13).requires_grad_(), bias_for(13)
    histogram = torch.zeros(13, 6, dtype=torch.int32)
    bounds = torch.tensor([-0.5, 1.0])
    qb = dict(qb_histogram=histogram, qb_bin_bounds=bounds, qb_histogram_mode=mode)
    option = (3, False, None, None, None, "sigmoid", True)
    (probs, routing), _ = call(logits, option, bias=bias, **qb)
    want_probs, want_routing, want_hist = derived_qb(logits.detach(), 3, bias, -0.5, 1.0, 6)
    assert torch.equal(routing, want_routing)
    assert_close(probs, want_probs, torch.float32)
    assert histogram.dtype == torch.int32 and torch.equal(histogram.long(), want_hist)
    call(logits, option, bias=bias, **qb)
    assert torch.equal(histogram.long(), 2 * want_hist)  # accumulates
    (probs_plain, _), _ = call(logits, option, bias=bias)
    assert torch.equal(
        torch.autograd.grad(probs.sum(), logits)[0],
        torch.autograd.grad(probs_plain.sum(), logits)[0],
    )


def test_ties_choose_the_lower_expert_and_group():
    logits = torch.zeros(3, 12)
    logits[1, [2, 5, 7, 9]] = 1.0  # a tie at the boundary: 4 equal leaders, topk 3
    (probs, routing), _ = call(logits, (3, False, None, None, None, "softmax", False))
    assert routing[0].nonzero().flatten().tolist() == [0, 1, 2]
    assert routing[1].nonzero().flatten().tolist() == [2, 5, 7]
    assert torch.allclose(probs[routing], torch.full((9,), 1 / 3))
    # grouped, 4 groups of 3: groups 1, 2, 3 tie (top-2 sums), 1 and 2 win, then 4 of their 6
    grouped = torch.tensor([[0.0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]])
    (_, routing), _ = call(grouped, (4, False, 4, 2, None, "sigmoid", False))
    assert routing[0].nonzero().flatten().tolist() == [3, 4, 7, 8]
    index = torch.empty(1, 4, dtype=torch.int64)
    call(logits[:1], (4, False, None, None, None, "sigmoid", False), topk_indices=index)
    assert index.tolist() == [[0, 1, 2, 3]]


def test_non_contiguous_logits():
    logits = torch.randn(16, 37)
    (probs, routing), bias = call(logits.t(), (3, False, None, None, None, "sigmoid", True))
    (want, want_routing), _ = call(
        logits.t().contiguous(), (3, False, None, None, None, "sigmoid", True), bias=bias
    )
    assert torch.equal(probs, want) and torch.equal(routing, want_routing)
    routing, scores = fused_compute_score_for_moe_aux_loss(logits.t(), 2, "softmax")
    assert torch.equal(
        scores, fused_compute_score_for_moe_aux_loss(logits.t().contiguous(), 2, "softmax")[1]
    )
    loss = fused_moe_aux_loss(scores.t(), torch.ones(37), 37, 37, 2, 1.0)
    assert_close(
        loss,
        fused_moe_aux_loss(scores.t().contiguous(), torch.ones(37), 37, 37, 2, 1.0),
        torch.float32,
    )


@pytest.mark.parametrize("score", SCORES)
def test_zero_tokens(score):
    logits = torch.zeros(0, 7, dtype=torch.bfloat16, requires_grad=True)
    (probs, routing), _ = call(logits, (2, False, None, None, None, score, score != "softmax"))
    assert probs.shape == (0, 7) and probs.dtype == torch.bfloat16 and routing.shape == (0, 7)
    probs.sum().backward()
    assert logits.grad.shape == (0, 7)
    routing, scores = fused_compute_score_for_moe_aux_loss(logits, 2, score, "bitmap_u8")
    assert routing.shape == (0, 1) and routing.dtype == torch.uint8 and scores.shape == (0, 7)
    loss = fused_moe_aux_loss(scores, torch.zeros(7), 1, 7, 2, 1.0)
    assert loss.item() == 0.0


def test_sqrtsoftplus_tails():
    """softplus(x) = x past 20; log1p(exp(x)) keeps tiny values for very negative x."""
    logits = torch.tensor([[30.0, 21.0, 19.0, -30.0, -60.0, 0.0]]).requires_grad_()
    routing, scores = fused_compute_score_for_moe_aux_loss(logits, 2, "sqrtsoftplus")
    want_routing, want = derived_aux_scores(logits.detach(), 2, "sqrtsoftplus")
    assert torch.equal(routing, want_routing) and scores[0, 4] > 0
    assert_close(scores, want, torch.float32)


# ----------------------------------------------------------------------------------------------
# gradcheck of the autograd Functions in float64 (the reference path)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", OPTIONS, ids=str)
def test_gradcheck_topk(option):
    topk, pre, groups, group_topk, scaling, score, with_bias = option
    spec = kernels.RouterSpec(
        topk=topk,
        score_function=score,
        use_pre_softmax=pre,
        num_groups=groups or 0,
        group_topk=group_topk or 0,
        scaling_factor=scaling or 1.0,
    )
    bias = bias_for(16) if with_bias else None
    logits = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)

    def probs(x):
        return moe_router.FusedTopkScoreFunction.apply(x, bias, None, None, None, spec)[0]

    assert torch.autograd.gradcheck(probs, (logits,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("score", SCORES)
def test_gradcheck_aux_scores_and_loss(score):
    logits = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    fn = moe_router.FusedComputeScoresForMoEAuxLoss.apply
    assert torch.autograd.gradcheck(lambda x: fn(x, 2, score, 0)[1], (logits,), eps=1e-6)
    probs = torch.rand(5, 18, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 9, (18,))
    loss = moe_router.FusedAuxLoss.apply
    assert torch.autograd.gradcheck(lambda p: loss(p, tokens, 7, 9, 2, 0.5), (probs,))


# ----------------------------------------------------------------------------------------------
# Signatures Megatron-Core and Transformer Engine code call, and bad input
# ----------------------------------------------------------------------------------------------


def test_signatures_are_transformer_engines():
    names = {
        fused_topk_with_score_function: (
            "logits topk use_pre_softmax num_groups group_topk scaling_factor score_function "
            "expert_bias routing_map_format topk_indices qb_histogram qb_bin_bounds "
            "qb_histogram_mode"
        ),
        fused_compute_score_for_moe_aux_loss: "logits topk score_function routing_map_format",
        fused_moe_aux_loss: "probs tokens_per_expert total_num_tokens num_experts topk coeff",
    }
    for fn, want in names.items():
        params = inspect.signature(fn).parameters
        assert list(params) == want.split()
    params = inspect.signature(fused_topk_with_score_function).parameters
    assert params["routing_map_format"].default == RoutingMapFormat.BYTEMAP == 0
    assert params["expert_bias"].default is inspect.Parameter.empty
    assert [m.value for m in QBHistogramMode] == [0, 1]


X = torch.zeros(4, 12)
TOPK = dict(
    logits=X,
    topk=2,
    use_pre_softmax=False,
    num_groups=None,
    group_topk=None,
    scaling_factor=None,
    score_function="softmax",
    expert_bias=None,
)
QB = dict(
    score_function="sigmoid",
    expert_bias=torch.zeros(12),
    qb_histogram=torch.zeros(12, 4, dtype=torch.int32),
    qb_bin_bounds=torch.tensor([0.0, 1.0]),
    qb_histogram_mode="two_kernel",
)
BAD_TOPK = [
    (dict(topk=13), ValueError, "topk must be in"),
    (dict(topk=0), ValueError, "topk must be at least 1"),
    (dict(topk=2.0), TypeError, "topk must be an int"),
    (dict(logits=torch.tensor(1.0)), ValueError, "at least 1 dim"),
    (dict(logits=X.double()), ValueError, "float64"),
    (dict(logits=X.long()), TypeError, "logits must be float32"),
    (dict(score_function="relu"), ValueError, "score_function must be"),
    (dict(num_groups=5, group_topk=1), ValueError, "divisible by num_groups"),
    (dict(num_groups=None, group_topk=1), ValueError, "num_groups must be a positive int"),
    (dict(topk=3, num_groups=4, group_topk=2), ValueError, "divisible by group_topk"),
    (dict(num_groups=2, group_topk=4, topk=4), ValueError, "group_topk .* <= num_groups"),
    (dict(topk=8, num_groups=4, group_topk=2), ValueError, "group size"),
    (dict(expert_bias=torch.zeros(12)), ValueError, "expert_bias needs"),
    (dict(score_function="sigmoid", expert_bias=torch.zeros(12).half()), TypeError, "float32"),
    (dict(score_function="sigmoid", expert_bias=torch.zeros(11)), ValueError, r"shape \(12,\)"),
    (dict(routing_map_format="BITMAP"), ValueError, "lowercase"),
    (dict(routing_map_format=2), ValueError, "one of"),
    (dict(routing_map_format=1.0), TypeError, "routing_map_format must be"),
    (dict(topk_indices=torch.zeros(4, 2).long(), routing_map_format=1), ValueError, "bitmap"),
    (dict(topk_indices=torch.zeros(4, 2, dtype=torch.uint8)), TypeError, "int16, int32"),
    (dict(topk_indices=torch.zeros(4, 3).long()), ValueError, r"shape must be \(4, 2\)"),
    (dict(qb_histogram=QB["qb_histogram"]), ValueError, "provided together"),
    ({**QB, "score_function": "softmax", "expert_bias": None}, ValueError, "sigmoid"),
    ({**QB, "expert_bias": None}, ValueError, "requires expert_bias"),
    ({**QB, "num_groups": 2, "group_topk": 1}, ValueError, "grouped"),
    ({**QB, "qb_histogram_mode": "atomic"}, ValueError, "qb_histogram_mode"),
    ({**QB, "topk": 12}, ValueError, "topk < num_experts"),
    ({**QB, "qb_bin_bounds": torch.tensor([1.0, 1.0])}, ValueError, "lower < upper"),
    ({**QB, "qb_bin_bounds": torch.tensor([0.0, float("inf")])}, ValueError, "finite"),
    (
        {**QB, "qb_histogram": torch.zeros(11, 4, dtype=torch.int32)},
        ValueError,
        "qb_histogram must have shape",
    ),
    ({**QB, "qb_histogram": torch.zeros(12, 4)}, TypeError, "int32"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD_TOPK, ids=lambda v: str(v)[:40])
def test_bad_topk_arguments_raise(change, error, match):
    with pytest.raises(error, match=match):
        fused_topk_with_score_function(**{**TOPK, **change})


@pytest.mark.parametrize(
    ("call_", "error", "match"),
    [
        (lambda: fused_compute_score_for_moe_aux_loss(X, 13, "softmax"), ValueError, "topk"),
        (lambda: fused_compute_score_for_moe_aux_loss(X, 2, "tanh"), ValueError, "score_function"),
        (
            lambda: fused_compute_score_for_moe_aux_loss(X, 2, "softmax", "x"),
            ValueError,
            "bytemap",
        ),
        (lambda: fused_moe_aux_loss(X[None], X[0], 4, 12, 2, 1.0), ValueError, "2-D"),
        (lambda: fused_moe_aux_loss(X.long(), X[0], 4, 12, 2, 1.0), TypeError, "probs must be"),
        (lambda: fused_moe_aux_loss(X, X[0, :5], 4, 12, 2, 1.0), ValueError, "tokens_per_expert"),
        (lambda: fused_moe_aux_loss(X, X[0], 4, 5, 2, 1.0), ValueError, "multiple of num_experts"),
        (lambda: fused_moe_aux_loss(X, X[0], 0, 12, 2, 1.0), ValueError, "greater than 0"),
        (
            lambda: fused_moe_aux_loss(X, X[0], torch.ones(2), 12, 2, 1.0),
            ValueError,
            "one number",
        ),
        (lambda: fused_moe_aux_loss(X, X[0], 4, 0, 2, 1.0), ValueError, "num_experts"),
        (lambda: fused_moe_aux_loss(X, X[0], 4, 12, 0, 1.0), ValueError, "topk"),
        (
            lambda: fused_moe_aux_loss(X, X[0].bool(), 4, 12, 2, 1.0),
            TypeError,
            "integer or float",
        ),
    ],
)
def test_bad_aux_arguments_raise(call_, error, match):
    with pytest.raises(error, match=match):
        call_()


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process (TRITON_INTERPRET is read when the kernels are defined). tile=256
# makes several programs with masked rows. The interpreter truncates fp32 -> bf16 / fp16 instead of
# rounding, so low-precision outputs are compared within their dtype's tolerance.
INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close, assert_equal_or_close as same
from torchte.kernels import router as R, moe_aux_loss as A
from torchte.kernels.router_maps import routing_to_mask

def topk(x, bias, spec, index_dtype=None):
    t, k = x.shape[0], spec.topk
    index = [torch.empty(t, k, dtype=index_dtype) if spec.dense_indices else None for _ in "ab"]
    out = R._topk_forward_triton(x, bias, index[0], spec, tile=256)
    ref = R.topk_forward_reference(x, bias, index[1], spec)
    for a, b, name in zip(out, ref, ["probs", "routing", "intermediate", "cutoff"]):
        same(a, b, (spec, name))
    mask = routing_to_mask(ref[1], spec.routing_layout, x.shape[-1])
    grad = torch.randn(x.shape).to(x.dtype)
    same(R._backward_triton(mask, ref[2], grad, spec, x.dtype, tile=256),
         R.topk_backward_reference(mask, ref[2], grad, spec, x.dtype), (spec, "grad"))

def rows(t, e, dtype=torch.float32):
    return (torch.argsort(torch.rand(t, e), -1).float() * 0.25 - e / 8).to(dtype)

torch.manual_seed(0)
S = R.RouterSpec
topk(rows(37, 13, torch.bfloat16), None, S(3, "softmax", scaling_factor=1.5))
topk(rows(5, 64), None, S(8, "softmax", True, 8, 4, dense_indices=True), torch.int16)
topk(rows(9, 12, torch.float16), torch.randn(12), S(4, "sigmoid", num_groups=3, group_topk=2,
                                                   routing_map_format=1))
topk(rows(37, 13), torch.randn(13), S(1, "sqrtsoftplus", scaling_factor=2.0))
topk(rows(37, 15) * 8, torch.randn(15), S(3, "sqrtsoftplus", num_groups=5, group_topk=3))
topk(rows(37, 13), torch.randn(13), S(3, "sigmoid", dense_indices=True, qb=True), torch.int64)
topk(rows(0, 6), None, S(2, "sigmoid"))
topk(rows(3, 1), None, S(1, "softmax"))
topk(torch.zeros(3, 13), None, S(4, "sigmoid", dense_indices=True), torch.int32)  # ties
for score in ["softmax", "sigmoid", "sqrtsoftplus"]:
    for t, e, fmt in [(37, 13, 0), (0, 5, 1), (4, 64, 1)][: 3 if score == "softmax" else 1]:
        x = rows(t, e)
        out = R._aux_scores_triton(x, 3 if e > 5 else 1, score, fmt, tile=256)
        ref = R.aux_scores_forward_reference(x, 3 if e > 5 else 1, score, fmt)
        for a, b in zip(out, ref):
            same(a, b, (score, t, e))
        grad = torch.randn(t, e)
        same(R._backward_triton(None, ref[2], grad, R.aux_spec(score), torch.bfloat16, tile=256),
             R.aux_scores_backward_reference(ref[2], grad, score, torch.bfloat16), score)
for rows_, cols, experts, tokens in [(37, 13, 13, torch.randint(0, 50, (13,))),
                                     (0, 8, 4, torch.zeros(8, dtype=torch.int32)),
                                     (300, 24, 8, torch.rand(24) * 40)]:
    probs = torch.rand(rows_, cols)
    for total in [rows_ + 3, torch.tensor(rows_ + 3), torch.tensor(rows_ + 3.0)]:
        loss, c = A._forward_triton(probs, tokens, total, experts, 2, 0.01)
        want, want_c = A.aux_loss_forward_reference(probs, tokens, total, experts, 2, 0.01)
        assert torch.equal(c, want_c), (c, want_c)
        same(loss, want, (rows_, cols))
        grad = torch.tensor(0.5)
        same(A._backward_triton(c, tokens, grad, rows_, torch.float32),
             A.aux_loss_backward_reference(c, tokens, grad, rows_, torch.float32), rows_)
print("ok")
"""


@requires_interpreter
def test_triton_kernels_in_interpreter_match_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ----------------------------------------------------------------------------------------------
# CUDA (Triton) against the CPU (torch reference)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", OPTIONS, ids=str)
def test_cuda_matches_cpu(option, dtype):
    logits = distinct_logits(1031, 64, dtype).requires_grad_()
    # a bias on a coarse grid: no near-ties that fp32 rounding on one device could flip
    bias = torch.randint(-4, 5, (64,)) / 16.0 if option[-1] else None
    weights = torch.randn(1031, 64)
    for extra in [{}, {"routing_map_format": "bitmap_u8"}, {"topk_indices": "int32"}]:

        def run(x, b, w, extra=extra):
            kw = dict(extra)
            if "topk_indices" in kw:
                shape = (1031, option[0])
                kw["topk_indices"] = torch.empty(shape, dtype=torch.int32, device=x.device)
            (probs, routing), _ = call(x, option, bias=b, **kw)
            (grad,) = torch.autograd.grad((probs.float() * w).sum(), x)
            return probs, routing, grad

        bias_cuda = None if bias is None else bias.cuda()
        want = run(logits, bias, weights)
        got = run(logits.detach().cuda().requires_grad_(), bias_cuda, weights.cuda())
        assert torch.equal(got[1].cpu(), want[1])
        assert_close(got[0], want[0], dtype)
        assert_close(got[2], want[2], dtype)
    routing, scores = fused_compute_score_for_moe_aux_loss(logits.detach().cuda(), 3, option[5])
    want_routing, want_scores = fused_compute_score_for_moe_aux_loss(logits.detach(), 3, option[5])
    assert torch.equal(routing.cpu(), want_routing)
    assert_close(scores, want_scores, torch.float32)


@pytest.mark.gpu
def test_cuda_quantile_balancing_and_aux_loss_match_cpu():
    logits, bias = distinct_logits(1031, 64, torch.float32), bias_for(64)
    hist = [torch.zeros(64, 16, dtype=torch.int32, device=d) for d in ("cpu", "cuda")]
    bounds = torch.tensor([-0.5, 1.0])
    for h, d in zip(hist, ("cpu", "cuda"), strict=True):
        fused_topk_with_score_function(
            logits.to(d),
            6,
            False,
            None,
            None,
            None,
            "sigmoid",
            bias.to(d),
            qb_histogram=h,
            qb_bin_bounds=bounds.to(d),
            qb_histogram_mode="fused_atomic",
        )
    # GPU exp is not the CPU's to the last bit: a value within an ulp of a bin edge may land in
    # the next bin; the counts agree up to such moves
    assert hist[1].sum() == hist[0].sum() == 1031 * 64
    assert (hist[1].cpu() - hist[0]).abs().sum() <= 8
    probs = torch.rand(1031, 128).requires_grad_()
    tokens = torch.randint(0, 200, (128,))
    for total in [2000, torch.tensor(2000)]:
        probs_cuda = probs.detach().cuda().requires_grad_()
        total_cuda = total.cuda() if isinstance(total, torch.Tensor) else total
        got = fused_moe_aux_loss(probs_cuda, tokens.cuda(), total_cuda, 64, 6, 0.01)
        want = fused_moe_aux_loss(probs, tokens, total, 64, 6, 0.01)
        assert_close(got, want, torch.float32)  # summed in another order
        (grad,) = torch.autograd.grad(got, probs_cuda)
        (want_grad,) = torch.autograd.grad(want, probs)
        assert torch.equal(grad.cpu(), want_grad)
