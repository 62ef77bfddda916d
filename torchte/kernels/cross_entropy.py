"""Cross entropy over logits whose vocabulary may be split across ranks, loss and gradient.

Shapes (N rows = tokens, V = this rank's vocabulary shard, W ranks, the whole vocabulary is
W V and this rank holds classes vocab_start .. vocab_start + V - 1):
  x       (N, V) logits, fp32 / bf16 / fp16 (fp64 in the torch reference), unit stride along V
  target  (N,) int32 / int64, a class of the whole vocabulary, or ignore_idx
  stats   (4, N) per row of this shard, in the math dtype (fp32; fp64 for fp64 logits):
          max_v x, sum_v exp(x - max), the target's logit (-inf where another shard holds it),
          sum_v x
  stats_all (W, 4, N)  every rank's stats, rank r at [r] (the caller all-gathers them)
  loss    (N,) math dtype;  grad (N, V) math dtype, contiguous;  dx (N, V) in x's dtype

With the combined max m, d = sum over the whole vocabulary of exp(x - m), lse = m + log d,
eps = label_smoothing / (W V) and t the target:
  loss = (1 - ls) (lse - x_t) + ls (lse - mean_v x)      (torch's label smoothing, ls)
       = (1 - ls) (m - x_t) + log d + ls (m - mean_v x)  (as computed: no inf - inf for a
                                                          target logit of -inf)
  grad = softmax(x) - eps - (1 - ls) [v == t]
The gradient is of the unreduced loss of the row; the caller scales it by the upstream
gradient (and 1 / count for a mean) in cross_entropy_backward. A row whose target is
ignore_idx gets loss 0 and gradient 0; a target outside [0, W V) (that is not ignore_idx) gets
NaN loss and gradient: the caller checks targets before launching, and where it cannot (during
CUDA graph capture) a bad target shows as NaN, never as another class's loss.

The max and the sum of exponentials are taken online, block by block along V (one pass), as
are the target logit and the plain sum; a second pass writes the gradient. Shards combine as
d = sum_r d_r exp(m_r - m). On CUDA with Triton these run as Triton kernels, one program per
row (none when N is 0); elsewhere (and for fp64 logits) the torch reference below.
Kernels are launched through Triton's own launch: these run once per training step, not per
layer, so FastLaunch's saving is not worth its keys here.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, next_power_of_2, tl, triton, triton_available

__all__ = [
    "cross_entropy_backward",
    "cross_entropy_backward_reference",
    "cross_entropy_loss_and_grad",
    "cross_entropy_loss_and_grad_reference",
    "cross_entropy_stats",
    "cross_entropy_stats_reference",
    "math_dtype",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REFERENCE_DTYPES = (*_DTYPES, torch.float64)
_TARGET_DTYPES = (torch.int32, torch.int64)
# Largest block of a row one program holds at once, and the warps that run a row. Not yet
# tuned on a GPU.
MAX_BLOCK = 8192
MAX_WARPS = 16
# Elements per program of the backward's scale-and-cast.
BACKWARD_BLOCK = 4096
BACKWARD_WARPS = 8

if triton is not None:

    @triton.jit
    def _stats_kernel(
        x_ptr,  # (N, V); fp32 / bf16 / fp16, rows x_row_stride apart, unit stride along V
        target_ptr,  # (N,) int32 / int64
        stats_ptr,  # (4, N) fp32, contiguous: max, sum exp(x - max), target logit, sum x
        n_rows,  # N
        n_cols,  # V
        x_row_stride,
        vocab_start,  # the first class of this shard
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_row_stride
        cols = tl.arange(0, BLOCK)
        m = float("-inf")
        d = 0.0
        s = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            xb = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(xb, axis=0))
            # While every logit so far is -inf, exp(x - m) would be exp(-inf + inf): shift by 0.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            d = d * tl.exp(m - shift) + tl.sum(tl.exp(xb - shift), axis=0)
            s += tl.sum(tl.where(mask, xb, 0.0), axis=0)
            m = m_new
        local = tl.load(target_ptr + row).to(tl.int64) - vocab_start
        here = (local >= 0) & (local < n_cols)
        x_t = tl.load(x_row + tl.where(here, local, 0), mask=here, other=float("-inf"))
        tl.store(stats_ptr + row, m)
        tl.store(stats_ptr + n_rows + row, d)
        tl.store(stats_ptr + 2 * n_rows + row, x_t.to(tl.float32))
        tl.store(stats_ptr + 3 * n_rows + row, s)

    @triton.jit
    def _loss_grad_kernel(
        x_ptr,  # (N, V); fp32 / bf16 / fp16, rows x_row_stride apart, unit stride along V
        target_ptr,  # (N,) int32 / int64
        stats_ptr,  # (W, 4, N) fp32, contiguous: every rank's stats
        loss_ptr,  # (N,) fp32
        grad_ptr,  # (N, V) fp32, contiguous; written when WRITE_GRAD
        n_rows,  # N
        n_cols,  # V
        x_row_stride,
        vocab_start,  # the first class of this shard
        world,  # W
        ignore_idx,
        label_smoothing,  # fp32 in [0, 1]
        WRITE_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        m = float("-inf")
        for w in range(0, world):
            m = tl.maximum(m, tl.load(stats_ptr + w * 4 * n_rows + row))
        shift = tl.where(m == float("-inf"), 0.0, m)
        d = 0.0
        x_t = float("-inf")
        s = 0.0
        for w in range(0, world):
            at = stats_ptr + w * 4 * n_rows + row
            d += tl.load(at + n_rows) * tl.exp(tl.load(at) - shift)
            x_t = tl.maximum(x_t, tl.load(at + 2 * n_rows))
            s += tl.load(at + 3 * n_rows)
        y = tl.load(target_ptr + row).to(tl.int64)
        n_vocab = n_cols * world
        ignored = y == ignore_idx
        valid = (y >= 0) & (y < n_vocab)
        eps = label_smoothing / n_vocab
        # With ls = 0 the smoothing terms are left out, not multiplied by 0 (inf * 0).
        loss = (m - x_t) + tl.log(d)
        if label_smoothing > 0.0:
            smooth = label_smoothing * (m - s / n_vocab)
            loss = (1.0 - label_smoothing) * (m - x_t) + tl.log(d) + smooth
        loss = tl.where(valid, loss, float("nan"))
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
        if WRITE_GRAD:
            x_row = x_ptr + row * x_row_stride
            g_row = grad_ptr + row * n_cols
            cols = tl.arange(0, BLOCK)
            inv_d = 1.0 / d
            hit = 1.0 - label_smoothing
            local = y - vocab_start
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                mask = offs < n_cols
                xb = tl.load(x_row + offs, mask=mask & ~ignored, other=0.0).to(tl.float32)
                g = tl.exp(xb - shift) * inv_d - eps
                g = tl.where(offs == local, g - hit, g)
                g = tl.where(valid, g, float("nan"))
                tl.store(g_row + offs, tl.where(ignored, 0.0, g), mask=mask)

    @triton.jit
    def _scale_kernel(
        grad_ptr,  # (N, V) fp32, contiguous
        scale_ptr,  # (N,) fp32, or (1,) when scale_stride is 0
        dx_ptr,  # (N, V) contiguous, x's dtype; may be grad_ptr itself
        n_cols,  # V
        scale_stride,  # 1 (a scale per row) or 0 (one scale)
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        k = tl.load(scale_ptr + row * scale_stride)
        g = tl.load(grad_ptr + row * n_cols + offs, mask=mask, other=0.0)
        tl.store(dx_ptr + row * n_cols + offs, (g * k).to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Public API and launchers
# ----------------------------------------------------------------------------------------------


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss, the gradient and the stats are computed and kept in: fp64 for fp64
    logits, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64 and triton_available()


def cross_entropy_stats(x: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Per-row stats of this vocabulary shard: x (N, V), target (N,) -> stats (4, N) in the math
    dtype (max, sum of exp(x - max), the target's logit or -inf, sum of x)."""
    if _use_triton(x):
        return _stats_triton(x, target, vocab_start)
    return cross_entropy_stats_reference(x, target, vocab_start)


