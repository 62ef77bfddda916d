"""te.distributed: Transformer Engine's distributed helpers, on torch.distributed.

- `checkpoint`: activation recompute under the forward's FP8 settings and scales
  (torchte/recompute.py; also `te.checkpoint`).
- `CudaRNGStatesTracker`: named RNG states (Megatron-Core's model-parallel RNG), forked for
  initialization and dropout inside tensor-parallel regions, replayed by `checkpoint`.
- `gather_along_first_dim`, `reduce_scatter_along_first_dim`, `allreduce`: the collectives of
  tensor and sequence parallelism, each returning (output, handle) as Transformer Engine's do;
  the handle is None unless async_op. Every collective of torchte goes through here: NCCL gets
  torch's tensor collectives (one preallocated output), other backends (gloo, which lacks
  reduce_scatter_tensor on some builds) one fallback: all_gather into a list, or all_reduce
  and this rank's slice.
- `use_symmetric_memory`, `all_gather_matmul`, `matmul_reduce_scatter`: the GEMMs that follow
  an all-gather or precede a reduce-scatter (sequence parallelism), fused with them through
  torch's symmetric memory (micro-pipelined async tensor parallelism: the collective runs in
  chunks under the GEMM) when switched on, on CUDA tensors of an NCCL group with a torch that
  has the symmetric-memory ops; elsewhere, and while switched off, the plain collective and
  the GEMM one after the other.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .recompute import checkpoint

__all__ = [
    "CudaRNGStatesTracker",
    "all_gather_matmul",
    "allreduce",
    "checkpoint",
    "gather_along_first_dim",
    "matmul_reduce_scatter",
    "reduce_scatter_along_first_dim",
    "symmetric_memory_enabled",
    "use_symmetric_memory",
]

_MODEL_PARALLEL_RNG = "model-parallel-rng"


def _world(group) -> int:
    """The ranks of `group` (1 without an initialized torch.distributed)."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _native(group) -> bool:
    """Whether the group's backend has the tensor collectives (NCCL)."""
    return dist.get_backend(group) == "nccl"


