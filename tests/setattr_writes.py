"""Attribute writes as torchte's own code makes them (tests import it as `from setattr_writes
import set_as_torchte`): the setattr guard warns only for those, since a client's writes are
accepted as Transformer Engine accepts them."""

from __future__ import annotations

from typing import Any


def set_as_torchte(obj: Any, name: str, value: Any) -> None:
    """`obj.<name> = value`, executed in a frame whose module is inside the torchte package."""
    code = compile(f"obj.{name} = value", "<torchte write>", "exec")
    exec(code, {"__name__": "torchte._test_write", "obj": obj, "value": value})
