"""Attention and the transformer layer: te beside the direct PyTorch calls, on one GPU.

    PYTHONPATH=. python benchmarks/attention.py [--json out.json] [--quick] [--only N]
    PYTHONPATH=. python benchmarks/attention.py --cpu-check    # build and run once, no timing

Sections (forward+backward, CUDA events, medians of interleaved rounds, bf16 tensors):
1. causal bshd, b 8 x s 4096 x h 32 x d 128: te.DotProductAttention(qkv_format="bshd",
   attn_mask_type="causal") against F.scaled_dot_product_attention(is_causal=True) on the
   (b, h, s, d) transposed views of the same tensors (target: within 3%).
2. thd, 64 packed documents (32768 tokens, lengths random from seed 0), h 32 x d 128, causal
   within each document: te.DotProductAttention(qkv_format="thd") against flex_attention with a
   document block mask (built once, outside the timing; compiled) and torch's varlen_attn where
   this torch has it. Ratios to the faster direct call.
3. te.TransformerLayer (hidden 4096, ffn 16384 SwiGLU, RMSNorm, 32 heads, 8 GQA groups, bshd,
   seq 2048 x batch 2, no bias, no dropout) training step in bf16 and FP8 (DelayedScaling,
   Float8CurrentScaling) against the same pre-norm block built by hand from te modules
   (te.LayerNormLinear qkv, te.DotProductAttention, te.Linear proj, residual, te.LayerNormMLP,
   residual) (target: no slower).
4. Host microseconds per forward+backward of the same two at 16 tokens, hidden 1024 (bf16;
   calls queued back to back, one synchronize per round, interleaved rounds, median; kernel
   launches of one call) (target: <= 1.15x).
TFLOP/s of attention count the causal half of the scores, forward+backward = 3.5 x forward.
Contenders torchte lacks print "missing"; ones this device or torch cannot run print "n/a".
--cpu-check builds every contender at tiny sizes on the CPU and runs one forward+backward
each (checking that every gradient arrives, finite); it times nothing. Never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from contenders import (
    Case,
    Contender,
    Missing,
    Step,
    Unavailable,
    check_once,
    measure_gpu,
    measure_host,
    print_table,
    run_case,
)
from torch import nn

BF16 = torch.bfloat16
EPS = 1e-5
BSHD_CAUSAL = {"attention_dropout": 0.0, "qkv_format": "bshd", "attn_mask_type": "causal"}


@dataclass(frozen=True)
class LayerDims:
    """A transformer block: widths, heads and the (batch, seq) of its input."""

    hidden: int
    ffn: int
    heads: int
    groups: int
    seq: int
    batch: int


@dataclass(frozen=True)
class Dims:
    """Every section's sizes: dense (b, s, h, d), packed (documents, tokens, h, d), the layer
    of section 3 and the small layer of section 4."""

    dense: tuple[int, int, int, int]
    packed: tuple[int, int, int, int]
    layer: LayerDims
    host: LayerDims


FULL = Dims(
    (8, 4096, 32, 128),
    (64, 8 * 4096, 32, 128),
    LayerDims(4096, 16384, 32, 8, 2048, 2),
    LayerDims(1024, 4096, 16, 4, 16, 1),
)
QUICK = Dims(
    (2, 1024, 16, 128),
    (16, 4096, 16, 128),
    LayerDims(1024, 4096, 8, 2, 512, 2),
    LayerDims(1024, 4096, 16, 4, 16, 1),
)
TINY = Dims(
    (2, 32, 4, 16), (4, 64, 4, 16), LayerDims(64, 128, 4, 2, 16, 2), LayerDims(64, 128, 4, 2, 16, 1)
)


def torchte_module():
    """The torchte package, or Missing when it does not import."""
    try:
        import torchte
    except Exception as exc:  # any import failure leaves every te row "missing"
        raise Missing(f"import torchte failed: {type(exc).__name__}: {exc}") from exc
    return torchte


def te_name(name: str):
    """torchte.<name>, or Missing."""
    value = getattr(torchte_module(), name, None)
    if value is None:
        raise Missing(f"torchte.{name}")
    return value


def fp8_recipe(name: str | None):
    """A fresh recipe object for 'delayed' / 'current' (None for bf16); Unavailable where
    this device cannot run FP8."""
    if name is None:
        return None
    te = torchte_module()
    ok, reason = te.is_fp8_available(return_reason=True)
    if not ok:
        raise Unavailable(f"FP8: {reason}")
    return {"delayed": te.recipe.DelayedScaling, "current": te.recipe.Float8CurrentScaling}[name]()


def train_step(forward, leaves: tuple, dy: torch.Tensor, params=(), recipe=None) -> Step:
    """A closure: y = forward(*leaves) (under te.autocast when recipe is given), then
    y.backward(dy) with fresh gradients on leaves and params (as after
    zero_grad(set_to_none=True)). step.grad_of lists the tensors whose grads it makes."""
    grad_of = (*leaves, *params)
    autocast = contextlib.nullcontext
    if recipe is not None:
        te_autocast = torchte_module().autocast

        def autocast():
            return te_autocast(recipe=recipe)

    def step() -> None:
        for t in grad_of:
            t.grad = None
        with autocast():
            y = forward(*leaves)
        y.backward(dy)

    step.grad_of = grad_of
    return step


def randn(*shape: int, device, grad: bool = False) -> torch.Tensor:
    """Standard normal bf16 of `shape` on `device` (a leaf requiring grad if `grad`)."""
    return torch.randn(shape, device=device, dtype=BF16, requires_grad=grad)


def causal_flops(lengths: list[int], heads: int, dim: int) -> float:
    """Forward+backward flops of causal attention over sequences of `lengths`: QK^T and PV
    over the allowed (causal) pairs, 2 flops per multiply-add, backward 2.5 x forward."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 3.5 * 4 * heads * dim * pairs


