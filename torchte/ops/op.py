"""The operations the fuser runs: basic operations, fused operations, and what they share.

A BasicOperation is one step of a `te.ops.Sequential` (a linear map, a bias, a norm, an
activation, a residual add, ...): `op_forward` and `op_backward` on its own tensors. A
FusedOperation stands for a run of consecutive basic operations and computes them together
(`fuser_forward` / `fuser_backward`), writing the same per-op contexts, so that backward may be
fused differently from forward. Every operation is a te module (device, dtype, FP8 state, the
hot-path setattr guard).

Per call, each basic op gets one OperationContext (what its backward needs) and the run's
RunSettings (the autocast state and compute dtype, read once by the fuser, never by an op).
Extra inputs and outputs: an op declares how many it takes (`num_extra_inputs`) and makes
(`num_extra_outputs`); the Sequential's call hands them out in op order. Keyword arguments for
one op's forward (`Sequential(...)(x, op_kwargs={op: {...}})`) reach it as `ctx.kwargs`.

Parameters a client assigns (Megatron-Core builds ops on the meta device and sets its own
parameters on them: `op.weight = ...`, `op.register_parameter(...)`, `load_state_dict(...,
assign=True)`) carry the op along: its device, dtype and plans follow them, and a call checks
that they are still where the op thinks (a parameter moved in place by its owner). Parameters
still on the meta device at the first call are materialized on the default device and
initialized, as Transformer Engine's ops do.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from torchte.autocast import autocast_state
from torchte.module._fp8_meta import refresh_op_fp8_metas
from torchte.module.base import SUPPORTED_DTYPES, TransformerEngineBaseModule
from torchte.recipe import Recipe

__all__ = [
    "BasicOperation",
    "FusedOperation",
    "FusibleOperation",
    "OperationContext",
    "RunSettings",
    "backward_one_by_one",
]


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What every op of one call needs to know besides tensors (built once per setting)."""

    fp8: bool
    """Whether GEMMs run in FP8 (te.autocast enabled)."""
    calibrating: bool
    """te.autocast(calibrating=True) without FP8: record amaxes, compute in high precision."""
    recipe: Recipe | None
    group: Any
    """The amax reduction group of the autocast region."""
    dtype: torch.dtype
    """The compute dtype: torch.autocast's where it is on, else the params_dtype of the run's
    first op with parameters, else (no op has any) the input's dtype."""
    requires_grad: bool
    """Whether a backward will run (grad mode on and some input or parameter needs grad)."""


_NO_KWARGS: MappingProxyType = MappingProxyType({})
_STATE = autocast_state()


class OperationContext:
    """What one basic op's backward needs from its forward: `saved` (tensors or quantized
    storages, given to save_for_backward) and any attributes the op sets; `kwargs`, the
    keyword arguments the call gave this op (Sequential's op_kwargs; empty by default).
    `requires_grad`: whether a backward will run through this op (set for ops written with
    Transformer Engine's signatures; True otherwise, Transformer Engine's default)."""

    requires_grad = True

    def __init__(self) -> None:
        self.saved: tuple = ()
        self.kwargs = _NO_KWARGS

    def save_for_backward(self, *values) -> None:
        """Keep these tensors (or Storages, or None) for backward."""
        self.saved = values

    @property
    def saved_tensors(self) -> tuple:
        """What save_for_backward kept (read by module code written for an autograd ctx)."""
        return self.saved

    @property
    def to_save(self) -> tuple:
        """Transformer Engine's name of what the forward keeps: assigning it saves."""
        return self.saved

    @to_save.setter
    def to_save(self, values) -> None:
        self.saved = () if values is None else tuple(values)


