"""te.moe.MoELayer's permutation fused with the FP8 cast of the experts' input
(moe/_fused_permute.py): under FP8 delayed and current scaling with split sizes on the device,
outputs and every gradient are the unfused layer's bit for bit (the same FP8 bytes), the fused
path is the one taken, and it stays out of the way where it does not apply."""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import representable

import torchte as te
import torchte.moe
from torchte import recipe
from torchte.moe import _fused_permute

pytestmark = pytest.mark.usefixtures("cpu_default_device")
T, H, F_, E = 13, 32, 16, 5
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


def _pair(**kw):
    """Two layers with the same parameters, the permutation fused in the first only."""
    layers = []
    for fuse in (True, False):
        torch.manual_seed(0)
        layer = te.moe.MoELayer(H, F_, E, 2, params_dtype=torch.bfloat16, device="cpu",
                                device_splits=True, fuse_permute_cast=fuse, **kw)  # fmt: skip
        layers.append(layer)
    return layers


def _step(layer, x, fp8_recipe, steps=2):
    """Two training steps' outputs and gradients (delayed scaling's scales move between)."""
    out = []
    for step in range(steps):
        xs = (x * (step + 1)).detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with te.autocast(recipe=fp8_recipe):
            y = layer(xs)
        y.float().square().sum().backward()
        out.append((y, xs.grad, [p.grad for p in layer.parameters()]))
    return out


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("bias", [False, True])
def test_fused_equals_unfused_bit_for_bit(name, bias, monkeypatch):
    calls = []
    original = _fused_permute.GatherQuantize.apply
    monkeypatch.setattr(_fused_permute.GatherQuantize, "apply",
                        lambda *a: calls.append(1) or original(*a))  # fmt: skip
    fused, plain = _pair(bias=bias)
    gen = torch.Generator().manual_seed(1)
    x = representable((T, H), torch.bfloat16, generator=gen).bfloat16()
    got = _step(fused, x, RECIPES[name]())
    assert len(calls) == 2  # the fused path ran in both steps
    want = _step(plain, x, RECIPES[name]())
    assert len(calls) == 2  # and never for the unfused layer
    for (y_f, dx_f, g_f), (y_p, dx_p, g_p) in zip(got, want, strict=True):
        assert torch.equal(y_f, y_p)
        assert torch.equal(dx_f, dx_p)
        for a, b in zip(g_f, g_p, strict=True):
            assert torch.equal(a, b)


def test_not_taken_in_bf16_with_host_splits_or_unless_asked(monkeypatch):
    calls = []
    original = _fused_permute.GatherQuantize.apply
    monkeypatch.setattr(_fused_permute.GatherQuantize, "apply",
                        lambda *a: calls.append(1) or original(*a))  # fmt: skip
    fused, off = _pair()
    x = torch.randn(T, H).bfloat16()
    fused(x)  # bf16: no FP8 cast to fuse
    host = te.moe.MoELayer(H, F_, E, 2, params_dtype=torch.bfloat16, device="cpu",
                           device_splits=False)  # fmt: skip
    default = te.moe.MoELayer(H, F_, E, 2, params_dtype=torch.bfloat16, device="cpu",
                              device_splits=True)  # fmt: skip
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        host(x)  # host splits: moe_permute_and_pad_with_probs, unfused
        fused(torch.zeros(0, H).bfloat16())  # zero tokens
        fused(x.float())  # x not in the experts' compute dtype
        off(x)  # fuse_permute_cast=False
        default(x)  # off by default
    assert not calls


def test_permuted_sources_match_the_permutation():
    """src / probs of every permuted row against moe_permute's rows (pad rows and a route of
    probability 0, which moe_permute writes as zeros: -1 and 0)."""
    from torchte.kernels.permutation import mask_row_id_map

    gen = torch.Generator().manual_seed(2)
    routing = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        routing[t, torch.randperm(E, generator=gen)[:2]] = True
    routing[:, 3] = False  # an expert without tokens
    probs = torch.rand(T, E, generator=gen) * routing
    zero_route = routing[0].nonzero()[0, 0]
    probs[0, zero_route] = 0.0
    row_id_map, counts = mask_row_id_map(routing)
    pads = (-counts[:E]) % 16
    pad_offsets = torch.cumsum(pads, 0) - pads
    rows = T * 2 + E * 15
    src, probs_P = _fused_permute.permuted_sources(row_id_map, counts, pad_offsets, probs, rows)
    want_src = torch.full((rows,), -1, dtype=torch.int32)
    want_probs = torch.zeros(rows)
    start = 0
    for e in range(E):
        tokens = routing[:, e].nonzero().flatten()
        want_src[start : start + len(tokens)] = torch.where(probs[tokens, e] > 0, tokens, -1)
        want_probs[start : start + len(tokens)] = probs[tokens, e]
        start += len(tokens) + int(pads[e])
    assert (want_src == -1).sum() > rows - 2 * T  # the zero-probability route is among them
    assert torch.equal(src, want_src) and torch.equal(probs_P, want_probs)


INTERPRETER_SCRIPT = """
import torch
from torchte.kernels import permutation as kp

gen = torch.Generator().manual_seed(3)
tokens, experts = 37, 6
routing = torch.zeros(tokens, experts, dtype=torch.bool)
for t in range(tokens):
    routing[t, torch.randperm(experts, generator=gen)[:2]] = True
routing[:, 2] = False
probs = torch.rand(tokens, experts, generator=gen) * routing
probs[5, routing[5].nonzero()[0, 0]] = 0.0
row_id_map, counts = kp.mask_row_id_map_reference(routing)
pads = (-counts[:experts].long()) % 16
pad_offsets = torch.cumsum(pads, 0) - pads
rows = tokens * 2 + experts * 15
ids = torch.arange(1, tokens + 1, dtype=torch.int32).unsqueeze(1)
got = kp._permute_triton(ids, row_id_map, probs, pad_offsets, counts, rows, 0)
want = kp.permute_rows_reference(ids, row_id_map, probs, pad_offsets, counts, rows, 0)
assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
assert int((got[0] == 0).sum()) > rows - 2 * tokens  # pad rows and the zero-probability route
print("ok")
"""


@requires_interpreter
def test_permute_kernel_moves_token_numbers_in_interpreter():
    """permuted_sources' use of the permute kernel: one int32 column, rows no route writes 0."""
    run_under_interpreter(INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RECIPES))
def test_cuda_fused_equals_unfused_bit_for_bit(name):
    """On a GPU (the gathering cast kernels, the TMA grouped GEMMs past 4096 rows)."""
    layers = []
    for fuse in (True, False):
        torch.manual_seed(0)
        layer = te.moe.MoELayer(256, 512, 8, 2, params_dtype=torch.bfloat16, device="cuda",
                                device_splits=True, fuse_permute_cast=fuse)  # fmt: skip
        layers.append(layer)
    x = torch.randn(3000, 256, device="cuda").bfloat16()
    got, want = (_step(layer, x, RECIPES[name]()) for layer in layers)
    for (y_f, dx_f, g_f), (y_p, dx_p, g_p) in zip(got, want, strict=True):
        assert torch.equal(y_f, y_p) and torch.equal(dx_f, dx_p)
        for a, b in zip(g_f, g_p, strict=True):
            assert torch.equal(a, b)
