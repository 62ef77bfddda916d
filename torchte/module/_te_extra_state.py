"""A te module's `_extra_state`: Transformer Engine's form, which torchte's modules also write.

Transformer Engine 2.x (`TransformerEngineBaseModule.get_extra_state`) saves a module that ran
under FP8 as a uint8 tensor of the pickled dict

    recipe               the recipe object (transformer_engine.common.recipe)
    scale_fwd            (3G,) fp32  \\  delayed scaling only: G GEMMs, 3 forward slots
    amax_history_fwd     (L, 3G) fp32 |  (input, weight, output) and 2 backward slots
    scale_bwd            (2G,) fp32   |  (grad_output, grad_input); row 0 of a history is the
    amax_history_bwd     (L, 2G) fp32 /  amax being recorded, as in torchte
    extra_fp8_variables  the plain values of its fp8_meta ("num_gemms", "fp8_checkpoint", ...)

and a module without FP8 state as an empty uint8 tensor. Transformer Engine 1.x had no "recipe"
(delayed scaling was the only one), saved "scale_inv_fwd"/"scale_inv_bwd" (1/scale) and, in some
releases, global amax buffers; it wrote an io.BytesIO of torch.save, or the uint8 form.

torchte's modules write this form too, always (get_extra_state), with two more entries that
Transformer Engine ignores: "nonfinite_fwd" (3G,) and "nonfinite_bwd" (2G,) int32, the counts of
amaxes left out for holding a NaN or inf, in the columns of the scales. Why this form and not a
dict of tensors (torchte's form before, still read): every state_dict value is then a tensor,
which tensor-only formats (safetensors, HF transformers' save_pretrained) require, and
Transformer Engine loads torchte's state_dict as it is. Why bytes and not a fixed numeric layout:
Transformer Engine reads only this one. torch.distributed.checkpoint loads into tensors of the
saved size: the bytes are written so that their length depends only on G and L (see
_te_pickle.py), so a model that ran under the same recipe loads as it is; a model that has not
run under delayed scaling holds the empty tensor, and its loader sizes the entry from the
checkpoint's metadata first (as torchte/train/fsdp_state.py does).

Columns: slot j of GEMM g is column g*S + j (S slots per GEMM), in both libraries for Linear,
LayerNormLinear and LayerNormMLP (fc1 is GEMM 0, fc2 GEMM 1). torchte's GroupedLinear keeps it
at column j*G + g (slot by slot), as Transformer Engine's GroupedLinear did in 1.x and early 2.x
releases; later 2.x releases lay it out GEMM by GEMM. A grouped payload is read slot by slot
when it has no recipe (1.x), else GEMM by GEMM, unless its values show the slot-by-slot layout
(see `_saved_slot_by_slot`); it is written GEMM by GEMM.

What torchte has no use for is dropped on load: scale_inv (recomputed from the scale), the recipe
(te.autocast's recipe rules, as for torchte's own checkpoints), extra_fp8_variables other than
num_gemms (checked), 1.x global buffers (torchte reduces amaxes per module). Non-finite counts,
where a payload has none (Transformer Engine's), start at zero. A payload of a recipe without
delayed scaling (current scaling, block scaling: only the recipe is saved) has nothing to load.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from torchte.recipe import DelayedScaling, Recipe

from ._lifecycle import ExtraStateError, read_extra_state
from ._te_pickle import TERecord, te_pickle, te_record, te_torch_load, te_unpickle

__all__ = [
    "check_te_norm_extra_state",
    "from_te_extra_state",
    "is_te_extra_state",
    "te_payload_of",
    "to_te_extra_state",
]

# (torchte key, Transformer Engine key, slots per GEMM)
_TENSORS = (
    ("fwd_scale", "scale_fwd", 3),
    ("fwd_amax_history", "amax_history_fwd", 3),
    ("bwd_scale", "scale_bwd", 2),
    ("bwd_amax_history", "amax_history_bwd", 2),
)
# torchte's non-finite counts, which Transformer Engine's payloads lack (same columns).
_COUNTS = (("fwd_nonfinite", "nonfinite_fwd", 3), ("bwd_nonfinite", "nonfinite_bwd", 2))
# DelayedScaling's fields as Transformer Engine 2.x has them.
_RECIPE_FIELDS = (
    "margin",
    "fp8_format",
    "amax_history_len",
    "amax_compute_algo",
    "scaling_factor_compute_algo",
    "reduce_amax",
    "fp8_dpa",
    "fp8_mha",
    "backward_override",
)


def is_te_extra_state(state: Any) -> bool:
    """Whether `state` is in Transformer Engine's form (a tensor of bytes, or an io.BytesIO)."""
    return isinstance(state, (torch.Tensor, io.BytesIO))


