"""te.ops.Quantize: under te.autocast, hand the next op its input in FP8 (forward=True) and/or
the previous op its gradient in FP8 (backward=True), as Float8Tensors made by this op's own
quantizers (with its own delayed-scaling state); outside te.autocast, y = x."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["Quantize"]


class Quantize(BasicOperation):
    """y = FP8(x) (forward=True) and dx = FP8(dy) (backward=True) under FP8; else identity."""

    def __init__(self, forward: bool = True, backward: bool = False, *, device=None) -> None:
        super().__init__(device, None, num_gemms=1)
        self.quantize_forward, self.quantize_backward = forward, backward
        self._finish_init()

    def quantizer_slots(self, mode: str) -> list[tuple[str, int]]:
        """Transformer Engine's: the output's quantizer (forward=True), the input gradient's
        (backward=True)."""
        if mode == "forward" and self.quantize_forward:
            return [("output", 0)]
        if mode == "backward" and self.quantize_backward:
            return [("grad_input", 0)]
        return []

    def op_forward(self, ctx, x, extra_inputs, settings):
        ctx.setup = setup = self._fp8_setup(settings.recipe) if settings.fp8 else None
        ctx.group = settings.group
        if setup is None or not self.quantize_forward:
            return x, ()
        return setup.output[0].quantize(x, rowwise=True, columnwise=True), ()

    def op_backward(self, ctx, dy, extra_output_grads):
        setup = ctx.setup
        if setup is None or not self.quantize_backward:
            return dy, (), ()
        dx = setup.grad_input[0].quantize(dy, rowwise=True, columnwise=True)
        hook = setup.backward_hook(ctx.group)
        if hook is not None:
            hook()  # delayed scaling: the backward scales update when this backward ends
        return dx, (), ()

    def extra_repr(self) -> str:
        return f"forward={self.quantize_forward}, backward={self.quantize_backward}"
