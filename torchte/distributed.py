"""te.distributed: Transformer Engine's distributed helpers, on torch.distributed.

- `checkpoint`: activation recompute under the forward's FP8 settings and scales
  (torchte/recompute.py; also `te.checkpoint`), with Transformer Engine's recompute flags
  (`activation_recompute_forward`, `is_fp8_activation_recompute_enabled`,
  `in_fp8_activation_recompute_phase`) for clients that recompute by themselves.
- `CudaRNGStatesTracker`: named RNG states (Megatron-Core's model-parallel RNG), forked for
  initialization and dropout inside tensor-parallel regions, replayed by `checkpoint`;
  `get_all_rng_states()`: the states of the tracker last added to or set.
- `gather_along_first_dim`, `reduce_scatter_along_first_dim`, `allreduce`: the collectives of
  tensor and sequence parallelism, with Transformer Engine's arguments, each returning
  (output, handle); the handle is None unless async_op. Every collective of torchte goes
  through here: NCCL gets torch's tensor collectives (one preallocated output), other backends
  (gloo, which lacks reduce_scatter_tensor on some builds) one fallback: all_gather into a
  list, or all_reduce and this rank's slice. The gather moves FP8 bytes for torchte's FP8
  values and per-tensor quantizers.
- `use_symmetric_memory`, `all_gather_matmul`, `matmul_reduce_scatter`: the GEMMs that follow
  an all-gather or precede a reduce-scatter (sequence parallelism), fused with them through
  torch's symmetric memory (micro-pipelined async tensor parallelism: the collective runs in
  chunks under the GEMM) when switched on, on CUDA tensors of an NCCL group with a torch that
  has the symmetric-memory ops; elsewhere, and while switched off, the plain collective and
  the GEMM one after the other.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .quantization import Float8Storage, QuantizedTensor
from .quantization._block_common import BlockQuantizerMixin
from .recompute import (
    activation_recompute_forward,
    checkpoint,
    get_activation_recompute_contexts,
    in_fp8_activation_recompute_phase,
    is_fp8_activation_recompute_enabled,
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
    inp,
    process_group=None,
    async_op: bool = False,
    quantizer=None,
    output_tensor: torch.Tensor | None = None,
    external_coalescing: bool = False,
) -> tuple[object, object | None]:
    """(the ranks' inputs stacked along dim 0, handle): inp (M, ...) on every rank -> (W M,
    ...), rank r's rows at [r M, (r + 1) M). With one rank, inp itself (quantized by
    `quantizer` when given).

    FP8: a torchte per-tensor quantizer (quantizer.quantize_gathered) casts the rows with a
    scale the ranks agree on and the FP8 bytes are gathered into a Float8Storage (rowwise);
    an inp that is a Float8Storage has its bytes gathered with its scale_inv (the ranks must
    share it). Other quantized inputs are gathered in high precision (with a warning), then
    quantized by `quantizer` if given. output_tensor: where a high-precision result goes
    ((W M, ...), inp's dtype and device). external_coalescing: accepted (the gathers here need
    no fix-up after a coalescing manager closes)."""
    world = _world(process_group)
    if world == 1:
        if quantizer is not None and _is_high_precision(inp):
            inp = quantizer.quantize(inp)
        return inp, None
    if isinstance(inp, Float8Storage):
        return _gather_fp8_storage(inp, process_group), _Done() if async_op else None
    if isinstance(inp, QuantizedTensor) or not isinstance(inp, torch.Tensor):
        warnings.warn(
            f"gather_along_first_dim: {type(inp).__name__} is gathered in high precision "
            "(dequantized first)",
            UserWarning,
            stacklevel=2,
        )
        inp = inp.dequantize()
    if quantizer is not None:
        return _gather_quantized(inp, process_group, quantizer), _Done() if async_op else None
    inp = inp.contiguous()
    out = _gather_output(inp, world, output_tensor)
    if _native(process_group):
        handle = dist.all_gather_into_tensor(out, inp, group=process_group, async_op=async_op)
        return out, handle
    dist.all_gather(list(out.chunk(world)), inp, group=process_group)
    return out, _Done() if async_op else None


def _is_high_precision(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor)


def _gather_output(inp: torch.Tensor, world: int, given: torch.Tensor | None) -> torch.Tensor:
    """The (W M, ...) output of a high-precision gather: `given` (checked) or a new one."""
    shape = (world * inp.shape[0], *inp.shape[1:])
    if given is None:
        return torch.empty(shape, dtype=inp.dtype, device=inp.device)
    _check_output("output_tensor", given, shape, inp)
    return given


def _check_output(name: str, out: torch.Tensor, shape: tuple, inp: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != inp.dtype or out.device != inp.device:
        raise ValueError(
            f"{name} must have shape {tuple(shape)}, dtype {inp.dtype} and device {inp.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _gather_quantized(inp: torch.Tensor, group, quantizer):
    """inp's rows quantized with one scale the ranks agree on, gathered as FP8 bytes (a torchte
    per-tensor quantizer), or each rank's blocks cast and gathered (the block-scaled formats);
    other quantizers: gathered in high precision, then quantized."""
    if hasattr(quantizer, "quantize_gathered"):
        reduce_max = functools.partial(allreduce, tp_group=group, op=dist.ReduceOp.MAX)

        def gather(t: torch.Tensor) -> torch.Tensor:
            return gather_along_first_dim(t, group)[0]

        # The block-scaled formats' columnwise copy is its own cast (never made from the
        # gathered rowwise bytes): gathered too where the quantizer makes it.
        columnwise = isinstance(quantizer, BlockQuantizerMixin) and quantizer.columnwise_usage
        return quantizer.quantize_gathered(inp, reduce_max, gather, columnwise)
    if not hasattr(quantizer, "quantize"):
        raise TypeError(
            f"gather_along_first_dim: quantizer must be a torchte Quantizer, got {quantizer!r}"
        )
    return quantizer.quantize(gather_along_first_dim(inp, group)[0])


def _gather_fp8_storage(inp: Float8Storage, group) -> Float8Storage:
    """inp's FP8 bytes (rowwise) gathered along dim 0 into a Float8Storage of its scale_inv."""
    if inp.rowwise_data is None:
        inp.update_usage(rowwise_usage=True)
    data = inp.rowwise_data.view(torch.uint8).reshape(inp.shape)
    gathered = gather_along_first_dim(data, group)[0].view(inp.fp8_dtype)
    shape = tuple(gathered.shape)
    return Float8Storage(gathered.reshape(-1, shape[-1]), None, inp.scale_inv, inp.fp8_dtype, shape)


