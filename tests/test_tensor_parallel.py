"""te.Linear, te.LayerNormLinear and te.LayerNormMLP under tensor and sequence parallelism:
2 gloo ranks on the CPU against the same layer on one rank with the full weight.

Each rank builds the full reference layer from one seed, takes its shard of the weight and of
the inputs, runs forward and backward, and compares its output, input gradient and parameter
gradients with the matching slices of the reference's. The values are -1, 0 or 1, so every
product and every partial sum (also the ones the collectives add) is exact in bf16: fp32 and
bf16 agree bit for bit. Under FP8 the dequantizing scale products (1 / 448 and the like) are
not exact, so the results agree within fp32's tolerance with the unquantized reference.
Delayed scaling reduces the amaxes over the group, so both ranks end with the same scales.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from ranks import each_config, on_ranks
from tolerances import assert_close, tolerance

import torchte as te
from torchte import distributed as te_dist
from torchte import recipe
from torchte.quantization.grouped_quantizer import GroupedQuantizer

WORLD = 2
S, B, K, N = 8, 2, 32, 64
PRECISIONS = ("fp32", "bf16", "delayed", "current")
CONFIGS = [
    (mode, sp, precision)
    for mode in ("column", "row")
    for sp in (False, True)
    for precision in PRECISIONS
]
NORM_CONFIGS = [(sp, precision) for sp in (False, True) for precision in PRECISIONS]
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}


def _shards(mode, sp, rank):
    """(input slice, output slice, weight slice, bias slice) of this rank, as index tuples."""
    world = dist.get_world_size()
    every = slice(None)
    seq = slice(rank * S // world, (rank + 1) * S // world)
    if mode == "column":
        cols = slice(rank * N // world, (rank + 1) * N // world)
        inp = (seq,) if sp else (every,)
        return inp, (every, every, cols), (cols,), (cols,)
    ks = slice(rank * K // world, (rank + 1) * K // world)
    out = (seq,) if sp else (every,)
    return (every, every, ks), out, (every, ks), (every,)


def _run(layer, x, dy, precision, steps=2):
    for _ in range(steps):  # delayed scaling: the later step uses the reduced scales
        for p in layer.parameters():
            p.grad = None
        x = x.detach().requires_grad_(True)
        with te.autocast(
            enabled=precision in RECIPES, recipe=RECIPES.get(precision, lambda: None)()
        ):
            y = layer(x)
        y.backward(dy)
    params = layer._parameters
    weight, bias = params.get("weight"), params.get("bias")
    grads = (None, None) if weight is None else (weight.grad, bias.grad)
    return y.detach(), x.grad, *grads


def _values(precision, seed):
    """(dtype, ternary(*shape)): the compute dtype of a precision, and a maker of seeded
    tensors of -1, 0 and 1 in it, drawn on the CPU and placed on the default device (a rank's
    GPU in tests/test_distributed_gpu2.py)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(seed)

    def ternary(*shape):
        values = torch.randint(-1, 2, shape, generator=gen, device="cpu")
        return values.to(torch.get_default_device(), dtype)

    return dtype, ternary


