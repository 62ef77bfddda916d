"""torchte modules under FSDP2 (torch.distributed.fsdp.fully_shard) on gloo ranks of the CPU.

Every rank trains on the same batch, so FSDP2's gradient average is of equal values and the
sharded model must equal one process training the whole model bit for bit: any difference is
torchte's (a stale or half-gathered FP8 weight, scales that differ between ranks, lost
state). Runs 2 ranks (4 for the checkpoint saved at one world size and loaded at another).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import each_config, on_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import torchte as te
from torchte import recipe
from torchte.distributed import fsdp as te_fsdp
from torchte.kernels._fp8_codec import cast_reference
from torchte.quantization.float8_tensor import Float8Tensor

WORLD = 2
FP8_E4M3 = torch.float8_e4m3fn
H, F, T = 32, 64, 16
SPLITS = [6, 0, 10]
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
}


class _Grouped(torch.nn.Module):
    """Two te.GroupedLinear over fixed splits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = te.GroupedLinear(len(SPLITS), H, F)
        self.fc2 = te.GroupedLinear(len(SPLITS), F, H)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x, SPLITS)), SPLITS)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "Linear":
        return torch.nn.Sequential(te.Linear(H, F), te.Linear(F, H))
    if kind == "LayerNorm":
        return torch.nn.Sequential(
            te.LayerNorm(H),
            te.LayerNormLinear(H, F, normalization="RMSNorm"),
            te.LayerNormMLP(F, H),
            te.RMSNorm(F),
        )
    if kind == "Grouped":
        return _Grouped()
    ops = te.ops.Sequential(te.ops.BasicLinear(H, F), te.ops.GELU(), te.ops.BasicLinear(F, H))
    return torch.nn.Sequential(ops)


def _shard(model, reshard=True, mp_policy=None):
    kw = {"reshard_after_forward": reshard}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for child in model.children():
        fully_shard(child, **kw)
    fully_shard(model, **kw)
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(-2, 3, (T, H), generator=gen).float() / 4


def _train(model, precision, steps=3, one_region=False, optimizer=None):
    """Losses of `steps` steps on one batch (SGD unless an optimizer is given); one_region: one
    te.autocast around them all (the weights change inside it)."""
    x, losses = _batch(), []
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)  # as on GPUs
    make = RECIPES.get(precision)

    def region():
        return te.autocast(enabled=make is not None, recipe=make() if make else None)

    with region() if one_region else contextlib.nullcontext():
        for _ in range(steps):
            inner = contextlib.nullcontext() if one_region else region()
            autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else None
            with inner, autocast or contextlib.nullcontext():
                loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def _full(model) -> dict:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _same_on_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(gathered[0], g) for g in gathered)


def _check_one_rank(kind, precision, reshard, rank) -> None:
    """FSDP2 over the ranks == one process, losses and parameters bit for bit; delayed
    scaling's state identical on every rank and equal to the one process's."""
    ref = _model(kind)
    policy = None
    if precision == "bf16":  # gathered in bf16, gradients reduced in fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = _shard(_model(kind), reshard, policy)
    want = _train(ref, precision)
    got = _train(sharded, "fp32" if precision == "bf16" else precision)
    assert got == want, (got, want)
    full = _full(sharded)
    for name, value in _full(ref).items():
        assert torch.equal(full[name], value), name
    if precision == "delayed":
        for a, b in zip(ref.modules(), sharded.modules(), strict=True):
            for pa, pb in zip(
                getattr(a, "_delayed_states", {}).get(4, ()),
                getattr(b, "_delayed_states", {}).get(4, ()),
                strict=True,
            ):
                assert torch.equal(pa.amax_history, pb.amax_history)
                assert _same_on_ranks(pb.scale)


ONE_RANK_CONFIGS = [
    *[(kind, p, True) for kind in ("Linear", "LayerNorm", "Grouped", "ops") for p in RECIPES],
    ("Linear", "fp32", True),
    ("Linear", "bf16", True),
    ("Linear", "current", False),
    ("LayerNorm", "delayed", False),
]


def _check_one_region(rank) -> None:
    """One te.autocast around several steps: each forward casts the weights FSDP2 just
    gathered (their _version does not move), never a copy cached at an earlier step."""
    want = _train(_model("Linear"), "current", one_region=True)
    assert _train(_shard(_model("Linear")), "current", one_region=True) == want


