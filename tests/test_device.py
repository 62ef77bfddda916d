"""Where a module goes when built without `device`, and the cached FP8 capability check."""

from __future__ import annotations

import torch

import torchte as te
from torchte import _device


def test_default_is_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _device.default_device(None) == torch.device("cpu")


def test_default_is_cuda_with_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _device.default_device(None) == torch.device("cuda", 0)


def test_users_default_device_wins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with torch.device("cpu"):
        assert _device.default_device(None) == torch.device("cpu")
    with torch.device("meta"):
        layer = te.Linear(16, 16)
    assert layer.weight.device.type == "meta"


def test_explicit_device_and_params_dtype_default():
    layer = te.Linear(16, 8, device="cpu")
    assert layer.weight.device.type == "cpu"
    assert layer.weight.dtype == torch.get_default_dtype()


def test_fp8_support_is_computed_once_per_device(monkeypatch):
    calls = []
    compute = _device._fp8_support
    monkeypatch.setattr(_device, "_fp8_support", lambda d: calls.append(d) or compute(d))
    monkeypatch.setattr(_device, "_FP8_SUPPORT", {})
    first = _device.fp8_support(torch.device("cpu"))
    assert first[0] is True and "emulated" in first[1]
    assert _device.fp8_support(torch.device("cpu")) == first
    assert calls == [torch.device("cpu")]
