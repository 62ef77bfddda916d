"""How far are a block's FP8 outputs and gradients from its high-precision ones, and did a
change move them? Per tensor, the relative error against the same block without FP8.

    PYTHONPATH=<tree> python benchmarks/fp8_error.py --save a.pt     # once per tree
    python benchmarks/fp8_error.py --compare a.pt b.pt              # the errors side by side

The block is the training example's: te.TransformerLayer (LayerNorm, GELU, biases, causal
self-attention) of width 2048, ffn 8192, 16 heads, on 16 sequences of 1024 tokens in bf16
(`--small`: width 256, 4 sequences of 128, which also runs on the CPU); `--model block`: the
same computation built from te.LayerNormLinear (QKV), te.DotProductAttention, te.Linear and
te.LayerNormMLP (benchmarks/block.py's gpt block, the example's blocks before
te.TransformerLayer), so that the two builds' errors compare. It runs once without
FP8 (the reference), then STEPS forward+backward passes under each recipe on the same input
and output gradient without changing the weights (delayed scaling's scales come from the
earlier passes' amaxes), and keeps the last pass's output, input gradient and parameter
gradients. The error of a tensor t is ||t - ref|| / ||ref|| in fp64. Uses the public API only,
so that an older tree records the same run. Never asserts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from attention import LayerDims
from block import KINDS, TeBlock

import torchte as te
from torchte import recipe

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
STEPS = 4
LARGE = (2048, 8192, 16, 16, 1024)  # hidden, ffn, heads, batch, seq
SMALL = (256, 1024, 4, 4, 128)


def build(model: str, dims, device):
    """The seeded block and a function of x that runs it: te.TransformerLayer ("layer") or
    block.py's gpt block of te modules ("block")."""
    hidden, ffn, heads, batch, seq = dims
    torch.manual_seed(0)
    if model == "block":
        block = TeBlock(LayerDims(hidden, ffn, heads, heads, seq, batch), KINDS["gpt"], device)
        return block, block
    block = te.TransformerLayer(
        hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, device=device, attn_input_format="bshd",
    )  # fmt: skip
    return block, lambda x: block(x, self_attn_mask_type="causal")


def run_block(dims, device, make_recipe, model: str = "layer") -> dict[str, torch.Tensor]:
    """The output, input gradient and parameter gradients of the last of STEPS passes of the
    seeded block under make_recipe() (None: without FP8, one pass)."""
    hidden, _, _, batch, seq = dims
    block, forward = build(model, dims, device)
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, device=device)
    for _ in range(1 if make_recipe is None else STEPS):
        x.grad = None
        block.zero_grad(set_to_none=True)
        with te.autocast(enabled=make_recipe is not None, recipe=make_recipe and make_recipe()):
            y = forward(x)
        y.backward(dy)
    out = {"output": y.detach(), "input grad": x.grad}
    out.update({f"grad {n}": p.grad for n, p in block.named_parameters() if p.grad is not None})
    return {k: v.double().cpu() for k, v in out.items()}


def errors(dims, device, model: str = "layer") -> dict[str, dict[str, float]]:
    """{recipe: {tensor: relative error against the block without FP8}}."""
    ref = run_block(dims, device, None, model)
    table = {}
    for name, make in RECIPES.items():
        got = run_block(dims, device, make, model)
        table[name] = {
            k: float((got[k] - r).norm() / r.norm().clamp_min(1e-30)) for k, r in ref.items()
        }
    return table


def print_tables(tables: list[dict], labels: list[str]) -> None:
    for name in tables[0]:
        print(f"\n{name}: relative error against the block without FP8")
        print(f"  {'tensor':56s}" + "".join(f" {label[-11:]:>11s}" for label in labels))
        for tensor in tables[0][name]:
            cells = "".join(f" {t[name].get(tensor, float('nan')):11.5f}" for t in tables)
            print(f"  {tensor[:56]:56s}{cells}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--save", metavar="PATH", help="also write the errors to PATH")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two saved runs side by side")
    p.add_argument("--small", action="store_true", help="a small block (runs on the CPU too)")
    p.add_argument("--model", choices=("layer", "block"), default="layer", help="see above")
    opts = p.parse_args(argv)
    if opts.compare:
        labels = [Path(path).stem for path in opts.compare]
        print_tables([torch.load(path) for path in opts.compare], labels)
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not opts.small:
        print("benchmarks/fp8_error.py needs a CUDA GPU for the large block (--small: the CPU)")
        return 0
    table = errors(SMALL if opts.small else LARGE, device, opts.model)
    if opts.save:
        torch.save(table, opts.save)
    print_tables([table], ["error"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
