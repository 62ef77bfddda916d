"""te.optimizers.FusedAdam and FusedSGD: against torch.optim (and a float64 reference of
Transformer Engine's Adam) step by step; master weights, param remainders, low-precision
states, capturable steps, checkpoints, FP8 parameters, DTensors, bad arguments; CUDA vs CPU."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from tolerances import assert_close, assert_close_to_scale, representable

from torchte.optimizers import FusedAdam, FusedSGD
from torchte.optimizers._adam import masters_from_remainders
from torchte.quantization import Float8CurrentScalingQuantizer, Float8Quantizer
from torchte.quantization.float8_tensor import Float8Tensor
from torchte.quantization.model_init import make_fp8_parameter

SHAPES = [(7, 13), (5,), (3, 1, 4), ()]
LR, WD = 0.0625, 0.125


def _values(shapes=SHAPES, dtype=torch.bfloat16, scale=1.0, device="cpu"):
    """Random tensors of `shapes`, exact in `dtype` (and fp32)."""
    return [representable(tuple(s), dtype, scale=scale, device=device) for s in shapes]


def _params(values, dtype=torch.float32):
    return [torch.nn.Parameter(v.clone().to(dtype)) for v in values]


def _set_grads(params, grads, attr="grad"):
    for p, g in zip(params, grads, strict=True):
        setattr(p, attr, g.clone().to(p.dtype))


def _grad_steps(n, shapes=SHAPES, scale=4.0, device="cpu"):
    return [_values(shapes, scale=scale, device=device) for _ in range(n)]


def adam_fp64(p0, grads, lr, betas, eps, wd, adamw, bias_correction=True):
    """Transformer Engine's Adam in float64: (params, exp_avg, exp_avg_sq) after the steps."""
    b1, b2 = betas
    p, m, v = p0.double(), torch.zeros_like(p0.double()), torch.zeros_like(p0.double())
    for t, g in enumerate(grads, start=1):
        g = g.double() if adamw else g.double() + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        update = (m / bc1) / ((v / bc2).sqrt() + eps)
        p = p - lr * (update + wd * p if adamw else update)
    return p, m, v


# ----------------------------------------------------------------------------------------------
# FusedAdam against torch.optim
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_matches_torch_step_by_step(adam_w_mode, capturable):
    values = _values()
    ref, ours = _params(values), _params(values)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": LR / 2}]  # noqa: E731
    opt_ref = torch_cls(groups(ref), lr=LR, weight_decay=WD, eps=1e-6)
    opt = FusedAdam(
        groups(ours),
        lr=LR,
        weight_decay=WD,
        eps=1e-6,
        adam_w_mode=adam_w_mode,
        capturable=capturable,
    )
    for grads in _grad_steps(4):
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        opt_ref.step()
        opt.step()
        for a, b in zip(ours, ref, strict=True):
            assert_close(a, b, torch.float32)
    for a, v in zip(ours, values, strict=True):
        assert not torch.equal(a.detach(), v)
    step = opt.param_groups[0]["step"]
    assert (step.tolist() == [4] and step.dtype == torch.int32) if capturable else step == 4


def test_adam_without_bias_correction_matches_the_float64_reference():
    values = _values()
    ours = _params(values)
    opt = FusedAdam(ours, lr=LR, weight_decay=WD, bias_correction=False, adam_w_mode=False)
    steps = _grad_steps(3)
    for grads in steps:
        _set_grads(ours, grads)
        opt.step()
    for i, p in enumerate(ours):
        expected, m, v = adam_fp64(
            values[i],
            [g[i] for g in steps],
            LR,
            (0.9, 0.999),
            1e-8,
            WD,
            adamw=False,
            bias_correction=False,
        )
        assert_close(p, expected, torch.float32)
        assert_close(opt.state[p]["exp_avg"], m, torch.float32)
        assert_close(opt.state[p]["exp_avg_sq"], v, torch.float32)


