"""Per-step time of the training example with experts: step wall time, GPU busy time, launches,
GPU kernel time by kind (kernel names matched in KINDS' order, so the grouped activation kernels,
whose names contain "scale", count as "FP8 cast/amax/scale") and the longest kernels (15 unless
--top N) with their launches a step.

    PYTHONPATH=. python benchmarks/train_profile.py medium large   # on a CUDA GPU
    PYTHONPATH=. python benchmarks/train_profile.py --host-splits medium   # sizes read back
    PYTHONPATH=. python benchmarks/train_profile.py --eager medium   # no CUDA graphs
    PYTHONPATH=. python benchmarks/train_profile.py --recipes bf16,current large
    PYTHONPATH=. python benchmarks/train_profile.py --top 30 medium   # the 30 longest kernels

The runs take the example's defaults, so their blocks are CUDA graphs (--cuda-graph auto on a
GPU); --eager and --host-splits (which no graph can hold) run them eagerly.

Per size and recipe (bf16, current, delayed): 8 warm-up steps, 10 timed steps (wall), then 3
profiled steps (kernel times). Never asserts.
"""

import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from torchte.train import cli, moe
from torchte.train.data import load_corpus
from torchte.train.loop import Trainer

KINDS = [
    ("grouped GEMM (cutlass)", ("cutlass", "GroupProblem")),
    ("GEMM", ("nvjet", "gemm", "sm90_xmma", "cublas")),
    ("attention", ("flash", "fmha", "attention")),
    (
        "FP8 cast/amax/scale",
        ("cast_transpose", "_amax", "delayed_scaling", "scale", "grouped_cast"),
    ),
    ("fused activation", ("_act", "activation", "_forward_kernel", "_backward_kernel")),
    ("norm", ("norm", "layernorm", "rms")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    (
        "copy/fill/elementwise",
        (
            "elementwise",
            "copy",
            "fill",
            "Fill",
            "Memset",
            "Memcpy",
            "reduce",
            "index",
            "scatter",
            "gather",
            "cat",
        ),
    ),
]


def kind(name):
    for label, keys in KINDS:
        if any(k in name for k in keys):
            return label
    return "other"


sizes = sys.argv[1:]
extra = []
TOP = 15  # the kernels that take the most time a step, by name
if "--host-splits" in sizes:  # the experts' sizes read back each step instead of kept on the GPU
    sizes.remove("--host-splits")
    moe.DEVICE_SPLITS = False
    extra = ["--cuda-graph", "off"]
recipes = ("bf16", "current", "delayed")
if "--recipes" in sizes:
    at = sizes.index("--recipes")
    recipes = tuple(sizes[at + 1].split(","))
    del sizes[at : at + 2]
if "--top" in sizes:
    at = sizes.index("--top")
    TOP = int(sizes[at + 1])
    del sizes[at : at + 2]
if "--eager" in sizes:
    sizes.remove("--eager")
    extra = ["--cuda-graph", "off"]
for size in sizes:
    for recipe in recipes:
        args = [
            "--device",
            "cuda",
            "--size",
            size,
            "--experts",
            "8",
            "--steps",
            "30",
            "--recipe",
            recipe,
            "--out",
            "/tmp/o",
            *extra,
        ]
        model_config, config = cli.parse_args(args)
        corpus = load_corpus(config.data, config.max_bytes, model_config.seq_len)
        trainer = Trainer(recipe, model_config, config, corpus)
        for _ in range(8):
            trainer.train_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            trainer.train_step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 10 * 1e3
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                trainer.train_step()
            torch.cuda.synchronize()
        per, by_name, calls = defaultdict(float), defaultdict(float), defaultdict(int)
        count = 0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[kind(e.name)] += e.device_time / 1e3 / 3
                by_name[e.name[:70]] += e.device_time / 1e3 / 3
                calls[e.name[:70]] += 1
                count += 1
        gpu = sum(per.values())
        print(
            f"{size} {recipe}: step {wall:.1f} ms, GPU busy {gpu:.1f} ms, launches {count // 3}, "
            f"tokens/s {config.batch_size * model_config.seq_len / wall * 1e3:,.0f}, "
            f"fused optimizer steps {trainer.optimizer.fused_steps} of {trainer.step}"
        )
        print(
            "   " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
        )
        for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP]:
            print(f"      {ms:7.2f} ms {calls[name] // 3:5d}x  {name}")
        del trainer
        torch.cuda.empty_cache()