# Section 1: causal bshd ----------------------------------------------------------------------


def dense_cases(dims: Dims, device: torch.device) -> Iterator[Case]:
    """q, k, v (b, s, h, d) bf16 -> te.DotProductAttention out (b, s, h d) and SDPA out
    (b, h, s, d), both from the same dy."""
    b, s, h, d = dims.dense
    torch.manual_seed(0)
    q, k, v = (randn(b, s, h, d, device=device, grad=True) for _ in range(3))
    dy = randn(b, s, h * d, device=device)

    def sdpa() -> Step:
        def forward(q, k, v):
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return train_step(forward, (q, k, v), dy.view(b, s, h, d).transpose(1, 2))

    def te_dpa() -> Step:
        attn = te_name("DotProductAttention")(h, d, **BSHD_CAUSAL)
        return train_step(attn, (q, k, v), dy)

    yield Case(
        1,
        f"causal bshd b{b} s{s} h{h} d{d}",
        "ms",
        [
            Contender("torch sdpa is_causal", sdpa, baseline=True),
            Contender("te.DotProductAttention", te_dpa, target=1.03),
        ],
        causal_flops([s] * b, h, d),
    )


# Section 2: packed thd -----------------------------------------------------------------------


def doc_lengths(docs: int, tokens: int, seed: int = 0) -> list[int]:
    """`docs` positive lengths summing to `tokens`: cuts at distinct random points."""
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(tokens - 1, generator=gen)[: docs - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, tokens]
    return [hi - lo for lo, hi in itertools.pairwise(bounds)]