def test_adam_updates_non_contiguous_params_as_contiguous_ones():
    base = representable((6, 9), torch.bfloat16)
    strided = torch.nn.Parameter(base.t().contiguous().t())  # column-major
    plain = torch.nn.Parameter(base.clone())
    assert not strided.is_contiguous()
    opts = [FusedAdam([p], lr=LR, weight_decay=WD) for p in (strided, plain)]
    for _ in range(3):
        g = representable((6, 9), torch.bfloat16, scale=4.0)
        for p, opt in zip((strided, plain), opts, strict=True):
            p.grad = g.clone()
            opt.step()
    assert_close(strided, plain, torch.float32)


def test_params_without_grads_or_elements_and_empty_groups():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    empty = torch.nn.Parameter(torch.zeros(0, 5))
    opt = FusedAdam([{"params": [a, b, empty]}, {"params": []}], lr=LR)
    a.grad, empty.grad = torch.ones(3), torch.zeros(0, 5)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(4)) and not torch.equal(a.detach(), torch.ones(3))
    assert set(opt.state[b]) == {"exp_avg", "exp_avg_sq"}  # states exist for every param
    assert [g["step"] for g in opt.param_groups] == [1, 1]  # empty groups count steps too


# ----------------------------------------------------------------------------------------------
# Master weights, remainders, low-precision states
# ----------------------------------------------------------------------------------------------


def _master(opt, p):
    state = opt.get_unscaled_state(p, "master_param")
    if state.dtype == torch.int16:
        return masters_from_remainders([p.detach()], [state])[1][0]
    return state


@pytest.mark.parametrize(
    "param_dtype, remainders",
    [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)],
)
def test_half_params_with_fp32_master_weights(param_dtype, remainders):
    values = _values()
    ref, ours = _params(values), _params(values, param_dtype)
    opt_ref = torch.optim.AdamW(ref, lr=LR, weight_decay=WD)
    opt = FusedAdam(
        ours, lr=LR, weight_decay=WD, master_weights=True, store_param_remainders=remainders
    )
    for grads in _grad_steps(3):
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        opt_ref.step()
        opt.step()
        for p, r in zip(ours, ref, strict=True):
            master = _master(opt, p)
            assert master.dtype == torch.float32
            assert_close(master, r, torch.float32)
            assert_close(p, master, param_dtype)
            if not remainders:
                assert torch.equal(p.detach(), master.to(param_dtype))
    state_dtype = opt.state[ours[0]]["master_param"].dtype
    assert state_dtype == (torch.int16 if remainders else torch.float32)


def test_remainders_keep_the_master_bit_for_bit():
    values = _values()
    full, rem = _params(values, torch.bfloat16), _params(values, torch.bfloat16)
    opt_full = FusedAdam(full, lr=LR, weight_decay=WD, master_weights=True)
    opt_rem = FusedAdam(
        rem, lr=LR, weight_decay=WD, master_weights=True, store_param_remainders=True
    )
    for grads in _grad_steps(3):
        _set_grads(full, grads)
        _set_grads(rem, grads)
        opt_full.step()
        opt_rem.step()
    for pf, pr in zip(full, rem, strict=True):
        assert torch.equal(_master(opt_full, pf), _master(opt_rem, pr))
        # Round to nearest with ties away from zero: at most half a bf16 ulp from the master.
        assert_close(pr, _master(opt_rem, pr), torch.bfloat16)


@pytest.mark.parametrize(
    "exp_avg_dtype, exp_avg_sq_dtype",
    [
        (torch.bfloat16,) * 2,
        (torch.float16,) * 2,
        (torch.uint8,) * 2,
        (torch.bfloat16, torch.float32),
    ],
)
def test_low_precision_moments_stay_within_their_tolerance(exp_avg_dtype, exp_avg_sq_dtype):
    tol = {torch.uint8: torch.float8_e4m3fn}.get(exp_avg_dtype, exp_avg_dtype)
    values = _values()
    ref, ours = _params(values), _params(values)
    opt_ref = FusedAdam(ref, lr=LR, weight_decay=WD)
    opt = FusedAdam(
        ours, lr=LR, weight_decay=WD, exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype
    )
    for grads in _grad_steps(3):
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        opt_ref.step()
        opt.step()
    for p, r, v in zip(ours, ref, values, strict=True):
        assert_close_to_scale(p - v, r - v, tol)
        for name in ("exp_avg", "exp_avg_sq"):
            unscaled = opt.get_unscaled_state(p, name)
            assert unscaled.dtype == torch.float32 and unscaled.shape == p.shape
            assert_close_to_scale(unscaled, opt_ref.state[r][name], tol)
    state = opt.state[ours[0]]
    if exp_avg_dtype == torch.uint8:
        assert type(state["exp_avg"]) is Float8Tensor
        assert state["exp_avg"].fp8_dtype == torch.float8_e4m3fn
        absmax = opt.get_unscaled_state(ours[0], "exp_avg").abs().max()
        assert_close(opt._scales[ours[0]]["exp_avg"], (absmax / 448).reshape(1), torch.float32)
    else:
        assert state["exp_avg"].dtype == exp_avg_dtype
        assert state["exp_avg_sq"].dtype == exp_avg_sq_dtype


