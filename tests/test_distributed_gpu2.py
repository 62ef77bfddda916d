"""The distributed features at world size 2, each test run twice: on 2 gloo ranks of the CPU
("gloo-cpu", which proves the test logic anywhere) and on 2 NCCL ranks, one GPU each
("nccl-cuda", gpu-marked; skipped unless 2 GPUs are present).

Tensor and sequence parallelism (te.Linear column/row, te.LayerNormLinear column,
te.LayerNormMLP set_parallel_mode, te.TransformerLayer, te.GroupedLinear column/row) against the
one-rank module built from the same whole weights, in bf16 and FP8 delayed / current scaling,
with the structure of tests/test_tensor_parallel.py (whose helpers these reuse): ternary values
(-1, 0, 1) exact in bf16, the FP8 runs in fp32 parameters within fp32's tolerance, the FP8
sequence-parallel gathers moving one byte per value. FSDP2 (fully_shard on te modules, FP8
all-gather on and off) against one process, and a torch.distributed.checkpoint saved at 2 ranks,
loaded at 1, saved there and loaded at 2 again, against the uninterrupted run.

Legend: S sequence, B batch, K in features, N out features (hidden states (S, B, K)).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import on_ranks
from test_fsdp import ALL_GATHERS, _recorded
from test_tensor_parallel import _gathers, _run, _shards
from test_transformer_layer_features import H as TL_HIDDEN
from test_transformer_layer_features import _shard as _tl_shard
from test_transformer_layer_features import _tp_run
from test_transformer_layer_features import make as make_layer
from tolerances import assert_close, representable, tolerance
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import torchte as te
import torchte.fsdp as te_fsdp
from torchte import recipe

WORLD = 2
S, B, K, N = 8, 2, 32, 64
PRECISIONS = ("bf16", "delayed", "current")
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
BACKENDS = [pytest.param("gloo-cpu"), pytest.param("nccl-cuda", marks=pytest.mark.gpu)]


def _on_ranks(fn, world: int, tmp_path, backend: str, *args) -> list:
    """on_ranks over `backend` ("gloo-cpu" or "nccl-cuda"); skips without 2 GPUs for NCCL."""
    if backend == "nccl-cuda" and torch.cuda.device_count() < WORLD:
        count = torch.cuda.device_count()
        pytest.skip(f"needs {WORLD} CUDA GPUs (torch.cuda.device_count() is {count})")
    return on_ranks(fn, world, tmp_path, *args, backend=backend.split("-")[0])


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _each(checks, device) -> dict:
    """{(check name, *config): "ok" or the error} of each check(*config), built on device."""
    outcome = {}
    for check, config in checks:
        key = (check.__name__, *config)
        try:
            with torch.device(device):
                check(*config)
            outcome[key] = "ok"
        except Exception as err:  # reported per config, in the main process
            outcome[key] = f"{type(err).__name__}: {str(err)[:600]}"
    return outcome


def _assert_ok(outcomes: list) -> None:
    for outcome in outcomes:
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed


def _values(precision: str, seed: int):
    """(dtype, ternary(*shape)): the parameter dtype of a precision (fp32 under FP8), and a
    maker of seeded tensors of -1, 0 and 1 in it on this rank's device (drawn on the CPU)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen, device = torch.Generator().manual_seed(seed), _device()

    def ternary(*shape):
        return torch.randint(-1, 2, shape, generator=gen, device="cpu").to(device, dtype)

    return dtype, ternary


def _assert_norm_close(got, want, dtype, label, scale=None) -> None:
    """||got - want|| <= rtol (||want|| or `scale`, the larger) + atol sqrt(n) with dtype's
    (rtol, atol): for sums of inexact values that the split modules add in another order than
    one GEMM does. scale: the size of the terms where the exact result is zero (their rounding
    is the error)."""
    rtol, atol = tolerance(dtype)
    error = (got.double() - want.double()).norm()
    size = want.double().norm() if scale is None else max(want.double().norm(), scale)
    bound = rtol * size + atol * want.numel() ** 0.5
    assert error <= bound, f"{label}: error {error:.3g} > {bound:.3g}"


def _first_gather_is(gathered, precision, dtype, numel, label) -> None:
    """The forward's first gather: FP8 bytes (uint8) under FP8, else the dtype's values."""
    want = (torch.uint8 if precision in RECIPES else dtype, numel)
    assert gathered and gathered[0] == want, f"{label}: gathered {gathered}"


# ---- tensor and sequence parallelism --------------------------------------------------------


