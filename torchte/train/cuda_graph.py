"""--cuda-graph: the transformer blocks' forwards and backwards captured as CUDA graphs with
te.make_graphed_callables, so that a training step replays two graphs a block (forward, and
backward) instead of launching each kernel from Python: what a host-bound model (small GEMMs,
many blocks, MoE routing) waits on.

What is captured, per recipe (GraphPlan):
- dense blocks (te.TransformerLayer): each whole block;
- blocks with experts (model.MoEBlock): each whole block, the MoE layer keeping its experts' row
  counts on the device (te.moe.MoELayer's device_splits=True), where the experts' grouped GEMMs
  find their groups on the device: under delayed, current and block scaling, and without FP8
  where the model computes in bf16 and torch._grouped_mm runs. Elsewhere (mxfp8 and nvfp4,
  whose grouped GEMMs run group by group; fp32 compute) those GEMMs need the row counts on the
  host, which no graph can hold: only each block's attention is captured, and the experts run
  eagerly with the counts read on the host (the example's default).
Not supported (the command line refuses --cuda-graph on, and auto is off): the CPU, --tp and
--fsdp (collectives and FSDP2's per-call hooks inside the blocks), --packed (the packed
attention reads each batch's document lengths on the host). Under auto only models with
experts are graphed (resolve_cuda_graph says why); `on` graphs dense ones too.

The capture (capture_blocks) runs once per recipe's run, at its first training step (after a
resume): sample inputs of the run's batch shape in the residual stream's dtype, requiring grad,
under the run's recipe (make_graphed_callables' fp8_enabled / fp8_recipe) and under
torch.autocast as the training step runs it, with autocast's weight-cast cache off (torch's
CUDA graphs need it off: a cast cached during capture would be replayed stale, never redone).
make_graphed_callables undoes what its eager warm-up wrote (delayed scaling's amax histories
and scales, the CUDA generator); each replay then records amaxes and moves the scales in place,
as an eager step does, so evaluation's snapshot and restore of the scaling state and the
checkpoints see the same tensors.

The blocks' parameter gradients are the backward graphs' static buffers themselves
(clone_param_grads_on_return=False): a step sets every .grad to None, runs one backward and
steps the optimizer before the next replay overwrites them, so no copy of 2000M gradients a
step (4.8 ms of a large step on an H200) is needed.

Evaluation: a graphed block whose training flag differs from the capture's runs eagerly under
the same autocast, so the model in eval mode (validation, under no_grad) runs every block
eagerly; the captured forward, which keeps activations for a backward, is never replayed
without grad.

On the CPU, make_graphed_callables runs the modules eagerly under the same autocast regions:
RunConfig allows cuda_graph there, so that the tests run this path without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import torchte as te
from torchte import recipe as te_recipe
from torchte.gemm import grouped_mm_supported

from .config import ModelConfig, RunConfig
from .model import GPT

CUDA_GRAPH_MODES = ("auto", "on", "off")
# FP8 recipes whose grouped GEMMs read the experts' row counts on the device.
DEVICE_SPLIT_RECIPES = ("delayed", "current", "block")
SAMPLE_SEED = 0  # the warm-up's sample inputs (its effects are undone: any values do)


def graph_conflicts(device: str, tp: int, fsdp: bool, packed: bool) -> list[tuple[str, str]]:
    """(option, why) of each option of a run that CUDA graphs of its blocks do not support."""
    conflicts = []
    if device != "cuda":
        conflicts.append((f"--device {device}", "CUDA graphs need a GPU"))
    if tp > 1:
        conflicts.append((f"--tp {tp}", "its collectives run inside the blocks"))
    if fsdp:
        conflicts.append(("--fsdp", "FSDP2 gathers the weights in hooks around each block"))
    if packed:
        conflicts.append(
            ("--packed", "the packed attention reads each batch's lengths on the host")
        )
    return conflicts


def resolve_cuda_graph(
    mode: str,
    device: str,
    tp: int = 1,
    fsdp: bool = False,
    packed: bool = False,
    experts: bool = True,
) -> tuple[bool, str]:
    """(on, why) for --cuda-graph `mode`: "off"; "on" (ValueError naming every option that
    conflicts, and why); "auto": on where it pays and is supported (a model with experts, on a
    GPU, one process, not packed), else off. Dense blocks stay eager under auto: at the
    example's sizes their steps wait on the GPU, not on the host (docs/benchmarks.md measures
    the MoE model, whose routing makes it host-bound: 5.8x the eager FP8 step's tokens/s)."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"--cuda-graph must be one of {', '.join(CUDA_GRAPH_MODES)}, got {mode}")
    if mode == "off":
        return False, "--cuda-graph off"
    conflicts = graph_conflicts(device, tp, fsdp, packed)
    if mode == "on":
        if conflicts:
            named = "; ".join(f"{option} ({why})" for option, why in conflicts)
            raise ValueError(
                f"--cuda-graph on is not supported with {named}: use --cuda-graph off, or "
                "auto, which turns it off there"
            )
        return True, "--cuda-graph on"
    if conflicts:
        option, why = conflicts[0]
        return False, f"auto: not with {option}, {why}"
    if not experts:
        return False, "auto: dense blocks run eagerly (--cuda-graph on captures them)"
    return True, "auto: experts, one process on a GPU"