class FusibleOperation:
    """An operation the fuser can run: a basic op or a fusion of several.

    Its fuser_forward / fuser_backward take torchte's arguments (below) or Transformer
    Engine's (keyword arguments basic_op_extra_inputs, prev_op_grad_output_quantizer,
    next_op_input_quantizer, basic_op_kwargs; basic_op_grad_extra_outputs, returning
    (dx, param grads per op, extra input grads per op)): the fuser tells them apart by their
    signature, once per class (ops/_te_signatures.py)."""

    is_fused_op = False

    def get_input_quantizer(self):
        """The quantizer of this op's input under the current te.autocast (None without)."""
        return None

    def get_grad_output_quantizer(self):
        """The quantizer of this op's output gradient under the current te.autocast."""
        return None

    def fuser_forward(self, ctxs: list, x, extra_inputs: list[tuple], settings: RunSettings):
        """x -> (y, [extra outputs of each basic op]); ctxs and extra_inputs per basic op."""
        raise NotImplementedError

    def fuser_backward(self, ctxs: list, dy, extra_output_grads: list[tuple]):
        """dy -> (dx, [extra input grads of each basic op], [param grads of each basic op])."""
        raise NotImplementedError


class BasicOperation(FusibleOperation, TransformerEngineBaseModule):
    """One operation (an nn.Module): subclasses give op_forward and op_backward, and call
    _finish_init() at the end of __init__."""

    num_extra_inputs = 0
    num_extra_outputs = 0
    # The input's last dimension this op needs (None: any); see output_features.
    input_features: int | None = None
    # Plain attributes a client sets on an op once, after construction, as a hint (Megatron-Core
    # marks ops it builds): written to __dict__ without the hot-path setattr warning.
    client_attributes: frozenset[str] = frozenset()

    def __init__(self, device=None, dtype: torch.dtype | None = None, num_gemms: int = 0) -> None:
        super().__init__(device, dtype, num_gemms)
        # An op makes no FP8 parameters (quantized_model_init): its weights are quantized per
        # call under te.autocast, so it keeps no model-init recipe to reattach quantizers for.
        self._model_init_recipe = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.client_attributes:
            self.__dict__[name] = value
            return
        super().__setattr__(name, value)

    # -- parameters a client assigns ------------------------------------------------------------

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        """nn.Module's; after construction the parameter is checked first (_check_parameter)
        and the op then follows it (_parameter_assigned). `op.weight = p` and
        load_state_dict(assign=True) come here too."""
        initialized = self.__dict__.get("_initialized", False)
        if initialized and param is not None:
            self._check_parameter(name, param)
        super().register_parameter(name, param)
        if initialized:
            self._parameter_assigned(name, param)

    def _check_parameter(self, name: str, param: torch.nn.Parameter) -> None:
        """Raise (before it is registered) when `param` cannot be this op's `name` (subclasses
        check shapes)."""

    def _parameter_assigned(self, name: str, param: torch.nn.Parameter | None) -> None:
        """A parameter was set after construction: the op takes its device and dtype from its
        parameters and forgets what it built from the old ones."""
        self._follow_parameters()

    def _follow_parameters(self) -> None:
        """Device (the one device of the parameters not on the meta device, or the meta device
        when all are) and params_dtype from the parameters where they agree; plans and FP8
        weight copies made from the old ones dropped."""
        params = [p for p in self._parameters.values() if p is not None]
        devices = {p.device for p in params}
        real = {d for d in devices if d.type != "meta"}
        target = real.pop() if len(real) == 1 else devices.pop() if len(devices) == 1 else None
        if target is not None and target != self.device:
            self._move_state(target)
        dtypes = {p.dtype for p in params if p.dtype in SUPPORTED_DTYPES}
        if dtypes:  # all the same; else the first one's (the one a call compares)
            first = next(p.dtype for p in params if p.dtype in SUPPORTED_DTYPES)
            self.__dict__["params_dtype"] = dtypes.pop() if len(dtypes) == 1 else first
        self._parameters_replaced()

    def params_for_call(self) -> list[torch.nn.Parameter]:
        """op_parameters() at the start of a call, after checking that the op's device and
        dtype are its first parameter's (two comparisons): a parameter moved or cast in place by
        its owner (`.data` replaced, as nn.Module.to does) is followed; parameters all still on
        the meta device are materialized on the default device and initialized (Transformer
        Engine's ops do so before their first forward)."""
        params = self.op_parameters()
        if params and (
            params[0].device != self.device
            or (params[0].dtype != self.params_dtype and params[0].dtype in SUPPORTED_DTYPES)
        ):
            present = [(n, p) for n, p in self._parameters.items() if p is not None]
            meta = [n for n, p in present if p.is_meta]
            if meta and len(meta) < len(present):
                raise RuntimeError(
                    f"te.ops.{type(self).__name__}: parameter(s) {', '.join(meta)} are still on "
                    "the meta device while the others are not: assign them too, or call "
                    "reset_parameters() to initialize them all"
                )
            if meta:
                self.reset_parameters()
            else:
                self._follow_parameters()
            params = self.op_parameters()
        return params

    def output_features(self, features: int | None) -> int | None:
        """The last dimension of the output for an input of `features` (None: unknown); the
        Sequential checks consecutive ops with it."""
        return features

    def op_parameters(self) -> list[torch.nn.Parameter]:
        """This op's parameters in the order op_backward returns their gradients."""
        return [p for p in self._parameters.values() if p is not None]

    def op_forward(self, ctx: OperationContext, x, extra_inputs: tuple, settings: RunSettings):
        """x -> (y, extra outputs (a tuple of num_extra_outputs tensors))."""
        raise NotImplementedError

    def op_backward(self, ctx: OperationContext, dy, extra_output_grads: tuple):
        """dy -> (dx, extra input grads (num_extra_inputs), param grads (op_parameters order));
        None where there is no gradient."""
        raise NotImplementedError

    # -- extra-tensor channels (Transformer Engine's) ------------------------------------------

    def extra_input_channels(self) -> tuple[str | None, ...]:
        """The channel each extra input slot is bound to (None: a public input of the call)."""
        return self.__dict__.get("_extra_input_channels") or (None,) * self.num_extra_inputs

    def extra_output_channels(self) -> tuple[tuple[str | None, bool], ...]:
        """(channel or None, whether the call also returns it) of each extra output slot."""
        return self.__dict__.get("_extra_output_channels") or ((None, True),) * (
            self.num_extra_outputs
        )

    def set_extra_input_channel(self, index: int, channel: str | None) -> BasicOperation:
        """Bind extra input `index` to `channel`: it then takes the extra output of an earlier
        op of the same fused run bound to that channel instead of an input of the call (None:
        public again). Only before a Sequential or a call of the op has run it (RuntimeError
        after)."""
        self._check_channel(index, self.num_extra_inputs, "input", channel)
        channels = list(self.extra_input_channels())
        channels[index] = channel
        self.__dict__["_extra_input_channels"] = tuple(channels)
        return self

    def set_extra_output_channel(
        self, index: int, channel: str | None, *, output_to_caller: bool = True
    ) -> BasicOperation:
        """Bind extra output `index` to `channel` for later ops of the same fused run;
        output_to_caller=False keeps it from the call's outputs (channel None: public again)."""
        self._check_channel(index, self.num_extra_outputs, "output", channel)
        if not isinstance(output_to_caller, bool):
            raise TypeError("set_extra_output_channel: output_to_caller must be a bool")
        channels = list(self.extra_output_channels())
        channels[index] = (channel, output_to_caller or channel is None)
        self.__dict__["_extra_output_channels"] = tuple(channels)
        return self

    def _check_channel(self, index: int, count: int, what: str, channel) -> None:
        who = f"te.ops.{type(self).__name__}"
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise IndexError(f"{who} has {count} extra {what}(s); extra {what} {index!r} is none")
        if channel is not None and (not isinstance(channel, str) or not channel):
            raise ValueError(f"{who}: an extra {what} channel is a non-empty str or None")
        if self.__dict__.get("_channels_locked", False):
            raise RuntimeError(
                f"{who}: its extra-tensor channels cannot change once a fused run has taken "
                "them (a Sequential that ran, or a call of the op): build new operations"
            )

    # -- quantizers, by Transformer Engine's (mode, index) -------------------------------------

    def quantizer_slots(self, mode: str) -> list[tuple[str, int]]:
        """(FP8Setup field, GEMM) of each of this op's quantizers of `mode`, in Transformer
        Engine's order: forward input and weight of each GEMM, backward its output gradient."""
        if mode == "forward":
            return [(name, g) for g in range(self.num_gemms) for name in ("input", "weight")]
        if mode == "backward":
            return [("grad_output", g) for g in range(self.num_gemms)]
        return []

    def num_quantizers(self, mode: str) -> int:
        """How many quantizers this op has for `mode` ("forward" or "backward")."""
        return len(self.quantizer_slots(mode))

    def get_quantizer(self, mode: str, index: int):
        """Quantizer `index` of `mode` ("forward" or "backward", Transformer Engine's order:
        see quantizer_slots) under the current te.autocast recipe; None outside te.autocast."""
        state = _STATE
        return self.quantizer_under(state.recipe if state.enabled else None, mode, index)

    def quantizer_under(self, recipe: Recipe | None, mode: str, index: int):
        """get_quantizer's answer under `recipe` (None: no FP8, no quantizer)."""
        if mode not in ("forward", "backward"):
            raise ValueError(f"get_quantizer: mode must be 'forward' or 'backward', got {mode!r}")
        slots = self.quantizer_slots(mode)
        if not 0 <= index < len(slots):
            raise IndexError(
                f"te.ops.{type(self).__name__} has {len(slots)} {mode} quantizer(s), "
                f"asked for index {index}"
            )
        if recipe is None:
            return None
        name, gemm = slots[index]
        return getattr(self._fp8_setup(recipe), name)[gemm]

    @property
    def _fp8_metas(self) -> dict[str, dict[str, Any] | None] | None:
        """Transformer Engine's per-op FP8 metadata, built when read (never by a call): None
        before the op is set up for an FP8 recipe or where it has no quantizers; else
        {"forward": ..., "backward": ...}, each None without quantizers of that mode or a
        dict (the same dict at each read) of "recipe" (the last recipe the op was set up
        for), "fp8_group" and, under delayed scaling, "scaling_fwd" / "scaling_bwd": views of
        the op's scales and amax histories, one column per quantizer in get_quantizer's order
        (module/_fp8_meta.py)."""
        setups = self.__dict__.get("_fp8_setups")
        if not setups or not (self.quantizer_slots("forward") or self.quantizer_slots("backward")):
            return None
        recipe = next(reversed(setups))
        metas = self.__dict__.setdefault("_te_fp8_metas", {})
        changed = self.__dict__.get("_te_fp8_metas_recipe") is not recipe
        self.__dict__["_te_fp8_metas_recipe"] = recipe
        refresh_op_fp8_metas(metas, self, recipe, changed)
        return metas

    def get_input_quantizer(self):
        if self.num_quantizers("forward"):
            return self.get_quantizer("forward", 0)
        return None

    def get_grad_output_quantizer(self):
        if self.num_quantizers("backward"):
            return self.get_quantizer("backward", 0)
        return None

    def check_settings(self, settings: RunSettings) -> None:
        """Raise before any kernel runs when this op cannot run under `settings`."""

    def check_extra_inputs(self, extra_inputs: tuple, rows: int | None) -> None:
        """Raise before any op of the run computes when the extra inputs cannot fit an input
        of `rows` rows (its elements over the last dimension; None: not known here)."""

    def output_rows(self, rows: int | None) -> int | None:
        """The rows of the output for an input of `rows` rows (None: unknown)."""
        return rows

    def forward_done(self, settings: RunSettings) -> None:
        """The run's forward succeeded: an op with FP8 state (num_gemms > 0) registers the
        delayed-scaling update of the amaxes it recorded."""
        if self.num_gemms and settings.recipe is not None:
            setup = self._fp8_setup(settings.recipe)
            if setup.records_amax:
                setup.forward_done(settings.group)
                self.__dict__["_saved_history_len"] = settings.recipe.amax_history_len

    def forward_failed(self, settings: RunSettings) -> None:
        """The run's forward failed: drop the amaxes this op recorded this step."""
        if self.num_gemms and settings.recipe is not None:
            self._fp8_setup(settings.recipe).forward_failed()

    def fuser_forward(self, ctxs, x, extra_inputs, settings):
        y, extra = self.op_forward(ctxs[0], x, extra_inputs[0], settings)
        return y, [extra]

    def fuser_backward(self, ctxs, dy, extra_output_grads):
        dx, extra_grads, param_grads = self.op_backward(ctxs[0], dy, extra_output_grads[0])
        return dx, [extra_grads], [param_grads]

    def forward(self, x: torch.Tensor, *extra_inputs: torch.Tensor):
        """Run this op alone, as a Sequential of one."""
        from .sequential import Sequential

        return Sequential._run_ops([self], x, extra_inputs)


