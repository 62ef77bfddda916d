"""flex_attention as the attention backends call it: compiled on CUDA (its fused Triton kernel;
eager flex_attention materializes the scores), eager elsewhere.

Compiled with static shapes: a recompile with dynamic shapes left inductor without a kernel
choice for some masks on torch 2.11 (NoValidChoicesError). Should compiling still fail, the
call runs eagerly (the same result, slower; said once) and so do the later ones.
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["flex_function"]

_EAGER_AFTER_FAILURE: list[bool] = []


def _compile_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = []
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # an older torch
        pass
    try:
        from torch._dynamo.exc import BackendCompilerFailed

        errors.append(BackendCompilerFailed)
    except ImportError:
        pass
    return tuple(errors)


@functools.cache
def flex_function(device_type: str):
    """The flex_attention callable for tensors on `device_type`."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)
    errors = _compile_errors()

    def run(*args, **kwargs):
        if _EAGER_AFTER_FAILURE:
            return flex_attention(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except errors as err:  # raised while compiling, before any kernel ran
            _EAGER_AFTER_FAILURE.append(True)
            warnings.warn(
                f"torchte attention: compiling flex_attention failed ({type(err).__name__}); "
                "flex_attention runs eagerly from now on (slower, more memory)",
                UserWarning,
                stacklevel=2,
            )
            return flex_attention(*args, **kwargs)

    return run