def flex_step(q, k, v, dy, lengths: list[int]) -> Step:
    """flex_attention over q, k, v (t, h, d) as (1, h, t, d) views with a causal document
    block mask built here, once; compiled on CUDA, eager elsewhere."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        raise Unavailable(f"torch {torch.__version__} has no flex_attention") from exc
    t, device = q.shape[0], q.device
    doc = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )

    def document_causal(b, h, qi, kj):
        return (doc[qi] == doc[kj]) & (qi >= kj)

    mask = create_block_mask(document_causal, None, None, t, t, device=device)
    attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def forward(q, k, v):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without")
            return attend(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), block_mask=mask)

    if device.type != "cuda":  # no CPU backward: check the forward, report the rest n/a
        forward(q.detach(), k.detach(), v.detach())
        raise Unavailable("flex_attention has no CPU backward (its forward ran)")
    return train_step(forward, (q, k, v), dy.transpose(0, 1).unsqueeze(0))


def varlen_step(q, k, v, dy, cu: torch.Tensor, max_len: int) -> Step:
    """torch.nn.attention.varlen.varlen_attn, causal, over q, k, v (t, h, d)."""
    if q.device.type != "cuda":
        raise Unavailable("varlen_attn needs CUDA")
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        raise Unavailable(f"torch {torch.__version__} has no varlen_attn") from exc
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}

    def forward(q, k, v):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal)

    return train_step(forward, (q, k, v), dy)


def te_thd_step(q, k, v, dy, cu: torch.Tensor, max_len: int, **options) -> Step:
    """te.DotProductAttention(qkv_format="thd", "padding_causal"): (t, h, d) -> (t, h d)."""
    t, h, d = q.shape
    attn = te_name("DotProductAttention")(
        h, d, attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding_causal", **options
    )

    def forward(q, k, v):
        return attn(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
        )

    return train_step(forward, (q, k, v), dy.reshape(t, h * d))


def packed_cases(dims: Dims, device: torch.device) -> Iterator[Case]:
    """Packed documents: q, k, v (t, h, d) bf16, cu_seqlens int32 (docs + 1)."""
    docs, t, h, d = dims.packed
    lengths = doc_lengths(docs, t)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    max_len = max(lengths)
    torch.manual_seed(0)
    q, k, v = (randn(t, h, d, device=device, grad=True) for _ in range(3))
    qkv = (q, k, v, randn(t, h, d, device=device))  # q, k, v, dy
    te_thd = partial(te_thd_step, *qkv, cu, max_len)
    yield Case(
        2,
        f"thd {docs} docs t{t} (max {max_len}) h{h} d{d} causal",
        "ms",
        [
            Contender("torch flex_attention doc mask", partial(flex_step, *qkv, lengths), True),
            Contender("torch varlen_attn", partial(varlen_step, *qkv, cu, max_len), True),
            Contender("te.DotProductAttention thd", te_thd),
            Contender("te.DotProductAttention thd flex", partial(te_thd, attention_backend="flex")),
        ],
        causal_flops(lengths, h, d),
    )


# Sections 3 and 4: the transformer layer -----------------------------------------------------


class HandBlock(nn.Module):
    """te.TransformerLayer's pre-norm block built by hand from te modules:
    x = x + proj(attention(qkv(rmsnorm(x)))); y = x + mlp(rmsnorm(x)).
    x (b, s, hidden) bf16 -> y (b, s, hidden); q (b, s, heads, hd), k / v (b, s, groups, hd).
    """

    def __init__(self, dims: LayerDims, device: torch.device) -> None:
        super().__init__()
        hd = dims.hidden // dims.heads
        self.heads, self.groups, self.hd = dims.heads, dims.groups, hd
        self.sizes = (dims.heads * hd, dims.groups * hd, dims.groups * hd)
        kw = {"params_dtype": BF16, "device": device, "bias": False}
        self.qkv = te_name("LayerNormLinear")(
            dims.hidden, sum(self.sizes), eps=EPS, normalization="RMSNorm", **kw
        )
        attention = te_name("DotProductAttention")
        self.attention = attention(dims.heads, hd, num_gqa_groups=dims.groups, **BSHD_CAUSAL)
        self.proj = te_name("Linear")(dims.heads * hd, dims.hidden, **kw)
        self.mlp = te_name("LayerNormMLP")(
            dims.hidden, dims.ffn, eps=EPS, normalization="RMSNorm", activation="swiglu", **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        context = self.attention(
            q.view(b, s, self.heads, self.hd),
            k.view(b, s, self.groups, self.hd),
            v.view(b, s, self.groups, self.hd),
        )
        x = x + self.proj(context)
        return x + self.mlp(x)


def transformer_layer(dims: LayerDims, device: torch.device, **options) -> nn.Module:
    """te.TransformerLayer with HandBlock's structure (options: fuse_qkv_params, ...)."""
    layer = te_name("TransformerLayer")
    return layer(dims.hidden, dims.ffn, dims.heads, num_gqa_groups=dims.groups, **options,
                 self_attn_mask_type="causal", attn_input_format="bshd", layernorm_epsilon=EPS,
                 hidden_dropout=0.0, attention_dropout=0.0, params_dtype=BF16, bias=False,
                 activation="swiglu", normalization="RMSNorm", device=device)  # fmt: skip


def layer_step(make: Callable[[], nn.Module], dims: LayerDims, device, recipe_name) -> Step:
    """A training step (forward+backward) of make() on x (batch, seq, hidden) bf16."""
    recipe = fp8_recipe(recipe_name)
    torch.manual_seed(0)
    module = make()
    x = randn(dims.batch, dims.seq, dims.hidden, device=device, grad=True)
    dy = randn(dims.batch, dims.seq, dims.hidden, device=device)
    return train_step(module, (x,), dy, tuple(module.parameters()), recipe)