def reduce_scatter_along_first_dim(
    inp: torch.Tensor,
    tp_group=None,
    async_op: bool = False,
    output: torch.Tensor | None = None,
) -> tuple[torch.Tensor, object | None]:
    """(this rank's slice of the sum over ranks, handle): inp (W M, ...) -> (M, ...), rank r
    gets rows [r M, (r + 1) M) of the sum, written into `output` when given ((M, ...), inp's
    dtype and device). With one rank, inp itself. ValueError unless W divides the first dim."""
    world = _world(tp_group)
    if world == 1:
        return inp, None
    if inp.shape[0] % world:
        raise ValueError(
            f"reduce_scatter_along_first_dim: the first dim ({inp.shape[0]}) must be divisible "
            f"by the group's {world} ranks"
        )
    inp = inp.contiguous()
    rows = inp.shape[0] // world
    shape = (rows, *inp.shape[1:])
    if output is not None:
        _check_output("output", output, shape, inp)
    if _native(tp_group):
        out = torch.empty(shape, dtype=inp.dtype, device=inp.device) if output is None else output
        handle = dist.reduce_scatter_tensor(out, inp, group=tp_group, async_op=async_op)
        return out, handle
    total = inp.clone()
    dist.all_reduce(total, group=tp_group)
    rank = dist.get_rank(tp_group)
    mine = total[rank * rows : (rank + 1) * rows]
    if output is not None:
        mine = output.copy_(mine)
    return mine, _Done() if async_op else None


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


# The states of the tracker last added to or set (Transformer Engine's get_all_rng_states):
# the dict object the tracker holds, so later forks show in it.
_ALL_RNG_STATES: dict[str, dict[str, torch.Tensor]] = {"states": {}}


def get_all_rng_states() -> dict[str, torch.Tensor]:
    """The RNG states (by name) of the CudaRNGStatesTracker last added to or set: the
    tracker's own dict, not a copy ({} before any)."""
    return _ALL_RNG_STATES["states"]


def set_all_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Make `states` what get_all_rng_states() returns."""
    if not isinstance(states, dict):
        raise TypeError(f"set_all_rng_states: states must be a dict, got {type(states).__name__}")
    _ALL_RNG_STATES["states"] = states


def graph_safe_rng_available() -> bool:
    """Whether torch has the CUDA-graph-safe generator API (register_generator_state and the
    graphsafe_get/set_state of generators). torchte's tracker keeps its states as RNG state
    tensors either way."""
    return (
        hasattr(torch.cuda.CUDAGraph, "register_generator_state")
        and hasattr(torch.Generator, "graphsafe_set_state")
        and hasattr(torch.Generator, "graphsafe_get_state")
        and hasattr(torch.Generator, "clone_state")
    )


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
        """Replace the states (as get_states gave them); get_all_rng_states() shows these."""
        self.states_ = {name: state.clone() for name, state in states.items()}
        set_all_rng_states(self.states_)

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed`; ValueError if the name or seed is taken.
        get_all_rng_states() shows this tracker's states from now on."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker: state {name!r} already exists")
        self.seeds_.add(seed)
        saved = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(saved)
        set_all_rng_states(self.states_)

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
