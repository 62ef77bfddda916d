"""Attention sinks in te.DotProductAttention: softmax_type "off-by-one" (1 added to each softmax
denominator) and "learnable" (exp(softmax_offset[h]) added, softmax_offset a Parameter), against
an fp64 model written from Transformer Engine's definition: the sink is one more score column
holding the head's logit, whose probability is dropped. Forward, the gradients of q, k, v and of
softmax_offset; formats sbhd / bshd / thd, masks, GQA, the math backend and flex's logsumexp
rescaling (forward on the CPU; forward and backward under the `gpu` marker).

Legend: b batch, sq / skv query / key lengths, h query heads, hg key/value heads, d / dv head
sizes.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from dpa_reference import cu_seqlens, output_to_bshd, padding, qkv, to_format, visible
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
from torchte.attention import packed
from torchte.attention._sinks import rescale_by_sink, sink_softmax
from torchte.attention.backends import BackendKey, choose_backend
from torchte.attention.packed import packed_attention

pytestmark = pytest.mark.usefixtures("cpu_default_device")

D, DV = 16, 8
SCALE = 0.25  # 1 / sqrt(D): exact
SINKS = [0.5, -1.0, 2.0, 0.25]  # one logit per head, exact
LENGTHS_Q, LENGTHS_KV = [5, 3], [4, 7]


# ----------------------------------------------------------------------------------------------
# The fp64 model
# ----------------------------------------------------------------------------------------------


def model(q, k, v, sink, *, mask_type="no_mask", window=(-1, -1), pad_q=None, pad_kv=None,
          arbitrary=None):  # fmt: skip
    """Attention with a sink column, fp64: q [b, sq, h, d], k [b, skv, hg, d], v [b, skv, hg,
    dv], sink [h] -> [b, sq, h, dv]. pad_* [b, s] bool (True = padding), arbitrary [b|1, 1,
    sq, skv] bool (True = masked out)."""
    q, k, v, sink = (x.to(torch.float64) for x in (q, k, v, sink))
    b, sq, h, _ = q.shape
    skv, group = k.shape[1], h // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * SCALE
    allowed = torch.ones(b, 1, sq, skv, dtype=torch.bool)
    for bi in range(b):
        len_q = sq if pad_q is None else int((~pad_q[bi]).sum())
        len_kv = skv if pad_kv is None else int((~pad_kv[bi]).sum())
        for i in range(sq):
            for j in range(skv):
                ok = visible(mask_type, window, i, j, len_q, len_kv)
                if pad_q is not None:
                    ok = ok and not bool(pad_q[bi, i]) and not bool(pad_kv[bi, j])
                allowed[bi, 0, i, j] = ok
    if arbitrary is not None:
        allowed = allowed & ~arbitrary
    scores = scores.masked_fill(~allowed, float("-inf"))
    column = sink.view(1, h, 1, 1).expand(b, h, sq, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def module(softmax_type="learnable", h=4, hg=2, fmt="bshd", mask_type="no_mask", sinks=None,
           **kwargs):  # fmt: skip
    """A DotProductAttention with softmax_offset set to `sinks` (SINKS by default)."""
    dpa = te.DotProductAttention(h, (D, DV), hg, qkv_format=fmt, attn_mask_type=mask_type,
                                 softmax_type=softmax_type, **kwargs)  # fmt: skip
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.tensor((sinks or SINKS)[:h]))
    return dpa


def mask_inputs(mask_type: str, b: int, sq: int, skv: int, as_cu: bool = False):
    """(forward kwargs, model kwargs) of a mask type."""
    if "padding" in mask_type:
        len_q = LENGTHS_Q if sq != skv else [LENGTHS_KV[0], sq - 1]
        len_kv = LENGTHS_KV if sq != skv else len_q
        pad_q, pad_kv = padding(len_q, sq), padding(len_kv, skv)
        if as_cu:
            kwargs = dict(cu_seqlens_q=cu_seqlens(len_q), cu_seqlens_kv=cu_seqlens(len_kv))
        else:
            kwargs = dict(attention_mask=(pad_q.view(b, 1, 1, sq), pad_kv.view(b, 1, 1, skv)))
        return kwargs, dict(pad_q=pad_q, pad_kv=pad_kv)
    if mask_type == "arbitrary":
        mask = torch.rand(b, 1, sq, skv, generator=torch.Generator().manual_seed(7)) < 0.4
        mask[0, 0, 1] = True  # a query row that sees no key
        return dict(attention_mask=mask), dict(arbitrary=mask)
    return {}, {}


def run(dpa, inputs, fmt, backend, kwargs, grad=True):
    """Output [b, sq, h, dv] and the gradients (q, k, v bshd; softmax_offset or None)."""
    q, k, v, dout = inputs
    leaves = [to_format(x, fmt).clone().requires_grad_(grad) for x in (q, k, v)]
    out = output_to_bshd(dpa(*leaves, attention_backend=backend, **kwargs), fmt, q.shape[2])
    if not grad:
        return out, None
    out.backward(dout)
    grads = [x.grad if fmt == "bshd" else x.grad.transpose(0, 1) for x in leaves]
    offset = dpa.softmax_offset
    return out, [*grads, offset.grad if isinstance(offset, torch.nn.Parameter) else None]


def model_run(inputs, sink, model_kwargs, learnable=True):
    """The model's output and gradients (q, k, v, sink or None)."""
    q, k, v, dout = (x.to(torch.float64).requires_grad_() for x in inputs)
    a = torch.tensor(sink, dtype=torch.float64, requires_grad=learnable)
    out = model(q, k, v, a, **model_kwargs)
    out.backward(dout)
    return out, [q.grad, k.grad, v.grad, a.grad if learnable else None]


