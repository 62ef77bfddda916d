"""te.GroupedLinear's parameters: one per group or one for all, FP8 ones, and their checkpoints.

Legend: G groups, W (G, N, K) the weights stacked, B (G, N) the biases stacked.

- Per group (the default): `weight0..weight{G-1}` (N, K) and `bias0..` (N,), views of one W
  and one B buffer. With `single_grouped_weight` / `single_grouped_bias` (Transformer Engine's
  newer option) one parameter `weight` (G, N, K) / `bias` (G, N) instead; the autograd
  Function then takes it whole and returns its gradient whole (`unpack_parameters`,
  `packed_grads`), and fused wgrad accumulation writes slice g of the weight's (G, N, K)
  main_grad (`GroupMainGrad`). Either layout loads the other's state_dict (`remap_checkpoint`).
- Under quantized_model_init each weight_g is a Float8Tensor quantized with GEMM g's weight
  quantizer (as te.Linear's), its bytes views of one grouped buffer (`pack_fp8_weights`), so
  the grouped FP8 path reads them in place as one GroupedStorage (`fp8_weight_group`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from torchte.offload import mark_not_offload
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.grouped import GroupedStorage

from ._common import MainGradTarget, stacked_view
from ._deferred_wgrad import ALL_GROUPS, add_to_grads
from ._lifecycle import keeping_out_of_inference

__all__ = [
    "GroupMainGrad",
    "check_layout_flags",
    "fp8_weight_group",
    "pack_fp8_weights",
    "packed_grads",
    "per_group_init",
    "regroup_fp8_weights",
    "remap_checkpoint",
    "unpack_parameters",
]


def per_group_init(init: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], None]:
    """An init for a stacked (G, ...) tensor that runs `init` on each slice in order: the
    same draws as G separate parameters initialized one after another."""

    def init_groups(stacked: torch.Tensor) -> None:
        for part in stacked.unbind(0):
            init(part)

    return init_groups


# -- the autograd Function's parameter inputs ------------------------------------------------


def unpack_parameters(call, num_gemms: int, params: Sequence, grads: Sequence):
    """(weights, biases, weight_grads, bias_grads), one entry per group, from the Function's
    parameter inputs `params` (G weights or one (G, N, K); G biases, one (G, N) or none) and
    their needs_input_grad `grads` (`call`: a GroupedCall, whose single_weight / single_bias
    say which layout)."""
    num_w = 1 if call.single_weight else num_gemms
    weights, biases = params[:num_w], params[num_w:]
    weight_grads, bias_grads = tuple(grads[:num_w]), tuple(grads[num_w:])
    if call.single_weight:
        weights, weight_grads = weights[0].unbind(0), weight_grads * num_gemms
    if call.single_bias and biases:
        biases, bias_grads = biases[0].unbind(0), bias_grads * num_gemms
    return list(weights), list(biases), weight_grads, bias_grads


def packed_grads(ctx, dws: list, dbs: list) -> list:
    """The gradients of the Function's parameter inputs from the per-group ones: the single
    weight's (G, N, K) (with fused wgrad accumulation, what GroupMainGrad.finish gave: its
    dummy or None) and the single bias's (G, N) in one piece each; per-group ones as they are."""
    if ctx.single_weight:
        into_main_grad = ctx.plan.gemms[0].main_grad is not None
        dws = [dws[0] if into_main_grad else _stacked(dws)]
    if ctx.single_bias and dbs:
        dbs = [_stacked(dbs)]
    return [*dws, *dbs]


def _stacked(grads: list) -> torch.Tensor | None:
    """The G per-group gradients as one (G, ...) tensor: a view where they are consecutive
    blocks of one buffer (as the grouped paths make them), else stacked; None where none."""
    if any(g is None for g in grads):
        return None
    stacked = stacked_view(grads)
    return stacked if stacked is not None else torch.stack(grads)


# -- fused wgrad accumulation into a single weight's main_grad --------------------------------


class _GroupSlot:
    """Group g of a single grouped weight, standing in for a weight parameter where the wgrad
    code reaches main_grad: main_grad is slice g (N, K) of the weight's (G, N, K) one;
    overwrite_main_grad is the weight's."""

    __slots__ = ("_group", "_param")

    def __init__(self, param: torch.nn.Parameter, group: int) -> None:
        self._param, self._group = param, group

    @property
    def main_grad(self) -> torch.Tensor:
        return self._param.main_grad[self._group]

    @property
    def overwrite_main_grad(self) -> bool:
        return bool(getattr(self._param, "overwrite_main_grad", False))

    @property
    def shape(self) -> torch.Size:
        return self._param.shape[1:]


