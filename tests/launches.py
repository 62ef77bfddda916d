"""Counting what a call puts on the GPU (tests import it as `from launches import ...`)."""

from __future__ import annotations

import torch


def count_device_ops(fn) -> int:
    """Kernels, memsets and copies that fn() puts on the GPU, counted with the torch profiler
    (0 if the profiler sees nothing). Run fn once before, to compile and fill caches."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
