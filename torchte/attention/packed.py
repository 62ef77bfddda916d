"""Packed variable-length attention: Transformer Engine's qkv_format "thd".

Shape legend: t query tokens, s key/value tokens, h query heads, hg key/value heads (GQA:
h % hg == 0), d query/key head size, dv value head size, b sequences.

Sequence i holds cu_seqlens[i+1] - cu_seqlens[i] real tokens starting at row
cu_seqlens_padded[i] of the tensor (at cu_seqlens[i] without padded offsets); rows from there to
cu_seqlens_padded[i+1] are padding between sequences, whose output and gradient are 0.
No token attends across a sequence boundary.

Host reads: checking the cu_seqlens values needs them on the host. CPU tensors cost nothing.
CUDA tensors are read back with one copy per call at most (all four in one), and the copy is
kept while those very tensors live unmodified, so the layers of a model that share one
cu_seqlens tensor sync once per step, not once per layer. That read also supplies
max_seqlen_q/kv when they are not given; giving them saves the max, not the read. Under CUDA
graph capture nothing is read back: values are not checked, and max_seqlen_q/kv must be given
where the varlen backend needs them.

Backends, chosen once per call signature (device, dtype, mask, padding, dropout, head sizes),
or forced by `backend=` or the TORCHTE_ATTN_BACKEND environment variable ("auto" and "sdpa"
leave the choice here):
"varlen" (torch's varlen_attn, CUDA fp16/bf16), "flex" (flex_attention with a document block
mask, CUDA compiled, CPU eager) and "math" (fp32 softmax, runs everywhere; the CPU default).
Attention sinks (`softmax_offset`, see _sinks.py) run on flex (its output rescaled by its
logsumexp) or math (the sink in the softmax's denominator), not on varlen.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch

from torchte.attention import packed_kernels as kernels
from torchte.attention.packed_math import MaskSpec, PackedLayout, dense_attention, loop_attention

__all__ = ["BACKENDS", "check_cu_seqlens", "packed_attention"]

BACKENDS = ("flex", "varlen", "math")
ENV_BACKEND = "TORCHTE_ATTN_BACKEND"
# TORCHTE_ATTN_BACKEND values that leave the choice here: "sdpa" names a backend of the
# padded formats (attention/backends.py), which has no packed form.
_ENV_AUTO = ("", "auto", "sdpa")
_DENSE_LIMIT = 1 << 22  # h * t * s scores above which the math backend loops per sequence
_CACHE_SIZE = 8


class _IdentityCache:
    """Values derived from tensors, valid while those very tensors live with unchanged
    `_version`; keyed by identity so that looking up costs no device work."""

    def __init__(self, size: int) -> None:
        self._entries: OrderedDict = OrderedDict()
        self._size = size

    @staticmethod
    def _stamp(tensors):
        return tuple(None if x is None else x._version for x in tensors)

    def get(self, tensors, extra=None):
        """The value stored for these tensors (and `extra`), or None."""
        entry = self._entries.get((tuple(map(id, tensors)), extra))
        if entry is None:
            return None
        refs, stamp, value = entry
        alive = all(
            (r is None and x is None) or (r is not None and r() is x)
            for r, x in zip(refs, tensors, strict=True)
        )
        return value if alive and stamp == self._stamp(tensors) else None

    def put(self, tensors, value, extra=None) -> None:
        """Store `value` for these tensors (and `extra`), dropping the oldest entry if full."""
        refs = tuple(None if x is None else weakref.ref(x) for x in tensors)
        self._entries[(tuple(map(id, tensors)), extra)] = (refs, self._stamp(tensors), value)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)


_HOST_VALUES = _IdentityCache(_CACHE_SIZE)
_BLOCK_MASKS = _IdentityCache(_CACHE_SIZE)
_CHOSEN: dict[tuple, str] = {}


def _check_cu_meta(cu: torch.Tensor, name: str, device: torch.device | None = None) -> None:
    """dtype, rank and device of one cumulative-offsets tensor; no device work."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must have shape (batch_size + 1,), got {tuple(cu.shape)}")
    if device is not None and cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, but the queries are on {device}")


def _check_offsets(values: list[int], tokens: int, name: str) -> None:
    """Cumulative offsets start at 0, never decrease and end at `tokens`."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i + 1}] = {values[i + 1]} "
                f"< {name}[{i}] = {values[i]}"
            )
    if values[-1] != tokens:
        raise ValueError(f"{name} must end at the token count {tokens}, got {values[-1]}")


def _check_padded(values: list[int], padded: list[int], name: str, pad_name: str) -> None:
    """Real lengths fit in the padded slots: cu[i+1] - cu[i] <= padded[i+1] - padded[i]."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for i in range(len(values) - 1):
        real, slot = values[i + 1] - values[i], padded[i + 1] - padded[i]
        if real < 0:
            raise ValueError(f"{name} must be non-decreasing, but sequence {i} has length {real}")
        if real > slot:
            raise ValueError(
                f"sequence {i} has {real} tokens by {name} but only {slot} rows by {pad_name}"
            )


