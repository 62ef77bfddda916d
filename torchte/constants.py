"""Transformer Engine's dtype tags (`transformer_engine.pytorch.constants.DType`, also
`te.DType`): an IntEnum with the values of Transformer Engine's C++ enum, which clients store,
compare and pass to Transformer Engine's quantizers; and its maps to and from torch dtypes.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed

__all__ = ["DType", "TE_DType", "TE_DType_To_Torch", "dist_group_type"]


class DType(enum.IntEnum):
    """A tensor's element type as Transformer Engine tags it (kFloat4E2M1: two values a byte)."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


# torch dtype -> DType, and back.
TE_DType = {
    torch.uint8: DType.kByte,
    torch.int32: DType.kInt32,
    torch.float32: DType.kFloat32,
    torch.float16: DType.kFloat16,
    torch.bfloat16: DType.kBFloat16,
    torch.float8_e4m3fn: DType.kFloat8E4M3,
    torch.float8_e5m2: DType.kFloat8E5M2,
    torch.float4_e2m1fn_x2: DType.kFloat4E2M1,
}
TE_DType_To_Torch = {tag: dtype for dtype, tag in TE_DType.items()}

# The type of the process groups Transformer Engine's arguments take.
dist_group_type = torch.distributed.ProcessGroup
