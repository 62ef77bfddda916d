"""The router's packed selection keys (torchte/kernels/router_topk.py): the key's order (float
order, then the lowest index; -0.0 ties +0.0; NaN never picked), decoding, the packing kernel
against its torch reference, and the top-k and aux-score kernels against the torch reference
(torchte/kernels/router_reference.py) under Triton's CPU interpreter and on the GPU: the
selection (map, indices) exactly, the float outputs within their dtype's tolerance.

Scores are drawn from a pool of values that stress the map to integers (both zeros, the
smallest denormals, the smallest normal, the largest finite, infinities), with many ties. On
rows with NaN the kernels are held to `select_like_gpu` (tests/router_gpu_model.py), a GPU's
selection in torch ops with a GPU's float max (the interpreter's max propagates NaN and the torch
reference sorts NaN first, so neither serves); without NaN it selects as the reference.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from router_gpu_model import select_like_gpu
from tolerances import assert_close

from torchte.kernels import router_topk as K
from torchte.kernels.router_maps import routing_to_mask
from torchte.kernels.router_reference import RouterSpec, topk_forward_reference

INF = float("inf")
MAX, TINY = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
DENORMS = [1e-45, 1e-39]  # the smallest denormal, a larger one
# Every non-NaN kind of fp32, in increasing order
ORDERED = [-INF, -MAX, -3.0, -1.5, -TINY, -DENORMS[1], -DENORMS[0], -0.0, 0.0]
ORDERED += [DENORMS[0], DENORMS[1], TINY, 0.5, 3.0, MAX, INF]
# Selection pool: finite values and -inf (no +inf: softmax of it is NaN), repeated for ties
POOL = [-INF, -3.0, -1.5, -TINY, -DENORMS[1], -DENORMS[0], -0.0, 0.0, 0.0]
POOL += [DENORMS[0], DENORMS[1], TINY, 0.5, 0.5, 2.0, 3.0]
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF]  # quiet, negative, signalling, -1

# (experts, num_groups, group_topk, topk): groups of 2, 5, 8 and 20 experts (padded to 2, 8,
# 8, 32 lanes), each also without groups
CASES = [(6, 3, 2, 2), (10, 2, 1, 3), (64, 8, 4, 8), (160, 8, 3, 6)]


def floats(bits: list[int]) -> torch.Tensor:
    """fp32 tensor of the given bit patterns (unsigned 32-bit ints)."""
    return (
        torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits]).int().view(torch.float32)
    )


def special_rows(t: int, e: int, nan_share: float = 0.0, seed: int = 0) -> torch.Tensor:
    """(t, e) fp32 logits drawn from POOL; a `nan_share` of the entries NaN (of NAN_BITS), and
    with nan_share > 0 row 0 NaN only."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(POOL)
    x = pool[torch.randint(len(POOL), (t, e), generator=g)]
    if nan_share > 0 and t > 0:
        nans = floats(NAN_BITS)[torch.randint(len(NAN_BITS), (t, e), generator=g)]
        x = torch.where(torch.rand(t, e, generator=g) < nan_share, nans, x)
        x[0] = nans[0]
    return x


