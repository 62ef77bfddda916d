"""te.optimizers' multi-tensor functions against plain torch: multi_tensor_applier, scale,
scale_tensor, l2norm, unscale_l2norm (the noop flag on inf / NaN), the Adam and SGD
functions with Transformer Engine's signatures, Megatron-Core's call patterns, bad lists."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, representable

from torchte.constants import DType
from torchte.optimizers import (
    MultiTensorApply,
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_adam_fp8,
    multi_tensor_adam_param_remainder,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_scale_tensor,
    multi_tensor_sgd,
    multi_tensor_unscale_l2norm,
)
from torchte.optimizers._adam import masters_from_remainders

SHAPES = [(7, 13), (1,), (3, 5, 2), (129,)]


def _flag():
    return torch.zeros(1, dtype=torch.int32)


def _tensors(dtype=torch.float32, shapes=SHAPES, scale=4.0):
    return [representable(s, torch.bfloat16, scale=scale).to(dtype) for s in shapes]


def _fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


# ----------------------------------------------------------------------------------------------
# Applier
# ----------------------------------------------------------------------------------------------


def test_applier_drops_empty_slots_and_returns_the_op_result():
    seen = []

    def op(chunk_size, flag, lists, *args):
        seen.append((chunk_size, [[t.numel() for t in ts] for ts in lists], args))
        return "result"

    a, b, empty = torch.ones(3), torch.ones(2), torch.ones(0)
    lists = [[a, empty, b], [a, torch.ones(5), b]]
    assert multi_tensor_applier(op, _flag(), lists, 1.5) == "result"
    assert seen == [(2048 * 32, [[3, 2], [3, 2]], (1.5,))]
    assert [len(ts) for ts in lists] == [3, 3]  # the caller's lists are kept
    assert multi_tensor_applier(op, _flag(), [[empty], [empty]]) is None
    assert MultiTensorApply(64)(op, _flag(), [[a]]) == "result" and seen[-1][0] == 64


def test_applier_bad_arguments_raise():
    with pytest.raises(RuntimeError, match="aligned"):
        multi_tensor_applier(multi_tensor_scale, _flag(), [[torch.ones(2)], []], 1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        MultiTensorApply(0)
    with pytest.raises(TypeError, match="callable"):
        multi_tensor_applier("scale", _flag(), [[torch.ones(2)]])
    with pytest.raises(ValueError, match="tensor_lists"):
        multi_tensor_applier(multi_tensor_scale, _flag(), [], 1.0)


# ----------------------------------------------------------------------------------------------
# Scale
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src_dtype, dst_dtype, in_place",
    [
        (torch.float32, torch.float32, False),
        (torch.float32, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.float16, torch.bfloat16, False),
        (torch.float32, torch.float32, True),
        (torch.bfloat16, torch.bfloat16, True),
        (torch.float16, torch.float16, True),
    ],
)
def test_scale_is_the_fp32_product_rounded_once(src_dtype, dst_dtype, in_place):
    srcs = _tensors(src_dtype)
    dsts = srcs if in_place else [torch.empty(s.shape, dtype=dst_dtype) for s in srcs]
    scale = 0.3
    expected = [(s.float() * _fp32(scale)).to(dst_dtype) for s in srcs]
    flag = _flag()
    multi_tensor_applier(multi_tensor_scale, flag, [srcs, dsts], scale)
    assert flag.item() == 0
    for d, e in zip(dsts, expected, strict=True):
        assert d.dtype == dst_dtype and torch.equal(d, e)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_sets_the_flag_on_non_finite_input(bad, in_place):
    srcs = _tensors()
    srcs[2][1, 3, 0] = bad
    dsts = srcs if in_place else [torch.zeros_like(s) for s in srcs]
    expected = [s * 0.5 for s in srcs]
    flag = _flag()
    multi_tensor_scale(2048, flag, [srcs, dsts], 0.5)
    assert flag.item() == 1
    for d, e in zip(dsts, expected, strict=True):  # every tensor is still written
        assert torch.equal(d, e) if not e.isnan().any() else torch.equal(d.isnan(), e.isnan())
    flag2 = _flag()
    multi_tensor_scale(2048, flag2, [_tensors(), _tensors()], 2.0)
    assert flag2.item() == 0  # a finite call leaves the flag as it was


def test_scale_tensor_reads_the_scale_on_the_device():
    grads = _tensors()
    expected = [g * 0.25 for g in grads]
    flag = _flag()
    multi_tensor_applier(multi_tensor_scale_tensor, flag, [grads, grads], torch.tensor([0.25]))
    assert flag.item() == 0 and all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    with pytest.raises(TypeError, match="fp32"):
        multi_tensor_scale_tensor(
            1, flag, [grads, grads], torch.tensor([0.25], dtype=torch.float64)
        )
    with pytest.raises(ValueError, match="one-element"):
        multi_tensor_scale_tensor(1, flag, [grads, grads], torch.ones(2))


def test_scale_bad_lists_raise():
    a = torch.ones(3)
    with pytest.raises(ValueError, match="2 tensor lists"):
        multi_tensor_scale(1, _flag(), [[a]], 1.0)
    with pytest.raises(ValueError, match="elements"):
        multi_tensor_scale(1, _flag(), [[a], [torch.ones(4)]], 1.0)
    with pytest.raises(TypeError, match="dtype"):
        multi_tensor_scale(1, _flag(), [[a.long()], [a]], 1.0)
    with pytest.raises(ValueError, match="noop_flag"):
        multi_tensor_scale(1, torch.zeros(2), [[a], [a]], 1.0)


# ----------------------------------------------------------------------------------------------
# L2 norm
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_torch(dtype, per_tensor):
    tensors = _tensors(dtype)
    flag = _flag()
    total, per = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], per_tensor)
    flat = torch.cat([t.double().reshape(-1) for t in tensors])
    assert total.shape == (1,) and total.dtype == torch.float32
    assert_close(total, flat.norm().reshape(1), torch.float32)
    if per_tensor:
        assert_close(per, torch.stack([t.double().norm() for t in tensors]), torch.float32)
    else:
        assert per.numel() == 0
    assert flag.item() == 0


def test_l2norm_sets_the_flag_on_non_finite_input():
    tensors = _tensors()
    tensors[0][2, 2] = float("nan")
    flag = _flag()
    total, _ = multi_tensor_l2norm(1, flag, [tensors])
    assert flag.item() == 1 and total.isnan().all()


def test_unscale_l2norm_leaves_the_tensors_alone():
    tensors = _tensors(scale=2.0**20)
    kept = [t.clone() for t in tensors]
    inv = torch.tensor([2.0**-18])
    total, per = multi_tensor_unscale_l2norm(1, _flag(), [tensors], inv, True)
    flat = torch.cat([t.double().reshape(-1) for t in kept]) * 2.0**-18
    assert_close(total, flat.norm().reshape(1), torch.float32)
    assert_close(per, torch.stack([t.double().norm() * 2.0**-18 for t in kept]), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(tensors, kept, strict=True))


def test_megatron_clip_grads_pattern_matches_torch_clip_grad_norm():
    """get_grad_norm_fp32 + clip_grad_by_total_norm_fp32 with a clip coefficient tensor."""
    grads = _tensors()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    max_norm = 1.5
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    flag = _flag()
    norm, _ = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], False)
    total = (norm**2.0) ** 0.5  # summed over ranks, then the root
    clip_coeff = (max_norm / (total + 1.0e-6)).clamp_max_(1.0)
    multi_tensor_applier(multi_tensor_scale_tensor, flag, [grads, grads], clip_coeff)
    assert_close(total, expected_norm.reshape(1), torch.float32)
    for g, p in zip(grads, params, strict=True):
        assert_close(g, p.grad, torch.float32)


def test_megatron_copy_this_to_that_pattern():
    """_multi_tensor_copy_this_to_that: scale 1.0 copies fp32 main params into bf16 params."""
    this = _tensors()
    that = [torch.empty(t.shape, dtype=torch.bfloat16) for t in this]
    flag = _flag()
    flag.fill_(0)
    multi_tensor_applier(multi_tensor_scale, flag, [this, that], 1.0)
    assert all(torch.equal(b, a.bfloat16()) for a, b in zip(this, that, strict=True))


# ----------------------------------------------------------------------------------------------
# Adam and SGD functions
# ----------------------------------------------------------------------------------------------


def _adam_fp64(p, g, m, v, lr, b1, b2, eps, step, adamw, wd, bias_correction=True):
    p, g, m, v = p.double(), g.double(), m.double(), v.double()
    if not adamw:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    return p - lr * (update + wd * p if adamw else update), m, v


ADAM_ARGS = (0.0625, 0.875, 0.9375, 1e-6, 3)  # lr, beta1, beta2, eps, step


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [1, 0])
def test_multi_tensor_adam_matches_the_float64_reference(mode, bias_correction):
    params, grads = _tensors(scale=1.0), _tensors()
    exp_avgs, exp_avg_sqs = _tensors(scale=0.5), [t.abs() for t in _tensors(scale=0.5)]
    expected = [
        _adam_fp64(
            *t, *ADAM_ARGS, adamw=bool(mode), wd=0.125, bias_correction=bool(bias_correction)
        )
        for t in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    ]
    multi_tensor_applier(
        multi_tensor_adam,
        _flag(),
        [grads, params, exp_avgs, exp_avg_sqs],
        *ADAM_ARGS,
        mode,
        bias_correction,
        0.125,
    )
    for got, want in zip(zip(params, exp_avgs, exp_avg_sqs, strict=True), expected, strict=True):
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, torch.float32)


def test_multi_tensor_adam_with_masters_and_remainders():
    masters = _tensors(scale=1.0)
    grads = _tensors(torch.bfloat16)
    moments = [[torch.zeros_like(m) for m in masters] for _ in range(2)]
    params = [m.bfloat16() for m in masters]
    expected = [
        _adam_fp64(
            m, g, torch.zeros_like(m), torch.zeros_like(m), *ADAM_ARGS[:4], 1, adamw=True, wd=0.0
        )[0]
        for m, g in zip(masters, grads, strict=True)
    ]
    remainders = [torch.zeros(m.shape, dtype=torch.int16) for m in masters]
    rem_params = [p.clone() for p in params]
    rem_moments = [[torch.zeros_like(m) for m in masters] for _ in range(2)]
    multi_tensor_adam(1, _flag(), [grads, params, *moments, masters], *ADAM_ARGS[:4], 1, 1, 1, 0.0)
    multi_tensor_adam_param_remainder(
        1, _flag(), [grads, rem_params, *rem_moments, remainders], *ADAM_ARGS[:4], 1, 1, 1, 0.0
    )
    rebuilt = masters_from_remainders(rem_params, remainders)[1]
    for m, p, r, e in zip(masters, params, rebuilt, expected, strict=True):
        assert_close(m, e, torch.float32)
        assert torch.equal(p, m.bfloat16())
        assert torch.equal(r, m)


def test_multi_tensor_adam_fp8_casts_the_masters_with_the_delayed_scale():
    masters = _tensors(scale=1.0, shapes=[(4, 16), (33,)])
    grads = _tensors(shapes=[(4, 16), (33,)])
    m = [torch.zeros_like(t) for t in masters]
    v = [torch.zeros_like(t) for t in masters]
    data = [torch.zeros(t.shape, dtype=torch.uint8) for t in masters]
    scales = [torch.tensor([32.0]), torch.tensor([16.0])]
    amaxes, scale_invs = [torch.zeros(1), torch.tensor([8.0])], [torch.zeros(1), torch.zeros(1)]
    lists = [grads, data, m, v, masters, scales, amaxes, scale_invs]
    multi_tensor_adam_fp8(1, _flag(), lists, *ADAM_ARGS[:4], 1, 1, 1, 0.0, DType.kFloat8E4M3)
    for d, master, s, amax, s_inv in zip(data, masters, scales, amaxes, scale_invs, strict=True):
        expected = (master * s).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(d.view(torch.float8_e4m3fn).float(), expected.float())
        assert s_inv.item() == 1 / s.item()
        assert amax.item() == max(amax.item(), master.abs().max().item())
    assert amaxes[1].item() == 8.0  # max-accumulated


@pytest.mark.parametrize("master", [False, True])
def test_capturable_adam_functions_skip_on_the_flag_and_unscale(master):
    params = _tensors(scale=1.0)
    grads = [g * 4 for g in _tensors()]
    unscaled = [g / 4 for g in grads]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    lists = [grads, [p.bfloat16() if master else p.clone() for p in params], m, v]
    if master:
        lists.append([p.clone() for p in params])
    fn = multi_tensor_adam_capturable_master if master else multi_tensor_adam_capturable
    args = (
        torch.tensor([0.0625]),
        0.875,
        0.9375,
        1e-6,
        torch.tensor([1], dtype=torch.int32),
        1,
        1,
        0.0,
        torch.tensor([0.25]),
    )
    before = [[t.clone() for t in ts] for ts in lists]
    fn(1, torch.ones(1, dtype=torch.int32), lists, *args)  # flag set: nothing changes
    assert all(
        torch.equal(a, b)
        for ts, bs in zip(lists, before, strict=True)
        for a, b in zip(ts, bs, strict=True)
    )
    fn(1, _flag(), lists, *args)
    targets = lists[4] if master else lists[1]
    for t, p, g, got_g in zip(targets, params, unscaled, grads, strict=True):
        expected = _adam_fp64(
            p,
            g,
            torch.zeros_like(p),
            torch.zeros_like(p),
            0.0625,
            0.875,
            0.9375,
            1e-6,
            1,
            adamw=True,
            wd=0.0,
        )[0]
        assert_close(t, expected, torch.float32)
        assert torch.equal(got_g, g)


def test_multi_tensor_sgd_matches_torch_and_honours_the_flag():
    weights, grads = _tensors(scale=1.0), _tensors()
    moms = [torch.zeros_like(w) for w in weights]
    ref = [torch.nn.Parameter(w.clone()) for w in weights]
    copies = [torch.empty(w.shape, dtype=torch.float16) for w in weights]
    sgd_args = (0.125, 0.875, 0.0, 0.0625, True, True, False, 1.0)  # wd, mom, damp, lr, ...
    multi_tensor_sgd(1, torch.ones(1, dtype=torch.int32), [grads, weights, moms], *sgd_args)
    assert all(torch.equal(w, r.detach()) for w, r in zip(weights, ref, strict=True))
    multi_tensor_sgd(1, _flag(), [grads, weights, moms, copies], *sgd_args)
    opt = torch.optim.SGD(ref, lr=0.0625, momentum=0.875, nesterov=True, weight_decay=0.125)
    for r, g in zip(ref, grads, strict=True):
        r.grad = g.clone()
    opt.step()
    for w, r, c in zip(weights, ref, copies, strict=True):
        assert_close(w, r, torch.float32)
        assert torch.equal(c, w.half())


@pytest.mark.parametrize(
    "fn, lists, args, error, match",
    [
        (multi_tensor_adam, 3, (), ValueError, "4 or 5 tensor lists"),
        (multi_tensor_adam, 4, (2,), ValueError, "mode"),
        (multi_tensor_adam, 4, (1, "step0"), ValueError, "step"),
        (multi_tensor_adam, "mismatch", (), ValueError, "elements"),
        (multi_tensor_adam, "int", (), TypeError, "dtype"),
        (multi_tensor_adam_param_remainder, 5, (), TypeError, "bfloat16"),
        (multi_tensor_sgd, 2, (), ValueError, "3 or 4"),
    ],
)
def test_multi_tensor_bad_arguments_raise(fn, lists, args, error, match):
    a = torch.ones(3)
    if lists == "mismatch":
        tensor_lists = [[a], [a], [torch.ones(4)], [a]]
    elif lists == "int":
        tensor_lists = [[a.long()], [a], [a], [a]]
    else:
        tensor_lists = [[a] for _ in range(lists)]
    mode = args[0] if args else 1
    step = 0 if len(args) > 1 else 1
    if fn is multi_tensor_sgd:
        call_args = (0.0, 0.0, 0.0, 0.1, False, True, False, 1.0)
    else:
        call_args = (0.1, 0.9, 0.99, 1e-8, step, mode, 1, 0.0)
    with pytest.raises(error, match=match):
        fn(1, _flag(), tensor_lists, *call_args)


# ----------------------------------------------------------------------------------------------
# CUDA equals CPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_scale_and_l2norm_on_cuda_equal_cpu():
    cpu = _tensors(torch.bfloat16, shapes=[(1023, 7), (4097,), (3,)])
    gpu = [t.cuda() for t in cpu]
    cpu[1][5] = float("inf")
    gpu[1][5] = float("inf")
    results = []
    for tensors in (cpu, gpu):
        flag = torch.zeros(1, dtype=torch.int32, device=tensors[0].device)
        total, per = multi_tensor_l2norm(1, flag, [tensors], True)
        out = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
        multi_tensor_scale(1, flag, [tensors, out], 0.375)
        results.append((flag.cpu(), total.cpu(), per.cpu(), [o.cpu() for o in out]))
    (f_c, t_c, p_c, o_c), (f_g, t_g, p_g, o_g) = results
    assert f_c.item() == f_g.item() == 1
    assert torch.equal(t_c, t_g) and torch.equal(p_c.isinf(), p_g.isinf())
    assert_close(p_g[~p_g.isinf()], p_c[~p_c.isinf()], torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(o_c, o_g, strict=True))
