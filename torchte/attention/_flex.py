"""flex_attention as the attention backends call it: compiled on CUDA (its fused Triton kernel;
eager flex_attention materializes the scores), eager elsewhere.

Compiled with static shapes: a recompile with dynamic shapes left inductor without a kernel
choice for some masks on torch 2.11 (NoValidChoicesError). Should compiling still fail for a
signature (dtype and the shapes of q, k, v; seen for a value head size of 32 under a query/key
head size of 64), that signature runs eagerly from then on (the same result, slower; said once
per signature).
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["flex_function", "lse_request", "split_lse"]

_EAGER_SIGNATURES: set[tuple] = set()


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

    def run(q, k, v, *args, **kwargs):
        signature = (q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape))
        if signature in _EAGER_SIGNATURES:
            return flex_attention(q, k, v, *args, **kwargs)
        try:
            return compiled(q, k, v, *args, **kwargs)
        except errors as err:  # raised while compiling, before any kernel ran
            _EAGER_SIGNATURES.add(signature)
            warnings.warn(
                f"torchte attention: compiling flex_attention failed ({type(err).__name__}) for "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} {q.dtype}; these "
                "shapes run eagerly from now on (slower, more memory)",
                UserWarning,
                stacklevel=2,
            )
            return flex_attention(q, k, v, *args, **kwargs)

    return run


@functools.cache
def lse_request() -> dict:
    """flex_attention's keyword arguments that make it return (out, aux) with aux.lse, or
    (older torch, before AuxRequest) (out, lse); pair with `split_lse`."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def split_lse(result) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, sq, dv], lse [b, h, sq] fp32, natural log) of a flex_attention call made
    with `lse_request()`."""
    out, extra = result
    return out, extra if isinstance(extra, torch.Tensor) else extra.lse
