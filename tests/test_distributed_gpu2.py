"""The distributed features at world size 2, each test run twice: on 2 gloo ranks of the CPU
("gloo-cpu", which proves the test logic anywhere) and on 2 NCCL ranks, one GPU each
("nccl-cuda", gpu-marked; skipped unless 2 GPUs are present).

Tensor and sequence parallelism (te.Linear column/row, te.LayerNormLinear column,
te.LayerNormMLP set_parallel_mode, te.TransformerLayer, te.GroupedLinear column/row) against the
one-rank module built from the same whole weights, in bf16 and FP8 delayed / current scaling,
by tests/test_tensor_parallel.py's own checks (its tensors follow the default device, here the
rank's GPU; te.TransformerLayer's from tests/test_transformer_layer_features.py): ternary
values (-1, 0, 1) exact in bf16, the FP8 runs in fp32 parameters within fp32's tolerance, the
FP8 sequence-parallel gathers moving one byte per value. FSDP2 (fully_shard on te modules, FP8
all-gather on and off) against one process, and a torch.distributed.checkpoint saved at 2 ranks,
loaded at 1, saved there and loaded at 2 again, against the uninterrupted run.

Legend: S sequence, B batch, K in features, N out features (hidden states (S, B, K)).
"""

from __future__ import annotations

import pytest
import test_tensor_parallel as tp_checks
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import on_ranks
from test_fsdp import ALL_GATHERS, _recorded
from test_transformer_layer_features import H as TL_HIDDEN
from test_transformer_layer_features import _shard as _tl_shard
from test_transformer_layer_features import _tp_run
from test_transformer_layer_features import make as make_layer
from tolerances import assert_close, representable, tolerance
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import torchte as te
from torchte import recipe
from torchte.distributed import fsdp as te_fsdp

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
        failed = [f"{config}: {text}" for config, text in outcome.items() if text != "ok"]
        assert not failed, "\n".join(failed)  # a string: pytest shows all of it


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


# ---- tensor and sequence parallelism --------------------------------------------------------


def _check_transformer_layer(sp: bool, precision: str) -> None:
    """te.TransformerLayer with set_parallel_mode (+SP) == the one-rank layer built from the
    same whole weights (tests/test_transformer_layer_features.py's check), two steps, the
    second recomputing attention; norm-wise within bf16's tolerance in bf16. Under FP8 (fp32
    parameters): fp32's tolerance where FP8 is emulated (gloo, the CPU); on GPUs the real FP8
    GEMMs add the split layer's partial sums in another order than one GEMM does, and a value
    that moves by one fp32 ulp can round to the neighbouring FP8 value in the next cast, so
    the output is held to e4m3's tolerance and the gradients (e5m2 under HYBRID) to e5m2's."""
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
    tol = tol_grad = torch.bfloat16
    if fp8:
        real_fp8 = dist.get_backend() == "nccl"
        tol = torch.float8_e4m3fn if real_fp8 else torch.float32
        tol_grad = torch.float8_e5m2 if real_fp8 else torch.float32
    label = f"TransformerLayer sp={sp} {precision}"
    _assert_norm_close(got[0], want[0][seq], tol, f"{label}: y")
    _assert_norm_close(got[1], want[1][seq], tol_grad, f"{label}: dx")
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
        _assert_norm_close(grad, expected, tol_grad, f"{label}: d {name}", scale)


def _on_this_rank(check):
    """tests/test_tensor_parallel.py's check(*config, rank) as check(*config) on this rank:
    the same checks, here over NCCL on this rank's GPU too (its tensors follow the default
    device)."""

    def run(*config):
        return check(*config, dist.get_rank())

    run.__name__ = check.__name__
    return run


_check_linear = _on_this_rank(tp_checks._check_config)
_check_norm_linear = _on_this_rank(tp_checks._check_norm_linear)
_check_mlp = _on_this_rank(tp_checks._check_mlp)
_check_grouped = _on_this_rank(tp_checks._check_grouped)

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
