"""Rule 1 of DESIGN.md for any torchte nn.Module: no nn.Module.__setattr__ on the hot path.

After construction (`_initialized` set in __dict__), a plain attribute set through
nn.Module.__setattr__ warns with RuntimeWarning (the test suite makes that an error); state that
changes per call is written with `_fast_setattr`, straight into __dict__.
"""

from __future__ import annotations

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
