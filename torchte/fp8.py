"""Transformer Engine's `FP8GlobalStateManager`, the class clients query for the FP8 settings in
force (`from transformer_engine.pytorch.fp8 import FP8GlobalStateManager`), answered from
torchte's own state: te.autocast's (per thread) and quantized_model_init's; the updates of
delayed-scaling state a client asks for by hand and `quantization_state` (fp8_state.py); and
its `check_*_support()` functions, (supported, reason) for each recipe family on the default
device.
"""

from __future__ import annotations

import torch

from . import fp8_state
from ._device import (
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .autocast import autocast_state, default_recipe
from .graphs.state import making_graphs
from .module.fp8_padding import get_align_size_for_quantization
from .quantization.model_init import model_init_settings
from .recipe import Recipe

__all__ = [
    "FP8GlobalStateManager",
    "check_fp8_block_scaling_support",
    "check_fp8_support",
    "check_mxfp8_support",
    "check_nvfp4_support",
    "get_align_size_for_quantization",
]


def check_fp8_support() -> tuple[bool, str]:
    """(supported, reason) for DelayedScaling and Float8CurrentScaling on the device modules are
    built on by default: `te.is_fp8_available(return_reason=True)`."""
    return is_fp8_available(return_reason=True)


def check_mxfp8_support() -> tuple[bool, str]:
    """(supported, reason) for MXFP8BlockScaling: see torchte.is_mxfp8_available."""
    return is_mxfp8_available(return_reason=True)


def check_fp8_block_scaling_support() -> tuple[bool, str]:
    """(supported, reason) for Float8BlockScaling: see torchte.is_fp8_block_scaling_available."""
    return is_fp8_block_scaling_available(return_reason=True)


def check_nvfp4_support() -> tuple[bool, str]:
    """(supported, reason) for NVFP4BlockScaling: see torchte.is_nvfp4_available."""
    return is_nvfp4_available(return_reason=True)


class FP8GlobalStateManager:
    """Class methods with Transformer Engine's names over torchte's FP8 state.

    quantization_state: Transformer Engine's object of the same name (fp8_state.py), whose
    fields read and write te.autocast's state of the calling thread."""

    quantization_state = fp8_state.quantization_state

    # (supported, reason), as Transformer Engine's class methods of these names answer.
    is_fp8_available = staticmethod(check_fp8_support)
    is_mxfp8_available = staticmethod(check_mxfp8_support)
    is_fp8_block_scaling_available = staticmethod(check_fp8_block_scaling_support)
    is_nvfp4_available = staticmethod(check_nvfp4_support)

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """Whether modules run in FP8 here (inside te.autocast(enabled=True))."""
        return autocast_state().enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        """Whether modules record amaxes in high precision here (calibrating=True)."""
        return autocast_state().calibrating

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """Whether modules built here store FP8 parameters (inside quantized_model_init)."""
        return model_init_settings() is not None

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        """Whether FP8 parameters built here keep their high-precision initial value
        (quantized_model_init(preserve_high_precision_init_val=True))."""
        return cls.quantization_state.high_precision_init_val

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """Whether a CUDA graph is being captured on the current stream, or make_graphed_callables
        is warming up and capturing (False while torch.compile traces)."""
        if torch.compiler.is_compiling():
            return False
        if making_graphs():
            return True
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The recipe of the innermost te.autocast (DelayedScaling() outside any)."""
        state = autocast_state()
        return state.recipe if state.depth else default_recipe()

    @classmethod
    def get_fp8_group(cls):
        """The amax reduction group of the innermost te.autocast (None outside any)."""
        return autocast_state().group

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first call inside the outermost te.autocast region, False after (and
        outside any region)."""
        state = autocast_state()
        first, state.first_module = state.first_module, False
        return first

    @classmethod
    def get_fp8_autocast_state(cls) -> tuple:
        """(enabled, calibrating, recipe, group, is-first-module, graph capturing)."""
        state = autocast_state()
        return (
            state.enabled,
            state.calibrating,
            state.recipe,
            state.group,
            state.first_module,
            cls.fp8_graph_capturing(),
        )

    @classmethod
    def set_fp8_autocast_state(cls, fp8_state: tuple) -> None:
        """Restore what get_fp8_autocast_state returned (the capturing flag is the stream's)."""
        state = autocast_state()
        enabled, calibrating, recipe, group, first = fp8_state[:5]
        if not isinstance(recipe, Recipe):
            raise TypeError(f"set_fp8_autocast_state: the recipe must be a Recipe, got {recipe!r}")
        state.enabled, state.calibrating = bool(enabled), bool(calibrating)
        state.recipe, state.group, state.first_module = recipe._frozen(), group, bool(first)

    get_autocast_state = get_fp8_autocast_state  # Transformer Engine 2.x's names
    set_autocast_state = set_fp8_autocast_state

    @classmethod
    def reset(cls) -> None:
        """FP8 off in this thread: te.autocast's settings back to their defaults, no update owed
        by hand, no skip flag tensor (scaling state already recorded in modules is kept)."""
        state = autocast_state()
        state.enabled = state.calibrating = state.first_module = False
        state.recipe, state.group = default_recipe(), None
        fp8_state.reset()

    # -- delayed-scaling updates a client asks for (fp8_state.py) ----------------------------

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta) -> None:
        """Owe the delayed-scaling state of `fp8_meta` (a te module: its state of the current
        recipe's history length; or a dict with "recipe", "fp8_group", "scaling_fwd",
        "scaling_bwd") its updates: the forward state's at the outermost te.autocast exit (or
        the next reduce_and_update_fp8_tensors(forward=True)), the backward state's at the
        next reduce_and_update_fp8_tensors(forward=False). Nothing for other recipes."""
        fp8_state.add_to_global_buffer(fp8_meta)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Delayed scaling: all-reduce (MAX, over each state's amax reduction group where its
        recipe asks for it) the newest amaxes of the states owed an update in this direction,
        then update their scales and amax histories, now (each state once)."""
        if not isinstance(forward, bool):
            raise TypeError(
                f"reduce_and_update_fp8_tensors: forward must be a bool, got {forward!r}"
            )
        fp8_state.reduce_and_update(forward)

    @staticmethod
    def reduce_tensor_across_group_op_max(tensor: torch.Tensor, group) -> None:
        """All-reduce `tensor` in place with MAX over `group` (nothing without
        torch.distributed)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)

    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        """Transformer Engine's key of the forward or backward scaling state in fp8_meta."""
        return "scaling_fwd" if forward else "scaling_bwd"

    @staticmethod
    def get_fwd_bwd_key(forward: bool = True) -> str:
        return "forward" if forward else "backward"

    # -- the FP8 weight-update flag of CUDA-graph replays ------------------------------------

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        """Fill the (1,) fp32 flag tensor with `skip` in place (made on first use on the
        current CUDA device, or the CPU without one), so a captured graph reading it sees each
        new value. Transformer Engine's modules skip requantizing cached FP8 weights in a
        replay where it is 1; torchte's graphs requantize FP8 weights in every replay and
        read no flag (fp8_weight_caching gives the results of caching off)."""
        state = cls.quantization_state
        if state.skip_fp8_weight_update_tensor is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            state.skip_fp8_weight_update_tensor = torch.empty(1, dtype=torch.float32, device=device)
        state.skip_fp8_weight_update_tensor.fill_(float(bool(skip)))

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> torch.Tensor | None:
        """The flag tensor set_skip_fp8_weight_update_tensor fills (None before the first)."""
        return cls.quantization_state.skip_fp8_weight_update_tensor