def cross_entropy_loss_and_grad(
    x: torch.Tensor,
    target: torch.Tensor,
    stats_all: torch.Tensor,
    vocab_start: int,
    ignore_idx: int,
    label_smoothing: float,
    write_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss (N,), grad (N, V)), both in the math dtype, of x (N, V) and target (N,) given every
    rank's stats (W, 4, N); grad is (0, V) when not write_grad (loss only)."""
    if _use_triton(x):
        return _loss_grad_triton(
            x, target, stats_all, vocab_start, ignore_idx, label_smoothing, write_grad
        )
    return cross_entropy_loss_and_grad_reference(
        x, target, stats_all, vocab_start, ignore_idx, label_smoothing, write_grad
    )


def cross_entropy_backward(
    grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, in_place: bool = False
) -> torch.Tensor:
    """dx = grad * scale, rounded once to `dtype`: grad (N, V) fp32 / fp64, scale (N,) (a
    factor per row) or (1,) in grad's dtype -> dx (N, V). in_place (dtype must be grad's):
    written into grad, which is returned."""
    _check_backward(grad, scale, dtype, in_place)
    if grad.is_cuda and grad.dtype == torch.float32 and triton_available():
        return _backward_triton(grad, scale, dtype, in_place)
    return cross_entropy_backward_reference(grad, scale, dtype, in_place)


