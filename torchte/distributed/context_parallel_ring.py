"""Ring attention (cp_comm_type "p2p"): each rank keeps its queries and passes its key / value
block around the ring of the context-parallel group; each step's partial output is merged with
the others through their log-sum-exp. The transfer of the next block is posted before the
current block's compute, so the two overlap (NCCL runs point-to-point work on its own stream).

Causal attention on the load-balanced split (see _cp_layout.py) does the same work on every rank
and step: the rank's own block is one causal call over its two chunks; a block from a lower rank
is attended by all local queries, unmasked, over that rank's first chunk; a block from a higher
rank by the local second chunk's queries, unmasked, over both of its chunks.

Backward: the ring run the other way round, starting from the block the forward ended with (kept
from the forward: the next rank's) and ending with the rank's own. Each block's dK / dV (fp32)
travels with it, so the sum is whole where the owner attends its own block last: no transfer
after the last step (the forward's order would need one more hop back to the owner, which
nothing hides), and on two ranks no key / value block moves at all. The partial gradients use
the merged output and log-sum-exp, so they add up to the whole attention's.

The merges run in one Triton launch each on CUDA (kernels/attention_merge.py), in place: the
first block's output stays as its kernel returned it, the last merge writes the layer's output
in its dtype, the ones between accumulate in fp32.

Block kernels: on CUDA in fp16 / bf16 (d == dv, a multiple of 8, at most 256) PyTorch's cuDNN
attention where it applies (_cudnn_ok) and its flash attention otherwise (their forward and
backward ops, which return and take the log-sum-exp); elsewhere, and for thd, an fp32 math
block (scores, log-sum-exp, softmax and the explicit backward formulas). GQA: hg key / value
heads travel, expanded to h for the kernel, their gradient summed back in fp32.

Legend: b batch (1 for thd), s / sk local query / key rows, h query heads, hg key / value heads,
d / dv head sizes; tensors are [b, s, h, d] (bshd; sbhd and thd are brought to it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .. import _collectives as collectives
from ..kernels._triton import triton_available
from ..kernels.attention_merge import merge_into, merge_reference
from ._cp_layout import CPGroup, SeqTables, rank_positions

__all__ = ["RingPlan", "ring_attention"]


@dataclass(frozen=True)
class RingPlan:
    """What the ring needs besides q, k, v: the group, the tables of the query and key rows,
    causal or not, thd or dense, the softmax scale and whether the flash kernels run."""

    cp: CPGroup
    q_tables: SeqTables
    kv_tables: SeqTables
    causal: bool
    packed: bool
    scale: float
    flash: bool


def flash_ok(q: torch.Tensor, dv: int, packed: bool) -> bool:
    """Whether the flash kernels take these blocks: CUDA, fp16 / bf16, d == dv, d % 8 == 0,
    d <= 256, dense formats."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and not packed
        and q.dtype in (torch.float16, torch.bfloat16)
        and d == dv
        and d % 8 == 0
        and d <= 256
    )


