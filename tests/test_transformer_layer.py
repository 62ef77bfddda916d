"""te.TransformerLayer against an fp64 plain-PyTorch layer (norms, F.linear, explicit softmax
attention, gelu / swiglu, residual adds) in fp32, forward and gradients; against the same te
modules composed by hand (te.MultiheadAttention, te.LayerNormMLP) bit for bit in bf16 and under
FP8 recipes; dropout and drop path; parameter names as Transformer Engine names them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention_reference import attention, f64, gather_heads, kv_rows, norm, qkv_rows, rnd
from attention_reference import set_representable as _set_representable
from tolerances import assert_close, assert_close_to_scale, representable, same_bits

import torchte as te
from torchte import recipe

pytestmark = pytest.mark.usefixtures("cpu_default_device")

HIDDEN, FFN, HEADS, HN, S, SK, B = 64, 96, 4, 16, 5, 6, 2
EPS = 1e-5
F32 = torch.float32

CASES = {
    "default-gqa": dict(num_gqa_groups=2),
    "rms-swiglu-fused": dict(
        normalization="RMSNorm", activation="swiglu", fuse_qkv_params=True, num_gqa_groups=2
    ),
    "post-layernorm-residual": dict(apply_residual_connection_post_layernorm=True),
    "output-layernorm": dict(output_layernorm=True, fuse_qkv_params=True),
    "output-and-post-layernorm": dict(
        output_layernorm=True, apply_residual_connection_post_layernorm=True
    ),
    "parallel-attention-mlp": dict(parallel_attention_mlp=True, num_gqa_groups=1),
    "decoder": dict(layer_type="decoder", num_gqa_groups=2),
    "decoder-post-layernorm-rms": dict(
        layer_type="decoder",
        apply_residual_connection_post_layernorm=True,
        normalization="RMSNorm",
        zero_centered_gamma=True,
    ),
}

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}


def make_layer(dtype, **kwargs) -> te.TransformerLayer:
    kwargs.setdefault("hidden_dropout", 0.0)
    layer = te.TransformerLayer(
        HIDDEN, FFN, HEADS, attention_dropout=0.0, layernorm_epsilon=EPS, params_dtype=dtype,
        **kwargs,
    )  # fmt: skip
    _set_representable(layer, dtype, scale=0.125)
    return layer


def inputs(kwargs, dtype):
    x = representable((S, B, HIDDEN), dtype).to(dtype).requires_grad_(True)
    enc = None
    if kwargs.get("layer_type") == "decoder":
        enc = representable((SK, B, HIDDEN), dtype).to(dtype).requires_grad_(True)
    return x, enc


def _gelu(t):
    return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))


def _activation(h, name):
    if name == "swiglu":
        a, b = h.chunk(2, dim=-1)
        return a * torch.sigmoid(a) * b
    return _gelu(h)


class Reference:
    """The fp64 layer over the module's parameters (fp64 leaves in `p`)."""

    def __init__(self, layer, kwargs):
        self.p = {name: f64(t) for name, t in layer.named_parameters()}
        self.kw = kwargs
        self.normalization = kwargs.get("normalization", "LayerNorm")
        self.zc = kwargs.get("zero_centered_gamma", False)
        self.groups = kwargs.get("num_gqa_groups", HEADS)
        fused = kwargs.get("fuse_qkv_params", False)
        self.interleaved = fused and kwargs.get("qkv_weight_interleaved", True)

    def _norm(self, x, prefix):
        p = self.p
        return rnd(norm(x, p[prefix + "weight"], p.get(prefix + "bias"), self.normalization,
                        EPS, self.zc), F32)  # fmt: skip

    def _proj(self, x, prefix, names):
        p = self.p
        if prefix + "weight" in p:
            w, b = p[prefix + "weight"], p[prefix + "bias"]
        else:
            w = torch.cat([p[f"{prefix}{n}_weight"] for n in names])
            b = torch.cat([p[f"{prefix}{n}_bias"] for n in names])
        return rnd(F.linear(x, w, b), F32)

    def attention_block(self, prefix, x, enc, ln: bool):
        """(proj output without its bias, proj bias, norm output or None)."""
        z = self._norm(x, prefix + ("layernorm_query." if enc is not None else "layernorm_qkv.")
                       + "layer_norm_") if ln else x  # fmt: skip
        if enc is None:
            y = self._proj(
                z, prefix + ("layernorm_qkv." if ln else "qkv."), ["query", "key", "value"]
            )
            rows = qkv_rows(HEADS, self.groups, HN, self.interleaved)
            q, k, v = (gather_heads(y, r) for r in rows)
        else:
            y = self._proj(z, prefix + "layernorm_query.", ["query"])
            q = y.reshape(*y.shape[:-1], HEADS, HN)
            y_kv = self._proj(enc, prefix + "key_value.", ["key", "value"])
            k, v = (gather_heads(y_kv, r) for r in kv_rows(self.groups, HN, self.interleaved))
        context = attention(q, k, v, enc is None, F32)
        out = rnd(F.linear(context, self.p[prefix + "proj.weight"]), F32)
        return out, self.p[prefix + "proj.bias"], z if ln else None

    def mlp(self, x):
        p, pre = self.p, "layernorm_mlp."
        z = self._norm(x, pre + "layer_norm_")
        h = rnd(F.linear(z, p[pre + "fc1_weight"], p[pre + "fc1_bias"]), F32)
        a = rnd(_activation(h, self.kw.get("activation", "gelu")), F32)
        return rnd(F.linear(a, p[pre + "fc2_weight"]), F32), p[pre + "fc2_bias"], z

    def __call__(self, x, enc):
        kw = self.kw
        post, out_ln = (
            kw.get("apply_residual_connection_post_layernorm"),
            kw.get("output_layernorm"),
        )
        out, bias, ln = self.attention_block("self_attention.", x, None, not out_ln)
        if kw.get("parallel_attention_mlp"):
            m, m_bias, _ = self.mlp(x)
            return x + (out + bias + m + m_bias)
        h = (ln if post and not out_ln else x) + (out + bias)
        if enc is not None:
            out, bias, ln = self.attention_block("inter_attention.", h, enc, True)
            h = (ln if post else h) + (out + bias)
        m, m_bias, ln = self.mlp(h)
        y = (ln if post else h) + (m + m_bias)
        if out_ln:
            y = self._norm(y, "layernorm.")
        return y


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_forward_and_gradients_match_fp64_reference(case):
    kwargs = CASES[case]
    layer = make_layer(F32, **kwargs)
    x, enc = inputs(kwargs, F32)
    out = layer(x, encoder_output=enc)
    ref_fn = Reference(layer, kwargs)
    x64, enc64 = f64(x), f64(enc)
    ref = ref_fn(x64, enc64)
    assert out.shape == x.shape
    assert_close(out, ref, F32)
    grad = representable(out.shape, F32)
    out.backward(grad)
    ref.backward(grad.double())
    assert_close_to_scale(x.grad, x64.grad, F32)
    if enc is not None:
        assert_close_to_scale(enc.grad, enc64.grad, F32)
    for name, param in layer.named_parameters():
        assert_close_to_scale(param.grad, ref_fn.p[name].grad, F32, msg=name)


