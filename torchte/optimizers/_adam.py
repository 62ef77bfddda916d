"""The Adam step of Transformer Engine's multi_tensor_adam functions, on torch's fused Adam.

One update, per element, in fp32 (Transformer Engine's kernels; mode 0 is Adam with L2
regularization, mode 1 AdamW):

    g = grad (* inv_scale, capturable)            g += wd * p           (mode 0)
    m = beta1 * m + (1 - beta1) * g               v = beta2 * v + (1 - beta2) * g * g
    update = (m / bc1) / (sqrt(v / bc2) + eps)    update += wd * p      (mode 1)
    p -= lr * update

bc1 = 1 - beta1 ** step, bc2 = 1 - beta2 ** step with bias correction, else 1. torch's fused
Adam / AdamW kernel (`torch._fused_adam_`, `torch._fused_adamw_`: one multi-tensor launch on
CUDA, vectorized on CPU) computes the same function with its operations in another order
(equal up to fp32 rounding); it runs when bias correction is on and each slot's tensors are
contiguous. Otherwise a foreach reference with Transformer Engine's order of operations runs.
Tensors of a dtype other than the slot's fp32 math (bf16 / fp16 params, grads or moments) are
updated through fp32 working copies and written back, rounded to nearest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchte.constants import TE_DType_To_Torch
from torchte.quantization.float8 import Float8Quantizer

from ._lists import check_flag, check_lists, fp32, working_fp32

__all__ = [
    "AdamHyper",
    "adam_update_",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adam_fp8",
    "multi_tensor_adam_param_remainder",
]

Scalar = float | torch.Tensor


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """The arguments of one Adam step. lr: float, or a one-element fp32 tensor (capturable);
    step: the step count after this step's increment, an int or a one-element tensor."""

    lr: Scalar
    beta1: float
    beta2: float
    eps: float
    step: int | torch.Tensor
    adamw: bool
    bias_correction: bool
    weight_decay: float

    @classmethod
    def of(cls, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay, name: str):
        """From Transformer Engine's positional arguments, checked."""
        if mode not in (0, 1):
            raise ValueError(f"{name}: mode must be 0 (Adam with L2) or 1 (AdamW), got {mode}")
        if not isinstance(step, torch.Tensor) and int(step) < 1:
            raise ValueError(f"{name}: step must be >= 1 (counted after the increment), got {step}")
        for arg, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{name}: {arg} must be in [0, 1], got {value}")
        b1, b2 = fp32(float(beta1)), fp32(float(beta2))
        lr = lr if isinstance(lr, torch.Tensor) else fp32(float(lr))
        step = step if isinstance(step, torch.Tensor) else int(step)
        args = (
            fp32(float(eps)),
            step,
            bool(mode),
            bool(bias_correction),
            fp32(float(weight_decay)),
        )
        return cls(lr, b1, b2, *args)


def adam_update_(
    targets: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    hyper: AdamHyper,
    found_inf: torch.Tensor | None = None,
    inv_scale: torch.Tensor | None = None,
) -> None:
    """One Adam step in place: targets (the weights the math updates: fp32 masters or the
    params), their grads and moments; slot i's tensors of one shape, any float dtype, on one
    device. found_inf: (1,) fp32, a 1 skips the step (nothing is written). inv_scale: (1,)
    fp32, the grads are multiplied by it and written back unscaled (unless skipped)."""
    lists = [targets, grads, exp_avgs, exp_avg_sqs]
    fusable = hyper.bias_correction and all(t.is_contiguous() for tensors in lists for t in tensors)
    dtypes = {t.dtype for tensors in lists for t in tensors}
    work = lists if fusable and len(dtypes) == 1 else [working_fp32(t) for t in lists]
    if fusable:
        _adam_fused_(*work, hyper, found_inf, inv_scale)
    else:
        _adam_reference_(*work, hyper, found_inf, inv_scale)
    written = (0, 1, 2, 3) if inv_scale is not None else (0, 2, 3)
    for k in written:
        _copy_changed(lists[k], work[k])


def _copy_changed(originals: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    pairs = [(o, c) for o, c in zip(originals, copies, strict=True) if o is not c]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [c for _, c in pairs])