def coarse_bias(e: int, seed: int = 1) -> torch.Tensor:
    """(e,) fp32 bias on a grid of 1/16: y + bias ties exactly where y does (0, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (e,), generator=g) / 16.0


def specs(e: int, groups: int, group_topk: int, topk: int) -> list[RouterSpec]:
    """The calls a case is run with: grouped and plain, every score function, QB on the plain
    sigmoid; indices (int32, int16) and both map formats."""
    s = RouterSpec
    return [
        s(topk, "softmax", num_groups=groups, group_topk=group_topk, dense_indices=True),
        s(topk, "softmax", True, groups, group_topk, 2.0, routing_map_format=1),
        s(topk, "sigmoid", num_groups=groups, group_topk=group_topk, dense_indices=True),
        s(topk - 1 or 1, "sigmoid", dense_indices=True, qb=True),
        s(topk, "sqrtsoftplus", num_groups=groups, group_topk=group_topk),
        s(topk, "softmax", scaling_factor=1.5, dense_indices=True),
    ]


def selection_scores(logits: torch.Tensor, inter: torch.Tensor, spec, bias) -> torch.Tensor:
    """The fp32 scores a kernel selected on, rebuilt bit for bit from its intermediate output
    (softmax and sigmoid only)."""
    if spec.score_function == "softmax":
        return inter if spec.pre_softmax else logits.float()
    return inter if bias is None else inter + bias


# ----------------------------------------------------------------------------------------------
# The key (torch reference)
# ----------------------------------------------------------------------------------------------


def test_keys_sort_as_the_floats_then_the_lower_index():
    g = torch.Generator().manual_seed(0)
    score = torch.tensor(ORDERED + ORDERED)[torch.randperm(2 * len(ORDERED), generator=g)]
    index = torch.arange(score.numel(), dtype=torch.int32)
    keys = K.pack_keys_reference(score, index)
    want = torch.sort(score, descending=True, stable=True).indices  # -0.0 == 0.0 here
    assert torch.equal(keys.argsort(descending=True), want)
    assert keys.unique().numel() == keys.numel()
    assert (keys > K.KEY_NONE).all()


def test_both_zeros_tie_and_the_lower_index_wins():
    score = torch.tensor([0.0, -0.0, 0.0, -0.0, DENORMS[0], -DENORMS[0]])
    keys = K.pack_keys_reference(score, torch.tensor([3, 0, 7, 1, 9, 2], dtype=torch.int32))
    assert torch.equal(keys[:4] >> 32, torch.zeros(4, dtype=torch.int64))
    assert keys[1] > keys[3] > keys[0] > keys[2]  # indices 0, 1, 3, 7
    assert keys[4] > keys[1] > keys[5]  # the denormals stay apart from zero


def test_nan_is_never_picked():
    nan = floats(NAN_BITS)
    keys = K.pack_keys_reference(nan, torch.zeros(len(NAN_BITS), dtype=torch.int32))
    assert (keys == K.KEY_NONE).all()
    lowest = K.pack_keys_reference(torch.tensor([-INF]), torch.tensor([2**31 - 2]).int())
    assert lowest > K.KEY_NONE
    assert K.key_value_reference(torch.tensor([K.KEY_NONE])).item() == -INF
    assert K.key_index_reference(torch.tensor([K.KEY_NONE])).item() == K.INDEX_BASE == 2**31 - 1


def test_keys_decode_to_score_and_index():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).int()
    score = torch.cat([bits.view(torch.float32), torch.tensor(ORDERED)])
    score = score[~score.isnan()]
    index = torch.randint(0, 2**31 - 1, score.shape, generator=g, dtype=torch.int64).int()
    index[:4] = torch.tensor([0, 1, 2**31 - 2, 12345])
    keys = K.pack_keys_reference(score, index)
    value = K.key_value_reference(keys)
    canonical = torch.where(score == 0, 0.0, score)  # -0.0 decodes as +0.0
    assert torch.equal(value.view(torch.int32), canonical.view(torch.int32))
    assert torch.equal(K.key_index_reference(keys), index)


@pytest.mark.parametrize(
    "score, index, error, match",
    [
        (torch.zeros(3, dtype=torch.float64), torch.zeros(3).int(), TypeError, "fp32"),
        (torch.zeros(3), torch.zeros(3).long(), TypeError, "int32"),
        (torch.zeros(2, 3), torch.zeros(2, 3).int(), ValueError, "1-D"),
        (torch.zeros(3), torch.zeros(4).int(), ValueError, "one shape"),
    ],
)
def test_pack_keys_checks_its_arguments(score, index, error, match):
    with pytest.raises(error, match=match):
        K.pack_keys(score, index)


def test_pack_keys_on_cpu_is_the_reference():
    score = torch.tensor(ORDERED)
    index = torch.arange(score.numel(), dtype=torch.int32)
    assert torch.equal(K.pack_keys(score, index), K.pack_keys_reference(score, index))
    assert K.pack_keys(torch.zeros(0), torch.zeros(0).int()).shape == (0,)


def test_group_scores_add_the_largest_first_in_fp32():
    """1 + 2**-24 + 2**-24 is 1 added largest first (a tie, which the lower group wins) and
    1 + 2**-23 otherwise: the interpreter test holds the kernels to the same row."""
    row = torch.tensor([[1.0, 0, 0, 0, 0, 1.0, 2**-24, 2**-24, 0, 0]])
    spec = RouterSpec(3, "softmax", num_groups=2, group_topk=1, dense_indices=True)
    index = torch.empty(1, 3, dtype=torch.int64)
    topk_forward_reference(row, None, index, spec)
    assert index.tolist() == [[0, 1, 2]]
    assert (row[0, 7] + row[0, 6]) + row[0, 5] > 1.0  # summed smallest first: group 1 wins


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_selection_model_is_the_reference_without_nan(case):
    """select_like_gpu (a GPU's selection) picks as the torch reference where no score is NaN,
    ties and -inf included: the model the NaN tests hold the kernels to."""
    e, groups, group_topk, topk = case
    x = special_rows(33, e, seed=e)
    for spec in specs(*case)[:3]:
        grouped = spec.grouped
        index = torch.empty(33, topk, dtype=torch.int64) if spec.dense_indices else None
        _, routing, inter, _ = topk_forward_reference(x, None, index, spec)
        mask = routing_to_mask(routing, spec.routing_layout, e)
        score = selection_scores(x, inter, spec, None)
        want_index, chosen, _ = select_like_gpu(
            score, topk, groups if grouped else 0, group_topk if grouped else 0
        )
        assert torch.equal(mask, chosen), spec
        if index is not None:
            assert torch.equal(index, want_index), spec
    plain = RouterSpec(topk, "sigmoid", qb=True, dense_indices=True)
    bias = coarse_bias(e)
    index = torch.empty(33, topk, dtype=torch.int64)
    _, _, inter, cutoff = topk_forward_reference(x, bias, index, plain)
    want_index, _, want_cutoff = select_like_gpu(inter + bias, topk, qb=True)
    assert torch.equal(index, want_index) and torch.equal(cutoff, want_cutoff)


# ----------------------------------------------------------------------------------------------
# Under Triton's CPU interpreter: the packing kernel against its reference, and the top-k and
# aux-score kernels against the torch reference (no NaN) and select_like_gpu (NaN rows)
# ----------------------------------------------------------------------------------------------

# The interpreter's exp is numpy's and it truncates fp32 -> bf16, so float outputs are held to
# their dtype's tolerance; the selection (map, indices) must be the reference's exactly.
INTERPRETER_SCRIPT = """
import torch
from router_gpu_model import select_like_gpu
from test_moe_router_packed import (
    CASES, ORDERED, NAN_BITS, coarse_bias, floats, selection_scores, special_rows, specs,
)
from tolerances import assert_close, assert_equal_or_close as same
from torchte.kernels import router as R, router_topk as K
from torchte.kernels.router_maps import routing_to_mask

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

def bits(a):
    return a.view(INTS[a.element_size()])

def same_bits(a, b, where):
    assert a.shape == b.shape and a.dtype == b.dtype, (where, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(bits(a), bits(b)), where

def same_nan_aware(a, b, where):
    assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan()), where
    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), where