def test_fp16_master_weights_are_scaled():
    values = _values()
    ref, ours = _params(values), _params(values, torch.bfloat16)
    opt_ref = FusedAdam(ref, lr=LR)
    opt = FusedAdam(ours, lr=LR, master_weights=True, master_weight_dtype=torch.float16)
    for grads in _grad_steps(2):
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        opt_ref.step()
        opt.step()
    for p, r in zip(ours, ref, strict=True):
        assert opt.state[p]["master_param"].dtype == torch.float16
        assert_close_to_scale(opt.get_unscaled_state(p, "master_param"), r, torch.float16)


def test_set_and_get_scaled_state_round_trip_without_touching_the_input():
    p = torch.nn.Parameter(torch.zeros(4, 6))
    opt = FusedAdam([p], exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.uint8)
    value = representable((4, 6), torch.float8_e4m3fn, scale=2.0**20)  # beyond fp16's range
    kept = value.clone()
    for name, dtype in (("exp_avg", torch.float16), ("exp_avg_sq", torch.float8_e4m3fn)):
        opt.set_scaled_state(p, name, value)
        assert torch.equal(value, kept)
        assert_close_to_scale(opt.get_unscaled_state(p, name), value, dtype)
    opt.set_scaled_state(p, "exp_avg", torch.zeros(4, 6))  # an all-zero state: scale 0, no NaN
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg"), torch.zeros(4, 6))


def test_megatron_style_initialize_state_and_decoupled_grads():
    values = _values()
    ref, ours = _params(values), _params(values, torch.bfloat16)
    opt_ref = FusedAdam(ref, lr=LR, weight_decay=WD)
    opt = FusedAdam(
        ours,
        lr=LR,
        weight_decay=WD,
        master_weights=True,
        use_decoupled_grad=True,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    for p in ours:
        opt.initialize_state(p)  # Megatron calls it with the param only
    for grads in _grad_steps(2):
        _set_grads(ref, grads)
        for p, g in zip(ours, grads, strict=True):
            p.decoupled_grad = g.clone()  # fp32 grads for bf16 params
        opt_ref.step()
        opt.step()
    for p, r, v in zip(ours, ref, values, strict=True):
        assert p.grad is None
        assert_close_to_scale(_master(opt, p) - v, r.detach() - v, torch.bfloat16)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in ours)


# ----------------------------------------------------------------------------------------------
# Capturable
# ----------------------------------------------------------------------------------------------


class _Scaler:
    """What FusedAdam reads of a torch GradScaler: the inf check and the scale."""

    def __init__(self, found: float, scale: float) -> None:
        self.found, self.scale = found, scale

    def _check_inf_per_device(self, optimizer):
        return {torch.device("cpu"): torch.tensor([self.found])}

    def _get_scale_async(self):
        return torch.tensor([self.scale])