class _Dummy:
    """The one dummy gradient (G, N, K) the G groups of a single weight share."""

    __slots__ = ("tensor",)

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None


class GroupMainGrad(MainGradTarget):
    """MainGradTarget of GEMM g of a single grouped weight (G, N, K): its wgrad goes into
    weight.main_grad[g] (fp32 (G, N, K), checked), through a weakref (rule 9)."""

    __slots__ = ("_group", "_shared")

    def __init__(self, weight: torch.nn.Parameter, group: int, shared: _Dummy) -> None:
        super().__init__([weight])
        self.parts = [(weakref.ref(weight), 0, weight.shape[1])]  # rows of group g's (N, K)
        self._group, self._shared = group, shared

    @staticmethod
    def shared_dummy() -> _Dummy:
        """What the G targets of one weight share (give each the same one)."""
        return _Dummy()

    def _weight(self) -> torch.nn.Parameter:
        param = self.parts[0][0]()
        if param is None:
            raise RuntimeError("the weight parameter was freed before its backward ran")
        main_grad = getattr(param, "main_grad", None)
        if main_grad is None or main_grad.shape != param.shape:
            got = "none" if main_grad is None else f"shape {tuple(main_grad.shape)}"
            raise RuntimeError(
                "fuse_wgrad_accumulation=True with single_grouped_weight needs weight.main_grad, "
                f"an fp32 tensor of the weight's shape {tuple(param.shape)} (G, N, K), set "
                f"before backward; got {got}"
            )
        return param

    def params(self) -> list[tuple[_GroupSlot, int, int]]:
        _, start, end = self.parts[0]
        return [(_GroupSlot(self._weight(), self._group), start, end)]

    def finish(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Mark the weight (grad_added_to_main_grad, where it has the attribute) and return
        the dummy gradient of the whole weight (G, N, K), or None where it is not marked."""
        param = self._weight()
        if not hasattr(param, "grad_added_to_main_grad"):
            return None
        param.grad_added_to_main_grad = True
        dummy = self._shared.tensor
        if dummy is None or dummy.shape != param.shape or dummy.dtype != dtype:
            dummy = torch.empty(param.shape, dtype=dtype, device=device)
            self._shared.tensor = dummy
        return dummy


# -- FP8 weight parameters (quantized_model_init) ---------------------------------------------


def pack_fp8_weights(weights: Sequence[Float8Tensor]) -> None:
    """Move the bytes of the G FP8 weight parameters (each (N, K), rowwise and columnwise data
    and scale_inv) into one GroupedStorage of G groups of N rows and point each parameter's
    storage at its views there (a copy; the values stay). In-place updates (optimizer steps,
    copy_, reset_parameters) keep the addresses, so the views stay one group."""
    storages = [w._storage for w in weights]
    grouped = GroupedStorage.from_groups(storages, storages[0].fp8_dtype)
    for storage, view in zip(storages, grouped.groups(), strict=True):
        storage.rowwise_data = view.rowwise_data
        storage.columnwise_data = view.columnwise_data
        storage.scale_inv = view.scale_inv
        mark_not_offload(storage)  # a parameter's data: saving it moves nothing


def regroup_fp8_weights(weights: Sequence[torch.Tensor]) -> None:
    """pack_fp8_weights again where the G weights are FP8 parameters no longer one group (moved
    one by one by .to() / .cuda(), or copied); nothing otherwise."""
    if not all(isinstance(w, Float8Tensor) for w in weights):
        return
    storages = [w._storage for w in weights]
    if any(s.scale_inv is None for s in storages) or _viewed_group(storages) is not None:
        return
    pack_fp8_weights(weights)


def fp8_weight_group(cache: list, weights: Sequence[Float8Tensor], columnwise: bool):
    """The G FP8 weight parameters as one GroupedStorage (G groups of N rows) for the grouped
    FP8 GEMMs: views of their bytes where they are one group (pack_fp8_weights; cached in
    the one-element list `cache` while the parameters hold the same data tensors), else a
    copy made now. columnwise: dgrad needs their columnwise data (made where missing)."""
    storages = [w._storage for w in weights]
    if columnwise:
        for storage in storages:
            if storage.columnwise_data is None:
                with keeping_out_of_inference():
                    storage.update_usage(columnwise_usage=True)
    tensors = tuple(t for s in storages for t in s.get_data_tensors())
    entry = cache[0]
    if entry is not None and all(a is b for a, b in zip(entry[0], tensors, strict=True)):
        return entry[1]
    grouped = _viewed_group(storages)
    if grouped is None:  # moved or loaded one by one: no longer one buffer
        return GroupedStorage.from_groups(storages, storages[0].fp8_dtype)
    mark_not_offload(grouped)
    cache[0] = (tensors, grouped)  # holds the tensors: an id in the key is never reused
    return grouped


def _viewed_group(storages) -> GroupedStorage | None:
    """A GroupedStorage over the storages' data as they lie (no copy), or None when they are
    not consecutive blocks of one buffer per usage."""
    first = storages[0]
    scale_inv = stacked_view([s.scale_inv for s in storages])
    usages = []
    for name in ("rowwise_data", "columnwise_data"):
        parts = [getattr(s, name) for s in storages]
        if all(p is None for p in parts):
            usages.append(None)
            continue
        if any(p is None for p in parts) or (stacked := stacked_view(parts)) is None:
            return None
        usages.append(stacked)
    if scale_inv is None or any(s.fp8_dtype != first.fp8_dtype for s in storages):
        return None
    rows, cols = usages
    n, k = first.shape
    return GroupedStorage(
        None if rows is None else rows.view(-1, k),
        None if cols is None else cols.view(-1),
        scale_inv.view(-1),
        first.fp8_dtype,
        [n] * len(storages),
        (n * len(storages), k),
    )


# -- checkpoints -----------------------------------------------------------------------------


def remap_checkpoint(state_dict: dict, prefix: str, kind: str, num_gemms: int, single: bool):
    """Make `state_dict` (in place) hold `kind` ("weight" or "bias") in this module's layout,
    as Transformer Engine does: G entries `{kind}{g}` stacked into one `{kind}` when the
    module has the single parameter, the single one split into G otherwise; entries of the
    other layout beside this one's are dropped. FP8 values are dequantized first."""
    whole = f"{prefix}{kind}"
    parts = [f"{prefix}{kind}{g}" for g in range(num_gemms)]
    has_whole = whole in state_dict
    has_parts = all(key in state_dict for key in parts)
    if single and has_parts and not has_whole:
        state_dict[whole] = torch.stack([_plain(state_dict.pop(key)) for key in parts])
    elif single and has_whole:
        for key in parts:
            state_dict.pop(key, None)
    elif not single and has_whole and not has_parts:
        value = state_dict[whole]
        if value.dim() == 0 or value.shape[0] != num_gemms:
            return  # not G stacked entries: the load names the key as unexpected
        value = _plain(state_dict.pop(whole))
        for key, part in zip(parts, value.unbind(0), strict=True):
            state_dict[key] = part
    elif not single and has_parts:
        state_dict.pop(whole, None)


def _plain(value):
    return value.dequantize() if isinstance(value, Float8Tensor) else value


def add_deferred_group_grads(module, gemm: int, wgrad) -> None:
    """GroupedLinear.backward_dw: group `gemm`'s weight gradient (N, K), or ALL_GROUPS' list
    of the G, added to weight{g}.grad, or to slice g of a single grouped weight's (G, N, K)
    .grad (made as zeros first: adding to zero changes no bit)."""
    grads = enumerate(wgrad) if gemm == ALL_GROUPS else ((gemm, wgrad),)
    params = module._parameters
    for g, dw in grads:
        if dw is None:
            continue
        if not module.single_grouped_weight:
            add_to_grads([params[f"weight{g}"]], dw)
            continue
        weight = params["weight"]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad[g].add_(dw.to(weight.dtype))


def check_layout_flags(single_weight, single_bias, use_grouped_tensor) -> None:
    """TypeError naming a parameter-layout argument that is not a bool (use_grouped_tensor:
    a bool or None)."""
    for name, value in (
        ("single_grouped_weight", single_weight),
        ("single_grouped_bias", single_bias),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"te.GroupedLinear: {name} must be a bool, got {value!r}")
    if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
        raise TypeError(
            f"te.GroupedLinear: use_grouped_tensor must be a bool or None, got "
            f"{use_grouped_tensor!r}"
        )
