"""Sequence-parallel GEMMs with their collectives under them (te.distributed.overlap_tp_comm)
against the plain path (the collective, then the GEMM), on gloo ranks of the CPU.

te.Linear (column and row), te.LayerNormLinear (column) and te.LayerNormMLP (fc1 column, fc2
row), all with sequence parallelism, in fp32, bf16 and FP8 delayed / current scaling: the
output, the input gradient and every parameter gradient equal bit for bit at 2 ranks (the same
GEMM per output row; one addition per reduced value either way). At 4 ranks the ring adds the
partial sums in another order than the collective: te.Linear's inputs and weights of -1, 0 and
1 make every sum exact, so they are equal there too (a norm's inexact output would not be).
Each run also checks that the overlapped path ran (its all-gather GEMMs and its ring
reduce-scatters are counted).

Legend: S sequence, B batch, K hidden, N output features.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from ranks import each_config, on_ranks

import torchte as te
from torchte import distributed as te_dist
from torchte import recipe
from torchte.distributed import overlap
from torchte.module import _tp_gemm

S, B, K, N = 8, 2, 32, 64
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
MODULES = ("linear column", "linear row", "layernorm_linear", "layernorm_mlp")
PRECISIONS = ("fp32", "bf16", "delayed", "current")


def _build(name: str, dtype: torch.dtype, world: int):
    tp = {"tp_group": dist.group.WORLD, "tp_size": world, "sequence_parallel": True}
    if name.startswith("linear"):
        mode = name.split()[1]
        return te.Linear(K, N, params_dtype=dtype, parallel_mode=mode, **tp)
    if name == "layernorm_linear":
        return te.LayerNormLinear(K, N, params_dtype=dtype, parallel_mode="column", **tp)
    return te.LayerNormMLP(K, N, params_dtype=dtype, set_parallel_mode=True, **tp)


def _ternary(gen, shape, dtype):
    values = torch.randint(-1, 2, shape, generator=gen, device="cpu")
    return values.to(torch.get_default_device(), dtype)


@contextlib.contextmanager
def _counted():
    """{"gathered": GEMMs under an all-gather, "scattered": ring reduce-scatters} inside."""
    counts = {"gathered": 0, "scattered": 0}
    gemm, scatter = overlap.RowsInFlight.gemm, _tp_gemm.gemm_reduce_scatter

    def counted_gemm(self, *args, **kwargs):
        counts["gathered"] += 1
        return gemm(self, *args, **kwargs)

    def counted_scatter(*args, **kwargs):
        counts["scattered"] += 1
        return scatter(*args, **kwargs)

    overlap.RowsInFlight.gemm, _tp_gemm.gemm_reduce_scatter = counted_gemm, counted_scatter
    try:
        yield counts
    finally:
        overlap.RowsInFlight.gemm, _tp_gemm.gemm_reduce_scatter = gemm, scatter


def _run(layer, x, dy, precision: str, overlapped: bool, steps: int = 2):
    previous = te_dist.overlap_tp_comm(overlapped, fp8=overlapped)
    try:
        for _ in range(steps):  # delayed scaling: the second step uses the reduced scales
            layer.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_(True)
            fp8 = precision in RECIPES
            with te.autocast(enabled=fp8, recipe=RECIPES[precision]() if fp8 else None):
                y = layer(xi)
            y.backward(dy)
    finally:
        te_dist.overlap_tp_comm(previous, fp8=False)
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return {"y": y.detach(), "dx": xi.grad, **grads}


def _check(name: str, precision: str, rank: int) -> None:
    world = dist.get_world_size()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(7)
    layer = _build(name, dtype, world)
    with torch.no_grad():
        for pname, param in layer.named_parameters():
            values = _ternary(gen, param.shape, dtype)
            param.copy_(values + 1 if pname == "layer_norm_weight" else values)
    plain = _build(name, dtype, world)
    plain.load_state_dict(layer.state_dict())
    rows, cols = S // world, N // world
    if name == "linear row":  # the whole sequence, this rank's input features
        x, dy = _ternary(gen, (S, B, K // world), dtype), _ternary(gen, (rows, B, N), dtype)
    else:  # this rank's sequence shard
        x = _ternary(gen, (rows, B, K), dtype)
        gathered_out = name in ("linear column", "layernorm_linear")  # (S, B, N / world)
        dy = _ternary(gen, (S, B, cols) if gathered_out else (rows, B, K), dtype)
    with _counted() as counts:
        got = _run(layer, x, dy, precision, True)
    want = _run(plain, x, dy, precision, False)
    expected = {"linear column": (2, 0), "linear row": (2, 2), "layernorm_linear": (2, 0)}
    gathered, scattered = expected.get(name, (4, 2))  # two steps; the MLP gathers twice a step
    assert counts == {"gathered": gathered, "scattered": scattered}, (name, counts)
    for key, value in want.items():
        assert got[key] is not None and torch.equal(got[key], value), f"{name} {precision}: {key}"


def _all_configs(rank: int, configs) -> dict:
    return each_config(_check, configs, rank)


def test_overlapped_equals_plain_two_ranks(tmp_path):
    configs = [(name, precision) for name in MODULES for precision in PRECISIONS]
    outcome = on_ranks(_all_configs, 2, tmp_path, configs)
    failed = {key: why for result in outcome for key, why in result.items() if why != "ok"}
    assert not failed, failed


def test_overlapped_equals_plain_four_ranks(tmp_path):
    configs = [("linear row", "bf16"), ("linear column", "current")]
    outcome = on_ranks(_all_configs, 4, tmp_path, configs)
    failed = {key: why for result in outcome for key, why in result.items() if why != "ok"}
    assert not failed, failed


def test_overlap_switch_refuses_a_non_bool():
    with pytest.raises(TypeError, match="must be bools"):
        te_dist.overlap_tp_comm(1)
    with pytest.raises(TypeError, match="must be bools"):
        te_dist.overlap_tp_comm(True, fp8="yes")


def test_fp8_gemms_stay_plain_unless_asked():
    previous = te_dist.overlap_tp_comm(True)
    try:
        assert te_dist.tp_overlap_enabled() and not te_dist.tp_overlap_enabled(fp8=True)
        te_dist.overlap_tp_comm(True, fp8=True)
        assert te_dist.tp_overlap_enabled(fp8=True)
    finally:
        te_dist.overlap_tp_comm(previous, fp8=False)


@pytest.mark.gpu
def test_overlapped_equals_plain_two_gpus(tmp_path):
    """The same on 2 NCCL ranks, one GPU each: FP8 GEMMs of cuBLAS on row chunks and NCCL's
    asynchronous gather and point-to-point ring."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    configs = [(name, precision) for name in MODULES for precision in PRECISIONS]
    outcome = on_ranks(_gpu_configs, 2, tmp_path, configs, backend="nccl")
    failed = {key: why for result in outcome for key, why in result.items() if why != "ok"}
    assert not failed, failed


def _gpu_configs(rank: int, configs) -> dict:
    torch.set_default_device(f"cuda:{rank}")
    return each_config(_check, configs, rank)