# the packing kernel
g = torch.Generator().manual_seed(0)
for n in [1, 7, 33, 1500]:
    score = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).int()
    score = score.view(torch.float32)
    special = torch.cat([torch.tensor(ORDERED), floats(NAN_BITS)])[: n]
    score[: special.numel()] = special
    index = torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int64).int()
    same_bits(K._pack_keys_triton(score, index), K.pack_keys_reference(score, index), n)

def index_buffer(t, spec, index_dtype):
    return torch.full((t, spec.topk), 5, dtype=index_dtype) if spec.dense_indices else None

def run(x, bias, spec, index_dtype, tile):
    return R._topk_forward_triton(x, bias, index_buffer(x.shape[0], spec, index_dtype), spec,
                                  tile=tile)

for i, case in enumerate(CASES):
    e, _, _, topk = case
    for j, spec in enumerate(specs(*case)):
        t = [1, 7, 33][(i + j) % 3]
        dtype = torch.bfloat16 if j == 1 else torch.float32
        index_dtype = torch.int16 if j == 2 else torch.int64
        bias = coarse_bias(e) if spec.score_function != "softmax" else None
        tile = 256 if j == 0 else 4096
        where = (case, spec, t)
        x = special_rows(t, e, seed=i + j).to(dtype)
        out = run(x, bias, spec, index_dtype, tile)
        ref = R.topk_forward(x, bias, index_buffer(t, spec, index_dtype), spec)  # CPU: reference
        for a, b, name in zip(out, ref, ["probs", "routing", "intermediate", "cutoff"]):
            same(a, b, (where, name))
        # NaN rows (row 0 NaN only): a GPU's selection
        if spec.score_function == "sqrtsoftplus":
            continue
        x = special_rows(t, e, nan_share=0.25, seed=i + j).to(dtype)
        probs, routing, inter, cutoff = run(x, bias, spec, index_dtype, tile)
        score = selection_scores(x, inter, spec, bias)
        groups = spec.num_groups if spec.grouped else 0
        want_index, chosen, want_cutoff = select_like_gpu(
            score, spec.topk, groups, spec.group_topk, spec.qb
        )
        if spec.dense_indices:
            assert torch.equal(routing, want_index.to(index_dtype)), (where, routing, want_index)
        else:
            assert torch.equal(routing_to_mask(routing, spec.routing_layout, e), chosen), where
        same_nan_aware(cutoff, want_cutoff, where)
        assert not probs[~chosen].any(), where