def _adam_fused_(params, grads, exp_avgs, exp_avg_sqs, hyper, found_inf, inv_scale) -> None:
    """torch's fused Adam(W) on lists of one dtype (fp32 math inside)."""
    device = params[0].device
    step = hyper.step
    if isinstance(step, torch.Tensor):
        step_t = step.to(device=device, dtype=torch.float32).reshape(())
    else:
        step_t = torch.full((), float(step), dtype=torch.float32, device=device)
    lr = hyper.lr
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device=device, dtype=torch.float32).reshape(())
    grad_scale = None if inv_scale is None else torch.reciprocal(inv_scale.float().reshape(1))
    fused = torch._fused_adamw_ if hyper.adamw else torch._fused_adam_
    fused(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [step_t] * len(params),
        lr=lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


def bias_corrections(hyper: AdamHyper, device: torch.device) -> tuple[Scalar, Scalar]:
    """(bc1, bc2) as fp32 floats (an int step, computed in double as the kernels' host code
    does) or 0-dim fp32 tensors (a step tensor)."""
    if not hyper.bias_correction:
        return 1.0, 1.0
    if isinstance(hyper.step, torch.Tensor):
        step = hyper.step.to(device=device, dtype=torch.float32).reshape(())
        return 1.0 - torch.pow(hyper.beta1, step), 1.0 - torch.pow(hyper.beta2, step)
    return fp32(1.0 - hyper.beta1**hyper.step), fp32(1.0 - hyper.beta2**hyper.step)


def _adam_reference_(params, grads, exp_avgs, exp_avg_sqs, hyper, found_inf, inv_scale) -> None:
    """Transformer Engine's Adam on fp32 lists, operation by operation, in foreach ops."""
    device = params[0].device
    wd = hyper.weight_decay
    g = grads if inv_scale is None else torch._foreach_mul(grads, inv_scale.float().reshape(()))
    g_math = torch._foreach_add(g, params, alpha=wd) if not hyper.adamw and wd != 0 else g
    m = torch._foreach_mul(exp_avgs, hyper.beta1)
    torch._foreach_add_(m, g_math, alpha=fp32(1.0 - hyper.beta1))
    v = torch._foreach_mul(exp_avg_sqs, hyper.beta2)
    torch._foreach_addcmul_(v, g_math, g_math, value=fp32(1.0 - hyper.beta2))
    bc1, bc2 = bias_corrections(hyper, device)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, hyper.eps)
    update = torch._foreach_div(m, bc1)
    torch._foreach_div_(update, denom)
    if hyper.adamw and wd != 0:
        torch._foreach_add_(update, params, alpha=wd)
    lr = hyper.lr
    if isinstance(lr, torch.Tensor):
        torch._foreach_mul_(update, lr.to(device=device, dtype=torch.float32).reshape(()))
        p = torch._foreach_sub(params, update)
    else:
        p = torch._foreach_add(params, update, alpha=-lr)
    results = [(params, p), (exp_avgs, m), (exp_avg_sqs, v)]
    if inv_scale is not None:
        results.append((grads, g))
    for old, new in results:
        _commit(old, new, found_inf)


def _commit(old: list[torch.Tensor], new: list[torch.Tensor], found_inf) -> None:
    """old = new, or old kept where found_inf is 1 (no synchronization)."""
    if found_inf is None:
        torch._foreach_copy_(old, new)
        return
    skip = found_inf.reshape(()) != 0
    for o, n in zip(old, new, strict=True):
        torch.where(skip, o, n, out=o)


# ----------------------------------------------------------------------------------------------
# Transformer Engine's functions
# ----------------------------------------------------------------------------------------------


def _adam_lists(tensor_lists, counts, name, masters_at=None):
    """The checked lists; each slot's tensors viewed with the shape of its list-1 tensor (they
    must have its number of elements, and be contiguous where the shape differs)."""
    n = len(tensor_lists) if not isinstance(tensor_lists, torch.Tensor) else 0
    if n not in counts:
        raise ValueError(f"{name}: expected {' or '.join(map(str, counts))} tensor lists, got {n}")
    lists = check_lists(tensor_lists, n, name)
    for k, tensors in enumerate(lists[:5]):
        for j, t in enumerate(tensors):
            ref = lists[1][j]
            if t.numel() != ref.numel():
                raise ValueError(
                    f"{name}: tensor_lists[{k}][{j}] has {t.numel()} elements, the param "
                    f"{ref.numel()}"
                )
            if t.shape != ref.shape:
                if not t.is_contiguous():
                    raise ValueError(
                        f"{name}: tensor_lists[{k}][{j}] has shape {tuple(t.shape)}, the param "
                        f"{tuple(ref.shape)}; a tensor of another shape must be contiguous"
                    )
                tensors[j] = t.view(ref.shape)
    return lists


