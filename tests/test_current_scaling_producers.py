"""te.LayerNormMLP under current scaling: past fused.CURRENT_FUSED_MIN elements the activation
and its backward write FP8 themselves (an amax pass, then the fused kernel); below it, and in
the unfused form, the activation then the cast. Both give the same outputs and gradients, bit
for bit (the same values, amax and scale)."""

from __future__ import annotations

import pytest
import torch
from tolerances import representable

import torchte as te
from torchte.quantization import fused
from torchte.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer

HIDDEN, FFN, TOKENS = 64, 1280, 64  # h: 64 x 1280 = 81,920 elements, past the bound


def run(activation: str, monkeypatch, fused_min: int | None):
    """(y, dx, {name: grad}, calls) of a seeded LayerNormMLP under Float8CurrentScaling with
    fused.CURRENT_FUSED_MIN set to fused_min (None: as it is); calls counts the fused
    activation functions the module reached."""
    if fused_min is not None:
        monkeypatch.setattr(fused, "CURRENT_FUSED_MIN", fused_min)
    calls = {"forward": 0, "backward": 0}
    for kind, name in (("forward", "activation_to_fp8"), ("backward", "activation_grad_to_fp8")):
        original = getattr(fused, name)

        def spy(*args, original=original, kind=kind):
            calls[kind] += 1
            return original(*args)

        monkeypatch.setattr("torchte.module.layernorm_mlp." + name, spy)
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(HIDDEN, FFN, activation=activation, params_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x = representable((2, TOKENS // 2, HIDDEN), torch.bfloat16, generator=gen)
    x = x.to(torch.bfloat16).requires_grad_()
    dy = representable((2, TOKENS // 2, HIDDEN), torch.bfloat16, generator=gen).bfloat16()
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = mlp(x)
    y.backward(dy)
    grads = {name: p.grad for name, p in mlp.named_parameters()}
    monkeypatch.undo()
    return y.detach(), x.grad, grads, calls


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fused_and_unfused_current_scaling_agree(activation, monkeypatch):
    y, dx, grads, calls = run(activation, monkeypatch, None)
    assert calls == {"forward": 1, "backward": 1}
    y_ref, dx_ref, grads_ref, calls_ref = run(activation, monkeypatch, 1 << 40)
    assert calls_ref == {"forward": 0, "backward": 0}
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ref[name]), name


def test_writes_activation():
    """Delayed quantizers always; current ones past the bound, without an amax reduction."""
    delayed = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn)
    current = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    bound = fused.CURRENT_FUSED_MIN
    assert fused.writes_activation(delayed, 1) and fused.writes_activation(delayed, bound + 1)
    assert not fused.writes_activation(current, bound)
    assert fused.writes_activation(current, bound + 1)
    current.amax_reduction = lambda amax: amax
    assert not fused.writes_activation(current, bound + 1)