@pytest.mark.parametrize("master_weights", [False, True])
def test_capturable_matches_the_default_path_on_cpu(master_weights):
    values = _values()
    dtype = torch.bfloat16 if master_weights else torch.float32
    plain, capt = _params(values, dtype), _params(values, dtype)
    kw = dict(
        lr=LR,
        weight_decay=WD,
        master_weights=master_weights,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    opt_plain, opt_capt = FusedAdam(plain, **kw), FusedAdam(capt, capturable=True, **kw)
    assert isinstance(opt_capt.param_groups[0]["lr"], torch.Tensor)
    late = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    opt_capt.add_param_group({"params": [late], "lr": 0.5})
    assert opt_capt.param_groups[1]["lr"].dtype == torch.float32
    for grads in _grad_steps(3):
        _set_grads(plain, grads)
        _set_grads(capt, grads)
        opt_plain.step()
        opt_capt.step()
    for a, b in zip(capt, plain, strict=True):
        assert_close(a, b, torch.float32)


def test_capturable_grad_scaler_skips_on_inf_and_unscales():
    values = _values()
    ref, ours = _params(values), _params(values)
    opt_ref, opt = FusedAdam(ref, lr=LR), FusedAdam(ours, lr=LR, capturable=True)
    grads = _grad_steps(1)[0]
    _set_grads(ours, [g * 8 for g in grads])
    opt.step(grad_scaler=_Scaler(found=1.0, scale=8.0))  # skipped, not counted
    for p, v in zip(ours, values, strict=True):
        assert torch.equal(p.detach(), v)
    assert opt.param_groups[0]["step"].tolist() == [0]
    opt.step(grad_scaler=_Scaler(found=0.0, scale=8.0))
    _set_grads(ref, grads)
    opt_ref.step()
    for p, r, g in zip(ours, ref, grads, strict=True):
        assert_close(p, r, torch.float32)
        assert_close(p.grad, g, torch.float32)  # written back unscaled
    assert opt.param_groups[0]["step"].tolist() == [1]


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

CHECKPOINT_CONFIGS = {
    "fp32": dict(),
    "master+bf16": dict(
        master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16
    ),
    "remainders": dict(master_weights=True, store_param_remainders=True),
    "scaled": dict(master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.uint8),
}


@pytest.mark.parametrize("config", list(CHECKPOINT_CONFIGS))
def test_state_dict_round_trip_continues_training(config):
    kw = CHECKPOINT_CONFIGS[config]
    dtype = torch.bfloat16 if kw.get("master_weights") else torch.float32
    values = _values()
    steps = _grad_steps(4)
    ours = _params(values, dtype)
    opt = FusedAdam(ours, lr=LR, weight_decay=WD, **kw)
    for grads in steps[:2]:
        _set_grads(ours, grads)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    saved = opt.state_dict()["state"][0]
    assert saved["exp_avg"].dtype == torch.float32 and type(saved["exp_avg"]) is torch.Tensor
    if config == "remainders":
        assert saved["master_param"].dtype == torch.int16
    resumed = _params([p.detach() for p in ours], dtype)
    opt2 = FusedAdam(resumed, lr=1.0, weight_decay=WD, **kw)
    opt2.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert opt2.param_groups[0]["lr"] == LR and opt2.param_groups[0]["step"] == 2
    for grads in steps[2:]:
        for params, o in ((ours, opt), (resumed, opt2)):
            _set_grads(params, grads)
            o.step()
    for a, b in zip(resumed, ours, strict=True):
        if config == "scaled":
            assert_close(a, b, torch.bfloat16)
        else:
            assert torch.equal(a.detach(), b.detach())


def test_state_dict_loads_into_other_state_dtypes():
    values = _values()
    ours = _params(values)
    opt = FusedAdam(ours, lr=LR)
    _set_grads(ours, _grad_steps(1)[0])
    opt.step()
    other = FusedAdam(
        _params(values), lr=LR, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16
    )
    other.load_state_dict(opt.state_dict())
    p_other = other.param_groups[0]["params"][0]
    assert other.state[p_other]["exp_avg"].dtype == torch.bfloat16
    assert other.state[p_other]["exp_avg_sq"].dtype == torch.float16
    assert_close(
        other.get_unscaled_state(p_other, "exp_avg"), opt.state[ours[0]]["exp_avg"], torch.bfloat16
    )


# ----------------------------------------------------------------------------------------------
# FP8 parameters
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_params_update_through_their_master_weights(scaling):
    shapes = [(16, 32), (8, 16)]
    values = _values(shapes, torch.float8_e4m3fn)
    quantizers = [
        Float8Quantizer(torch.tensor([64.0]), torch.zeros(1), torch.float8_e4m3fn)
        if scaling == "delayed"
        else Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
        for _ in shapes
    ]
    ours = [make_fp8_parameter(v, q, False) for v, q in zip(values, quantizers, strict=True)]
    ref = _params([p.dequantize().detach() for p in ours])  # current scaling rounds values
    opt_ref = FusedAdam(ref, lr=LR / 16, weight_decay=WD)
    opt = FusedAdam(ours, lr=LR / 16, weight_decay=WD, master_weights=True)
    for grads in _grad_steps(2, shapes):
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        opt_ref.step()
        opt.step()
    for p, r, q in zip(ours, ref, quantizers, strict=True):
        assert type(p) is Float8Tensor
        master = opt.get_unscaled_state(p, "master_param")
        assert_close(master, r, torch.float32)
        if scaling == "delayed":
            # Cast with the quantizer's scale; the master's amax recorded.
            expected = (master * 64.0).clamp(-448, 448).to(torch.float8_e4m3fn).float() / 64.0
            assert q.amax.item() >= master.abs().max().item()
        else:
            expected = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(master)
            expected = expected.dequantize()
        assert torch.equal(p.dequantize(), expected)
        assert p._storage.columnwise_data is not None  # usages kept


def test_fp8_params_need_master_weights():
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    p = make_fp8_parameter(torch.ones(4, 16), q, False)
    p.grad = torch.ones(4, 16)
    with pytest.raises(RuntimeError, match="master_weights"):
        FusedAdam([p]).step()
    p2 = make_fp8_parameter(torch.ones(4, 16), q, False)
    p2.grad = torch.ones(4, 16)
    with pytest.raises(RuntimeError, match="capturable"):
        FusedAdam([p2], master_weights=True, capturable=True).step()


# ----------------------------------------------------------------------------------------------
# DTensor
# ----------------------------------------------------------------------------------------------


def test_dtensor_params_get_dtensor_states(tmp_path):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        values = _values([(6, 5), (3,)])
        plain = _params(values, torch.bfloat16)
        dparams = [
            torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
            for p in plain
        ]
        kw = dict(
            lr=LR,
            master_weights=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        )
        opt_plain, opt_d = FusedAdam(plain, **kw), FusedAdam(dparams, **kw)
        for grads in _grad_steps(2, [(6, 5), (3,)]):
            _set_grads(plain, grads)
            for p, g in zip(dparams, grads, strict=True):
                p.grad = distribute_tensor(g.to(torch.bfloat16), mesh, [Shard(0)])
            opt_plain.step()
            opt_d.step()
        for p, d in zip(plain, dparams, strict=True):
            assert torch.equal(d.to_local(), p.detach())
            assert all(isinstance(s, DTensor) for s in opt_d.state[d].values())
        assert isinstance(opt_d.state_dict()["state"][0]["master_param"], DTensor)
        with pytest.raises(RuntimeError, match="DTensor"):
            dparams[0].grad = torch.zeros(6, 5, dtype=torch.bfloat16)
            opt_d.step()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# FusedSGD
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "momentum, dampening, nesterov, weight_decay",
    [
        (0.0, 0.0, False, 0.0),
        (0.875, 0.0, False, WD),
        (0.875, 0.25, False, 0.0),
        (0.875, 0.0, True, WD),
    ],
)
def test_sgd_matches_torch(momentum, dampening, nesterov, weight_decay):
    values = _values()
    ref, ours = _params(values), _params(values)
    kw = dict(
        lr=LR, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay
    )
    opt_ref, opt = torch.optim.SGD(ref, **kw), FusedSGD(ours, **kw)
    for grads in _grad_steps(3):
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        opt_ref.step()
        opt.step()
        for a, b in zip(ours, ref, strict=True):
            assert_close(a, b, torch.float32)
    assert all(not torch.equal(p.detach(), v) for p, v in zip(ours, values, strict=True))


