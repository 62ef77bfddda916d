"""Tensor and sequence parallelism of the GEMM modules, Megatron-style, over torch.distributed.

Legend: P ranks in the tensor-parallel group; x (S, ..., K) input with the sequence first, W
(N, K) the full weight, y (S, ..., N). parallel_mode:
- "column": W's rows split, rank r holds W_r (N/P, K) and its bias part; y comes out split on its
  last dim (..., N/P). The input is whole on every rank: the input gradients of the ranks are
  partial sums, all-reduced in backward. With sequence_parallel the input arrives split along
  the sequence (S/P, ..., K): it is all-gathered before the GEMM and its gradient
  reduce-scattered back.
- "row": W's columns split, rank r holds (N, K/P) and reads its slice of x's last dim; the
  GEMM's outputs are partial sums, all-reduced (sequence_parallel: reduce-scattered along the
  sequence, and the output gradient all-gathered in backward); the bias, whole on every rank,
  is added once after the reduction.
- None: nothing is split; with sequence_parallel the parameters are only marked.
te.Linear, te.LayerNormLinear and te.LayerNormMLP run the collectives inside their autograd
Function (gather_gemm_input, reduce_partial, input_grad_reduction: under FP8 the gathered input
moves as FP8 bytes, block-scaled ones included, and a column GEMM's input-gradient reduction
runs while its wgrad GEMM does); te.GroupedLinear (no sequence parallelism) has them as
autograd Functions around its own (gemm_input, gemm_output). All go through te.distributed's
helpers (one place for the gloo fallbacks).

Parameter attributes Megatron-Core reads are set as Transformer Engine sets them:
`tensor_model_parallel`, `partition_dim`, `partition_stride` on split weights (and on the
column-split bias), `sequence_parallel` on the row-parallel bias, whose gradient is then a
partial sum under sequence parallelism (Megatron all-reduces such parameters' gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchte import distributed as te_dist

from ._linear_core import default_init_method

__all__ = [
    "NO_TP",
    "TensorParallel",
    "check_divides",
    "forked_init",
    "set_group",
    "tensor_parallel",
]

_MODES = (None, "column", "row")


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """One module's tensor-parallel setting (see the module docstring)."""

    mode: str | None
    group: object | None
    size: int
    sequence_parallel: bool

    @property
    def split(self) -> bool:
        """Whether the GEMM is split over more than one rank."""
        return self.mode is not None and self.size > 1

    def local_features(self, in_features: int, out_features: int) -> tuple[int, int]:
        """(K, N) of this rank's weight."""
        if self.mode == "column":
            return in_features, out_features // self.size
        if self.mode == "row":
            return in_features // self.size, out_features
        return in_features, out_features

    def mark(self, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> None:
        """The parameter attributes Megatron-Core reads (module docstring)."""
        split = self.mode is not None
        for weight in weights:
            _set_model_parallel(weight, split, 1 if self.mode == "row" else 0)
        for bias in biases:
            if self.mode == "column":
                _set_model_parallel(bias, True, 0)
            elif self.mode == "row":
                bias.sequence_parallel = self.sequence_parallel

    def group_or_raise(self):
        """The process group, RuntimeError when none is set yet (construction may precede it:
        set_tensor_parallel_group)."""
        if self.group is None:
            raise RuntimeError(
                f"tensor parallelism over {self.size} ranks needs its process group: pass "
                "tp_group= or call set_tensor_parallel_group(group) before the forward"
            )
        return self.group

    @property
    def gathers_sequence(self) -> bool:
        """Whether the GEMM's input is all-gathered along the sequence (column + SP)."""
        return self.mode == "column" and self.sequence_parallel and self.size > 1

    def gather_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """Inside a Function: t's sequence shards all-gathered along dim 0 under sequence
        parallelism over more than one rank (a column GEMM's input, a row GEMM's output
        gradient), else t."""
        if not (self.sequence_parallel and self.size > 1):
            return t
        return te_dist.gather_along_first_dim(t, self.group_or_raise())[0]

    def reduce_max(self, t: torch.Tensor) -> None:
        """t all-reduced in place with MAX over the group (FP8 amaxes of split tensors)."""
        te_dist.allreduce(t, self.group_or_raise(), op=dist.ReduceOp.MAX)

    def gather_gemm_input(self, z: torch.Tensor, quantizer, columnwise: bool, keep_output: bool):
        """Inside a Function's forward, column + SP: (the GEMM's input, the norm output to hand
        out). Under FP8 with no norm output handed out: z's rows cast by each rank and gathered
        as quantized bytes (quantizer.quantize_gathered), and None; else z gathered in high
        precision, as both. Per-tensor quantizers cast with a scale the ranks agree on and
        gather the rowwise bytes, half of bf16's (the transpose made from them); the
        block-scaled ones (quantization/block_gather.py) gather each copy they make, rowwise
        and, for the wgrad GEMM (columnwise), the columnwise copy too."""
        if quantizer is None or keep_output:
            whole = self.gather_sequence(z)
            return whole, whole
        gather = self.gather_sequence
        return quantizer.quantize_gathered(z, self.reduce_max, gather, columnwise), None

    def input_grad_reduction(self, grad_z=None):
        """What a column GEMM's backward passes as linear_backward's start_reduction: starts
        the asynchronous reduce-scatter (SP) or all-reduce of its input gradient (a partial sum
        on each rank; plus grad_z, the gradient of a gathered output handed out, which is one
        too) and returns the wait; None where nothing is reduced."""
        if self.mode != "column" or self.size == 1:
            return None
        self.group_or_raise()

        def start(grad: torch.Tensor):
            if grad_z is not None:
                grad = grad + grad_z.reshape(grad.shape)
            out, handle = self._reduce(grad, async_op=True)

            def finish() -> torch.Tensor:
                if handle is not None:
                    handle.wait()
                return out

            return finish

        return start

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """Inside a Function's forward: a row-split GEMM's partial output summed over the
        ranks, reduce-scattered along the sequence (SP) or all-reduced (mode and size as
        for the layer's split)."""
        if self.size == 1:
            return y
        return self._reduce(y, async_op=False)[0]

    def _reduce(self, t: torch.Tensor, async_op: bool):
        """(t summed over the ranks: this rank's rows under sequence parallelism (reduce-scatter
        along dim 0), else all of it (all-reduce), handle)."""
        group = self.group_or_raise()
        if self.sequence_parallel:
            return te_dist.reduce_scatter_along_first_dim(t, group, async_op=async_op)
        return te_dist.allreduce(t.contiguous(), group, async_op=async_op)

    def gemm_input(self, inp: torch.Tensor) -> torch.Tensor:
        """Around a GEMM Function without sequence parallelism (te.GroupedLinear): the input as
        is, its gradient all-reduced in backward where the GEMM is column-split."""
        if self.mode != "column" or self.size == 1:
            return inp
        return _CopyToRegion.apply(inp, self.group_or_raise())

    def check_output_rows(self, inp: torch.Tensor) -> None:
        """Row-parallel sequence parallelism reduce-scatters the output along the sequence:
        ValueError unless P divides it (before any kernel runs)."""
        scatters = self.mode == "row" and self.sequence_parallel and self.size > 1
        if scatters and inp.shape[0] % self.size:
            raise ValueError(
                f"sequence_parallel: the input's first (sequence) dim must be divisible by "
                f"the {self.size} tensor-parallel ranks, got shape {tuple(inp.shape)}"
            )

    def gemm_output(self, out: torch.Tensor) -> torch.Tensor:
        """Around a GEMM Function without sequence parallelism: the output as is (column), or
        all-reduced (row)."""
        if self.mode != "row" or self.size == 1:
            return out
        return _ReduceFromRegion.apply(out, self.group_or_raise())


# The setting of a GEMM with no tensor parallelism (te.ops' linear ops, which take none yet).
NO_TP = TensorParallel(None, None, 1, False)


def set_group(module: str, tp: TensorParallel, tp_group) -> TensorParallel:
    """The setting with its process group set (set_tensor_parallel_group): the group's size
    must be tp_size."""
    return tensor_parallel(module, tp_group, tp.size, tp.mode, tp.sequence_parallel)


def tensor_parallel(
    module: str, tp_group, tp_size: int, parallel_mode: str | None, sequence_parallel: bool
) -> TensorParallel:
    """The checked setting: ValueError for a parallel_mode outside {column, row, None}, a
    tp_size below 1, or a tp_group whose size disagrees with tp_size; RuntimeError for a group
    without torch.distributed initialized."""
    if parallel_mode not in _MODES:
        raise ValueError(
            f"{module}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}"
        )
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{module}: tp_size must be a positive int, got {tp_size!r}")
    if tp_group is not None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"{module}: tp_group was given but torch.distributed is not initialized "
                "(call torch.distributed.init_process_group first)"
            )
        group_size = dist.get_world_size(tp_group)
        if tp_size not in (1, group_size):
            raise ValueError(
                f"{module}: tp_size={tp_size} disagrees with tp_group's {group_size} ranks"
            )
        tp_size = group_size
    return TensorParallel(parallel_mode, tp_group, tp_size, bool(sequence_parallel))


