"""Rule 1 of DESIGN.md for any torchte nn.Module: no nn.Module.__setattr__ on the hot path.

After construction (`_initialized` set in __dict__), a plain attribute that torchte's own code
sets through nn.Module.__setattr__ warns with RuntimeWarning (the test suite makes that an
error); state that changes per call is written with `_fast_setattr`, straight into __dict__.
Client code (a subclass defined elsewhere, as Megatron-Core's TE wrappers are, or a script)
sets attributes silently, as Transformer Engine's modules let it: only torchte's own writes can
be a slow path that torchte put there.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from torch import nn

__all__ = ["SET_BY_TORCH", "SetattrGuard"]

# Plain attributes torch itself sets on a module after construction (torch.compile's module
# wrapper mirrors its training flag and marks the module; FSDP2 flags a module it wraps): kept
# in __dict__, no warning.
SET_BY_TORCH = frozenset(
    ("training", "_is_torch_compile", "_is_fsdp_managed_module", "_fsdp_use_orig_params")
)


class SetattrGuard(nn.Module):
    """nn.Module whose plain attributes set after construction warn (see the module doc)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SET_BY_TORCH:
            self.__dict__[name] = value
            self._set_by_torch(name)
            return
        if (
            self.__dict__.get("_initialized", False)
            and not isinstance(value, (nn.Parameter, nn.Module))
            and name != "__class__"  # FSDP2's wrapping class, set once
            and _set_by_torchte()
        ):
            warnings.warn(
                f"{type(self).__name__}.{name} set through nn.Module.__setattr__ after "
                "construction: this is slow on the hot path; use _fast_setattr",
                RuntimeWarning,
                stacklevel=2,
            )
        super().__setattr__(name, value)

    def _set_by_torch(self, name: str) -> None:
        """Called after torch set one of SET_BY_TORCH (a subclass reacts; default nothing)."""

    def _fast_setattr(self, name: str, value: Any) -> None:
        """Set a plain attribute without nn.Module's bookkeeping (hot path)."""
        self.__dict__[name] = value


def _set_by_torchte() -> bool:
    """Whether the assignment that reached SetattrGuard.__setattr__ was written in torchte's
    own code (two frames up: past __setattr__ and this function). A property setter of a
    torchte module called from client code counts as the client's."""
    module = sys._getframe(2).f_globals.get("__name__", "")
    return module == "torchte" or module.startswith("torchte.")