class Composition(torch.nn.Module):
    """The pre-norm encoder or decoder layer composed by hand from the same te modules under
    the same names; dropout and drop path drawn in the same order as the layer draws them."""

    def __init__(self, dtype, kwargs, hidden_dropout=0.0, drop_path=0.0):
        super().__init__()
        self.p, self.drop = hidden_dropout, drop_path
        groups = kwargs.get("num_gqa_groups")
        attn = dict(attention_dropout=0.0, layernorm_epsilon=EPS, params_dtype=dtype,
                    num_gqa_groups=groups, input_layernorm=True, return_bias=True)  # fmt: skip
        self.self_attention = te.MultiheadAttention(HIDDEN, HEADS, **attn)
        if kwargs.get("layer_type") == "decoder":
            self.inter_attention = te.MultiheadAttention(
                HIDDEN, HEADS, attention_type="cross", attn_mask_type="no_mask", **attn
            )
        self.layernorm_mlp = te.LayerNormMLP(
            HIDDEN, FFN, eps=EPS, params_dtype=dtype, return_bias=True
        )

    def _add(self, out, bias, residual, drop_path=True):
        y = F.dropout(out + bias, p=self.p, training=self.training)
        if drop_path and self.drop and self.training:
            keep = 1 - self.drop
            mask = (keep + torch.rand((y.shape[0], 1, 1), dtype=y.dtype)).floor_()
            y = y.div(keep) * mask
        return residual + y

    def forward(self, x, enc):
        h = self._add(*self.self_attention(x), x)
        if enc is not None:
            h = self._add(*self.inter_attention(h, encoder_output=enc), h, drop_path=False)
        return self._add(*self.layernorm_mlp(h), h)


