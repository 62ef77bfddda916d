"""te.InferenceParams: Transformer Engine's KV cache for generation (non-paged), which
te.DotProductAttention fills and reads when a forward gets `inference_params`.

Legend: B max_batch_size, S max_sequence_length, hg num_heads_kv, dk / dv head_dim_k /
head_dim_v, h query heads; in one step: b sequences, sq the (padded) query length, n new tokens,
skv the longest sequence in the cache after the step, t rows of a thd input (t >= n).

    params = te.InferenceParams(4, 128, num_heads_kv=2, head_dim_k=64, dtype=torch.bfloat16)
    params.pre_step(OrderedDict([(7, 5), (9, 3)]))  # sequence id -> its new tokens this step
    out = layer(x, inference_params=params)          # x [2, 5, hidden], each row padded at its end
    params.pre_step(OrderedDict([(7, 1), (9, 1)]))  # then one token each
    out = layer(x_next, inference_params=params)     # x_next [2, 1, hidden]

The cache of each layer is [B, S, hg, dk] and [B, S, hg, dv] ("bshd"); row i holds the i-th
sequence of the latest step_dict (rows are reordered when sequences finish or join). New
tokens come as sbhd / bshd [., b, ...] padded at the end of each row, or thd (packed in
step_dict's order); each attends to its sequence's cached tokens and to the new tokens before
it (causal masks are aligned to the bottom right). The cache is written outside autograd: no
gradient flows into past keys and values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .._device import default_device
from .formats import from_bhsd

__all__ = ["CachedStep", "InferenceParams", "cache_mask_type"]

_FORMATS = ("sbhd", "bshd", "thd")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The mask type a step attends with: padding from the cache's lengths, causal to the bottom right.
_CACHE_MASKS = {
    "padding": "padding",
    "no_mask": "padding",
    "padding_causal": "padding_causal_bottom_right",
    "padding_causal_bottom_right": "padding_causal_bottom_right",
    "causal": "padding_causal_bottom_right",
    "causal_bottom_right": "padding_causal_bottom_right",
}


def cache_mask_type(attn_mask_type: str) -> str:
    """The mask type of an attention over the cache; ValueError for "arbitrary"."""
    if attn_mask_type not in _CACHE_MASKS:
        raise ValueError(
            f"attn_mask_type={attn_mask_type!r} cannot be used with inference_params: use "
            "'padding_causal' (or 'padding', 'causal', 'no_mask')"
        )
    return _CACHE_MASKS[attn_mask_type]


@dataclass(frozen=True)
class _StepPlan:
    """Where one step's new tokens go, made by pre_step for all layers.

    rows, src, dst: (n,) int64 on the cache's device: each new token's batch row, its position
    in its padded row of the step, its position in the cache. step_lens, total_lens: (B,)
    int64 on the device (zeros past b); start: (B,) int32 on the host, the lengths before the
    step (RoPE's start positions).
    """

    batch_size: int
    max_step: int
    max_total: int
    n_new: int
    rows: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    step_lens: torch.Tensor
    total_lens: torch.Tensor
    start: torch.Tensor


@dataclass(frozen=True)
class CachedStep:
    """One layer's attention inputs after its step: q [b, h, sq, dk], k [b, hg, skv, dk],
    v [b, hg, skv, dv] (views of the cache), pad_q [b, sq] and pad_kv [b, skv] bool, True past
    each sequence's new and cached tokens."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pad_q: torch.Tensor
    pad_kv: torch.Tensor


class _NonPagedCache:
    """The caches of all layers, cache[layer_number] = (k [B, S, hg, dk], v [B, S, hg, dv]),
    and the sequences in them, {seq_id: length}, in row order."""

    def __init__(self, shape: tuple[int, int, int, int, int], dtype, device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sequences: OrderedDict = OrderedDict()

    def reset(self) -> None:
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int) -> None:
        batch, seq, heads, dk, dv = self.shape
        kw = {"dtype": self.dtype, "device": self.device}
        self.cache[layer_number] = (
            torch.zeros(batch, seq, heads, dk, **kw),
            torch.zeros(batch, seq, heads, dv, **kw),
        )

    def reorder(self, order: list) -> None:
        """Move each continuing sequence's row to its place in `order` (new ids: any row)."""
        old = {seq: row for row, seq in enumerate(self.sequences)}
        src = [old.get(seq, row) for row, seq in enumerate(order)]
        if all(old.get(seq, row) == row for row, seq in enumerate(order)):
            return
        index = torch.tensor(src, device=self.device)
        for k, v in self.cache.values():
            k[: len(src)] = k.index_select(0, index)
            v[: len(src)] = v.index_select(0, index)


class InferenceParams:
    """Transformer Engine's InferenceParams with its non-paged KV cache manager.

    Arguments as Transformer Engine's (num_heads_kv, head_dim_k and dtype are required);
    `device` (torchte only) is where the caches live (default: CUDA where there is a GPU, else
    the CPU; torch's default device wins). is_paged=True and custom_cache_manager raise
    NotImplementedError.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        num_heads_kv: int | None = None,
        head_dim_k: int | None = None,
        dtype: torch.dtype | None = None,
        head_dim_v: int | None = None,
        is_paged: bool = False,
        total_num_pages: int | None = None,
        page_size: int | None = None,
        max_ctx_len: int | None = None,
        qkv_format: str = "bshd",
        custom_cache_manager=None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if is_paged:
            raise NotImplementedError(
                "InferenceParams: is_paged=True (the paged KV cache) is not implemented in "
                "torchte yet; use is_paged=False"
            )
        if custom_cache_manager is not None:
            raise NotImplementedError(
                "InferenceParams: custom_cache_manager is not implemented in torchte"
            )
        head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        sizes = {
            "max_batch_size": max_batch_size,
            "max_sequence_length": max_sequence_length,
            "num_heads_kv": num_heads_kv,
            "head_dim_k": head_dim_k,
            "head_dim_v": head_dim_v,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"InferenceParams: {name} must be a positive int, got {value!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"InferenceParams: dtype must be one of {_DTYPES}, got {dtype!r}")
        if qkv_format not in _FORMATS:
            raise ValueError(
                f"InferenceParams: qkv_format must be one of {_FORMATS}, got {qkv_format!r}"
            )
        if max_ctx_len is not None and not 1 <= max_ctx_len <= max_sequence_length:
            raise ValueError(
                f"InferenceParams: max_ctx_len must be in [1, max_sequence_length="
                f"{max_sequence_length}], got {max_ctx_len}"
            )
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.num_heads_kv, self.head_dim_k, self.head_dim_v = num_heads_kv, head_dim_k, head_dim_v
        self.dtype, self.is_paged, self.max_ctx_len = dtype, False, max_ctx_len
        self.total_num_pages, self.page_size = total_num_pages, page_size
        self.device = default_device(device)
        shape = (max_batch_size, max_sequence_length, num_heads_kv, head_dim_k, head_dim_v)
        self.cache_manager = _NonPagedCache(shape, dtype, self.device)
        self.cache_qkv_format = "bshd"
        self._set_format(qkv_format)
        ints = {"dtype": torch.int32, "device": self.device}
        self.cu_seqlens_q = torch.zeros(max_batch_size + 1, **ints)
        self.cu_seqlens_kv = torch.zeros(max_batch_size + 1, **ints)
        self.pre_step_seqlens = torch.zeros(max_batch_size, **ints)
        self.reset()

    def _set_format(self, qkv_format: str) -> None:
        self.input_qkv_format = qkv_format
        same = qkv_format == self.cache_qkv_format
        self.output_qkv_format = qkv_format if same else f"{qkv_format}_2{self.cache_qkv_format}"

    def reset(self) -> None:
        """Forget every sequence (the caches stay allocated)."""
        self.sequences: OrderedDict = OrderedDict()
        self.sequences_pre_step: OrderedDict = OrderedDict()
        self.batch_size = 0
        self._plan: _StepPlan | None = None
        self.cache_manager.reset()

    def __repr__(self) -> str:
        return (
            f"dtype={self.dtype}, is_paged={self.is_paged}, "
            f"max_batch_size={self.max_batch_size}, max_seqlen={self.max_sequence_length}, "
            f"num_heads={self.num_heads_kv}, head_dim_k={self.head_dim_k}, "
            f"head_dim_v={self.head_dim_v}"
        )

    def allocate_memory(self, layer_number: int) -> None:
        """Allocate layer_number's caches, k [B, S, hg, dk] and v [B, S, hg, dv] (zeros)."""
        if isinstance(layer_number, bool) or not isinstance(layer_number, int):
            raise ValueError(f"layer_number must be an int, got {layer_number!r}")
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: Mapping) -> None:
        """Begin a step: step_dict {seq_id: new tokens} in the batch's order. Ids not in it are
        finished and dropped; new ids start empty. ValueError (nothing changed) when the batch
        exceeds max_batch_size or a sequence would exceed max_sequence_length."""
        if not isinstance(step_dict, Mapping):
            raise TypeError(f"step_dict must be an OrderedDict, got {type(step_dict).__name__}")
        if len(step_dict) > self.max_batch_size:
            raise ValueError(
                f"step_dict has {len(step_dict)} sequences, more than max_batch_size="
                f"{self.max_batch_size}"
            )
        pre_lens, step_lens = [], []
        for seq, step in step_dict.items():
            if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
                raise ValueError(f"step_dict[{seq!r}] must be a positive int, got {step!r}")
            pre = self.cache_manager.sequences.get(seq, 0)
            if pre + step > self.max_sequence_length:
                raise ValueError(
                    f"sequence {seq!r} would hold {pre + step} tokens after this step, more "
                    f"than max_sequence_length={self.max_sequence_length}"
                )
            pre_lens.append(pre)
            step_lens.append(step)
        self.cache_manager.reorder(list(step_dict))
        totals = [p + s for p, s in zip(pre_lens, step_lens, strict=True)]
        self.cache_manager.sequences = OrderedDict(zip(step_dict, totals, strict=True))
        self.sequences = self.cache_manager.sequences
        self.sequences_pre_step = OrderedDict(zip(step_dict, pre_lens, strict=True))
        self.batch_size = len(step_dict)
        self._plan = self._make_plan(pre_lens, step_lens)

    def _make_plan(self, pre_lens: list[int], step_lens: list[int]) -> _StepPlan:
        """The step's index tensors, built on the host and moved once."""
        pad = [0] * (self.max_batch_size - len(step_lens))
        pre = torch.tensor(pre_lens + pad, dtype=torch.int64)
        step = torch.tensor(step_lens + pad, dtype=torch.int64)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), step.cumsum(0)])
        cu_kv = torch.cat([torch.zeros(1, dtype=torch.int64), (pre + step).cumsum(0)])
        n_new = int(cu_q[-1])
        rows = torch.repeat_interleave(torch.arange(self.max_batch_size), step)
        src = torch.arange(n_new) - cu_q[rows]
        dst = pre[rows] + src
        self.cu_seqlens_q.copy_(cu_q)
        self.cu_seqlens_kv.copy_(cu_kv)
        self.pre_step_seqlens.copy_(pre)
        device = self.device
        return _StepPlan(
            batch_size=len(step_lens),
            max_step=max(step_lens, default=0),
            max_total=max((p + s for p, s in zip(pre_lens, step_lens, strict=True)), default=0),
            n_new=n_new,
            rows=rows.to(device),
            src=src.to(device),
            dst=dst.to(device),
            step_lens=step.to(device),
            total_lens=(pre + step).to(device),
            start=pre.to(torch.int32),
        )

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """Each sequence's length before the step, int32 [B] on the cache's device (zeros
        past the batch)."""
        return self.pre_step_seqlens

    def start_positions(self, n: int) -> torch.Tensor:
        """RoPE's start positions of the step's first n rows: int32 [n] on the host."""
        plan = self._checked_plan()
        return plan.start[:n]

    def convert_paged_to_nonpaged(self, layer_number: int):
        """Paged caches only: NotImplementedError (torchte has no paged cache)."""
        raise NotImplementedError(
            "InferenceParams.convert_paged_to_nonpaged: the paged KV cache (is_paged=True) is "
            "not implemented in torchte"
        )

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str):
        """Copy a layer's new keys and values into its cache: (k_cache [b, S, hg, dk],
        v_cache [b, S, hg, dv], cu_seqlens_q, cu_seqlens_kv (int32 [B + 1]),
        max_sequence_length, the output format ("bshd", "sbhd_2bshd" or "thd_2bshd"))."""
        b = self._write(layer_number, new_k, new_v, qkv_format)
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        return (
            k_cache[:b],
            v_cache[:b],
            self.cu_seqlens_q,
            self.cu_seqlens_kv,
            self.max_sequence_length,
            self.output_qkv_format,
        )

    def _checked_plan(self) -> _StepPlan:
        if self._plan is None:
            raise ValueError("inference_params: call pre_step(step_dict) before the forward")
        return self._plan

    def _write(self, layer_number, new_k, new_v, qkv_format: str) -> int:
        """Write the new tokens of k and v into layer_number's cache; the batch rows b."""
        if qkv_format not in _FORMATS:
            raise ValueError(f"qkv_format must be one of {_FORMATS}, got {qkv_format!r}")
        if layer_number not in self.cache_manager.cache:
            raise ValueError(
                f"inference_params has no cache for layer_number={layer_number!r}: call "
                "allocate_memory(layer_number) first (te.MultiheadAttention does)"
            )
        plan = self._checked_plan()
        self._set_format(qkv_format)
        b = _check_new(self, plan, new_k, new_v, qkv_format)
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        index = (plan.rows, plan.dst)
        with torch.no_grad():
            for cache, new in ((k_cache, new_k), (v_cache, new_v)):
                cache.index_put_(index, _new_tokens(new, plan, qkv_format))
        return b

    def cached_step(self, layer_number: int, q, k, v, qkv_format: str) -> CachedStep:
        """Write k and v (the step's new tokens) into layer_number's cache, and give the
        attention's inputs over the cache (see CachedStep)."""
        b = self._write(layer_number, k, v, qkv_format)
        plan = self._plan
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        skv = max(plan.max_total, 1)
        if qkv_format == "thd":
            q_bshd = q.new_zeros(b, plan.max_step, *q.shape[1:])
            q_bshd = q_bshd.index_put((plan.rows, plan.src), q[: plan.n_new])
        else:
            q_bshd = q if qkv_format == "bshd" else q.transpose(0, 1)
        sq = q_bshd.shape[1]
        positions_q = torch.arange(sq, device=q.device)
        positions_kv = torch.arange(skv, device=q.device)
        return CachedStep(
            q=q_bshd.transpose(1, 2),
            k=k_cache[:b, :skv].transpose(1, 2),
            v=v_cache[:b, :skv].transpose(1, 2),
            pad_q=positions_q.view(1, sq) >= plan.step_lens[:b].view(b, 1),
            pad_kv=positions_kv.view(1, skv) >= plan.total_lens[:b].view(b, 1),
        )

    def step_output(self, out: torch.Tensor, qkv_format: str, rows: int) -> torch.Tensor:
        """The attention output [b, h, sq, dv] in qkv_format: [sq, b, h dv], [b, sq, h dv] or,
        thd, [rows, h dv] (rows past the new tokens are zeros)."""
        if qkv_format != "thd":
            return from_bhsd(out, qkv_format)
        plan = self._plan
        tokens = out.transpose(1, 2)[plan.rows, plan.src].flatten(1)
        if rows == plan.n_new:
            return tokens
        return torch.cat([tokens, tokens.new_zeros(rows - plan.n_new, tokens.shape[1])])


