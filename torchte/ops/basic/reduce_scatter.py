"""te.ops.ReduceScatter: the sum over ranks, split along the first dimension.

Legend: P ranks; x (P M, ...) on each rank -> y (M, ...), rank r's rows [r M, (r + 1) M) of
the sum. Backward all-gathers the gradient (rank r's rows at [r M, (r + 1) M)).
"""

from __future__ import annotations

from torchte import distributed as te_dist

from ..op import BasicOperation
from ._parallel import group_size

__all__ = ["ReduceScatter"]


class ReduceScatter(BasicOperation):
    """Reduce-scatter along dim 0 over `process_group` (None: the world group), as Transformer
    Engine's op; a group of one rank passes x through. ValueError (before the collective) unless
    P divides the input's first dimension."""

    def __init__(self, process_group=None, *, device=None) -> None:
        super().__init__(device, None)
        self.process_group = process_group
        self.process_group_size = group_size("te.ops.ReduceScatter", process_group)
        self._finish_init()

    def output_rows(self, rows: int | None) -> int | None:
        return None if rows is None else rows // self.process_group_size

    def op_forward(self, ctx, x, extra_inputs, settings):
        ranks = self.process_group_size
        if ranks == 1:
            return x.detach(), ()
        if x.dim() == 0 or x.shape[0] % ranks:
            raise ValueError(
                f"te.ops.ReduceScatter: the input's first dim must be divisible by the group's "
                f"{ranks} ranks, got shape {tuple(x.shape)}"
            )
        return te_dist.reduce_scatter_along_first_dim(x, self.process_group)[0], ()

    def op_backward(self, ctx, dy, extra_output_grads):
        if self.process_group_size == 1:
            return dy, (), ()
        return te_dist.gather_along_first_dim(dy, self.process_group)[0], (), ()

    def extra_repr(self) -> str:
        return f"process_group_size={self.process_group_size}"