def te_payload_of(state: torch.Tensor | io.BytesIO, module: str) -> Any:
    """The object Transformer Engine serialized into `state` (None for the empty tensor),
    read by the restricted unpickler; ExtraStateError naming `module` if it cannot be."""
    try:
        if isinstance(state, io.BytesIO):
            return te_torch_load(state)
        if state.numel() == 0:
            return None
        if state.dtype != torch.uint8 or state.dim() != 1:
            raise ExtraStateError(
                f"a tensor extra state must be 1-D uint8 bytes (Transformer Engine's format), "
                f"got {state.dtype} of shape {tuple(state.shape)}"
            )
        return te_unpickle(state.detach().cpu().contiguous().numpy().tobytes())
    except ExtraStateError as err:
        raise ExtraStateError(f"{module}: {err}") from None


def from_te_extra_state(
    state: torch.Tensor | io.BytesIO, module: str, num_gemms: int, slot_major: bool
) -> dict | None:
    """torchte's extra state dict (as _lifecycle.extra_state_of makes) for the payload `state`
    of a module with `num_gemms` GEMMs laid out slot by slot if `slot_major`; None when it holds
    nothing to load. ExtraStateError names `module` and what is wrong."""
    payload = te_payload_of(state, module)
    if payload is None:
        return None
    if not isinstance(payload, dict):
        raise ExtraStateError(
            f"{module}: Transformer Engine's extra state holds a {type(payload).__name__}, "
            "not the dict of a module's FP8 state"
        )
    if "scale_fwd" not in payload and ({"forward", "backward"} & payload.keys()):
        raise ExtraStateError(
            f"{module}: this extra state is that of a Transformer Engine te.ops operation "
            "(per-direction quantizer state), which torchte does not read; load with "
            "strict=False without this entry to start from fresh FP8 scales"
        )
    recipe = payload.get("recipe")
    if recipe is not None and not isinstance(recipe, TERecord):
        raise ExtraStateError(f"{module}: extra state's recipe is a {type(recipe).__name__}")
    if recipe is not None and not recipe.delayed():
        return None  # current or block scaling: Transformer Engine saves only the recipe
    tensors = _checked_tensors(payload, module, num_gemms)
    _check_num_gemms(payload.get("extra_fp8_variables"), module, num_gemms)
    # 1.x laid a grouped module out slot by slot, as torchte does; 2.x (mostly) GEMM by GEMM.
    reorder = slot_major and recipe is not None and not _saved_slot_by_slot(tensors, num_gemms)
    state: dict[str, Any] = {"amax_history_len": tensors["amax_history_fwd"].shape[0]}
    for ours, theirs, slots in _TENSORS + _COUNTS:
        t = tensors.get(theirs)
        if t is not None:
            state[ours] = _columns(t, slots, num_gemms, True) if reorder else t
    return state