def test_sgd_updates_non_contiguous_params_as_contiguous_ones():
    base = representable((6, 9), torch.bfloat16)
    strided = torch.nn.Parameter(base.t().contiguous().t())
    plain = torch.nn.Parameter(base.clone())
    kw = dict(lr=LR, momentum=0.875, weight_decay=WD)
    opts = [FusedSGD([p], **kw) for p in (strided, plain)]
    for _ in range(3):
        g = representable((6, 9), torch.bfloat16, scale=4.0)
        for p, opt in zip((strided, plain), opts, strict=True):
            p.grad = g.clone()
            opt.step()
    assert_close(strided, plain, torch.float32)


def sgd_fp64(p0, grads, lr, momentum, dampening, nesterov, wd, wd_after, scale=1.0):
    p, buf = p0.double(), None
    for t, g in enumerate(grads):
        g = g.double() * scale
        if not wd_after:
            g = g + wd * p
        if momentum:
            buf = g.clone() if t == 0 else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        if wd_after:
            g = g + wd * p
        p = p - lr * g
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd_after_momentum", [False, True])
def test_sgd_dtypes_and_wd_after_momentum_match_the_float64_reference(dtype, wd_after_momentum):
    values = _values()
    ours = _params(values, dtype)
    opt = FusedSGD(
        ours,
        lr=LR,
        momentum=0.875,
        weight_decay=WD,
        nesterov=True,
        wd_after_momentum=wd_after_momentum,
    )
    steps = _grad_steps(3)
    for grads in steps:
        _set_grads(ours, grads)
        opt.most_recent_scale = 2.0  # grads are divided by it
        opt.step()
    assert opt.most_recent_scale == 1.0
    for i, p in enumerate(ours):
        expected = sgd_fp64(
            values[i], [g[i] for g in steps], LR, 0.875, 0.0, True, WD, wd_after_momentum, scale=0.5
        )
        assert_close_to_scale(p, expected, dtype)
        assert opt.state[p]["momentum_buffer"].dtype == dtype


