"""The training example's optimizer step: torch.nn.utils.clip_grad_norm_ then torch's fused
AdamW, against ClippedAdamW.clip_and_step (train/optimizer.py: the gradients' norm and AdamW
with the clipping factor folded into its read of them, two Triton launches), with their parts
and a device copy's bandwidth beside them.

    PYTHONPATH=. python benchmarks/optimizer_step.py large medium   # on a CUDA GPU

The parameters are the example's (--experts 8) in fp32 with fp32 gradients, as its graphed
blocks hand them out, in its two groups (weight decay on matrices only). Never asserts.
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


def main() -> None:
    copy = copy_gbps()
    rows = []
    for size in sys.argv[1:] or ["large"]:
        rows += run(size, copy)
        torch.cuda.empty_cache()
    print(f"device copy {copy:.0f} GB/s; params fp32, grads fp32")
    print(f"{'size':<8}{'step':<40}{'ms':>9}{'of copy':>9}")
    for size, name, ms, fraction in rows:
        print(f"{size:<8}{name:<40}{ms:>9.3f}{fraction:>9.2f}")


if __name__ == "__main__":
    main()
