"""The torch references of the token-permutation launchers (kernels/permutation.py runs them
on the CPU and the tests hold the Triton kernels to them): the same functions in torch ops,
the same bytes. Conventions: kernels/permutation.py's module doc."""

from __future__ import annotations

import torch

__all__ = [
    "permute_rows_reference",
    "routes_of",
    "tokens_of",
    "unpermute_rows_backward_reference",
    "unpermute_rows_reference",
]


def routes_of(row_id_map: torch.Tensor, index_topk: int) -> int:
    """E of a mask map (N, 2E+1), or K of an index map."""
    return index_topk if index_topk else (row_id_map.shape[1] - 1) // 2


def tokens_of(row_id_map: torch.Tensor, index_topk: int) -> int:
    """N of a mask map (N, 2E+1), or of an index map (K N,)."""
    return row_id_map.numel() // index_topk if index_topk else row_id_map.shape[0]


def _kept(
    rows: torch.Tensor, routed: torch.Tensor, limit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, index), like rows: the routes whose row is in [0, limit), and their rows with
    `limit` (an extra row, cut off or zero) for the others."""
    keep = routed & (rows >= 0) & (rows < limit)
    return keep, torch.where(keep, rows, limit)


# ----------------------------------------------------------------------------------------------
# Torch references: the same functions, used on CPU and in tests
# ----------------------------------------------------------------------------------------------


def _routes_reference(
    row_id_map: torch.Tensor, n: int, index_topk: int, pad_offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, experts, routed), (N, slots) each, slots in the kernels' route order: the row of
    each route (padding added; int64), its expert (or k; 0 where unrouted), whether it is one
    of the token's routes."""
    if index_topk:
        rows = row_id_map.reshape(index_topk, n).t().long()
        experts = torch.arange(index_topk, device=rows.device).expand(n, index_topk)
        return rows, experts, torch.ones_like(rows, dtype=torch.bool)
    e = (row_id_map.shape[1] - 1) // 2
    slots = e
    if n and not (row_id_map.is_meta or _is_fake(row_id_map)):
        slots = int(row_id_map[:, 2 * e].max())  # no slot past the most routes holds one
    rows = row_id_map[:, :slots].long()
    experts = row_id_map[:, e : e + slots].long().clamp(min=0)
    routed = torch.arange(slots, device=rows.device) < row_id_map[:, 2 * e :]
    if pad_offsets is not None:
        rows = torch.where(routed, rows + pad_offsets.long()[experts], rows)
    return rows, experts, routed


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """What sums run in: fp64 for fp64 rows, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def permute_rows_reference(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    num_out_tokens: int,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of permute_rows (row_counts is not needed: every row starts at zero).
    Shapes never depend on values (it is also the fake of the op under torch.compile): a
    dropped route writes an extra row at the end, cut off."""
    n, h = inp.shape
    rows, experts, routed = _routes_reference(row_id_map, n, index_topk, pad_offsets)
    dst = _kept(rows, routed, num_out_tokens)[1].reshape(-1)
    values = inp[:, None, :].expand(n, rows.shape[1], h)
    out_probs = None
    if probs is not None:
        token = torch.arange(n, device=inp.device)[:, None]
        p = probs[token, experts]
        out_probs = probs.new_zeros((num_out_tokens + 1,))
        out_probs[dst] = p.reshape(-1)
        out_probs = out_probs[:num_out_tokens]
        if not index_topk:
            values = torch.where((p == 0)[:, :, None], torch.zeros_like(values), values)
    out = inp.new_zeros((num_out_tokens + 1, h))
    out[dst] = values.reshape(-1, h)
    return out[:num_out_tokens], out_probs


def unpermute_rows_reference(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None,
    permuted_probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of unpermute_rows: routes added in the kernel's order, in fp32."""
    r_rows, h = inp.shape
    n = tokens_of(row_id_map, index_topk)
    rows, experts, routed = _routes_reference(row_id_map, n, index_topk, pad_offsets)
    keep, src = _kept(rows, routed, r_rows)  # r_rows: an appended zero row
    x = torch.cat([inp, inp.new_zeros((1, h))])
    token = torch.arange(n, device=inp.device)
    if index_topk == 1 and merging_probs is None:
        out = x[src[:, 0]]
    else:
        acc_dtype = _acc_dtype(inp)
        acc = torch.zeros((n, h), dtype=acc_dtype, device=inp.device)
        for j in range(rows.shape[1]):
            v = x[src[:, j]].to(acc_dtype)
            if merging_probs is not None:
                p = merging_probs[token, experts[:, j]].to(acc_dtype)
                v = torch.where(keep[:, j, None], v * p[:, None], 0.0)
            acc = acc + v
        out = acc.to(inp.dtype)
    unpermuted = None
    if permuted_probs is not None:
        pp = torch.cat([permuted_probs.reshape(-1), permuted_probs.new_zeros(1)])
        unpermuted = _per_route(pp[src], experts, routed, routes_of(row_id_map, index_topk))
    return out, unpermuted


def _per_route(
    values: torch.Tensor, experts: torch.Tensor, routed: torch.Tensor, routes: int
) -> torch.Tensor:
    """(N, routes): values (N, slots) put at their routes' experts (or k), zero elsewhere."""
    n = values.shape[0]
    out = values.new_zeros((n, routes + 1))
    out.scatter_(1, torch.where(routed, experts, routes), values)  # unrouted: a cut column
    return out[:, :routes]


def unpermute_rows_backward_reference(
    grad: torch.Tensor,
    row_id_map: torch.Tensor,
    fwd_input: torch.Tensor,
    merging_probs: torch.Tensor,
    pad_offsets: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    index_topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of unpermute_rows_backward (row_counts is not needed)."""
    n, h = grad.shape
    r_rows = fwd_input.shape[0]
    rows, experts, routed = _routes_reference(row_id_map, n, index_topk, pad_offsets)
    keep, src = _kept(rows, routed, r_rows)  # r_rows: an extra row, zero in x, cut from d_input
    acc_dtype = _acc_dtype(grad)
    g = grad.to(acc_dtype)[:, None, :]
    token = torch.arange(n, device=grad.device)[:, None]
    p = merging_probs[token, experts].to(acc_dtype)
    d_input = grad.new_zeros((r_rows + 1, h))
    d_input[src.reshape(-1)] = (g * p[:, :, None]).to(grad.dtype).reshape(-1, h)
    x = torch.cat([fwd_input, fwd_input.new_zeros((1, h))])
    dots = torch.where(keep, (x[src].to(acc_dtype) * g).sum(-1), 0.0)
    routes = routes_of(row_id_map, index_topk)
    d_probs = _per_route(dots.to(merging_probs.dtype), experts, routed, routes)
    return d_input[:r_rows], d_probs
