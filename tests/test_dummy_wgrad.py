"""get_dummy_wgrad (Transformer Engine's transformer_engine.pytorch.module.base name): one
cached placeholder per shape, dtype and device."""

from __future__ import annotations

import pytest
import torch

from torchte.module.dummy_wgrad import get_dummy_wgrad


def test_one_cached_zero_tensor_per_shape_and_dtype(cpu_default_device):
    first = get_dummy_wgrad([3, 5], torch.bfloat16)
    assert first.shape == (3, 5) and first.dtype == torch.bfloat16
    assert first.device.type == "cpu" and not first.requires_grad
    assert torch.count_nonzero(first) == 0
    again = get_dummy_wgrad((3, 5), torch.bfloat16)
    assert again.data_ptr() == first.data_ptr()
    other_dtype = get_dummy_wgrad([3, 5], torch.float32)
    other_shape = get_dummy_wgrad([5, 3], torch.bfloat16)
    assert other_dtype.data_ptr() != first.data_ptr() != other_shape.data_ptr()


def test_zero_clears_what_a_caller_wrote(cpu_default_device):
    dummy = get_dummy_wgrad([7], torch.float32)
    dummy.fill_(2.0)
    assert torch.equal(get_dummy_wgrad([7], torch.float32), torch.full((7,), 2.0))
    cleared = get_dummy_wgrad([7], torch.float32, zero=True)
    assert cleared.data_ptr() == dummy.data_ptr() and torch.count_nonzero(cleared) == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="dtype"):
        get_dummy_wgrad([2], "float32")
    with pytest.raises(ValueError, match="non-negative"):
        get_dummy_wgrad([2, -1], torch.float32)
