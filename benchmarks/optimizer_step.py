"""The training example's optimizer step: torch.nn.utils.clip_grad_norm_ then torch's fused
AdamW, against ClippedAdamW.clip_and_step (train/optimizer.py: the gradients' norm and AdamW
with the clipping factor folded into its read of them, two Triton launches), with their parts
and a device copy's bandwidth beside them.

    PYTHONPATH=. python benchmarks/optimizer_step.py large medium   # on a CUDA GPU

The parameters are the example's (--experts 8) in fp32 with fp32 gradients, as its graphed
blocks hand them out, in its two groups (weight decay on matrices only).

A second table: te.optimizers.FusedAdam (one Triton launch per group and dtype combination,
kernels/adam_states.py) against torch's fused AdamW over the dense model of each size (no
experts; --size large: 355M), with the same states where torch has them (fp32; bf16 params
and moments), and FusedAdam's master-weight forms (bf16 params, fp32 masters, fp32 or bf16
moments) against torch's fp32 step, their usual alternative; capturable: the step replayed
as a CUDA graph. Never asserts.
"""

import sys

import torch
from timing import copy_gbps, gpu_ms

from torchte.kernels import adamw
from torchte.train.config import SIZES, ModelConfig
from torchte.train.model import GPT
from torchte.train.optimizer import ClippedAdamW

# Bytes an element moves: the norm reads the gradient; clipping's multiply reads and writes it;
# AdamW reads param, grad and two moments and writes three of them.
NORM, MULTIPLY, ADAMW = 4, 8, 28
CHUNKS = (1 << 14, 1 << 15, 1 << 16)  # ADAMW_CHUNK's alternatives


def model_params(size: str) -> list[torch.Tensor]:
    preset = SIZES[size]
    config = ModelConfig(
        preset.hidden, preset.layers, preset.heads, preset.ffn, preset.seq_len, experts=8
    )
    model = GPT(config, torch.float32, torch.device("cuda"))
    params = [p.detach().requires_grad_() for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def optimizer(cls, params):
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return cls(groups, lr=1e-4, betas=(0.9, 0.95), fused=True)


def run(size: str, copy: float) -> list[tuple]:
    params = model_params(size)
    grads = [p.grad for p in params]
    numel = sum(p.numel() for p in params)
    theirs, ours = optimizer(torch.optim.AdamW, params), optimizer(ClippedAdamW, params)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(params, 1e9)
        theirs.step()

    def fused_step():
        ours.clip_and_step(1e9, None)

    cases = [  # (name, ADAMW_CHUNK or None for the default, step, bytes an element)
        ("torch: clip_grad_norm_ + fused AdamW", None, torch_step, NORM + MULTIPLY + ADAMW),
        ("  clip_grad_norm_", None, lambda: torch.nn.utils.clip_grad_norm_(params, 1e9),
         NORM + MULTIPLY),
        ("  get_total_norm", None, lambda: torch.nn.utils.get_total_norm(grads), NORM),
        ("  fused AdamW", None, theirs.step, ADAMW),
        ("ClippedAdamW.clip_and_step", None, fused_step, NORM + ADAMW),
        ("  grad_norm", None, lambda: adamw.grad_norm(grads), NORM),
    ]  # fmt: skip
    cases += [(f"  chunks of {c} elements", c, fused_step, NORM + ADAMW) for c in CHUNKS]
    default = adamw.ADAMW_CHUNK
    rows = []
    for name, chunk, fn, bytes_per_element in cases:
        adamw.ADAMW_CHUNK = chunk or default
        ms = gpu_ms(fn, reps=10)
        rows.append((size, name, ms, bytes_per_element * numel / ms / 1e6 / copy))
    adamw.ADAMW_CHUNK = default
    return rows


# (name, param dtype, FusedAdam's options or None for torch's fused AdamW, bytes an element:
# grad read, target (param or master) read and written, moments read and written, param copy)
FUSED_ADAM_CASES = [
    ("torch fused AdamW, fp32", torch.float32, None, 28),
    ("FusedAdam, fp32", torch.float32, {}, 28),
    ("FusedAdam, fp32, capturable graph", torch.float32, {"capturable": True}, 28),
    ("torch fused AdamW, bf16 params + moments", torch.bfloat16, None, 14),
    ("FusedAdam, bf16 params + moments", torch.bfloat16,
     {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}, 14),
    ("FusedAdam, bf16 + fp32 master", torch.bfloat16, {"master_weights": True}, 28),
    ("FusedAdam, bf16 + fp32 master, bf16 moments", torch.bfloat16,
     {"master_weights": True, "exp_avg_dtype": torch.bfloat16,
      "exp_avg_sq_dtype": torch.bfloat16}, 20),
]  # fmt: skip


def fused_adam_rows(size: str, copy: float) -> list[tuple]:
    """te.optimizers.FusedAdam against torch's fused AdamW over the dense model of `size`."""
    from torchte.optimizers import FusedAdam

    preset = SIZES[size]
    config = ModelConfig(preset.hidden, preset.layers, preset.heads, preset.ffn, preset.seq_len)
    rows = []
    for name, dtype, options, bytes_per_element in FUSED_ADAM_CASES:
        model = GPT(config, dtype, torch.device("cuda"))
        params = [p.detach().requires_grad_() for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        kw = {"lr": 1e-4, "betas": (0.9, 0.95)}
        if options is None:
            opt = torch.optim.AdamW(groups, fused=True, **kw)
        else:
            opt = FusedAdam(groups, **kw, **options)
        step = opt.step
        if options and options.get("capturable"):
            step = _graphed(opt.step)
        ms = gpu_ms(step, reps=10)
        numel = sum(p.numel() for p in params)
        rows.append((size, name, ms, bytes_per_element * numel / ms / 1e6 / copy))
        del model, params, groups, opt
        torch.cuda.empty_cache()
    return rows


def _graphed(step):
    """step captured in a CUDA graph (after a warm-up on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    copy = copy_gbps()
    rows, adam_rows = [], []
    for size in sys.argv[1:] or ["large"]:
        rows += run(size, copy)
        torch.cuda.empty_cache()
        adam_rows += fused_adam_rows(size, copy)
    print(f"device copy {copy:.0f} GB/s; params fp32, grads fp32")
    print(f"{'size':<8}{'step':<40}{'ms':>9}{'of copy':>9}")
    for size, name, ms, fraction in rows:
        print(f"{size:<8}{name:<40}{ms:>9.3f}{fraction:>9.2f}")
    print("\nte.optimizers.FusedAdam, the dense model of each size; grads in the params' dtype")
    print(f"{'size':<8}{'step':<46}{'ms':>9}{'of copy':>9}")
    for size, name, ms, fraction in adam_rows:
        print(f"{size:<8}{name:<46}{ms:>9.3f}{fraction:>9.2f}")


if __name__ == "__main__":
    main()