def check_divides(module: str, tp: TensorParallel, in_features: int, out_features: int) -> None:
    """ValueError unless tp_size divides the features the mode splits."""
    split = {"column": ("out_features", out_features), "row": ("in_features", in_features)}
    if tp.mode in split and split[tp.mode][1] % tp.size:
        name, value = split[tp.mode]
        raise ValueError(
            f"{module}: tp_size={tp.size} must divide {name}={value} ({tp.mode}-parallel)"
        )


def forked_init(init_method, get_rng_state_tracker, rng_tracker_name):
    """init_method run inside get_rng_state_tracker().fork(rng_tracker_name) when a tracker is
    given (Megatron-Core's model-parallel RNG: each rank draws its own shard), else as is
    (None: the default init)."""
    if get_rng_state_tracker is None:
        return init_method
    method = init_method or default_init_method

    def init(weight):
        tracker = get_rng_state_tracker()
        fork = tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork()
        with fork:
            method(weight)

    return init


def _set_model_parallel(param: torch.Tensor, split: bool, dim: int) -> None:
    param.tensor_model_parallel = split
    param.partition_dim = dim
    param.partition_stride = 1


# ----------------------------------------------------------------------------------------------
# The collectives as autograd Functions
# ----------------------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    """Forward: x itself (whole on every rank). Backward: the ranks' partial dx all-reduced."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dx):
        return te_dist.allreduce(dx.contiguous().clone(), ctx.group)[0], None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: the ranks' partial y all-reduced (into a copy: the GEMM's output is another
    Function's). Backward: dy itself (whole on every rank)."""

    @staticmethod
    def forward(ctx, y, group):
        return te_dist.allreduce(y.contiguous().clone(), group)[0]

    @staticmethod
    def backward(ctx, dy):
        return dy, None