def check(out, grads, want_out, want_grads, dtype=torch.float32):
    assert_close(out, want_out, dtype, msg="output")
    for name, got, want in zip(("q", "k", "v", "softmax_offset"), grads, want_grads, strict=True):
        if want is None:
            assert got is None, name
        else:
            assert_close_to_scale(got, want, dtype, msg=f"grad of {name}")


# ----------------------------------------------------------------------------------------------
# The parameter
# ----------------------------------------------------------------------------------------------


def test_softmax_offset_as_transformer_engine():
    learnable = te.DotProductAttention(8, D, 2, tp_size=2, softmax_type="learnable")
    offset = learnable.softmax_offset
    assert isinstance(offset, torch.nn.Parameter) and offset.requires_grad
    assert offset.shape == (4,) and offset.dtype == torch.float32 and not offset.any()
    assert list(dict(learnable.named_parameters())) == ["softmax_offset"]
    assert list(learnable.state_dict()) == ["softmax_offset"]
    off_by_one = te.DotProductAttention(8, D, softmax_type="off-by-one")
    assert not isinstance(off_by_one.softmax_offset, torch.nn.Parameter)
    assert off_by_one.softmax_offset.shape == (8,) and not off_by_one.softmax_offset.any()
    assert list(off_by_one.state_dict()) == [] and list(off_by_one.parameters()) == []
    assert te.DotProductAttention(8, D).softmax_offset is None
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        te.DotProductAttention(8, D, softmax_type="sparse")


def test_state_dict_round_trip_and_dtype_moves():
    dpa = module()
    other = te.DotProductAttention(4, (D, DV), 2, softmax_type="learnable")
    other.load_state_dict(dpa.state_dict())
    assert torch.equal(other.softmax_offset, torch.tensor(SINKS))
    other.to(torch.bfloat16)  # as Megatron's Float16Module does: the logits follow
    assert other.softmax_offset.dtype == torch.bfloat16
    q, k, v, dout = (x.to(torch.bfloat16) for x in qkv(2, 5, 5, 4, 2, D, DV, torch.bfloat16))
    out = other(q, k, v, qkv_format="sbhd", attn_mask_type="causal")
    out.backward(dout.transpose(0, 1).reshape(out.shape))
    assert out.dtype == torch.bfloat16 and other.softmax_offset.grad.dtype == torch.bfloat16


def test_wrong_offset_shape_is_named():
    dpa = module()
    dpa.softmax_offset = torch.nn.Parameter(torch.zeros(3))
    q, k, v, _ = qkv(1, 3, 3, 4, 2, D, DV, torch.float32)
    with pytest.raises(ValueError, match=r"softmax_offset must have one logit per query head"):
        dpa(q, k, v, qkv_format="bshd")


# ----------------------------------------------------------------------------------------------
# sbhd / bshd
# ----------------------------------------------------------------------------------------------

MASKS = ["no_mask", "causal", "padding", "padding_causal", "causal_bottom_right", "arbitrary"]
GQA = ((4, 4), (4, 2), (4, 1))