def check_logits(x: torch.Tensor, target: torch.Tensor, name: str = "cross_entropy") -> None:
    """ValueError / TypeError unless x is (N, V) of a supported float dtype with V >= 1 and a
    unit stride along V, and target (N,) int32 / int64 on x's device."""
    if x.dtype not in _REFERENCE_DTYPES:
        raise TypeError(
            f"{name}: logits must be float32, bfloat16, float16 or float64, got {x.dtype}"
        )
    if x.dim() != 2 or x.shape[1] < 1 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"{name}: logits must be (N, V) with V >= 1 and unit stride along V, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"{name}: target must be int64 or int32, got {target.dtype}")
    if target.dim() != 1 or target.shape[0] != x.shape[0]:
        raise ValueError(
            f"{name}: target must be (N,) = ({x.shape[0]},) for logits {tuple(x.shape)}, got "
            f"{tuple(target.shape)}"
        )
    if target.device != x.device:
        raise ValueError(f"{name}: target is on {target.device}, logits on {x.device}")


def _check_loss_inputs(x: torch.Tensor, target: torch.Tensor, stats_all: torch.Tensor) -> None:
    """check_logits, then every rank's stats (W, 4, N) in the math dtype on x's device."""
    check_logits(x, target)
    want = math_dtype(x.dtype)
    if stats_all.dim() != 3 or stats_all.shape[1:] != (4, x.shape[0]) or stats_all.shape[0] < 1:
        raise ValueError(
            f"cross_entropy: stats_all must be (W, 4, N) = (W, 4, {x.shape[0]}), got "
            f"{tuple(stats_all.shape)}"
        )
    if stats_all.dtype != want or stats_all.device != x.device:
        raise ValueError(
            f"cross_entropy: stats_all must be {want} on {x.device}, got {stats_all.dtype} on "
            f"{stats_all.device}"
        )


