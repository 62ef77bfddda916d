"""te.MultiheadAttention against an fp64 plain-PyTorch reference (F.layer_norm / RMS, F.linear,
explicit softmax attention, Transformer Engine's QKV row layout written out head by head) and
against a composition of the same te modules (te.LayerNormLinear / te.Linear,
te.DotProductAttention, te.Linear) holding the same weights, in fp32, bf16 and FP8.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import (
    attention,
    f64,
    gather_heads,
    kv_rows,
    linear,
    norm,
    qkv_rows,
    rnd,
    set_representable,
)
from tolerances import assert_close, assert_close_to_scale, representable, same_bits

import torchte as te
from torchte import recipe
from torchte.attention.dot_product_attention import DotProductAttention

pytestmark = pytest.mark.usefixtures("cpu_default_device")

HIDDEN, HEADS, HN, S, SK, B = 64, 4, 16, 5, 7, 2
F32 = torch.float32
EPS = 1e-5

# name -> MultiheadAttention keyword arguments (beyond sizes, dropout 0).
CASES = {
    "self-ln-split-gqa": dict(input_layernorm=True, num_gqa_groups=2),
    "self-ln-fused-interleaved-rms": dict(
        input_layernorm=True, fuse_qkv_params=True, num_gqa_groups=2, normalization="RMSNorm"
    ),
    "self-ln-fused-plain-mha": dict(
        input_layernorm=True, fuse_qkv_params=True, qkv_weight_interleaved=False
    ),
    "self-fused-interleaved-mqa": dict(fuse_qkv_params=True, num_gqa_groups=1),
    "cross-ln-split-gqa": dict(input_layernorm=True, num_gqa_groups=2, attention_type="cross"),
    "cross-fused-interleaved": dict(
        fuse_qkv_params=True, num_gqa_groups=2, attention_type="cross", attn_mask_type="no_mask"
    ),
}

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}


def make_mha(dtype, **kwargs) -> te.MultiheadAttention:
    kwargs.setdefault("attn_mask_type", "causal")
    mha = te.MultiheadAttention(
        HIDDEN, HEADS, attention_dropout=0.0, layernorm_epsilon=EPS, params_dtype=dtype, **kwargs
    )
    set_representable(mha, dtype, scale=0.125)
    return mha


def inputs(kwargs, dtype, fmt="sbhd"):
    """(hidden_states, encoder_output or None), exact in dtype, requiring grad."""
    shape = (S, B, HIDDEN) if fmt == "sbhd" else (B, S, HIDDEN)
    x = representable(shape, dtype).to(dtype).requires_grad_(True)
    enc = None
    if kwargs.get("attention_type") == "cross":
        enc_shape = (SK, B, HIDDEN) if fmt == "sbhd" else (B, SK, HIDDEN)
        enc = representable(enc_shape, dtype).to(dtype).requires_grad_(True)
    return x, enc


def _weight(p, prefix, names):
    """The fused weight and bias of a projection: `weight` or its parts concatenated."""
    if prefix + "weight" in p:
        return p[prefix + "weight"], p[prefix + "bias"]
    weights = [p[f"{prefix}{n}_weight"] for n in names]
    biases = [p[f"{prefix}{n}_bias"] for n in names]
    return torch.cat(weights), torch.cat(biases)


def reference(mha, kwargs, x, enc, dtype):
    """(out (s, b, h) fp64, {name: fp64 leaf}, x64, enc64) from mha's parameters."""
    p = {name: f64(t) for name, t in mha.named_parameters()}
    x64, enc64 = f64(x), f64(enc)
    ng = kwargs.get("num_gqa_groups", HEADS)
    interleaved = kwargs.get("fuse_qkv_params", False) and kwargs.get(
        "qkv_weight_interleaved", True
    )
    ln = kwargs.get("input_layernorm", False)
    normalization = kwargs.get("normalization", "LayerNorm")
    cross = kwargs.get("attention_type") == "cross"
    prefix = (
        ("layernorm_query." if ln else "query_layer.")
        if cross
        else ("layernorm_qkv." if ln else "qkv.")
    )
    z = x64
    if ln:
        ln_w, ln_b = p[prefix + "layer_norm_weight"], p.get(prefix + "layer_norm_bias")
        z = rnd(norm(x64, ln_w, ln_b, normalization, EPS), dtype)
    if cross:
        w, b = _weight(p, prefix, ["query"])
        q = linear(z, w, b, dtype).reshape(S, B, HEADS, HN)
        w_kv, b_kv = _weight(p, "key_value.", ["key", "value"])
        y_kv = linear(enc64, w_kv, b_kv, dtype)
        k_rows, v_rows = kv_rows(ng, HN, interleaved)
        k, v = gather_heads(y_kv, k_rows), gather_heads(y_kv, v_rows)
    else:
        w, b = _weight(p, prefix, ["query", "key", "value"])
        y = linear(z, w, b, dtype)
        q_rows, k_rows, v_rows = qkv_rows(HEADS, ng, HN, interleaved)
        q, k, v = (gather_heads(y, rows) for rows in (q_rows, k_rows, v_rows))
    causal = kwargs.get("attn_mask_type", "causal") == "causal"
    context = attention(q, k, v, causal, dtype)
    out = linear(context, p["proj.weight"], p["proj.bias"], dtype)
    return out, p, x64, enc64