@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_learnable_formats_masks(fmt, mask_type):
    dpa = module(fmt=fmt, mask_type=mask_type, attention_type="cross")
    inputs = qkv(2, 5, 7, 4, 2, D, DV, torch.float32)
    kwargs, model_kwargs = mask_inputs(mask_type, 2, 5, 7)
    out, grads = run(dpa, inputs, fmt, "auto", kwargs)
    check(out, grads, *model_run(inputs, SINKS, dict(mask_type=mask_type, **model_kwargs)))


@pytest.mark.parametrize("mask_type", ["causal", "padding"])
@pytest.mark.parametrize("heads", GQA, ids=lambda hh: f"h{hh[0]}g{hh[1]}")
def test_learnable_gqa_self_attention(heads, mask_type):
    h, hg = heads
    dpa = module(h=h, hg=hg, fmt="sbhd", mask_type=mask_type)
    inputs = qkv(3, 6, 6, h, hg, D, DV, torch.float32)
    kwargs, model_kwargs = {}, {}
    if mask_type == "padding":
        pad = padding([6, 2, 5], 6)
        kwargs, model_kwargs = (
            dict(attention_mask=pad.view(3, 1, 1, 6)),
            dict(pad_q=pad, pad_kv=pad),
        )
    out, grads = run(dpa, inputs, "sbhd", "auto", kwargs)
    check(out, grads, *model_run(inputs, SINKS, dict(mask_type=mask_type, **model_kwargs)))


@pytest.mark.parametrize("backend", ["math", "auto"])
@pytest.mark.parametrize("mask_type", ["causal", "padding_causal"])
def test_off_by_one(mask_type, backend):
    dpa = module("off-by-one", fmt="sbhd", mask_type=mask_type)
    inputs = qkv(2, 5, 7, 4, 2, D, DV, torch.float32)
    kwargs, model_kwargs = mask_inputs(mask_type, 2, 5, 7, as_cu=True)
    out, grads = run(dpa, inputs, "sbhd", backend, kwargs)
    want = model_run(inputs, [0.0] * 4, dict(mask_type=mask_type, **model_kwargs), False)
    check(out, grads, *want)


def test_sliding_window_and_checkpointed_core_attention():
    dpa = module(mask_type="padding_causal", window_size=(2, 0))
    inputs = qkv(2, 5, 7, 4, 2, D, DV, torch.float32)
    kwargs, model_kwargs = mask_inputs("padding_causal", 2, 5, 7)
    model_kwargs.update(mask_type="padding_causal", window=(2, 0))
    want = model_run(inputs, SINKS, model_kwargs)
    check(*run(dpa, inputs, "bshd", "math", kwargs), *want)
    dpa.softmax_offset.grad = None
    check(*run(dpa, inputs, "bshd", "math", dict(checkpoint_core_attention=True, **kwargs)), *want)


def test_limits_of_the_sink():
    """A sink of -100 is the vanilla softmax; off-by-one is learnable at 0."""
    inputs = qkv(2, 5, 5, 4, 2, D, DV, torch.float32)
    vanilla, _ = run(module("vanilla", mask_type="causal"), inputs, "bshd", "math", {}, False)
    far, _ = run(module(mask_type="causal", sinks=[-100.0] * 4), inputs, "bshd", "math", {}, False)
    assert_close(far, vanilla, torch.float32)
    zero = module(mask_type="causal", sinks=[0.0] * 4)
    one, _ = run(module("off-by-one", mask_type="causal"), inputs, "bshd", "math", {}, False)
    assert torch.equal(run(zero, inputs, "bshd", "math", {}, False)[0], one)
    assert not torch.allclose(one, vanilla)


def test_dropout_on_the_probabilities_without_the_sink():
    """Training-mode dropout drops the probabilities after the sink's is removed (as
    Transformer Engine's unfused backend): the same draw applied to the model's
    probabilities gives the same output."""
    dpa = module(mask_type="causal", attention_dropout=0.5)
    q, k, v, _ = qkv(2, 5, 5, 4, 2, D, DV, torch.float32)
    torch.manual_seed(11)
    out = dpa(q, k, v, attention_backend="auto")
    torch.manual_seed(11)
    scores = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) * SCALE
    probs = sink_softmax(scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -torch.inf),
                         torch.tensor(SINKS).view(1, 4, 1, 1))  # fmt: skip
    want = torch.einsum("bhij,bjhd->bihd", F.dropout(probs, 0.5), v.repeat_interleave(2, 2))
    assert_close(out.view(2, 5, 4, DV), want, torch.float32)