# ----------------------------------------------------------------------------------------------
# Bad arguments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(amsgrad=True), RuntimeError, "AMSGrad"),
        (dict(master_weights=True, master_weight_dtype=torch.bfloat16), RuntimeError, "master"),
        (dict(exp_avg_dtype=torch.int8), RuntimeError, "exp_avg_dtype"),
        (dict(exp_avg_sq_dtype=torch.float64), RuntimeError, "exp_avg_sq_dtype"),
        (
            dict(capturable=True, master_weights=True, master_weight_dtype=torch.float16),
            RuntimeError,
            "capturable",
        ),
        (
            dict(capturable=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
            RuntimeError,
            "capturable",
        ),
        (dict(capturable=True, exp_avg_dtype=torch.bfloat16), RuntimeError, "capturable"),
        (
            dict(capturable=True, master_weights=True, store_param_remainders=True),
            RuntimeError,
            "remainders",
        ),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(eps=-1e-8), ValueError, "eps"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(betas=(1.0, 0.999)), ValueError, "betas"),
        (dict(betas=(0.9,)), ValueError, "betas"),
    ],
)
def test_adam_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedAdam([torch.nn.Parameter(torch.ones(3))], **kwargs)


def test_adam_bad_inputs_raise_before_updating():
    p, q = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))
    opt = FusedAdam([q, p], use_decoupled_grad=True)
    q.decoupled_grad, p.decoupled_grad = torch.ones(4), torch.ones(3, 2)
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    assert torch.equal(q.detach(), torch.ones(4))  # nothing updated before the check
    assert "step" not in opt.param_groups[0]
    opt = FusedAdam([p])
    p.grad = torch.ones(2, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2, 3))
    with pytest.raises(ValueError, match="unknown optimizer state"):
        opt.get_unscaled_state(p, "momentum")
    with pytest.raises(TypeError, match="floating-point"):
        opt.set_scaled_state(p, "exp_avg", torch.ones(2, 3, dtype=torch.int32))
    opt.set_scaled_state(p, "exp_avg", torch.full((2, 3), 0.5, dtype=torch.bfloat16))
    assert torch.equal(opt.state[p]["exp_avg"], torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="elements"):
        opt.set_scaled_state(p, "exp_avg", torch.ones(5))
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    q.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="fp32, fp16, bf16"):
        FusedAdam([q]).step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-0.1), "learning rate"),
        (dict(lr=0.1, momentum=-0.5), "momentum"),
        (dict(lr=0.1, weight_decay=-1.0), "weight_decay"),
        (dict(lr=0.1, nesterov=True), "Nesterov"),
    ],
)
def test_sgd_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedSGD([torch.nn.Parameter(torch.ones(3))], **kwargs)


