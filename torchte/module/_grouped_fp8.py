"""te.GroupedLinear under FP8: all groups quantized in one launch into a GroupedStorage.

Legend as in grouped_linear.py. Forward: x's groups quantized together with their own scales
(delayed: GEMM g's input scale; current: each group's own amax), then y per group as te.Linear
computes it (fp8_gemm with the bias fused), or one torch._scaled_grouped_mm where it runs
(gemm.scaled_grouped_mm_supported: e4m3 operands on sm90). Backward: dy quantized the same way
with the grad_output scales, dgrad and wgrad per group with te.Linear's FP8 GEMMs, so with the
per-group forward the results equal a stack of te.Linear layers bit for bit.

Group sizes known only on the device (m_splits a device tensor; a CUDA graph replayed with new
splits): nothing reads them back. The grouped casts take the offsets on the device and leave
room for the worst case; fprop is the persistent TMA grouped GEMM with fast accumulation where
it runs (gemm.grouped_fprop_takes_tma: Hopper and newer, past SMALL_ROWS tokens; also with
host sizes, where it is as fast as cuBLAS per group in one launch), else
torch._scaled_grouped_mm where it takes the operands, else, like dgrad (whose e5m2 gradients
sm90's torch._scaled_grouped_mm refuses) and wgrad, one Triton grouped GEMM
(gemm.device_grouped_rows / device_grouped_wgrad) that finds each group's rows on the device;
bias gradients are one GEMM with a one-hot matrix. Results then differ from the per-group
cuBLAS GEMMs by the accumulation order. When determinism is asked for (ctx.exact,
grouped_linear.exact_requested) the sizes are read back and every GEMM runs per group.
"""

from __future__ import annotations

import torch

from torchte._device import graph_capturing
from torchte._group_splits import GroupSplits
from torchte.gemm import (
    device_grouped_rows,
    device_grouped_wgrad,
    fp8_gemm,
    grouped_fprop_takes_tma,
    scaled_grouped_dgrad,
    scaled_grouped_fprop,
    scaled_grouped_mm_supported,
)
from torchte.quantization.grouped import GroupedStorage

from ._common import (
    group_bias_rows,
    group_sums,
    restore_saved,
    save_for_backward,
    should_overwrite,
    stack_parameters,
)
from ._deferred_wgrad import group_wgrads
from ._linear_core import cast_to
from ._weight_cache import cached_quantization


def grouped_fp8_weights(weights, setup, key, is_first_microbatch, columnwise) -> GroupedStorage:
    """The G weights (N, K) quantized together, GEMM g's weight scale each, as one
    GroupedStorage of G groups of N rows: rowwise (G * N, K) is the (G, N, K) operand of the
    grouped GEMM, group g's columnwise block its (K, N) transpose for dgrad. Cached like
    te.Linear's FP8 weight (_weight_cache.cached_quantization): requantized when a weight or the
    scales moved."""

    def quantize() -> GroupedStorage:
        stacked = stack_parameters(weights)
        sizes = [stacked.shape[1]] * stacked.shape[0]
        rows = stacked.reshape(-1, stacked.shape[2])
        return setup.grouped_weight.quantize(rows, sizes, True, columnwise)

    capturing = graph_capturing(weights[0])
    cache = setup.grouped_weight_cache
    return cached_quantization(cache, key, is_first_microbatch, capturing, quantize, columnwise)