# FSDP2's all-gather: all_gather_single in newer torch, all_gather_into_tensor before.
ALL_GATHERS = tuple(n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n))


@contextlib.contextmanager
def _recorded(*names: str):
    """[(dtype, numel) of the input tensor] of each torch.distributed.<name> call inside (the
    all-gathers' second argument, all_reduce's first)."""
    originals, seen = {name: getattr(dist, name) for name in names}, []

    def recorder(name):
        def run(*args, **kwargs):
            if name == "all_reduce":
                tensor = args[0] if args else kwargs["tensor"]
            else:
                tensor = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
            seen.append((tensor.dtype, tensor.numel()))
            return originals[name](*args, **kwargs)

        return run

    for name in names:
        setattr(dist, name, recorder(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _check_fp8_all_gather(rank) -> None:
    """te.fsdp.enable_fp8_all_gather: the weights move as one byte per value (biases as they
    are); under current scaling the training equals the high-precision gather's bit for bit
    (the GEMM casts the same whole-weight amax); precompute_fp8_scales leaves the all-gathers
    without all-reduces; the gathered weight is a Float8Tensor with one scale on all ranks."""
    plain = _shard(_model("Linear"))
    fp8 = _shard(te_fsdp.enable_fp8_all_gather(_model("Linear")))
    with _recorded(*ALL_GATHERS) as plain_moves:
        want = _train(plain, "current", steps=1)
    with _recorded(*ALL_GATHERS) as fp8_moves, _recorded("all_reduce") as own:
        got = _train(fp8, "current", steps=1)
    assert got == want, (got, want)
    weights, biases = 2 * H * F, H + F
    plain_bytes = sum(n * dtype.itemsize for dtype, n in plain_moves)
    fp8_bytes = sum(n * dtype.itemsize for dtype, n in fp8_moves)
    # Forward and backward each gather every parameter's shard once.
    assert plain_bytes == 2 * (weights + biases) * 4 // WORLD, (plain_moves, fp8_moves)
    assert fp8_bytes == 2 * (weights + biases * 4) // WORLD, (plain_moves, fp8_moves)
    assert _train(fp8, "current", steps=2) == _train(plain, "current", steps=2)
    seen, gathered = [], []
    fp8[0].register_forward_pre_hook(lambda module, args: seen.append(module.weight))
    fp8[0].register_forward_pre_hook(
        lambda module, args: gathered.append(module.weight._storage.rowwise_data.clone())
    )
    with _recorded("all_reduce") as reduces:
        te_fsdp.precompute_fp8_scales(fp8)
        agreed = fp8[0].weight.to_local()._scale
        expected = cast_reference(fp8[0].weight.to_local()._data, agreed.scale, FP8_E4M3)
        _train(fp8, "current", steps=1)
    # The all-gathers sent the bytes precompute_fp8_scales cast, all weights at once.
    assert torch.equal(agreed.data.view(torch.uint8), expected.view(torch.uint8))
    rows = expected.shape[0]
    mine = gathered[0][rank * rows : (rank + 1) * rows]
    assert torch.equal(mine.view(torch.uint8), expected.view(torch.uint8))
    # Without it each weight's gather (forward and backward) all-reduces its own amax; with
    # it, one all-reduce for both weights and none in the gathers.
    assert own.count((torch.float32, 1)) == 4, own
    assert reduces[0] == (torch.float32, 2) and (torch.float32, 1) not in reduces[1:], reduces
    scale_inv = seen[0]._storage.scale_inv
    assert isinstance(seen[0], Float8Tensor) and _same_on_ranks(scale_inv)
    assert scale_inv.data_ptr() % 16 == 0  # cuBLAS's FP8 GEMM refuses unaligned scales


def _check_fp8_all_gather_modules(kind, rank) -> None:
    """enable_fp8_all_gather on the other GEMM modules (te.GroupedLinear requantizes the
    gathered weight: the same bytes under current scaling): the high-precision gather's
    training under current scaling, bit for bit."""
    want = _train(_shard(_model(kind)), "current")
    assert _train(_shard(te_fsdp.enable_fp8_all_gather(_model(kind))), "current") == want


def _check_meta_init(rank) -> None:
    """Built on the meta device, sharded, then to_empty + reset_parameters: every rank holds
    its shard of rank 0's initialization (seeds differ per rank here)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(te.Linear(H, F), te.LayerNormMLP(F, H))
    _shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(100 + rank)
    for module in model:
        module.reset_parameters()
    for name, value in _full(model).items():
        assert _same_on_ranks(value), name
    assert _train(model, "current", steps=1)[0] > 0


def _check_bad_input(rank) -> None:
    model = _shard(_model("Linear"))
    with pytest.raises(ValueError, match="already sharded"):
        te_fsdp.enable_fp8_all_gather(model)
    fused = torch.nn.Sequential(te.Linear(H, F, fuse_wgrad_accumulation=True))
    for p in fused.parameters():
        p.main_grad = torch.zeros_like(p)
    _shard(fused)
    with pytest.raises(NotImplementedError, match="fuse_wgrad_accumulation under FSDP2"):
        fused(_batch())
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        quantized = torch.nn.Sequential(te.Linear(H, F))
    with pytest.raises(ValueError, match="an FP8 parameter"):
        te_fsdp.enable_fp8_all_gather(quantized)


def _quantized_model(precision):
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPES[precision]()):
        return torch.nn.Sequential(te.Linear(H, F), te.LayerNormMLP(F, H))


def _check_quantized_model_init(precision, rank) -> None:
    """FP8 parameters (te.quantized_model_init) shard as FP8 bytes (each rank holding a
    Float8Tensor of its rows), gather as FP8 bytes, and train as one process does."""
    ref, sharded = _quantized_model(precision), _shard(_quantized_model(precision))
    local = sharded[0].weight.to_local()
    assert isinstance(local, Float8Tensor) and local.shape == (F // WORLD, H), local
    assert local._storage.rowwise_data.dtype == torch.float8_e4m3fn
    want = _train(ref, precision)
    with _recorded(*ALL_GATHERS) as moves:
        got = _train(sharded, precision, steps=1)
    assert got == want[:1], (got, want)
    assert got + _train(sharded, precision, steps=2) == want
    fp8_weights = 3 * H * F  # the Linear's and the MLP's two GEMM weights: a byte per value
    others = F + (F + F) + (H + F)  # fp32: the biases, the norm's gain and bias
    moved = sum(n * dtype.itemsize for dtype, n in moves)
    assert moved == 2 * (fp8_weights + 4 * others) // WORLD, moves
    for name, value in _full(sharded).items():
        assert _same_on_ranks(value), name


def _check_cache_built_before_wrapping(rank) -> None:
    """An FP8 forward before fully_shard caches FP8 weights of the unsharded parameters; the
    sharded model never reuses them: it trains as one process that ran the same forward."""
    ref, sharded = _model("Linear"), _model("Linear")
    for model in (ref, sharded):
        with te.autocast(recipe=RECIPES["current"]()):
            model(_batch())
    assert _train(_shard(sharded), "current") == _train(ref, "current")


def _check_amax_histories_agree(rank) -> None:
    """Each rank on its own batch: delayed scaling reduces the amaxes over the ranks, so the
    histories and scales stay the same on every rank under FSDP2."""
    model = _shard(_model("LayerNorm"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        with te.autocast(recipe=RECIPES["delayed"](), amax_reduction_group=dist.group.WORLD):
            model(torch.randn(T, H, generator=gen) * (rank + 1)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    states = [s for m in model.modules() for s in getattr(m, "_delayed_states", {}).get(4, ())]
    assert states
    for state in states:
        assert _same_on_ranks(state.amax_history) and _same_on_ranks(state.scale)


def _check_state_dict_round_trip(rank) -> None:
    """A one-process model's state_dict loads into the sharded model (full_state_dict) and the
    sharded model's full state_dict loads back into a one-process model: the same values, FP8
    scaling state included."""
    options = StateDictOptions(full_state_dict=True)
    ref = _model("Linear")
    _train(ref, "delayed", steps=2)
    sharded = _shard(_model("Linear"))
    set_model_state_dict(sharded, ref.state_dict(), options=options)
    assert _train(sharded, "delayed", steps=2) == _train(ref, "delayed", steps=2)
    back = _model("Linear")
    back.load_state_dict(get_model_state_dict(sharded, options=options))
    for name, value in _full(sharded).items():
        assert torch.equal(back.get_parameter(name), value), name
    assert _train(back, "delayed", steps=1) == _train(ref, "delayed", steps=1)


def _rank_main(rank: int) -> dict:
    warnings.simplefilter("error", RuntimeWarning)  # torchte's setattr guard, as in the suite
    outcome = each_config(_check_one_rank, ONE_RANK_CONFIGS, rank, named=True)
    checks = (
        _check_one_region,
        _check_fp8_all_gather,
        _check_meta_init,
        _check_bad_input,
        _check_cache_built_before_wrapping,
        _check_amax_histories_agree,
        _check_state_dict_round_trip,
    )
    for check in checks:
        outcome.update(each_config(check, [()], rank, named=True))
    outcome.update(
        each_config(_check_quantized_model_init, [(p,) for p in RECIPES], rank, named=True)
    )
    outcome.update(
        each_config(_check_fp8_all_gather_modules, [("LayerNorm",), ("Grouped",)], rank, named=True)
    )
    return outcome


def test_fsdp2_equals_one_process(tmp_path):
    for outcome in on_ranks(_rank_main, WORLD, tmp_path):
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed


# -- torch.distributed.checkpoint: saved at 4 ranks, loaded at 2 -----------------------------


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _steps(model, optimizer, steps: int) -> list[float]:
    return _train(model, "delayed", steps, optimizer=optimizer)


def _checkpointed_model(kind: str):
    """A sharded model: high-precision te.Linear layers, or FP8 parameters (quantized)."""
    if kind == "quantized":
        torch.manual_seed(0)
        with te.quantized_model_init(recipe=RECIPES["delayed"]()):
            return _shard(torch.nn.Sequential(te.Linear(H, F), te.Linear(F, H)))
    return _shard(_model("Linear"))


def _save_after_two(rank: int, path: str, kind: str) -> list[float]:
    model = _checkpointed_model(kind)
    optimizer = _adam(model)
    losses = _steps(model, optimizer, 2)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return losses


def _resume_or_run(rank: int, path: str | None, kind: str) -> list[float]:
    model = _checkpointed_model(kind)
    optimizer = _adam(model)
    if path is None:
        return _steps(model, optimizer, 4)[2:]
    _steps(model, optimizer, 1)  # scaling state and moments that the load must replace
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    assert (kind == "quantized") == isinstance(model[0].weight.to_local(), Float8Tensor)
    return _steps(model, optimizer, 2)


@pytest.mark.parametrize("kind", ["Linear", "quantized"])
def test_checkpoint_saved_at_four_ranks_resumes_at_two(tmp_path, kind):
    """Saved through torch.distributed.checkpoint over 4 ranks, loaded over 2 (FP8 scaling state
    and, for te.quantized_model_init, the FP8 parameters' bytes resharded): the training goes
    on as a 2-rank run that was never interrupted."""
    path = str(tmp_path / "checkpoint")
    on_ranks(_save_after_two, 4, tmp_path / "save", path, kind)
    resumed = on_ranks(_resume_or_run, WORLD, tmp_path / "load", path, kind)
    uninterrupted = on_ranks(_resume_or_run, WORLD, tmp_path / "run", None, kind)
    assert resumed == uninterrupted


def _uneven(rank: int) -> dict:
    """64 rows over 3 ranks (22, 22, 20: FSDP2 pads the last shard): the FP8 all-gather and FP8
    parameters pad and unpad their bytes, and train as one process."""
    outcome = {}
    for name in ("fp8 all-gather", "quantized"):
        try:
            if name == "quantized":
                ref, sharded = _quantized_model("current"), _shard(_quantized_model("current"))
            else:
                ref = _model("Linear")
                sharded = _shard(te_fsdp.enable_fp8_all_gather(_model("Linear")))
            assert sharded[0].weight.to_local().shape[0] == (20 if rank == 2 else 22)
            assert _train(sharded, "current") == _train(ref, "current")
            outcome[name] = "ok"
        except Exception as err:
            outcome[name] = f"{type(err).__name__}: {str(err)[:600]}"
    return outcome


def test_uneven_shards_over_three_ranks(tmp_path):
    for outcome in on_ranks(_uneven, 3, tmp_path):
        assert all(text == "ok" for text in outcome.values()), outcome
