"""fuse_wgrad_accumulation on te.MultiheadAttention and te.TransformerLayer: the flag reaches
every inner GEMM module (QKV, query, key_value, proj, the MLP's fc1 and fc2), whose weights
then accumulate their gradients into the caller's fp32 `main_grad` (as Megatron creates it);
norms and biases keep ordinary `.grad`.

Checked against a twin model without the fusion holding the same weights: after two backward
calls, each weight's main_grad equals the twin's accumulated .grad.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import set_representable
from tolerances import assert_close, representable

import torchte as te

pytestmark = pytest.mark.usefixtures("cpu_default_device")

HIDDEN, FFN, HEADS, S, SK, B = 64, 96, 4, 5, 7, 2
F32 = torch.float32

MHA_CASES = {
    "self-ln-fused": dict(input_layernorm=True, fuse_qkv_params=True, num_gqa_groups=2),
    "self-split": dict(num_gqa_groups=2),
    "cross-ln-fused": dict(input_layernorm=True, fuse_qkv_params=True, attention_type="cross"),
    "cross-split": dict(attention_type="cross", attn_mask_type="no_mask"),
}
LAYER_CASES = {
    "encoder": dict(),
    "decoder": dict(layer_type="decoder"),
    "parallel-mlp-rms": dict(parallel_attention_mlp=True, normalization="RMSNorm"),
}


def _fused_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The weights that fuse_wgrad_accumulation routes to main_grad: every weight of a GEMM
    module (those with a fuse_wgrad_accumulation flag), not its norm's."""
    weights = {}
    for prefix, module in model.named_modules():
        if not hasattr(module, "fuse_wgrad_accumulation"):
            continue
        for name, param in module.named_parameters(recurse=False):
            if name.endswith("weight") and "norm" not in name:
                weights[f"{prefix}.{name}"] = param
    return weights


def _twins(build, fuse_kw: dict):
    """(fused model with zeroed fp32 main_grads, twin without the fusion), same weights."""
    fused = build(fuse_wgrad_accumulation=True, **fuse_kw)
    set_representable(fused, F32, scale=0.125)
    plain = build(fuse_wgrad_accumulation=False, **fuse_kw)
    plain.load_state_dict(fused.state_dict())
    for param in _fused_weights(fused).values():
        param.main_grad = torch.zeros(param.shape, dtype=F32)
    return fused, plain


def _two_steps(model, kwargs_of_step):
    """Two forward/backward calls with fixed inputs; the gradients accumulate."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        kwargs = kwargs_of_step(gen)
        x = representable((S, B, HIDDEN), F32, generator=gen).requires_grad_()
        out = model(x, **kwargs)
        out.backward(representable(out.shape, F32, scale=0.25, generator=gen))


def _assert_main_grads_equal_plain_grads(fused, plain, expected_names):
    weights = _fused_weights(fused)
    assert expected_names <= set(weights), sorted(weights)
    plain_params = dict(plain.named_parameters())
    for name, param in fused.named_parameters():
        if name in weights:
            assert param.grad is None, name
            assert param.main_grad.dtype == F32
            assert param.main_grad.abs().sum() > 0, name
            assert_close(param.main_grad, plain_params[name].grad, F32, msg=name)
        else:
            assert_close(param.grad, plain_params[name].grad, F32, msg=name)


def _every_module_fuses(model) -> None:
    flags = {n: m.fuse_wgrad_accumulation for n, m in model.named_modules()
             if hasattr(m, "fuse_wgrad_accumulation")}  # fmt: skip
    assert flags and all(flags.values()), flags


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention_main_grad_is_sum_of_plain_grads(case):
    kwargs = MHA_CASES[case]

    def build(**fuse):
        return te.MultiheadAttention(
            HIDDEN, HEADS, attention_dropout=0.0, params_dtype=F32,
            qk_norm_type="RMSNorm", **kwargs, **fuse,
        )  # fmt: skip

    fused, plain = _twins(build, {})
    _every_module_fuses(fused)
    cross = kwargs.get("attention_type") == "cross"

    def step_kwargs(gen):
        if not cross:
            return {}
        return {"encoder_output": representable((SK, B, HIDDEN), F32, generator=gen)}

    _two_steps(fused, step_kwargs)
    _two_steps(plain, step_kwargs)
    names = {"proj.weight"}
    if not cross:
        layer = "layernorm_qkv" if kwargs.get("input_layernorm") else "qkv"
        parts = ["weight"] if kwargs.get("fuse_qkv_params") else ["query_weight", "key_weight"]
        names |= {f"{layer}.{p}" for p in parts}
    else:
        names |= {"key_value.weight" if kwargs.get("fuse_qkv_params") else "key_value.key_weight"}
    _assert_main_grads_equal_plain_grads(fused, plain, names)


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_transformer_layer_main_grad_is_sum_of_plain_grads(case):
    kwargs = LAYER_CASES[case]

    def build(**fuse):
        return te.TransformerLayer(
            HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=F32,
            fuse_qkv_params=True, **kwargs, **fuse,
        )  # fmt: skip

    fused, plain = _twins(build, {})
    _every_module_fuses(fused)
    decoder = kwargs.get("layer_type") == "decoder"

    def step_kwargs(gen):
        if not decoder:
            return {}
        return {"encoder_output": representable((SK, B, HIDDEN), F32, generator=gen)}

    _two_steps(fused, step_kwargs)
    _two_steps(plain, step_kwargs)
    names = {
        "self_attention.layernorm_qkv.weight",
        "self_attention.proj.weight",
        "layernorm_mlp.fc1_weight",
        "layernorm_mlp.fc2_weight",
    }
    if decoder:
        names |= {"inter_attention.key_value.weight", "inter_attention.layernorm_query.weight"}
    _assert_main_grads_equal_plain_grads(fused, plain, names)


def test_transformer_layer_fusion_needs_fused_qkv_params():
    with pytest.raises(ValueError, match="fuse_qkv_params"):
        te.TransformerLayer(HIDDEN, FFN, HEADS, fuse_wgrad_accumulation=True)
