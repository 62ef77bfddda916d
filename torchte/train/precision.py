"""The compute dtype of a run: bf16 under torch.autocast, or fp32 throughout.

Master weights and the AdamW state are fp32 either way; FP8 GEMMs run under an FP8 recipe in
either mode. What differs is everything else the model computes (the GEMMs of the run without
FP8, the norms, activations, attention and the head): under "bf16" torch.autocast runs them in
bf16, under "fp32" autocast is off and te modules compute in their parameters' dtype, fp32.

`--compute-dtype auto` picks bf16 on a GPU (fp32 on one without bf16) and, on the CPU, whatever
the CPU runs faster: CPUs without bf16 instructions (AVX2-only x86, for one) emulate bf16
matrix products many times slower than fp32, where CPUs with AVX512-BF16 or AMX run them
faster. A timing probe of a fraction of a second, a matrix product of about the model's size
in both dtypes, decides; bf16 must be at least as fast as fp32 to be chosen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .timing import probe_shape, time_in_turn

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ComputeChoice:
    """The compute dtype of a run and why it was chosen."""

    name: str
    """"bf16" or "fp32"."""
    reason: str
    """Why, for the run's header line and the table's note."""

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of `name`."""
        return TORCH_DTYPES[self.name]


def choose_compute_dtype(
    requested: str, device: str, hidden: int = 128, ffn: int = 512
) -> ComputeChoice:
    """The compute dtype for --compute-dtype `requested` ("auto", "bf16" or "fp32") on
    `device`; the CPU's probe multiplies (tokens, hidden) by (hidden, ffn), both clamped."""
    if requested != "auto":
        return ComputeChoice(requested, f"--compute-dtype {requested}")
    if device == "cuda":
        if torch.cuda.is_bf16_supported():
            return ComputeChoice("bf16", "auto: bf16 on a GPU")
        return ComputeChoice("fp32", "auto: this GPU has no bf16")
    slowdown = bf16_slowdown(*probe_shape(hidden, ffn))
    if slowdown >= 2.0:
        return ComputeChoice(
            "fp32", f"auto: bf16 is emulated on this CPU, {slowdown:.0f}x slower than fp32"
        )
    if slowdown > 1.0:
        return ComputeChoice("fp32", "auto: bf16 is no faster than fp32 on this CPU")
    return ComputeChoice("bf16", f"auto: this CPU runs bf16 {1 / slowdown:.1f}x faster than fp32")


@functools.cache
def bf16_slowdown(m: int, k: int, n: int) -> float:
    """Time of a (m, k) @ (k, n) matrix product on the CPU in bf16 over its time in fp32: the
    best of a few runs each (timing.time_in_turn); measured once per shape. One thread: what is
    measured is the instructions, and a single thread does not wait for a sibling that another
    process keeps off its core."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    operands = [(a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
    work = [lambda x=x, w=w: torch.mm(x, w) for x, w in operands]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32_s, bf16_s = time_in_turn(work)
    finally:
        torch.set_num_threads(threads)
    return bf16_s / fp32_s
