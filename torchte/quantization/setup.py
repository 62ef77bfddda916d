"""FP8Setup: the quantizers of one module under one recipe, and what that recipe does per step.

Everything that differs between recipes lives here and in the quantizers, not in the modules:
which quantizers a recipe makes, whether producers can write FP8 themselves (a quantizer's
`fusable`), the delayed-scaling bookkeeping around a forward and a backward (when the scales
update, what a failed forward drops), and priming a new FP8 weight's scale. A module asks its
setup; it never tests which recipe it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from torchte._device import fp8_support
from torchte.autocast import autocast_state, update_after_backward
from torchte.recipe import DelayedScaling, Float8CurrentScaling, Recipe

from .block_setup import BLOCK_RECIPES, block_quantizer, grouped_block_mode
from .delayed import DelayedScalingState
from .float8 import Float8CurrentScalingQuantizer
from .grouped_quantizer import GroupedQuantizer

__all__ = ["FP8Setup", "check_recipe", "needs_delayed_state", "new_setup"]

_STATE = autocast_state()
# The grouped quantizers a grouped module uses, by slot.
_GROUPED_SLOTS = (("input", True), ("weight", True), ("grad_output", False))


def check_recipe(recipe: Recipe, device: torch.device) -> None:
    """Raise unless `recipe` runs on `device` in this release."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"unknown recipe {recipe!r}: expected a torchte.recipe.Recipe")
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling, *BLOCK_RECIPES)):
        raise NotImplementedError(
            f"recipe {type(recipe).__name__} is not implemented in torchte yet; use "
            "DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling or "
            "NVFP4BlockScaling"
        )
    name = type(recipe).__name__
    if any(getattr(recipe, "override_linear_precision", ())):
        raise NotImplementedError(
            f"{name}(override_linear_precision={recipe.override_linear_precision}): GEMMs kept "
            "in high precision under an FP8 recipe are not implemented in torchte yet"
        )
    unsupported = recipe._unsupported()
    if unsupported is not None:
        raise NotImplementedError(unsupported)
    supported, reason = fp8_support(device)
    if not supported:
        raise RuntimeError(f"FP8 recipe {name} cannot run: {reason}")


def needs_delayed_state(recipe: Recipe) -> int | None:
    """The amax history length of the delayed-scaling state `recipe` keeps; None: none."""
    return recipe.amax_history_len if isinstance(recipe, DelayedScaling) else None


def new_setup(
    recipe: Recipe,
    num_gemms: int,
    delayed_pair: Callable[[int], tuple[DelayedScalingState, DelayedScalingState]],
) -> FP8Setup:
    """The quantizers for `recipe` (unchecked); delayed_pair(history_len) gives the module's
    (forward, backward) scaling state when the recipe keeps one."""
    history_len = needs_delayed_state(recipe)
    states = (None, None) if history_len is None else delayed_pair(history_len)
    return FP8Setup(recipe, num_gemms, states)