def fp8_forward(ctx, x, splits: GroupSplits, plan, biases, w_fp8: GroupedStorage, needs):
    """y (T, N) under FP8; saves what fp8_backward needs on ctx. x (T, K) in high precision,
    or a GroupedStorage a fused producer wrote with this GEMM's input quantizer (its groups
    the splits', columnwise data present when need_wgrad)."""
    need_dgrad, need_wgrad = needs
    first = plan.gemms[0]
    dtype, sizes = first.dtype, splits.host_sizes()  # sizes None: on the device only
    # save_original_input: x kept as given, cast again in backward (_wgrad_input)
    keep = need_wgrad and first.save_original_input and not isinstance(x, GroupedStorage)
    x_saved = x if keep else None
    if isinstance(x, GroupedStorage):
        x_fp8 = x
    else:
        x = cast_to(x, dtype).contiguous()
        x_fp8 = first.setup.grouped_input.quantize(x, splits, True, need_wgrad and not keep)
    num_groups, n = splits.num_groups, w_fp8.m_splits[0]
    bias = [cast_to(b, dtype) for b in biases] if biases else [None] * num_groups
    device = x_fp8.rowwise_data.device
    exact = ctx.exact  # GEMMs per group, as te.Linear runs them (sizes on the host then)
    # One grouped GEMM unless exact: the TMA kernel where it runs (faster than
    # torch._scaled_grouped_mm and level with per-expert cuBLAS, see grouped_fprop_takes_tma),
    # else torch._scaled_grouped_mm where it takes the operands.
    tma = not exact and grouped_fprop_takes_tma(x_fp8, w_fp8)
    one_gemm = not (exact or tma) and one_fprop_gemm(
        device, x_fp8.fp8_dtype, w_fp8.fp8_dtype, sizes, dtype
    )
    if tma or one_gemm or sizes is None:
        if one_gemm:
            y = scaled_grouped_fprop(x_fp8, w_fp8, splits, dtype)
        else:
            weights = w_fp8.rowwise_data.view(num_groups, n, -1)
            # fast accumulation, as te.Linear's forward GEMM (fp8_gemm use_fast_accum)
            y = device_grouped_rows(x_fp8, weights, w_fp8.scale_inv, dtype, fast_accum=True)
        if biases:
            y.add_(group_bias_rows(biases, splits, dtype))
    else:
        y = torch.empty(x_fp8.shape[0], n, dtype=dtype, device=x_fp8.rowwise_data.device)
        x_rows, _, x_scales = x_fp8.gemm_operands()
        w_rows, _, w_scales = w_fp8.gemm_operands()
        for g, (out, b) in enumerate(zip(y.split(sizes), bias, strict=True)):
            if sizes[g]:
                fp8_gemm(
                    x_rows[g], x_scales[g], w_rows[g], w_scales[g], dtype, bias=b, out=out,
                    use_fast_accum=True,
                )  # fmt: skip
    if need_wgrad and x_saved is None:
        x_fp8.update_usage(rowwise_usage=False)  # wgrad reads the columnwise blocks only
        x_saved = x_fp8
    save_for_backward(ctx, x_saved, w_fp8 if need_dgrad else None)
    return y


def _wgrad_input(x_saved, splits: GroupSplits, first) -> GroupedStorage:
    """The wgrad GEMMs' input: the saved FP8 value, or (save_original_input) the input kept as
    given, cast now with the forward's grouped quantizer (current scaling: the same bytes)."""
    if isinstance(x_saved, GroupedStorage):
        return x_saved
    x = cast_to(x_saved, first.dtype).contiguous()
    return first.setup.grouped_input.quantize(x, splits, False, True)


def one_fprop_gemm(device, a_dtype, b_dtype, sizes: list[int] | None, out_dtype) -> bool:
    """Whether fprop runs as one torch._scaled_grouped_mm for these group sizes (None: on the
    device, any split) and output dtype (it writes bf16 only)."""
    if out_dtype != torch.bfloat16:
        return False
    if scaled_grouped_mm_supported(device, a_dtype, b_dtype, True):
        return True
    if sizes is None:
        return False
    aligned = all(size % 16 == 0 for size in sizes)
    return aligned and scaled_grouped_mm_supported(device, a_dtype, b_dtype, False)


