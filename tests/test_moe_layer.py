"""te.moe.MoELayer on the CPU: the layer against a per-expert loop of plain torch in float64 on
the same weights (exactly representable values) and the same routing, forward and backward
(input, router, expert and shared-expert weight gradients); softmax and sigmoid scores, top_k
1 and 2, an expert no token chooses, host and device split sizes, the aux loss against its
formula, Float8CurrentScaling emulated on the CPU, zero tokens, bad input.

Legend: T tokens, H hidden, F the experts' width (FC1 makes 2F for swiglu), E experts, k top_k.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te
import torchte.moe
from torchte import recipe

pytestmark = pytest.mark.usefixtures("cpu_default_device")
T, H, F_, E = 13, 32, 16, 5


def _fill(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> None:
    """Every parameter exactly representable in `dtype` (and the router's fp32)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(representable(tuple(p.shape), dtype, scale=0.5, generator=gen))


def _layer(dtype=torch.float32, seed=0, **kw) -> te.moe.MoELayer:
    layer = te.moe.MoELayer(H, F_, E, kw.pop("top_k", 2), params_dtype=dtype, device="cpu", **kw)
    _fill(layer, dtype, seed)
    return layer


def _act64(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b
    assert activation == "gelu"
    return F.gelu(h, approximate="tanh")


def _route64(logits, k, score_function, scaling_factor=None, bias=None):
    """(T, E) float64 probs (0 off the chosen experts), (T, E) bool map: the router's rule."""
    if score_function == "softmax":
        chosen = logits.topk(k, dim=-1).indices
        probs = torch.zeros_like(logits).scatter(1, chosen, logits.gather(1, chosen).softmax(-1))
    else:
        scores = torch.sigmoid(logits)
        select = scores if bias is None else scores + bias.double()
        chosen = select.topk(k, dim=-1).indices
        picked = scores.gather(1, chosen)
        if k > 1:
            picked = picked / picked.sum(-1, keepdim=True)
        probs = torch.zeros_like(logits).scatter(1, chosen, picked)
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)


def _params64(layer) -> dict[str, torch.Tensor]:
    """The layer's weights as float64 leaves: router (E, H), fc1 / fc2 per expert, shared."""
    named = dict(layer.named_parameters())
    return {n: p.detach().double().requires_grad_() for n, p in named.items()}


def _linear64(x, w, weight, bias):
    """x @ w[weight]^T (+ w[bias] where the layer has that bias)."""
    y = x @ w[weight].T
    return y + w[bias] if bias in w else y


def _reference(layer, x, w, activation="swiglu", scaling_factor=None):
    """(y (T, H), routing map (T, E), logits (T, E)) of the layer's math, per expert, fp64."""
    logits = x @ w["router.weight"].T
    bias = getattr(layer, "expert_bias", None)
    probs, routing = _route64(logits, layer.top_k, layer.score_function, scaling_factor, bias)
    y = torch.zeros_like(x)
    for e in range(layer.num_experts):
        rows = routing[:, e].nonzero().squeeze(1)
        h = _act64(
            _linear64(x[rows], w, f"experts.fc1.weight{e}", f"experts.fc1.bias{e}"), activation
        )
        out = _linear64(h, w, f"experts.fc2.weight{e}", f"experts.fc2.bias{e}")
        y = y.index_add(0, rows, probs[rows, e, None] * out)
    if layer.shared_experts is not None:
        h = _act64(
            _linear64(x, w, "shared_experts.fc1.weight", "shared_experts.fc1.bias"), activation
        )
        y = y + _linear64(h, w, "shared_experts.fc2.weight", "shared_experts.fc2.bias")
    return y, routing, logits


def _aux64(logits, k, score_function, coeff):
    """Switch Transformer's load-balancing loss, written out."""
    tokens, experts = logits.shape
    if score_function == "softmax":
        scores = logits.softmax(-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / scores.sum(-1, keepdim=True)
    chosen = scores.topk(k, dim=-1).indices
    tokens_per_expert = torch.zeros(experts, dtype=torch.float64).index_add(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.float64)
    )
    return experts * coeff / (k * tokens**2) * (tokens_per_expert * scores.sum(0)).sum()


def _check(
    layer, dtype, grad_dtype=None, activation="swiglu", shape=(T, H), seed=1, nonneg=False, **kw
):
    """Forward and backward of `layer` (x in its params dtype, exact in `dtype`; x >= 1/16 with
    nonneg) against _reference, held to `dtype`'s tolerance (`grad_dtype`'s for the gradients);
    returns the reference's routing map."""
    grad_dtype = grad_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    x = representable(shape, dtype, scale=1.0, generator=gen).double()
    x = x.abs() + 1 / 16 if nonneg else x
    gy = representable(shape, dtype, scale=1.0, generator=gen)
    x_in = x.to(layer.experts.fc1.weight0.dtype).requires_grad_()
    y = layer(x_in)
    loss = (y.float() * gy).sum()
    if layer.aux_loss is not None:
        loss = loss + layer.aux_loss
    loss.backward()
    w = _params64(layer)
    x64 = x.reshape(-1, H).requires_grad_()
    y64, routing, logits = _reference(layer, x64, w, activation, **kw)
    loss64 = (y64 * gy.double().reshape(-1, H)).sum()
    if layer.aux_loss_coeff > 0:
        aux64 = _aux64(logits, layer.top_k, layer.score_function, layer.aux_loss_coeff)
        assert_close(layer.aux_loss, aux64, torch.float32, msg="aux loss")
        loss64 = loss64 + aux64
    loss64.backward()
    assert y.dtype == x_in.dtype and y.shape == x_in.shape
    # below fp32 the results are sums of rounded terms: their error follows the terms' size
    close = assert_close if dtype == torch.float32 else assert_close_to_scale
    close(y.reshape(-1, H), y64, dtype, msg="output")
    close(x_in.grad.reshape(-1, H), x64.grad, grad_dtype, msg="input grad")
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        close(p.grad, w[name].grad, grad_dtype, msg=f"grad of {name}")
    return routing


@pytest.mark.parametrize("device_splits", [False, True])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_matches_per_expert_loop(score_function, top_k, device_splits):
    layer = _layer(top_k=top_k, score_function=score_function, device_splits=device_splits)
    routing = _check(layer, torch.float32)
    assert routing.sum() == T * top_k


def test_bf16_3d_input_shared_expert_aux_loss():
    layer = _layer(
        torch.bfloat16, shared_expert_ffn_hidden_size=16, aux_loss_coeff=0.01, scaling_factor=2.0
    )
    _check(layer, torch.bfloat16, shape=(3, 5, H), scaling_factor=2.0)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("device_splits", [False, True])
def test_expert_without_tokens(score_function, device_splits):
    """Expert 0's router row is -1/2 and x >= 0: it never wins; no NaN, exact elsewhere."""
    layer = _layer(score_function=score_function, device_splits=device_splits, aux_loss_coeff=0.1)
    with torch.no_grad():
        layer.router.weight[0] = -0.5
        layer.router.weight[1:] = layer.router.weight[1:] / 8
    gen = torch.Generator().manual_seed(3)
    x = representable((T, H), torch.float32, generator=gen).abs() + 1 / 16
    y = layer(x)
    assert torch.isfinite(y).all()
    routing = _check(layer, torch.float32, nonneg=True)
    assert not routing[:, 0].any() and routing.sum() == T * layer.top_k
    grads = dict(layer.named_parameters())
    assert torch.count_nonzero(grads["experts.fc1.weight0"].grad) == 0


@pytest.mark.parametrize("device_splits", [False, True])
def test_biases_fc2_scaled_by_the_probability(device_splits):
    layer = _layer(bias=True, shared_expert_ffn_hidden_size=8, device_splits=device_splits)
    names = {n for n, _ in layer.named_parameters()}
    assert {f"experts.fc2.bias{e}" for e in range(E)} <= names
    assert "shared_experts.fc2.bias" in names
    _check(layer, torch.float32)


def test_gelu_and_expert_bias():
    layer = _layer(activation="gelu", score_function="sigmoid", expert_bias=True, top_k=2)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.25, 0.0, -0.25]))
    routing = _check(layer, torch.float32, activation="gelu")
    assert torch.equal(layer.local_tokens_per_expert, routing.sum(0).float())


