"""The training example's model under FSDP2 on N GPUs, without FP8 and with it.

Measures tokens/s in bf16 and FP8 (delayed and current scaling), bytes all-gathered and
reduce-scattered per step, peak memory per GPU, and scaling efficiency against one GPU running
one rank's share of the work.

    torchrun --nproc-per-node 8 benchmarks/fsdp.py [--json out.json]   # on 8 GPUs (NCCL)
    PYTHONPATH=. python benchmarks/fsdp.py --single                    # one GPU: checks it runs
    ... --fp8-all-gather   # also the FP8 recipes with their weights gathered as FP8
    ... --variants reshard keep torch-step   # which ways of sharding each row runs (below)

Model: torchte.train's GPT at --size large (~355M parameters: 7 blocks of width 2048, FFN 8192,
sequence 1024), fp32 master weights, bf16 compute (torch.autocast), AdamW. A step is the
training example's own (loop.Trainer.train_step: forward, backward, gradient clipping over all
shards, AdamW) on random bytes, each rank training on --batch sequences of every global batch of
--batch x N; every block wrapped by fully_shard, then the whole model (fsdp_run.shard_model).
Rows: bf16 with the parameters all-gathered as they are (fp32) and cast to bf16 first
(MixedPrecisionPolicy, gradients reduced in fp32); the FP8 recipes with the bf16 gather; with
--fp8-all-gather, the FP8 recipes again with the te modules' weights gathered as FP8
(torchte.fsdp.enable_fp8_all_gather before fully_shard; the other parameters in bf16).
Each row in each of --variants: "reshard" (the example's default: every block gathered for its
forward and again for its backward), "keep" (--fsdp-keep-gathered: a block keeps its gathered
weights from its forward to its backward) and "torch-step" (reshard, the optimizer step taken
by torch's clip_grad_norm_ and AdamW over the DTensors instead of ClippedAdamW's sharded fused
step: what the step cost before that).
Step time: median of 5 x 3 steps after 3 warmup steps (CUDA events). Tokens/s: the global
batch's tokens over the step time. Bytes: the collectives FSDP calls in one step, counted by
wrapping torch.distributed's all-gather and reduce-scatter (the whole gathered parameters and
the whole gradients reduced: the larger tensor of each call). Baseline: the same model unsharded
on one GPU training one rank's --batch (no communication), measured once per recipe;
efficiency = baseline time / FSDP time. --single: one GPU, an NCCL group of one rank, --size
medium, to check the script. Rank 0 prints a table last; nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from linear import device_s

from torchte import _device
from torchte.train.config import SIZES, ModelConfig, RunConfig
from torchte.train.data import Corpus
from torchte.train.fsdp_run import data_parallel
from torchte.train.loop import Trainer

RECIPES = ("bf16", "delayed", "current")
COLLECTIVES = {  # what FSDP2 may call (the name differs between torch releases): each is wrapped
    "all-gather": ("all_gather_single", "all_gather_into_tensor"),
    "reduce-scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
}


class CollectiveBytes(contextlib.AbstractContextManager):
    """Counts the bytes of torch.distributed's all-gathers and reduce-scatters called inside it
    (per kind: the larger tensor of each call, the whole buffer)."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        self._wrapped: dict[str, object] = {}

    def __enter__(self) -> CollectiveBytes:
        # torch.distributed's own functions call each other through their module's globals,
        # never through these attributes, so a call is counted once.
        for kind, names in COLLECTIVES.items():
            for name in (n for n in names if hasattr(dist, n)):
                original = getattr(dist, name)
                self._wrapped[name] = original

                def counted(*args, _original=original, _kind=kind, **kwargs):
                    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                    self.bytes[_kind] += max(t.numel() * t.element_size() for t in tensors)
                    return _original(*args, **kwargs)

                setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._wrapped.items():
            setattr(dist, name, original)


def random_corpus() -> Corpus:
    """16 MiB of random bytes (the speed of a step does not depend on the text)."""
    stream = torch.randint(0, 256, (2**24,), dtype=torch.uint8, generator=torch.Generator())
    return Corpus(stream[: -(2**20)], stream[-(2**20) :], "random bytes", 0, 0, False)


VARIANTS = ("reshard", "keep", "torch-step")


def run_config(
    recipe: str, batch: int, fsdp: bool, gather: str = "fp32", keep: bool = False
) -> RunConfig:
    """A run of `recipe` on the GPU, `batch` sequences a step (the global batch under fsdp),
    the parameters all-gathered as `gather` ("fp32", "bf16", or "fp8": the te modules' weights
    as FP8, the rest in bf16), kept from forward to backward where `keep`."""
    return RunConfig(
        recipes=(recipe,), device="cuda", steps=1000, batch_size=batch, lr=2e-4, warmup=10,
        seed=0, log_every=1000, eval_every=1000, eval_batches=1, data=None, max_bytes=2**24,
        out=Path("."), fsdp=fsdp, fp8_all_gather=gather == "fp8",
        fsdp_gather_dtype="fp32" if gather == "fp32" else "bf16", compute_dtype="bf16",
        fsdp_keep_gathered=keep,
    )  # fmt: skip