def _checked_tensors(payload: dict, module: str, num_gemms: int) -> dict[str, torch.Tensor]:
    """The four delayed-scaling tensors of `payload` as fp32 CPU copies, and the non-finite
    counts where it has them (int32), shapes checked."""
    missing = [theirs for _, theirs, _ in _TENSORS if theirs not in payload]
    if missing:
        raise ExtraStateError(
            f"{module}: Transformer Engine's delayed-scaling extra state lacks "
            f"{', '.join(repr(k) for k in missing)}"
        )
    out = {}
    for _, theirs, slots in _TENSORS:
        t = payload[theirs]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ExtraStateError(f"{module}: extra state's {theirs} is not a float tensor")
        history = theirs.startswith("amax")
        n = slots * num_gemms
        if t.dim() != (2 if history else 1) or t.shape[-1] != n or (history and t.shape[0] < 1):
            want = f"(L, {n})" if history else f"({n},)"
            raise ExtraStateError(
                f"{module}: extra state's {theirs} has shape {tuple(t.shape)}, this module's is "
                f"{want} ({slots} per GEMM, {num_gemms} GEMMs)"
            )
        out[theirs] = t.detach().to("cpu", torch.float32, copy=True)
    for _, theirs, slots in _COUNTS:
        t = payload.get(theirs)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.shape != (slots * num_gemms,):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ExtraStateError(
                f"{module}: extra state's {theirs} is {got}, this module's is an int tensor of "
                f"shape ({slots * num_gemms},)"
            )
        out[theirs] = t.detach().to("cpu", torch.int32, copy=True)
    rows = (out["amax_history_fwd"].shape[0], out["amax_history_bwd"].shape[0])
    if rows[0] != rows[1]:
        raise ExtraStateError(
            f"{module}: extra state's forward and backward amax histories have {rows[0]} and "
            f"{rows[1]} rows; torchte keeps one history length per recipe"
        )
    return out


def _check_num_gemms(extra: Any, module: str, num_gemms: int) -> None:
    saved = extra.get("num_gemms") if isinstance(extra, dict) else None
    if saved is not None and saved != num_gemms:
        raise ExtraStateError(
            f"{module}: extra state was saved by a module of {saved} GEMMs, this one has "
            f"{num_gemms}"
        )


def _saved_slot_by_slot(tensors: dict[str, torch.Tensor], num_gemms: int) -> bool:
    """Whether a 2.x payload of G > 1 GEMMs is laid out slot by slot (Transformer Engine's early
    2.x GroupedLinear): when the columns where GEMM by GEMM keeps the slots GroupedLinear never
    quantizes (each GEMM's output and grad_input) hold amaxes while the slot-by-slot ones are
    all zero."""
    fwd_history, bwd_history = tensors["amax_history_fwd"], tensors["amax_history_bwd"]
    g = num_gemms

    def unused_zero(by_slot: bool) -> bool:
        out = [2 * g + i if by_slot else 3 * i + 2 for i in range(g)]
        grad_in = [g + i if by_slot else 2 * i + 1 for i in range(g)]
        return not fwd_history[:, out].any() and not bwd_history[:, grad_in].any()

    return g > 1 and unused_zero(True) and not unused_zero(False)


def _columns(t: torch.Tensor, slots: int, num_gemms: int, to_slot_major: bool) -> torch.Tensor:
    """t (..., slots*G) with its columns reordered GEMM by GEMM -> slot by slot (or back)."""
    index = torch.arange(slots * num_gemms)
    if to_slot_major:  # column j*G + g takes column g*S + j
        index = index.view(num_gemms, slots).t().reshape(-1)
    else:  # column g*S + j takes column j*G + g
        index = index.view(slots, num_gemms).t().reshape(-1)
    return t.index_select(-1, index)


# -- writing --------------------------------------------------------------------------------------