def _cudnn_ok(q: torch.Tensor) -> bool:
    """Whether cuDNN's attention kernels (faster than the flash ones on Hopper) take the
    blocks: a GPU of compute capability 9+, head size <= 128, cuDNN attention enabled in
    torch.backends.cuda, and TORCHTE_CP_CUDNN not 0."""
    if os.environ.get("TORCHTE_CP_CUDNN", "1") == "0" or q.shape[-1] > 128:
        return False
    return torch.backends.cuda.cudnn_sdp_enabled() and _capability(q.device)[0] >= 9


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _expand(x: torch.Tensor, h: int) -> torch.Tensor:
    """[b, s, hg, d] -> [b, s, h, d] (each key / value head repeated for its query heads)."""
    hg = x.shape[2]
    return x if hg == h else x.repeat_interleave(h // hg, dim=2)


def _fold(dx: torch.Tensor, hg: int) -> torch.Tensor:
    """[b, s, h, d] gradient of an expanded tensor -> [b, s, hg, d] (summed per group in
    fp32)."""
    b, s, h, d = dx.shape
    return dx if h == hg else dx.view(b, s, hg, h // hg, d).sum(3, dtype=torch.float32)


def _scores(q, k, scale, causal, allowed):
    """fp32 [b, h, sq, sk] scaled scores, -inf where masked (causal: top-left; allowed: bool
    [sq, sk] True where a query may see a key)."""
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    elif causal:
        sq, sk = s.shape[-2:]
        upper = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) with rows that see no key (lse -inf) as zeros."""
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.nan_to_num(p, nan=0.0)


def block_forward(q, k, v, causal, allowed, scale, flash):
    """One block: q [b, sq, h, d], k [b, sk, hg, d], v [b, sk, hg, dv] -> (out [b, sq, h, dv]
    (q's dtype with flash, else fp32), lse fp32 [b, h, sq], the flash kernel's other outputs
    its backward takes (None for the math block))."""
    h = q.shape[2]
    k, v = _expand(k, h), _expand(v, h)
    if flash and _cudnn_ok(q):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal,
            False, scale=scale,
        )  # fmt: skip
        lse = res[1]  # [b, h, sq] or [b, h, sq, 1]: kept as [b, h, sq]
        aux = ("cudnn", res[2], res[3], res[6], res[7], lse.dim())
        return res[0].transpose(1, 2), lse.reshape(lse.shape[:3]), aux
    if flash:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
        )
        # cum_seq_q, cum_seq_k (undefined for dense inputs), philox seed and offset
        return res[0].transpose(1, 2), res[1], ("flash", res[2], res[3], res[6], res[7])
    s = _scores(q, k, scale, causal, allowed)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(_probs(s, lse), v.float().transpose(1, 2))
    return out.transpose(1, 2), lse, None


def block_backward(dout, q, k, v, out, lse, causal, allowed, scale, aux):
    """The gradients of one block given the merged out [b, sq, h, dv] and lse [b, h, sq]:
    (dq [b, sq, h, d], dk [b, sk, hg, d], dv [b, sk, hg, dv]); the flash kernel's when `aux`
    (block_forward's third output) is given (in q's dtype, fp32 where GQA summed heads: the
    ring converts each to its fp32 sums once), else the fp32 math block's."""
    h, hg = q.shape[2], k.shape[2]
    ke, ve = _expand(k, h), _expand(v, h)
    if aux is not None and aux[0] == "cudnn":
        sq, sk = q.shape[1], k.shape[1]
        _, cum_q, cum_k, seed, offset, lse_dim = aux
        stats = lse.contiguous() if lse_dim == 3 else lse.unsqueeze(-1).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2),
            out.transpose(1, 2), stats, seed, offset, None, cum_q, cum_k, sq, sk, 0.0, causal,
            scale=scale,
        )  # fmt: skip
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    elif aux is not None:
        sq, sk = q.shape[1], k.shape[1]
        _, cum_q, cum_k, seed, offset = aux
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            ke.transpose(1, 2),
            ve.transpose(1, 2),
            out.transpose(1, 2),
            lse.contiguous(),
            cum_q,
            cum_k,
            sq,
            sk,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    else:
        p = _probs(_scores(q, ke, scale, causal, allowed), lse)
        do = dout.float().transpose(1, 2)
        dv = torch.matmul(p.transpose(-1, -2), do).transpose(1, 2)
        dp = torch.matmul(do, ve.float().transpose(1, 2).transpose(-1, -2))
        delta = (do * out.float().transpose(1, 2)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, ke.float().transpose(1, 2)).transpose(1, 2)
        dk = torch.matmul(ds.transpose(-1, -2), q.float().transpose(1, 2)).transpose(1, 2)
    return dq, _fold(dk, hg), _fold(dv, hg)


def _rows(x: torch.Tensor, sel) -> torch.Tensor:
    """The rows `sel` (a slice or an index tensor) of x along dim 1."""
    return x[:, sel] if isinstance(sel, slice) else x.index_select(1, sel)


def _add_rows(acc: torch.Tensor, sel, value: torch.Tensor) -> None:
    """acc[:, sel] += value (sel a slice or an index tensor)."""
    if isinstance(sel, slice):
        acc[:, sel] += value
    else:
        acc.index_add_(1, sel, value.to(acc.dtype))


