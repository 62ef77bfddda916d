"""te.LayerNormLinear and te.LayerNormMLP without FP8: a plain module takes torch's own ops
(F.layer_norm or F.rms_norm, F.linear, the activation, under torch's autograd) instead of its
autograd Function, with the same results within the tolerance table; every setting and call
that the shortcut does not cover keeps the Function, also when it changes after construction.

Outputs and gradients are compared with assert_close_to_scale: the two paths round at other
points (torch's gated activation rounds act(x1) before the product, its GELU is written
differently), and a GEMM or a norm backward sums such terms, so their error follows the
terms' size, not the result's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import assert_close_to_scale, representable

import torchte as te
from torchte import _nvtx
from torchte.module import _tensor_parallel
from torchte.module import layernorm_linear as lnl_module
from torchte.module import layernorm_mlp as mlp_module
from torchte.module._tensor_parallel import TensorParallel
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

H, FFN = 32, 48
TORCH_ACTIVATIONS = ["gelu", "relu", "silu", "geglu", "reglu", "swiglu", "glu"]
FUSED_ONLY = ["qgelu", "qgeglu", "srelu", "sreglu", "clamped_swiglu"]


def make(kind: str, dtype=torch.bfloat16, activation="gelu", hidden=H, ffn=FFN, **kw):
    """A LayerNormLinear (hidden -> ffn) or LayerNormMLP (hidden, ffn) with parameters exact in
    bf16."""
    if kind == "LayerNormLinear":
        module = te.LayerNormLinear(hidden, ffn, params_dtype=dtype, **kw)
    else:
        module = te.LayerNormMLP(hidden, ffn, activation=activation, params_dtype=dtype, **kw)
    with torch.no_grad():
        for name, p in module.named_parameters():
            value = representable(p.shape, torch.bfloat16, scale=0.25, device=p.device)
            p.copy_(1 + value if name == "layer_norm_weight" else value)
    return module


def on_function(module):
    """A copy of `module` (same parameter values) that always runs its autograd Function."""
    twin = copy.deepcopy(module)
    twin._fast_setattr("_plain", False)
    return twin


def run(module, x, dy, **fp8):
    """(outputs, dx, {name: grad}) of one forward (under te.autocast(**fp8)) and backward."""
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(**(fp8 or {"enabled": False})):
        out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    outs[0].backward(dy)
    if len(outs) > 1 and outs[1] is not None:  # return_bias: the bias, as a caller adds it
        outs[1].backward(dy.sum(tuple(range(dy.dim() - 1))))
    return outs, x.grad, {n: p.grad for n, p in module.named_parameters()}


class Spy:
    """Counts the shortcut's norm calls (torch_norm, as both modules reach it)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        for owner in (lnl_module, mlp_module):
            monkeypatch.setattr(owner, "torch_norm", self._wrap(owner.torch_norm))

    def _wrap(self, norm):
        def spy(*args):
            self.calls += 1
            return norm(*args)

        return spy


def takes_torch_ops(monkeypatch, module, x, **fp8) -> bool:
    """Whether a forward of `module` on x (under te.autocast(**fp8)) takes torch's ops."""
    spy = Spy(monkeypatch)
    with te.autocast(**(fp8 or {"enabled": False})):
        out = module(x)
    y = out[0] if isinstance(out, tuple) else out
    function = "Function" in type(y.grad_fn).__name__ if y.grad_fn is not None else None
    assert function is None or function == (spy.calls == 0)  # one path or the other
    return spy.calls == 1


def assert_same_results(got, want, dtype) -> None:
    (outs, dx, grads), (outs_ref, dx_ref, grads_ref) = got, want
    assert len(outs) == len(outs_ref)
    for out, out_ref in zip(outs, outs_ref, strict=True):
        assert out.dtype == out_ref.dtype and out.shape == out_ref.shape
        assert_close_to_scale(out, out_ref, dtype)
    assert_close_to_scale(dx, dx_ref, dtype)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert grad is not None and grads_ref[name] is not None, name
        assert grad.dtype == grads_ref[name].dtype, name
        assert_close_to_scale(grad, grads_ref[name], dtype, msg=name)