# A group's score adds its PER largest largest first, in fp32: 1 + 2**-24 + 2**-24 rounds to 1
# and ties group 0, which wins as the lower group (summed otherwise it would be 1 + 2**-23).
row = torch.tensor([[1.0, 0, 0, 0, 0, 1.0, 2**-24, 2**-24, 0, 0]])
spec = R.RouterSpec(3, "softmax", num_groups=2, group_topk=1, dense_indices=True)
assert run(row, None, spec, torch.int64, 4096)[1].tolist() == [[0, 1, 2]]

# zero tokens, and the aux-loss scores: the reference without NaN, select_like_gpu with NaN
out = R._topk_forward_triton(torch.zeros(0, 10), None, None, specs(10, 2, 1, 3)[0])
assert out[0].shape == (0, 10)
for score_function in ["softmax", "sigmoid", "sqrtsoftplus"]:
    x = special_rows(33, 10, seed=3)
    out = R._aux_scores_triton(x, 3, score_function, 0, tile=256)
    for a, b in zip(out, R.aux_scores_forward(x, 3, score_function, 0)):
        same(a, b, score_function)
    x = special_rows(33, 10, nan_share=0.1, seed=3)
    scores, routing, _ = R._aux_scores_triton(x, 3, score_function, 0, tile=256)
    assert torch.equal(routing, select_like_gpu(scores, 3)[1]), score_function