def _check_dtypes(tensors, allowed, what, name) -> None:
    for j, t in enumerate(tensors):
        if t.dtype not in allowed:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name}: {what} {j} has dtype {t.dtype}; expected {names}")


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_adam_dtypes(lists, name) -> None:
    for k, what in enumerate(("grad", "param", "exp_avg", "exp_avg_sq")):
        _check_dtypes(lists[k], _FLOATS, what, name)
    if len(lists) == 5 and "remainder" not in name:
        _check_dtypes(lists[4], (torch.float32,), "master param", name)


def _checked_lists(noop_flag, tensor_lists, counts, name):
    """The checked flag, lists (see _adam_lists) and their dtypes; the lists."""
    check_flag(noop_flag, name)
    lists = _adam_lists(tensor_lists, counts, name)
    _check_adam_dtypes(lists, name)
    return lists


@torch.no_grad()
def multi_tensor_adam(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """Adam on [grads, params, exp_avgs, exp_avg_sqs] (+ [fp32 master params]).

    With masters the math updates them and the params get their values (rounded to the
    params' dtype). Params, grads, moments: fp32 / bf16 / fp16. noop_flag is not read (as in
    Transformer Engine, infs and NaNs propagate).
    """
    name = "multi_tensor_adam"
    lists = _checked_lists(noop_flag, tensor_lists, (4, 5), name)
    hyper = AdamHyper.of(lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, name)
    if not lists[0]:
        return
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    if len(lists) == 5:
        adam_update_(lists[4], grads, exp_avgs, exp_avg_sqs, hyper)
        torch._foreach_copy_(params, lists[4])
    else:
        adam_update_(params, grads, exp_avgs, exp_avg_sqs, hyper)


@torch.no_grad()
def multi_tensor_adam_param_remainder(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """Adam on [grads, bf16 params, exp_avgs, exp_avg_sqs, int16 remainders]: the fp32 master
    of each param is its bf16 bits (rounded to nearest, ties away from zero) and the int16
    remainder of the low 16 bits (see masters_from_remainders); both are written back."""
    name = "multi_tensor_adam_param_remainder"
    lists = _checked_lists(noop_flag, tensor_lists, (5,), name)
    _check_dtypes(lists[1], (torch.bfloat16,), "param", name)
    _check_dtypes(lists[4], (torch.int16,), "param remainder", name)
    hyper = AdamHyper.of(lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, name)
    if not lists[0]:
        return
    grads, params, exp_avgs, exp_avg_sqs, remainders = lists
    flat, masters = masters_from_remainders(params, remainders)
    adam_update_(masters, grads, exp_avgs, exp_avg_sqs, hyper)
    split_into_remainders(flat, params, remainders)


def masters_from_remainders(
    params: list[torch.Tensor], remainders: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(flat fp32 buffer, one fp32 view per param): the master values of bf16 params and their
    int16 remainders. The bf16 param was rounded up (one ulp away from zero) where the
    remainder is negative: its top 16 bits are the param's bits minus that rounding."""
    hi = torch.cat([p.reshape(-1) for p in params]).view(torch.int16).to(torch.int32)
    lo = torch.cat([r.reshape(-1) for r in remainders]).to(torch.int32)
    hi = hi - (lo < 0).to(torch.int32)
    hi = ((hi + 0x8000) & 0xFFFF) - 0x8000  # int16 wrap-around, as the kernel's int16 math
    flat = (hi * 65536 + (lo & 0xFFFF)).view(torch.float32)
    pieces = flat.split([p.numel() for p in params])
    return flat, [piece.view(p.shape) for piece, p in zip(pieces, params, strict=True)]


def split_into_remainders(
    flat: torch.Tensor, params: list[torch.Tensor], remainders: list[torch.Tensor]
) -> None:
    """Write the fp32 masters in `flat` back as bf16 params (top 16 bits, plus one where the
    low half is >= 0x8000: round to nearest, ties away) and int16 remainders (the low 16 bits)."""
    bits = flat.view(torch.int32)
    lo = bits & 0xFFFF
    lo = lo - ((lo >> 15) << 16)  # as a signed int16
    hi = (bits >> 16) + (lo < 0).to(torch.int32)
    hi = ((hi + 0x8000) & 0xFFFF) - 0x8000
    sizes = [p.numel() for p in params]
    hi16 = hi.to(torch.int16).view(torch.bfloat16).split(sizes)
    lo16 = lo.to(torch.int16).split(sizes)
    torch._foreach_copy_(params, [h.view(p.shape) for h, p in zip(hi16, params, strict=True)])
    torch._foreach_copy_(
        remainders, [r16.view(r.shape) for r16, r in zip(lo16, remainders, strict=True)]
    )


@torch.no_grad()
def multi_tensor_adam_fp8(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    fp8_dtype,
) -> None:
    """Adam on [grads, FP8 params (bytes: uint8 or the FP8 dtype), exp_avgs, exp_avg_sqs,
    fp32 masters, scales, amaxes, scale_invs] (the last three (1,) fp32 each): the masters are
    updated, then cast to FP8 with the delayed scale (through a Float8Quantizer: amax
    max-accumulated, scale_inv = 1 / scale). fp8_dtype: a te.DType or torch FP8 dtype."""
    name = "multi_tensor_adam_fp8"
    check_flag(noop_flag, name)
    torch_fp8 = TE_DType_To_Torch.get(fp8_dtype, fp8_dtype)
    if torch_fp8 not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name}: fp8_dtype must be an FP8 e4m3 or e5m2 dtype, got {fp8_dtype}")
    if isinstance(tensor_lists, torch.Tensor) or len(tensor_lists) != 8:
        raise ValueError(f"{name}: expected 8 tensor lists")
    lists = _adam_lists(list(tensor_lists[:5]), (5,), name) + check_lists(tensor_lists[5:], 3, name)
    _check_dtypes(lists[0], _FLOATS, "grad", name)
    _check_dtypes(lists[1], (torch.uint8, torch_fp8), "param", name)
    states = ("exp_avg", "exp_avg_sq", "master", "scale", "amax", "scale_inv")
    for k, what in enumerate(states, start=2):
        _check_dtypes(lists[k], (torch.float32,), what, name)
    hyper = AdamHyper.of(lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, name)
    if not lists[0]:
        return
    grads, params, exp_avgs, exp_avg_sqs, masters, scales, amaxes, scale_invs = lists
    adam_update_(masters, grads, exp_avgs, exp_avg_sqs, hyper)
    for data, master, scale, amax, scale_inv in zip(
        params, masters, scales, amaxes, scale_invs, strict=True
    ):
        quantizer = Float8Quantizer(scale.reshape(1), amax.reshape(1), torch_fp8, internal=True)
        fresh = quantizer.quantize(master.reshape(1, -1), rowwise=True, columnwise=False)
        data.view(torch_fp8).copy_(fresh.rowwise_data.view(data.shape))
        scale_inv.copy_(fresh.scale_inv.reshape(scale_inv.shape))


def _make_capturable(count: int, name: str, doc: str):
    """A capturable function of Transformer Engine's signature on `count` tensor lists: lr and
    step tensors, grads unscaled by inv_scale, a set noop_flag skips the step."""

    @torch.no_grad()
    def capturable(
        chunk_size: int,
        noop_flag: torch.Tensor,
        tensor_lists: Sequence[Sequence[torch.Tensor]],
        lr: torch.Tensor,
        beta1: float,
        beta2: float,
        epsilon: float,
        step: torch.Tensor,
        mode: int,
        bias_correction: int,
        weight_decay: float,
        inv_scale: torch.Tensor,
    ) -> None:
        lists = _checked_lists(noop_flag, tensor_lists, (count,), name)
        for arg, value in (("lr", lr), ("step", step), ("inv_scale", inv_scale)):
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise TypeError(f"{name}: {arg} must be a one-element tensor")
        hyper = AdamHyper.of(
            lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay, name
        )
        if not lists[0]:
            return
        found_inf = noop_flag.to(device=lists[0][0].device, dtype=torch.float32).reshape(1)
        grads, params, exp_avgs, exp_avg_sqs = lists[:4]
        targets = lists[4] if count == 5 else params
        adam_update_(targets, grads, exp_avgs, exp_avg_sqs, hyper, found_inf, inv_scale)
        if count == 5:
            torch._foreach_copy_(params, targets)

    capturable.__name__ = capturable.__qualname__ = name
    capturable.__doc__ = doc
    return capturable


multi_tensor_adam_capturable = _make_capturable(
    4,
    "multi_tensor_adam_capturable",
    """Adam on [grads, params, exp_avgs, exp_avg_sqs] with lr and step read from tensors,
    grads multiplied by inv_scale (and written back), and nothing changed when noop_flag is
    set: no synchronization, for CUDA-graph capture.""",
)
multi_tensor_adam_capturable_master = _make_capturable(
    5,
    "multi_tensor_adam_capturable_master",
    """multi_tensor_adam_capturable on [grads, params, exp_avgs, exp_avg_sqs, fp32 masters]:
    the masters are updated and the params get their values.""",
)