class _Done:
    """The handle of a collective that already finished (a fallback made of several)."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def gather_along_first_dim(
    inp: torch.Tensor, process_group=None, async_op: bool = False
) -> tuple[torch.Tensor, object | None]:
    """(the ranks' inputs stacked along dim 0, handle): inp (M, ...) on every rank -> (W M,
    ...), rank r's rows at [r M, (r + 1) M)."""
    world = _world(process_group)
    if world == 1:
        return inp, None
    inp = inp.contiguous()
    out = torch.empty((world * inp.shape[0], *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    if _native(process_group):
        handle = dist.all_gather_into_tensor(out, inp, group=process_group, async_op=async_op)
        return out, handle
    dist.all_gather(list(out.chunk(world)), inp, group=process_group)
    return out, _Done() if async_op else None


def reduce_scatter_along_first_dim(
    inp: torch.Tensor, process_group=None, async_op: bool = False
) -> tuple[torch.Tensor, object | None]:
    """(this rank's slice of the sum over ranks, handle): inp (W M, ...) -> (M, ...), rank r
    gets rows [r M, (r + 1) M) of the sum. ValueError unless W divides the first dim."""
    world = _world(process_group)
    if world == 1:
        return inp, None
    if inp.shape[0] % world:
        raise ValueError(
            f"reduce_scatter_along_first_dim: the first dim ({inp.shape[0]}) must be divisible "
            f"by the group's {world} ranks"
        )
    inp = inp.contiguous()
    rows = inp.shape[0] // world
    if _native(process_group):
        out = torch.empty((rows, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        handle = dist.reduce_scatter_tensor(out, inp, group=process_group, async_op=async_op)
        return out, handle
    total = inp.clone()
    dist.all_reduce(total, group=process_group)
    rank = dist.get_rank(process_group)
    return total[rank * rows : (rank + 1) * rows], _Done() if async_op else None


def allreduce(
    inp: torch.Tensor, tp_group=None, async_op: bool = False, *, op=dist.ReduceOp.SUM
) -> tuple[torch.Tensor, object | None]:
    """(the sum over ranks, or another `op` (torch.distributed.ReduceOp), in inp's storage,
    handle)."""
    if _world(tp_group) == 1:
        return inp, None
    handle = dist.all_reduce(inp, op=op, group=tp_group, async_op=async_op)
    return inp, handle


# Whether the sequence-parallel GEMMs fuse their collectives through symmetric memory (the
# environment variable TORCHTE_SYMMETRIC_MEMORY=1 switches it on at import), and the groups
# whose symmetric-memory workspace is set up.
_SYMMETRIC = {"enabled": os.environ.get("TORCHTE_SYMMETRIC_MEMORY", "0") == "1"}
_SYMMETRIC_GROUPS: set[str] = set()


def use_symmetric_memory(enabled: bool = True) -> bool:
    """Switch the fused symmetric-memory collectives of sequence-parallel high-precision GEMMs
    (te.Linear column and row with sequence_parallel) on or off; returns the previous setting.
    They apply to CUDA tensors of NCCL groups where torch has the ops (torch.ops.symm_mem);
    elsewhere the plain collectives run. FP8 GEMMs keep the plain collectives (their gathers
    move FP8 bytes)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"use_symmetric_memory: enabled must be a bool, got {enabled!r}")
    previous, _SYMMETRIC["enabled"] = _SYMMETRIC["enabled"], enabled
    return previous


def symmetric_memory_enabled() -> bool:
    """Whether use_symmetric_memory switched the fused collectives on."""
    return _SYMMETRIC["enabled"]


def _symmetric_group(t: torch.Tensor, group) -> str | None:
    """The name of `group` when t's GEMM can fuse its collective through symmetric memory (set
    up on first use), else None."""
    if not (_SYMMETRIC["enabled"] and t.is_cuda and _native(group)):
        return None
    name = (group or dist.group.WORLD).group_name
    if name not in _SYMMETRIC_GROUPS:
        try:  # importing it registers torch.ops.symm_mem
            from torch.distributed import _symmetric_memory as symm_mem
        except ImportError:
            return None
        if not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
            return None
        with warnings.catch_warnings():  # deprecated (no longer needed) in newer torch
            warnings.simplefilter("ignore", FutureWarning)
            if not symm_mem.is_symm_mem_enabled_for_group(name):
                symm_mem.enable_symm_mem_for_group(name)
        _SYMMETRIC_GROUPS.add(name)
    return name


def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, process_group=None):
    """(a, a @ b): a_shard (M, K) on every rank gathered along dim 0 into a (W M, K), and its
    product with b (K, N); fused through symmetric memory when use_symmetric_memory is on."""
    name = _symmetric_group(a_shard, process_group)
    if name is not None:
        a, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, name)
        return a, out
    a = gather_along_first_dim(a_shard, process_group)[0]
    return a, torch.mm(a, b)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, process_group=None) -> torch.Tensor:
    """This rank's rows of the sum over ranks of a @ b: a (W M, K), b (K, N) -> (M, N), rank r
    gets rows [r M, (r + 1) M); fused through symmetric memory when use_symmetric_memory is
    on."""
    name = _symmetric_group(a, process_group)
    if name is not None:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, name)
    return reduce_scatter_along_first_dim(torch.mm(a, b), process_group)[0]


class CudaRNGStatesTracker:
    """Named RNG states of the device's default generator (the GPU's where there is one, else
    the CPU's): `add` one from a seed, `fork` to draw from it (dropout or initialization
    inside a tensor-parallel region), `get_states` / `set_states` to save and replay them."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the states by name."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (as get_states gave them)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed`; ValueError if the name or seed is taken."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker: state {name!r} already exists")
        self.seeds_.add(seed)
        saved = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state `name` inside the block (it advances), then return to the state
        before; KeyError naming the states there are if `name` was never added."""
        if name not in self.states_:
            raise KeyError(
                f"CudaRNGStatesTracker: no state {name!r} (added: {sorted(self.states_)})"
            )
        saved = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(saved)


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