def _same(a, b, msg):
    assert same_bits(a.detach().float(), b.detach().float()), msg


def _compare(layer, comp, kwargs, dtype, steps=2, seed=None):
    for step in range(steps):
        x, enc = inputs(kwargs, dtype)
        x2 = x.detach().clone().requires_grad_(True)
        enc2 = None if enc is None else enc.detach().clone().requires_grad_(True)
        if seed is not None:
            torch.manual_seed(seed + step)
        out = layer(x, encoder_output=enc)
        if seed is not None:
            torch.manual_seed(seed + step)
        out2 = comp(x2, enc2)
        _same(out, out2, "output")
        grad = representable(out.shape, dtype).to(dtype)
        out.backward(grad)
        out2.backward(grad)
        _same(x.grad, x2.grad, "input gradient")
        if enc is not None:
            _same(enc.grad, enc2.grad, "encoder_output gradient")
    params = dict(comp.named_parameters())
    for name, param in layer.named_parameters():
        _same(param.grad, params[name].grad, name)


@pytest.mark.parametrize("case", ["default-gqa", "decoder"])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_same_bits_as_composition_of_te_modules(case, dtype):
    kwargs = CASES[case]
    layer = make_layer(dtype, **kwargs)
    comp = Composition(dtype, kwargs)
    comp.load_state_dict(layer.state_dict())
    _compare(layer, comp, kwargs, dtype)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("case", ["default-gqa", "decoder"])
def test_fp8_gemms_same_bits_as_composition(name, case):
    """Under te.autocast every GEMM of the layer runs FP8, attention high precision; the
    layer equals the composition under the same recipe, step after step."""
    kwargs = CASES[case]
    layer = make_layer(torch.bfloat16, **kwargs)
    comp = Composition(torch.bfloat16, kwargs)
    comp.load_state_dict(layer.state_dict())
    for _ in range(2):
        with te.autocast(recipe=RECIPES[name]()):
            _compare(layer, comp, kwargs, torch.bfloat16, steps=1)
    x, enc = inputs(kwargs, torch.bfloat16)
    with torch.no_grad():
        with te.autocast(recipe=RECIPES[name]()):
            fp8_out = layer(x, encoder_output=enc)
        assert not torch.equal(fp8_out, layer(x, encoder_output=enc))


def test_hidden_dropout_and_drop_path_draw_as_the_composition():
    """In training, dropout after each block and drop path per sample: the same draws from
    torch's generator as the composition; in eval, neither."""
    kwargs = dict(CASES["decoder"], hidden_dropout=0.25, drop_path_rate=0.5)
    layer = make_layer(F32, **kwargs)
    comp = Composition(F32, kwargs, hidden_dropout=0.25, drop_path=0.5)
    comp.load_state_dict(layer.state_dict())
    _compare(layer, comp, kwargs, F32, steps=2, seed=7)
    x, enc = inputs(kwargs, F32)
    torch.manual_seed(3)
    train_out = layer(x, encoder_output=enc)
    layer.eval()
    comp.eval()
    eval_out = layer(x, encoder_output=enc)
    assert not torch.equal(train_out, eval_out)
    assert torch.equal(eval_out, comp(x, enc))


def test_drop_path_drops_whole_samples():
    from torchte._transformer_parts import DropPath

    drop = DropPath(0.5)
    x = torch.ones(64, 3, 8)
    y = drop(x)
    per_sample = y.reshape(64, -1)
    kept = per_sample[:, 0] != 0
    assert torch.equal(per_sample[kept], torch.full_like(per_sample[kept], 2.0))
    assert torch.equal(per_sample[~kept], torch.zeros_like(per_sample[~kept]))
    assert 0 < kept.sum() < 64
    drop.eval()
    assert torch.equal(drop(x), x)


def test_drop_path_rate_one_drops_every_sample_and_draws_as_any_rate():
    """drop_path_rate=1.0 (Transformer Engine accepts it): the branch is all zeros in training
    (no NaN from 1 / (1 - p)), its gradient zero, the RNG advanced as at any other rate; a
    TransformerLayer built with it then computes residual + nothing in training."""
    from torchte._transformer_parts import DropPath

    drop = DropPath(1.0)
    x = torch.randn(16, 3, 8, requires_grad=True)
    torch.manual_seed(0)
    y = drop(x)
    after_one = torch.rand(1)
    torch.manual_seed(0)
    DropPath(0.5)(x.detach())
    assert torch.equal(torch.rand(1), after_one)
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    drop.eval()
    assert torch.equal(drop(x), x)
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, drop_path_rate=1.0, hidden_dropout=0.0)
    h = torch.randn(S, B, HIDDEN)
    with torch.no_grad():
        assert torch.equal(layer(h), h)  # both residual branches dropped
        layer.eval()
        assert not torch.equal(layer(h), h)


