"""A small GPT of te modules: a byte-level causal language model.

Legend: B batch, S sequence length, H hidden, V vocabulary (256 bytes), nh heads, hd = H / nh.

Block: x + proj(attention(te.LayerNormLinear(x) -> q, k, v)), then + MLP: te.LayerNormMLP
(dense) or MoEMLP (experts). Token and learned position embeddings (torch nn.Embedding),
a final te.LayerNorm and a te.Linear head. Weights are N(0, 0.02); the layers that write into
the residual stream (attention projection, the MLP's second GEMM) get 0.02 / sqrt(2 layers),
so the stream's scale does not grow with depth.

Tensor parallelism (tp_group of P ranks, Megatron-style): each rank holds nh / P heads (its
rows of q, k and v in the QKV te.LayerNormLinear, column-parallel; its columns of the
row-parallel projection) and its share of the MLP (te.LayerNormMLP with set_parallel_mode);
embeddings, norms and the head are whole on every rank. Without sequence parallelism every rank
sees the whole residual stream; with it (sequence_parallel) each rank holds its rows of the
batch (dim 0, which the modules split as Transformer Engine's split the sequence), gathered
before each QKV and MLP and reduce-scattered after each projection. shard_from copies a whole
model's weights into such a model.

Precision: the parameters may be fp32 (master weights) with the model run under torch.autocast;
the residual stream is then kept in the autocast dtype from the embeddings on. The output
layer (the head) always runs in high precision, outside any FP8 region, as is usual for FP8
training: its GEMM is small, and the logits decide the loss directly.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchte as te
from torchte.module.base import TransformerEngineBaseModule

from .config import ModelConfig
from .moe import MoEMLP

INIT_STD = 0.02


def _normal(std: float):
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


class SplitHeads(torch.autograd.Function):
    """qkv (B, S, 3H) -> q, k, v (B, nh, S, hd), views of qkv; the backward writes their
    gradients into one (B, S, 3H) tensor in a single pass. (Through view, permute and unbind,
    autograd would stack the three gradients and then copy the permuted stack again: on a GPU
    that took longer than the attention's own backward.)"""

    @staticmethod
    def forward(ctx, qkv_BSX: torch.Tensor, heads: int):
        b, s, x = qkv_BSX.shape
        return qkv_BSX.view(b, s, 3, heads, x // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, *grads_BnSd):  # autograd passes zeros for an unused output
        b, _, s, _ = grads_BnSd[0].shape
        grad_BSX = torch.stack([g.transpose(1, 2) for g in grads_BnSd], dim=2).view(b, s, -1)
        return grad_BSX, None


class Attention(nn.Module):
    """Causal self-attention: x (B, S, H) -> (B, S, H); norm and QKV in one te.LayerNormLinear."""

    def __init__(self, config: ModelConfig, kw: dict, out_std: float, tp: dict) -> None:
        super().__init__()
        size = tp.get("tp_size", 1)
        self.heads = config.heads // size  # this rank's
        h = config.hidden
        column = {"parallel_mode": "column", **tp} if tp else {}
        row = {"parallel_mode": "row", **tp} if tp else {}
        self.qkv = te.LayerNormLinear(h, 3 * h, init_method=_normal(INIT_STD), **column, **kw)
        self.proj = te.Linear(h, h, init_method=_normal(out_std), **row, **kw)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        # each (B, nh / P, S, hd): under sequence parallelism B is the whole batch's, gathered
        q, k, v = SplitHeads.apply(self.qkv(x_BSH), self.heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """One transformer block (pre-norm): attention, then the MLP, each with a residual."""

    def __init__(self, config: ModelConfig, kw: dict, tp: dict) -> None:
        super().__init__()
        out_std = INIT_STD / math.sqrt(2 * config.layers)
        self.attn = Attention(config, kw, out_std, tp)
        if config.experts:
            self.mlp = MoEMLP(
                config.hidden, config.ffn, config.experts, config.top_k,
                kw["params_dtype"], kw["device"], _normal(INIT_STD), _normal(out_std),
            )  # fmt: skip
        else:
            self.mlp = te.LayerNormMLP(
                config.hidden,
                config.ffn,
                activation="gelu",
                init_method=_normal(INIT_STD),
                output_layer_init_method=_normal(out_std),
                set_parallel_mode=bool(tp),
                **tp,
                **kw,
            )

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(x_BSH)
        return x_BSH + self.mlp(x_BSH)


class GPT(nn.Module):
    """tokens (B, S) int64 -> logits (B, S, V) in the parameters' dtype."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp_group=None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        tp = {}
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            size = dist.get_world_size(tp_group)
            if config.experts or config.heads % size:
                raise ValueError(
                    f"tensor parallelism over {size} ranks needs the dense MLP and a head "
                    f"count it divides (heads {config.heads}, experts {config.experts})"
                )
            tp = {"tp_group": tp_group, "tp_size": size, "sequence_parallel": sequence_parallel}
        kw = {"params_dtype": dtype, "device": device}
        self.tok_emb = nn.Embedding(config.vocab, config.hidden, device=device, dtype=dtype)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden, device=device, dtype=dtype)
        for emb in (self.tok_emb, self.pos_emb):
            nn.init.normal_(emb.weight, mean=0.0, std=INIT_STD)
        self.blocks = nn.ModuleList(Block(config, kw, tp) for _ in range(config.layers))
        split_rows = bool(tp) and sequence_parallel
        self.norm = te.LayerNorm(config.hidden, sequence_parallel=split_rows, **kw)
        self.head = te.Linear(config.hidden, config.vocab, init_method=_normal(INIT_STD), **kw)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
        x_BSH = self.tok_emb(tokens_BS) + self.pos_emb(positions)
        x_BSH = x_BSH.to(_stream_dtype(x_BSH))
        for block in self.blocks:
            x_BSH = block(x_BSH)
        z_BSH = self.norm(x_BSH)
        with te.autocast(enabled=False):  # the output layer stays in high precision
            return self.head(z_BSH)


def shard_index(name: str, config: ModelConfig, rank: int, size: int) -> tuple:
    """Where rank `rank`'s piece of parameter `name` (a name of GPT's) sits in the whole
    parameter, tensor-parallel over `size` ranks: its heads' rows of q, k and v, its columns of
    each projection, its share of each MLP; everything else whole."""
    h, ffn = config.hidden, config.ffn

    def rows(total: int) -> slice:
        return slice(rank * total // size, (rank + 1) * total // size)

    key = name.split(".", 2)[-1] if name.startswith("blocks.") else name
    if key in ("attn.qkv.weight", "attn.qkv.bias"):
        return (torch.cat([torch.arange(h)[rows(h)] + j * h for j in range(3)]),)
    index = {
        "attn.proj.weight": (slice(None), rows(h)),
        "mlp.fc1_weight": (rows(ffn),),
        "mlp.fc1_bias": (rows(ffn),),
        "mlp.fc2_weight": (slice(None), rows(ffn)),
    }
    return index.get(key, (slice(None),))


@torch.no_grad()
def shard_from(model: GPT, whole: GPT, rank: int, size: int) -> None:
    """Copy a whole (one-rank) model's weights into `model`, tensor-parallel over `size` ranks,
    as rank `rank` (shard_index)."""
    wholes = dict(whole.named_parameters())
    for name, param in model.named_parameters():
        param.copy_(wholes[name][shard_index(name, whole.config, rank, size)])


def _stream_dtype(x: torch.Tensor) -> torch.dtype:
    """The residual stream's dtype: torch.autocast's where it is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def count_parameters(model: nn.Module) -> int:
    """The number of parameter elements."""
    return sum(p.numel() for p in model.parameters())


def scaled_modules(model: nn.Module) -> list[TransformerEngineBaseModule]:
    """The te modules that carry FP8 scaling state (the norms carry none)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, TransformerEngineBaseModule)
        and type(m).get_extra_state is not nn.Module.get_extra_state
    ]


def scaling_snapshot(model: nn.Module) -> list[dict]:
    """Copies of every te module's delayed-scaling state (scales, amax histories)."""
    return [m.get_extra_state() for m in scaled_modules(model)]


def restore_scaling(model: nn.Module, snapshot: list[dict]) -> None:
    """Put the delayed-scaling state back as `snapshot` found it. A module that had none gets
    the initial values (scale 1, empty history), as if it had never run under FP8."""
    for module, saved in zip(scaled_modules(model), snapshot, strict=True):
        if saved:
            module.set_extra_state(saved)
            continue
        now = module.get_extra_state()
        if now:
            initial = {k: v for k, v in now.items() if k == "amax_history_len"}
            for key in ("fwd", "bwd"):
                initial[f"{key}_scale"] = torch.ones_like(now[f"{key}_scale"])
                initial[f"{key}_amax_history"] = torch.zeros_like(now[f"{key}_amax_history"])
            module.set_extra_state(initial)