def _sections(plan: RingPlan, source: int):
    """[(query rows, key rows, causal)] of this rank's work on the block of rank `source`:
    None rows mean all rows."""
    cp = plan.cp
    if not plan.causal:
        return [(None, None, False)]
    if source == cp.rank:
        return [(None, None, True)]
    if source < cp.rank:
        return [(None, plan.kv_tables.first, False)]
    return [(plan.q_tables.second, None, False)]


def _allowed(plan: RingPlan, source: int, q_rows, k_rows, device):
    """thd: bool [sq, sk], True where a query sees a key (same sequence, both real tokens, and
    the key not after the query when causal); None for dense formats."""
    if not plan.packed:
        return None
    cp = plan.cp
    seq_q, pos_q, real_q = rank_positions(plan.q_tables, cp.size, cp.rank, device)
    seq_k, pos_k, real_k = rank_positions(plan.kv_tables, cp.size, source, device)
    if q_rows is not None:
        seq_q, pos_q, real_q = (x[q_rows] for x in (seq_q, pos_q, real_q))
    if k_rows is not None:
        seq_k, pos_k, real_k = (x[k_rows] for x in (seq_k, pos_k, real_k))
    ok = (seq_q[:, None] == seq_k[None]) & real_q[:, None] & real_k[None]
    if plan.causal:
        ok &= pos_k[None] <= pos_q[:, None]
    return ok


def _pick(x, rows):
    return x if rows is None else _rows(x, rows)


def _exchange(plan: RingPlan, tensors: list[torch.Tensor], backward: bool = False):
    """Post the send of `tensors` to the next rank and the receive of the previous rank's
    into new buffers (backward: to the previous rank, from the next): (buffers, works)."""
    tensors = [x.contiguous() for x in tensors]  # (a no-op for the ring's own buffers)
    recvs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in tensors]
    cp = plan.cp
    dst, src = (cp.prev_rank, cp.next_rank) if backward else (cp.next_rank, cp.prev_rank)
    works = collectives.send_recv(tensors, recvs, dst, src, cp.group)
    return recvs, works


def _merge(out, lse, rows, o_i, lse_i, last: bool) -> torch.Tensor:
    """Merge a block's (o_i [b, r, h, dv], lse_i [b, h, r]) into the running out [b, s, h, dv]
    and lse [b, h, s] at query rows `rows` (None: all); returns out. The running out is fp32,
    except the first block's output before a second merge: the `last` merge writes into it in
    its own dtype; any other makes it fp32 first. On CUDA, dense rows (None or a slice) merge
    in place in one launch; thd's index rows and the CPU take torch operations."""
    if not last and out.dtype != torch.float32:
        out = out.to(torch.float32, memory_format=torch.contiguous_format)
    if out.is_cuda and triton_available() and not isinstance(rows, torch.Tensor):
        first = 0 if rows is None else rows.start
        merge_into(out, lse, first, o_i, lse_i)
        return out
    if out.dtype != torch.float32:
        out = out.float()
    cur_o = out if rows is None else _rows(out, rows)
    cur_l = lse if rows is None else _lse_rows(lse, rows)
    merged, new_l = merge_reference(cur_o, cur_l, o_i, lse_i)
    if rows is None:
        out.copy_(merged)
        lse.copy_(new_l)
    elif isinstance(rows, slice):
        out[:, rows] = merged
        lse[:, :, rows] = new_l
    else:
        out.index_copy_(1, rows, merged)
        lse.index_copy_(2, rows, new_l)
    return out


def _ring_forward(q, k, v, plan: RingPlan):
    """(out [b, s, h, dv] (fp32, or q's dtype where the last merge wrote it), lse fp32
    [b, h, s], the flash kernels' aux or None, the key / value block of the last step: the next
    rank's) of the whole ring."""
    cp = plan.cp
    out = lse = None  # the first block (the rank's own, every query row) starts them
    kv, aux = [k, v], None
    for step in range(cp.size):
        source = (cp.rank - step) % cp.size
        works = None
        if step < cp.size - 1:
            nxt, works = _exchange(plan, kv)
        for q_rows, k_rows, causal in _sections(plan, source):
            allowed = _allowed(plan, source, q_rows, k_rows, q.device)
            o_i, lse_i, aux = block_forward(
                _pick(q, q_rows),
                _pick(kv[0], k_rows),
                _pick(kv[1], k_rows),
                causal,
                allowed,
                plan.scale,
                plan.flash,
            )
            if step == 0:  # the first block covers every query row
                out, lse = o_i, lse_i.float()
            else:
                out = _merge(out, lse, q_rows, o_i, lse_i, last=step == cp.size - 1)
        collectives.wait_all(works)
        if works is not None:
            kv = nxt
    return out, lse, aux, kv