def _host_values(tensors: tuple) -> list[list[int]] | None:
    """Host copies of the given (b+1,) tensors (None entries skipped), one read for all;
    None under CUDA graph capture, where reading back is not allowed."""
    cached = _HOST_VALUES.get(tensors)
    if cached is not None:
        return cached
    present = [x for x in tensors if x is not None]
    if present[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    flat = torch.cat(present).tolist()
    n = present[0].numel()
    values = [flat[i * n : (i + 1) * n] for i in range(len(present))]
    _HOST_VALUES.put(tensors, values)
    return values


def check_cu_seqlens(cu_seqlens: torch.Tensor, tokens: int, name: str) -> None:
    """Raise ValueError naming `name` unless `cu_seqlens` is an int32 (b+1,) tensor of
    cumulative offsets that starts at 0, never decreases and ends at `tokens`.

    Reads the values back once (cached while this tensor lives unchanged); a no-op for the
    values under CUDA graph capture.
    """
    _check_cu_meta(cu_seqlens, name)
    values = _host_values((cu_seqlens,))
    if values is not None:
        _check_offsets(values[0], tokens, name)


def _check_inputs(q, k, v, window, scale, dropout_p) -> None:
    """Shapes, dtypes and devices of q (t, h, d), k (s, hg, d), v (s, hg, dv); the options."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D (tokens, heads, head_dim) tensor for thd")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k and v must share one dtype and one device")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in tokens or heads")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head size {q.shape[2]} != k head size {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"k heads ({k.shape[1]}) must divide q heads ({q.shape[1]})")
    if (
        not isinstance(window, tuple | list)
        or len(window) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window)
    ):
        raise ValueError(f"window must be a (left, right) pair of ints >= -1, got {window!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not isinstance(scale, int | float):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")


def _unsupported(name: str, sig: tuple) -> str | None:
    """Why backend `name` cannot run signature `sig`, or None if it can."""
    device_type, dtype, spec, padded, dropout, same_cu, d, dv, needs_grad, sink = sig
    if name == "math":
        return None
    if dropout:
        return "dropout_p > 0"
    if sink and name == "varlen":
        return "attention sinks (softmax_offset)"
    if name == "flex":
        if device_type != "cuda" and needs_grad:
            return "backward off CUDA (flex_attention has no CPU backward)"
        if device_type == "cuda" and dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype} on CUDA"
        return None
    if device_type != "cuda" or kernels.varlen_features() is None:
        return "this device or torch (varlen_attn needs CUDA and torch.nn.attention.varlen)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (varlen takes float16 and bfloat16)"
    if padded:
        return "padding between sequences (cu_seqlens_*_padded)"
    if d != dv or d % 8 != 0 or d > 256:
        return f"head sizes d={d}, dv={dv} (varlen takes d == dv, a multiple of 8, <= 256)"
    masked = spec.causal or (spec.left, spec.right) != (-1, -1)
    if masked and not spec.bottom_right and not same_cu:
        return "top-left alignment with distinct cu_seqlens_q and cu_seqlens_kv"
    if not kernels.varlen_window_ok(spec):
        return f"window {(spec.left, spec.right)} with this torch's varlen_attn"
    return None


def _choose(forced: str | None, source: str, sig: tuple) -> str:
    """The backend for `sig`: the forced one (NotImplementedError if it cannot run it), else
    the first of varlen, flex, math on CUDA, and math elsewhere; cached per signature."""
    key = (forced, *sig)
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        return chosen
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"{source} must be one of {BACKENDS}, got {forced!r}")
        reason = _unsupported(forced, sig)
        if reason is not None:
            raise NotImplementedError(
                f"packed attention backend {forced!r} (from {source}) does not support {reason}"
            )
        chosen = forced
    else:
        order = ("varlen", "flex", "math") if sig[0] == "cuda" else ("math",)
        chosen = next(n for n in order if _unsupported(n, sig) is None)
    _CHOSEN[key] = chosen
    return chosen


def _checked_host(q, k, cu_q, cu_kv, pad_q, pad_kv):
    """Check every offsets tensor; return host (cu_q, cu_kv, starts_q, starts_kv) lists, or
    None under CUDA graph capture (metadata still checked, values not)."""
    names = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    tensors = (cu_q, cu_kv, pad_q, pad_kv)
    for name, cu in zip(names, tensors, strict=True):
        if cu is not None:
            _check_cu_meta(cu, name, q.device)
            if cu.numel() != cu_q.numel():
                raise ValueError(f"{name} has {cu.numel()} entries, cu_seqlens_q {cu_q.numel()}")
    values = _host_values(tensors)
    if values is None:
        return None
    it = iter(values)
    host = {name: next(it) for name, cu in zip(names, tensors, strict=True) if cu is not None}
    starts = []
    for real, padded, tokens in (
        (names[0], names[2], q.shape[0]),
        (names[1], names[3], k.shape[0]),
    ):
        if padded in host:
            _check_offsets(host[padded], tokens, padded)
            _check_padded(host[real], host[padded], real, padded)
            starts.append(host[padded])
        else:
            _check_offsets(host[real], tokens, real)
            starts.append(host[real])
    return host[names[0]], host[names[1]], starts[0], starts[1]


def _max_len(host, index: int, given: int | None, name: str) -> int:
    """max_seqlen given, else the longest sequence of host[index]; ValueError if neither."""
    if given is not None:
        return int(given)
    if host is None:
        raise ValueError(f"{name} must be given under CUDA graph capture (no host reads)")
    cu = host[index]
    return max((cu[i + 1] - cu[i] for i in range(len(cu) - 1)), default=0)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_kv: int | None,
    *,
    causal: bool,
    bottom_right: bool,
    window: tuple[int, int],
    scale: float,
    dropout_p: float = 0.0,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    backend: str | None = None,
    softmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T) v within each packed sequence (qkv_format "thd").

    q (t, h, d), k (s, hg, d), v (s, hg, dv), h % hg == 0; cu_seqlens_* int32 (b+1,).
    `causal` masks keys after the query's diagonal, aligned to the top-left corner of each
    sequence's (len_q, len_kv) score matrix, or to its bottom-right one if `bottom_right`;
    `window` (left, right), -1 unbounded, keeps keys within [diag - left, diag + right] of
    the same diagonal (right is 0 when causal). softmax_offset: fp32 (h,) sink logits, one more
    term exp(softmax_offset[h]) in each softmax denominator of head h (None: none). Returns
    (t, h, dv) in q's dtype; rows in the padding between sequences, and queries that see no
    key, are 0.
    """
    _check_inputs(q, k, v, window, scale, dropout_p)
    sink = _check_sink(softmax_offset, q)
    host = _checked_host(
        q, k, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded
    )
    spec = MaskSpec(bool(causal), bool(bottom_right), window[0], 0 if causal else window[1])
    padded = any(
        p is not None and p is not c
        for p, c in ((cu_seqlens_q_padded, cu_seqlens_q), (cu_seqlens_kv_padded, cu_seqlens_kv))
    )
    same_cu = cu_seqlens_q is cu_seqlens_kv and cu_seqlens_q_padded is cu_seqlens_kv_padded
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, sink)
    )
    sig = (q.device.type, q.dtype, spec, padded, dropout_p > 0, same_cu, *q.shape[2:], v.shape[2])
    sig = (*sig, needs_grad, sink is not None)
    forced, source = backend, "backend"
    env = os.environ.get(ENV_BACKEND, "auto")
    if forced is None and env not in _ENV_AUTO:
        forced, source = env, ENV_BACKEND
    name = _choose(forced, source, sig)
    if q.shape[0] == 0 or k.shape[0] == 0:
        name = "math"  # nothing to attend: the dense path gives zeros of the right shape
    if name == "varlen":
        max_q = _max_len(host, 0, max_seqlen_q, "max_seqlen_q")
        max_kv = _max_len(host, 1, max_seqlen_kv, "max_seqlen_kv")
        return kernels.varlen_packed(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, max_q, max_kv, spec, float(scale)
        )
    if name == "math" and host is not None and q.shape[1] * q.shape[0] * k.shape[0] > _DENSE_LIMIT:
        return loop_attention(q, k, v, host, spec, float(scale), dropout_p, sink)
    tensors = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    layout = PackedLayout.build(
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded,
        q.shape[0],
        k.shape[0],
        spec.bottom_right,
    )
    if name == "math":
        return dense_attention(q, k, v, layout, spec, float(scale), dropout_p, sink)
    extra = (spec, q.shape[0], k.shape[0])
    block_mask = _BLOCK_MASKS.get(tensors, extra)
    if block_mask is None:
        block_mask = kernels.build_block_mask(layout, spec, q.shape[0], k.shape[0], q.device)
        _BLOCK_MASKS.put(tensors, block_mask, extra)
    return kernels.flex_packed(q, k, v, block_mask, float(scale), sink)


def _check_sink(softmax_offset: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """softmax_offset as fp32 (h,), after checking its shape and device against q (t, h, d)."""
    if softmax_offset is None:
        return None
    if not isinstance(softmax_offset, torch.Tensor) or softmax_offset.shape != (q.shape[1],):
        got = getattr(softmax_offset, "shape", type(softmax_offset).__name__)
        raise ValueError(f"softmax_offset must be a tensor ({q.shape[1]},) of q's heads, got {got}")
    if softmax_offset.device != q.device:
        raise ValueError(f"softmax_offset is on {softmax_offset.device}, q on {q.device}")
    return softmax_offset.float()