def step_seconds(trainer: Trainer) -> float:
    return device_s(trainer.train_step, 3, 5, "cuda")


def measure(
    name: str, model_config: ModelConfig, args, dp, corpus, gather: str, variant: str, baselines
) -> dict:
    """One row: the FSDP step over dp's ranks, then (once per recipe, kept in `baselines`) the
    one-GPU baseline of one rank's work (unsharded, fp32 parameters)."""
    config = run_config(name, args.batch * dp.size, True, gather, keep=variant == "keep")
    trainer = Trainer(name, model_config, config, corpus, dp=dp)
    if variant == "torch-step":  # the sharded fused step refused: torch's clip and AdamW
        trainer.optimizer._shards_fusable = lambda params: False
    seconds = step_seconds(trainer)
    torch.cuda.reset_peak_memory_stats()
    with CollectiveBytes() as counter:
        trainer.train_step()
    torch.cuda.synchronize()
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del trainer
    torch.cuda.empty_cache()
    if name not in baselines:
        baseline = Trainer(name, model_config, run_config(name, args.batch, False), corpus)
        baselines[name] = step_seconds(baseline)
        del baseline
        torch.cuda.empty_cache()
    base_seconds = baselines[name]
    return {
        "config": f"{name}, {gather}, {variant}",
        "variant": variant,
        "recipe": name,
        "gather": gather,
        "step_s": seconds,
        "tokens_per_s": config.batch_size * model_config.seq_len / seconds,
        "baseline_s": base_seconds,
        "efficiency": base_seconds / seconds,
        "all_gather_bytes": counter.bytes["all-gather"],
        "reduce_scatter_bytes": counter.bytes["reduce-scatter"],
        "peak_bytes": int(peak.item()),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true", help="one GPU, --size medium")
    parser.add_argument("--size", choices=tuple(SIZES), help="model size (default: large)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    parser.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="also run the FP8 recipes with torchte.fsdp.enable_fp8_all_gather (weights "
        "gathered as FP8)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=["reshard", "keep"],
        help="ways of sharding each row runs in (the module docstring says what each is)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fsdp.py needs CUDA GPUs")
    if args.single:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29518")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    try:
        preset = SIZES[args.size or ("medium" if args.single else "large")]
        model_config = ModelConfig(
            preset.hidden, preset.layers, preset.heads, preset.ffn, preset.seq_len
        )
        fp8_ok, why = _device.fp8_support(torch.device("cuda"))
        # bf16 gathered as the master weights are (fp32, the training example's default) and
        # in bf16 (the usual mixed-precision policy, which the FP8 rows keep for the rest).
        runs = [("bf16", "fp32"), ("bf16", "bf16")]
        runs += [(name, "bf16") for name in RECIPES[1:] if fp8_ok]
        if fp8_ok and args.fp8_all_gather:
            runs += [(name, "fp8") for name in RECIPES[1:]]
        dp, corpus = data_parallel("cuda"), random_corpus()
        baselines: dict[str, float] = {}
        rows = [
            measure(name, model_config, args, dp, corpus, gather, variant, baselines)
            for name, gather in runs
            for variant in args.variants
        ]
        if dp.rank == 0:
            report(args, model_config, dp.size, rows, None if fp8_ok else why)
    finally:
        dist.destroy_process_group()


def report(args, model_config: ModelConfig, world: int, rows: list[dict], no_fp8) -> None:
    """Print the table (and write --json)."""
    tokens = args.batch * model_config.seq_len
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: torchte.train GPT "
        f"({model_config.layers} blocks x {model_config.hidden}, FFN {model_config.ffn}), FSDP2 "
        f"over {world} GPU(s), {tokens} tokens per rank and step, bf16 compute"
    )
    if no_fp8:
        print(f"FP8 recipes left out: {no_fp8}")
    head = ("config", "tokens/s", "efficiency", "gather MB", "scatter MB", "peak GiB/GPU")
    print(
        f"{head[0]:30s} {head[1]:>10s} {head[2]:>10s} {head[3]:>10s} {head[4]:>10s} {head[5]:>13s}"
    )
    for r in rows:
        print(
            f"{r['config']:30s} {r['tokens_per_s']:10,.0f} {r['efficiency']:10.1%} "
            f"{r['all_gather_bytes'] / 2**20:10.1f} {r['reduce_scatter_bytes'] / 2**20:10.1f} "
            f"{r['peak_bytes'] / 2**30:13.2f}"
        )
    print("efficiency: one GPU's step time on one rank's batch, unsharded / the FSDP step time")
    if args.json is not None:
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "ranks": world,
            "model": vars(model_config),
            "tokens_per_rank": tokens,
            "rows": rows,
        }
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