print("ok")
"""


@requires_interpreter
def test_kernels_in_interpreter_match_the_reference_and_the_gpu_selection_on_nan():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ----------------------------------------------------------------------------------------------
# CUDA: the kernels against the torch reference on the CPU (selection exactly, floats within
# tolerance: a GPU's exp is not the CPU's to the last bit) and select_like_gpu on NaN rows
# ----------------------------------------------------------------------------------------------


def _equal_nan_aware(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _gpu_logits(rows: int, e: int, logits_kind: str) -> torch.Tensor:
    """(rows, e) fp32 logits: "random" normal values on a grid of 1/8 (exact ties, no near
    ties a GPU's rounding could flip against the CPU), else special_rows (with NaN for "nan")."""
    if logits_kind == "random":
        g = torch.Generator().manual_seed(rows)
        return (torch.randn(rows, e, generator=g) * 8).round() / 8
    return special_rows(rows, e, nan_share=0.1 if logits_kind == "nan" else 0.0, seed=rows)


def _check_topk_on_cuda(x: torch.Tensor, spec: RouterSpec, bias, dtype, where, exact) -> None:
    """The kernels on x (rows, E) against the reference on the rows without NaN (exact: every
    such row routed as the reference routes it; else the rows routed alike, for special values
    whose scores a GPU's exp may round apart from the CPU's into or out of a tie) and, unless
    exact, against select_like_gpu (softmax / sigmoid) on every row of the GPU's own scores."""
    from torchte.kernels import router as kernels

    rows, e = x.shape
    index_cuda = index_cpu = None
    if spec.dense_indices:
        index_cuda = torch.full((rows, spec.topk), 5, dtype=torch.int32, device="cuda")
        index_cpu = torch.full((rows, spec.topk), 5, dtype=torch.int32)
    bias_cuda = None if bias is None else bias.cuda()
    out = kernels._topk_forward_triton(x.to(dtype).cuda(), bias_cuda, index_cuda, spec)
    probs, routing, inter, cutoff = (a.cpu() for a in out)
    ref = kernels.topk_forward(x.to(dtype), bias, index_cpu, spec)  # CPU: the reference
    ok = ~x.isnan().any(1)
    assert routing.dtype == ref[1].dtype, where
    if exact:
        assert torch.equal(routing[ok], ref[1][ok]), where
    else:
        alike = (routing == ref[1]).reshape(rows, -1).all(1)
        ok = ok & alike
    assert probs.dtype == ref[0].dtype, where
    assert_close(probs[ok], ref[0][ok], dtype, msg=str(where))
    assert_close(inter[ok], ref[2][ok], torch.float32, msg=str(where))
    if spec.qb:
        assert_close(cutoff[ok], ref[3][ok], torch.float32, msg=str(where))
    if spec.score_function == "sqrtsoftplus" or exact:
        return  # without NaN, select_like_gpu is the reference (tested on the CPU above)
    score = selection_scores(x.to(dtype), inter, spec, bias)
    groups = spec.num_groups if spec.grouped else 0
    want_index, chosen, want_cutoff = select_like_gpu(
        score, spec.topk, groups, spec.group_topk, spec.qb
    )
    if spec.dense_indices:  # 2**31 - 1 where a row has no lane left
        assert torch.equal(routing, want_index.int()), where
    else:
        assert torch.equal(routing_to_mask(routing, spec.routing_layout, e), chosen), where
    # an all-NaN row's cutoff: NaN in both
    assert _equal_nan_aware(cutoff, want_cutoff), where
    assert not probs[~chosen].any(), where


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [32768, 1031, 7])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("logits_kind", ["random", "special", "nan"])
def test_cuda_kernels_match_the_reference_and_the_gpu_selection_on_nan(rows, case, logits_kind):
    from torchte.kernels import router as kernels

    e = case[0]
    x = _gpu_logits(rows, e, logits_kind)
    for j, spec in enumerate(specs(*case)):
        dtype = torch.bfloat16 if j == 1 else torch.float32
        bias = coarse_bias(e) if spec.score_function != "softmax" else None
        where = (case, spec, rows, logits_kind)
        _check_topk_on_cuda(x, spec, bias, dtype, where, exact=logits_kind == "random")
    ok = ~x.isnan().any(1)
    for score_function in ["softmax", "sigmoid", "sqrtsoftplus"]:
        where = (score_function, case, rows, logits_kind)
        out = [a.cpu() for a in kernels._aux_scores_triton(x.cuda(), 3, score_function, 0)]
        ref = kernels.aux_scores_forward(x, 3, score_function, 0)  # CPU: the reference
        assert torch.equal(out[1][ok], ref[1][ok]), where
        assert_close(out[0][ok], ref[0][ok], torch.float32, msg=str(where))
        assert_close(out[2][ok], ref[2][ok], torch.float32, msg=str(where))
        if not ok.all():
            assert torch.equal(out[1], select_like_gpu(out[0], 3)[1]), where


@pytest.mark.gpu
def test_cuda_pack_keys_match_the_reference():
    g = torch.Generator().manual_seed(0)
    n = 100_003
    score = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).int()
    score = score.view(torch.float32)
    score[: len(ORDERED)] = torch.tensor(ORDERED)
    index = torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int64).int()
    keys = K.pack_keys(score.cuda(), index.cuda())
    assert keys.is_cuda and torch.equal(keys.cpu(), K.pack_keys_reference(score, index))