def _new_tokens(new: torch.Tensor, plan: _StepPlan, qkv_format: str) -> torch.Tensor:
    """The step's new tokens of k or v, (n, hg, d), in the cache's order."""
    if qkv_format == "thd":
        return new[: plan.n_new]
    bshd = new if qkv_format == "bshd" else new.transpose(0, 1)
    return bshd[plan.rows, plan.src]


def _check_new(params: InferenceParams, plan: _StepPlan, k, v, qkv_format: str) -> int:
    """ValueError naming the argument when k, v do not fit the cache or the step; the batch
    rows b of the input (the step's sequences, or up to max_batch_size padded rows)."""
    rank = 3 if qkv_format == "thd" else 4
    for name, x, dim in (("key", k, params.head_dim_k), ("value", v, params.head_dim_v)):
        if x.dim() != rank or x.shape[-2] != params.num_heads_kv or x.shape[-1] != dim:
            raise ValueError(
                f"inference_params: the {name} tensor must be {rank}-D with num_heads_kv="
                f"{params.num_heads_kv} heads of {dim} channels, got {list(x.shape)}"
            )
        if x.dtype != params.dtype or x.device != params.device:
            raise ValueError(
                f"inference_params: the {name} tensor must have the cache's dtype and device "
                f"({params.dtype}, {params.device}), got {x.dtype}, {x.device}"
            )
    if qkv_format == "thd":
        if k.shape[0] < plan.n_new:
            raise ValueError(
                f"inference_params: the thd input has {k.shape[0]} tokens, fewer than the "
                f"{plan.n_new} new tokens of step_dict"
            )
        return plan.batch_size
    b, s = (k.shape[1], k.shape[0]) if qkv_format == "sbhd" else (k.shape[0], k.shape[1])
    if not plan.batch_size <= b <= params.max_batch_size:
        raise ValueError(
            f"inference_params: the input's batch of {b} must hold the step's "
            f"{plan.batch_size} sequences and not exceed max_batch_size={params.max_batch_size}"
        )
    if s < plan.max_step:
        raise ValueError(
            f"inference_params: the input's sequence length {s} is shorter than the step's "
            f"longest, {plan.max_step} new tokens"
        )
    return b