def fp8_backward(ctx, dy: torch.Tensor | GroupedStorage, dbias: torch.Tensor | None = None):
    """(dx, [dw_g], [db_g]) under FP8, the GEMMs and sums as te.Linear's per group, each GEMM
    writing its rows of one output buffer. dy (T, N) in high precision, or a GroupedStorage a
    fused producer wrote with this GEMM's grad_output quantizer, with dbias (G, N), the bias
    gradients it summed, when the biases want them."""
    x_saved, w_fp8 = restore_saved(ctx)
    plan, splits = ctx.plan, ctx.splits
    first = plan.gemms[0]
    x_fp8 = _wgrad_input(x_saved, splits, first) if ctx.need_wgrad else None
    dtype, sizes = first.dtype, splits.host_sizes()  # sizes None: on the device only
    if isinstance(dy, GroupedStorage):
        dy_fp8 = dy
        device = dy.scale_inv.device
    else:
        dy = cast_to(dy, dtype).contiguous()
        device = dy.device
        quantizer = first.setup.grouped_grad_output
        dy_fp8 = quantizer.quantize(dy, splits, ctx.need_dgrad, ctx.need_wgrad)
    if first.backward_hook is not None:
        first.backward_hook()
    n = dy_fp8.shape[1]
    dy_operands = None
    dx = None
    if ctx.need_dgrad:
        dx, dy_operands = _dgrad(dy_fp8, w_fp8, splits, dtype, ctx.exact)
    dws = [None] * ctx.num_gemms
    if ctx.need_wgrad:

        def compute() -> list:
            if sizes is None:

                def wgrad(out_dtype):
                    return device_grouped_wgrad(dy_fp8, x_fp8, out_dtype)

                return device_wgrads(ctx, wgrad, first.main_grad is not None, device)
            _, dy_cols, dy_scales = dy_operands or dy_fp8.gemm_operands()
            _, x_cols, x_scales = x_fp8.gemm_operands()
            operands = (dy_cols, dy_scales, x_cols, x_scales)
            if first.main_grad is not None:
                return _wgrad_into_main_grad(ctx, sizes, operands, device)
            return _wgrad_buffer(ctx, sizes, operands, (n, x_fp8.shape[1]), device)

        dws = group_wgrads(ctx, compute, device)  # delay_wgrad_compute: left to backward_dw
    dbs = [None] * ctx.num_bias
    if ctx.num_bias and ctx.bias_grad and dbias is not None:
        dbs = list(dbias.unbind(0))
    elif ctx.num_bias and ctx.bias_grad:
        if not isinstance(dy, torch.Tensor):
            raise ValueError("fp8_backward: an FP8 dy needs the bias gradients given (dbias)")
        if sizes is None:
            sums = group_sums(dy, splits).to(dtype)
        else:
            sums = torch.zeros(ctx.num_bias, n, dtype=dtype, device=device)
            for g, part in enumerate(dy.split(sizes)):
                if sizes[g]:
                    torch.sum(part, 0, out=sums[g])
        dbs = list(sums.unbind(0))
    return dx, dws, dbs


def _wgrad_into_main_grad(ctx, sizes: list[int], operands, device) -> list:
    """fuse_wgrad_accumulation: GEMM g's weight gradient written into (overwrite_main_grad,
    the first microbatch) or added to weight g's main_grad (fp32), as te.Linear does; the
    grads autograd gets (a dummy where the weight has grad_added_to_main_grad, else None)."""
    dy_cols, dy_scales, x_cols, x_scales = operands
    dws = []
    for g, gemm in enumerate(ctx.plan.gemms):
        target = gemm.main_grad
        ((param, _, _),) = target.params()
        overwrite = should_overwrite(param, gemm.is_first_microbatch)
        if sizes[g]:
            fp8_gemm(
                dy_cols[g], dy_scales[g], x_cols[g], x_scales[g], torch.float32,
                out=param.main_grad, accumulate=not overwrite,
            )  # fmt: skip
        elif overwrite:  # a group without rows adds nothing
            param.main_grad.zero_()
        finished = target.finish(param.shape, ctx.weight_dtype, device)
        dws.append(finished if ctx.weight_grads[g] else None)
    return dws


