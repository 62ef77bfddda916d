"""The flex and varlen backends of packed (thd) attention, on PyTorch's own attention kernels.

Shape legend: t query tokens, s key/value tokens, h query heads, hg key/value heads,
d query/key head size, dv value head size.

- flex: torch.nn.attention.flex_attention with a block mask built from the pack's layout
  (document mask plus the causal/window rule of packed_math.allowed). Compiled on CUDA; on the
  CPU it runs flex's unfused eager implementation (materializes the scores; for testing).
- varlen: torch.nn.attention.varlen.varlen_attn (flash attention with cumulative sequence
  offsets), CUDA only, fp16/bf16. Its causal and window diagonals are bottom-right aligned and
  it has no padding between sequences, so packed.py only picks it where that matches.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

from torchte.attention._flex import flex_function, lse_request, split_lse
from torchte.attention._sinks import rescale_by_sink
from torchte.attention.packed_math import MaskSpec, PackedLayout, allowed

__all__ = [
    "build_block_mask",
    "flex_packed",
    "varlen_features",
    "varlen_packed",
    "varlen_window_ok",
]


@functools.cache
def varlen_features() -> frozenset[str] | None:
    """Keyword arguments of this torch's public varlen_attn, or None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_window_ok(spec: MaskSpec) -> bool:
    """Whether this torch's varlen_attn takes the window: any window where it has a
    `window_size` argument, else (older torch, `is_causal` only) no window or plain causal."""
    features = varlen_features() or frozenset()
    if "window_size" in features:
        return True
    return (spec.left, spec.right) in ((-1, -1), (-1, 0)) and "is_causal" in features


def build_block_mask(layout: PackedLayout, spec: MaskSpec, t: int, s: int, device: torch.device):
    """flex BlockMask of the pack: query i sees key j iff packed_math.allowed says so."""
    from torch.nn.attention.flex_attention import create_block_mask

    seq_q, pos_q, off_q = layout.seq_q, layout.pos_q, layout.off_q
    seq_kv, pos_kv = layout.seq_kv, layout.pos_kv

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(
            seq_q[q_idx], pos_q[q_idx], off_q[q_idx], seq_kv[kv_idx], pos_kv[kv_idx], spec
        )

    return create_block_mask(mask_mod, None, None, t, s, device=device)


def flex_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask,
    scale: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed attention through flex_attention; with sink (fp32 (h,) logits), its output
    rescaled by its logsumexp (_sinks.rescale_by_sink).

    q (t, h, d), k (s, hg, d), v (s, hg, dv); returns (t, h, dv) contiguous, q's dtype.
    """
    fn = flex_function(q.device.type)
    if not torch.is_grad_enabled():  # flex refuses inputs that require grad on the CPU
        q, k, v = q.detach(), k.detach(), v.detach()
    q_bhtd, k_bhsd, v_bhsd = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    extra = {} if sink is None else lse_request()
    with warnings.catch_warnings():
        # The CPU (eager) path warns that it is unfused; that is what it is for here.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(
            q_bhtd, k_bhsd, v_bhsd, block_mask=block_mask, scale=scale, enable_gqa=gqa, **extra
        )
    if sink is not None:
        out, lse = split_lse(out)
        out = rescale_by_sink(out, lse, sink.view(1, -1, 1))
    return out[0].transpose(0, 1).contiguous()


def varlen_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    max_q: int,
    max_kv: int,
    spec: MaskSpec,
    scale: float,
) -> torch.Tensor:
    """Packed attention through varlen_attn (bottom-right diagonal, no padding between
    sequences). q (t, h, d), k (s, hg, d), v (s, hg, dv); returns (t, h, dv), q's dtype."""
    from torch.nn.attention.varlen import varlen_attn

    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in varlen_features():
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    window = (spec.left, spec.right)
    if "window_size" in varlen_features():
        kwargs["window_size"] = window
    elif window != (-1, -1):
        kwargs["is_causal"] = True  # varlen_window_ok() let only (-1, 0) through
    if "scale" in varlen_features():
        kwargs["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)  # older torch: only the 1/sqrt(d) default
    return varlen_attn(q, k, v, cu_q, cu_kv, max_q, max_kv, **kwargs)
