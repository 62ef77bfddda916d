"""te.DotProductAttention against an fp64 softmax(Q K^T) V built from exactly representable
inputs (dpa_reference.py): formats x mask types x GQA x backends, forward and gradients, on
the CPU; the CUDA backends (sdpa, flex) in bf16 under the `gpu` marker.

Legend: b batch, sq / skv query / key lengths, h query heads, hg key/value heads, d / dv head
sizes. Queries 5 and keys 7 make bottom-right and top-left diagonals differ.
"""

from __future__ import annotations

import pytest
import torch
from dpa_reference import cu_seqlens, output_to_bshd, padding, qkv, reference, to_format
from tolerances import assert_close, assert_close_to_scale, representable

import torchte as te

MASKS = (
    "no_mask",
    "causal",
    "padding",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
GQA = ((4, 4), (4, 2), (4, 1))
D, DV = 16, 8
SCALE = 0.25  # 1 / sqrt(D): exact
LENGTHS_Q, LENGTHS_KV = [5, 3], [4, 7]  # b = 2; sequences padded at their end


def _mask_inputs(mask_type: str, b: int, sq: int, skv: int, h: int, as_cu: bool):
    """(forward kwargs, reference kwargs) for the mask type."""
    if "padding" in mask_type:
        len_q = LENGTHS_Q if sq != skv else [LENGTHS_KV[0], sq - 1]
        len_kv = LENGTHS_KV if sq != skv else len_q
        pad_q, pad_kv = padding(len_q, sq), padding(len_kv, skv)
        if as_cu:
            kwargs = dict(cu_seqlens_q=cu_seqlens(len_q), cu_seqlens_kv=cu_seqlens(len_kv))
        elif sq == skv:
            kwargs = dict(attention_mask=pad_q.view(b, 1, 1, sq))
        else:
            kwargs = dict(attention_mask=(pad_q.view(b, 1, 1, sq), pad_kv.view(b, 1, 1, skv)))
        return kwargs, dict(pad_q=pad_q, pad_kv=pad_kv)
    if mask_type == "arbitrary":
        gen = torch.Generator().manual_seed(7)
        mask = torch.rand(b, 1, sq, skv, generator=gen) < 0.4
        mask[0, 0, 1] = True  # a query row that sees no key
        return dict(attention_mask=mask), dict(arbitrary=mask)
    return {}, {}


def _run(module, inputs, fmt, dtype, backend, kwargs, grad=True):
    """Module output [b, sq, h, dv] and the gradients of q, k, v (bshd, fp32 values)."""
    q, k, v, dout = inputs
    leaves = [to_format(x, fmt).to(dtype).clone().requires_grad_(grad) for x in (q, k, v)]
    out = module(*leaves, attention_backend=backend, **kwargs)
    out_bshd = output_to_bshd(out, fmt, q.shape[2])
    if not grad:
        return out_bshd, None
    out_bshd.backward(dout.to(dtype))
    grads = [to_format(x.grad, fmt) if fmt == "bshd" else x.grad.transpose(0, 1) for x in leaves]
    return out_bshd, grads


def _reference(inputs, ref_kwargs):
    q, k, v, dout = (x.to(torch.float64).clone().requires_grad_(True) for x in inputs)
    out = reference(q, k, v, scale=SCALE, **ref_kwargs)
    out.backward(dout)
    return out, [q.grad, k.grad, v.grad]


def _check(out, grads, ref_out, ref_grads, dtype):
    assert_close(out, ref_out, dtype)
    if grads is None:
        return
    for name, grad, ref in zip("qkv", grads, ref_grads, strict=True):
        assert_close_to_scale(grad, ref, dtype, msg=f"grad of {name}")


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("heads", GQA, ids=lambda hh: f"h{hh[0]}g{hh[1]}")
@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("sq,skv", [(6, 6), (5, 7)], ids=["self", "cross"])
def test_formats_masks_gqa(fmt, mask_type, heads, backend, sq, skv):
    h, hg = heads
    b = 2
    module = te.DotProductAttention(
        h,
        (D, DV),
        num_gqa_groups=hg,
        qkv_format=fmt,
        attn_mask_type=mask_type,
        attention_type="self" if sq == skv else "cross",
    )
    inputs = qkv(b, sq, skv, h, hg, D, DV, torch.float32)
    kwargs, ref_kwargs = _mask_inputs(mask_type, b, sq, skv, h, as_cu=False)
    out, grads = _run(module, inputs, fmt, torch.float32, backend, kwargs)
    ref_out, ref_grads = _reference(inputs, dict(mask_type=mask_type, **ref_kwargs))
    _check(out, grads, ref_out, ref_grads, torch.float32)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_padding_from_cu_seqlens(mask_type, backend):
    b, sq, skv, h, hg = 2, 5, 7, 4, 2
    module = te.DotProductAttention(h, (D, DV), hg, qkv_format="bshd", attn_mask_type=mask_type)
    inputs = qkv(b, sq, skv, h, hg, D, DV, torch.float32)
    kwargs, ref_kwargs = _mask_inputs(mask_type, b, sq, skv, h, as_cu=True)
    out, grads = _run(module, inputs, "bshd", torch.float32, backend, kwargs)
    ref_out, ref_grads = _reference(inputs, dict(mask_type=mask_type, **ref_kwargs))
    _check(out, grads, ref_out, ref_grads, torch.float32)
    assert torch.equal(out[1, 3:], torch.zeros_like(out[1, 3:]))  # padded queries give zeros


@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("heads", GQA, ids=lambda hh: f"h{hh[0]}g{hh[1]}")
def test_flex_forward_on_cpu(mask_type, heads):
    """flex_attention runs forward only on the CPU (no backward there)."""
    h, hg = heads
    b, sq, skv = 2, 5, 7
    module = te.DotProductAttention(h, (D, DV), hg, qkv_format="bshd", attn_mask_type=mask_type)
    inputs = qkv(b, sq, skv, h, hg, D, DV, torch.float32)
    kwargs, ref_kwargs = _mask_inputs(mask_type, b, sq, skv, h, as_cu=False)
    with torch.no_grad():
        out, _ = _run(module, inputs, "bshd", torch.float32, "flex", kwargs, grad=False)
    ref_out = reference(*inputs[:3], scale=SCALE, mask_type=mask_type, **ref_kwargs)
    assert_close(out, ref_out, torch.float32)


WINDOWS = [
    ("no_mask", (2, 1)),
    ("no_mask", (0, 0)),
    ("padding", (1, 2)),
    ("arbitrary", (3, 0)),
    ("causal", (2, 0)),
    ("causal_bottom_right", (1, 0)),
    ("padding_causal", (2, 0)),
    ("padding_causal_bottom_right", (0, 0)),
]


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("mask_type,window", WINDOWS)
def test_sliding_window(mask_type, window, backend):
    b, sq, skv, h, hg = 2, 5, 7, 4, 2
    module = te.DotProductAttention(
        h, (D, DV), hg, qkv_format="sbhd", attn_mask_type=mask_type, window_size=window
    )
    inputs = qkv(b, sq, skv, h, hg, D, DV, torch.float32)
    kwargs, ref_kwargs = _mask_inputs(mask_type, b, sq, skv, h, as_cu=False)
    out, grads = _run(module, inputs, "sbhd", torch.float32, backend, kwargs)
    ref_out, ref_grads = _reference(inputs, dict(mask_type=mask_type, window=window, **ref_kwargs))
    _check(out, grads, ref_out, ref_grads, torch.float32)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_window_overridden_in_forward_and_top_left_diagonal(backend):
    """forward's window_size and bottom_right_diagonal=False (a top-left window)."""
    b, sq, skv, h = 1, 5, 7, 2
    module = te.DotProductAttention(h, D, qkv_format="bshd", attn_mask_type="no_mask")
    inputs = qkv(b, sq, skv, h, h, D, D, torch.float32)
    kwargs = dict(window_size=(1, 1), bottom_right_diagonal=False)
    out, grads = _run(module, inputs, "bshd", torch.float32, backend, kwargs)
    ref_kwargs = dict(mask_type="no_mask", window=(1, 1), bottom_right=False)
    _check(out, grads, *_reference(inputs, ref_kwargs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("mask_type", ["causal", "padding_causal_bottom_right"])
def test_half_precision_forward(dtype, backend, mask_type):
    b, sq, skv, h, hg = 2, 5, 7, 4, 2
    module = te.DotProductAttention(h, (D, DV), hg, qkv_format="bshd", attn_mask_type=mask_type)
    inputs = qkv(b, sq, skv, h, hg, D, DV, dtype)
    kwargs, ref_kwargs = _mask_inputs(mask_type, b, sq, skv, h, as_cu=False)
    out, _ = _run(module, inputs, "bshd", dtype, backend, kwargs, grad=False)
    assert out.dtype == dtype
    ref = reference(*inputs[:3], scale=SCALE, mask_type=mask_type, **ref_kwargs)
    assert_close(out, ref.to(dtype), dtype)


ALIBI_CASES = [
    ("no_mask", None),
    ("causal", None),
    ("causal_bottom_right", "heads"),
    ("padding", "batch_heads"),
    ("padding_causal", "heads"),
]


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("mask_type,slopes_kind", ALIBI_CASES)
def test_alibi(mask_type, slopes_kind, backend):
    b, sq, skv, h, hg = 2, 5, 7, 4, 2
    module = te.DotProductAttention(h, (D, DV), hg, qkv_format="bshd", attn_mask_type=mask_type)
    inputs = qkv(b, sq, skv, h, hg, D, DV, torch.float32)
    kwargs, ref_kwargs = _mask_inputs(mask_type, b, sq, skv, h, as_cu=False)
    if slopes_kind is None:  # ALiBi's own slopes for 4 heads: 2^-2, 2^-4, 2^-6, 2^-8
        slopes, ref_slopes = None, torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    else:
        shape = (h,) if slopes_kind == "heads" else (b, h)
        slopes = representable(shape, torch.float32, scale=0.5).abs()
        ref_slopes = slopes
    kwargs = dict(kwargs, core_attention_bias_type="alibi", alibi_slopes=slopes)
    out, grads = _run(module, inputs, "bshd", torch.float32, backend, kwargs)
    ref_kwargs = dict(ref_kwargs, mask_type=mask_type, alibi_slopes=ref_slopes)
    _check(out, grads, *_reference(inputs, ref_kwargs), torch.float32)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("bias_shape", ["1hss", "b1ss", "bhss", "11ss"])
def test_core_attention_bias(bias_type, bias_shape, backend):
    b, sq, skv, h, hg = 2, 5, 7, 4, 1
    module = te.DotProductAttention(h, (D, DV), hg, qkv_format="sbhd", attn_mask_type="causal")
    inputs = qkv(b, sq, skv, h, hg, D, DV, torch.float32)
    dims = {"1": 1, "b": b, "h": h}
    shape = (dims[bias_shape[0]], dims[bias_shape[1]], sq, skv)
    bias = representable(shape, torch.float32).requires_grad_(True)
    kwargs = dict(core_attention_bias_type=bias_type, core_attention_bias=bias)
    out, grads = _run(module, inputs, "sbhd", torch.float32, backend, kwargs)
    ref_bias = bias.detach().double().requires_grad_(True)
    ref_add = ref_bias * SCALE if bias_type == "pre_scale_bias" else ref_bias
    ref_out, ref_grads = _reference_with_bias(inputs, ref_add)
    _check(out, grads, ref_out, ref_grads, torch.float32)
    assert_close_to_scale(bias.grad, ref_bias.grad, torch.float32)


def _reference_with_bias(inputs, bias):
    q, k, v, dout = (x.to(torch.float64).clone().requires_grad_(True) for x in inputs)
    out = reference(q, k, v, scale=SCALE, mask_type="causal", bias=bias)
    out.backward(dout)
    return out, [q.grad, k.grad, v.grad]


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("layout", ["sb3hd", "sbh3d", "bshd_bs2hd", "bshd_bsh2d"])
def test_interleaved_views(layout, backend):
    """q, k, v as views of one packed tensor (Transformer Engine's qkv layouts)."""
    b, s, h = 2, 6, 2
    fmt = "sbhd" if layout.startswith("sb") else "bshd"
    module = te.DotProductAttention(h, D, qkv_format=fmt, attn_mask_type="causal")
    first = (s, b) if fmt == "sbhd" else (b, s)
    if layout in ("sb3hd", "sbh3d"):
        dim = 2 if layout == "sb3hd" else 3
        shape = (*first, 3, h, D) if dim == 2 else (*first, h, 3, D)
        packed = representable(shape, torch.float32).requires_grad_(True)
        q, k, v = packed.unbind(dim)
    else:
        dim = 2 if layout == "bshd_bs2hd" else 3
        shape = (*first, 2, h, D) if dim == 2 else (*first, h, 2, D)
        packed = representable(shape, torch.float32).requires_grad_(True)
        q = representable((*first, h, D), torch.float32).requires_grad_(True)
        k, v = packed.unbind(dim)
    out = module(q, k, v, attention_backend=backend)
    out.sum().backward()
    to_b = (lambda x: x.transpose(0, 1)) if fmt == "sbhd" else (lambda x: x)
    ref = reference(to_b(q), to_b(k), to_b(v), scale=SCALE, mask_type="causal")
    assert_close(output_to_bshd(out, fmt, h), ref, torch.float32)
    assert packed.grad is not None and packed.grad.abs().sum() > 0


def test_output_shapes():
    module = te.DotProductAttention(4, (D, DV), 2)  # sbhd, causal by default
    q, k, v = torch.randn(5, 3, 4, D), torch.randn(5, 3, 2, D), torch.randn(5, 3, 2, DV)
    assert module(q, k, v).shape == (5, 3, 4 * DV)
    out = module(*(x.transpose(0, 1) for x in (q, k, v)), qkv_format="bshd")
    assert out.shape == (3, 5, 4 * DV)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
@pytest.mark.parametrize(
    "mask_type,window",
    [
        ("no_mask", None),
        ("causal", None),
        ("padding_causal", None),
        ("causal_bottom_right", None),
        ("no_mask", (3, 2)),
        ("causal", (4, 0)),
        ("arbitrary", None),
    ],
)
def test_cuda_backends_bf16(backend, mask_type, window):
    b, sq, skv, h, hg, d = 2, 37, 53, 8, 2, 64
    module = te.DotProductAttention(
        h,
        d,
        hg,
        qkv_format="bshd",
        attn_mask_type=mask_type,
        window_size=window,
        softmax_scale=0.125,
    )
    q, k, v, dout = qkv(b, sq, skv, h, hg, d, d, torch.bfloat16)
    kwargs, ref_kwargs = _mask_inputs(mask_type, b, sq, skv, h, as_cu=False)
    kwargs = {n: _cuda(x) for n, x in kwargs.items()}
    leaves = [x.cuda().bfloat16().requires_grad_(True) for x in (q, k, v)]
    out = module(*leaves, attention_backend=backend, **kwargs)
    out_bshd = output_to_bshd(out, "bshd", h)
    out_bshd.backward(dout.cuda().bfloat16())
    ref_leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    window = (-1, 0) if window is None and "causal" in mask_type else window or (-1, -1)
    ref = reference(*ref_leaves, scale=0.125, mask_type=mask_type, window=window, **ref_kwargs)
    ref.backward(dout.double())
    # bf16 kernels round the probabilities and the output: errors follow the output's scale
    assert_close_to_scale(out_bshd, ref, torch.bfloat16)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert_close_to_scale(leaf.grad, ref_leaf.grad, torch.bfloat16)


def _cuda(x):
    if isinstance(x, tuple):
        return tuple(t.cuda() for t in x)
    return x.cuda()