def test_parameter_names_equal_transformer_engines():
    """Names as Transformer Engine 2.x names its submodules and parameters (written here)."""
    mha = [
        "self_attention.layernorm_qkv.layer_norm_weight",
        "self_attention.layernorm_qkv.layer_norm_bias",
        "self_attention.layernorm_qkv.query_weight",
        "self_attention.layernorm_qkv.query_bias",
        "self_attention.layernorm_qkv.key_weight",
        "self_attention.layernorm_qkv.key_bias",
        "self_attention.layernorm_qkv.value_weight",
        "self_attention.layernorm_qkv.value_bias",
        "self_attention.proj.weight",
        "self_attention.proj.bias",
    ]
    mlp = [
        "layernorm_mlp.layer_norm_weight",
        "layernorm_mlp.layer_norm_bias",
        "layernorm_mlp.fc1_weight",
        "layernorm_mlp.fc1_bias",
        "layernorm_mlp.fc2_weight",
        "layernorm_mlp.fc2_bias",
    ]
    inter = [
        "inter_attention.layernorm_query.layer_norm_weight",
        "inter_attention.layernorm_query.layer_norm_bias",
        "inter_attention.layernorm_query.query_weight",
        "inter_attention.layernorm_query.query_bias",
        "inter_attention.key_value.key_weight",
        "inter_attention.key_value.key_bias",
        "inter_attention.key_value.value_weight",
        "inter_attention.key_value.value_bias",
        "inter_attention.proj.weight",
        "inter_attention.proj.bias",
    ]
    output_ln_fused = [
        "self_attention.qkv.weight",
        "self_attention.qkv.bias",
        "self_attention.proj.weight",
        "self_attention.proj.bias",
        *mlp,
        "layernorm.weight",
        "layernorm.bias",
    ]
    built = {
        "encoder": (te.TransformerLayer(HIDDEN, FFN, HEADS), mha + mlp),
        "decoder": (
            te.TransformerLayer(HIDDEN, FFN, HEADS, layer_type="decoder"),
            mha + inter + mlp,
        ),
        "output-ln-fused": (
            te.TransformerLayer(HIDDEN, FFN, HEADS, output_layernorm=True, fuse_qkv_params=True),
            output_ln_fused,
        ),
    }
    for name, (layer, expected) in built.items():
        keys = [k for k in layer.state_dict() if not k.endswith("_extra_state")]
        assert sorted(keys) == sorted(expected), name


def test_swiglu_mlp_shape():
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, activation="swiglu", normalization="RMSNorm")
    assert layer.layernorm_mlp.fc1_weight.shape == (2 * FFN, HIDDEN)
    assert layer.self_attention.layernorm_qkv.layer_norm_bias is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(layer_type="middle"), ValueError, "layer_type"),
        (dict(attn_input_format="hsbd"), ValueError, "attn_input_format"),
        (dict(parallel_attention_mlp=True, layer_type="decoder"), ValueError, "parallel"),
        (dict(parallel_attention_mlp=True, output_layernorm=True), ValueError, "parallel"),
        (dict(fuse_wgrad_accumulation=True), ValueError, "fuse_qkv_params"),
        (dict(ub_tp_comm_overlap=True), NotImplementedError, "ub_tp_comm_overlap"),
        (dict(drop_path_rate=1.5), ValueError, "drop_path_rate"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        te.TransformerLayer(HIDDEN, FFN, HEADS, **kwargs)


def test_decoder_needs_encoder_output():
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, layer_type="decoder")
    with pytest.raises(ValueError, match="encoder_output"):
        layer(torch.zeros(S, B, HIDDEN))


def test_bshd_equals_sbhd_transposed():
    kwargs = CASES["rms-swiglu-fused"]
    sbhd = make_layer(F32, **kwargs)
    bshd = te.TransformerLayer(
        HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd",
        **kwargs,
    )  # fmt: skip
    bshd.load_state_dict(sbhd.state_dict())
    x, _ = inputs(kwargs, F32)
    assert_close(bshd(x.transpose(0, 1)).transpose(0, 1), sbhd(x), F32)