@pytest.mark.parametrize("mask_type", ["padding_causal", "arbitrary"])
def test_flex_forward_on_cpu(mask_type):
    """flex_attention's output rescaled by its logsumexp (forward only on the CPU)."""
    dpa = module(mask_type=mask_type, window_size=(3, 0) if "causal" in mask_type else None)
    inputs = qkv(2, 5, 7, 4, 2, D, DV, torch.float32)
    kwargs, model_kwargs = mask_inputs(mask_type, 2, 5, 7)
    model_kwargs["window"] = (3, 0) if "causal" in mask_type else (-1, -1)
    with torch.no_grad():
        out, _ = run(dpa, inputs, "bshd", "flex", kwargs, grad=False)
    want = model(*inputs[:3], torch.tensor(SINKS), mask_type=mask_type, **model_kwargs)
    assert_close(out, want, torch.float32)


def test_logsumexp_rescaling_and_its_gradients():
    """The flex path's identity out = o * sigmoid(lse - a), differentiated through o and lse,
    gives the model's output and gradients (q, k, v and the sink), here with torch's own
    vanilla attention and logsumexp."""
    inputs = qkv(2, 5, 7, 4, 4, D, DV, torch.float32)
    q, k, v, dout = (x.to(torch.float64).requires_grad_() for x in inputs)
    sink = torch.tensor(SINKS, dtype=torch.float64, requires_grad=True)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * SCALE
    vanilla = torch.einsum("bhij,bjhd->bhid", torch.softmax(scores, -1), v)
    out = rescale_by_sink(vanilla, torch.logsumexp(scores, -1), sink.view(1, -1, 1))
    out.transpose(1, 2).backward(dout)
    got = [q.grad, k.grad, v.grad, sink.grad]
    check(out.transpose(1, 2), got, *model_run(inputs, SINKS, {}))
    # A row that sees no key (lse = -inf, output 0) gives 0 and no gradient.
    empty = torch.zeros(1, 4, 1, DV, dtype=torch.float64, requires_grad=True)
    lse = torch.full((1, 4, 1), -torch.inf, dtype=torch.float64, requires_grad=True)
    rescaled = rescale_by_sink(empty, lse, sink.view(1, -1, 1))
    rescaled.sum().backward()
    assert not rescaled.any() and not lse.grad.any() and torch.equal(sink.grad, got[3])


def test_backend_choice():
    def key(device, dropout=False, forced="auto", bias="no_bias"):
        return BackendKey(torch.bfloat16, device, "bshd", "causal", dropout, (-1, 0), bias,
                          False, False, True, forced, True)  # fmt: skip

    assert choose_backend(key("cpu")) == "math"
    assert choose_backend(key("cuda")) == "flex"
    assert choose_backend(key("cuda", dropout=True)) == "math"
    assert choose_backend(key("cuda", bias="post_scale_bias")) == "math"
    assert choose_backend(key("cuda", forced="math")) == "math"
    with pytest.raises(NotImplementedError, match="attention_backend='sdpa' has no attention sink"):
        choose_backend(key("cuda", forced="sdpa"))
    dpa = module()
    q, k, v, _ = qkv(1, 3, 3, 4, 2, D, DV, torch.float32)
    with pytest.raises(NotImplementedError, match="sdpa"):
        dpa(q, k, v, attention_backend="sdpa")


def test_core_attention_bias_with_sink():
    """A post-scale bias and the sink together (math)."""
    dpa = module(mask_type="causal")
    inputs = qkv(2, 5, 5, 4, 2, D, DV, torch.float32)
    bias = representable((1, 4, 5, 5), torch.float32)
    out, grads = run(
        dpa,
        inputs,
        "bshd",
        "auto",
        dict(core_attention_bias_type="post_scale_bias", core_attention_bias=bias),
    )
    q, k, v, dout = (x.to(torch.float64).requires_grad_() for x in inputs)
    a = torch.tensor(SINKS, dtype=torch.float64, requires_grad=True)
    scores = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) * SCALE + bias
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -torch.inf)
    column = a.view(1, 4, 1, 1).expand(2, 4, 5, 1)
    probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    want = torch.einsum("bhij,bjhd->bihd", probs, v.repeat_interleave(2, 2))
    want.backward(dout)
    check(out, grads, want, [q.grad, k.grad, v.grad, a.grad])