def _ring_backward(dout, q, k, v, out, lse, last_kv, plan: RingPlan, aux):
    """(dq, dk, dv) of the ring (dq fp32, dk / dv in k's dtype): step t attends the block of
    rank + 1 + t, from last_kv (the forward's last block) to the rank's own; key / value blocks
    and their fp32 gradient sums travel to the previous rank."""
    cp = plan.cp
    dq = None
    kv, dkv, dkv_works = list(last_kv), None, None
    for step in range(cp.size):
        source = (cp.rank + 1 + step) % cp.size  # the last step: the rank's own block
        kv_works = None
        if step < cp.size - 2:  # the next block but the own one, which is here
            nxt, kv_works = _exchange(plan, kv, backward=True)
        part = dkv  # the sums so far of this block's dK / dV (None on the first step)
        last = step == cp.size - 1  # the own block: one section of every row
        for q_rows, k_rows, causal in _sections(plan, source):
            allowed = _allowed(plan, source, q_rows, k_rows, q.device)
            dq_i, dk_i, dv_i = block_backward(
                _pick(dout, q_rows),
                _pick(q, q_rows),
                _pick(kv[0], k_rows),
                _pick(kv[1], k_rows),
                _pick(out, q_rows),
                lse if q_rows is None else _lse_rows(lse, q_rows),
                causal,
                allowed,
                plan.scale,
                aux,
            )
            dq = _accumulate(dq, q_rows, dq_i, q.shape)
            collectives.wait_all(dkv_works)  # (queued after this block's kernels)
            dkv_works = None
            if last and part is not None:  # the whole sums, added and cast in one pass
                part = [
                    torch.add(acc, d, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
                    for acc, d, x in zip(part, (dk_i, dv_i), (k, v), strict=True)
                ]
            else:
                part = [
                    _accumulate(acc, k_rows, d, x.shape)
                    for acc, d, x in zip(part or (None, None), (dk_i, dv_i), kv, strict=True)
                ]
        if not last:
            dkv, dkv_works = _exchange(plan, part, backward=True)
        collectives.wait_all(kv_works)
        if kv_works is not None:
            kv = nxt
        elif step == cp.size - 2:
            kv = [k, v]
    return dq, part[0].to(k.dtype), part[1].to(v.dtype)


def _lse_rows(lse: torch.Tensor, rows) -> torch.Tensor:
    return lse[:, :, rows] if isinstance(rows, slice) else lse.index_select(2, rows)


def _accumulate(acc: torch.Tensor | None, rows, value: torch.Tensor, shape) -> torch.Tensor:
    """acc (fp32 of `shape`, None before the first value) with value added at `rows` (None:
    all rows, value then whole)."""
    if acc is None:
        if rows is None:  # contiguous: the sums are sent to the next rank
            return value.to(torch.float32, memory_format=torch.contiguous_format)
        acc = torch.zeros(shape, dtype=torch.float32, device=value.device)
    if rows is None:
        acc += value
    else:
        _add_rows(acc, rows, value)
    return acc


class _RingAttention(torch.autograd.Function):
    """q [b, s, h, d], k [b, sk, hg, d], v [b, sk, hg, dv] -> out [b, s, h, dv] in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        out, lse, aux, last_kv = _ring_forward(q, k, v, plan)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *last_kv)
        ctx.plan, ctx.aux = plan, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *last_kv = ctx.saved_tensors
        dq, dk, dv = _ring_backward(
            dout.contiguous(), q, k, v, out, lse, last_kv, ctx.plan, ctx.aux
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q, k, v, plan: RingPlan) -> torch.Tensor:
    """Ring attention over the plan's group: q [b, s, h, d], k [b, sk, hg, d],
    v [b, sk, hg, dv] (this rank's load-balanced rows) -> [b, s, h, dv] in q's dtype."""
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), plan)