def _check_config(mode, sp, precision, rank) -> None:
    dtype, ternary = _values(precision, 0)
    x, dy = ternary(S, B, K), ternary(S, B, N)
    ref = te.Linear(K, N, params_dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(ternary(N, K))
        ref.bias.copy_(ternary(N))
    layer = te.Linear(
        K, N, params_dtype=dtype, parallel_mode=mode, sequence_parallel=sp,
        tp_group=dist.group.WORLD, tp_size=dist.get_world_size(),
    )  # fmt: skip
    inp, out, w, b = _shards(mode, sp, rank)
    with torch.no_grad():
        layer.weight.copy_(ref.weight[w])
        layer.bias.copy_(ref.bias[b])
    want = _run(ref, x, dy, "fp32" if precision in RECIPES else precision)
    with _gathers() as gathered:
        got = _run(layer, x[inp], dy[out], precision)
    if mode == "column" and sp:  # the input: FP8 bytes under FP8 (one per value)
        moved = (torch.uint8 if precision in RECIPES else dtype, S // dist.get_world_size() * B * K)
        assert gathered[0] == moved, gathered
    bias_grad = got[3].clone()
    if mode == "row" and sp:  # a partial sum per rank: Megatron all-reduces it (attribute)
        assert layer.bias.sequence_parallel
        dist.all_reduce(bias_grad)
    label = f"{mode} sp={sp} {precision}"
    pairs = {"y": (got[0], want[0][out]), "dx": (got[1], want[1][inp])}
    pairs.update({"dW": (got[2], want[2][w]), "db": (bias_grad, want[3][b])})
    for name, (a, e) in pairs.items():
        if precision in RECIPES:
            assert_close(a, e.double(), torch.float32, msg=f"{label}: {name}")
        else:
            assert a.dtype == e.dtype and torch.equal(a, e), f"{label}: {name}"
    if precision == "delayed":  # the same scales on both ranks
        for state in layer._delayed_states[4]:
            scales = [torch.empty_like(state.scale) for _ in range(dist.get_world_size())]
            dist.all_gather(scales, state.scale)
            assert all(torch.equal(scales[0], t) for t in scales), label


@contextlib.contextmanager
def _gathers():
    """[(dtype, elements) of each tensor te.distributed all-gathers from this rank] inside."""
    original = te_dist.gather_along_first_dim
    seen = []

    def recorded(inp, *args, **kwargs):
        seen.append((inp.dtype, inp.numel()))
        return original(inp, *args, **kwargs)

    te_dist.gather_along_first_dim = recorded
    try:
        yield seen
    finally:
        te_dist.gather_along_first_dim = original


def _check_norm_linear(sp, precision, rank) -> None:
    """te.LayerNormLinear, column-parallel: the norm's output equal on every rank (whole, or
    this rank's sequence shard), its weight gradients whole on every rank without sequence
    parallelism, and with it the partial sums of this rank's rows (those the one-rank layer
    makes from these rows alone). The norm's output is inexact, so the results agree
    within the dtype's tolerance; under FP8 both layers quantize the same norm output with the
    same scale, so against the one-rank FP8 layer within fp32's."""
    dtype, ternary = _values(precision, 1)
    x, dy = ternary(S, B, K), ternary(S, B, N)
    ref = te.LayerNormLinear(K, N, params_dtype=dtype)
    layer = te.LayerNormLinear(
        K, N, params_dtype=dtype, parallel_mode="column", sequence_parallel=sp,
        tp_group=dist.group.WORLD, tp_size=WORLD,
    )  # fmt: skip
    inp, out, w, b = _shards("column", sp, rank)
    with torch.no_grad():
        ref.weight.copy_(ternary(N, K))
        ref.bias.copy_(ternary(N))
        ref.layer_norm_weight.copy_(1 + ternary(K) / 4)
        ref.layer_norm_bias.copy_(ternary(K) / 8)
        layer.weight.copy_(ref.weight[w])
        layer.bias.copy_(ref.bias[b])
        layer.layer_norm_weight.copy_(ref.layer_norm_weight)
        layer.layer_norm_bias.copy_(ref.layer_norm_bias)
    shard_ref = copy.deepcopy(ref)
    want = _run(ref, x, dy, precision)
    with _gathers() as gathered:
        got = _run(layer, x[inp], dy[out], precision)
    if sp:  # forward: the norm output, FP8 bytes under FP8 (one per value), else the dtype's
        fp8 = precision in RECIPES
        assert gathered[0] == (torch.uint8 if fp8 else dtype, S // WORLD * B * K), gathered
    assert layer.layer_norm_weight.sequence_parallel == sp
    if sp:  # partial sums over this rank's rows: those of the one-rank layer run on them
        _run(shard_ref, x[inp], dy[inp], precision)
        ref = shard_ref
    norm_grads = [layer.layer_norm_weight.grad, layer.layer_norm_bias.grad]
    label = f"LayerNormLinear sp={sp} {precision}"
    tol = torch.bfloat16 if precision == "bf16" else torch.float32
    pairs = {"y": (got[0], want[0][out]), "dx": (got[1], want[1][inp])}
    pairs.update({"dW": (got[2], want[2][w]), "db": (got[3], want[3][b])})
    pairs["d ln weight"] = (norm_grads[0], ref.layer_norm_weight.grad)
    pairs["d ln bias"] = (norm_grads[1], ref.layer_norm_bias.grad)
    for name, (a, e) in pairs.items():
        assert_close(a, e.double(), tol, msg=f"{label}: {name}")


def _assert_norm_close(got, want, dtype, label) -> None:
    """||got - want|| <= rtol(dtype) ||want|| (Frobenius): the MLP's row-parallel fc2 adds the
    ranks' partial sums of inexact values in another order than one GEMM does, which an
    elementwise check flags wherever the sum cancels; FP8 (dtype e4m3): each rank scales its
    shard of the activation by that shard's own amax."""
    rtol = tolerance(dtype)[0]
    error = (got.double() - want.double()).norm() / want.double().norm()
    assert error <= rtol, f"{label}: relative error {error:.3g} > {rtol}"


def _check_mlp(sp, precision, rank) -> None:
    """te.LayerNormMLP with set_parallel_mode (fc1 column, fc2 row; SwiGLU, whose fc1 rows are
    split per half): output, input gradient and every parameter gradient against the one-rank
    module's matching slices (fc2's bias and the norm's parameters: partial sums of this rank's
    rows under sequence parallelism, as te.LayerNormLinear's), within the dtype's relative
    tolerance norm-wise (_assert_norm_close)."""
    dtype, ternary = _values(precision, 2)
    ffn = 32
    x, dy = ternary(S, B, K), ternary(S, B, K)
    kw = {"params_dtype": dtype, "activation": "swiglu"}
    ref = te.LayerNormMLP(K, ffn, **kw)
    layer = te.LayerNormMLP(
        K, ffn, set_parallel_mode=True, sequence_parallel=sp, tp_group=dist.group.WORLD,
        tp_size=WORLD, **kw,
    )  # fmt: skip
    rows = torch.arange(rank * ffn // WORLD, (rank + 1) * ffn // WORLD)
    fc1_rows = torch.cat([rows, rows + ffn])  # [act_r; gate_r]
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(ternary(*param.shape) / (4 if "layer_norm" in name else 1))
        ref.layer_norm_weight.add_(1)
        shards = {
            "fc1_weight": ref.fc1_weight[fc1_rows], "fc1_bias": ref.fc1_bias[fc1_rows],
            "fc2_weight": ref.fc2_weight[:, rows],
        }  # fmt: skip
        for name, param in layer.named_parameters():
            param.copy_(shards.get(name, getattr(ref, name)))
    seq = _shards("column", sp, rank)[0]
    shard_ref = copy.deepcopy(ref)
    want = _run(ref, x, dy, precision)
    with _gathers() as gathered:
        got = _run(layer, x[seq], dy[seq], precision)
    if sp:  # the norm output: FP8 bytes under FP8 (one per value)
        moved = (torch.uint8 if precision in RECIPES else dtype, S // WORLD * B * K)
        assert gathered[0] == moved, gathered
    grads = {name: p.grad for name, p in layer.named_parameters()}
    partial = ("layer_norm_weight", "layer_norm_bias", "fc2_bias")
    if sp:  # those of the one-rank module run on this rank's rows
        _run(shard_ref, x[seq], dy[seq], precision)
    label = f"LayerNormMLP sp={sp} {precision}"
    tol = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(precision, torch.float8_e4m3fn)
    _assert_norm_close(got[0], want[0][seq], tol, f"{label}: y")
    _assert_norm_close(got[1], want[1][seq], tol, f"{label}: dx")
    index = {"fc1_weight": fc1_rows, "fc1_bias": fc1_rows}
    for name, grad in grads.items():
        source = shard_ref if sp and name in partial else ref
        expected = getattr(source, name).grad
        if name in index:
            expected = expected[index[name]]
        elif name == "fc2_weight":
            expected = expected[:, rows]
        _assert_norm_close(grad, expected, tol, f"{label}: d {name}")
    assert layer.fc2_bias.sequence_parallel == sp and layer.fc1_weight.partition_dim == 0
    assert layer.fc2_weight.partition_dim == 1


GROUPED_CONFIGS = [(mode, precision) for mode in ("column", "row") for precision in PRECISIONS]


def _check_grouped(mode, precision, rank) -> None:
    """te.GroupedLinear, column or row per expert (an expert without tokens among them): the
    same exactness as te.Linear's."""
    dtype, ternary = _values(precision, 3)
    splits = [6, 0, 10]
    x, dy = ternary(sum(splits), K), ternary(sum(splits), N)
    ref = te.GroupedLinear(len(splits), K, N, params_dtype=dtype)
    layer = te.GroupedLinear(
        len(splits), K, N, params_dtype=dtype, parallel_mode=mode, tp_group=dist.group.WORLD
    )
    every = slice(None)
    if mode == "column":  # (x, y) column slices, weight and bias slices
        part = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
        x_cols, y_cols, w, b = every, part, (part,), part
    else:
        part = slice(rank * K // WORLD, (rank + 1) * K // WORLD)
        x_cols, y_cols, w, b = part, every, (every, part), every
    with torch.no_grad():
        for g in range(len(splits)):
            ref.get_parameter(f"weight{g}").copy_(ternary(N, K))
            ref.get_parameter(f"bias{g}").copy_(ternary(N))
            layer.get_parameter(f"weight{g}").copy_(ref.get_parameter(f"weight{g}")[w])
            layer.get_parameter(f"bias{g}").copy_(ref.get_parameter(f"bias{g}")[b])
    results = []
    for module, xi, dyi in ((ref, x, dy), (layer, x[:, x_cols], dy[:, y_cols])):
        xi = xi.clone().requires_grad_(True)
        fp8 = precision in RECIPES
        with te.autocast(enabled=fp8, recipe=RECIPES[precision]() if fp8 else None):
            y = module(xi, splits)
        y.backward(dyi)
        grads = {n: p.grad for n, p in module.named_parameters()}
        results.append({"y": y.detach(), "dx": xi.grad, **grads})
    want, got = results
    want["y"], want["dx"] = want["y"][:, y_cols], want["dx"][:, x_cols]
    for name in grads:
        want[name] = want[name][w if name.startswith("weight") else b]
    label = f"GroupedLinear {mode} {precision}"
    for name, a in got.items():
        if precision in RECIPES:
            assert_close(a, want[name].double(), torch.float32, msg=f"{label}: {name}")
        else:
            assert torch.equal(a, want[name]), f"{label}: {name}"


def _check_gathered_norm_output(module_name, rank) -> None:
    """return_layernorm_output_gathered: the whole norm output on every rank; a loss on it (each
    rank taking its own rows' term) back-propagates as on one rank."""
    _, ternary = _values("fp32", 6)
    x, dz = ternary(S, B, K), ternary(S, B, K)
    make = getattr(te, module_name)
    size = N if module_name == "LayerNormLinear" else 32
    ref = make(K, size, return_layernorm_output=True)
    tp = {"tp_group": dist.group.WORLD, "sequence_parallel": True}
    tp.update(
        {"parallel_mode": "column"}
        if module_name == "LayerNormLinear"
        else {"set_parallel_mode": True}
    )
    layer = make(K, size, return_layernorm_output_gathered=True, **tp)
    with torch.no_grad():
        ref.layer_norm_weight.copy_(1 + ternary(K) / 4)
        layer.layer_norm_weight.copy_(ref.layer_norm_weight)
        for name, param in layer.named_parameters():
            if "layer_norm" not in name:  # the output is not checked: any split weights
                getattr(ref, name).zero_()
                param.zero_()
    seq = _shards("column", True, rank)[0]
    xr = x.clone().requires_grad_(True)
    y, z = ref(xr)
    ((z * dz).sum() + y.sum() * 0).backward()
    xl = x[seq].clone().requires_grad_(True)
    y, z = layer(xl)
    assert z.shape == (S, B, K)
    assert_close(z, ref(x)[1].detach().double(), torch.float32, msg=f"{module_name}: z")
    ((z[seq] * dz[seq]).sum() + y.sum() * 0).backward()
    assert_close(xl.grad, xr.grad[seq].double(), torch.float32, msg=f"{module_name}: dx")


def _tp_mlp(**kw):
    return te.LayerNormMLP(
        K, 32, set_parallel_mode=True, sequence_parallel=True, tp_group=dist.group.WORLD, **kw
    )


def _check_features(feature, precision, rank) -> None:
    """te.checkpoint, CPU offloading and fused wgrad accumulation around tensor-parallel
    modules give the gradients of the plain run, bit for bit."""
    _, ternary = _values(precision, 4)
    fp8 = precision in RECIPES
    torch.manual_seed(5)
    blocks = [_tp_mlp(fuse_wgrad_accumulation=feature == "main_grad") for _ in range(2)]
    twins = [_tp_mlp() for _ in range(2)]
    for block, twin in zip(blocks, twins, strict=True):
        twin.load_state_dict(block.state_dict())
        for p in block.parameters():
            p.main_grad = torch.zeros_like(p)
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_offload_bytes=0
    )
    x = ternary(S // WORLD, B, K)

    def run(layers, special):
        h = x.clone().requires_grad_(True)
        out = h
        with te.autocast(enabled=fp8, recipe=RECIPES[precision]() if fp8 else None):
            for layer in layers:
                if special and feature == "checkpoint":
                    out = te.checkpoint(layer, out)
                elif special and feature == "offload":
                    with context:
                        out = layer(out)
                    out = sync(out)
                else:
                    out = layer(out)
        out.float().square().sum().backward()
        grads = [h.grad]
        for layer in layers:
            for p in layer.parameters():
                main = special and feature == "main_grad" and p.dim() == 2
                grads.append(p.main_grad if main else p.grad)
        return grads

    got, want = run(blocks, True), run(twins, False)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.to(b.dtype), b), f"{feature} {precision}: {i}"


FEATURE_CONFIGS = [
    (feature, precision)
    for feature in ("checkpoint", "offload", "main_grad")
    for precision in ("fp32", "current")
]


def _check_current_scaling_agrees(rank) -> None:
    """A current-scaling quantizer of a split tensor-parallel module scales each rank's piece
    by the amax over the ranks: the same scale on both, the bytes of the whole tensor's cast."""
    layer = te.Linear(K, N, parallel_mode="row", tp_group=dist.group.WORLD)
    setup = layer._fp8_setup(recipe.Float8CurrentScaling())
    quantizer = setup.input[0]
    gen = torch.Generator().manual_seed(7)
    whole = (
        torch.randn(WORLD, 16, K // WORLD, generator=gen) * torch.tensor([1.0, 3.0])[:, None, None]
    )
    piece = quantizer.quantize(whole[rank], columnwise=False)
    alone = setup.input[0].__class__(quantizer.fp8_dtype).quantize(whole.reshape(-1, K // WORLD))
    assert torch.equal(piece.scale_inv, alone.scale_inv)  # rank 1's amax on both ranks
    rows = slice(rank * 16, (rank + 1) * 16)
    assert torch.equal(
        piece.rowwise_data.view(torch.uint8), alone.rowwise_data[rows].view(torch.uint8)
    )


SYMMETRIC_CONFIGS = [(mode, precision) for mode in ("column", "row") for precision in PRECISIONS]
_FUSED = ("all_gather_matmul", "matmul_reduce_scatter")


def _check_symmetric(mode, precision, rank) -> None:
    """te.distributed.use_symmetric_memory: te.Linear + sequence parallelism equals one rank as
    without it; its high-precision GEMMs go through the fused collectives (here, on the CPU,
    their plain fallback), FP8 ones keep the plain collectives."""
    calls, originals = [], {name: getattr(te_dist, name) for name in _FUSED}

    def recorded(name):
        def run(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return run

    previous = te_dist.use_symmetric_memory(True)
    try:
        for name in _FUSED:
            setattr(te_dist, name, recorded(name))
        _check_config(mode, True, precision, rank)
    finally:
        for name in _FUSED:
            setattr(te_dist, name, originals[name])
        te_dist.use_symmetric_memory(previous)
    forward, backward = _FUSED if mode == "column" else reversed(_FUSED)
    want = [] if precision in RECIPES else [forward, backward] * 2  # two steps
    assert calls == want, calls


def _check_grouped_current_scaling_agrees(rank) -> None:
    """The grouped quantizer of a row-split te.GroupedLinear scales each group's piece by the
    group's amax over the ranks (a different rank holding the largest value of each group): the
    same scales on both, the bytes of the whole groups' cast."""
    splits = [16, 0, 32, 16]
    layer = te.GroupedLinear(len(splits), K, N, parallel_mode="row", tp_group=dist.group.WORLD)
    quantizer = layer._fp8_setup(recipe.Float8CurrentScaling()).grouped_input
    gen = torch.Generator().manual_seed(11)
    magnitude = torch.tensor([[1.0, 5.0, 4.0, 0.5], [3.0, 1.0, 0.25, 2.0]])
    rows = torch.repeat_interleave(magnitude, torch.tensor(splits), dim=1)  # (WORLD, T)
    whole = torch.randn(WORLD, sum(splits), K // WORLD, generator=gen) * rows[..., None]
    piece = quantizer.quantize(whole[rank], splits, columnwise=False)
    alone = GroupedQuantizer(quantizer.fp8_dtype).quantize(
        torch.cat(list(whole), dim=1), splits, columnwise=False
    )
    assert torch.equal(piece.scale_inv, alone.scale_inv)
    cols = slice(rank * K // WORLD, (rank + 1) * K // WORLD)
    assert torch.equal(
        piece.rowwise_data.view(torch.uint8), alone.rowwise_data[:, cols].view(torch.uint8)
    )


def _rank_main(rank: int) -> dict:
    outcome = each_config(_check_config, CONFIGS, rank)
    outcome.update(each_config(_check_norm_linear, NORM_CONFIGS, rank))
    mlp = each_config(_check_mlp, NORM_CONFIGS, rank)
    outcome.update({("mlp", *config): text for config, text in mlp.items()})
    outcome.update(each_config(_check_features, FEATURE_CONFIGS, rank))
    outcome.update(each_config(_check_current_scaling_agrees, [()], rank))
    symmetric = each_config(_check_symmetric, SYMMETRIC_CONFIGS, rank)
    outcome.update({("symmetric", *config): text for config, text in symmetric.items()})
    agrees = each_config(_check_grouped_current_scaling_agrees, [()], rank)
    outcome.update({("grouped", *config): text for config, text in agrees.items()})
    gathered = [("LayerNormLinear",), ("LayerNormMLP",)]
    outcome.update(each_config(_check_gathered_norm_output, gathered, rank))
    grouped = each_config(_check_grouped, GROUPED_CONFIGS, rank)
    outcome.update({("grouped", *config): text for config, text in grouped.items()})
    layer = te.Linear(K, N, parallel_mode="row", sequence_parallel=True, tp_group=dist.group.WORLD)
    try:
        layer(torch.randn(3, B, K // WORLD))
        outcome["odd sequence"] = "no error"
    except ValueError as err:
        outcome["odd sequence"] = str(err)
    layer(torch.randn(4, B, K // WORLD)).sum().backward()  # the next step still runs
    # A layer built before its group (tp_size only) gets it later and equals one built with it.
    late = te.Linear(K, N, parallel_mode="column", sequence_parallel=True, tp_size=WORLD)
    early = te.Linear(
        K, N, parallel_mode="column", sequence_parallel=True, tp_group=dist.group.WORLD
    )
    early.load_state_dict(late.state_dict())
    late.set_tensor_parallel_group(dist.group.WORLD)
    x = torch.randn(S // WORLD, B, K)
    outcome["late group"] = "ok" if torch.equal(late(x), early(x)) else "differs"
    return outcome


def test_linear_tensor_parallel_equals_one_rank(tmp_path):
    for outcome in on_ranks(_rank_main, WORLD, tmp_path):
        assert "divisible by the 2 tensor-parallel ranks" in outcome.pop("odd sequence")
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed


# Four ranks: features split four ways (FP8 GEMMs need every split dim a multiple of 16).
CONFIGS_4 = [
    (mode, sp, precision)
    for mode in ("column", "row")
    for sp in (False, True)
    for precision in ("fp32", "bf16", "current")
    if not (mode == "row" and precision == "current")
]


def _rank_main_4(rank: int) -> dict:
    return each_config(_check_config, CONFIGS_4, rank)


def test_linear_tensor_parallel_over_four_ranks(tmp_path):
    for outcome in on_ranks(_rank_main_4, 4, tmp_path):
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed


def test_parameters_are_marked_as_transformer_engine_marks_them():
    column = te.Linear(16, 32, parallel_mode="column", tp_size=2)
    assert column.weight.shape == (16, 16) and column.out_features == 16
    assert column.weight.tensor_model_parallel and column.weight.partition_dim == 0
    assert column.bias.tensor_model_parallel and column.bias.partition_dim == 0
    row = te.Linear(16, 32, parallel_mode="row", tp_size=2, sequence_parallel=True)
    assert row.weight.shape == (32, 8) and row.in_features == 8
    assert row.weight.tensor_model_parallel and row.weight.partition_dim == 1
    assert row.weight.partition_stride == 1
    assert row.bias.sequence_parallel and not hasattr(row.bias, "tensor_model_parallel")
    replicated = te.Linear(16, 32)
    assert replicated.weight.tensor_model_parallel is False


def test_a_split_layer_without_its_group_asks_for_it():
    layer = te.Linear(16, 32, parallel_mode="column", tp_size=2)
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        layer(torch.randn(4, 16))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"parallel_mode": "diagonal"}, ValueError, "parallel_mode must be None"),
        ({"parallel_mode": "column", "tp_size": 3}, ValueError, "must divide out_features=32"),
        ({"parallel_mode": "row", "tp_size": 3}, ValueError, "must divide in_features=16"),
        ({"tp_size": 0}, ValueError, "tp_size must be a positive int"),
        ({"tp_group": object()}, RuntimeError, "torch.distributed is not initialized"),
    ],
)
def test_bad_tensor_parallel_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        te.Linear(16, 32, **kwargs)


def test_rng_tracker_draws_the_initial_weights():
    tracker = te.distributed.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 77)
    layers = [
        te.Linear(16, 32, get_rng_state_tracker=lambda: tracker, parallel_mode="column", tp_size=2)
        for _ in range(2)
    ]
    assert not torch.equal(layers[0].weight, layers[1].weight)  # the tracker's state advanced
    again = te.distributed.CudaRNGStatesTracker()
    again.add("model-parallel-rng", 77)
    first = te.Linear(
        16, 32, get_rng_state_tracker=lambda: again, parallel_mode="column", tp_size=2
    )
    assert torch.equal(first.weight, layers[0].weight)


def test_symmetric_memory_switch():
    assert te_dist.symmetric_memory_enabled() is False  # off unless TORCHTE_SYMMETRIC_MEMORY=1
    assert te_dist.use_symmetric_memory(True) is False
    try:
        assert te_dist.symmetric_memory_enabled() is True
        with pytest.raises(TypeError, match="enabled must be a bool"):
            te_dist.use_symmetric_memory("yes")
        assert te_dist.symmetric_memory_enabled() is True  # a refused call changes nothing
    finally:
        assert te_dist.use_symmetric_memory(False) is True
