"""Sequence-parallel all-gathers of block-scaled values: each rank casts its own rows and the
bytes and scales are gathered, not the high-precision values (Float8BlockScaling's 1x128
blocks, MXFP8's 1x32, NVFP4's 1x16 with a per-tensor amax).

Legend: P ranks of the tensor-parallel group, each holding x (S_l, ..., K), its slice along
dim 0 (the sequence) of the whole tensor (P S_l, ..., K); M_l = prod(x.shape[:-1]) its rows,
M = P M_l. Every rank holds the same number of rows (sequence parallelism splits evenly), so
every rank takes the same branch and issues the same collectives.

The result equals, bytes and scales, the quantization of the gathered high-precision tensor:
- rowwise copies (blocks along K): a row's blocks and scales depend on that row alone (and on
  NVFP4's per-tensor amax, all-reduced with MAX first so every rank encodes with the global
  one), so each rank casts its rows and the pieces are concatenated along the rows.
- columnwise copies (blocks along the sequence): where each rank's rows are whole blocks
  (M_l a multiple of 128 / 32 / 16; NVFP4's Hadamard transform, over 16 rows, then stays
  inside a rank too) each rank makes its own and the pieces are concatenated along the rows
  (MXFP8: data (M, K) not transposed) or along the last dim (1x128 and NVFP4: data (K, M)).
  Elsewhere the whole tensor is gathered in high precision and quantized after (more bytes on
  the wire; a one-time UserWarning says why).
Scale buffers are gathered without their padding rows and padded again (with zeros, as the
casts pad them). NVFP4 with stochastic rounding draws its random bits per rank: the bytes are
then another draw of the same distribution, not those of one cast of the gathered tensor.

Collectives: the rowwise data (and MXFP8's columnwise data) gathered straight into its final
layout; the scales and the transposed columnwise data packed into one buffer and gathered once.
The result is always a Storage (internal), as the per-tensor quantize_gathered returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from torchte.kernels import block_cast as bc
from torchte.kernels import mxfp8_cast as mx
from torchte.kernels import nvfp4_cast as nv

from .blockwise import Float8BlockQuantizer, Float8BlockwiseQTensorStorage
from .mxfp8 import MXFP8Quantizer, MXFP8TensorStorage
from .nvfp4 import NVFP4Quantizer, NVFP4TensorStorage

__all__ = ["gather_blockwise", "gather_mxfp8", "gather_nvfp4", "quantize_gathered"]

ReduceMax = Callable[[torch.Tensor], None]
Gather = Callable[[torch.Tensor], torch.Tensor]

# Alignment of each part inside a packed buffer, in bytes (any dtype views back in place).
_PACK_ALIGN = 16
# The formats whose fallback was already warned about (one warning per format and process).
_warned: set[str] = set()


def quantize_gathered(quantizer, x_hp: torch.Tensor, reduce_max: ReduceMax, gather: Gather,
                      columnwise: bool):  # fmt: skip
    """The whole tensor (P S_l, ..., K) of which x_hp (S_l, ..., K) is this rank's piece along
    dim 0, quantized by `quantizer` (Float8BlockQuantizer with 1x128 blocks, MXFP8Quantizer or
    NVFP4Quantizer) with the rowwise copy, and the columnwise one when `columnwise`: each rank
    casts its rows and the bytes are gathered (module docstring). reduce_max(t) all-reduces t
    in place with MAX over the ranks; gather(t) all-gathers t along dim 0."""
    if isinstance(quantizer, Float8BlockQuantizer):
        return gather_blockwise(quantizer, x_hp, reduce_max, gather, columnwise)
    if isinstance(quantizer, MXFP8Quantizer):
        return gather_mxfp8(quantizer, x_hp, reduce_max, gather, columnwise)
    if isinstance(quantizer, NVFP4Quantizer):
        return gather_nvfp4(quantizer, x_hp, reduce_max, gather, columnwise)
    raise TypeError(f"quantize_gathered: no block-scaled gather for {type(quantizer).__name__}")


# ----------------------------------------------------------------------------------------------
# One function per format
# ----------------------------------------------------------------------------------------------


def gather_blockwise(
    quantizer: Float8BlockQuantizer, x_hp: torch.Tensor, reduce_max: ReduceMax, gather: Gather,
    columnwise: bool,
) -> Float8BlockwiseQTensorStorage:  # fmt: skip
    """quantize_gathered for Float8BlockScaling's 1x128 blocks: rowwise data (M, K) + scales
    (ceil(K/128), M) (gathered along their last dim); columnwise data (K, M) + scales
    (M/128, K) where M_l is a multiple of 128. 128x128 blocks (x_block_scaling_dim=2): the
    high-precision gather, then the cast (a tile spans rows of several ranks)."""
    if quantizer.block_scaling_dim != 1:
        reason = "128x128 activation tiles (x_block_scaling_dim=2) span several ranks' rows"
        return _gathered_hp(quantizer, x_hp, gather, columnwise, "Float8BlockScaling 2D", reason)
    x2d = _rows(x_hp)
    rows = x2d.shape[0]
    if rows == 0 or (columnwise and rows % bc.BLOCK):
        reason = f"each rank's {rows} rows are not whole 1x128 blocks of the columnwise copy"
        return _gathered_hp(quantizer, x_hp, gather, columnwise, "Float8BlockScaling", reason)
    data, scale, data_t, scale_t = bc.block_quantize(
        x2d, quantizer.fp8_dtype, 1, True, columnwise, quantizer.force_pow_2_scales,
        quantizer.amax_epsilon,
    )  # fmt: skip
    gathered_data = _gather_bytes(data, gather)
    parts = [(scale, "last")]
    if columnwise:
        parts += [(data_t, "last"), (scale_t, "rows")]
    packed = _gather_packed(parts, gather)
    data_t, scale_t = packed[1:] if columnwise else (None, None)
    shape = _whole_shape(x_hp, rows, gathered_data.shape[0])
    return Float8BlockwiseQTensorStorage(
        gathered_data, packed[0], data_t, scale_t, quantizer.fp8_dtype, shape, 1
    )


def gather_mxfp8(
    quantizer: MXFP8Quantizer, x_hp: torch.Tensor, reduce_max: ReduceMax, gather: Gather,
    columnwise: bool,
) -> MXFP8TensorStorage:  # fmt: skip
    """quantize_gathered for MXFP8: rowwise data (M, K) + codes (round_up(M, 128),
    round_up(K/32, 4)); columnwise data (M, K) + codes (round_up(M/32, 4), round_up(K, 128)),
    both gathered along the rows. Needs M_l a multiple of 32 (MXFP8 casts no partial block of
    rows), else the high-precision gather."""
    x2d = _rows(x_hp)
    rows, cols = x2d.shape
    if rows == 0 or rows % mx.BLOCK:
        reason = f"each rank's {rows} rows are not whole blocks of {mx.BLOCK} rows"
        return _gathered_hp(quantizer, x_hp, gather, columnwise, "MXFP8", reason)
    two_d = quantizer.with_2d_quantization
    data, scale, data_t, scale_t = mx.mxfp8_quantize(
        x2d, quantizer.fp8_dtype, True, columnwise, two_d
    )
    gathered_data = _gather_bytes(data, gather)
    parts = [(scale[:rows], "rows")]
    if columnwise:
        parts.append((scale_t[: rows // mx.BLOCK], "rows"))
        data_t = _gather_bytes(data_t, gather)
    packed = _gather_packed(parts, gather)
    total = gathered_data.shape[0]
    scale = _padded(packed[0], mx.scale_shape(total, cols, False))
    scale_t = _padded(packed[1], mx.scale_shape(total, cols, True)) if columnwise else None
    return MXFP8TensorStorage(
        gathered_data, scale, data_t, scale_t, quantizer.fp8_dtype,
        _whole_shape(x_hp, rows, total), two_d,
    )  # fmt: skip


def gather_nvfp4(
    quantizer: NVFP4Quantizer, x_hp: torch.Tensor, reduce_max: ReduceMax, gather: Gather,
    columnwise: bool,
) -> NVFP4TensorStorage:  # fmt: skip
    """quantize_gathered for NVFP4: the per-tensor amaxes (rowwise; the columnwise one after
    the Hadamard transform) all-reduced with reduce_max (then with the quantizer's own
    amax_reduction, if set) before any rank encodes; rowwise data (M, K/2) + scales
    (round_up(M, 128), round_up(K/16, 4)); columnwise data (K, M/2) + scales (round_up(K, 128),
    round_up(M/16, 4)), gathered along their last dim. Needs M_l a multiple of 16, else the
    high-precision gather."""
    x2d = _rows(x_hp)
    rows, cols = x2d.shape
    if rows == 0 or rows % nv.FP4_BLOCK:
        reason = f"each rank's {rows} rows are not whole blocks of {nv.FP4_BLOCK} rows"
        return _gathered_hp(quantizer, x_hp, gather, columnwise, "NVFP4", reason)
    spec = quantizer.spec(True, columnwise)
    amax = nv.compute_amax(x2d, spec)
    reduce_max(amax)  # both entries: MAX is elementwise
    if quantizer.amax_reduction is not None:
        quantizer._reduce(amax, spec)
    rng = quantizer._rng_state(x2d.device) if spec.stochastic else None
    data, scale, data_t, scale_t = nv.quantize(x2d, amax, spec, rng)
    gathered_data = _gather_bytes(data, gather)
    parts = [(scale[:rows], "rows")]
    if columnwise:
        parts += [(data_t, "last"), (scale_t[:cols, : rows // nv.FP4_BLOCK], "last")]
    packed = _gather_packed(parts, gather)
    total = gathered_data.shape[0]
    scale = _padded(packed[0], nv.scale_shape(total, cols))
    data_t = scale_t = None
    if columnwise:
        data_t, scale_t = packed[1], _padded(packed[2], nv.scale_shape(cols, total))
    return NVFP4TensorStorage(
        gathered_data, scale, data_t, scale_t, amax[0:1], amax[1:2] if columnwise else None,
        _whole_shape(x_hp, rows, total),
        rht_sign_mask=spec.sign_mask if spec.rht else None,
        with_2d_quantization=spec.two_d,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _rows(x_hp: torch.Tensor) -> torch.Tensor:
    """x_hp (S_l, ..., K) as (M_l, K); ValueError for a tensor of fewer than 2 dims."""
    if not isinstance(x_hp, torch.Tensor) or x_hp.dim() < 2:
        shape = tuple(x_hp.shape) if isinstance(x_hp, torch.Tensor) else type(x_hp).__name__
        raise ValueError(
            f"quantize_gathered: x_hp must be (S, ..., K) with the sequence first, got {shape}"
        )
    return x_hp.detach().reshape(-1, x_hp.shape[-1])


def _whole_shape(x_hp: torch.Tensor, rows: int, total: int) -> tuple[int, ...]:
    """The gathered tensor's shape (P S_l, ..., K), P = total / rows (rows > 0)."""
    return (x_hp.shape[0] * (total // rows), *x_hp.shape[1:])


def _gathered_hp(quantizer, x_hp: torch.Tensor, gather: Gather, columnwise: bool, name: str,
                 reason: str):  # fmt: skip
    """The fallback: x_hp gathered in high precision, then quantized. A UserWarning saying why,
    once per format and process (a tensor without rows moves nothing: no warning)."""
    whole = gather(x_hp.detach().contiguous())
    if not quantizer.internal:  # the result is a Storage, whatever the quantizer hands out
        quantizer = quantizer.copy()
        quantizer.internal = True
    out = quantizer.quantize(whole, rowwise=True, columnwise=columnwise)
    if x_hp.numel() > 0 and name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"{name} sequence-parallel gather: {reason}, so the input is gathered in high "
            "precision and quantized after (more bytes on the wire than the quantized gather); "
            "warned once",
            UserWarning,
            stacklevel=5,  # the caller of the quantizer's quantize_gathered
        )
    return out


def _gather_bytes(t: torch.Tensor, gather: Gather) -> torch.Tensor:
    """t (M_l, ...) gathered along dim 0 as raw bytes (gloo has no FP8 dtypes), in t's dtype."""
    return gather(t.contiguous().view(torch.uint8)).view(t.dtype)


def _gather_packed(parts: list[tuple[torch.Tensor, str]], gather: Gather) -> list[torch.Tensor]:
    """Each 2-D part of this rank's (t, "rows" or "last") gathered in one collective: the
    parts' bytes packed into one buffer, each at a multiple of _PACK_ALIGN bytes (the bytes
    between them unset, never read). Returns the whole tensors, contiguous: "rows" parts
    (P r, c), "last" parts (r, P c)."""
    spans, offset = [], 0
    for t, _ in parts:
        size = t.numel() * t.element_size()
        spans.append((offset, size))
        offset += size + -size % _PACK_ALIGN
    local = torch.empty(offset, dtype=torch.uint8, device=parts[0][0].device)
    for (t, _), (start, size) in zip(parts, spans, strict=True):
        local[start : start + size].view(t.dtype).view(t.shape).copy_(t)  # the one copy
    packed = gather(local)
    ranks = packed.numel() // offset
    packed = packed.view(ranks, offset)
    out = []
    for (t, axis), (start, size) in zip(parts, spans, strict=True):
        r, c = t.shape
        piece = packed[:, start : start + size].view(t.dtype).view(ranks, r, c)
        if axis == "rows":
            out.append(piece.reshape(ranks * r, c))
        else:
            out.append(piece.permute(1, 0, 2).reshape(r, ranks * c))
    return out


def _padded(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """t in the top-left corner of a zero tensor of `shape` (t itself where it is that)."""
    if tuple(t.shape) == tuple(shape):
        return t
    out = t.new_zeros(shape)
    out[: t.shape[0], : t.shape[1]] = t
    return out