def backward_one_by_one(ops: list, ctxs: list, dy, extra_output_grads: list):
    """The basic ops' own backwards, last op first: (dx, [extra input grads per op], [param
    grads per op]); what a fused op runs where its fused backward does not apply."""
    extras, params = [], []
    for op, ctx, out_grads in reversed(list(zip(ops, ctxs, extra_output_grads, strict=True))):
        dy, extra, grads = op.op_backward(ctx, dy, out_grads)
        extras.insert(0, extra)
        params.insert(0, grads)
    return dy, extras, params


class FusedOperation(FusibleOperation, torch.nn.Module):
    """Stands for consecutive basic ops computed together: made by a fusion when a run is
    planned (once per setting), or built by a user as a module of its own.

    It holds the basic ops as submodules `basic_ops.<i>` (Transformer Engine's state-dict keys),
    so their parameters are seen once through it, and no state of its own. Put in a
    te.ops.Sequential or called alone, it runs as its basic ops planned afresh, as in
    Transformer Engine: the fusions registered for them apply (its own fuser_forward /
    fuser_backward run where a fusion makes it). A basic op a subclass also keeps under another
    attribute (`self.linear = linear`) is an alias there, not a second submodule.
    """

    is_fused_op = True

    def __init__(self, basic_ops: list[BasicOperation]) -> None:
        torch.nn.Module.__init__(self)
        ops = list(basic_ops)
        if not ops:
            raise ValueError("te.ops.FusedOperation needs at least one basic op, got none")
        self._modules["basic_ops"] = torch.nn.ModuleList(ops)
        # The plain list, read on the hot path from __dict__ (no nn.Module.__getattr__); the
        # ModuleList above holds the same ops for parameters(), state_dict() and to().
        self.__dict__["basic_ops"] = ops

    def __setattr__(self, name: str, value: Any) -> None:
        ops = self.__dict__.get("basic_ops", ())
        if isinstance(value, torch.nn.Module) and any(value is op for op in ops):
            self.__dict__[name] = value  # an alias of a basic op (see the class docstring)
            return
        super().__setattr__(name, value)

    def get_input_quantizer(self):
        return self.basic_ops[0].get_input_quantizer()

    def get_grad_output_quantizer(self):
        return self.basic_ops[-1].get_grad_output_quantizer()

    def forward(
        self,
        x: torch.Tensor,
        *extra_inputs: torch.Tensor,
        basic_op_kwargs: list[dict[str, Any]] | None = None,
    ):
        """Run the basic ops on their own, as a Sequential of them: x and the extra inputs in
        op order -> y [, extra outputs]; basic_op_kwargs: keyword arguments per basic op."""
        from .sequential import Sequential

        return Sequential._run_ops(self.basic_ops, x, extra_inputs, self, basic_op_kwargs)
