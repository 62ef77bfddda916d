"""te.Linear with fuse_wgrad_accumulation: weight gradients accumulated into weight.main_grad.

Megatron's contract: main_grad (fp32, the weight's shape) is added to (or overwritten on the
first microbatch / with overwrite_main_grad); weight.grad is not produced unless the parameter
has `grad_added_to_main_grad`, which is then set and a dummy grad returned. main_grad is reached
through a weakref to the parameter, so saved-tensor hooks that swap saved tensors cannot
redirect it.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")


IN, OUT = 32, 48
# (recipe, params dtype): high precision and both FP8 recipes.
CASES = [
    (None, torch.float32),
    (None, torch.bfloat16),
    (DelayedScaling(amax_history_len=4), torch.float32),
    (Float8CurrentScaling(), torch.float32),
    (DelayedScaling(amax_history_len=4), torch.bfloat16),
]
IDS = ["hp-fp32", "hp-bf16", "delayed-fp32", "current-fp32", "delayed-bf16"]


def make_layer(dtype=torch.float32, fuse=True, main_grad=True, **kwargs) -> te.Linear:
    """The same weights every call (a fixed generator), so twin layers match."""
    layer = te.Linear(IN, OUT, params_dtype=dtype, fuse_wgrad_accumulation=fuse, **kwargs)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(representable((OUT, IN), torch.bfloat16, scale=0.125, generator=gen))
        layer.bias.copy_(representable(OUT, torch.bfloat16, generator=gen))
    if main_grad:
        for name in layer.weight_names:
            param = getattr(layer, name)
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
    return layer


def batches(n: int, dtype, tokens: int = 5):
    return [
        (
            representable((tokens, IN), torch.bfloat16).to(dtype),
            representable((tokens, OUT), torch.bfloat16, scale=0.25).to(dtype),
        )
        for _ in range(n)
    ]


def step(layer, x, dy, recipe, **kwargs):
    """Forward under autocast (FP8 when recipe is given) and backward; returns (y, dx)."""
    x = x.detach().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x, **kwargs)
    y.backward(dy)
    return y, x.grad


def reference_wgrads(recipe, data) -> list[torch.Tensor]:
    """The fp32-accurate wgrad of each batch: fp64 for hp; for FP8 an unfused fp32 twin layer
    run through the same steps (inputs are bf16-exact, so it quantizes to the same bytes as a
    bf16 layer, and its fp32 wgrad is what main_grad accumulates)."""
    if recipe is None:
        return [dy.double().t() @ x.double() for x, dy in data]
    twin = make_layer(torch.float32, fuse=False, main_grad=False)
    grads = []
    for x, dy in data:
        twin.zero_grad()
        step(twin, x.float(), dy.float(), recipe)
        grads.append(twin.weight.grad)
    return grads


@pytest.mark.parametrize("recipe,dtype", CASES, ids=IDS)
def test_main_grad_is_sum_of_wgrads(recipe, dtype):
    layer = make_layer(dtype)
    data = batches(2, dtype)
    outputs = [step(layer, x, dy, recipe) for x, dy in data]
    expected = reference_wgrads(recipe, data)
    main_grad = layer.weight.main_grad
    assert main_grad.dtype == torch.float32
    # Accumulated in fp32 whatever the parameter dtype.
    assert_close(main_grad, expected[0] + expected[1], torch.float32)
    assert layer.weight.grad is None
    # The bias gradient is an ordinary .grad.
    assert_close(layer.bias.grad, sum(dy.double().sum(0) for _, dy in data), dtype)
    for (x, _), (y, dx) in zip(data, outputs, strict=True):
        assert y.shape == (5, OUT) and dx.shape == x.shape


@pytest.mark.parametrize("recipe,dtype", CASES, ids=IDS)
def test_first_microbatch_overwrites(recipe, dtype):
    layer = make_layer(dtype)
    layer.weight.main_grad.fill_(1000.0)
    data = batches(3, dtype)
    expected = reference_wgrads(recipe, data)
    step(layer, *data[0], recipe, is_first_microbatch=True)
    assert_close(layer.weight.main_grad, expected[0], torch.float32)
    step(layer, *data[1], recipe, is_first_microbatch=False)
    assert_close(layer.weight.main_grad, expected[0] + expected[1], torch.float32)
    step(layer, *data[2], recipe, is_first_microbatch=True)
    assert_close(layer.weight.main_grad, expected[2], torch.float32)


@pytest.mark.parametrize("recipe,dtype", CASES, ids=IDS)
def test_overwrite_main_grad_attribute(recipe, dtype):
    layer = make_layer(dtype)
    layer.weight.overwrite_main_grad = True
    data = batches(2, dtype)
    # The twin runs the same sequence of steps (delayed scales depend on it).
    expected = reference_wgrads(recipe, [data[0], data[1], data[0]])
    step(layer, *data[0], recipe)
    step(layer, *data[1], recipe)
    assert_close(layer.weight.main_grad, expected[1], torch.float32)
    layer.weight.overwrite_main_grad = False
    step(layer, *data[0], recipe)
    assert_close(layer.weight.main_grad, expected[1] + expected[2], torch.float32)


@pytest.mark.parametrize("recipe,dtype", CASES, ids=IDS)
def test_grad_added_to_main_grad_gives_dummy_grad(recipe, dtype):
    layer = make_layer(dtype)
    layer.weight.grad_added_to_main_grad = False
    returned = []
    layer.weight.register_hook(lambda grad: returned.append(grad))
    for x, dy in batches(2, dtype):
        step(layer, x, dy, recipe)
        assert layer.weight.grad_added_to_main_grad is True
        layer.weight.grad_added_to_main_grad = False
    assert layer.weight.grad is not None
    assert layer.weight.grad.shape == layer.weight.shape
    assert layer.weight.grad.dtype == dtype
    assert len(returned) == 2
    assert returned[0] is returned[1]  # one cached dummy, not a new tensor per backward
    assert layer.weight.main_grad.abs().sum().item() > 0


def test_missing_main_grad_is_a_clear_error():
    layer = make_layer(main_grad=False)
    x, dy = batches(1, torch.float32)[0]
    with pytest.raises(RuntimeError, match="main_grad"):
        step(layer, x, dy, None)


@pytest.mark.parametrize("recipe,dtype", CASES, ids=IDS)
def test_zero_tokens(recipe, dtype):
    layer = make_layer(dtype)
    layer.weight.main_grad.fill_(3.0)
    x, dy = torch.empty(0, IN, dtype=dtype), torch.empty(0, OUT, dtype=dtype)
    step(layer, x, dy, recipe)
    assert torch.equal(layer.weight.main_grad, torch.full((OUT, IN), 3.0))
    step(layer, x, dy, recipe, is_first_microbatch=True)
    assert torch.equal(layer.weight.main_grad, torch.zeros(OUT, IN))


@pytest.mark.parametrize("recipe,dtype", CASES[:4], ids=IDS[:4])
def test_one_token(recipe, dtype):
    layer = make_layer(dtype)
    data = batches(1, dtype, tokens=1)
    step(layer, *data[0], recipe)
    expected = reference_wgrads(recipe, data)
    assert_close(layer.weight.main_grad, expected[0], torch.float32)


class CloneOnUnpack:
    """saved_tensors_hooks whose unpack returns a clone of every saved tensor (as offloading to
    the CPU and back does): saved tensors are not the objects that were saved."""

    def __init__(self) -> None:
        self.unpacked = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.unpacked += 1
        return t.clone()


@pytest.mark.parametrize("recipe,dtype", CASES, ids=IDS)
def test_saved_tensor_hooks_cannot_redirect_main_grad(recipe, dtype):
    data = batches(2, dtype)
    plain = make_layer(dtype)
    plain_out = [step(plain, x, dy, recipe) for x, dy in data]

    hooked = make_layer(dtype)
    main_grad = hooked.weight.main_grad
    hooks = CloneOnUnpack()
    hooked_out = []
    for x, dy in data:
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            x = x.detach().requires_grad_()
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = hooked(x)
        y.backward(dy)
        hooked_out.append((y, x.grad))
    assert hooks.unpacked > 0
    assert hooked.weight.main_grad is main_grad
    assert torch.equal(main_grad, plain.weight.main_grad)
    assert main_grad.abs().sum().item() > 0
    assert hooked.weight.grad is None
    for (y1, dx1), (y2, dx2) in zip(plain_out, hooked_out, strict=True):
        assert torch.equal(y1, y2)
        assert torch.equal(dx1, dx2)
    assert torch.equal(plain.bias.grad, hooked.bias.grad)


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["hp", "current"])
def test_parameters_split_main_grads(recipe):
    split = {"q": 16, "kv": 32}
    layer = te.Linear(IN, OUT, parameters_split=split, fuse_wgrad_accumulation=True)
    full = te.Linear(IN, OUT, fuse_wgrad_accumulation=True)
    weight = representable((OUT, IN), torch.bfloat16, scale=0.125)
    with torch.no_grad():
        full.weight.copy_(weight)
        layer.q_weight.copy_(weight[:16])
        layer.kv_weight.copy_(weight[16:])
    full.weight.main_grad = torch.zeros(OUT, IN)
    layer.q_weight.main_grad = torch.zeros(16, IN)
    layer.kv_weight.main_grad = torch.zeros(32, IN)
    for x, dy in batches(2, torch.float32):
        step(full, x, dy, recipe)
        step(layer, x, dy, recipe)
    assert full.weight.main_grad.abs().sum().item() > 0
    assert torch.equal(layer.q_weight.main_grad, full.weight.main_grad[:16])
    assert torch.equal(layer.kv_weight.main_grad, full.weight.main_grad[16:])
    assert layer.q_weight.grad is None and layer.kv_weight.grad is None


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["hp", "current"])
def test_deepcopy_of_a_used_layer_accumulates_into_its_own_main_grad(recipe):
    layer = make_layer()
    data = batches(2, torch.float32)
    step(layer, *data[0], recipe)
    original = layer.weight.main_grad.clone()
    clone = copy.deepcopy(layer)
    clone.weight.main_grad = torch.zeros(OUT, IN)
    step(clone, *data[1], recipe)
    assert torch.equal(layer.weight.main_grad, original)  # the original is untouched
    expected = reference_wgrads(recipe, data)[1]
    assert_close(clone.weight.main_grad, expected, torch.float32)


def test_whole_module_save_after_a_fused_step():
    layer = make_layer()
    step(layer, *batches(1, torch.float32)[0], None)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded.weight, layer.weight)
    loaded.weight.main_grad = torch.zeros(OUT, IN)
    step(loaded, *batches(1, torch.float32)[0], None)
    assert loaded.weight.main_grad.abs().sum().item() > 0
