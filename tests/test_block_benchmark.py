"""benchmarks/block.py's dry run on the CPU: every contender of the gpt and llama blocks and of
the TransformerLayer case builds, runs a forward and backward under its recipe and gives every
input and parameter a finite gradient, and the plain-PyTorch block computes what the te block
does (the same weights, bf16)."""

from __future__ import annotations

import pytest
import torch
from benchmark_modules import import_benchmark
from tolerances import representable


@pytest.fixture(scope="module")
def block():
    """benchmarks/block.py."""
    return import_benchmark("block")


def test_every_contender_runs_with_finite_gradients(block):
    opts = block.parse_args(["--cpu-check"])
    rows = block.measure_blocks(opts, torch.device("cpu"))
    assert len(rows) == 2 * (1 + len(block.RECIPES)) + 6
    for row in rows:
        assert row["status"].startswith("ran fwd+bwd"), (row["case"], row["impl"], row["status"])


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_torch_block_computes_the_te_block(block, name):
    dims, kind = block.TINY, block.KINDS[name]
    torch.manual_seed(0)
    te_block = block.TeBlock(dims, kind, "cpu")
    torch_block = block.TorchBlock(dims, kind, "cpu")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        torch_block.qkv.weight.copy_(te_block.qkv.weight)
        torch_block.proj.weight.copy_(te_block.proj.weight)
        torch_block.mlp.fc1.weight.copy_(te_block.mlp.fc1_weight)
        torch_block.mlp.fc2.weight.copy_(te_block.mlp.fc2_weight)
        for norm, weight in (
            (torch_block.norm1, te_block.qkv),
            (torch_block.mlp.norm, te_block.mlp),
        ):
            norm.weight.copy_(weight.layer_norm_weight)
        if kind.bias:
            for mine, theirs in (
                (torch_block.qkv.bias, te_block.qkv.bias),
                (torch_block.proj.bias, te_block.proj.bias),
                (torch_block.mlp.fc1.bias, te_block.mlp.fc1_bias),
                (torch_block.mlp.fc2.bias, te_block.mlp.fc2_bias),
                (torch_block.norm1.bias, te_block.qkv.layer_norm_bias),
                (torch_block.mlp.norm.bias, te_block.mlp.layer_norm_bias),
            ):
                mine.copy_(theirs)
    x = representable((dims.batch, dims.seq, dims.hidden), torch.bfloat16, generator=gen)
    x = x.to(torch.bfloat16)
    ours, theirs = torch_block(x).float(), te_block(x).float()
    # bf16 rounding at every layer of a block: compared against the output's scale
    error = (ours - theirs).abs().max() / theirs.abs().max()
    assert error < 0.05, error
    assert not torch.equal(ours, torch.zeros_like(ours))