def test_device_splits_equal_host_splits():
    """The two permutation routes give the same numbers (the padding differs, not the rows)."""
    host, dev = _layer(device_splits=False), _layer(device_splits=True)
    x = representable((T, H), torch.float32, generator=torch.Generator().manual_seed(5))
    x_h, x_d = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_h, y_d = host(x_h), dev(x_d)
    y_h.sum().backward()
    y_d.sum().backward()
    assert_close(y_d, y_h, torch.float32)
    assert_close(x_d.grad, x_h.grad, torch.float32)
    for (name, p_h), p_d in zip(host.named_parameters(), dev.parameters(), strict=True):
        assert_close(p_d.grad, p_h.grad, torch.float32, msg=name)


@pytest.mark.parametrize("device_splits", [False, True])
def test_float8_current_scaling(device_splits):
    """Emulated FP8 on the CPU: forward within e4m3's tolerance, gradients within e5m2's."""
    layer = _layer(torch.bfloat16, device_splits=device_splits, shared_expert_ffn_hidden_size=16)
    x = representable((T, H), torch.float8_e4m3fn, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y_bf16 = layer(x.bfloat16())
        with te.autocast(recipe=recipe.Float8CurrentScaling()):
            y_fp8 = layer(x.bfloat16())
    assert not torch.equal(y_fp8, y_bf16)  # the experts did run in FP8
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        _check(layer, torch.float8_e4m3fn, grad_dtype=torch.float8_e5m2, seed=7)


@pytest.mark.parametrize("device_splits", [False, True])
def test_zero_tokens(device_splits):
    layer = _layer(device_splits=device_splits, aux_loss_coeff=0.01)
    x = torch.zeros(0, H, requires_grad=True)
    y = layer(x)
    (y.sum() + layer.aux_loss).backward()
    assert y.shape == (0, H) and x.grad.shape == (0, H)
    assert layer.aux_loss.item() == 0.0


def test_aux_loss_none_without_coefficient():
    layer = _layer()
    layer(torch.ones(2, H))
    assert layer.aux_loss is None


@pytest.mark.parametrize("device_splits", [False, True])
def test_nan_logits_raise_naming_the_layer(device_splits):
    layer = _layer(device_splits=device_splits)
    x = torch.ones(4, H)
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"MoELayer.*NaN"):
        layer(x)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"top_k": E + 1}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"score_function": "tanh"}, "score_function"),
        ({"activation": "mish"}, "activation"),
        ({"expert_bias": True}, "expert_bias"),
        ({"aux_loss_coeff": -1.0}, "aux_loss_coeff"),
        ({"router_dtype": torch.float64}, "router_dtype"),
        ({"num_groups": 2, "group_topk": 1}, "num_experts"),
        ({"shared_expert_ffn_hidden_size": 0}, "shared_expert_ffn_hidden_size"),
    ],
)
def test_bad_arguments(kw, match):
    args = {"top_k": 2, **kw}
    with pytest.raises(ValueError, match=match):
        te.moe.MoELayer(H, F_, E, args.pop("top_k"), device="cpu", **args)


