"""Attention sinks: Transformer Engine's softmax_type "off-by-one" and "learnable".

A sink is one more logit per head that every query row sees and whose probability is dropped:

    p_ij = exp(s_ij) / (exp(a_h) + sum_k exp(s_ik))      (s = scaled, masked scores)

with a_h = 0 for "off-by-one" (1 added to the denominator) and the learnable per-head parameter
`softmax_offset` for "learnable". A row that sees no key gives zeros, as without a sink.

Two ways to compute it, both exact (legend: h heads, sq queries, skv keys, dv value channels):
- the math backends put the sink into the softmax's denominator (`sink_softmax`);
- a backend that returns the logsumexp L_i = log sum_k exp(s_ik) of each row next to its
  vanilla output o_i rescales that output (`rescale_by_sink`):
      out_i = o_i * exp(L_i) / (exp(L_i) + exp(a_h)) = o_i * sigmoid(L_i - a_h).
  Differentiating through o_i and L_i (flex_attention does) gives the exact gradients of q, k,
  v and of a_h: d a_h = -sum_i (dout_i . out_i) * (1 - sigmoid(L_i - a_h)), the sink's
  probability times the usual softmax term, summed over every row of the head.
"""

from __future__ import annotations

import torch

__all__ = ["SOFTMAX_TYPES", "rescale_by_sink", "sink_softmax"]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax of scores (fp32 [..., skv], -inf where masked) with one more logit `sink` (fp32,
    broadcastable to scores[..., :1]) in the denominator -> probabilities like scores.

    The row maximum that keeps exp in range includes the sink and is detached: the result does
    not depend on it, so the gradients (of scores and of sink) are exact."""
    if scores.shape[-1] == 0:
        return scores
    row_max = torch.maximum(scores.detach().amax(dim=-1, keepdim=True), sink.detach())
    exp_scores = torch.exp(scores - row_max)
    denominator = exp_scores.sum(dim=-1, keepdim=True) + torch.exp(sink - row_max)
    return exp_scores / denominator


def rescale_by_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Vanilla attention output out [..., sq, dv] and its rows' logsumexp lse [..., sq] (natural
    log; -inf for a row that sees no key) -> the output with the sink, in out's dtype.
    sink: fp32, broadcastable to lse."""
    weight = torch.sigmoid(lse.float() - sink)
    return (out.float() * weight.unsqueeze(-1)).to(out.dtype)
