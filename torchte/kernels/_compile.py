"""Kernel entry points as torch.library custom ops while torch.compile traces.

A launcher reads data pointers to launch Triton kernels and writes scaling state in place;
neither can be traced into a graph. And AOTAutograd, free to recompute a value in backward
from a graph input instead of saving it, would recompute a scale_inv from a scale that the
forward has since updated in place. So, while torch.compile traces, each entry point becomes an
opaque custom op `torchte::<name>`: its implementation is the launcher itself (run with real
tensors when the graph runs), its fake implementation the torch reference beside it
(`<name>_reference`, same signature), which gives the same shapes and dtypes. Eagerly the
launcher is called directly: no dispatcher on the hot path.

Outputs a launcher gives as None travel through the op as a placeholder: an empty 1-D uint8
tensor, which no real output is.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

__all__ = ["compiled_as_op"]

NAMESPACE = "torchte"


def compiled_as_op(schema: str) -> Callable[[Callable], Callable]:
    """Decorate launcher `name` of a kernel module: under torch.compile it runs as the custom
    op `torchte::name(schema)`, whose fake is `name_reference` from the same module. `schema`
    is the part after the name, e.g. "(Tensor x, Tensor(a!) amax) -> ()"; mutated arguments
    are annotated there."""

    def decorate(launcher: Callable) -> Callable:
        name = launcher.__name__

        def impl(*args, **kwargs):
            return _with_placeholders(launcher(*args, **kwargs), args)

        def fake(*args, **kwargs):
            reference = launcher.__globals__[f"{name}_reference"]
            return _with_placeholders(reference(*args, **kwargs), args)

        mutated = re.findall(r"Tensor\([a-z]!\) (\w+)", schema)
        op = torch.library.custom_op(
            f"{NAMESPACE}::{name}", impl, mutates_args=mutated, schema=schema
        )
        op.register_fake(fake)

        @functools.wraps(launcher)
        def dispatch(*args, **kwargs):
            if torch.compiler.is_compiling():
                return _without_placeholders(op(*args, **kwargs))
            return launcher(*args, **kwargs)

        return dispatch

    return decorate


def _placeholder(args) -> torch.Tensor:
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    return torch.empty(0, dtype=torch.uint8, device=device)


def _with_placeholders(out, args):
    if isinstance(out, tuple):
        return tuple(_placeholder(args) if t is None else t for t in out)
    return out


def _is_placeholder(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == (0,)


def _without_placeholders(out):
    if isinstance(out, tuple | list):
        return tuple(None if _is_placeholder(t) else t for t in out)
    return out