def test_bad_input_shape():
    layer = _layer()
    with pytest.raises(ValueError, match="hidden_size=32"):
        layer(torch.ones(3, H + 1))


def test_no_module_setattr_per_call():
    """The per-call state (aux_loss) is written without nn.Module.__setattr__ (rule 1)."""
    layer = _layer(aux_loss_coeff=0.01)
    calls = []
    cls = type(layer)
    original = torch.nn.Module.__setattr__

    def spy(self, name, value):
        calls.append(name)
        original(self, name, value)

    cls.__setattr__ = spy
    try:
        layer(torch.ones(3, H))
    finally:
        del cls.__setattr__
    assert calls == [] and layer.aux_loss is not None


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_normalization_comes_first(normalization):
    normed = _layer(normalization=normalization, shared_expert_ffn_hidden_size=8)
    assert next(iter(normed.named_parameters()))[0] == "norm.weight"
    with torch.no_grad():
        normed.norm.weight.copy_(torch.linspace(0.5, 1.5, H))
    plain = _layer(shared_expert_ffn_hidden_size=8)
    plain.load_state_dict({k: v for k, v in normed.state_dict().items() if "norm" not in k})
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(normed.norm(x))
        got = normed(x)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="normalization"):
        _layer(normalization="BatchNorm")


