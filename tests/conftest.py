"""Shared pytest setup: skip `gpu` tests without CUDA, seed torch before every test, and an
NCCL group of one rank for the GPU tests of distributed code.

The `gpu` marker and RuntimeWarning-as-error live in pyproject.toml; nothing is registered
here. This folder is on sys.path, so tests import helpers as `from tolerances import ...`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

SEED = 1234


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests carrying the `gpu` marker as skipped when no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Seed torch's generators (CPU and every CUDA device) so each test is reproducible."""
    torch.manual_seed(SEED)


@pytest.fixture
def cpu_default_device():
    """Build layers and tensors on the CPU (the FP8 emulation) even on a GPU machine."""
    with torch.device("cpu"):
        yield


@pytest.fixture
def nccl_group(tmp_path):
    """An NCCL process group of one rank (the GPU tests of distributed code), destroyed after
    the test."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
