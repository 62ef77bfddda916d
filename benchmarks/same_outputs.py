"""Do two trees compute the same numbers? Record every output of a fixed run, then compare.

    PYTHONPATH=<tree> python benchmarks/same_outputs.py --save a.pt     # once per tree
    python benchmarks/same_outputs.py --compare a.pt b.pt              # bit for bit

The run uses the public API only, so that a tree from before a refactor records the same run:
te.Linear, te.LayerNormLinear (LayerNorm, RMSNorm), te.LayerNormMLP (GELU, SwiGLU) and
te.GroupedLinear, in bf16 and under delayed and current scaling, three SGD steps each, with
odd sizes (inputs of 48 x 3 x 64 tokens, 1 token, uneven expert splits). It records the
outputs, the input and parameter gradients, the parameters after the steps, and the modules'
state_dict extra state (delayed scaling's scales and amax histories, which the FP8 kernels
write). A refactor that should not change numerics shows every entry equal. Never asserts.
"""

from __future__ import annotations

import argparse
import io
import sys

import torch

import torchte as te
from torchte import recipe

RECIPES = {"bf16": None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
H, F = 64, 192
STEPS = 3


def _modules(device: str) -> dict:
    kw = {"params_dtype": torch.bfloat16, "device": device}
    return {
        "Linear": lambda: te.Linear(H, F, **kw),
        "LayerNormLinear": lambda: te.LayerNormLinear(H, F, **kw),
        "RMSNormLinear": lambda: te.LayerNormLinear(H, F, normalization="RMSNorm", **kw),
        "LayerNormMLP": lambda: te.LayerNormMLP(H, F, **kw),
        "SwiGLUMLP": lambda: te.LayerNormMLP(H, F, activation="swiglu", **kw),
        "GroupedLinear": lambda: te.GroupedLinear(3, H, F, **kw),
    }


def _extra_state(module) -> dict:
    """The tensors of every `_extra_state` entry of the module's state_dict."""
    out = {}
    for name, value in module.state_dict().items():
        if name.endswith("_extra_state") and isinstance(value, dict):
            out.update({f"{name}.{k}": v for k, v in value.items() if torch.is_tensor(v)})
        elif name.endswith("_extra_state") and isinstance(value, io.BytesIO):
            out[name] = torch.frombuffer(bytearray(value.getvalue()), dtype=torch.uint8)
    return out


def record(device: str) -> dict[str, torch.Tensor]:
    """Every output of the fixed run, by name (on the CPU)."""
    results = {}
    for kind, make in _modules(device).items():
        for rname, make_recipe in RECIPES.items():
            for tokens in ((48, 3), (1, 1)):
                torch.manual_seed(1234)
                module = make()
                opt = torch.optim.SGD(module.parameters(), lr=0.05)
                for step in range(STEPS):
                    x = torch.randn(*tokens, H, device=device, dtype=torch.bfloat16)
                    x.requires_grad_(True)
                    extra = ()
                    if kind == "GroupedLinear":
                        x = x.detach().reshape(-1, H).requires_grad_(True)
                        rows = x.shape[0]
                        extra = ([rows - rows // 2 - rows // 3, rows // 3, rows // 2],)
                    fp8 = make_recipe is not None
                    with te.autocast(enabled=fp8, recipe=make_recipe() if fp8 else None):
                        y = module(x, *extra)
                    y = y[0] if isinstance(y, tuple) else y
                    y.float().square().mean().backward()
                    tag = f"{kind}/{rname}/{tokens[0]}x{tokens[1]}/step{step}"
                    results[f"{tag}/y"] = y.detach()
                    results[f"{tag}/dx"] = x.grad.detach()
                    for name, p in module.named_parameters():
                        results[f"{tag}/d{name}"] = p.grad.detach().clone()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                for name, p in module.named_parameters():
                    results[f"{tag}/{name}"] = p.detach().clone()
                for name, t in _extra_state(module).items():
                    results[f"{tag}/{name}"] = t.detach().clone()
    return {k: v.cpu() for k, v in results.items()}


def compare(path_a: str, path_b: str) -> int:
    """Print the entries that differ (bit for bit, NaN equal to NaN); return their count."""
    a, b = torch.load(path_a), torch.load(path_b)
    differ = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            differ.append((name, "missing in " + ("first" if name not in a else "second")))
            continue
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            differ.append((name, f"{tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"))
        elif not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)):
            diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()
            differ.append((name, f"max |difference| {diff:.3g}"))
    for name, what in differ:
        print(f"DIFFERS {name}: {what}")
    print(f"{len(set(a) | set(b))} entries compared, {len(differ)} differ")
    return len(differ)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--save", metavar="PATH", help="record the run to PATH")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two recordings")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    if not args.save:
        p.error("give --save PATH or --compare A B")
    results = record(args.device)
    torch.save(results, args.save)
    print(f"{len(results)} entries recorded on {args.device} to {args.save}")


if __name__ == "__main__":
    main()