class FP8Setup:
    """The quantizers of one module under one recipe, one entry per GEMM.

    input/weight/output quantize forward tensors; grad_output/grad_input backward ones.
    output and grad_input make user-visible Float8Tensors (fp8_output / fp8_grad).
    grouped_* quantize all GEMMs' tensors of one slot at once (grouped modules; None where the
    state is not laid out slot by slot); grouped_mode names the grouped path they serve:
    "fp8" (per-tensor scales per group), "block" (Float8BlockScaling's 1x128 / 128x128
    blocks) or None (grouped modules run group by group). fwd_state/bwd_state are the
    DelayedScalingStates (None under current scaling and the block recipes).
    """

    __slots__ = (
        "bwd_state",
        "fwd_state",
        "grad_input",
        "grad_output",
        "grouped_grad_output",
        "grouped_input",
        "grouped_mode",
        "grouped_weight",
        "grouped_weight_cache",
        "input",
        "output",
        "recipe",
        "records_amax",
        "weight",
        "weight_cache",
    )

    def __init__(self, recipe: Recipe, num_gemms: int, states) -> None:
        self.recipe = recipe
        self.fwd_state, self.bwd_state = states
        # Whether a forward writes amaxes into the module's scaling state (delayed scaling).
        self.records_amax = self.fwd_state is not None
        # Per GEMM, [(key, Float8Storage)] of the cached FP8 weight.
        self.weight_cache = [[None] for _ in range(num_gemms)]
        # A grouped module's FP8 weights of all GEMMs as one GroupedStorage: [(key, storage)].
        self.grouped_weight_cache = [None]
        fmt = recipe.fp8_format
        dtypes = {True: fmt.fwd_dtype, False: fmt.bwd_dtype}
        slots = (("input", True, True), ("weight", True, True), ("output", True, False))
        slots += (("grad_output", False, True), ("grad_input", False, False))
        for slot, forward, internal in slots:
            dtype = dtypes[forward]
            if self.fwd_state is not None:
                state = self.fwd_state if forward else self.bwd_state
                quantizers = [state.quantizer(slot, dtype, internal, g) for g in range(num_gemms)]
            elif isinstance(recipe, BLOCK_RECIPES):
                quantizers = [block_quantizer(recipe, slot, dtype, internal)] * num_gemms
            else:
                power_2, eps = recipe._slot_scaling(slot)
                q = Float8CurrentScalingQuantizer(
                    dtype, power_2_scale=power_2, amax_epsilon=eps, internal=internal
                )
                quantizers = [q] * num_gemms
            setattr(self, slot, quantizers)
        self.grouped_mode = None
        if isinstance(recipe, BLOCK_RECIPES):
            self.grouped_mode = grouped_block_mode(recipe)
            for slot, _ in _GROUPED_SLOTS:
                quantizer = getattr(self, slot)[0] if self.grouped_mode else None
                setattr(self, f"grouped_{slot}", quantizer)
            return
        for slot, forward in _GROUPED_SLOTS:
            setattr(self, f"grouped_{slot}", self._grouped_quantizer(slot, dtypes[forward]))
        if self.grouped_input is not None:
            self.grouped_mode = "fp8"

    def _grouped_quantizer(self, slot: str, dtype: torch.dtype) -> GroupedQuantizer | None:
        if self.fwd_state is None:
            power_2, eps = self.recipe._slot_scaling(slot)
            return GroupedQuantizer(dtype, amax_epsilon=eps, power_2_scale=power_2)
        state = self.fwd_state if slot in self.fwd_state.slots else self.bwd_state
        return GroupedQuantizer(dtype, state, slot) if state.slot_major else None

    def weight_generation(self) -> int:
        """Moves whenever the weight scale may have changed: a cached FP8 weight made at another
        generation is stale (0 where the scale is computed per quantization)."""
        return self.fwd_state.generation if self.fwd_state is not None else 0

    def forward_done(self, group) -> None:
        """A forward under this setup succeeded: its amaxes update the scales when the
        outermost autocast region exits (amax-reduced over `group`)."""
        if self.fwd_state is not None:
            _STATE.register_step(self.fwd_state, self.bwd_state, self.recipe, group)

    def forward_failed(self) -> None:
        """A forward under this setup failed: drop the amaxes it recorded this step."""
        if self.fwd_state is not None:
            _STATE.drop_forward(self.fwd_state)

    def backward_hook(self, group) -> Callable[[], None] | None:
        """What a backward that quantized gradients calls, once it did: the backward scales
        update when that backward pass ends. None where nothing is owed (current scaling)."""
        if self.bwd_state is None:
            return None
        return functools.partial(update_after_backward, self.bwd_state, self.recipe, group)

    def prime_weight(self, weight: torch.Tensor, gemm: int = 0) -> None:
        """Before weight GEMM `gemm` is first quantized as an FP8 parameter (quantized_model_init,
        reset_parameters of such a module), give its scale the value the weight's own amax asks
        for (see Float8Quantizer.prime_scale); nothing under current scaling."""
        if self.fwd_state is None:
            return
        recipe = self.recipe
        self.weight[gemm].prime_scale(weight, recipe.fp8_format.value.max_fwd, recipe.margin)

    def reduce_current_amaxes(self, reduce_max: Callable[[torch.Tensor], None]) -> None:
        """Tensor parallelism under current scaling: the input, weight and output-gradient
        quantizers scale by the amax over the ranks (reduce_max all-reduces a (1,) tensor with
        MAX), so a tensor split over them is cast with one scale; a tensor whole on every rank
        gets its own. Nothing under delayed scaling, whose amaxes are reduced after the step."""
        if self.fwd_state is not None:
            return
        for slot in ("input", "weight", "grad_output"):
            for quantizer in (*getattr(self, slot), getattr(self, f"grouped_{slot}")):
                if quantizer is not None:
                    quantizer.amax_reduction = reduce_max

    def drop_weight_caches(self) -> None:
        """Forget the cached FP8 weights (their parameters were replaced)."""
        for cache in (*self.weight_cache, self.grouped_weight_cache):
            cache[0] = None
