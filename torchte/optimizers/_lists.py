"""Helpers the multi-tensor functions and the optimizers share: argument checks, the noop
flag, DTensor unwrapping, and fp32 working copies of tensor lists."""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:  # torch.distributed may be missing from a build
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - depends on the torch build

    class DTensor:  # type: ignore[no-redef]
        """Stands in for torch's DTensor where torch.distributed is missing (never matches)."""


__all__ = [
    "FLOAT_DTYPES",
    "DTensor",
    "check_flag",
    "check_lists",
    "fp32",
    "local_tensor",
    "raise_flag",
    "working_fp32",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp32(value: float) -> float:
    """`value` rounded to the nearest fp32 (how Transformer Engine's kernels take a float)."""
    return torch.tensor(value, dtype=torch.float32).item()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def check_flag(flag: torch.Tensor, name: str) -> None:
    """The noop flag must be a one-element tensor."""
    if not isinstance(flag, torch.Tensor) or flag.numel() != 1:
        raise ValueError(f"{name}: noop_flag must be a one-element tensor, got {flag!r}")


def raise_flag(flag: torch.Tensor, found: torch.Tensor) -> None:
    """flag = 1 where `found` (a one-element fp32 tensor, 0 or 1) is 1; no synchronization."""
    flag.masked_fill_(found.reshape(()).to(flag.device) != 0, 1)


def check_lists(
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    count: int,
    name: str,
    floating: bool = False,
) -> list[list[torch.Tensor]]:
    """`count` aligned lists of tensors on one device, as lists (DTensors as their shards).

    ValueError when the number of lists or their lengths are wrong or the tensors sit on
    several devices; TypeError for a non-tensor, or (floating=True) a dtype other than fp32,
    bf16, fp16.
    """
    if isinstance(tensor_lists, torch.Tensor) or len(tensor_lists) != count:
        got = "a tensor" if isinstance(tensor_lists, torch.Tensor) else len(tensor_lists)
        raise ValueError(f"{name}: expected {count} tensor lists, got {got}")
    lists = [[local_tensor(t) for t in tensors] for tensors in tensor_lists]
    if any(len(tensors) != len(lists[0]) for tensors in lists):
        sizes = [len(tensors) for tensors in lists]
        raise ValueError(f"{name}: the tensor lists must have equal lengths, got {sizes}")
    devices = set()
    for i, tensors in enumerate(lists):
        for j, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: tensor_lists[{i}][{j}] is a {type(t).__name__}")
            if floating and t.dtype not in FLOAT_DTYPES:
                raise TypeError(
                    f"{name}: tensor_lists[{i}][{j}] has dtype {t.dtype}; expected fp32, bf16 "
                    "or fp16"
                )
            devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(
            f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    return lists


def working_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor in fp32: an fp32 tensor itself, any other an fp32 copy of its shape.

    The copies are views of one buffer made by a single concatenation and cast (two launches
    for the whole list, not one per tensor); they are contiguous.
    """
    convert = [i for i, t in enumerate(tensors) if t.dtype != torch.float32]
    out = list(tensors)
    if not convert:
        return out
    if len(convert) == 1:
        i = convert[0]
        out[i] = tensors[i].float().contiguous()
        return out
    flat = torch.cat([tensors[i].reshape(-1) for i in convert]).float()
    pieces = flat.split([tensors[i].numel() for i in convert])
    for i, piece in zip(convert, pieces, strict=True):
        out[i] = piece.view(tensors[i].shape)
    return out
