"""te.LayerNorm and te.RMSNorm: numerics against torch.nn.LayerNorm and an RMSNorm written in
torch (both in fp64, with the same weights), shapes, dtypes, arguments, errors, state_dict
names and the setattr guard. The kernels themselves are tested in test_kernels_norm.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from setattr_writes import set_as_torchte
from tolerances import assert_close, representable
from torch import nn

from torchte.module.norm import LayerNorm, RMSNorm

pytestmark = pytest.mark.usefixtures("cpu_default_device")

HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class TorchRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, in plain torch."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def make_pair(kind, hidden, dtype, zero_centered=False, device=None, **kwargs):
    """(te module, fp64 torch module with the same effective weights)."""
    if kind == "layernorm":
        layer = LayerNorm(hidden, params_dtype=dtype, zero_centered_gamma=zero_centered,
                          device=device, **kwargs)  # fmt: skip
        ref = nn.LayerNorm(hidden, eps=layer.eps, dtype=torch.float64, device=device)
    else:
        layer = RMSNorm(hidden, params_dtype=dtype, zero_centered_gamma=zero_centered,
                        device=device, **kwargs)  # fmt: skip
        ref = TorchRMSNorm(hidden, layer.eps, torch.float64, device=device)
    gen = torch.Generator().manual_seed(hidden)
    w = representable(hidden, dtype, scale=0.25 if zero_centered else 1.0, generator=gen)
    with torch.no_grad():
        layer.weight.copy_(w)
        ref.weight.copy_(w.double() + 1.0 if zero_centered else w.double())
        if kind == "layernorm":
            b = representable(hidden, dtype, generator=gen)
            layer.bias.copy_(b)
            ref.bias.copy_(b.double())
    return layer, ref


def run(module, x, dy):
    """(y, dx, dweight, dbias) of one forward and backward."""
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(dy)
    bias = getattr(module, "bias", None)
    return y, x.grad, module.weight.grad, None if bias is None else bias.grad


def check_module(kind, shape, dtype, zero_centered=False, device=None):
    hidden = shape[-1]
    layer, ref = make_pair(kind, hidden, dtype, zero_centered, device)
    gen = torch.Generator().manual_seed(sum(shape))
    x = (representable(shape, dtype, scale=2.0, generator=gen) + 0.5).to(device, dtype)
    dy = representable(shape, dtype, generator=gen).to(device, dtype)
    y, dx, dw, db = run(layer, x, dy)
    y_r, dx_r, dw_r, db_r = run(ref, x.double(), dy.double())
    assert y.shape == x.shape and y.dtype == dtype and dx.dtype == dtype
    assert dw.dtype == dtype
    assert_close(y, y_r, dtype, "y")
    assert_close(dx, dx_r, dtype, "dx")
    assert_close(dw, dw_r, dtype, "dweight")
    if kind == "layernorm":
        assert_close(db, db_r, dtype, "dbias")


# ----------------------------------------------------------------------------------------------
# Numerics
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (2, 3, 1023), (4, 7, 129)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_matches_torch(kind, dtype, shape, zero_centered):
    check_module(kind, shape, dtype, zero_centered)


def test_layernorm_matches_nn_layernorm_in_fp32():
    """Against torch.nn.LayerNorm itself, in fp32, with the same (random) weights."""
    layer = LayerNorm(257)
    ref = nn.LayerNorm(257)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
        ref.load_state_dict(layer.state_dict())
    x, dy = torch.randn(3, 5, 257) * 3 + 1, torch.randn(3, 5, 257)
    for got, want in zip(run(layer, x, dy), run(ref, x, dy), strict=True):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_no_grad_and_inference_match_grad_path(kind):
    layer, _ = make_pair(kind, 33, torch.float32)
    x = torch.randn(4, 33)
    y = layer(x.requires_grad_())
    with torch.no_grad():
        y_ng = layer(x)
    with torch.inference_mode():
        y_inf = layer(x)
    assert torch.equal(y.detach(), y_ng) and torch.equal(y_ng, y_inf)
    assert not y_ng.requires_grad


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_input_dtype_cast_to_params_dtype(kind):
    """As in Transformer Engine: y in params_dtype; the input's gradient in its own dtype."""
    layer, _ = make_pair(kind, 40, torch.float32)
    x = torch.randn(3, 40, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert_close(y, layer(x.detach().float()), torch.float32)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_autocast_dtype(kind):
    """Under torch.autocast: y in the autocast dtype, fp32 parameters and their fp32 grads."""
    layer, ref = make_pair(kind, 64, torch.float32)
    x = representable((6, 64), torch.bfloat16, scale=2.0).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    y_ref = ref(x.detach().double())
    assert_close(y, y_ref, torch.bfloat16)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_zero_tokens(kind):
    layer, _ = make_pair(kind, 24, torch.bfloat16)
    x = torch.zeros(0, 3, 24, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 3, 24)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(layer.weight.grad, torch.zeros(24, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_non_contiguous_input(kind):
    layer, ref = make_pair(kind, 48, torch.float32)
    x = torch.randn(48, 2, 5).permute(1, 2, 0)  # (2, 5, 48), last dim strided
    dy = torch.randn(2, 5, 48).transpose(0, 1).contiguous().transpose(0, 1)
    for got, want in zip(run(layer, x, dy), run(ref, x.double(), dy.double()), strict=True):
        if want is not None:
            assert_close(got, want, torch.float32)


def test_gradient_accumulates_over_calls():
    layer, _ = make_pair("layernorm", 16, torch.float32)
    x = torch.randn(3, 16)
    layer(x).sum().backward()
    once = layer.weight.grad.clone()
    layer(x).sum().backward()
    assert_close(layer.weight.grad, 2 * once, torch.float32)


# ----------------------------------------------------------------------------------------------
# Arguments, parameters, state_dict
# ----------------------------------------------------------------------------------------------


def test_parameters_and_init():
    ln = LayerNorm(10, params_dtype=torch.bfloat16)
    assert ln.weight.dtype == ln.bias.dtype == torch.bfloat16
    assert torch.equal(ln.weight, torch.ones(10, dtype=torch.bfloat16))
    assert torch.equal(ln.bias, torch.zeros(10, dtype=torch.bfloat16))
    zc = RMSNorm(10, zero_centered_gamma=True)
    assert torch.equal(zc.weight, torch.zeros(10)) and zc.bias is None
    assert ln.weight.device.type == "cpu" and ln.eps == 1e-5
    assert LayerNorm(6, 1e-3).eps == 1e-3  # eps is the second positional argument
    assert LayerNorm(normalized_shape=(6,)).hidden_size == 6
    assert RMSNorm(torch.Size([7])).hidden_size == 7


def test_state_dict_names_are_transformer_engines():
    ln, rms = LayerNorm(8), RMSNorm(8)
    assert list(ln.state_dict()) == ["weight", "bias"]
    assert list(rms.state_dict()) == ["weight"]
    torch_ln = nn.LayerNorm(8)
    with torch.no_grad():
        torch_ln.weight.normal_()
    ln.load_state_dict(torch_ln.state_dict())  # strict: same names, nothing extra
    assert torch.equal(ln.weight, torch_ln.weight)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]


def test_sequence_parallel_marks_parameters():
    ln = LayerNorm(8, sequence_parallel=True)
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel
    assert RMSNorm(8).weight.sequence_parallel is False


def test_setattr_guard_not_triggered_by_forward_backward():
    for layer in (LayerNorm(12), RMSNorm(12, zero_centered_gamma=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            x = torch.randn(2, 3, 12, requires_grad=True)
            layer(x).sum().backward()
            with torch.no_grad():
                layer(x)
            layer.train(False)
            layer(x)
        with pytest.warns(RuntimeWarning, match="_fast_setattr"):
            set_as_torchte(layer, "eps", 1e-3)


# ----------------------------------------------------------------------------------------------
# Errors, raised before any kernel runs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_hidden_size_mismatch_names_both_sizes(cls):
    with pytest.raises(ValueError, match=r"last dimension is 9, but hidden_size is 8"):
        cls(8)(torch.randn(2, 9))
    with pytest.raises(ValueError, match="0-d"):
        cls(8)(torch.tensor(1.0))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_unsupported_input_dtype(cls):
    with pytest.raises(TypeError, match=r"input dtype torch.float64 is not supported"):
        cls(8)(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        cls(8)([1.0] * 8)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_wrong_device(cls):
    layer = cls(8, device="meta")
    with pytest.raises(ValueError, match=r"input is on cpu but the module's parameters are on"):
        layer(torch.randn(2, 8))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_bad_arguments(cls):
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        cls(0)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        cls(8.0)
    with pytest.raises(TypeError, match="exactly one of hidden_size and normalized_shape"):
        cls(8, normalized_shape=8)
    with pytest.raises(TypeError, match="exactly one of hidden_size and normalized_shape"):
        cls()
    with pytest.raises(ValueError, match="normalized_shape must hold positive ints"):
        cls((4, 0))
    with pytest.raises(TypeError, match="params_dtype"):
        cls(8, params_dtype=torch.float64)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        cls(8, eps=-1.0)


def test_layernorm_normalization_argument():
    assert LayerNorm(8, normalization="LayerNorm").hidden_size == 8
    with pytest.raises(ValueError, match=r"use te\.RMSNorm"):
        LayerNorm(8, normalization="RMSNorm")


# ----------------------------------------------------------------------------------------------
# On the GPU: the Triton path end to end, and launches per call
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (2, 3, 1023), (16, 4096), (2, 65537)])
def test_matches_torch_gpu(kind, dtype, shape):
    check_module(kind, shape, dtype, zero_centered=shape[-1] % 2 == 1, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_launches_per_call_gpu(kind):
    from launches import count_device_ops

    from torchte.kernels._triton import triton_available

    if not triton_available():
        pytest.skip("needs Triton")
    layer, _ = make_pair(kind, 1024, torch.bfloat16, device="cuda")
    x = torch.randn(16, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)  # no accumulation kernels into existing grads
        layer(x).backward(dy)

    step()
    with torch.no_grad():
        layer(x)
        assert count_device_ops(lambda: layer(x)) == 1
    assert count_device_ops(step) == 3  # forward 1, backward 2