def _check_backward(
    grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, in_place: bool
) -> None:
    if grad.dim() != 2 or grad.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"cross_entropy_backward: grad must be (N, V) float32 / float64, got "
            f"{grad.dtype} {tuple(grad.shape)}"
        )
    if not grad.is_contiguous():
        raise ValueError("cross_entropy_backward: grad must be contiguous")
    if scale.dim() != 1 or scale.shape[0] not in (1, grad.shape[0]) or scale.dtype != grad.dtype:
        raise ValueError(
            f"cross_entropy_backward: scale must be ({grad.shape[0]},) or (1,) of {grad.dtype}, "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    if scale.device != grad.device:
        raise ValueError(
            f"cross_entropy_backward: scale is on {scale.device}, grad on {grad.device}"
        )
    if in_place and dtype != grad.dtype:
        raise ValueError(
            f"cross_entropy_backward: in_place needs dtype {grad.dtype} (grad's), got {dtype}"
        )


def _launch_shape(n_cols: int, max_block: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of n_cols elements."""
    block = min(next_power_of_2(n_cols), max_block)
    return block, max(1, min(MAX_WARPS, block // 256))


def _stats_triton(
    x: torch.Tensor, target: torch.Tensor, vocab_start: int, max_block: int = MAX_BLOCK
) -> torch.Tensor:
    """Launch _stats_kernel: x (N, V), target (N,) -> stats (4, N) fp32."""
    check_logits(x, target)
    n_rows, n_cols = x.shape
    stats = torch.empty(4, n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return stats
    block, num_warps = _launch_shape(n_cols, max_block)
    _stats_kernel[(n_rows,)](
        x, target, stats, n_rows, n_cols, x.stride(0), vocab_start, BLOCK=block,
        num_warps=num_warps,
    )  # fmt: skip
    return stats


def _loss_grad_triton(
    x: torch.Tensor,
    target: torch.Tensor,
    stats_all: torch.Tensor,
    vocab_start: int,
    ignore_idx: int,
    label_smoothing: float,
    write_grad: bool,
    max_block: int = MAX_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch _loss_grad_kernel: -> (loss (N,) fp32, grad (N, V) fp32, or (0, V))."""
    _check_loss_inputs(x, target, stats_all)
    n_rows, n_cols = x.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grad_rows = n_rows if write_grad else 0
    grad = torch.empty(grad_rows, n_cols, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return loss, grad
    block, num_warps = _launch_shape(n_cols, max_block)
    _loss_grad_kernel[(n_rows,)](
        x, target, stats_all.contiguous(), loss, grad if write_grad else loss, n_rows, n_cols,
        x.stride(0), vocab_start, stats_all.shape[0], ignore_idx, float(label_smoothing),
        WRITE_GRAD=write_grad, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return loss, grad


def _backward_triton(
    grad: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    in_place: bool,
    block: int = BACKWARD_BLOCK,
) -> torch.Tensor:
    """Launch _scale_kernel: grad (N, V) fp32, scale (N,) or (1,) -> dx (N, V) in dtype."""
    n_rows, n_cols = grad.shape
    dx = grad if in_place else torch.empty(n_rows, n_cols, dtype=dtype, device=grad.device)
    if dx.numel() == 0:
        return dx
    block = min(block, next_power_of_2(n_cols))
    stride = 0 if scale.shape[0] == 1 else 1
    grid = (n_rows, cdiv(n_cols, block))
    num_warps = max(1, min(BACKWARD_WARPS, block // 256))
    _scale_kernel[grid](grad, scale, dx, n_cols, stride, BLOCK=block, num_warps=num_warps)
    return dx


# ----------------------------------------------------------------------------------------------
# Torch reference: the same functions, used on CPU, for fp64 logits, and in tests
# ----------------------------------------------------------------------------------------------


def _shifted(m: torch.Tensor) -> torch.Tensor:
    """The max to subtract before exp: 0 where it is -inf (a row of -inf logits)."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def cross_entropy_stats_reference(
    x: torch.Tensor, target: torch.Tensor, vocab_start: int
) -> torch.Tensor:
    """Torch reference of cross_entropy_stats: x (N, V), target (N,) -> stats (4, N)."""
    check_logits(x, target)
    x_m = x.to(math_dtype(x.dtype))
    n_cols = x.shape[1]
    m = x_m.amax(dim=1)
    d = torch.exp(x_m - _shifted(m)[:, None]).sum(dim=1)
    local = target.long() - vocab_start
    here = (local >= 0) & (local < n_cols)
    x_t = x_m.gather(1, torch.where(here, local, 0)[:, None])[:, 0]
    x_t = torch.where(here, x_t, float("-inf"))
    return torch.stack([m, d, x_t, x_m.sum(dim=1)])


def _combine_reference(stats_all: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(m, shift, d, x_t, s), each (N,), over the whole vocabulary from (W, 4, N)."""
    m_w, d_w, xt_w, s_w = stats_all.unbind(dim=1)
    m = m_w.amax(dim=0)
    shift = _shifted(m)
    d = (d_w * torch.exp(m_w - shift)).sum(dim=0)
    return m, shift, d, xt_w.amax(dim=0), s_w.sum(dim=0)


def cross_entropy_loss_and_grad_reference(
    x: torch.Tensor,
    target: torch.Tensor,
    stats_all: torch.Tensor,
    vocab_start: int,
    ignore_idx: int,
    label_smoothing: float,
    write_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of cross_entropy_loss_and_grad: -> (loss (N,), grad (N, V) or (0, V))."""
    _check_loss_inputs(x, target, stats_all)
    n_cols = x.shape[1]
    m, shift, d, x_t, s = _combine_reference(stats_all)
    y = target.long()
    n_vocab = n_cols * stats_all.shape[0]
    ignored = y == ignore_idx
    valid = (y >= 0) & (y < n_vocab)
    eps = label_smoothing / n_vocab
    loss = (m - x_t) + torch.log(d)
    if label_smoothing > 0.0:
        smooth = label_smoothing * (m - s / n_vocab)
        loss = (1.0 - label_smoothing) * (m - x_t) + torch.log(d) + smooth
    loss = torch.where(valid, loss, float("nan"))
    loss = torch.where(ignored, 0.0, loss)
    if not write_grad:
        return loss, torch.empty(0, n_cols, dtype=loss.dtype, device=x.device)
    x_m = x.to(loss.dtype)
    grad = torch.exp(x_m - shift[:, None]) * (1.0 / d)[:, None] - eps
    cols = torch.arange(n_cols, device=x.device)
    hit = cols[None, :] == (y - vocab_start)[:, None]
    grad = torch.where(hit, grad - (1.0 - label_smoothing), grad)
    grad = torch.where(valid[:, None], grad, float("nan"))
    grad = torch.where(ignored[:, None], 0.0, grad)
    return loss, grad.contiguous()


def cross_entropy_backward_reference(
    grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, in_place: bool = False
) -> torch.Tensor:
    """Torch reference of cross_entropy_backward: grad (N, V), scale (N,) or (1,) -> dx (N, V)."""
    _check_backward(grad, scale, dtype, in_place)
    if in_place:
        return grad.mul_(scale[:, None])
    return (grad * scale[:, None]).to(dtype)