def layer_contenders(dims: LayerDims, device, recipe_name, target: float) -> list[Contender]:
    """Hand-built block (baseline), te.TransformerLayer with one fused qkv weight (as the
    hand-built one; the target) and with Transformer Engine's default separate q/k/v."""

    def step(make):
        return lambda: layer_step(make, dims, device, recipe_name)

    return [
        Contender("hand-built te block", step(lambda: HandBlock(dims, device)), baseline=True),
        Contender(
            "te.TransformerLayer fuse_qkv_params",
            step(lambda: transformer_layer(dims, device, fuse_qkv_params=True)),
            target=target,
        ),
        Contender(
            "te.TransformerLayer (separate q/k/v)", step(lambda: transformer_layer(dims, device))
        ),
    ]


def layer_cases(dims: Dims, device: torch.device) -> Iterator[Case]:
    """Section 3: one case per recipe (FP8 delayed, FP8 current, bf16) at dims.layer."""
    L = dims.layer
    shape = f"h{L.hidden} ffn{L.ffn} {L.heads}/{L.groups} heads b{L.batch} s{L.seq}"
    for recipe_name in ("delayed", "current", None):
        label = f"fp8 {recipe_name}" if recipe_name else "bf16"
        yield Case(3, f"layer {label} {shape}", "ms", layer_contenders(L, device, recipe_name, 1.0))


def host_cases(dims: Dims, device: torch.device) -> Iterator[Case]:
    """Section 4: host time of the same contenders at dims.host, bf16."""
    H = dims.host
    name = f"host bf16 h{H.hidden} ffn{H.ffn} {H.batch * H.seq} tokens"
    yield Case(4, name, "host us", layer_contenders(H, device, None, 1.15))


SECTIONS = {1: dense_cases, 2: packed_cases, 3: layer_cases, 4: host_cases}

# Measuring ----------------------------------------------------------------------------------


# Output -------------------------------------------------------------------------------------


def environment(opts) -> dict:
    """What the figures were measured on (benchmarks/linear.py's, when torchte imports)."""
    try:
        from linear import environment as linear_environment

        ns = argparse.Namespace(
            device=opts.device, quick=opts.quick, host_shape=None, gemm_shape=None
        )
        env = linear_environment(ns)
    except Exception as exc:  # torchte itself missing: still say what ran where
        env = {"device": opts.device, "torch": torch.__version__, "torchte": repr(exc)}
    return {**env, "sections": opts.sections, "cpu_check": opts.cpu_check}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line, plus the sizes and repeats it selects."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    p.add_argument("--only", type=int, choices=tuple(SECTIONS), help="run one section")
    p.add_argument(
        "--cpu-check",
        action="store_true",
        help="tiny shapes on the CPU, one forward+backward each, no timing",
    )
    opts = p.parse_args(argv)
    opts.sections = [opts.only] if opts.only else list(SECTIONS)
    opts.device = "cpu" if opts.cpu_check else "cuda"
    opts.dims = TINY if opts.cpu_check else QUICK if opts.quick else FULL
    opts.rounds, opts.reps = (3, 5) if opts.quick else (5, 10)
    opts.host_rounds, opts.host_calls = (3, 30) if opts.quick else (7, 100)
    return opts


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections case by case, write JSON if asked, print the table last."""
    opts = parse_args(argv)
    if not opts.cpu_check and not torch.cuda.is_available():
        print(
            "benchmarks/attention.py needs a CUDA GPU; nothing measured (--cpu-check runs a "
            "CPU dry run of the contenders, untimed)"
        )
        return 0
    env = environment(opts)
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    device = torch.device(opts.device)
    rows = []
    for section in opts.sections:
        for case in SECTIONS[section](opts.dims, device):
            measure = measure_host if case.unit == "host us" else measure_gpu
            measure = check_once if opts.cpu_check else measure
            rows += run_case(case, measure, opts)
            print(f"done [{section}] {case.name}", flush=True)
    if opts.json:
        result = {"environment": env, "dims": asdict(opts.dims), "rows": rows}
        Path(opts.json).write_text(json.dumps(result, indent=2, default=str))
    print_table(rows, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