# ----------------------------------------------------------------------------------------------
# CUDA equals CPU
# ----------------------------------------------------------------------------------------------


# (param dtype, the dtype whose rounding CPU and CUDA may differ by, FusedAdam arguments): the
# fused kernels round the fp32 math differently, which can flip a rounding of a stored state.
GPU_CONFIGS = {
    "fp32": (torch.float32, torch.float32, dict()),
    "bf16-master-remainders": (
        torch.bfloat16,
        torch.bfloat16,
        dict(master_weights=True, store_param_remainders=True),
    ),
    "bf16-moments-capturable": (
        torch.bfloat16,
        torch.bfloat16,
        dict(
            master_weights=True,
            capturable=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        ),
    ),
    "scaled-states": (
        torch.float32,
        torch.float8_e4m3fn,
        dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16),
    ),
    "no-bias-correction": (
        torch.float32,
        torch.float32,
        dict(bias_correction=False, adam_w_mode=False),
    ),
}
GPU_SHAPES = [(129, 67), (1000,), (3,)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
def test_adam_on_cuda_equals_cpu(config):
    dtype, tol, kw = GPU_CONFIGS[config]
    values = _values(GPU_SHAPES)
    cpu = _params(values, dtype)
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    opt_cpu = FusedAdam(cpu, lr=LR, weight_decay=WD, **kw)
    opt_gpu = FusedAdam(gpu, lr=LR, weight_decay=WD, **kw)
    for grads in _grad_steps(3, GPU_SHAPES):
        _set_grads(cpu, grads)
        _set_grads(gpu, [g.cuda() for g in grads])
        opt_cpu.step()
        opt_gpu.step()
    for a, b, v in zip(gpu, cpu, values, strict=True):
        assert a.device.type == "cuda"
        assert_close_to_scale(a.float() - v.cuda(), b.float() - v, tol)
        for name in opt_cpu.state[b]:
            state_gpu = opt_gpu.get_unscaled_state(a, name)
            state_cpu = opt_cpu.get_unscaled_state(b, name)
            if state_cpu.dtype == torch.int16:  # remainders: compare the masters
                state_gpu = masters_from_remainders([a.detach()], [state_gpu])[1][0]
                state_cpu = masters_from_remainders([b.detach()], [state_cpu])[1][0]
            assert_close_to_scale(state_gpu.float(), state_cpu.float(), tol)


@pytest.mark.gpu
def test_sgd_on_cuda_equals_cpu():
    values = _values([(129, 67), (1000,)])
    cpu = _params(values)
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    kw = dict(lr=LR, momentum=0.875, nesterov=True, weight_decay=WD)
    opt_cpu, opt_gpu = FusedSGD(cpu, **kw), FusedSGD(gpu, **kw)
    for grads in _grad_steps(3, [(129, 67), (1000,)]):
        _set_grads(cpu, grads)
        _set_grads(gpu, [g.cuda() for g in grads])
        opt_cpu.step()
        opt_gpu.step()
    for a, b in zip(gpu, cpu, strict=True):
        assert_close(a, b, torch.float32)


@pytest.mark.parametrize("cls, kw", [(FusedAdam, {}), (FusedSGD, {"lr": 0.1})])
def test_deprecated_set_grad_none_decides_zero_grad(cls, kw):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        opt = cls([p], set_grad_none=False, **kw)
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert torch.equal(p.grad, torch.zeros(3))
    with pytest.raises(ValueError, match="set_grad_none"):
        opt.zero_grad(set_to_none=True)
    opt_default = cls([p], **kw)
    opt_default.zero_grad()
    assert p.grad is None
