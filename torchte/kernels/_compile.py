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
tensor, which no real output is. A `CastSpec spec` argument (FP8-writing kernels) travels as
its fields (CastSpec.SCHEMA) and is rebuilt on the other side; it is passed positionally.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

from .cast_spec import CastSpec

__all__ = ["compiled_as_op"]

NAMESPACE = "torchte"
# How many op arguments a CastSpec travels as.
_SPEC_FIELDS = len(CastSpec.SCHEMA.split(", "))


def compiled_as_op(schema: str) -> Callable[[Callable], Callable]:
    """Decorate launcher `name` of a kernel module: under torch.compile it runs as the custom
    op `torchte::name(schema)`, whose fake is `name_reference` from the same module. `schema`
    is the part after the name, e.g. "(Tensor x, Tensor(a!) amax) -> ()"; mutated arguments
    are annotated there."""

    spec_at = _spec_position(schema)
    if spec_at is not None:
        schema = schema.replace("CastSpec spec", CastSpec.SCHEMA)

    def decorate(launcher: Callable) -> Callable:
        name = launcher.__name__

        def impl(*args, **kwargs):
            return _with_placeholders(launcher(*_spec_rebuilt(args, spec_at), **kwargs), args)

        def fake(*args, **kwargs):
            reference = launcher.__globals__[f"{name}_reference"]
            out = reference(*_spec_rebuilt(args, spec_at), **kwargs)
            return _with_placeholders(out, args)

        mutated = re.findall(r"Tensor\([a-z]!\)\?? (\w+)", schema)
        op = torch.library.custom_op(
            f"{NAMESPACE}::{name}", impl, mutates_args=mutated, schema=schema
        )
        op.register_fake(fake)

        @functools.wraps(launcher)
        def dispatch(*args, **kwargs):
            if torch.compiler.is_compiling():
                return _without_placeholders(op(*_spec_spread(args, spec_at), **kwargs))
            return launcher(*args, **kwargs)

        return dispatch

    return decorate


def _spec_position(schema: str) -> int | None:
    """The index of the `CastSpec spec` argument among the schema's arguments, or None."""
    arguments = schema[schema.index("(") + 1 : schema.index(")")].split(", ")
    found = [i for i, arg in enumerate(arguments) if arg == "CastSpec spec"]
    return found[0] if found else None


def _spec_spread(args: tuple, at: int | None) -> tuple:
    """The launcher's arguments with the CastSpec at `at` replaced by its fields."""
    if at is None:
        return args
    return (*args[:at], *args[at].fields(), *args[at + 1 :])


def _spec_rebuilt(args: tuple, at: int | None) -> tuple:
    """The op's arguments with the CastSpec fields from `at` on made a CastSpec again."""
    if at is None:
        return args
    end = at + _SPEC_FIELDS
    return (*args[:at], CastSpec.from_fields(*args[at:end]), *args[end:])


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
