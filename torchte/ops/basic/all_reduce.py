"""te.ops.AllReduce: the sum over ranks. Legend: x, y (...) of the same shape on every rank.

As Transformer Engine's op, the output is taken to feed computations that every rank repeats,
so its gradient is the same on every rank and backward passes it through unchanged."""

from __future__ import annotations

from torchte import distributed as te_dist

from ..op import BasicOperation
from ._parallel import group_size

__all__ = ["AllReduce"]


class AllReduce(BasicOperation):
    """All-reduce (sum) over `process_group` (None: the world group); a group of one rank
    passes x through. reduce_in_backward: Transformer Engine's argument, kept as an attribute;
    its op (and this one) reduces nothing in backward whatever its value. The sum is written to
    a new tensor: x (a tensor the caller or another op may still hold) is left as it was."""

    def __init__(self, process_group=None, reduce_in_backward: bool = True, *, device=None) -> None:
        super().__init__(device, None)
        self.process_group = process_group
        self.process_group_size = group_size("te.ops.AllReduce", process_group)
        self._reduce_in_backward = reduce_in_backward
        self._finish_init()

    def op_forward(self, ctx, x, extra_inputs, settings):
        if self.process_group_size == 1:
            return x, ()
        y = x.contiguous()
        if y is x:
            y = x.clone()
        return te_dist.allreduce(y, self.process_group)[0], ()

    def op_backward(self, ctx, dy, extra_output_grads):
        return dy, (), ()

    def extra_repr(self) -> str:
        return f"process_group_size={self.process_group_size}"