# ----------------------------------------------------------------------------------------------
# thd, the KV cache, MultiheadAttention
# ----------------------------------------------------------------------------------------------


def packed_model_run(q, k, v, dout, lens_q, lens_kv, mask_type, sink, gaps=None):
    """Each packed sequence run alone through the model; (out, grads) in the packed layout."""
    gaps = gaps or [0] * len(lens_q)
    leaves = [x.detach().to(torch.float64).requires_grad_() for x in (q, k, v)]
    a = torch.tensor(sink, dtype=torch.float64, requires_grad=True)
    pieces, row_q, row_kv = [], 0, 0
    for n_q, n_kv, gap in zip(lens_q, lens_kv, gaps, strict=True):
        one = [x[r : r + n].unsqueeze(0) for x, r, n in zip(
            leaves, (row_q, row_kv, row_kv), (n_q, n_kv, n_kv), strict=True)]  # fmt: skip
        pieces.append(model(*one, a, mask_type=mask_type.replace("padding_", "")).squeeze(0))
        pieces.append(leaves[0].new_zeros(gap, q.shape[1], v.shape[2]))
        row_q, row_kv = row_q + n_q + gap, row_kv + n_kv + gap
    out = torch.cat(pieces)
    out.backward(dout.to(torch.float64).view(out.shape))
    return out.reshape(out.shape[0], -1), [x.grad for x in leaves] + [a.grad]


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd(mask_type, heads):
    h, hg = heads
    lens_q, lens_kv = [3, 0, 5], [4, 2, 5]
    q = representable((8, h, D), torch.float32).requires_grad_()
    k = representable((11, hg, D), torch.float32).requires_grad_()
    v = representable((11, hg, DV), torch.float32).requires_grad_()
    dout = representable((8, h * DV), torch.float32)
    dpa = module(h=h, hg=hg, fmt="thd", mask_type=mask_type, attention_type="cross")
    out = dpa(q, k, v, cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    out.backward(dout)
    grads = [q.grad, k.grad, v.grad, dpa.softmax_offset.grad]
    check(out, grads, *packed_model_run(q, k, v, dout, lens_q, lens_kv, mask_type, SINKS))
    if mask_type != "padding_causal_bottom_right":
        return
    with torch.no_grad():  # flex (forward only on the CPU), its output rescaled by its lse
        flex = dpa(q, k, v, cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv),
                   attention_backend="flex")  # fmt: skip
    assert_close(flex, out, torch.float32)


def test_thd_padding_between_sequences_and_long_packs_loop():
    """Padded offsets (rows between sequences give 0), through the dense and the per-sequence
    math paths (the latter taken above a score count)."""
    lens, gaps = [3, 4], [2, 1]
    padded = cu_seqlens([3 + 2, 4 + 1])
    q = representable((10, 4, D), torch.float32).requires_grad_()
    k = representable((10, 2, D), torch.float32).requires_grad_()
    v = representable((10, 2, DV), torch.float32).requires_grad_()
    dout = representable((10, 4 * DV), torch.float32)
    want = packed_model_run(q, k, v, dout, lens, lens, "padding_causal", SINKS, gaps)
    for limit in (packed._DENSE_LIMIT, 0):
        dpa = module(fmt="thd", mask_type="padding_causal")
        q.grad = k.grad = v.grad = None
        old, packed._DENSE_LIMIT = packed._DENSE_LIMIT, limit
        try:
            out = dpa(q, k, v, cu_seqlens_q=cu_seqlens(lens), cu_seqlens_kv=cu_seqlens(lens),
                      cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)  # fmt: skip
            out.backward(dout)
        finally:
            packed._DENSE_LIMIT = old
        check(out, [q.grad, k.grad, v.grad, dpa.softmax_offset.grad], *want)


def test_packed_attention_checks_the_offset():
    q, k, v = (representable((6, 4, D), torch.float32) for _ in range(3))
    cu = cu_seqlens([2, 4])
    args = dict(causal=True, bottom_right=False, window=(-1, 0), scale=SCALE)
    with pytest.raises(ValueError, match=r"softmax_offset must be a tensor \(4,\)"):
        packed_attention(q, k, v, cu, cu, None, None, softmax_offset=torch.zeros(3), **args)
    with pytest.raises(NotImplementedError, match=r"varlen.*attention sinks"):
        packed._choose("varlen", "backend", ("cuda", torch.bfloat16, None, False, False, True,
                                             D, D, True, True))  # fmt: skip
    out = packed_attention(q, k, v, cu, cu, None, None, softmax_offset=torch.zeros(4), **args)
    assert out.shape == (6, 4, D)


