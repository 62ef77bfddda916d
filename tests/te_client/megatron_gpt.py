"""Megatron-Core's own GPT, built from its Transformer Engine layer spec, trained on torchte
through the alias: one command that runs every case and prints a table.

    PYTHONPATH=.:<megatron-core> python tests/te_client/megatron_gpt.py [--cases a,b] [--steps N]

Needs megatron-core 0.19 (Python >= 3.12 by its metadata; its sources also import on 3.11) and
a CUDA GPU (NCCL group of one rank); `--cpu` tries the same on gloo and the CPU, where Megatron's
own CUDA calls allow. Each case builds a 2-layer GPT of hidden 64 with Megatron's TE spec,
trains it with Megatron's optimizer, DDP and forward-backward schedule, and reports the loss;
`fp32-match` compares the TE spec with Megatron's local spec in fp32 (same weights); `dist-ckpt`
saves and loads a Megatron distributed checkpoint; `cuda-graph` captures the layers with
cuda_graph_impl="transformer_engine". A case that fails prints its error and the table says so;
the exit status is the number of failed cases.
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import sys
import tempfile
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import torchte.alias  # noqa: F401  (before Megatron, which imports transformer_engine)

SEQ, BATCH, VOCAB, HIDDEN, HEADS, LAYERS = 32, 4, 128, 64, 4, 2


@dataclass
class Case:
    """One row of the table: how the model is configured and what the case checks."""

    name: str
    config: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    check: str = "train"
    env: dict = field(default_factory=dict)
    # Megatron's distributed optimizer with FP8 parameters gathered as FP8 (--fp8-param-gather).
    fp8_param_gather: bool = False


CASES = [
    Case("bf16", {"bf16": True}),
    Case("fp8-delayed", {"bf16": True, "fp8": "hybrid", "fp8_recipe": "delayed"}),
    Case("fp8-tensorwise", {"bf16": True, "fp8": "e4m3", "fp8_recipe": "tensorwise"}),
    Case("fp8-blockwise", {"bf16": True, "fp8": "e4m3", "fp8_recipe": "blockwise"}),
    Case("fp8-mxfp8", {"bf16": True, "fp8": "e4m3", "fp8_recipe": "mxfp8"}),
    Case("fp32-match", {}, check="match"),
    Case(
        "moe-grouped",
        {"bf16": True, "num_moe_experts": 4, "moe_grouped_gemm": True},
        {"num_experts": 4, "moe_grouped_gemm": True},
    ),
    Case(
        "moe-grouped-fp8",
        {
            "bf16": True,
            "fp8": "hybrid",
            "fp8_recipe": "delayed",
            "num_moe_experts": 4,
            "moe_grouped_gemm": True,
        },
        {"num_experts": 4, "moe_grouped_gemm": True},
    ),
    Case(
        "moe-grouped-blockwise",
        {
            "bf16": True,
            "fp8": "e4m3",
            "fp8_recipe": "blockwise",
            "num_moe_experts": 4,
            "moe_grouped_gemm": True,
        },
        {"num_experts": 4, "moe_grouped_gemm": True},
    ),
    Case(
        "moe-op-fuser",
        {
            "bf16": True,
            "num_moe_experts": 4,
            "moe_grouped_gemm": True,
            "use_transformer_engine_op_fuser": True,
            "gated_linear_unit": True,
            "activation_func": "silu",
            "add_bias_linear": False,
        },
        {"num_experts": 4, "moe_grouped_gemm": True, "use_te_op_fuser": True},
        check="fused-experts",
        # Megatron builds its te.ops SwiGLU experts only where this names the fused kernel
        # present (Transformer Engine's is Blackwell's; torchte's grouped MLP runs anywhere).
        env={"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"},
    ),
    Case(
        "moe-fused-paths",
        {
            "bf16": True,
            "num_moe_experts": 4,
            "moe_grouped_gemm": True,
            "moe_router_fusion": True,
            "moe_permute_fusion": True,
            "cross_entropy_loss_fusion": True,
            "cross_entropy_fusion_impl": "te",
            "apply_rope_fusion": True,
        },
        {"num_experts": 4, "moe_grouped_gemm": True},
    ),
    Case(
        "fp8-param-gather",
        {"bf16": True, "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param": True},
        fp8_param_gather=True,
    ),
    Case(
        "fp8-param-gather-blockwise",
        {"bf16": True, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True},
        fp8_param_gather=True,
    ),
    Case("dist-ckpt", {"bf16": True, "fp8": "hybrid", "fp8_recipe": "delayed"}, check="ckpt"),
    Case(
        "cuda-graph",
        {"bf16": True, "cuda_graph_impl": "transformer_engine"},
        check="train",
    ),
]


def _init(cpu: bool) -> torch.device:
    backend = "gloo" if cpu else "nccl"
    if cpu:
        # Megatron allocates its gradient buffers on torch.cuda.current_device(): on the CPU,
        # point that at the CPU (this mode is for looking, not for the record).
        torch.cuda.current_device = lambda: "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not cpu:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    return torch.device("cpu" if cpu else "cuda")


def _config(case: Case, cpu: bool):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = dict(case.config)
    if options.pop("activation_func", None) == "silu":
        options["activation_func"] = F.silu
    options.pop("use_te_op_fuser", None)
    dtype = torch.bfloat16 if options.get("bf16") else torch.float32
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN if not options.get("num_moe_experts") else 2 * HIDDEN,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_router_topk=2,
        # alltoall makes CUDA streams at construction: allgather on the CPU.
        moe_token_dispatcher_type="allgather" if cpu else "alltoall",
        moe_aux_loss_coeff=1e-2 if options.get("num_moe_experts") else 0.0,
        **options,
    )


def _model(config, spec_kwargs: dict, local: bool, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec = (
        get_gpt_layer_local_spec(**spec_kwargs)
        if local
        else get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    return model.to(device)


def _batch(step: int, device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return {
        "tokens": tokens[:, :-1].to(device),
        "labels": tokens[:, 1:].to(device),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).to(device),
        "loss_mask": torch.ones(BATCH, SEQ, device=device),
    }


def _train(
    model, config, steps: int, device: torch.device, fp8_param_gather: bool = False
) -> list[float]:
    """Megatron's DDP, optimizer and forward-backward schedule for `steps` steps."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=fp8_param_gather,
            fp8_param_gather=fp8_param_gather,
        ),
        model,
    )
    if device.type == "cpu":
        # Megatron's optimizers allocate on "cuda": on the CPU, Adam on the DDP's main grads.
        optimizer = _MainGradAdam(ddp.parameters())
    else:
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                bf16=config.bf16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=fp8_param_gather,
                clip_grad=1.0,
            ),
            [ddp],
        )
    forward_backward = get_forward_backward_func()
    losses = []
    for step in range(steps):
        batch = _batch(step, device)

        forward_step = functools.partial(_forward_step, batch)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        if device.type == "cpu":
            # Megatron's schedule allocates on "cuda": on the CPU, its steps by hand.
            output, loss_func = forward_step(None, ddp)
            loss, record = loss_func(output)
            loss.backward()
            # finish_grad_sync waits on CUDA streams; one rank has nothing to reduce.
            records = [record]
        else:
            records = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter([batch]),
                model=[ddp],
                num_microbatches=1,
                seq_length=SEQ,
                micro_batch_size=BATCH,
                forward_only=False,
            )
        optimizer.step()
        losses.append(float(records[0]["loss"]))
    return losses


