"""A small GPT of te modules: a byte-level causal language model.

Legend: B batch, S sequence length, T = B S tokens, H hidden, V vocabulary (256 bytes),
nh heads, ng key/value groups, hd = H / nh.

Block (dense): te.TransformerLayer, pre-norm, causal self-attention (qkv_format "bshd", or
"thd" for packed batches), no dropout, biases; its norm (LayerNorm or RMSNorm), activation
and GQA groups from ModelConfig. Block (with experts): te.MultiheadAttention (the same
attention, its norm inside) and MoEMLP. Token embeddings (torch nn.Embedding) and either
learned position embeddings or rotary embeddings (te.RotaryPositionEmbedding, applied to
queries and keys in every block); a final te.LayerNorm (or te.RMSNorm) and a te.Linear head.
Weights are N(0, 0.02); the layers that write into the residual stream (attention projection,
the MLP's second GEMM) get 0.02 / sqrt(2 layers), so the stream's scale does not grow with
depth.

Packed batches (ModelConfig.packed, packing.py): the rows of a batch are flattened into T
tokens and each document attends only within itself; positions (learned or rotary) restart at
every document.

Tensor parallelism (tp_group of P ranks, Megatron-style, set_parallel_mode): each rank holds
nh / P heads and ng / P key/value groups (its rows of the query, key and value weights of
layernorm_qkv, column-parallel; its columns of the row-parallel proj) and its share of the MLP
(te.LayerNormMLP; its rows of each half of FC1 for gated activations); embeddings, norms and
the head are whole on every rank. Without sequence parallelism every rank sees the whole
residual stream; with it (sequence_parallel) each rank holds its rows of the batch (dim 0,
which the modules split as Transformer Engine's split the sequence), gathered before each
QKV and MLP and reduce-scattered after each projection. shard_from copies a whole model's
weights into such a model.

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
from torch import nn

import torchte as te
from torchte.distributed.context_parallel import split_for_cp_rank
from torchte.kernels.activation import is_gated
from torchte.module.base import TransformerEngineBaseModule

from . import packing
from .config import ModelConfig
from .ep_run import expert_rows, is_expert
from .moe import MoEMLP

INIT_STD = 0.02


def _normal(std: float):
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


def _attention_options(config: ModelConfig) -> dict:
    """te.MultiheadAttention's (and te.TransformerLayer's) arguments common to both blocks."""
    return {
        "num_gqa_groups": config.gqa_groups,
        "layernorm_epsilon": 1e-5,
        "init_method": _normal(INIT_STD),
        "bias": True,
        "normalization": config.normalization,
    }


def _format(config: ModelConfig) -> tuple[str, str]:
    """(qkv_format, attention mask type) of the blocks."""
    return ("thd", "padding_causal") if config.packed else ("bshd", "causal")


def dense_block(config: ModelConfig, number: int, kw: dict, tp: dict) -> te.TransformerLayer:
    """Block `number` (1-based) of a dense model."""
    out_std = INIT_STD / math.sqrt(2 * config.layers)
    qkv_format, mask = _format(config)
    return te.TransformerLayer(
        config.hidden,
        config.ffn,
        config.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        output_layer_init_method=_normal(out_std),
        layer_number=number,
        self_attn_mask_type=mask,
        set_parallel_mode=bool(tp),
        activation=config.activation,
        attn_input_format=qkv_format,
        **_attention_options(config),
        **tp,
        **kw,
    )


class MoEBlock(nn.Module):
    """A block with experts (pre-norm): x + self_attention(x), then + mlp (MoEMLP).
    x (B, S, H), or (T, H) packed -> the same shape."""

    def __init__(
        self,
        config: ModelConfig,
        number: int,
        kw: dict,
        device_splits: bool | None = None,
        ep_group=None,
        tp: dict | None = None,
    ) -> None:
        """device_splits: MoEMLP's (None: the example's default); ep_group: its experts split
        over these ranks (expert parallelism); tp: the attention's tensor-parallel options
        (with sequence parallelism: the experts then run on this rank's rows)."""
        super().__init__()
        out_std = INIT_STD / math.sqrt(2 * config.layers)
        qkv_format, mask = _format(config)
        self.self_attention = te.MultiheadAttention(
            config.hidden,
            config.heads,
            attention_dropout=0.0,
            output_layer_init_method=_normal(out_std),
            layer_number=number,
            attn_mask_type=mask,
            input_layernorm=True,
            qkv_format=qkv_format,
            set_parallel_mode=bool(tp),
            **_attention_options(config),
            **(tp or {}),
            **kw,
        )
        self.mlp = MoEMLP(
            config.hidden, config.ffn, config.experts, config.top_k,
            kw["params_dtype"], kw["device"], _normal(INIT_STD), _normal(out_std),
            config.normalization, config.activation, device_splits, ep_group,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, **attention: object) -> torch.Tensor:
        """attention: te.MultiheadAttention.forward's keyword arguments (RoPE, cu_seqlens)."""
        x = x + self.self_attention(x, **attention)
        return x + self.mlp(x)


class GPT(nn.Module):
    """tokens (B, S) int64 [, doc_starts (B, S) bool for a packed model] -> logits (B, S, V)
    in the parameters' dtype."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp_group=None,
        sequence_parallel: bool = False,
        moe_device_splits: bool | None = None,
        ep_group=None,
    ) -> None:
        """moe_device_splits: where the MoE layers keep their experts' row counts (True: on the
        device, as CUDA graphs need; None: moe.DEVICE_SPLITS); ep_group: the MoE layers'
        experts split over its ranks (expert parallelism, ep_run.py)."""
        super().__init__()
        self.config = config
        tp = {}
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            size = dist.get_world_size(tp_group)
            # experts: split over the same ranks (ep_group), each rank's on its rows
            moe_ok = ep_group is not None and sequence_parallel
            if (config.experts and not moe_ok) or config.heads % size or config.gqa_groups % size:
                raise ValueError(
                    f"tensor parallelism over {size} ranks needs head and group counts it "
                    f"divides (heads {config.heads}, gqa groups {config.gqa_groups}) and, with "
                    f"experts ({config.experts}), expert parallelism over the same ranks with "
                    "sequence parallelism"
                )
            tp = {"tp_group": tp_group, "tp_size": size, "sequence_parallel": sequence_parallel}
        self.tp_group = tp_group if tp and sequence_parallel else None  # packed: gathers
        kw = {"params_dtype": dtype, "device": device}
        self.tok_emb = nn.Embedding(config.vocab, config.hidden, device=device, dtype=dtype)
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=INIT_STD)
        self.cp_positions = None  # context parallelism: this rank's positions (S / cp,)
        if config.rope:  # (S, 1, 1, hd) fp32 angles, not saved: they follow from the config
            freqs = te.RotaryPositionEmbedding(config.head_dim)(config.seq_len)
            self.register_buffer("rope_freqs", freqs.to(device), persistent=False)
        else:
            self.pos_emb = nn.Embedding(config.seq_len, config.hidden, device=device, dtype=dtype)
            nn.init.normal_(self.pos_emb.weight, mean=0.0, std=INIT_STD)
        self.blocks = nn.ModuleList(
            MoEBlock(config, i + 1, kw, moe_device_splits, ep_group, tp)
            if config.experts
            else dense_block(config, i + 1, kw, tp)
            for i in range(config.layers)
        )
        split_rows = bool(tp) and sequence_parallel
        norm = te.RMSNorm if config.normalization == "RMSNorm" else te.LayerNorm
        self.norm = norm(config.hidden, sequence_parallel=split_rows, **kw)
        self.head = te.Linear(config.hidden, config.vocab, init_method=_normal(INIT_STD), **kw)

    def set_context_parallel_group(self, cp_group) -> None:
        """Context parallelism over cp_group: every block's self-attention attends over the
        ranks' shares of each sequence (RoPE at this rank's positions), and the learned
        position embeddings take this rank's positions."""
        ranks = list(range(dist.get_world_size(cp_group)))
        for block in self.blocks:
            block.set_context_parallel_group(cp_group, ranks, None, "p2p")
        cp, rank = len(ranks), dist.get_rank(cp_group)
        whole = torch.arange(self.config.seq_len)
        self.cp_positions = split_for_cp_rank(whole, cp, rank, 0)

    def forward(
        self, tokens_BS: torch.Tensor, doc_starts_BS: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s = tokens_BS.shape
        attention = {}
        if self.config.rope:
            attention["rotary_pos_emb"] = self.rope_freqs
        x = self.tok_emb(tokens_BS)
        if self.config.packed:
            if doc_starts_BS is None:
                raise ValueError("a packed GPT needs doc_starts (B, S): where documents start")
            cu = packing.cu_seqlens(doc_starts_BS.to(tokens_BS.device), self.tp_group)
            attention.update(
                cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s
            )  # fmt: skip
        if not self.config.rope:
            positions = torch.arange(s, device=tokens_BS.device)
            if self.cp_positions is not None:  # this rank's share of each sequence
                positions = self.cp_positions.to(tokens_BS.device)
            if self.config.packed:
                positions = packing.positions(doc_starts_BS.to(tokens_BS.device))
            x = x + self.pos_emb(positions)
        x = x.to(_stream_dtype(x))
        if self.config.packed:
            x = x.flatten(0, 1)  # (T, H)
        for block in self.blocks:
            x = block(x, **attention)
        z = self.norm(x)
        with te.autocast(enabled=False):  # the output layer stays in high precision
            return self.head(z).view(b, s, -1)


def shard_index(name: str, config: ModelConfig, rank: int, size: int) -> tuple:
    """Where rank `rank`'s piece of parameter `name` (a name of GPT's) sits in the whole
    parameter, tensor-parallel over `size` ranks: its heads' rows of q, its groups' rows of k
    and v, its columns of each projection, its share of each MLP (of each half of a gated
    FC1); everything else whole."""
    h, kv, ffn = config.hidden, config.gqa_groups * config.head_dim, config.ffn

    def rows(total: int) -> slice:
        return slice(rank * total // size, (rank + 1) * total // size)

    key = name.split(".", 2)[-1] if name.startswith("blocks.") else name
    module, _, param = key.rpartition(".")
    if module == "self_attention.layernorm_qkv" and "_" in param:
        part, kind = param.split("_", 1)  # query_weight, key_bias, ...
        if part in ("query", "key", "value") and kind in ("weight", "bias"):
            return (rows(h if part == "query" else kv),)
    if key in ("layernorm_mlp.fc1_weight", "layernorm_mlp.fc1_bias"):
        if not is_gated(config.activation):
            return (rows(ffn),)
        return (torch.cat([torch.arange(ffn)[rows(ffn)] + j * ffn for j in range(2)]),)
    index = {
        "self_attention.proj.weight": (slice(None), rows(h)),
        "layernorm_mlp.fc2_weight": (slice(None), rows(ffn)),
    }
    return index.get(key, (slice(None),))


@torch.no_grad()
def shard_from(model: GPT, whole: GPT, rank: int, size: int) -> None:
    """Copy a whole (one-rank) model's weights into `model`, tensor-parallel over `size` ranks,
    as rank `rank` (piece_index)."""
    wholes = dict(whole.named_parameters())
    for name, param in model.named_parameters():
        param.copy_(wholes[name][piece_index(param, name, whole.config, rank, size)])


def piece_index(param, name: str, config: ModelConfig, rank: int, size: int) -> tuple:
    """shard_index, or for an expert parameter (Megatron-Core's `allreduce = False`: experts
    split over the same ranks, expert parallelism) its E / size experts' rows."""
    if is_expert(param):
        return expert_rows(param, rank)
    return shard_index(name, config, rank, size)


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
    return [m._scaling_state() for m in scaled_modules(model)]


def restore_scaling(model: nn.Module, snapshot: list[dict]) -> None:
    """Put the delayed-scaling state back as `snapshot` found it. A module that had none gets
    the initial values (scale 1, empty history), as if it had never run under FP8."""
    for module, saved in zip(scaled_modules(model), snapshot, strict=True):
        if saved:
            module._load_scaling_state(saved)
            continue
        now = module._scaling_state()
        if now:
            initial = {k: v for k, v in now.items() if k == "amax_history_len"}
            for key in ("fwd", "bwd"):
                initial[f"{key}_scale"] = torch.ones_like(now[f"{key}_scale"])
                initial[f"{key}_amax_history"] = torch.zeros_like(now[f"{key}_amax_history"])
            module._load_scaling_state(initial)