def _check_linear(mode: str, sp: bool, precision: str) -> None:
    """te.Linear column or row (+SP) == the matching slices of the one-rank layer's results."""
    rank, fp8 = dist.get_rank(), precision in RECIPES
    dtype, ternary = _values(precision, 0)
    x, dy = ternary(S, B, K), ternary(S, B, N)
    ref = te.Linear(K, N, params_dtype=dtype)
    layer = te.Linear(
        K, N, params_dtype=dtype, parallel_mode=mode, sequence_parallel=sp,
        tp_group=dist.group.WORLD, tp_size=WORLD,
    )  # fmt: skip
    inp, out, w, b = _shards(mode, sp, rank)
    with torch.no_grad():
        ref.weight.copy_(ternary(N, K))
        ref.bias.copy_(ternary(N))
        layer.weight.copy_(ref.weight[w])
        layer.bias.copy_(ref.bias[b])
    want = _run(ref, x, dy, "fp32" if fp8 else precision)
    with _gathers() as gathered:
        got = _run(layer, x[inp], dy[out], precision)
    label = f"Linear {mode} sp={sp} {precision}"
    if mode == "column" and sp:
        _first_gather_is(gathered, precision, dtype, S // WORLD * B * K, label)
    bias_grad = got[3].clone()
    if mode == "row" and sp:  # a partial sum per rank: Megatron all-reduces it
        dist.all_reduce(bias_grad)
    pairs = {"y": (got[0], want[0][out]), "dx": (got[1], want[1][inp])}
    pairs.update({"dW": (got[2], want[2][w]), "db": (bias_grad, want[3][b])})
    for name, (a, e) in pairs.items():
        if fp8:
            assert_close(a, e.double(), torch.float32, msg=f"{label}: {name}")
        else:
            assert a.dtype == e.dtype and torch.equal(a, e), f"{label}: {name}"


def _check_norm_linear(sp: bool, precision: str) -> None:
    """te.LayerNormLinear column (+SP): results within the dtype's tolerance (fp32's under
    FP8), the norm's gradients partial sums of this rank's rows under SP."""
    rank = dist.get_rank()
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
    label = f"LayerNormLinear sp={sp} {precision}"
    if sp:
        _first_gather_is(gathered, precision, dtype, S // WORLD * B * K, label)
        _run(shard_ref, x[inp], dy[inp], precision)
        ref = shard_ref
    tol = torch.bfloat16 if precision == "bf16" else torch.float32
    pairs = {"y": (got[0], want[0][out]), "dx": (got[1], want[1][inp])}
    pairs.update({"dW": (got[2], want[2][w]), "db": (got[3], want[3][b])})
    pairs["d ln weight"] = (layer.layer_norm_weight.grad, ref.layer_norm_weight.grad)
    pairs["d ln bias"] = (layer.layer_norm_bias.grad, ref.layer_norm_bias.grad)
    for name, (a, e) in pairs.items():
        assert_close(a, e.double(), tol, msg=f"{label}: {name}")


def _check_mlp(sp: bool, precision: str) -> None:
    """te.LayerNormMLP set_parallel_mode (fc1 column, fc2 row; SwiGLU's fc1 rows split per
    half) == the one-rank module's matching slices, norm-wise within the dtype's tolerance
    (e4m3's under FP8: each rank scales its shard of the activation by its own amax)."""
    rank, ffn = dist.get_rank(), 32
    dtype, ternary = _values(precision, 2)
    x, dy = ternary(S, B, K), ternary(S, B, K)
    kw = {"params_dtype": dtype, "activation": "swiglu"}
    ref = te.LayerNormMLP(K, ffn, **kw)
    layer = te.LayerNormMLP(
        K, ffn, set_parallel_mode=True, sequence_parallel=sp, tp_group=dist.group.WORLD,
        tp_size=WORLD, **kw,
    )  # fmt: skip
    rows = torch.arange(rank * ffn // WORLD, (rank + 1) * ffn // WORLD, device=_device())
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
    label = f"LayerNormMLP sp={sp} {precision}"
    if sp:
        _first_gather_is(gathered, precision, dtype, S // WORLD * B * K, label)
        _run(shard_ref, x[seq], dy[seq], precision)
    tol = torch.bfloat16 if precision == "bf16" else torch.float8_e4m3fn
    _assert_norm_close(got[0], want[0][seq], tol, f"{label}: y")
    _assert_norm_close(got[1], want[1][seq], tol, f"{label}: dx")
    partial = ("layer_norm_weight", "layer_norm_bias", "fc2_bias")
    for name, param in layer.named_parameters():
        expected = getattr(shard_ref if sp and name in partial else ref, name).grad
        if name in ("fc1_weight", "fc1_bias"):
            expected = expected[fc1_rows]
        elif name == "fc2_weight":
            expected = expected[:, rows]
        _assert_norm_close(param.grad, expected, tol, f"{label}: d {name}")


def _check_transformer_layer(sp: bool, precision: str) -> None:
    """te.TransformerLayer with set_parallel_mode (+SP) == the one-rank layer built from the
    same whole weights (tests/test_transformer_layer_features.py's check), two steps, the
    second recomputing attention; norm-wise within bf16's tolerance in bf16 (fp32 parameters
    and fp32's tolerance under FP8)."""
    rank, fp8 = dist.get_rank(), precision in RECIPES
    dtype = torch.float32 if fp8 else torch.bfloat16
    ref = make_layer("layer", dtype, seed=3)
    tp = {"set_parallel_mode": True, "tp_group": dist.group.WORLD, "sequence_parallel": sp}
    module = make_layer("layer", dtype, seed=4, **tp)
    with torch.no_grad():
        whole = dict(ref.named_parameters())
        for name, param in module.named_parameters():
            param.copy_(_tl_shard(whole[name], param.shape, rank)[1])
    gen = torch.Generator().manual_seed(5)
    x, dy = (
        representable((S, B, TL_HIDDEN), torch.bfloat16, generator=gen).to(_device(), dtype)
        for _ in range(2)
    )
    want = _tp_run(ref, (x, None), dy, precision, 2)
    seq = slice(rank * S // WORLD, (rank + 1) * S // WORLD) if sp else slice(None)
    got = _tp_run(module, (x[seq], None), dy[seq], precision, 2)
    tol, label = (torch.float32 if fp8 else torch.bfloat16), f"TransformerLayer sp={sp} {precision}"
    _assert_norm_close(got[0], want[0][seq], tol, f"{label}: y")
    _assert_norm_close(got[1], want[1][seq], tol, f"{label}: dx")
    for name, param in module.named_parameters():
        grad = param.grad
        if getattr(param, "sequence_parallel", False):  # partial sums (Megatron all-reduces)
            grad = grad.clone()
            dist.all_reduce(grad)
        expected = _tl_shard(whole[name].grad, param.shape, rank)[1]
        # The key bias's gradient is zero but for rounding (softmax does not change when every
        # score of a query moves alike): measured against the query bias's.
        scale = (
            whole[name.replace("key", "query")].grad.double().norm() if "key_bias" in name else None
        )
        _assert_norm_close(grad, expected, tol, f"{label}: d {name}", scale)


def _check_grouped(mode: str, precision: str) -> None:
    """te.GroupedLinear column or row per expert (one expert without tokens): as te.Linear."""
    rank, fp8 = dist.get_rank(), precision in RECIPES
    dtype, ternary = _values(precision, 3)
    splits = [6, 0, 10]
    x, dy = ternary(sum(splits), K), ternary(sum(splits), N)
    ref = te.GroupedLinear(len(splits), K, N, params_dtype=dtype)
    layer = te.GroupedLinear(
        len(splits), K, N, params_dtype=dtype, parallel_mode=mode, tp_group=dist.group.WORLD
    )
    every, size = slice(None), (N if mode == "column" else K) // WORLD
    part = slice(rank * size, (rank + 1) * size)
    if mode == "column":  # (x columns, y columns, weight slice, bias slice)
        x_cols, y_cols, w, b = every, part, (part,), part
    else:
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
        with te.autocast(enabled=fp8, recipe=RECIPES[precision]() if fp8 else None):
            y = module(xi, splits)
        y.backward(dyi)
        results.append(
            {"y": y.detach(), "dx": xi.grad, **{n: p.grad for n, p in module.named_parameters()}}
        )
    want, got = results
    want["y"], want["dx"] = want["y"][:, y_cols], want["dx"][:, x_cols]
    label = f"GroupedLinear {mode} {precision}"
    for name, a in got.items():
        e = want[name] if name in ("y", "dx") else want[name][w if name[0] == "w" else b]
        if fp8:
            assert_close(a, e.double(), torch.float32, msg=f"{label}: {name}")
        else:
            assert torch.equal(a, e), f"{label}: {name}"


TP_CHECKS = (
    [
        (_check_linear, (m, sp, p))
        for m in ("column", "row")
        for sp in (False, True)
        for p in PRECISIONS
    ]
    + [(_check_norm_linear, (sp, p)) for sp in (False, True) for p in PRECISIONS]
    + [(_check_mlp, (sp, p)) for sp in (False, True) for p in PRECISIONS]
    + [(_check_transformer_layer, (sp, p)) for sp in (False, True) for p in PRECISIONS]
    + [(_check_grouped, (m, p)) for m in ("column", "row") for p in PRECISIONS]
)


def _tp_main(rank: int) -> dict:
    torch.set_num_threads(1)  # one core per CPU rank: no oversubscription
    return _each(TP_CHECKS, _device())


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_at_two_ranks_equals_one_rank(tmp_path, backend):
    _assert_ok(_on_ranks(_tp_main, WORLD, tmp_path, backend))


# ---- FSDP2 and distributed checkpoints ------------------------------------------------------

H, F, T = 32, 64, 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(te.LayerNormLinear(H, F), te.Linear(F, H), te.LayerNormMLP(H, F))


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    for child in model.children():
        fully_shard(child)
    return fully_shard(model)


def _train(model, precision: str, steps: int, optimizer=None) -> list[float]:
    """Losses of `steps` steps on one batch (the same on every rank), SGD unless given."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randint(-2, 3, (T, H), generator=gen, device="cpu").float() / 4).to(_device())
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)
    fp8, losses = precision in RECIPES, []
    for _ in range(steps):
        with te.autocast(enabled=fp8, recipe=RECIPES[precision]() if fp8 else None):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same_training(got: list[float], want: list[float], label: str) -> None:
    assert_close(torch.tensor(got), torch.tensor(want), torch.float32, msg=label)


def _check_fsdp(precision: str) -> None:
    """fully_shard on te modules over 2 ranks == one process: losses and whole parameters."""
    ref, sharded = _model(), _shard(_model())
    _assert_same_training(_train(sharded, precision, 3), _train(ref, precision, 3), precision)
    for name, p in sharded.named_parameters():
        whole = p.full_tensor().detach()
        assert_close(whole, ref.get_parameter(name).detach(), torch.float32, msg=name)


def _check_fp8_all_gather(precision: str) -> None:
    """te.fsdp.enable_fp8_all_gather: the GEMM weights move one byte per value (half of bf16's
    two, a quarter of fp32's four), the rest as they are, and the training equals the
    high-precision gather's (current scaling: the same whole-weight amax)."""
    plain = _shard(_model())
    fp8 = _shard(te_fsdp.enable_fp8_all_gather(_model()))
    with _recorded(*ALL_GATHERS) as plain_moves:
        want = _train(plain, precision, 1)
    with _recorded(*ALL_GATHERS) as fp8_moves:
        got = _train(fp8, precision, 1)
    if precision == "current":
        _assert_same_training(got, want, "fp8 all-gather")
    weights = sum(
        p.numel() for n, p in _model().named_parameters() if n.endswith("weight") and p.dim() == 2
    )
    others = sum(p.numel() for p in _model().parameters()) - weights
    plain_bytes = sum(n * dtype.itemsize for dtype, n in plain_moves)
    fp8_bytes = sum(n * dtype.itemsize for dtype, n in fp8_moves)
    # Forward and backward each gather every parameter's shard once.
    assert plain_bytes == 2 * (weights + others) * 4 // WORLD, plain_moves
    assert fp8_bytes == 2 * (weights + others * 4) // WORLD, fp8_moves


FSDP_CHECKS = [(_check_fsdp, (p,)) for p in PRECISIONS] + [
    (_check_fp8_all_gather, (p,)) for p in RECIPES
]


def _fsdp_main(rank: int) -> dict:
    torch.set_num_threads(1)
    return _each(FSDP_CHECKS, _device())


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_at_two_ranks_equals_one_process(tmp_path, backend):
    _assert_ok(_on_ranks(_fsdp_main, WORLD, tmp_path, backend))


def _checkpoint_run(rank: int, load: str | None, save: str | None, steps: int) -> list[float]:
    """Sharded model + Adam over this world (FP8 delayed scaling): load `load` if given, train
    `steps` steps, save to `save` if given; the losses."""
    with torch.device(_device()):
        model = _shard(_model())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        if load is not None:
            _train(model, "delayed", 1, optimizer)  # state the load must replace
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=load)
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        losses = _train(model, "delayed", steps, optimizer)
        if save is not None:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=save)
    return losses


def _save_and_whole(rank: int, path: str) -> tuple[list[float], list[float]]:
    """(losses of 2 steps saved to path, losses of 6 steps never interrupted)."""
    return _checkpoint_run(rank, None, path, 2), _checkpoint_run(rank, None, None, 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_saved_at_two_loads_at_one_and_back(tmp_path, backend):
    """DCP saved over 2 ranks after 2 steps, loaded over 1 for 2 steps and saved, loaded over
    2 for 2 more: the losses of the 6-step run that was never interrupted."""
    first, second = str(tmp_path / "at2"), str(tmp_path / "at1")
    runs = _on_ranks(_save_and_whole, WORLD, tmp_path / "save", backend, first)
    (saved, whole), other = runs[0], runs[1]
    assert other == runs[0]
    one = _on_ranks(_checkpoint_run, 1, tmp_path / "one", backend, first, second, 2)
    back = _on_ranks(_checkpoint_run, WORLD, tmp_path / "back", backend, second, None, 2)
    assert back[0] == back[1]
    _assert_same_training(saved + one[0] + back[0], whole, "2 -> 1 -> 2")