# -- the shortcut gives the Function's results ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize(
    "kind,activation",
    [("LayerNormLinear", None), ("LayerNormMLP", "gelu"), ("LayerNormMLP", "swiglu")],
    ids=["LayerNormLinear", "MLP-gelu", "MLP-swiglu"],
)
def test_torch_ops_match_the_function(monkeypatch, kind, activation, normalization, bias, dtype):
    module = make(kind, dtype, activation, normalization=normalization, bias=bias)
    function = on_function(module)
    x = representable((2, 5, H), torch.bfloat16).to(dtype)  # (b, s, h)
    dy = representable((2, 5, H if kind == "LayerNormMLP" else FFN), torch.bfloat16, scale=0.5)
    dy = dy.to(dtype)
    assert module._plain and takes_torch_ops(monkeypatch, module, x)
    assert not takes_torch_ops(monkeypatch, function, x)
    assert_same_results(run(module, x, dy), run(function, x, dy), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize(
    "kind,activation",
    [("LayerNormLinear", None), ("LayerNormMLP", "gelu"), ("LayerNormMLP", "swiglu")],
    ids=["LayerNormLinear", "MLP-gelu", "MLP-swiglu"],
)
def test_torch_ops_match_the_function_on_gpu(monkeypatch, kind, activation, normalization):
    """On CUDA torch's own kernels run (its bf16 LayerNorm backward among them, which the CPU
    path runs in fp32), over enough rows that the norm's weight gradients sum many terms."""
    hidden, ffn = 256, 384
    module = make(kind, torch.bfloat16, activation, hidden, ffn, normalization=normalization,
                  device="cuda")  # fmt: skip
    x = representable((4, 128, hidden), torch.bfloat16, device="cuda").bfloat16()
    out = hidden if kind == "LayerNormMLP" else ffn
    dy = representable((4, 128, out), torch.bfloat16, scale=0.5, device="cuda").bfloat16()
    assert takes_torch_ops(monkeypatch, module, x)
    got, want = run(module, x, dy), run(on_function(module), x, dy)
    assert_same_results(got, want, torch.bfloat16)


@pytest.mark.parametrize("activation", TORCH_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_torch_activation_matches_the_function(monkeypatch, activation, dtype):
    module = make("LayerNormMLP", dtype, activation)
    x = representable((7, H), torch.bfloat16).to(dtype)
    dy = representable((7, H), torch.bfloat16, scale=0.5).to(dtype)
    assert takes_torch_ops(monkeypatch, module, x)
    assert_same_results(run(module, x, dy), run(on_function(module), x, dy), dtype)


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_return_bias_is_returned_not_added(monkeypatch, kind):
    module = make(kind, return_bias=True)
    x = representable((3, 4, H), torch.bfloat16).bfloat16()
    dy = representable((3, 4, H if kind == "LayerNormMLP" else FFN), torch.bfloat16).bfloat16()
    assert takes_torch_ops(monkeypatch, module, x)
    got, want = run(module, x, dy), run(on_function(module), x, dy)
    bias = module.bias if kind == "LayerNormLinear" else module.fc2_bias
    assert got[0][1] is bias  # the parameter itself: its gradient is the caller's use of it
    assert_same_results(got, want, torch.bfloat16)


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_without_autograd_and_with_no_tokens(monkeypatch, kind):
    module = make(kind)
    x = representable((5, H), torch.bfloat16).bfloat16()
    with torch.no_grad():
        assert takes_torch_ops(monkeypatch, module, x)
        assert_close_to_scale(module(x), on_function(module)(x), torch.bfloat16)
    empty = torch.zeros(0, 3, H, dtype=torch.bfloat16)
    dy = torch.zeros(0, 3, H if kind == "LayerNormMLP" else FFN, dtype=torch.bfloat16)
    assert takes_torch_ops(monkeypatch, module, empty)
    (y,), dx, grads = run(module, empty, dy)
    (y_ref,), dx_ref, grads_ref = run(on_function(module), empty, dy)
    assert y.shape == y_ref.shape == dy.shape and dx.shape == dx_ref.shape == empty.shape
    for name, grad in grads.items():  # no tokens: zero gradients
        assert torch.equal(grad, grads_ref[name]) and not grad.any(), name


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_bad_input_gets_the_module_error(kind):
    module = make(kind)
    what = "in_features" if kind == "LayerNormLinear" else "hidden_size"
    with pytest.raises(ValueError, match=what):
        module(torch.zeros(4, H + 1, dtype=torch.bfloat16))


# -- what keeps the Function ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize(
    "fp8",
    [
        {"recipe": DelayedScaling()},
        {"recipe": Float8CurrentScaling()},
        {"enabled": False, "calibrating": True, "recipe": DelayedScaling()},
    ],
    ids=["delayed", "current", "calibrating"],
)
def test_fp8_and_calibration_keep_the_function(monkeypatch, kind, fp8):
    module = make(kind)
    x = representable((16, H), torch.bfloat16).bfloat16()
    assert not takes_torch_ops(monkeypatch, module, x, **fp8)
    assert takes_torch_ops(monkeypatch, module, x)  # and the next plain call takes torch's ops


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_calls_the_shortcut_does_not_cover_keep_the_function(monkeypatch, kind):
    module = make(kind)
    x = representable((4, H), torch.bfloat16)
    assert not takes_torch_ops(monkeypatch, module, x)  # fp32 input to a bf16 module
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_torch_ops(monkeypatch, module, x.bfloat16())
    if kind == "LayerNormLinear":
        with pytest.raises(ValueError, match="fp8_output"):  # the Function's error
            module(x.bfloat16(), fp8_output=True)
    assert takes_torch_ops(monkeypatch, module, x.bfloat16())


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize(
    "setting",
    [
        {"zero_centered_gamma": True},
        {"fuse_wgrad_accumulation": True},
        {"delay_wgrad_compute": True},
        {"return_layernorm_output": True},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_settings_the_shortcut_does_not_cover_keep_the_function(monkeypatch, kind, setting):
    module = make(kind, **setting)
    x = representable((4, H), torch.bfloat16).bfloat16()
    assert not takes_torch_ops(monkeypatch, module, x)


def test_mlp_settings_the_shortcut_does_not_cover(monkeypatch):
    x = representable((4, H), torch.bfloat16).bfloat16()
    assert not make("LayerNormMLP", checkpoint=True)._plain
    for activation in FUSED_ONLY:
        module = make("LayerNormMLP", activation=activation)
        assert not module._plain and not takes_torch_ops(monkeypatch, module, x), activation
    for activation in TORCH_ACTIVATIONS:
        assert make("LayerNormMLP", activation=activation)._plain, activation


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_construction_time_conditions(monkeypatch, kind):
    with te.quantized_model_init(recipe=DelayedScaling()):
        assert not make(kind)._plain  # FP8 weight parameters
    tp = {"parallel_mode": "column"} if kind == "LayerNormLinear" else {"set_parallel_mode": True}
    assert not make(kind, tp_size=2, **tp)._plain  # split over ranks (group set later)
    assert make(kind, tp_size=1, **tp)._plain  # one rank: nothing to split
    if kind == "LayerNormLinear":
        assert not make(kind, parameters_split=("a", "b"))._plain
    monkeypatch.setattr(_nvtx, "ENABLED", True)
    assert not make(kind)._plain  # TORCHTE_NVTX=1: the Function opens its range


def test_gated_activations_take_the_shortcut_up_to_a_size(monkeypatch):
    # rows * FFN <= the bound: with the bound at 4 rows' worth, 4 rows take torch's ops.
    monkeypatch.setattr(mlp_module, "GATED_TORCH_MAX_ELEMENTS", 4 * FFN)
    swiglu, gelu = make("LayerNormMLP", activation="swiglu"), make("LayerNormMLP")
    assert swiglu._plain and gelu._plain
    for rows, expected in ((1, True), (4, True), (5, False)):
        x = representable((rows, 1, H), torch.bfloat16).bfloat16()
        assert takes_torch_ops(monkeypatch, swiglu, x) == expected, rows
        assert takes_torch_ops(monkeypatch, gelu, x), rows  # not gated: any size
    assert mlp_module.GATED_TORCH_MAX_ELEMENTS == 4 * FFN
    monkeypatch.undo()
    assert make("LayerNormMLP", activation="swiglu")._plain_max_numel == 2**24 // FFN * H


# -- settings changed after construction ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_settings_written_after_construction_are_respected(monkeypatch, kind):
    module = make(kind)
    x = representable((4, H), torch.bfloat16).bfloat16()
    dy = representable((4, H if kind == "LayerNormMLP" else FFN), torch.bfloat16).bfloat16()
    weights = [p for n, p in module.named_parameters() if p.dim() == 2]
    for w in weights:
        w.main_grad = torch.zeros(w.shape)
    module.fuse_wgrad_accumulation = True  # a client's write (Megatron-Core sets such flags)
    assert not takes_torch_ops(monkeypatch, module, x)
    run(module, x, dy)
    assert all(w.main_grad.any() for w in weights)  # accumulated by the Function
    module.fuse_wgrad_accumulation = False
    assert takes_torch_ops(monkeypatch, module, x)

    module.return_layernorm_output = True
    assert not takes_torch_ops(monkeypatch, module, x)
    module.return_layernorm_output = False
    module.return_bias = True
    assert takes_torch_ops(monkeypatch, module, x)
    _, bias = module(x)
    assert bias is (module.bias if kind == "LayerNormLinear" else module.fc2_bias)


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_set_tensor_parallel_group_decides_again(monkeypatch, kind):
    module = make(kind)
    assert module._plain
    split = TensorParallel("column", None, 2, False)
    monkeypatch.setattr(_tensor_parallel, "set_group", lambda *args: split)  # LayerNormLinear
    monkeypatch.setattr(mlp_module, "set_group", lambda *args: split)
    module.set_tensor_parallel_group(None)
    assert module._tp is split and not module._plain


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_moved_module_decides_again(monkeypatch, kind):
    module = make(kind)
    module._fast_setattr("_plain", False)  # as a stale flag would be
    module.to(torch.float32)
    assert module._plain
    x = representable((4, H), torch.bfloat16)
    assert takes_torch_ops(monkeypatch, module, x)  # fp32 now, the input too
    assert not takes_torch_ops(monkeypatch, module, x.bfloat16())
