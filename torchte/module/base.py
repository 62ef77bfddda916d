"""What every te module shares: the hot-path rules of DESIGN.md and FP8 bookkeeping.

- `__setattr__` warns after construction; per-call state goes through `_fast_setattr`.
- The module's device is its parameters' (set at construction, followed through .to(),
  .cuda(), to_empty()); capability checks are cached per device.
- Quantizers are built once per recipe (`FP8Setup`), delayed-scaling state lives per module and
  goes into the state_dict as extra state.
- A weight is quantized once per change: the FP8 copy is cached by the parameter (identity and
  `_version`), the autocast step (a write through `.data` does not move `_version`) and the
  generation of its delayed scale.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from torchte import _nvtx
from torchte._device import default_device
from torchte.autocast import autocast_state
from torchte.quantization.base import QuantizedTensor
from torchte.quantization.delayed import DEFAULT_HISTORY_LEN, DelayedScalingState
from torchte.quantization.float8 import Float8Storage
from torchte.quantization.model_init import model_init_settings
from torchte.quantization.setup import FP8Setup, check_recipe, new_setup
from torchte.recipe import Recipe

from ._deferred_wgrad import WgradStore, add_to_grads, run_deferred
from ._functorch import Deferred, plain, transforms_active
from ._lifecycle import (
    ExtraStateError,
    ParameterInit,
    extra_state_of,
    keeping_out_of_inference,
    load_counts,
    moved_state,
    read_extra_state,
    reinitialize,
)
from ._setattr_guard import SetattrGuard
from ._te_compat import TEMetadataMixin
from ._te_extra_state import from_te_extra_state, is_te_extra_state, to_te_extra_state
from ._weight_cache import columnwise_weight, fp8_weight_cached

__all__ = ["PlanKey", "TransformerEngineBaseModule"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE = autocast_state()


class PlanKey(NamedTuple):
    """What a module's plan depends on: the autocast state and the call's flags (see _plan)."""

    fp8: bool
    calibrating: bool
    recipe: Recipe | None
    group: Any
    dtype: torch.dtype
    is_first_microbatch: bool | None
    fp8_output: bool
    fp8_grad: bool


class TransformerEngineBaseModule(TEMetadataMixin, SetattrGuard):
    """Base of te modules: device and dtype defaults, FP8 state, the setattr guard."""

    # Delayed-scaling state laid out slot by slot (see DelayedScalingState): grouped modules.
    _slot_major = False
    # Make the delayed-scaling state of the default history length at construction. The
    # state must exist before torch.compile traces a forward: a graph cannot create a tensor
    # that its backward then updates in place (a few KiB per GEMM; see _delayed_state_pair).
    _state_at_init = False

    def __init__(self, device, params_dtype: torch.dtype | None, num_gemms: int = 1) -> None:
        super().__init__()
        self.__dict__["_initialized"] = False
        self.device = default_device(device)
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if self.params_dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"params_dtype must be one of torch.float32, torch.bfloat16, torch.float16; "
                f"got {self.params_dtype}"
            )
        self.num_gemms = num_gemms
        self._autocast_type = _autocast_type(self.device)
        self._nvtx_name = f"te.{type(self).__name__}.forward"
        # history_len -> (forward state, backward state); the last used one is saved.
        self._delayed_states: dict[int, tuple[DelayedScalingState, DelayedScalingState]] = {}
        self._saved_history_len: int | None = None
        self._fp8_setups: dict[Recipe, FP8Setup] = {}
        # Plans: what a forward needs beyond tensors, built once per setting (see _plan).
        self._plans: dict[tuple, Any] = {}
        self._last_plan: tuple | None = None
        # The recipe of the FP8 weights built under quantized_model_init (None: none are).
        settings = model_init_settings()
        self._model_init_recipe: Recipe | None = None if settings is None else settings.recipe
        # delay_wgrad_compute (_deferred_wgrad.py): the deferred wgrad GEMMs, or None.
        self.delay_wgrad_compute = False
        self._wgrad_store: WgradStore | None = None
        self._wgrad_hooks: list[Callable[[], None]] = []
        self._save_original_input = False

    def _defer_wgrad(self, delay_wgrad_compute: bool, weight_names: list[str]) -> None:
        """In __init__: with delay_wgrad_compute, backward leaves the weight-gradient GEMMs to
        backward_dw. The weights are marked `skip_backward_post_hook` (as Transformer Engine
        marks them: their gradient is not ready when autograd's backward reaches them)."""
        if not isinstance(delay_wgrad_compute, bool):
            raise TypeError(f"delay_wgrad_compute must be a bool, got {delay_wgrad_compute!r}")
        self.delay_wgrad_compute = delay_wgrad_compute
        if delay_wgrad_compute:
            self._wgrad_store = WgradStore()
            for name in weight_names:
                self._parameters[name].skip_backward_post_hook = True

    def need_backward_dw(self) -> bool:
        """Whether backward_dw must run to finish the weight gradients (delay_wgrad_compute)."""
        return self._wgrad_store is not None

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs the oldest backward deferred (delay_wgrad_compute=True)
        into main_grad (fuse_wgrad_accumulation) or the weights' .grad, then the hooks given to
        register_wgrad_accumulation_and_reduce_hooks. Nothing when none is waiting."""
        run_deferred(self._wgrad_store, self._take_deferred_wgrad, self._wgrad_hooks)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Call hook() at the end of each backward_dw (a data-parallel gradient reduction, as
        Megatron-Core registers one)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._wgrad_hooks.append(hook)

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        """Call the hooks given to register_wgrad_accumulation_and_reduce_hooks, as backward_dw
        does after its GEMMs (Transformer Engine's name; Megatron-Core calls it on the modules
        whose GEMMs its te.ops experts ran)."""
        for hook in self._wgrad_hooks:
            hook()

    def _wgrad_parameters(self, gemm: int) -> list[nn.Parameter]:
        """The weight parameters of GEMM number `gemm` (rows stacked: its weight gradient)."""
        raise NotImplementedError

    def _take_deferred_wgrad(self, gemm: int, wgrad) -> None:
        """backward_dw: add GEMM `gemm`'s deferred weight gradient to its parameters' .grad."""
        add_to_grads(self._wgrad_parameters(gemm), wgrad)

    def _finish_init(self) -> None:
        """Call at the end of a subclass __init__: from here on, setattr warns."""
        if self._state_at_init:
            self._delayed_state_pair(DEFAULT_HISTORY_LEN)
        self.__dict__["_initialized"] = True

    def _set_by_torch(self, name: str) -> None:
        if name == "_is_fsdp_managed_module":  # FSDP2 replaced the parameters
            self._parameters_replaced()

    def train(self, mode: bool = True) -> TransformerEngineBaseModule:
        self.__dict__["training"] = mode
        for module in self.children():
            module.train(mode)
        return self

    def _apply(self, fn, recurse: bool = True):
        """nn.Module.to()/.half()/.cuda()/to_empty() and the like: the module then computes in
        the parameters' new dtype (params_dtype follows them) on their device (the scaling
        state moves along), and FP8 weight copies made from the old tensors are dropped."""
        result = super()._apply(fn, recurse)
        params = list(self.parameters(recurse=False))
        dtypes = {p.dtype for p in params if p.is_floating_point()}
        if len(dtypes) == 1 and (dtype := dtypes.pop()) in SUPPORTED_DTYPES:
            self.__dict__["params_dtype"] = dtype
        devices = {p.device for p in params}
        if len(devices) == 1 and (device := devices.pop()) != self.device:
            self._move_state(device)
        self._parameters_replaced()
        return result

    def _parameters_replaced(self) -> None:
        """Parameters were replaced (to_empty makes new ones; te.fsdp wraps them): forget the
        FP8 weight copies made from the old ones and the plans holding them (and quantizers of
        old states)."""
        for setup in self._fp8_setups.values():
            setup.drop_weight_caches()
        self.__dict__.update(_plans={}, _last_plan=None)

    def _move_state(self, device: torch.device) -> None:
        """The parameters moved to `device`: the module's device and FP8 state follow (with a
        scaling state loaded while the module was on the meta device)."""
        self.__dict__.update(device=device, _autocast_type=_autocast_type(device), _fp8_setups={})
        for pair in self._delayed_states.values():
            for state in pair:
                moved_state(state, device)
        self._attach_weight_quantizers()
        pending = self.__dict__.pop("_pending_scaling_state", None)
        if pending is not None and device.type != "meta":
            self._load_scaling_state(pending)

    def _follow_materialized_parameters(self) -> bool:
        """A module built on the meta device whose parameters were then replaced by real ones
        without nn.Module.to / to_empty (HF transformers' from_pretrained loads so): its
        device and FP8 state follow the parameters. Whether that happened."""
        if self.device.type != "meta":
            return False
        devices = {p.device for p in self.parameters(recurse=False)}
        if len(devices) != 1 or (device := devices.pop()).type == "meta":
            return False
        self._move_state(device)
        self._parameters_replaced()
        return True

    # -- parameters -------------------------------------------------------------------------------

    def _parameter_inits(self) -> list[ParameterInit]:
        """How each parameter is initialized (subclasses say; see _lifecycle.ParameterInit)."""
        return []

    def _fp8_weight_slots(self) -> list[tuple[str, int]]:
        """(parameter name, GEMM) of each weight that may be an FP8 parameter."""
        inits = self._parameter_inits()
        return [(n, spec.gemm) for spec in inits if spec.gemm is not None for n in spec.names]

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Initialize every parameter again as the constructor did (init_method for weights,
        ones or zeros for norms, zeros for biases), in place; FP8 weights are requantized. After
        deferred initialization (`with torch.device("meta")`, then `to_empty(device=...)`) this
        gives the parameters their values. defer_init=True does nothing (Transformer Engine's
        argument: the parameters stay uninitialized). Parameters still on the meta device are
        first made, as Transformer Engine does, on the module's device, or on the default device
        (the current CUDA device; the CPU where there is none) when that is the meta device
        too."""
        if defer_init:
            return
        if any(p.is_meta for p in self.parameters(recurse=False)):
            device = self.device if self.device.type != "meta" else default_device(None)
            self.to_empty(device=device, recurse=False)
        recipe = self._model_init_recipe

        def prime(full_hp: torch.Tensor, gemm: int) -> None:
            self._fp8_setup(recipe).prime_weight(full_hp, gemm)

        reinitialize(self, self._parameter_inits(), prime if recipe is not None else None)

    def _attach_weight_quantizers(self) -> None:
        """Give FP8 weight parameters the quantizers of this module's current scaling state
        (after the state was moved or the module copied or unpickled)."""
        recipe = self._model_init_recipe
        if recipe is None:
            return
        # Not _fp8_setup: the recipe need not run where the module now is (the meta device).
        setup = self._fp8_setups.get(recipe) or self._new_fp8_setup(recipe)
        for name, gemm in self._fp8_weight_slots():
            param = self._parameters.get(name)
            if isinstance(param, QuantizedTensor) and hasattr(param, "_quantizer"):
                param._quantizer = setup.weight[gemm]

    # -- FP8 state ------------------------------------------------------------------------------

    def _fp8_setup(self, recipe: Recipe) -> FP8Setup:
        """The quantizers for `recipe` (built once, after the recipe is checked)."""
        setup = self._fp8_setups.get(recipe)
        if setup is None:
            check_recipe(recipe, self.device)
            setup = self._fp8_setups[recipe] = self._new_fp8_setup(recipe)
        return setup

    def _new_fp8_setup(self, recipe: Recipe) -> FP8Setup:
        """Quantizers for `recipe` over this module's scaling state (the recipe unchecked);
        split over tensor-parallel ranks, current scaling reduces its amaxes over them."""
        setup = new_setup(recipe, self.num_gemms, self._delayed_state_pair)
        tp = getattr(self, "_tp", None)
        if tp is not None and tp.split:
            setup.reduce_current_amaxes(_AmaxReduction(self))
        return setup

    def _delayed_state_pair(self, history_len: int):
        pair = self._delayed_states.get(history_len)
        if pair is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"te.{type(self).__name__}: torch.compile cannot create the delayed-scaling "
                    f"state of amax_history_len={history_len} inside a compiled forward (its "
                    "backward updates it in place); run one step eagerly under this recipe "
                    f"first, or use the default amax_history_len={DEFAULT_HISTORY_LEN}, whose "
                    "state is made with the module"
                )
            with keeping_out_of_inference():
                pair = tuple(
                    DelayedScalingState(
                        forward, history_len, self.device, self.num_gemms, self._slot_major
                    )
                    for forward in (True, False)
                )
            self._delayed_states[history_len] = pair
        return pair

    def nonfinite_amax_count(self) -> int:
        """How many times a tensor of this module quantized under delayed scaling held a NaN or
        inf (its amax was left out of the history and its scale kept), over all its tensors and
        history lengths. Reading it waits for the device."""
        counts = [s.nonfinite.sum() for pair in self._delayed_states.values() for s in pair]
        return int(torch.stack(counts).sum().item()) if counts else 0

    def get_extra_state(self) -> torch.Tensor:
        """The delayed-scaling state (scales, amax histories and non-finite counts of the last
        used history length) as Transformer Engine's uint8 tensor of pickled bytes (1-D, on the
        CPU; see _te_extra_state.py); empty when the module has not run under delayed scaling."""
        name = f"te.{type(self).__name__}"
        self._follow_materialized_parameters()
        state = self._scaling_state()
        return to_te_extra_state(state, name, self.num_gemms, self._slot_major, None)

    def set_extra_state(self, state: torch.Tensor | io.BytesIO | dict[str, Any] | None) -> None:
        """Load what get_extra_state made, Transformer Engine's forms of it (the uint8 tensor,
        1.x's io.BytesIO) or torchte's older dict form. ExtraStateError names anything missing
        or wrong."""
        if is_te_extra_state(state):
            name = f"te.{type(self).__name__}"
            state = from_te_extra_state(state, name, self.num_gemms, self._slot_major)
        self._load_scaling_state(state)

    def _scaling_state(self) -> dict[str, Any]:
        """The delayed-scaling state as a dict of tensors (copies; see
        _lifecycle.extra_state_of); {} when the module has not run under delayed scaling.
        On the meta device: the state loaded there, kept until the module is materialized."""
        pending = self.__dict__.get("_pending_scaling_state")
        if pending is not None:
            return pending
        length = self._saved_history_len
        return {} if length is None else extra_state_of(length, *self._delayed_states[length])

    def _load_scaling_state(self, state: dict[str, Any] | None) -> None:
        """Load a dict made by _scaling_state (nothing for None or {})."""
        name = f"te.{type(self).__name__}"
        state = read_extra_state(state, name)
        if state is None:
            return
        if self.device.type == "meta":  # no values here: loaded once the module is real
            self.__dict__["_pending_scaling_state"] = state
            return
        length = state["amax_history_len"]
        fwd, bwd = self._delayed_state_pair(length)
        try:
            fwd.load(state["fwd_scale"], state["fwd_amax_history"])
            bwd.load(state["bwd_scale"], state["bwd_amax_history"])
            load_counts(state, fwd, bwd)
        except ValueError as err:
            raise ExtraStateError(f"{name}: {err}") from None
        self.__dict__["_saved_history_len"] = length

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        except ExtraStateError as err:
            raise ExtraStateError(f"cannot load {prefix}_extra_state: {err}") from None

    # -- per call ----------------------------------------------------------------------------------

    def _compute_dtype(self) -> torch.dtype:
        """params_dtype, or torch.autocast's dtype where it is on for this device."""
        device_type = self._autocast_type
        if device_type is not None and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        if self.__dict__.get("_is_fsdp_managed_module"):
            return self._gathered_dtype()
        return self.params_dtype

    def _gathered_dtype(self) -> torch.dtype:
        """Under FSDP2: the dtype its all-gather gave the parameters (a MixedPrecisionPolicy's
        param_dtype; FP8-gathered weights stand for it), as nn.Linear computes in; params_dtype
        when there is none."""
        for param in self._parameters.values():
            if param is not None and param.dtype in SUPPORTED_DTYPES:
                return param.dtype
        return self.params_dtype

    def _plan(self, dtype, is_first_microbatch, fp8_output, fp8_grad):
        """The plan for the autocast state and these flags (built once by _build_plan)."""
        state = _STATE
        fp8, calibrating = state.enabled, state.calibrating and not state.enabled
        recipe = state.recipe if (fp8 or calibrating) else None
        group = state.group if recipe is not None else None
        # A plain tuple: equal to (and hashed as) the PlanKey _build_plan is given, made faster.
        key = (fp8, calibrating, recipe, group, dtype, is_first_microbatch, fp8_output, fp8_grad)
        last = self._last_plan
        if last is not None and last[0] == key:
            return last[1]
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build_plan(PlanKey._make(key))
            self._plans[key] = plan
        self.__dict__["_last_plan"] = (key, plan)
        self._note_fp8_recipe(recipe)  # fp8_meta's recipe; warns where its type changed
        return plan

    def _build_plan(self, key: PlanKey):
        raise NotImplementedError

    def _guarded_forward(self, setup: FP8Setup | None, group, run: Callable):
        """run() inside an NVTX range; a failure drops the step's recorded amaxes of this
        module (rule 2: nothing half-recorded survives), success registers the scale update."""
        if setup is not None and setup.records_amax and transforms_active():
            raise NotImplementedError(
                f"te.{type(self).__name__}: delayed scaling (and calibration) record amaxes into "
                "the module's scaling state in place, which torch.func transforms (grad, vjp, "
                "vmap, ...) do not allow; under torch.func use recipe.Float8CurrentScaling, or "
                "run without FP8"
            )
        _nvtx.range_push(self._nvtx_name)
        try:
            out = run()
        except BaseException:
            if setup is not None:
                setup.forward_failed()
            raise
        finally:
            _nvtx.range_pop()
        if setup is not None and setup.records_amax:
            setup.forward_done(group)
            self.__dict__["_saved_history_len"] = setup.recipe.amax_history_len
        return out

    def _fp8_weight(self, weight, plan, is_first_microbatch, need_columnwise, params):
        """The FP8 weight of GEMM plan.gemm: a quantized parameter's own storage (Float8Tensor,
        or a block-scaled one), or the cached quantized copy (requantized when one of `params`,
        the parameters the weight is made of, changed, or the step's scale moved). The
        columnwise (transposed) copy is made only where backward runs FP8 GEMMs
        (plan.fp8_backward: not under a backward_override)."""
        if not plan.fp8:
            return None
        need_columnwise = need_columnwise and plan.fp8_backward
        if isinstance(weight, QuantizedTensor) and hasattr(weight, "_storage"):
            storage = weight._storage
            if need_columnwise and storage.columnwise_data is None:
                storage = columnwise_weight(weight, plan.setup.weight[plan.gemm])
            return storage
        setup = plan.setup
        quantizer = setup.weight[plan.gemm]
        if torch.compiler.is_compiling():
            # A traced graph quantizes the weight at every call: a cache read there would be a
            # guard on the weight's version, failing (recompiling) at every step.
            with torch.no_grad():
                return quantizer.quantize(weight, columnwise=need_columnwise)
        if torch.is_grad_enabled() and transforms_active():  # see module/_functorch.py

            def quantize_plain() -> Float8Storage:
                with torch.no_grad():
                    return quantizer.quantize(plain(weight), columnwise=need_columnwise)

            return Deferred(quantize_plain)
        generation = (_STATE.step, setup.weight_generation())
        return fp8_weight_cached(
            setup.weight_cache[plan.gemm],
            weight,
            quantizer,
            self._weight_version(params),
            generation,
            is_first_microbatch,
            need_columnwise,
        )

    def _weight_version(self, params):
        """What a cached FP8 copy of the weight `params` is keyed by (weight_version). Under
        FSDP2 a key equal to no other: its all-gathers rewrite the unsharded weights in place
        without moving their _version, so the copy is made anew at each forward
        (is_first_microbatch=False still reuses it, as across microbatches)."""
        if self.__dict__.get("_is_fsdp_managed_module"):
            return object()
        return weight_version(params)

    def __getstate__(self) -> dict:
        # Plans hold weakrefs to this module's parameters: a copy builds its own.
        state = self.__dict__.copy()
        state.update(_plans={}, _last_plan=None, _fp8_setups={})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # FP8 weight parameters come back without their quantizers (views into the state).
        self._attach_weight_quantizers()

    # -- checks shared by forwards ----------------------------------------------------------------

    def _check_input(self, inp: torch.Tensor, features: int, what: str = "in_features") -> None:
        """Raise before any kernel runs when `inp` cannot go through this module."""
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{type(self).__name__} input must be a torch.Tensor, got {inp!r}")
        if inp.dim() == 0 or inp.shape[-1] != features:
            raise ValueError(
                f"{type(self).__name__}: input's last dimension is "
                f"{inp.shape[-1] if inp.dim() else 'missing (0-d input)'}, "
                f"but {what} is {features}"
            )
        if inp.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{type(self).__name__}: input dtype {inp.dtype} is not supported; "
                "use torch.float32, torch.bfloat16 or torch.float16"
            )
        if inp.device != self.device and not (
            self._follow_materialized_parameters() and inp.device == self.device
        ):
            raise ValueError(
                f"{type(self).__name__}: input is on {inp.device} but the module's parameters "
                f"are on {self.device}"
            )


def _autocast_type(device: torch.device) -> str | None:
    """The device type torch.autocast is asked about for `device`; None where it has none
    (the meta device, used for deferred initialization and shape inference)."""
    return device.type if torch.amp.is_autocast_available(device.type) else None


def weight_version(params) -> tuple:
    """What a cached FP8 weight is keyed by: each parameter's identity and _version counter (a
    functional_call with other tensors of the same version must not get the cached copy)."""
    return tuple((id(p), p._version) for p in params)


def check_fp8_dims(module: str, **dims: int) -> None:
    """FP8 GEMMs need every named dimension divisible by 16."""
    for name, size in dims.items():
        if size % 16 != 0:
            raise ValueError(
                f"{module}: FP8 GEMMs need {name} divisible by 16, but {name} is {size}; "
                "pad it or run this layer outside te.autocast"
            )


class _AmaxReduction:
    """All-reduces a (1,) amax with MAX over a module's tensor-parallel group (read at each call:
    set_tensor_parallel_group may set it after the quantizers exist); holds the module weakly."""

    __slots__ = ("_module",)

    def __init__(self, module) -> None:
        self._module = weakref.ref(module)

    def __call__(self, amax: torch.Tensor) -> None:
        self._module()._tp.reduce_max(amax)
