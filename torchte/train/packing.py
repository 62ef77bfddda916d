"""Packed batches (--packed): several documents back to back in each sequence row, attention kept
within each document (te attention's qkv_format "thd") and positions counted from each
document's first token.

Legend: B rows, S sequence length, T = B S tokens, D documents in the batch. doc_starts (B, S)
bool is True where a document starts; column 0 always is (a row never continues the previous
one). The tokens of a batch are its rows flattened in order, so document d covers tokens
cu_seqlens[d] to cu_seqlens[d + 1].

Under sequence parallelism each tensor-parallel rank holds its rows of the batch, while
attention runs over the rows of every rank (gathered in rank order): the cu_seqlens that
attention takes are those of the gathered rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["cu_seqlens", "positions"]


def positions(doc_starts_BS: torch.Tensor) -> torch.Tensor:
    """int64 (B, S): each token's position in its document (0 at every document start)."""
    index_BS = torch.arange(doc_starts_BS.shape[1], device=doc_starts_BS.device)
    index_BS = index_BS.expand_as(doc_starts_BS)
    start_BS = torch.where(doc_starts_BS, index_BS, 0).cummax(dim=1).values
    return index_BS - start_BS


def cu_seqlens(doc_starts_BS: torch.Tensor, group=None) -> torch.Tensor:
    """int32 (D + 1,): the documents' token offsets in the flattened batch, then T. With a
    process group (sequence parallelism), those of every rank's rows gathered in rank order."""
    if group is not None and dist.get_world_size(group) > 1:
        mine = doc_starts_BS.to(torch.uint8)  # gloo gathers no bool tensors
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine, group=group)
        doc_starts_BS = torch.cat(parts).bool()
    flat_T = doc_starts_BS.reshape(-1)
    starts_D = flat_T.nonzero().squeeze(1)
    end = torch.tensor([flat_T.numel()], device=flat_T.device)
    return torch.cat([starts_D, end]).to(torch.int32)