@pytest.mark.parametrize("device_splits", [False, True])
def test_single_grouped_weight_equals_per_expert_weights(device_splits):
    """One (E, N, K) weight and one (E, N) bias per GEMM: the outputs and gradients of E
    per-expert parameters holding the same values."""
    per_expert = _layer(device_splits=device_splits, bias=True)
    single = te.moe.MoELayer(H, F_, E, 2, device="cpu", device_splits=device_splits, bias=True,
                             single_grouped_weight=True)  # fmt: skip
    names = [name for name, _ in single.named_parameters()]
    assert "experts.fc1.weight" in names and "experts.fc1.weight0" not in names
    with torch.no_grad():
        for name, p in single.named_parameters():
            if name.startswith("experts."):
                op, kind = name.split(".")[1:]
                parts = [getattr(per_expert.experts, op).get_parameter(f"{kind}{g}")
                         for g in range(E)]  # fmt: skip
                p.copy_(torch.stack(parts))
            else:
                p.copy_(per_expert.get_parameter(name))
    x = representable((T, H), torch.float32, generator=torch.Generator().manual_seed(9))
    x_p, x_s = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_p, y_s = per_expert(x_p), single(x_s)
    y_p.square().sum().backward()
    y_s.square().sum().backward()
    assert_close(y_s, y_p, torch.float32)
    assert_close(x_s.grad, x_p.grad, torch.float32)
    for name, p in single.named_parameters():
        if name.startswith("experts."):
            op, kind = name.split(".")[1:]
            want = torch.stack([getattr(per_expert.experts, op).get_parameter(f"{kind}{g}").grad
                                for g in range(E)])  # fmt: skip
        else:
            want = per_expert.get_parameter(name).grad
        assert_close(p.grad, want, torch.float32, msg=name)


def test_checkpoints_load_across_the_expert_weight_layouts():
    """A per-expert checkpoint loads into single_grouped_weight=True and back (te.ops'
    GroupedLinear stacks or splits the entries): the same outputs, nothing missing."""
    per_expert = _layer(bias=True)
    with torch.no_grad():
        for p in per_expert.parameters():
            p.uniform_(-0.5, 0.5)
    single = te.moe.MoELayer(H, F_, E, 2, device="cpu", bias=True, single_grouped_weight=True)
    assert not single.load_state_dict(per_expert.state_dict()).missing_keys
    back = _layer(bias=True)
    assert not back.load_state_dict(single.state_dict()).missing_keys
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    want = per_expert(x)
    assert torch.equal(single(x), want) and torch.equal(back(x), want)
    assert torch.equal(single.experts.fc2.bias[3], per_expert.experts.fc2.bias3)


def test_single_grouped_weight_must_be_a_bool():
    with pytest.raises(TypeError, match="single_grouped_weight"):
        te.moe.MoELayer(H, F_, E, 2, device="cpu", single_grouped_weight=1)
