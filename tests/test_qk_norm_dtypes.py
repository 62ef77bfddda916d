"""te.MultiheadAttention's query/key norms (qk_norm_type) when the activations' dtype is not
the norm parameters' dtype: the norms are built in params_dtype (as Transformer Engine builds
them), compute in torch.autocast's dtype where it is on, else in their parameters' dtype, and
attention gets q, k and v of one dtype. Outputs and gradients against an fp64 reference.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import (
    attention,
    f64,
    gather_heads,
    linear,
    norm,
    qkv_rows,
    rnd,
    set_representable,
)
from tolerances import assert_close_to_scale, representable, tolerance

import torchte as te

pytestmark = pytest.mark.usefixtures("cpu_default_device")

HIDDEN, HEADS, GROUPS, HN, S, B = 64, 4, 2, 16, 5, 2
EPS, QK_EPS = 1e-5, 1e-6
BF16, F32 = torch.bfloat16, torch.float32
NORMS = ["RMSNorm", "LayerNorm", "L2Normalization"]
# How the activations and the norm parameters come to differ:
# bf16-params: the module in bf16 (torch's default dtype fp32);
# fp32-params-autocast: fp32 parameters, run under torch.autocast(bfloat16);
# fp32-qk-norms: a bf16 module whose q_norm / k_norm the user keeps in fp32.
SETUPS = ["bf16-params", "fp32-params-autocast", "fp32-qk-norms"]


def make_mha(setup: str, qk_norm_type: str) -> te.MultiheadAttention:
    params_dtype = F32 if setup == "fp32-params-autocast" else BF16
    mha = te.MultiheadAttention(
        HIDDEN, HEADS, attention_dropout=0.0, layernorm_epsilon=EPS, params_dtype=params_dtype,
        input_layernorm=True, fuse_qkv_params=True, num_gqa_groups=GROUPS,
        qk_norm_type=qk_norm_type, qk_norm_eps=QK_EPS,
    )  # fmt: skip
    set_representable(mha, BF16, scale=0.125)  # exact in bf16 whatever params_dtype
    if setup == "fp32-qk-norms":
        mha.q_norm.float()
        mha.k_norm.float()
    return mha


def run(mha, setup: str, x: torch.Tensor) -> torch.Tensor:
    if setup == "fp32-params-autocast":
        with torch.autocast("cpu", dtype=BF16):
            return mha(x)
    return mha(x)


def _qk_norm(t, p, name: str, qk_norm_type: str):
    """The reference query/key norm over hn, rounded to bf16 (the attention's dtype)."""
    if qk_norm_type == "L2Normalization":
        y = t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + QK_EPS)
    else:
        y = norm(t, p[name + ".weight"], p.get(name + ".bias"), qk_norm_type, QK_EPS)
    return rnd(y, BF16)


def reference(mha, x, qk_norm_type: str):
    """(out (s, b, h) fp64, {name: fp64 leaf}, x64): every module output rounded to bf16."""
    p = {name: f64(t) for name, t in mha.named_parameters()}
    x64 = f64(x)
    ln_w, ln_b = p["layernorm_qkv.layer_norm_weight"], p["layernorm_qkv.layer_norm_bias"]
    z = rnd(norm(x64, ln_w, ln_b, "LayerNorm", EPS), BF16)
    y = linear(z, p["layernorm_qkv.weight"], p["layernorm_qkv.bias"], BF16)
    q, k, v = (gather_heads(y, rows) for rows in qkv_rows(HEADS, GROUPS, HN, True))
    q = _qk_norm(q, p, "q_norm", qk_norm_type)
    k = _qk_norm(k, p, "k_norm", qk_norm_type)
    context = attention(q, k, v, True, BF16)
    return linear(context, p["proj.weight"], p["proj.bias"], BF16), p, x64


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("qk_norm_type", NORMS)
def test_outputs_and_gradients_match_fp64_reference(setup, qk_norm_type):
    mha = make_mha(setup, qk_norm_type)
    x_dtype = F32 if setup == "fp32-params-autocast" else BF16
    x = representable((S, B, HIDDEN), BF16).to(x_dtype).requires_grad_(True)
    out = run(mha, setup, x)
    ref, p, x64 = reference(mha, x, qk_norm_type)
    assert out.shape == (S, B, HIDDEN) and out.dtype == BF16
    assert_close_to_scale(out, ref, BF16)
    grad = representable(out.shape, BF16, scale=0.25)
    out.backward(grad.to(out.dtype))
    ref.backward(grad.double())
    assert x.grad.dtype == x_dtype
    assert_close_to_scale(x.grad, x64.grad, BF16, msg="x")
    for name, param in mha.named_parameters():
        assert param.grad.dtype == param.dtype, name
        if name == "k_norm.bias":
            # Zero in exact arithmetic (softmax ignores a shift shared by every key): what is
            # left is rounding, small next to the query bias's gradient.
            rtol, _ = tolerance(BF16)
            bound = rtol * p["q_norm.bias"].grad.abs().max().item()
            assert param.grad.abs().max().item() <= bound
            continue
        assert_close_to_scale(param.grad, p[name].grad, BF16, msg=name)


@pytest.mark.parametrize("qk_norm_type", ["RMSNorm", "LayerNorm"])
def test_qk_norm_parameters_in_params_dtype(qk_norm_type):
    mha = te.MultiheadAttention(HIDDEN, HEADS, params_dtype=BF16, qk_norm_type=qk_norm_type)
    norms = (mha.q_norm, mha.k_norm)
    assert all(t.dtype == BF16 for m in norms for t in m.parameters())


@pytest.mark.parametrize("setup", ["bf16-params", "fp32-params-autocast"])
def test_transformer_layer_with_qk_norm_runs_in_bf16(setup):
    params_dtype = F32 if setup == "fp32-params-autocast" else BF16
    layer = te.TransformerLayer(
        HIDDEN, 96, HEADS, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=params_dtype,
        qk_norm_type="RMSNorm",
    )  # fmt: skip
    assert layer.self_attention.q_norm.weight.dtype == params_dtype
    x = representable((S, B, HIDDEN), BF16).to(params_dtype).requires_grad_(True)
    out = run(layer, setup, x)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert layer.self_attention.q_norm.weight.grad.dtype == params_dtype
