"""Block-scaled FP8 (Float8BlockScaling: 1x128 activations and gradients, 128x128 weights)
against torch bf16 on the shapes of the block-scaling targets, in one run:

    PYTHONPATH=. python benchmarks/block_scaling.py [--json out.json] [--only NAME ...]

Rows (forward+backward milliseconds, CUDA events, medians; the ratio is torch bf16's time over
the row's), each timed two ways: one step alone (a synchronize before it, so the GPU also
waits for the host's first launch) and steps back to back (the host runs ahead, as in a
training loop of many layers). Cases: te.Linear 8192^3; te.LayerNormMLP 8192 tokens, 4096 ->
16384 -> 4096; a GPT block (te.TransformerLayer, hidden 2048, 16 heads, 16K tokens as 8 x
2048); te.GroupedLinear 8 x 4096^2 at 32K tokens (uneven splits, a host list); the te.ops
grouped MLP (8 experts, 32K tokens, 4096 -> 2 x 14336 -> 4096, ScaledSwiGLU, splits on the
device) against torch bf16 torch._grouped_mm; and the 1x128 / 128x128 quantization kernels as
a fraction of a device-to-device copy. MXFP8 / NVFP4 (emulated on Hopper) time te.Linear
8192^3 beside bf16.
Never asserts; a row that fails prints its error.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from grouped_linear import EXPERTS, split_tokens
from layernorm_mlp import TorchMLP
from timing import fwd_bwd_step, gpu_ms
from torch import nn

import torchte as te
from torchte import recipe

BF16 = {"dtype": torch.bfloat16, "device": "cuda"}


def _input(tokens, features):
    return torch.randn(tokens, features, requires_grad=True, **BF16)


def linear_case(size=8192):
    x, dy = _input(size, size), torch.randn(size, size, **BF16)
    torch_layer = nn.Linear(size, size, **BF16)
    te_layer = te.Linear(size, size, params_dtype=torch.bfloat16, device="cuda")
    return torch_layer, te_layer, x, dy, ()


def mlp_case(tokens=8192, hidden=4096, ffn=16384):
    x, dy = _input(tokens, hidden), torch.randn(tokens, hidden, **BF16)
    te_mlp = te.LayerNormMLP(hidden, ffn, params_dtype=torch.bfloat16, device="cuda")
    return TorchMLP(hidden, ffn, "gelu"), te_mlp, x, dy, ()


def gpt_case(hidden=2048, heads=16, seq=2048, batch=8):
    x = torch.randn(seq, batch, hidden, requires_grad=True, **BF16)
    dy = torch.randn(seq, batch, hidden, **BF16)
    torch_block = nn.TransformerEncoderLayer(
        hidden, heads, 4 * hidden, dropout=0.0, activation="gelu", norm_first=True, **BF16
    )

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch_block
            self.mask = nn.Transformer.generate_square_subsequent_mask(seq, device="cuda")

        def forward(self, inp):
            return self.block(inp, src_mask=self.mask, is_causal=True)

    te_block = te.TransformerLayer(
        hidden, 4 * hidden, heads, hidden_dropout=0.0, attention_dropout=0.0,
        self_attn_mask_type="causal", params_dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    return TorchGPT(), te_block, x, dy, ()


class TorchGrouped(nn.Module):
    """torch._grouped_mm bf16 of G weights (N, K)."""

    def __init__(self, features):
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, features, features, **BF16) / features**0.5)

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.w.transpose(1, 2), offs=offs)


def grouped_case(tokens=32768, features=4096):
    x, dy = _input(tokens, features), torch.randn(tokens, features, **BF16)
    sizes = split_tokens(tokens)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    te_layer = te.GroupedLinear(
        EXPERTS, features, features, bias=False, params_dtype=torch.bfloat16, device="cuda"
    )
    # Split sizes on the host, as Transformer Engine's GroupedLinear takes them (Megatron's
    # tokens_per_expert list); the grouped MLP below takes them on the device.
    return TorchGrouped(features), te_layer, x, dy, (offs, sizes)


class TorchGroupedMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, 2 * ffn, hidden, **BF16) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, hidden, ffn, **BF16) / ffn**0.5)

    def forward(self, x, offs, probs):
        h = torch._grouped_mm(x, self.w1.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        a = (F.silu(gate) * up * probs[:, None]).to(torch.bfloat16)
        return torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)


class TeGroupedMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        kw = {"dtype": torch.bfloat16, "device": "cuda", "bias": False}
        self.mlp = te.ops.Sequential(
            te.ops.GroupedLinear(EXPERTS, hidden, 2 * ffn, **kw),
            te.ops.ScaledSwiGLU(),
            te.ops.GroupedLinear(EXPERTS, ffn, hidden, **kw),
        )

    def forward(self, x, splits, probs):
        return self.mlp(x, splits, probs, splits)


def grouped_mlp_case(tokens=32768, hidden=4096, ffn=14336):
    x, dy = _input(tokens, hidden), torch.randn(tokens, hidden, **BF16)
    sizes = split_tokens(tokens)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    probs = torch.rand(tokens, device="cuda")
    splits = torch.tensor(sizes, device="cuda")
    extra = ((offs, probs), (splits, probs))
    return TorchGroupedMLP(hidden, ffn), TeGroupedMLP(hidden, ffn), x, dy, extra


CASES = {
    "te.Linear 8192^3": (linear_case, 2 * 3 * 8192**3),
    "LayerNormMLP 8192x4096x16384": (mlp_case, 2 * 3 * 2 * 8192 * 4096 * 16384),
    "GPT block h2048 16K tokens": (gpt_case, None),
    "GroupedLinear 8x4096^2 32K": (grouped_case, 2 * 3 * 32768 * 4096**2),
    "te.ops grouped MLP 8x(4096->2x14336->4096) 32K": (
        grouped_mlp_case,
        2 * 3 * 32768 * 4096 * 3 * 14336,
    ),
}
RECIPES = {
    "block": recipe.Float8BlockScaling,
    "mxfp8 (emulated)": recipe.MXFP8BlockScaling,
    "nvfp4 (emulated)": recipe.NVFP4BlockScaling,
}


def _extras(extra):
    """(torch's extra inputs, te's): grouped cases give a pair of tuples, others nothing."""
    if not extra:
        return (), ()
    if isinstance(extra[0], tuple):
        return extra
    return (extra[0],), (extra[1],)


def _times(step) -> tuple[float, float]:
    """(ms of one step timed alone: events around it after a synchronize, so the GPU also
    waits for the host's first launch; ms per step of 10 steps back to back, the host running
    ahead as in a training loop), medians."""
    return gpu_ms(step, reps=10), gpu_ms(step, reps=5, inner=10)


def run_case(name, recipes, rows):
    make, flops = CASES[name]
    torch_mod, te_mod, x, dy, extra = make()
    torch_extra, te_extra = _extras(extra)
    base, base_b2b = _times(fwd_bwd_step(torch_mod, x, dy, None, torch_extra))
    rows.append({
        "case": name, "impl": "torch bf16", "ms": base, "ratio": 1.0, "flops": flops,
        "ms_b2b": base_b2b, "ratio_b2b": 1.0,
    })  # fmt: skip
    for label, make_recipe in [("te bf16", None), *recipes]:
        fp8 = make_recipe() if make_recipe else None
        try:
            ms, ms_b2b = _times(fwd_bwd_step(te_mod, x, dy, fp8, te_extra))
            rows.append({
                "case": name, "impl": label, "ms": ms, "ratio": base / ms, "flops": flops,
                "ms_b2b": ms_b2b, "ratio_b2b": base_b2b / ms_b2b,
            })  # fmt: skip
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            rows.append({"case": name, "impl": label, "error": msg})
    del torch_mod, te_mod
    torch.cuda.empty_cache()


def quantize_rows(rows, size=8192):
    from torchte.quantization.blockwise import Float8BlockQuantizer

    x = torch.randn(size, size, **BF16)
    copy_ms = gpu_ms(lambda: x.clone(), reps=20)
    copy_bytes = 2 * x.numel() * 2
    for dim in (1, 2):
        q = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=dim)
        ms = gpu_ms(lambda q=q: q.quantize(x, rowwise=True, columnwise=True), reps=20)
        moved = x.numel() * (2 + 1 + 1)
        rows.append({
            "case": f"quantize {size}^2 bf16 {'1x128' if dim == 1 else '128x128'} row+col",
            "impl": "torchte", "ms": ms,
            "of_copy": (moved / ms) / (copy_bytes / copy_ms),
        })  # fmt: skip


def print_table(rows):
    print(f"{'case':48s} {'impl':18s} {'ms':>8s} {'x bf16':>7s} {'TFLOP/s':>8s}"
          f" {'b2b ms':>8s} {'x bf16':>7s}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['case']:48s} {r['impl']:18s} {r['error']}")
            continue
        if "of_copy" in r:
            print(f"{r['case']:48s} {r['impl']:18s} {r['ms']:8.3f} {r['of_copy']:6.2f} of copy")
            continue
        tflops = f"{r['flops'] / r['ms'] / 1e9:8.0f}" if r.get("flops") else "       -"
        print(
            f"{r['case']:48s} {r['impl']:18s} {r['ms']:8.3f} {r['ratio']:6.2f}x {tflops}"
            f" {r['ms_b2b']:8.3f} {r['ratio_b2b']:6.2f}x"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*", help="case names (substrings) to run")
    parser.add_argument("--emulated", action="store_true", help="also MXFP8 / NVFP4 rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows: list[dict] = []
    for name in CASES:
        if args.only and not any(s in name for s in args.only):
            continue
        recipes = [("te block", RECIPES["block"])]
        if args.emulated and name == "te.Linear 8192^3":
            recipes += [(label, RECIPES[label]) for label in list(RECIPES)[1:]]
        run_case(name, recipes, rows)
    if not args.only or any("quantize" in s for s in args.only):
        quantize_rows(rows)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