def device_wgrads(ctx, wgrad, into_main_grad: bool, device) -> list:
    """The weight gradients from one grouped GEMM, wgrad(out_dtype) -> (G, N, K), that reads
    the sizes on the device: handed out as views of its output, or (fuse_wgrad_accumulation)
    copied into or added to each weight's main_grad as _wgrad_into_main_grad decides, two
    multi-tensor launches."""
    if not into_main_grad:
        return list(wgrad(ctx.weight_dtype).unbind(0))
    grads = wgrad(torch.float32).unbind(0)
    copies, adds, dws = ([], []), ([], []), []
    for g, gemm in enumerate(ctx.plan.gemms):
        target = gemm.main_grad
        ((param, _, _),) = target.params()
        into = copies if should_overwrite(param, gemm.is_first_microbatch) else adds
        into[0].append(param.main_grad)
        into[1].append(grads[g])
        finished = target.finish(param.shape, ctx.weight_dtype, device)
        dws.append(finished if ctx.weight_grads[g] else None)
    if copies[0]:
        torch._foreach_copy_(*copies)
    if adds[0]:
        torch._foreach_add_(*adds)
    return dws


def _wgrad_buffer(ctx, sizes: list[int], operands, shape, device) -> list:
    """The weight gradients in one (G, N, K) buffer, handed out as views: one GEMM per group.
    (The columnwise data of dy and x are one (K, Mp_g) block per group, not the single (K, T)
    matrix with groups as column ranges that torch._scaled_grouped_mm's 2-D x 2-D form
    takes.)"""
    dy_cols, dy_scales, x_cols, x_scales = operands
    grads = torch.empty(ctx.num_gemms, *shape, dtype=ctx.weight_dtype, device=device)
    for g in range(ctx.num_gemms):
        if sizes[g]:
            fp8_gemm(
                dy_cols[g], dy_scales[g], x_cols[g], x_scales[g], ctx.weight_dtype,
                out=grads[g],
            )  # fmt: skip
        else:
            grads[g].zero_()  # a group without rows: zero wgrad
    return list(grads.unbind(0))


def _dgrad(dy_fp8: GroupedStorage, w_fp8: GroupedStorage, splits: GroupSplits, dtype, exact):
    """(dx (T, K), dy's gemm_operands or None): per group dy_g W_g, as one
    torch._scaled_grouped_mm where it takes these operands (the same probe as fprop's; on sm90
    not for e5m2 gradients) and exact (te.Linear's GEMMs asked for) is False, else one GEMM
    per group into one buffer."""
    sizes = splits.host_sizes()
    device = w_fp8.scale_inv.device
    dtypes = (dy_fp8.fp8_dtype, w_fp8.fp8_dtype)
    if not exact and one_fprop_gemm(device, *dtypes, sizes, dtype):
        return scaled_grouped_dgrad(dy_fp8, w_fp8, splits, dtype), None
    if sizes is None:
        num_groups, n = w_fp8.num_groups, w_fp8.m_splits[0]
        weights_t = w_fp8.columnwise_data.view(num_groups, -1, n)  # (G, K, N)
        return device_grouped_rows(dy_fp8, weights_t, w_fp8.scale_inv, dtype), None
    operands = dy_fp8.gemm_operands()
    dy_rows, _, dy_scales = operands
    _, w_cols, w_scales = w_fp8.gemm_operands()
    dx = torch.empty(dy_fp8.shape[0], w_fp8.shape[1], dtype=dtype, device=device)
    for g, out in enumerate(dx.split(sizes)):
        if sizes[g]:
            fp8_gemm(dy_rows[g], dy_scales[g], w_cols[g], w_scales[g], dtype, out=out)
    return dx, operands