def _forward_step(batch: dict, data_iterator, model):
    """Megatron's forward_step_func: the model's per-token losses and the loss function."""
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_masked_loss, batch["loss_mask"])


def _masked_loss(mask: torch.Tensor, output_tensor: torch.Tensor):
    loss = (output_tensor.float() * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


class _MainGradAdam(torch.optim.Adam):
    """torch's Adam stepping on the gradients Megatron's DDP leaves in `main_grad`."""

    def __init__(self, params) -> None:
        super().__init__(list(params), lr=1e-3)

    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                grad = getattr(param, "main_grad", None)
                param.grad = None if grad is None else grad.to(param.dtype)
        super().step()


def _copy_matching(te_model, local_model) -> None:
    """Copy the TE-spec model's weights into the local-spec model (names differ by layout)."""
    te_state = te_model.state_dict()
    local_state = local_model.state_dict()
    rename = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    }
    with torch.no_grad():
        for name, value in te_state.items():
            if "_extra_state" in name:
                continue
            target = name
            for te_name, local_name in rename.items():
                if name.endswith(te_name):
                    target = name[: -len(te_name)] + local_name
            if target in local_state:
                local_state[target].copy_(value)
            else:
                raise KeyError(f"no local-spec parameter for {name} (looked for {target})")


def run_case(case: Case, steps: int, device: torch.device, cpu: bool) -> str:
    """Run one case; the table's result text."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.update(case.env)
    torch.manual_seed(0)
    if not cpu:
        model_parallel_cuda_manual_seed(0)
    config = _config(case, cpu)
    model = _model(config, case.spec, local=False, device=device)
    if case.check == "match":
        local = _model(config, case.spec, local=True, device=device)
        _copy_matching(model, local)
        te_losses = _train(model, config, steps, device)
        local_losses = _train(local, config, steps, device)
        worst = max(abs(a - b) / abs(b) for a, b in zip(te_losses, local_losses, strict=True))
        if worst > 1e-4:
            raise AssertionError(f"TE spec {te_losses} vs local spec {local_losses}")
        return f"loss {te_losses[-1]:.4f} = local {local_losses[-1]:.4f} (rel {worst:.1e})"
    if case.check == "fused-experts":
        experts = [m for m in model.modules() if hasattr(m, "_with_fused_impl")]
        if not experts or not all(m._with_fused_impl for m in experts):
            raise AssertionError("Megatron did not build its te.ops experts (the op fuser path)")
    fp8_weights = []
    if case.fp8_param_gather:
        from transformer_engine.pytorch import QuantizedTensor

        fp8_weights = [p for p in model.parameters() if isinstance(p, QuantizedTensor)]
        if not fp8_weights:
            raise AssertionError("fp8_param=True built no FP8 parameters")
    before = [w.dequantize().clone() for w in fp8_weights]
    losses = _train(model, config, steps, device, case.fp8_param_gather)
    if any(torch.equal(b, w.dequantize()) for b, w in zip(before, fp8_weights, strict=True)):
        raise AssertionError("an FP8 parameter kept its value: the cast from the masters missed it")
    if not all(map(torch.isfinite, torch.tensor(losses))):
        raise AssertionError(f"non-finite loss: {losses}")
    if case.check == "ckpt":
        return _checkpoint_round_trip(model, config, case, device, losses)
    return f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"


def _checkpoint_round_trip(model, config, case: Case, device, losses) -> str:
    """Save Megatron's sharded state dict and load it into a fresh model: equal tensors."""
    from megatron.core import dist_checkpointing

    with tempfile.TemporaryDirectory() as folder:
        dist_checkpointing.save(model.sharded_state_dict(), folder)
        fresh = _model(config, case.spec, local=False, device=device)
        loaded = dist_checkpointing.load(fresh.sharded_state_dict(), folder)
        fresh.load_state_dict(loaded)
    before, after = model.state_dict(), fresh.state_dict()
    for name, value in before.items():
        same = (
            _same_extra_state(value, after[name])
            if name.endswith("_extra_state")
            else not isinstance(value, torch.Tensor) or torch.equal(value, after[name])
        )
        if not same:
            raise AssertionError(f"{name} differs after the checkpoint round trip")
    return f"loss {losses[-1]:.4f}; {len(before)} entries equal after load"


