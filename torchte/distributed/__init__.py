"""te.distributed: Transformer Engine's distributed helpers, on torch.distributed.

- `checkpoint`: activation recompute under the forward's FP8 settings and scales
  (torchte/recompute.py; also `te.checkpoint`), with Transformer Engine's recompute flags
  (`activation_recompute_forward`, `is_fp8_activation_recompute_enabled`,
  `in_fp8_activation_recompute_phase`) for clients that recompute by themselves.
- `CudaRNGStatesTracker`: named RNG states (Megatron-Core's model-parallel RNG), forked for
  initialization and dropout inside tensor-parallel regions, replayed by `checkpoint`;
  `get_all_rng_states()`: the states of the tracker last added to or set (rng.py).
- `gather_along_first_dim`, `reduce_scatter_along_first_dim`, `allreduce`: the collectives of
  tensor and sequence parallelism, with Transformer Engine's arguments, each returning
  (output, handle); the handle is None unless async_op. Every collective of torchte goes
  through torchte/_collectives.py, which imports nothing of torchte: NCCL gets torch's tensor
  collectives, other backends (gloo) one fallback. The gather (gather.py) moves FP8 bytes for
  torchte's FP8 values and per-tensor quantizers.
- `use_symmetric_memory`, `all_gather_matmul`, `matmul_reduce_scatter`: the GEMMs that follow
  an all-gather or precede a reduce-scatter (sequence parallelism), fused with them through
  torch's symmetric memory when switched on (symmetric_memory.py).
- `ExpertParallel`, `DispatchPlan`, `exchange_counts`, `dispatch`, `combine`, `pad_rows`,
  `unpad_rows`, `all_to_all_split`: expert parallelism's token dispatch and combine (the
  all-to-alls with host split sizes, differentiable; expert_parallel.py), used by
  te.moe.MoELayer(ep_group=...).
- `overlap_tp_comm`: the sequence-parallel GEMMs of te.Linear / LayerNormLinear /
  LayerNormMLP run with their all-gather or reduce-scatter under them (on by default;
  overlap.py).
- `split_for_cp_rank`, `gather_from_cp_ranks`, `get_batch_on_this_cp_rank`: context
  parallelism's load-balanced split of whole sequences (chunks r and 2 cp - 1 - r of 2 cp) and
  its inverse; te.DotProductAttention(cp_group=...) attends over the split (p2p ring,
  all_gather or a2a; context_parallel.py).
- fsdp.py (also `te.fsdp`): FSDP2 gathers torchte's GEMM weights in FP8.
"""

from __future__ import annotations

from .._collectives import all_to_all_split, allreduce, reduce_scatter_along_first_dim
from ..recompute import (
    activation_recompute_forward,
    checkpoint,
    get_activation_recompute_contexts,
    in_fp8_activation_recompute_phase,
    is_fp8_activation_recompute_enabled,
)
from .context_parallel import gather_from_cp_ranks, get_batch_on_this_cp_rank, split_for_cp_rank
from .expert_parallel import (
    DispatchPlan,
    ExpertParallel,
    combine,
    dispatch,
    exchange_counts,
    pad_rows,
    unpad_rows,
)
from .gather import gather_along_first_dim
from .overlap import overlap_tp_comm, tp_overlap_enabled
from .rng import (
    CudaRNGStatesTracker,
    get_all_rng_states,
    graph_safe_rng_available,
    set_all_rng_states,
)
from .symmetric_memory import (
    all_gather_matmul,
    matmul_reduce_scatter,
    symmetric_memory_enabled,
    use_symmetric_memory,
)

__all__ = [
    "CudaRNGStatesTracker",
    "DispatchPlan",
    "ExpertParallel",
    "activation_recompute_forward",
    "all_gather_matmul",
    "all_to_all_split",
    "allreduce",
    "checkpoint",
    "combine",
    "dispatch",
    "exchange_counts",
    "gather_along_first_dim",
    "gather_from_cp_ranks",
    "get_activation_recompute_contexts",
    "get_all_rng_states",
    "get_batch_on_this_cp_rank",
    "graph_safe_rng_available",
    "in_fp8_activation_recompute_phase",
    "is_fp8_activation_recompute_enabled",
    "matmul_reduce_scatter",
    "overlap_tp_comm",
    "pad_rows",
    "reduce_scatter_along_first_dim",
    "set_all_rng_states",
    "split_for_cp_rank",
    "symmetric_memory_enabled",
    "tp_overlap_enabled",
    "unpad_rows",
    "use_symmetric_memory",
]