def _grads(mha):
    return {name: t.grad for name, t in mha.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_fp64_reference(case, dtype):
    kwargs = CASES[case]
    mha = make_mha(dtype, **kwargs)
    x, enc = inputs(kwargs, dtype)
    out = mha(x, encoder_output=enc)
    ref, p, x64, enc64 = reference(mha, kwargs, x, enc, dtype)
    assert out.shape == (S, B, HIDDEN) and out.dtype == dtype
    if dtype != torch.float32:
        # bf16: a one-ulp difference in the rounded context moves proj's sums by about an
        # ulp of their largest terms; gradients: see the composition test (same bits).
        assert_close_to_scale(out, ref, dtype)
        return
    assert_close(out, ref, dtype)
    grad = representable(out.shape, dtype)
    out.backward(grad)
    ref.backward(grad.double())
    assert_close_to_scale(x.grad, x64.grad, dtype)
    if enc is not None:
        assert_close_to_scale(enc.grad, enc64.grad, dtype)
    for name, g in _grads(mha).items():
        assert_close_to_scale(g, p[name].grad, dtype, msg=name)


class Composition(torch.nn.Module):
    """The same te modules under the same names, called one after the other; q, k and v
    picked from the projection's output by the reference's row layout."""

    def __init__(self, dtype, kwargs):
        super().__init__()
        self.kwargs = kwargs
        ng = kwargs.get("num_gqa_groups", HEADS)
        fused = kwargs.get("fuse_qkv_params", False)
        self.interleaved = fused and kwargs.get("qkv_weight_interleaved", True)
        ln = kwargs.get("input_layernorm", False)
        common = dict(params_dtype=dtype, bias=True)
        norm_kw = dict(eps=EPS, normalization=kwargs.get("normalization", "LayerNorm"))
        q_size, kv_size = HEADS * HN, ng * HN
        if kwargs.get("attention_type") == "cross":
            split = None if fused else ("query",)
            if ln:
                self.layernorm_query = te.LayerNormLinear(
                    HIDDEN, q_size, parameters_split=split, **norm_kw, **common
                )
            else:
                self.query_layer = te.Linear(HIDDEN, q_size, **common)
            kv_split = None if fused else ("key", "value")
            self.key_value = te.Linear(HIDDEN, 2 * kv_size, parameters_split=kv_split, **common)
        else:
            split = None if fused else {"query": q_size, "key": kv_size, "value": kv_size}
            if ln:
                self.layernorm_qkv = te.LayerNormLinear(
                    HIDDEN, q_size + 2 * kv_size, parameters_split=split, **norm_kw, **common
                )
            else:
                self.qkv = te.Linear(HIDDEN, q_size + 2 * kv_size, parameters_split=split, **common)
        self.core_attention = DotProductAttention(
            HEADS,
            HN,
            num_gqa_groups=ng,
            attention_dropout=0.0,
            attn_mask_type=kwargs.get("attn_mask_type", "causal"),
            attention_type=kwargs.get("attention_type", "self"),
        )
        self.proj = te.Linear(q_size, HIDDEN, **common)
        self.groups = ng

    def forward(self, x, enc):
        mask = self.kwargs.get("attn_mask_type", "causal")
        if self.kwargs.get("attention_type") == "cross":
            layer = getattr(self, "layernorm_query", None) or self.query_layer
            q = layer(x).reshape(S, B, HEADS, HN)
            y_kv = self.key_value(enc)
            k_rows, v_rows = kv_rows(self.groups, HN, self.interleaved)
            k, v = gather_heads(y_kv, k_rows), gather_heads(y_kv, v_rows)
        else:
            layer = getattr(self, "layernorm_qkv", None) or self.qkv
            y = layer(x)
            rows = qkv_rows(HEADS, self.groups, HN, self.interleaved)
            q, k, v = (gather_heads(y, r) for r in rows)
        return self.proj(self.core_attention(q, k, v, attn_mask_type=mask))


def _assert_same(a, b, msg):
    assert same_bits(a.detach().float(), b.detach().float()), msg


def _run_both(mha, comp, kwargs, dtype, steps=2):
    """Forward and backward both for `steps` steps, comparing bits each step."""
    for _ in range(steps):
        x, enc = inputs(kwargs, dtype)
        x2 = x.detach().clone().requires_grad_(True)
        enc2 = None if enc is None else enc.detach().clone().requires_grad_(True)
        out = mha(x, encoder_output=enc)
        out2 = comp(x2, enc2)
        _assert_same(out, out2, "output")
        grad = representable(out.shape, dtype).to(dtype)
        out.backward(grad)
        out2.backward(grad)
        _assert_same(x.grad, x2.grad, "input gradient")
        if enc is not None:
            _assert_same(enc.grad, enc2.grad, "encoder_output gradient")
    comp_params = dict(comp.named_parameters())
    for name, param in mha.named_parameters():
        _assert_same(param.grad, comp_params[name].grad, name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bits_as_composition_of_te_modules(case, dtype):
    kwargs = CASES[case]
    mha = make_mha(dtype, **kwargs)
    comp = Composition(dtype, kwargs)
    comp.load_state_dict(mha.state_dict())
    _run_both(mha, comp, kwargs, dtype)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("case", ["self-ln-split-gqa", "cross-fused-interleaved"])
def test_fp8_gemms_same_bits_as_composition(name, case):
    """Under te.autocast the projections run FP8 GEMMs, attention high precision: the layer
    equals the composition of the same te modules under the same recipe, step after step."""
    dtype = torch.bfloat16
    kwargs = CASES[case]
    mha = make_mha(dtype, **kwargs)
    comp = Composition(dtype, kwargs)
    comp.load_state_dict(mha.state_dict())
    with te.autocast(recipe=RECIPES[name]()):
        _run_both(mha, comp, kwargs, dtype, steps=1)
    with te.autocast(recipe=RECIPES[name]()):
        _run_both(mha, comp, kwargs, dtype, steps=1)
    # The projections did run FP8: the output differs from the high-precision one.
    x, enc = inputs(kwargs, dtype)
    with torch.no_grad(), te.autocast(recipe=RECIPES[name]()):
        fp8_out = mha(x, encoder_output=enc)
    with torch.no_grad():
        assert not torch.equal(fp8_out, mha(x, encoder_output=enc))


def test_bshd_equals_sbhd_transposed():
    kwargs = CASES["self-ln-fused-interleaved-rms"]
    sbhd = make_mha(torch.float32, **kwargs)
    bshd = te.MultiheadAttention(
        HIDDEN, HEADS, attention_dropout=0.0, qkv_format="bshd", **kwargs,
        attn_mask_type="causal",
    )  # fmt: skip
    bshd.load_state_dict(sbhd.state_dict())
    x, _ = inputs(kwargs, torch.float32)
    assert_close(bshd(x.transpose(0, 1)).transpose(0, 1), sbhd(x), torch.float32)


def test_return_bias_and_layernorm_output():
    kwargs = dict(CASES["self-ln-split-gqa"], return_bias=True, return_layernorm_output=True)
    mha = make_mha(torch.float32, **kwargs)
    plain = make_mha(torch.float32, **CASES["self-ln-split-gqa"])
    plain.load_state_dict(mha.state_dict())
    x, _ = inputs(kwargs, torch.float32)
    out, bias, ln_out = mha(x)
    assert torch.equal(bias, mha.proj.bias)
    assert_close(out + bias, plain(x), torch.float32)
    qkv = mha.layernorm_qkv
    expected = norm(x.double(), qkv.layer_norm_weight.double(), qkv.layer_norm_bias.double(),
                    "LayerNorm", EPS)  # fmt: skip
    assert ln_out.shape == x.shape
    assert_close(ln_out, expected, torch.float32)


def test_parameter_names_equal_transformer_engines():
    """state_dict parameter names as Transformer Engine 2.x documents its submodules and
    parameters (written here, not read from torchte)."""
    expected = {
        "self-ln-split": [
            "layernorm_qkv.layer_norm_weight",
            "layernorm_qkv.layer_norm_bias",
            "layernorm_qkv.query_weight",
            "layernorm_qkv.query_bias",
            "layernorm_qkv.key_weight",
            "layernorm_qkv.key_bias",
            "layernorm_qkv.value_weight",
            "layernorm_qkv.value_bias",
            "proj.weight",
            "proj.bias",
        ],
        "self-fused": ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"],
        "cross-ln-split": [
            "layernorm_query.layer_norm_weight",
            "layernorm_query.layer_norm_bias",
            "layernorm_query.query_weight",
            "layernorm_query.query_bias",
            "key_value.key_weight",
            "key_value.key_bias",
            "key_value.value_weight",
            "key_value.value_bias",
            "proj.weight",
            "proj.bias",
        ],
        "cross-fused-rms": [
            "layernorm_query.layer_norm_weight",
            "layernorm_query.weight",
            "layernorm_query.bias",
            "key_value.weight",
            "key_value.bias",
            "proj.weight",
            "proj.bias",
        ],
        "cross-plain": [
            "query_layer.weight",
            "query_layer.bias",
            "key_value.key_weight",
            "key_value.key_bias",
            "key_value.value_weight",
            "key_value.value_bias",
            "proj.weight",
            "proj.bias",
        ],
    }
    built = {
        "self-ln-split": te.MultiheadAttention(HIDDEN, HEADS, input_layernorm=True),
        "self-fused": te.MultiheadAttention(HIDDEN, HEADS, fuse_qkv_params=True),
        "cross-ln-split": te.MultiheadAttention(
            HIDDEN, HEADS, input_layernorm=True, attention_type="cross"
        ),
        "cross-fused-rms": te.MultiheadAttention(
            HIDDEN,
            HEADS,
            input_layernorm=True,
            attention_type="cross",
            fuse_qkv_params=True,
            normalization="RMSNorm",
        ),
        "cross-plain": te.MultiheadAttention(HIDDEN, HEADS, attention_type="cross"),
    }
    for name, mha in built.items():
        keys = [k for k in mha.state_dict() if not k.endswith("_extra_state")]
        assert sorted(keys) == sorted(expected[name]), name
        # Each GEMM module's FP8 state travels as its own _extra_state, as in Transformer Engine.
        for module in {k.split(".")[0] for k in expected[name]}:
            assert f"{module}._extra_state" in mha.state_dict(), module


def test_qkv_weight_shapes_and_gqa_sizes():
    mha = te.MultiheadAttention(96, 6, kv_channels=8, num_gqa_groups=3, fuse_qkv_params=True)
    assert mha.qkv.weight.shape == (6 * 8 + 2 * 3 * 8, 96)
    assert mha.proj.weight.shape == (96, 48)


def test_qk_norm_rmsnorm_over_head_dim():
    kwargs = dict(CASES["self-fused-interleaved-mqa"], qk_norm_type="RMSNorm", qk_norm_eps=1e-6)
    mha = make_mha(torch.float32, **kwargs)
    assert mha.q_norm.weight.shape == (HN,) and mha.k_norm.weight.shape == (HN,)
    with torch.no_grad():
        mha.q_norm.weight.copy_(representable(HN, torch.float32, scale=0.5) + 1)
        mha.k_norm.weight.copy_(representable(HN, torch.float32, scale=0.5) + 1)
    x, _ = inputs(kwargs, torch.float32)
    p = {name: t.detach().double() for name, t in mha.named_parameters()}
    y = linear(x.double(), p["qkv.weight"], p["qkv.bias"], torch.float32)
    rows = qkv_rows(HEADS, 1, HN, True)
    q, k, v = (gather_heads(y, r) for r in rows)
    q = rnd(norm(q, p["q_norm.weight"], None, "RMSNorm", 1e-6), torch.float32)
    k = rnd(norm(k, p["k_norm.weight"], None, "RMSNorm", 1e-6), torch.float32)
    ctx = attention(q, k, v, True, torch.float32)
    ref = linear(ctx, p["proj.weight"], p["proj.bias"], torch.float32)
    assert_close(mha(x), ref, torch.float32)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(attention_type="both"), ValueError),
        (dict(qkv_format="sbh"), ValueError),
        (dict(num_gqa_groups=3), ValueError),
        (dict(layer_number=0), ValueError),
        (dict(qk_norm_type="BatchNorm"), ValueError),
        (dict(ub_overlap_ag=True), NotImplementedError),
        (dict(tp_size=2), ValueError),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        te.MultiheadAttention(HIDDEN, HEADS, **kwargs)


def test_cross_attention_needs_encoder_output():
    mha = te.MultiheadAttention(HIDDEN, HEADS, attention_type="cross")
    with pytest.raises(ValueError, match="encoder_output"):
        mha(torch.zeros(S, B, HIDDEN))


def test_fp8_mha_recipe_raises():
    mha = te.MultiheadAttention(HIDDEN, HEADS)
    fp8_mha = recipe.DelayedScaling(fp8_mha=True)
    with pytest.raises(NotImplementedError, match="fp8_mha"), te.autocast(recipe=fp8_mha):
        mha(torch.zeros(S, B, HIDDEN))


def _rotate_reference(t, freqs):
    """t (s, b, n, hn) rotated by angles freqs (s, 1, 1, hn) in fp64: t cos + rot(t) sin,
    rot(x) = [-x2, x1] for the halves x1, x2 of the last dim (non-interleaved RoPE)."""
    x1, x2 = t.chunk(2, dim=-1)
    return t * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()


def test_rotary_pos_emb_rotates_queries_and_keys():
    kwargs = CASES["self-ln-fused-interleaved-rms"]
    mha = make_mha(torch.float32, **kwargs)
    x, _ = inputs(kwargs, torch.float32)
    half = torch.arange(S, dtype=torch.float32)[:, None] * representable(HN // 2, torch.float32)
    freqs = torch.cat((half, half), dim=-1).reshape(S, 1, 1, HN)
    p = {name: t.detach().double() for name, t in mha.named_parameters()}
    qkv = mha.layernorm_qkv
    z = rnd(norm(x.double(), p["layernorm_qkv.layer_norm_weight"], None, "RMSNorm", EPS), F32)
    y = linear(z, p["layernorm_qkv.weight"], p["layernorm_qkv.bias"], F32)
    q, k, v = (gather_heads(y, r) for r in qkv_rows(HEADS, 2, HN, True))
    q = rnd(_rotate_reference(q, freqs.double()), F32)
    k = rnd(_rotate_reference(k, freqs.double()), F32)
    ref = linear(attention(q, k, v, True, F32), p["proj.weight"], p["proj.bias"], F32)
    assert qkv.normalization == "RMSNorm"
    assert_close(mha(x, rotary_pos_emb=freqs), ref, F32)
    # A (query, key) pair with the same frequencies is the same rotation.
    assert torch.equal(mha(x, rotary_pos_emb=(freqs, freqs)), mha(x, rotary_pos_emb=freqs))


def test_inference_params_of_another_type_raise():
    mha = te.MultiheadAttention(HIDDEN, HEADS)
    with pytest.raises(TypeError, match=r"inference_params must be a te\.InferenceParams"):
        mha(torch.zeros(S, B, HIDDEN), inference_params=object())