def _same_extra_state(a, b) -> bool:
    """Whether two `_extra_state` values (Transformer Engine's uint8 pickles, as the alias
    writes them, or empty) hold the same FP8 state: pickles of equal objects may differ in
    their bytes."""
    decoded = [
        pickle.loads(x.cpu().numpy().tobytes()) if isinstance(x, torch.Tensor) and x.numel()
        else None
        for x in (a, b)
    ]  # fmt: skip
    if decoded[0] is None or decoded[1] is None:
        return decoded[0] is decoded[1]
    x, y = decoded
    return x.keys() == y.keys() and all(
        torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    device = _init(args.cpu)
    wanted = args.cases.split(",")
    rows = []
    for case in [c for c in CASES if c.name in wanted]:
        try:
            rows.append((case.name, "ok", run_case(case, args.steps, device, args.cpu)))
        except Exception as error:  # a case that fails is a row of the table
            traceback.print_exc()
            rows.append((case.name, "FAIL", f"{type(error).__name__}: {error}"[:160]))
    dist.destroy_process_group()
    print(f"\n{'case':<18} {'result':<6} detail")
    for name, result, detail in rows:
        print(f"{name:<18} {result:<6} {detail}")
    return sum(result != "ok" for _, result, _ in rows)


if __name__ == "__main__":
    sys.exit(main())
