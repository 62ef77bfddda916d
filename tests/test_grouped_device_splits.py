"""Grouped FP8 layers with group sizes known only on the device (a split tensor on the GPU):
nothing is read back to the host, so the step can be captured in a CUDA graph and replayed
with other splits.

On the CPU the same path runs when READ_CPU_SPLITS is off (tests only): the grouped casts with
worst-case room, the grouped GEMMs' references. There it equals the host-sizes path bit for
bit; on the GPU the quantized bytes are equal and the GEMMs (Triton against cuBLAS) agree
within the output dtype's tolerance, and a CUDA graph replays with new splits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import assert_close, representable

import torchte as te
import torchte._group_splits as group_splits_mod
from torchte import recipe
from torchte.kernels import grouped_cast
from torchte.kernels.cast_spec import CastSpec
from torchte.quantization.grouped import GroupedStorage

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
SPLITS = [16, 0, 40, 8]  # an expert without tokens, sizes not multiples of 16
OTHER_SPLITS = [0, 24, 8, 32]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
pytestmark = pytest.mark.usefixtures("cpu_default_device")


@pytest.fixture
def device_only_splits(monkeypatch):
    """Split tensors on the CPU take the device-side path too."""
    monkeypatch.setattr(group_splits_mod, "READ_CPU_SPLITS", False)


def _mlp(device, bias):
    kw = {"device": device, "dtype": torch.bfloat16, "bias": bias}
    mlp = te.ops.Sequential(
        te.ops.GroupedLinear(len(SPLITS), 64, 64, **kw),
        te.ops.ScaledSwiGLU(device=device),
        te.ops.GroupedLinear(len(SPLITS), 32, 64, **kw),
    )
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(representable(param.shape, torch.bfloat16, scale=0.125, generator=gen))
    return mlp


def _step(mlp, splits, recipe_name, seed=0):
    """(y, dx, dprobs, parameter grads) of one forward+backward of the MLP."""
    tokens = int(sum(splits.tolist() if isinstance(splits, torch.Tensor) else splits))
    device = next(mlp.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    x = representable((tokens, 64), torch.bfloat16, generator=gen, device=device)
    x = x.to(torch.bfloat16).requires_grad_(True)
    probs = representable(tokens, torch.bfloat16, generator=gen, device=device).abs()
    probs.requires_grad_(True)
    with te.autocast(recipe=RECIPES[recipe_name]()):
        y = mlp(x, splits, probs, splits)
    y.backward(representable(y.shape, torch.bfloat16, generator=gen, device=device).to(y.dtype))
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad(set_to_none=True)
    return y.detach(), x.grad, probs.grad, grads


def _assert_results(got, want, device, bias):
    """Without biases bit for bit on the CPU. With biases the host path's per-group GEMM adds
    the bias before its one rounding and the device path after the GEMM: h can differ by one
    bf16 step, and an FP8 byte made from it by one FP8 step, so the CPU results agree within
    e4m3's tolerance. On the GPU (the same cuBLAS fprop and bias add on both paths, Triton
    against cuBLAS for dgrad and wgrad, sums in another order) within bf16's."""
    pairs = [("y", got[0], want[0]), ("dx", got[1], want[1]), ("dprobs", got[2], want[2])]
    assert got[3].keys() == want[3].keys()
    pairs += [(name, got[3][name], want[3][name]) for name in want[3]]
    for name, a, b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if device == "cpu" and not bias:
            assert torch.equal(a, b), name
        else:
            tolerance = torch.float8_e4m3fn if device == "cpu" else torch.bfloat16
            assert_close(a, b.double(), tolerance, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("bias", [False, True])
def test_fused_grouped_mlp_with_device_splits_equals_host_splits(
    device_only_splits, device, recipe_name, bias
):
    mlp = _mlp(device, bias)
    twin = copy.deepcopy(mlp)
    for step in range(2):  # delayed scaling: the second step uses the updated scales
        on_device = torch.tensor(SPLITS, device=device)
        got = _step(mlp, on_device, recipe_name, seed=step)
        want = _step(twin, SPLITS, recipe_name, seed=step)
        _assert_results(got, want, device, bias)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_grouped_linear_main_grad_with_device_splits(device_only_splits, recipe_name):
    """fuse_wgrad_accumulation from the device-side grouped wgrad: overwritten on the first
    microbatch, added on the next, equal to the host-sizes path."""
    layers = [
        te.GroupedLinear(len(SPLITS), 32, 48, bias=False, fuse_wgrad_accumulation=True)
        for _ in range(2)
    ]
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        for w in layer.parameters():
            w.main_grad = torch.full(w.shape, 0.5)
    x = representable((sum(SPLITS), 32), torch.bfloat16).to(torch.bfloat16)
    for first in (True, False):
        for layer, splits in zip(layers, (torch.tensor(SPLITS), SPLITS), strict=True):
            with te.autocast(recipe=RECIPES[recipe_name]()):
                y = layer(x, splits, is_first_microbatch=first)
            y.backward(torch.ones_like(y))
        for a, b in zip(layers[0].parameters(), layers[1].parameters(), strict=True):
            assert torch.equal(a.main_grad, b.main_grad)
    assert torch.equal(layers[0].weight1.main_grad, torch.zeros(48, 32))  # no tokens


@pytest.mark.parametrize("columnwise", [False, True])
def test_quantize_grouped_from_device_offsets(columnwise):
    """m_splits None: the same bytes and scales, the columnwise blocks at the same places in a
    buffer with room for any split (T + 15 G columns), the rest zero."""
    tokens, k = sum(SPLITS), 32
    x = representable((tokens, k), torch.bfloat16).float()
    spec = CastSpec(torch.float8_e4m3fn, True, columnwise, None, None, 0.0, False)
    rows, cols = grouped_cast.device_grouped_offsets(torch.tensor(SPLITS))
    host_rows, host_cols = grouped_cast.grouped_offsets(SPLITS, "cpu")
    assert torch.equal(rows, host_rows) and torch.equal(cols, host_cols)
    got = grouped_cast.quantize_grouped(x, None, rows, cols, spec)
    want = grouped_cast.quantize_grouped(x, SPLITS, host_rows, host_cols, spec)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[2], want[2])
    if columnwise:
        room = grouped_cast.grouped_columns(None, tokens, len(SPLITS))
        assert got[1].numel() == k * room == k * (tokens + 15 * len(SPLITS))
        used = want[1].numel()
        assert torch.equal(got[1].view(torch.uint8)[:used], want[1].view(torch.uint8))
        assert not got[1].view(torch.uint8)[used:].any()


