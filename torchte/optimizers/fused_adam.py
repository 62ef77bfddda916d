"""FusedAdam: Transformer Engine's Adam / AdamW with master weights and low-precision states.

The update: on a CUDA device, one Triton launch per group and combination of dtypes
(kernels/adam_states.py) that reads every state in its own dtype (fp32, bf16, fp16) and writes
the params of fp32 masters in the same pass; elsewhere, and for masters kept as remainders,
torch's fused Adam kernel or a foreach reference through fp32 working copies (`_adam.py`).
What this file adds is Transformer Engine's state handling:

- master weights (`master_weights=True`): an fp32 (or scaled fp16) copy of each bf16 / fp16
  / FP8 parameter that the math updates, the parameter then getting its rounded value. With
  `store_param_remainders` a bf16 parameter keeps only the low 16 bits of its fp32 master
  (int16): the master is the parameter's bits and the remainder.
- states in lower precision (`exp_avg_dtype`, `exp_avg_sq_dtype`, `master_weight_dtype`):
  bf16 is stored rounded; fp16 and uint8 (FP8 e4m3, a Float8Tensor) are stored scaled by a
  per-tensor fp32 factor (`_scales`) so that the tensor's max |x| maps to half the fp16 range
  / to 448. `get_unscaled_state` / `set_scaled_state` read and write them in fp32.
- FP8 parameters (torchte's Float8Tensor, e.g. from `te.quantized_model_init`): updated
  through their fp32 master, then requantized in place by their own quantizer
  (`Float8Tensor.quantize_`: a delayed-scaling quantizer casts with its scale and records the
  amax, current scaling takes a new scale).
- `capturable=True`: lr and step are device tensors, a GradScaler's inf check skips the step
  on the device, nothing synchronizes (CUDA-graph capture).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch

from torchte.kernels import adam_states
from torchte.kernels._triton import triton_available
from torchte.quantization.base import QuantizedTensor

from . import multi_tensor
from ._adam import (
    AdamHyper,
    adam_update_,
    bias_corrections,
    masters_from_remainders,
    split_into_remainders,
)
from ._adam_plan import Batch, Entry, kernel_takes
from ._adam_states import (
    STATE_NAMES,
    STATE_RANGES,
    check_args,
    like_param,
    new_state,
    read_unscaled,
    store_scaled_,
)
from ._lists import DTensor, fp32, local_tensor

__all__ = ["FusedAdam"]


class FusedAdam(torch.optim.Optimizer):
    """Adam (`adam_w_mode=False`) or AdamW, Transformer Engine's `te.optimizers.FusedAdam`.

    Arguments and defaults are Transformer Engine's: lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0, amsgrad=False (refused), and keyword-only bias_correction=True,
    adam_w_mode=True, capturable=False, master_weights=False, master_weight_dtype=fp32 (or
    fp16), exp_avg_dtype / exp_avg_sq_dtype = fp32 (or fp16, bf16, torch.uint8 for FP8),
    use_decoupled_grad=False (read `param.decoupled_grad` instead of `.grad`),
    store_param_remainders=False (bf16 params with fp32 masters only), set_grad_none
    (deprecated). Params: fp32, bf16, fp16 or Float8Tensor (needs master_weights); works on
    CPU and CUDA. The step count lives in each param group (`group["step"]`).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
    ) -> None:
        dtypes = (master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype)
        check_args(lr, betas, eps, weight_decay, amsgrad, dtypes, capturable, master_weights)
        if capturable:
            lr = torch.tensor(float(lr), dtype=torch.float32)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        first = [g["params"][0] for g in self.param_groups if g["params"]]
        device = first[0].device if first else torch.device("cpu")
        if capturable:
            self._place_capturable_tensors()
            self._step_supports_amp_scaling = True
        # The noop flag of the multi-tensor functions (capturable: the last step's inf check).
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.multi_tensor_adam = multi_tensor.multi_tensor_adam
        self.multi_tensor_adam_param_remainder = multi_tensor.multi_tensor_adam_param_remainder
        self.multi_tensor_adam_fp8 = multi_tensor.multi_tensor_adam_fp8
        self.multi_tensor_adam_capturable = multi_tensor.multi_tensor_adam_capturable
        self.multi_tensor_adam_capturable_master = multi_tensor.multi_tensor_adam_capturable_master
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = dict(
            zip(STATE_NAMES, (exp_avg_dtype, exp_avg_sq_dtype, master_weight_dtype), strict=True)
        )
        # A scaled state's max |x| maps to this (half the fp16 range, the e4m3 maximum).
        self.dtype_to_range_map = dict(STATE_RANGES)
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._entries: dict[torch.Tensor, Entry] = {}  # routes kept between steps
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        if capturable and self.store_param_remainders:
            raise RuntimeError(
                "FusedAdam: capturable mode does not support store_param_remainders."
            )
        # Whether bf16 moments are updated without an fp32 copy kept between steps (always).
        self.fuse_unscale = exp_avg_dtype == exp_avg_sq_dtype == torch.bfloat16
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn(
                "set_grad_none kwarg in FusedAdam constructor is deprecated. "
                "Use set_to_none kwarg in zero_grad instead.",
                DeprecationWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------------
    # Gradients
    # ------------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Reset the gradients (`.decoupled_grad` with use_decoupled_grad): to None (default,
        or the deprecated set_grad_none) or to zeros."""
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(
                    f"Called zero_grad with set_to_none={set_to_none}, but FusedAdam was "
                    f"initialized with set_grad_none={self.set_grad_none}"
                )
            set_to_none = self.set_grad_none
        set_to_none = True if set_to_none is None else set_to_none
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        if self.use_decoupled_grad:
            return getattr(p, "decoupled_grad", None)
        return p.grad

    # ------------------------------------------------------------------------------------------
    # States
    # ------------------------------------------------------------------------------------------

    def _check_state_name(self, state_name: str) -> torch.dtype:
        if state_name not in self.name_to_dtype_map:
            raise ValueError(
                f"FusedAdam: unknown optimizer state {state_name!r}; expected one of {STATE_NAMES}"
            )
        return self.name_to_dtype_map[state_name]

    def _uses_remainders(self, param: torch.Tensor, state_name: str) -> bool:
        """Whether this param's master is kept as int16 remainders (bf16, not quantized)."""
        return (
            self.store_param_remainders
            and state_name == "master_param"
            and param.dtype == torch.bfloat16
            and not isinstance(local_tensor(param), QuantizedTensor)
        )

    def _apply_scale(
        self,
        state_name: str,
        unscaled_state: torch.Tensor,
        scaled_state: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        """Store fp32 `unscaled_state` into the low-precision `scaled_state`; for fp16 and FP8
        states the factor (max |x| / range) is written to `scale` (1,) fp32 and divided out.
        `unscaled_state` is not modified."""
        store_scaled_(scaled_state, unscaled_state, self.name_to_dtype_map[state_name], scale)

    def get_unscaled_state(
        self, param: torch.Tensor, state_name: str, skip_unscale: bool = False
    ) -> torch.Tensor:
        """The state `state_name` ("exp_avg", "exp_avg_sq", "master_param") of `param` in
        fp32, of the param's (local) shape: the state itself when it is fp32, else an fp32
        copy multiplied back by its scale. bf16 with skip_unscale: the bf16 state itself;
        masters kept as remainders: the int16 remainders."""
        dtype = self._check_state_name(state_name)
        state = self.state[param]
        if state_name not in state:
            raise KeyError(f"FusedAdam: the parameter has no {state_name!r} state yet")
        stored = local_tensor(state[state_name])
        scale = self._scales.get(param, {}).get(state_name)
        return read_unscaled(stored, dtype, scale, local_tensor(param).shape, skip_unscale)

    def set_scaled_state(
        self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor
    ) -> None:
        """Set the state `state_name` of `param` from an fp32 value (another float dtype is
        converted) of the param's number of elements (int16 remainders for a master kept as
        remainders), scaling it into the state's dtype. Creates the state if missing."""
        dtype = self._check_state_name(state_name)
        remainders = self._uses_remainders(param, state_name)
        unscaled_state = local_tensor(unscaled_state)
        if remainders and unscaled_state.dtype != torch.int16:
            raise TypeError(
                f"FusedAdam.set_scaled_state: {state_name} is kept as int16 remainders "
                f"(store_param_remainders) and must be given as int16, got {unscaled_state.dtype}"
            )
        if not remainders:
            if not unscaled_state.is_floating_point():
                raise TypeError(
                    f"FusedAdam.set_scaled_state: {state_name} must be a floating-point tensor "
                    f"(fp32), got {unscaled_state.dtype}"
                )
            unscaled_state = unscaled_state.float()  # a bf16 / fp16 checkpoint value: exact
        local_param = local_tensor(param)
        if unscaled_state.numel() != local_param.numel():
            raise ValueError(
                f"FusedAdam.set_scaled_state: {state_name} has {unscaled_state.numel()} elements, "
                f"the parameter {local_param.numel()}"
            )
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False, remainders)
        stored = local_tensor(self.state[param][state_name])
        if dtype != torch.float32:
            self._apply_scale(state_name, unscaled_state, stored, self._scales[param][state_name])
        else:
            stored.copy_(unscaled_state.reshape(stored.shape))

    def _initialize_state(
        self,
        param: torch.Tensor,
        state_name: str,
        zero_buffer: bool,
        store_param_remainders: bool = False,
    ) -> None:
        """Create the state `state_name` of `param` (zeros), in its dtype; a scale of 1 for a
        state not in fp32. A DTensor param gets DTensor states (checkpointing)."""
        dtype = self._check_state_name(state_name)
        local_param = local_tensor(param)
        data = like_param(new_state(local_param, dtype, store_param_remainders), param)
        self.state[param][state_name] = data
        if dtype != torch.float32:
            scales = self._scales.setdefault(param, {})
            scales[state_name] = torch.ones(1, dtype=torch.float32, device=local_param.device)

    @torch.no_grad()
    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool | None = None):
        """Create `param`'s states: zero moments and, with master weights, the master (a copy
        of the param's value, or zero remainders). store_param_remainders: default, whether
        this optimizer keeps this param's master as remainders."""
        if store_param_remainders is None:
            store_param_remainders = self._uses_remainders(param, "master_param")
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if not self.master_weights:
            return
        self._initialize_state(param, "master_param", False, store_param_remainders)
        if not store_param_remainders:
            local_param = local_tensor(param)
            if isinstance(local_param, QuantizedTensor):
                master = local_param.dequantize(dtype=torch.float32)
            else:
                master = local_param.detach().float()
            self.set_scaled_state(param, "master_param", master.clone())

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------

    def _saved_to_params(self, saved_groups: list[dict[str, Any]]) -> dict[Any, torch.Tensor]:
        return dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=True,
            )
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict with every state in fp32 (unscaled): low-precision
        states load back into an optimizer of other state dtypes."""
        state_dict = super().state_dict()
        params = self._saved_to_params(state_dict["param_groups"])
        for key, values in state_dict["state"].items():
            param = params[key]
            unscaled = {}
            for name in values:
                unscaled[name] = like_param(self.get_unscaled_state(param, name), param)
            state_dict["state"][key] = unscaled
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (of FusedAdam's fp32 form); each state is stored again in this
        optimizer's dtype with set_scaled_state, from the given (not dtype-cast) values."""
        super().load_state_dict(state_dict)
        self._entries.clear()
        params = self._saved_to_params(state_dict["param_groups"])
        for key, values in state_dict["state"].items():
            param = params[key]
            self.state[param] = {}
            for name, value in values.items():
                if value is None:
                    continue
                self._check_state_name(name)
                value = local_tensor(value)
                if not self._uses_remainders(param, name):
                    value = value.float()
                with torch.no_grad():
                    self.set_scaled_state(param, name, value)
        if self.capturable:
            self._place_capturable_tensors()
        else:
            for group in self.param_groups:
                if isinstance(group.get("step"), torch.Tensor):
                    group["step"] = int(group["step"].item())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group; capturable: the group's lr becomes a device tensor."""
        super().add_param_group(param_group)
        if getattr(self, "capturable", False):  # not yet set while __init__ adds the groups
            self._place_capturable_tensors()

    def _place_capturable_tensors(self) -> None:
        """lr and step as fp32 / int32 tensors on each group's device (capturable)."""
        for group in self.param_groups:
            if not group["params"]:
                continue
            device = local_tensor(group["params"][0]).device
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)
            if "step" in group:
                step = torch.as_tensor(group["step"], dtype=torch.int32).reshape(1)
                group["step"] = step.to(device)

    # ------------------------------------------------------------------------------------------
    # The step
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One Adam step of every param with a gradient; returns closure's loss (or None).

        grad_scaler (capturable only, as a torch GradScaler passes itself): its inf check
        skips the step on the device and its scale unscales the gradients.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group, grad_scaler)
        return loss

    def _amp_state(self, device, grad_scaler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(found_inf (1,) fp32, inv_scale (1,) fp32 or None) of a capturable step."""
        if grad_scaler is None:
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = None
        else:
            found_inf = grad_scaler._check_inf_per_device(self)[device].float().reshape(1)
            inv_scale = grad_scaler._get_scale_async().double().reciprocal().float().reshape(1)
        if self._dummy_overflow_buf.device == device:
            self._dummy_overflow_buf.copy_(found_inf)
        return found_inf, inv_scale

    def _advance_step(self, group, found_inf) -> None:
        """Count this step in the group, also an empty one (all ranks keep the same count);
        capturable: on the device, not counting a step the inf check skips."""
        if not self.capturable:
            group["step"] = group.get("step", 0) + 1
            return
        taken = (found_inf == 0).to(torch.int32)
        if "step" in group:
            group["step"] += taken
        else:
            group["step"] = taken.clone()

    def _step_group(self, group, grad_scaler) -> None:
        params = group["params"]
        device = local_tensor(params[0]).device if params else self._dummy_overflow_buf.device
        batch = Batch()
        for p in params:
            self._collect(p, batch)
        if len(batch.devices) > 1:
            raise ValueError(
                f"FusedAdam: the params of one group must be on one device, got {batch.devices}"
            )
        if self.capturable and (batch.requantize or batch.rescale or batch.remainder.grads):
            raise RuntimeError(
                "FusedAdam with capturable=True does not support FP8 parameters, scaled "
                "(fp16 / fp8) states or param remainders: their updates cannot be captured."
            )
        found_inf, inv_scale = (None, None)
        if self.capturable:
            found_inf, inv_scale = self._amp_state(device, grad_scaler)
        self._advance_step(group, found_inf)
        self._update(group, batch, found_inf, inv_scale)
        self._finish(batch)

    def _collect(self, p: torch.Tensor, batch: Batch) -> None:
        """Put p (if it has a gradient) on its route, with fp32 copies of scaled states: the
        route kept from an earlier step where it still holds (_adam_plan.Entry)."""
        entry = self._entries.get(p)
        if entry is not None and entry.current(self.state[p]):
            grad = self._grad_of(p)
            if grad is None or entry.add(grad, batch):
                return
        self._route(p, batch)

    def _route(self, p: torch.Tensor, batch: Batch) -> None:
        """_collect's full route of p, whose Entry is kept where the route can be."""
        self._entries.pop(p, None)
        state = self.state[p]
        if len(state) == 0:
            self.initialize_state(p)
        grad = self._grad_of(p)
        local_p = local_tensor(p)
        if grad is None or local_p.numel() == 0:
            return
        if grad.is_sparse:
            raise RuntimeError("FusedAdam does not support sparse gradients.")
        if isinstance(p, DTensor) != isinstance(grad, DTensor):
            raise RuntimeError(
                "FusedAdam: a DTensor parameter needs a DTensor gradient, a plain one a plain one"
            )
        grad = local_tensor(grad)
        if grad.shape != local_p.shape:
            raise ValueError(
                f"FusedAdam: gradient of shape {tuple(grad.shape)} for a parameter of shape "
                f"{tuple(local_p.shape)}"
            )
        batch.devices.add(local_p.device)
        rescaled = len(batch.rescale)
        exp_avg = self._working_state(p, "exp_avg", batch)
        exp_avg_sq = self._working_state(p, "exp_avg_sq", batch)
        kept = None  # (route, target, param, remainder) of an Entry
        if isinstance(local_p, QuantizedTensor):
            if not self.master_weights:
                raise RuntimeError(
                    f"FusedAdam without master_weights does not support {type(local_p).__name__}"
                    " parameters. Use master_weights=True."
                )
            master = self._working_state(p, "master_param", batch)
            batch.direct.add(grad, master, exp_avg, exp_avg_sq)
            batch.requantize.append((local_p, master))
        elif local_p.dtype in (torch.float16, torch.bfloat16):
            if not self.master_weights:
                kept = ("direct", local_p, None, None)
            elif self._uses_remainders(p, "master_param"):
                kept = ("remainder", None, local_p, local_tensor(state["master_param"]))
            else:
                master = self._working_state(p, "master_param", batch)
                kept = ("mastered", master, local_p, None)
        elif local_p.dtype == torch.float32:
            kept = ("direct", local_p, None, None)
        else:
            raise RuntimeError(
                "FusedAdam only supports model weights in fp32, fp16, bf16 and fp8 "
                f"(Float8Tensor), got {local_p.dtype}"
            )
        if kept is None:
            return
        route, target, param, remainder = kept
        getattr(batch, route).add(grad, target, exp_avg, exp_avg_sq, param, remainder)
        if local_p.dtype == torch.float32 and self.master_weights and "master_param" in state:
            batch.sync_masters.append(p)  # the master follows the fp32 param: no Entry
        elif len(batch.rescale) == rescaled:  # no per-step copies of scaled states
            names = STATE_NAMES if route != "direct" else STATE_NAMES[:2]
            self._entries[p] = Entry(
                route, target, exp_avg, exp_avg_sq, param, remainder,
                tuple(state[name] for name in names), local_p.shape, local_p.device,
                isinstance(p, DTensor), kernel_takes(target, exp_avg, exp_avg_sq, param),
            )  # fmt: skip

    def _working_state(self, p: torch.Tensor, name: str, batch: Batch) -> torch.Tensor:
        """The tensor the update reads and writes for state `name`: the state itself (fp32,
        bf16), or an fp32 copy that `_finish` scales back (fp16, FP8)."""
        if self.name_to_dtype_map[name] in (torch.float32, torch.bfloat16):
            return local_tensor(self.state[p][name])
        unscaled = self.get_unscaled_state(p, name)
        batch.rescale.append((p, name, unscaled))
        return unscaled

    def _update(self, group, batch: Batch, found_inf, inv_scale) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        step = group["step"]
        if not self.capturable:
            lr = float(lr)
            step = int(step)
        hyper = AdamHyper(
            lr=lr if self.capturable else fp32(lr),
            beta1=fp32(float(beta1)),
            beta2=fp32(float(beta2)),
            eps=fp32(float(group["eps"])),
            step=step,
            adamw=self.adam_w_mode == 1,
            bias_correction=bool(group["bias_correction"]),
            weight_decay=fp32(float(group["weight_decay"])),
        )
        amp = (found_inf, inv_scale)
        device_hyper = self._device_hyper(hyper, batch)
        for route, copies in ((batch.direct, None), (batch.mastered, batch.mastered.params)):
            if not route.grads:
                continue
            lists = (route.targets, route.grads, route.exp_avgs, route.exp_avg_sqs)
            if device_hyper is not None and route.kernel_ok:
                adam_states.adam_step_(
                    *lists, copies, device_hyper, _constants(hyper), *amp, checked=True
                )
                continue
            adam_update_(*lists, hyper, *amp)
            if copies is not None:
                torch._foreach_copy_(copies, route.targets)
        rem = batch.remainder
        if rem.grads:
            flat, masters = masters_from_remainders(rem.params, rem.remainders)
            adam_update_(masters, rem.grads, rem.exp_avgs, rem.exp_avg_sqs, hyper, *amp)
            split_into_remainders(flat, rem.params, rem.remainders)

    @staticmethod
    def _device_hyper(hyper: AdamHyper, batch: Batch) -> torch.Tensor | None:
        """(lr, bc1, bc2) as a (3,) fp32 tensor on the params' CUDA device, where the one-launch
        kernel (kernels/adam_states.py) runs the update; None elsewhere (the CPU, no Triton)."""
        (device,) = batch.devices or {torch.device("cpu")}
        if device.type != "cuda" or not triton_available():
            return None
        bc1, bc2 = bias_corrections(hyper, device)
        if isinstance(hyper.lr, torch.Tensor) or isinstance(bc1, torch.Tensor):
            values = [torch.as_tensor(x, dtype=torch.float32, device=device).reshape(())
                      for x in (hyper.lr, bc1, bc2)]  # fmt: skip
            return torch.stack(values)  # on the device: capturable
        host = torch.tensor([hyper.lr, bc1, bc2], dtype=torch.float32).pin_memory()
        return host.to(device, non_blocking=True)

    def _finish(self, batch: Batch) -> None:
        """After the update: FP8 params requantized from their masters, scaled states stored
        back, fp32 params' masters refreshed."""
        for param, master in batch.requantize:
            param.quantize_(master)
        for p, name, unscaled in batch.rescale:
            stored = local_tensor(self.state[p][name])
            self._apply_scale(name, unscaled, stored, self._scales[p][name])
        for p in batch.sync_masters:
            self.set_scaled_state(p, "master_param", local_tensor(p).detach().float())


def _constants(hyper: AdamHyper) -> adam_states.AdamStates:
    return adam_states.AdamStates(
        hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.adamw
    )