def test_kv_cache_prefill_equals_uncached():
    """The KV cache's path takes the sink too: a prefill of whole sequences gives the bits of
    the uncached padding_causal call."""
    q, k, v = (representable((3, 5, heads, D), torch.float32) for heads in (4, 2, 2))
    dpa = te.DotProductAttention(4, D, 2, qkv_format="bshd", attn_mask_type="padding_causal",
                                 layer_number=1, softmax_type="learnable")  # fmt: skip
    with torch.no_grad():
        dpa.softmax_offset.copy_(torch.tensor(SINKS))
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    uncached = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    vanilla = te.DotProductAttention(4, D, 2, qkv_format="bshd", attn_mask_type="padding_causal")
    assert not torch.allclose(uncached, vanilla(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu))
    params = te.InferenceParams(3, 8, num_heads_kv=2, head_dim_k=D, dtype=torch.float32,
                                qkv_format="bshd")  # fmt: skip
    params.allocate_memory(1)
    params.pre_step(OrderedDict(enumerate([5, 3, 4])))
    assert torch.equal(dpa(q, k, v, inference_params=params), uncached)


def test_multihead_attention_carries_the_offset():
    mha = te.MultiheadAttention(64, 4, num_gqa_groups=2, softmax_type="learnable", device="cpu")
    assert "core_attention.softmax_offset" in mha.state_dict()
    assert mha.core_attention.softmax_offset.device.type == "cpu"
    x = representable((5, 2, 64), torch.float32).requires_grad_()
    mha(x).sum().backward()
    assert mha.core_attention.softmax_offset.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# CUDA: flex (rescaled by its logsumexp) forward and backward
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_type", ["causal", "padding_causal", "arbitrary"])
@pytest.mark.parametrize("backend", ["auto", "math"])
def test_cuda_dense(mask_type, backend, dtype):
    h, hg = 4, 2
    inputs = qkv(2, 5, 7, h, hg, D, DV, dtype)
    kwargs, model_kwargs = mask_inputs(mask_type, 2, 5, 7)
    with torch.device("cuda"):
        dpa = module(h=h, hg=hg, mask_type=mask_type)
    cuda_in = [x.to("cuda", dtype) for x in inputs]
    cuda_kw = {n: (tuple(t.cuda() for t in x) if isinstance(x, tuple) else x.cuda())
               for n, x in kwargs.items()}  # fmt: skip
    out, grads = run(dpa, cuda_in, "bshd", backend, cuda_kw)
    want_out, want_grads = model_run(inputs, SINKS, dict(mask_type=mask_type, **model_kwargs))
    # A kernel's bf16 output (flex: rounded, then rescaled by the sink) at the output's scale.
    assert_close_to_scale(out, want_out, dtype)
    for name, got, want in zip("qkva", grads, want_grads, strict=True):
        assert_close_to_scale(got, want, dtype, msg=f"grad of {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "flex", "math"])
def test_cuda_thd(backend):
    lens_q, lens_kv = [3, 0, 5], [4, 2, 5]
    q = representable((8, 4, D), torch.bfloat16, device="cuda").to(torch.bfloat16)
    k = representable((11, 1, D), torch.bfloat16, device="cuda").to(torch.bfloat16)
    v = representable((11, 1, DV), torch.bfloat16, device="cuda").to(torch.bfloat16)
    dout = representable((8, 4 * DV), torch.bfloat16, device="cuda").to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with torch.device("cuda"):
        dpa = module(h=4, hg=1, fmt="thd", mask_type="padding_causal", attention_type="cross")
    cu_q, cu_kv = cu_seqlens(lens_q).cuda(), cu_seqlens(lens_kv).cuda()
    out = dpa(*leaves, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, attention_backend=backend)
    out.backward(dout)
    grads = [x.grad for x in leaves] + [dpa.softmax_offset.grad]
    want_out, want_grads = packed_model_run(
        q.cpu(), k.cpu(), v.cpu(), dout.cpu(), lens_q, lens_kv, "padding_causal", SINKS
    )
    assert_close_to_scale(out, want_out, torch.bfloat16)
    for name, got, want in zip("qkva", grads, want_grads, strict=True):
        assert_close_to_scale(got, want, torch.bfloat16, msg=f"grad of {name}")