def to_te_extra_state(
    state: dict, module: str, num_gemms: int | None, slot_major: bool, recipe: Recipe | None
) -> torch.Tensor:
    """Transformer Engine's uint8 extra state (1-D; empty for an empty `state`) for torchte's
    dict `state` (scales, amax histories, non-finite counts: see _lifecycle.extra_state_of) of
    te module `module` (a name for messages) with `num_gemms` GEMMs (None: from the scales)
    laid out slot by slot if `slot_major`; `recipe` (a DelayedScaling, or None for
    DelayedScaling(amax_history_len=L)) is the recipe written with it."""
    if not state:
        return torch.empty(0, dtype=torch.uint8)
    checked = read_extra_state(state, module)
    length = checked["amax_history_len"]
    if num_gemms is None:
        num_gemms = checked["fwd_scale"].numel() // 3
    payload: dict[str, Any] = {"recipe": _te_recipe(recipe, length, module)}
    for ours, theirs, slots in _TENSORS:
        t = checked[ours].detach().to("cpu", torch.float32)
        _check_columns(t, ours, slots, num_gemms, module)
        payload[theirs] = _columns(t, slots, num_gemms, False) if slot_major else t.clone()
    for ours, theirs, slots in _COUNTS:
        if ours in checked:
            t = checked[ours].detach().to("cpu", torch.int32)
            _check_columns(t, ours, slots, num_gemms, module)
            payload[theirs] = _columns(t, slots, num_gemms, False) if slot_major else t.clone()
    fmt = payload["recipe"].fields["fp8_format"].value
    payload["extra_fp8_variables"] = {
        "fp8_checkpoint": True,
        "num_gemms": num_gemms,
        "fp8_max_fwd": fmt.max_fwd,
        "fp8_max_bwd": fmt.max_bwd,
    }
    return torch.frombuffer(bytearray(te_pickle(payload)), dtype=torch.uint8)


def _check_columns(t: torch.Tensor, key: str, slots: int, num_gemms: int, module: str) -> None:
    """ValueError unless `t` is (slots*G,), or (L, slots*G) for an amax history."""
    if t.shape[-1] != slots * num_gemms or t.dim() != (2 if "history" in key else 1):
        raise ValueError(
            f"{module}: extra state's {key} has shape {tuple(t.shape)}, not that of "
            f"{num_gemms} GEMMs of {slots} slots"
        )


def _te_recipe(recipe: Recipe | None, length: int, module: str) -> TERecord:
    """Transformer Engine's DelayedScaling with `recipe`'s fields (TE's defaults when None)."""
    if recipe is None:
        recipe = DelayedScaling(amax_history_len=length)
    if not isinstance(recipe, Recipe) or not recipe.delayed():
        raise ValueError(
            f"recipe must be a torchte.recipe.DelayedScaling (the recipe of the saved "
            f"delayed-scaling state) or None, got {recipe!r}"
        )
    if recipe.amax_history_len != length:
        raise ValueError(
            f"recipe.amax_history_len is {recipe.amax_history_len}, but {module}'s saved amax "
            f"history has {length} rows (Transformer Engine sizes the history from the recipe)"
        )
    for name in ("amax_compute_algo", "scaling_factor_compute_algo"):
        if callable(getattr(recipe, name)):
            raise ValueError(
                f"recipe.{name} is a callable, which torchte does not write into a checkpoint "
                "(nor read from one); export with 'max' or 'most_recent' and None"
            )
    return te_record("DelayedScaling", {n: getattr(recipe, n) for n in _RECIPE_FIELDS})


def check_te_norm_extra_state(state: Any, module: str) -> None:
    """Check the `_extra_state` of a Transformer Engine 2.x norm (an operation-fuser op: pickled
    {}, or empty), which torchte's norms, holding no FP8 state, take and drop."""
    if not is_te_extra_state(state):
        raise ExtraStateError(
            f"{module} has no extra state; got a {type(state).__name__} (Transformer Engine's "
            "norms save a uint8 tensor, which is accepted and dropped)"
        )
    payload = te_payload_of(state, module)
    if payload is not None and not isinstance(payload, dict):
        raise ExtraStateError(
            f"{module}: Transformer Engine's norm extra state holds a {type(payload).__name__}, "
            "not an operation's state dict"
        )