@dataclass(frozen=True)
class GraphPlan:
    """What one recipe's run captures."""

    whole_blocks: bool
    """True: each block; False: each block's self-attention (the experts run eagerly)."""
    moe_device_splits: bool | None
    """The MoE layers' device_splits: True where they are captured; None: the default."""
    note: str
    """One line for the log: what is captured, and why not more."""


def experts_capturable(recipe: str, compute_dtype: str, device: torch.device) -> bool:
    """Whether the experts' grouped GEMMs of a run of `recipe` find their row counts on the
    device (a graph can hold them): FP8 delayed, current and block scaling, and without FP8
    the bf16 grouped GEMM (torch._grouped_mm, where it runs on `device`)."""
    if recipe in DEVICE_SPLIT_RECIPES:
        return True
    if recipe == "bf16" and compute_dtype == "bf16":
        return grouped_mm_supported(device, torch.bfloat16, True)
    return False


def plan_graphs(recipe: str, model_config: ModelConfig, config: RunConfig) -> GraphPlan | None:
    """What a run of `recipe` captures; None with config.cuda_graph off."""
    if not config.cuda_graph:
        return None
    layers = model_config.layers
    if not model_config.experts:
        return GraphPlan(True, None, f"each of the {layers} blocks captured")
    if experts_capturable(recipe, config.compute_dtype, torch.device(config.device)):
        note = f"each of the {layers} blocks captured, the experts' row counts on the device"
        return GraphPlan(True, True, note)
    why = "fp32 compute" if recipe == "bf16" else recipe
    note = (
        f"the attention of each of the {layers} blocks captured; the experts run eagerly "
        f"(their grouped GEMMs under {why} read the row counts on the host)"
    )
    return GraphPlan(False, None, note)


def capture_blocks(
    model: GPT,
    plan: GraphPlan,
    recipe: te_recipe.Recipe | None,
    batch_size: int,
    stream_dtype: torch.dtype,
    autocast_bf16: bool,
) -> tuple[nn.Module, ...]:
    """Capture the blocks of `model` (or their self-attention, per `plan`) for batches of
    `batch_size` rows: x (B, S, H) in stream_dtype, the residual stream's. Returns the modules
    whose forward now replays (release() gives them theirs back)."""
    config = model.config
    device = model.head.weight.device
    modules = tuple(b if plan.whole_blocks else b.self_attention for b in model.blocks)
    gen = torch.Generator().manual_seed(SAMPLE_SEED)  # not torch's generators: the run's
    shape = (batch_size, config.seq_len, config.hidden)
    samples = tuple(
        (torch.randn(shape, generator=gen).to(device, stream_dtype).requires_grad_(),)
        for _ in modules
    )
    kwargs = None
    if config.rope:  # the same buffer at every call: the replay copies nothing
        kwargs = tuple({"rotary_pos_emb": model.rope_freqs} for _ in modules)
    with torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=autocast_bf16, cache_enabled=False
    ):
        te.make_graphed_callables(
            modules,
            samples,
            sample_kwargs=kwargs,
            fp8_enabled=recipe is not None,
            fp8_recipe=recipe,
            clone_param_grads_on_return=False,
        )
    return modules


def release(modules: tuple[nn.Module, ...]) -> None:
    """Free the graphs of capture_blocks' modules; each gets its own forward back."""
    for module in modules:
        module.reset()
