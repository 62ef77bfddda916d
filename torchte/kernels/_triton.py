"""Triton plumbing shared by the kernels: whether it can be used, and a low-overhead launch."""

from __future__ import annotations

import functools

import torch

__all__ = [
    "FastLaunch",
    "cdiv",
    "int_key",
    "next_power_of_2",
    "ptr_key",
    "sm_count",
    "tl",
    "triton",
    "triton_available",
]

# Every kernel file takes triton and triton.language from here: None on CPU-only installs, where
# the torch references run.
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0. Launchers use this, not triton.cdiv: in Triton 3.6 that is
    a ConstexprFunction, whose call from Python unwraps its arguments (about 10 us a call on
    the GPU machine's host, profiled)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); a plain function, for the reason cdiv
    gives."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def int_key(value: int) -> tuple[bool, int, int]:
    """What Triton specializes an int argument on: being 1, its residue mod 16, its width; the
    part of a FastLaunch key that stands for an int argument."""
    return value == 1, value & 15, value >> 31


def ptr_key(*tensors: torch.Tensor) -> tuple[int, ...]:
    """What Triton specializes pointer arguments on: each address modulo 16; the part of a
    FastLaunch key that stands for these tensors.

    A call costs more than writing `t.data_ptr() & 15` into the key's tuple for each tensor
    (about 0.2-0.5 us per key on a slow CPU): the launchers that list their pointers one by one
    keep that form. This replaces a generator over a tuple of tensors, which costs as much.
    """
    return tuple([t.data_ptr() & 15 for t in tensors])


# The current CUDA device's index straight from torch's C API where CUDA is built in:
# torch.cuda.current_device() adds a lazy-initialization check to every call (a few us of a
# launch's host time). CPU builds (the interpreter's tests) keep torch.cuda's own.
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


@functools.cache
def triton_available() -> bool:
    """True when triton imports and a CUDA device is present (computed once)."""
    return triton is not None and torch.cuda.is_available()


class FastLaunch:
    """Launches one Triton kernel with little host work (the hot path runs it per layer call).

    `kernel[grid](...)` re-derives Triton's specialization of every argument on each call. Here
    the caller passes a key that determines that specialization (each pointer's dtype and
    address modulo 16, each int's being 1 or a multiple of 16 or past int32, the constexprs,
    num_warps); the first launch for (device, key) goes through Triton, which compiles or finds
    the kernel, and later ones call the compiled kernel directly, as Triton's own launch does.
    Float arguments must always be Python floats (Triton does not specialize them).
    Compile options (num_stages, ...) go to the first launch only: the key must include them.
    """

    __slots__ = ("compiled", "kernel", "stream_of")

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}
        self.stream_of = None

    def __call__(
        self, key: tuple, grid: tuple[int, int, int], num_warps: int, *args, **options
    ) -> None:
        device = _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()
        compiled = self.compiled.get((device, key))
        if compiled is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps, **options)
            if compiled is not None:  # None under TRITON_INTERPRET
                self.compiled[(device, key)] = getattr(compiled, "result", lambda: compiled)()
                self.stream_of = triton.runtime.driver.active.get_current_stream
            return
        stream = self.stream_of(device)
        enter = triton.knobs.runtime.launch_enter_hook
        if enter is not None and getattr(enter, "calls", True):
            exit_ = triton.knobs.runtime.launch_exit_hook
            meta = compiled.launch_metadata(grid, stream, *args)
        else:  # an empty hook chain does nothing: skip it and the metadata it would get
            meta = enter = exit_ = None
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, meta,
            enter, exit_, *args,
        )  # fmt: skip
