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
  through collectives.py, which imports nothing of torchte: NCCL gets torch's tensor
  collectives, other backends (gloo) one fallback. The gather (gather.py) moves FP8 bytes for
  torchte's FP8 values and per-tensor quantizers.
- `use_symmetric_memory`, `all_gather_matmul`, `matmul_reduce_scatter`: the GEMMs that follow
  an all-gather or precede a reduce-scatter (sequence parallelism), fused with them through
  torch's symmetric memory when switched on (symmetric_memory.py).
- fsdp.py (also `te.fsdp`): FSDP2 gathers torchte's GEMM weights in FP8.
"""

from __future__ import annotations

from ..recompute import (
    activation_recompute_forward,
    checkpoint,
    get_activation_recompute_contexts,
    in_fp8_activation_recompute_phase,
    is_fp8_activation_recompute_enabled,
)
from .collectives import allreduce, reduce_scatter_along_first_dim
from .gather import gather_along_first_dim
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
    "activation_recompute_forward",
    "all_gather_matmul",
    "allreduce",
    "checkpoint",
    "gather_along_first_dim",
    "get_activation_recompute_contexts",
    "get_all_rng_states",
    "graph_safe_rng_available",
    "in_fp8_activation_recompute_phase",
    "is_fp8_activation_recompute_enabled",
    "matmul_reduce_scatter",
    "reduce_scatter_along_first_dim",
    "set_all_rng_states",
    "symmetric_memory_enabled",
    "use_symmetric_memory",
]