def test_grouped_storage_with_device_sizes_reads_them_back_once():
    tokens, k = sum(SPLITS), 32
    x = representable((tokens, k), torch.bfloat16).float()
    spec = CastSpec(torch.float8_e4m3fn, True, True, None, None, 0.0, False)
    offsets = grouped_cast.device_grouped_offsets(torch.tensor(SPLITS))
    data, data_t, scale_inv = grouped_cast.quantize_grouped(x, None, *offsets, spec)
    storage = GroupedStorage(
        data, data_t, scale_inv, torch.float8_e4m3fn, None, (tokens, k), offsets
    )
    assert not storage.sizes_on_host and storage.num_groups == len(SPLITS)
    assert "on the device" in repr(storage)
    host = GroupedStorage.from_groups(storage.groups(), torch.float8_e4m3fn)  # reads them back
    assert storage.sizes_on_host and storage.m_splits == tuple(SPLITS)
    assert torch.equal(storage.dequantize(), host.dequantize())
    storage.update_usage(rowwise_usage=False)
    storage.update_usage(rowwise_usage=True)  # rebuilt from the columnwise blocks
    assert torch.equal(storage.rowwise_data.view(torch.uint8), data.view(torch.uint8))
    with pytest.raises(ValueError, match="offsets must be two"):
        GroupedStorage(data, None, scale_inv, torch.float8_e4m3fn, None, (tokens, k))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_device_splits_never_synchronize_and_capture_in_a_cuda_graph(recipe_name):
    """Eager with device splits runs with torch's sync debug mode set to error; a CUDA graph of
    forward+backward replays with other splits and equals eager on those splits (bit for bit
    under current scaling, which carries no state from the capture's warm-up). The graph is
    made from a module that has not run eagerly: an eager backward first leaves autograd
    nodes on the default stream, which a later capture may not wait on (torch's rule)."""
    mlp = _mlp("cuda", bias=True)
    eager, checked = copy.deepcopy(mlp), copy.deepcopy(mlp)
    tokens = sum(SPLITS)
    x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda", requires_grad=True)
    splits = torch.tensor(SPLITS, device="cuda")
    make = RECIPES[recipe_name]
    graphed = te.make_graphed_callables(
        mlp, (x, splits, probs, splits), fp8_enabled=True, fp8_recipe=make()
    )
    x2, probs2 = x.detach().clone().requires_grad_(True), probs.detach().clone()
    with te.autocast(recipe=make()):
        checked(x2, splits, probs2.requires_grad_(True), splits)  # compile, probe: unchecked
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with te.autocast(recipe=make()):
            y = checked(x2, splits, probs2, splits)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    splits.copy_(torch.tensor(OTHER_SPLITS, device="cuda"))
    with te.autocast(recipe=make()):
        want = eager(x.detach(), splits, probs.detach(), splits)
    got = graphed(x, splits, probs, splits)
    if recipe_name == "current":
        assert torch.equal(got, want)
    else:
        assert_close(got, want.double(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_grouped_linear_past_small_rows_equals_a_stack_of_linears(recipe_name):
    """Past kernels/grouped_gemm_fp8.SMALL_ROWS tokens the device-split GEMMs are the
    persistent TMA kernels (the forward with fast accumulation, as te.Linear's): y, dx and
    each weight's gradient against te.Linear per group (cuBLAS) on the same weights, within
    bf16's tolerance. One step, so delayed scaling's scales are the initial ones on both."""
    from torchte.kernels.grouped_gemm_fp8 import SMALL_ROWS

    splits, k, n = [0, 3000, 1, 1999], 256, 128
    assert sum(splits) > SMALL_ROWS
    kw = {"bias": False, "device": "cuda", "params_dtype": torch.bfloat16}
    layer = te.GroupedLinear(len(splits), k, n, **kw)
    linears = [te.Linear(k, n, **kw) for _ in splits]
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for g, linear in enumerate(linears):
            weight = representable((n, k), torch.bfloat16, scale=0.125, generator=gen)
            getattr(layer, f"weight{g}").copy_(weight)
            linear.weight.copy_(weight)
    x = representable((sum(splits), k), torch.bfloat16, generator=gen, device="cuda")
    dy = representable((sum(splits), n), torch.bfloat16, generator=gen, device="cuda")
    x_grouped = x.to(torch.bfloat16).requires_grad_(True)
    x_linear = x.to(torch.bfloat16).requires_grad_(True)
    with te.autocast(recipe=RECIPES[recipe_name]()):
        y = layer(x_grouped, torch.tensor(splits, device="cuda"))
        parts = [
            linear(part) for linear, part in zip(linears, x_linear.split(splits), strict=True)
            if part.shape[0]
        ]  # fmt: skip
    y.backward(dy.to(torch.bfloat16))
    torch.cat(parts).backward(dy.to(torch.bfloat16))
    assert_close(y, torch.cat(parts).double(), torch.bfloat16, msg="y")
    assert_close(x_grouped.grad, x_linear.grad.double(), torch.bfloat16, msg="dx")
    for g, linear in enumerate(linears):
        got = getattr(layer, f"weight{g}").grad
        want = linear.weight.grad if splits[g] else torch.zeros_like(got)
        assert_close(got, want.double(), torch.bfloat16, msg=f"dw{g}")
