"""te.Linear in high precision: numerics against torch.nn.Linear and fp64, shapes, arguments,
errors, parameters_split and the setattr guard.

FP8 numerics are in test_linear_fp8.py, fused wgrad accumulation in test_linear_main_grad.py.
Inputs and weights are drawn exactly representable in the parameter dtype (tolerances.py), so
the fp64 reference sees the very values the layer computes with.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from setattr_writes import set_as_torchte
from tolerances import assert_close, representable

import torchte as te
from torchte.autocast import autocast_state
from torchte.quantization.setup import check_recipe
from torchte.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP4QATFloat8BlockScaling,
    MXFP4QATMXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

pytestmark = pytest.mark.usefixtures("cpu_default_device")

HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def set_weights(layer: te.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)


def make_layer(in_f, out_f, dtype, bias=True, **kwargs):
    """A te.Linear with representable weights (and a non-zero bias), and those weights."""
    layer = te.Linear(in_f, out_f, bias=bias, params_dtype=dtype, **kwargs)
    weight = representable((out_f, in_f), dtype, scale=0.125).to(dtype)
    b = representable(out_f, dtype).to(dtype) if bias else None
    set_weights(layer, weight, b)
    return layer, weight, b


def run(layer, x, dy):
    """(y, dx, dW, db) of one forward and backward; x is a leaf without grad history."""
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(dy)
    # A parameters_split layer has neither `weight` nor `bias`: its grads are read per split.
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    return (
        y,
        x.grad,
        weight.grad if weight is not None else None,
        bias.grad if bias is not None else None,
    )


def reference(x, weight, bias, dy):
    """fp64 (y, dx, dW, db) of y = x W^T + b for x (..., K)."""
    x64, w64, dy64 = x.double(), weight.double(), dy.double()
    y = x64 @ w64.t()
    if bias is not None:
        y = y + bias.double()
    x2d, dy2d = x64.reshape(-1, x64.shape[-1]), dy64.reshape(-1, dy64.shape[-1])
    db = dy2d.sum(0) if bias is not None else None
    return y, dy64 @ w64, dy2d.t() @ x2d, db


def check_against_reference(layer, x, weight, bias, dy, dtype):
    y, dx, dw, db = run(layer, x, dy)
    y_ref, dx_ref, dw_ref, db_ref = reference(x, weight, bias, dy)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert dx.shape == x.shape and dw.shape == weight.shape
    assert dw.dtype == dtype
    assert_close(y, y_ref, dtype, msg="forward")
    assert_close(dx, dx_ref, dtype, msg="dgrad")
    assert_close(dw, dw_ref, dtype, msg="wgrad")
    if bias is not None:
        assert_close(db, db_ref, dtype, msg="bias grad")


# -- numerics -------------------------------------------------------------------------------------

HP_SHAPES = [(17, 33, 7), (33, 17, 13), (1023, 17, 5), (16, 1023, 3), (64, 32, 127)]


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("in_f,out_f,tokens", HP_SHAPES)
def test_hp_matches_fp64_reference(dtype, in_f, out_f, tokens):
    layer, weight, bias = make_layer(in_f, out_f, dtype)
    x = representable((tokens, in_f), dtype).to(dtype)
    dy = representable((tokens, out_f), dtype).to(dtype)
    check_against_reference(layer, x, weight, bias, dy, dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_hp_matches_torch_linear(dtype):
    layer, weight, bias = make_layer(33, 17, dtype)
    ref = torch.nn.Linear(33, 17, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    x = representable((2, 11, 33), dtype).to(dtype)
    dy = representable((2, 11, 17), dtype).to(dtype)
    y, dx, dw, db = run(layer, x, dy)
    y_ref, dx_ref, dw_ref, db_ref = run(ref, x, dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        assert got.dtype == want.dtype
        assert_close(got, want, dtype)


def test_fp32_equivalent_to_torch_linear_on_random_data():
    layer = te.Linear(64, 48, params_dtype=torch.float32)
    ref = torch.nn.Linear(64, 48)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(torch.randn(48))
        layer.bias.copy_(ref.bias)
    x, dy = torch.randn(4, 5, 64), torch.randn(4, 5, 48)
    for got, want in zip(run(layer, x, dy), run(ref, x, dy), strict=True):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_hp_extra_leading_dims(dtype):
    layer, weight, bias = make_layer(17, 33, dtype)
    x = representable((2, 3, 17), dtype).to(dtype)
    dy = representable((2, 3, 33), dtype).to(dtype)
    y, *_ = run(layer, x, dy)
    assert y.shape == (2, 3, 33)
    layer.zero_grad()
    check_against_reference(layer, x, weight, bias, dy, dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_hp_zero_tokens(dtype):
    layer, _, _ = make_layer(17, 33, dtype)
    x = torch.empty(0, 17, dtype=dtype)
    y, dx, dw, db = run(layer, x, torch.empty(0, 33, dtype=dtype))
    assert y.shape == (0, 33) and dx.shape == (0, 17)
    assert torch.equal(dw, torch.zeros(33, 17, dtype=dtype))
    assert torch.equal(db, torch.zeros(33, dtype=dtype))


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_hp_one_token(dtype):
    layer, weight, bias = make_layer(33, 17, dtype)
    x = representable((1, 33), dtype).to(dtype)
    dy = representable((1, 17), dtype).to(dtype)
    check_against_reference(layer, x, weight, bias, dy, dtype)


def test_input_dtype_differs_from_params_dtype():
    layer, weight, bias = make_layer(16, 8, torch.bfloat16)
    x = representable((3, 16), torch.bfloat16)  # fp32 tensor with bf16-exact values
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert_close(y, x.double() @ weight.double().t() + bias.double(), torch.bfloat16)


# -- arguments ------------------------------------------------------------------------------------


def test_return_bias_returns_bias_separately():
    layer, weight, bias = make_layer(16, 8, torch.float32, return_bias=True)
    x = representable((3, 16), torch.float32)
    out, b = layer(x)
    assert b is not None and torch.equal(b, bias)
    assert_close(out, x.double() @ weight.double().t(), torch.float32)
    # The returned bias is the parameter: gradient flows to it when the caller adds it.
    (out + b).sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((8,), 3.0))


def test_bias_false():
    layer, weight, _ = make_layer(16, 8, torch.float32, bias=False)
    assert layer.bias is None
    assert "bias" not in dict(layer.named_parameters())
    x = representable((3, 16), torch.float32)
    assert_close(layer(x), x.double() @ weight.double().t(), torch.float32)


def test_init_method_is_called_on_the_weight():
    calls = []

    def init(weight):
        calls.append(tuple(weight.shape))
        with torch.no_grad():
            weight.fill_(0.5)

    layer = te.Linear(16, 8, init_method=init)
    assert calls == [(8, 16)]
    assert torch.equal(layer.weight, torch.full((8, 16), 0.5))
    assert torch.equal(layer.bias, torch.zeros(8))


def test_default_init_is_not_constant():
    layer = te.Linear(64, 64)
    assert layer.weight.std().item() > 0


@pytest.mark.parametrize("default", [torch.float32, torch.bfloat16])
def test_params_dtype_none_uses_torch_default(default):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        layer = te.Linear(16, 8)
    finally:
        torch.set_default_dtype(previous)
    assert layer.weight.dtype == default and layer.bias.dtype == default
    assert layer.params_dtype == default


def test_default_device():
    """Without `device` (and no user default device): CUDA on a GPU machine, else the CPU."""
    torch.set_default_device(None)  # undo the CPU default this file's fixture sets
    layer = te.Linear(16, 8)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert layer.weight.device.type == expected
    assert layer.bias.device.type == expected
    assert layer.device.type == expected


def test_user_default_device_wins():
    torch.set_default_device("meta")
    layer = te.Linear(16, 8)
    assert layer.weight.device.type == "meta"


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_params_dtype(dtype):
    layer = te.Linear(16, 8, params_dtype=dtype)
    assert layer.weight.dtype == dtype and layer.bias.dtype == dtype
    assert layer(torch.randn(2, 16, dtype=dtype)).dtype == dtype


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_in_features_mismatch(x_dtype):
    layer = te.Linear(32, 16)
    with pytest.raises(ValueError, match=r"in_features is 32") as info:
        layer(torch.randn(4, 31, dtype=x_dtype))
    assert "31" in str(info.value)
    with pytest.raises(ValueError, match="in_features"), te.autocast():
        layer(torch.randn(2, 3, 48))
    assert autocast_state().depth == 0


def test_in_features_mismatch_zero_dim_input():
    with pytest.raises(ValueError, match="in_features"):
        te.Linear(32, 16)(torch.tensor(1.0))


@pytest.mark.parametrize(
    "in_f,out_f,name,size", [(24, 16, "in_features", 24), (16, 40, "out_features", 40)]
)
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()])
def test_fp8_dims_not_divisible_by_16(in_f, out_f, name, size, recipe):
    layer = te.Linear(in_f, out_f)
    match = rf"{name}.*divisible by 16.*{name} is {size}"
    with pytest.raises(ValueError, match=match), te.autocast(recipe=recipe):
        layer(torch.randn(3, in_f))
    # Outside autocast the same layer runs in high precision.
    assert layer(torch.randn(3, in_f)).shape == (3, out_f)


@pytest.mark.parametrize("fp8", [False, True])
def test_input_on_another_device(fp8):
    layer = te.Linear(32, 16)
    x = torch.empty(4, 32, device="meta")
    with pytest.raises(ValueError, match=r"meta.*cpu"):
        if fp8:
            with te.autocast():
                layer(x)
        else:
            layer(x)


@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("fp8", [False, True])
def test_integer_input(int_dtype, fp8):
    layer = te.Linear(32, 16)
    x = torch.ones(4, 32, dtype=int_dtype)
    match = str(int_dtype).replace("torch.", "")
    with pytest.raises(TypeError, match=match), te.autocast(enabled=fp8):
        layer(x)


def test_unknown_recipe_type_error():
    with pytest.raises(TypeError, match="recipe"), te.autocast(recipe="DelayedScaling"):
        pass
    with pytest.raises(TypeError, match="recipe"):
        check_recipe(object(), torch.device("cpu"))


def test_unknown_recipe_subclass_not_implemented():
    class MyRecipe(Recipe):
        pass

    layer = te.Linear(16, 16)
    with pytest.raises(NotImplementedError, match="MyRecipe"), te.autocast(recipe=MyRecipe()):
        layer(torch.randn(2, 16))


@pytest.mark.parametrize(
    "recipe",
    [
        MXFP4QATFloat8BlockScaling(),
        MXFP4QATMXFP8BlockScaling(),
        NVFP4BlockScaling(row_scaled_activation=True),
    ],
)
def test_block_recipe_options_not_implemented(recipe):
    layer = te.Linear(32, 16)
    match = type(recipe).__name__.split("(")[0]
    with pytest.raises(NotImplementedError, match=match), te.autocast(recipe=recipe):
        layer(torch.randn(4, 32))
    assert autocast_state().depth == 0
    assert layer(torch.randn(4, 32)).shape == (4, 16)


def test_tensor_parallel_of_the_other_modules_not_implemented():
    with pytest.raises(NotImplementedError, match="sequence_parallel over more than one rank"):
        te.GroupedLinear(2, 16, 16, parallel_mode="column", tp_size=2, sequence_parallel=True)
    with pytest.raises(NotImplementedError, match="parallel_mode='row'"):
        te.LayerNormLinear(16, 16, parallel_mode="row", tp_size=2)


def test_unknown_kwarg():
    with pytest.raises(TypeError, match="not_an_argument"):
        te.Linear(16, 16, not_an_argument=True)


def test_bad_parallel_mode():
    with pytest.raises(ValueError, match="parallel_mode"):
        te.Linear(16, 16, parallel_mode="diagonal")


@pytest.mark.parametrize("in_f,out_f", [(0, 4), (4, 0), (-1, 4)])
def test_non_positive_features(in_f, out_f):
    with pytest.raises(ValueError, match="positive"):
        te.Linear(in_f, out_f)


def test_unsupported_params_dtype():
    with pytest.raises(TypeError, match="params_dtype"):
        te.Linear(16, 16, params_dtype=torch.float64)


def test_fp8_output_needs_autocast():
    with pytest.raises(ValueError, match="fp8_output"):
        te.Linear(16, 16)(torch.randn(2, 16), fp8_output=True)


# -- parameters_split -----------------------------------------------------------------------------


def split_layer(parameters_split, out_f=48, in_f=32, bias=True):
    layer = te.Linear(in_f, out_f, bias=bias, parameters_split=parameters_split)
    full = te.Linear(in_f, out_f, bias=bias)
    weight = representable((out_f, in_f), torch.float32, scale=0.125)
    b = representable(out_f, torch.float32) if bias else None
    set_weights(full, weight, b)
    with torch.no_grad():
        start = 0
        for name in layer.weight_names:
            param = getattr(layer, name)
            param.copy_(weight[start : start + param.shape[0]])
            if bias:
                getattr(layer, name.replace("_weight", "_bias")).copy_(
                    b[start : start + param.shape[0]]
                )
            start += param.shape[0]
    return layer, full


def test_parameters_split_tuple_names_and_shapes():
    layer, _ = split_layer(("query", "key", "value"))
    params = dict(layer.named_parameters())
    assert list(params) == [
        "query_weight",
        "query_bias",
        "key_weight",
        "key_bias",
        "value_weight",
        "value_bias",
    ]
    for name in ("query", "key", "value"):
        assert params[f"{name}_weight"].shape == (16, 32)
        assert params[f"{name}_bias"].shape == (16,)


def test_parameters_split_dict_sizes_and_trailing_underscore():
    layer, _ = split_layer({"gate_": 32, "up": 16})
    params = dict(layer.named_parameters())
    assert params["gate_weight"].shape == (32, 32) and params["up_weight"].shape == (16, 32)
    assert params["gate_bias"].shape == (32,) and params["up_bias"].shape == (16,)
    assert "weight" not in params


@pytest.mark.parametrize(
    "split", [("query", "key", "value"), {"a": 8, "b": 40}, ("only",), {"whole": 48}]
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", [None, DelayedScaling(), Float8CurrentScaling()])
def test_parameters_split_equals_unsplit(split, bias, recipe):
    """A split layer (one named split too: its parameter is `{name}_weight`, not `weight`)
    computes what the unsplit one does, its gradients split by rows."""
    layer, full = split_layer(split, bias=bias)
    x = representable((2, 5, 32), torch.float32)
    dy = representable((2, 5, 48), torch.float32)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y_split, dx_split, _, _ = run(layer, x, dy)
        y_full, dx_full, dw_full, db_full = run(full, x, dy)
    assert torch.equal(y_split, y_full)
    assert torch.equal(dx_split, dx_full)
    start = 0
    for name in layer.weight_names:
        param = getattr(layer, name)
        rows = slice(start, start + param.shape[0])
        assert torch.equal(param.grad, dw_full[rows]), name
        if bias:
            b_param = getattr(layer, name.replace("_weight", "_bias"))
            assert torch.equal(b_param.grad, db_full[rows]), name
        start += param.shape[0]
    assert start == 48


@pytest.mark.parametrize(
    "split", [("a", "b", "c", "d", "e"), {"a": 16, "b": 16}, {"a": 0, "b": 48}]
)
def test_parameters_split_bad_sizes(split):
    with pytest.raises(ValueError, match="parameters_split"):
        te.Linear(32, 48, parameters_split=split)


# -- setattr guard --------------------------------------------------------------------------------


def test_setattr_after_construction_warns():
    layer = te.Linear(16, 16)
    with pytest.warns(RuntimeWarning, match="foo"):
        set_as_torchte(layer, "foo", 1)
    assert layer.foo == 1


def test_client_setattr_after_construction_is_silent():
    layer = te.Linear(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.is_first_microbatch = True  # as Megatron-Core's wrappers write it
        layer.te_quant_params = None
    assert layer.is_first_microbatch is True and layer.te_quant_params is None


def test_fast_setattr_train_eval_do_not_warn():
    layer = te.Linear(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer._fast_setattr("foo", 1)
        assert layer.foo == 1
        layer.eval()
        assert layer.training is False
        layer.train()
        assert layer.training is True
        layer.train(False)
        assert layer.training is False
        layer.weight = torch.nn.Parameter(torch.zeros(16, 16))  # parameters are exempt


@pytest.mark.parametrize(
    "recipe,dtype",
    [
        (None, torch.bfloat16),
        (None, torch.float32),
        (DelayedScaling(amax_history_len=4), torch.bfloat16),
        (Float8CurrentScaling(), torch.bfloat16),
        (DelayedScaling(), torch.float32),
    ],
)
def test_forward_backward_never_uses_slow_setattr(recipe, dtype):
    layer = te.Linear(32, 16, params_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            x = torch.randn(3, 32, dtype=dtype, requires_grad=True)
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = layer(x, is_first_microbatch=step == 0)
            y.sum().backward()
        with torch.no_grad(), te.autocast(enabled=recipe is not None, recipe=recipe):
            layer(torch.randn(3, 32, dtype=dtype))
        layer.state_dict()
    assert x.grad is not None and layer.weight.grad is not None
