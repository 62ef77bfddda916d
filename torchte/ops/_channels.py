"""Extra-tensor channels inside one fused run (Transformer Engine's set_extra_input_channel /
set_extra_output_channel): an op's extra output bound to a channel feeds the extra inputs of
later ops of the run bound to the same channel, instead of going out of the call and coming back
in; going backward, the gradients those inputs receive are summed into the producer's extra
output gradient. Slots bound to no channel stay public: the call takes and returns them in op
order, as without channels.

A Routing is built once per OperationFuser (None where no op of the run binds a channel, so
such runs keep the plain per-op split); per call it places the public tensors into per-op slots,
fills bound inputs as their producers run, and collects the public outputs and gradients.
"""

from __future__ import annotations

__all__ = ["Routing", "routing_of"]

Slot = tuple[int, int]  # (op index in the run, slot index)


class Routing:
    """Where each extra input and output of a run's ops comes from and goes to."""

    __slots__ = ("consumers", "input_counts", "output_counts", "public_in", "public_out", "sources")

    def __init__(self, ops: list) -> None:
        self.input_counts = [op.num_extra_inputs for op in ops]
        self.output_counts = [op.num_extra_outputs for op in ops]
        producers: dict[str, Slot] = {}
        self.public_out: list[Slot] = []
        for i, op in enumerate(ops):
            for k, (channel, to_caller) in enumerate(op.extra_output_channels()):
                if channel is not None:
                    if channel in producers:
                        raise ValueError(
                            f"te.ops: extra-tensor channel {channel!r} has two producers "
                            f"(ops {producers[channel][0]} and {i} of the fused run)"
                        )
                    producers[channel] = (i, k)
                if to_caller:
                    self.public_out.append((i, k))
        self.public_in: list[Slot] = []
        self.sources: dict[Slot, Slot] = {}
        self.consumers: dict[Slot, list[Slot]] = {}
        for i, op in enumerate(ops):
            for k, channel in enumerate(op.extra_input_channels()):
                if channel is None:
                    self.public_in.append((i, k))
                    continue
                source = producers.get(channel)
                if source is None or source[0] >= i:
                    raise ValueError(
                        f"te.ops: extra input {k} of op {i} ({type(op).__name__}) is bound to "
                        f"channel {channel!r}, which no earlier op of the fused run produces"
                    )
                self.sources[(i, k)] = source
                self.consumers.setdefault(source, []).append((i, k))

    def place_inputs(self, flat) -> list[list]:
        """The public extra inputs (in op order) in per-op slot lists; bound slots None."""
        per_op = [[None] * count for count in self.input_counts]
        for tensor, (i, k) in zip(flat, self.public_in, strict=True):
            per_op[i][k] = tensor
        return per_op

    def fill_inputs(self, per_op: list[list], indices: list[int], outputs: list[tuple]) -> None:
        """Before the step of basic ops `indices` runs: its bound inputs from producers of
        earlier steps (a producer in the same step hands its output over itself)."""
        for i in indices:
            for k in range(self.input_counts[i]):
                source = self.sources.get((i, k))
                if source is not None and source[0] not in indices:
                    per_op[i][k] = outputs[source[0]][source[1]]

    def public_outputs(self, outputs: list[tuple]) -> list:
        return [outputs[i][k] for i, k in self.public_out]

    def place_output_grads(self, flat) -> list[list]:
        per_op = [[None] * count for count in self.output_counts]
        for grad, (i, k) in zip(flat, self.public_out, strict=True):
            per_op[i][k] = grad
        return per_op

    def add_channel_grads(self, per_op: list[list], indices, channel_grads: dict) -> None:
        """Before a backward step: each bound output of its ops gets the gradients its
        consumers (later steps, already run) gave back."""
        for i in indices:
            for k in range(self.output_counts[i]):
                grad = channel_grads.pop((i, k), None)
                if grad is not None:
                    mine = per_op[i][k]
                    per_op[i][k] = grad if mine is None else mine + grad

    def take_input_grads(self, i: int, grads: tuple, indices, channel_grads: dict) -> None:
        """After a backward step: the gradients of op i's bound inputs go to their producers."""
        for k, grad in enumerate(grads):
            source = self.sources.get((i, k))
            if source is None or grad is None or source[0] in indices:
                continue
            previous = channel_grads.get(source)
            channel_grads[source] = grad if previous is None else previous + grad

    def public_input_grads(self, per_op: list[tuple]) -> list:
        out = []
        for i, k in self.public_in:
            grads = per_op[i]
            out.append(grads[k] if k < len(grads) else None)
        return out


def routing_of(ops: list) -> Routing | None:
    """The run's Routing, or None where no op binds a channel."""
    bound = any(
        any(c is not None for c in op.extra_input_channels())
        or any(c is not None for c, _ in op.extra_output_channels())
        for op in ops
    )
    return Routing(ops) if bound else None
