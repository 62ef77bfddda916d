"""Activations written straight in Float8BlockScaling's 1x128 FP8 (kernels/activation_block.py,
quantization/fused_block_act.py): forward a = act(h), backward dh = da * act'(h) with the bias
gradient, and a GEMM's output-gradient cast with its bias gradient (quantize_with_dbias).

The unfused composition they replace: a = activation_forward(h) then
Float8BlockQuantizer.quantize(a); dh = activation_backward(da, h) then quantize(dh) and
dbias = dh.sum(0) (module/_linear_core.linear_backward); dy: quantize(dy) and dy.sum(0).
- CPU (the public path): bytes and scales equal the unfused path's bit for bit, every
  activation, fp32 / bf16 / fp16, power-of-2 scales on and off, usage combinations, NaN / inf;
  dbias within the tolerance table of the unfused sum, bit-equal where the sums are exact.
- fp64 model: on exactly representable inputs of relu-like activations (no transcendental),
  bytes and scales equal test_kernels_block_cast's fp64 model and dbias the exact sums.
- Triton's CPU interpreter: the kernels against the unfused Triton composition (the same fp32
  activation code: bytes equal), against the torch references (bytes equal for relu-like
  activations, else within one FP8 step), dbias, several launch configurations.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from test_kernels_block_cast import rows_model
from tolerances import assert_close, assert_close_to_scale, representable

from torchte.kernels import activation as act
from torchte.kernels import activation_block as ab
from torchte.kernels.cast_spec import CastSpec
from torchte.quantization.blockwise import Float8BlockQuantizer, Float8BlockwiseQTensorStorage
from torchte.quantization.float8 import Float8CurrentScalingQuantizer
from torchte.quantization.fused_block_act import (
    activation_grad_to_block,
    activation_to_block,
    fusable_1x128,
    quantize_with_dbias,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LIMIT, ALPHA = 7.0, 1.702
RELU_LIKE = ["relu", "reglu", "srelu", "sreglu"]  # no exp: exact on representable inputs
USAGES = [(True, True), (True, False), (False, True)]


def quantizer(fp8=E4M3, power_2=True, eps=0.0) -> Float8BlockQuantizer:
    return Float8BlockQuantizer(
        fp8, amax_epsilon=eps, force_pow_2_scales=power_2, block_scaling_dim=1
    )


def special(name: str, lead: tuple[int, ...], n: int, dtype, seed: int = 0):
    """(h (*lead, K), da (*lead, n)) in dtype: normal values of varied size, a zero block, NaN,
    -inf and +inf in h, a tiny da value."""
    gen = torch.Generator().manual_seed(seed)
    k = 2 * n if act.is_gated(name) else n
    h = torch.randn((*lead, k), generator=gen) * 3
    h.view(-1)[::7] *= 1e-3
    h.view(-1)[::13] *= 30
    da = torch.randn((*lead, n), generator=gen) * 2
    da.view(-1)[::11] *= 1e-4
    h2d = h.view(-1, k)
    h2d[0] = 0.0
    if h2d.shape[0] > 3 and k > 3:
        h2d[1, 3], h2d[2, 1], h2d[3, 2] = float("nan"), float("-inf"), float("inf")
    return h.to(dtype), da.to(dtype)


def same(got: Float8BlockwiseQTensorStorage, want: Float8BlockwiseQTensorStorage, where):
    """Two 1x128 storages hold the same copies, bytes and scale bits."""
    assert got.shape == want.shape and got.fp8_dtype == want.fp8_dtype, where
    assert got.block_dim == want.block_dim == 1, where
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), (where, name)
        if a is not None:
            bits = torch.int32 if a.dtype == torch.float32 else torch.uint8
            assert a.shape == b.shape and torch.equal(a.view(bits), b.view(bits)), (where, name)


def close_sums(got: torch.Tensor, want: torch.Tensor, dtype, where) -> None:
    """Column sums: the same NaN and infinities as want's, the finite ones within dtype's
    tolerance (atol to the sums' scale: they are sums of rounded terms)."""
    fin = torch.isfinite(want)
    assert got.dtype == want.dtype and got.shape == want.shape, where
    assert torch.equal(torch.isfinite(got), fin), where
    tags = (got[~fin].nan_to_num(0.0, 1.0, -1.0), want[~fin].nan_to_num(0.0, 1.0, -1.0))
    assert torch.equal(*tags), where
    assert_close_to_scale(got[fin], want[fin], dtype, msg=str(where))


# ----------------------------------------------------------------------------------------------
# The public (CPU) path against the unfused composition
# ----------------------------------------------------------------------------------------------


# (input dtype, leading dims, FP8 dtype, power-of-2 scales, amax_epsilon), one per usage.
SETTINGS = [
    (torch.bfloat16, (3, 43), E4M3, True, 0.0),
    (torch.float32, (131,), E5M2, False, 0.0),
    (torch.float16, (2, 5), E4M3, False, 2.0**-10),
]


@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_forward_equals_unfused(name):
    for i, (dtype, lead, fp8, power_2, eps) in enumerate(SETTINGS):
        h, _ = special(name, lead, 133, dtype, seed=i)
        q = quantizer(fp8, power_2, eps)
        a = act.activation_forward(h, name, LIMIT, ALPHA)
        columnwise = i != 1
        got = activation_to_block(q, h, name, LIMIT, ALPHA, columnwise, a.shape)
        same(got, q.quantize(a, rowwise=True, columnwise=columnwise), (name, dtype, i))


@pytest.mark.parametrize("name", act.ACTIVATIONS)
def test_backward_equals_unfused(name):
    for i, (setting, usage) in enumerate(zip(SETTINGS, USAGES, strict=True)):
        dtype, lead, fp8, power_2, eps = setting
        h, da = special(name, lead, 130, dtype, seed=i)
        q = quantizer(fp8, power_2, eps)
        dh = act.activation_backward(da, h, name, LIMIT, ALPHA)
        got, dbias = activation_grad_to_block(q, da, h, name, LIMIT, ALPHA, usage, dh.shape)
        want = q.quantize(dh, rowwise=usage[0], columnwise=usage[1])
        same(got, want, (name, dtype, usage))
        close_sums(dbias, dh.reshape(-1, dh.shape[-1]).sum(0), dtype, (name, dtype, usage))


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_quantize_with_dbias_equals_unfused(dtype):
    for i, usage in enumerate([*USAGES, (False, False)]):
        dy, _ = special("gelu", (5, 27), 259, dtype, seed=i)
        q = quantizer(E5M2 if i % 2 else E4M3, power_2=bool(i % 2))
        got, dbias = quantize_with_dbias(q, dy, usage, dy.shape)
        want = q.quantize(dy, rowwise=usage[0], columnwise=usage[1])
        same(got, want, (dtype, usage))
        close_sums(dbias, dy.reshape(-1, 259).sum(0), dtype, (dtype, usage))


def test_backward_without_usages_gives_dbias_alone():
    h, da = special("swiglu", (9,), 40, torch.bfloat16)
    got, dbias = activation_grad_to_block(
        quantizer(), da, h, "swiglu", LIMIT, ALPHA, (False, False), h.shape
    )
    assert got.rowwise_data is None and got.columnwise_data is None and got.shape == (9, 80)
    dh = act.activation_backward(da, h, "swiglu", LIMIT, ALPHA)
    close_sums(dbias, dh.sum(0), torch.bfloat16, "no usage")


def test_zero_tokens():
    q = quantizer()
    h = torch.empty(0, 7, 96, dtype=torch.bfloat16)
    da = torch.empty(0, 7, 48, dtype=torch.bfloat16)
    a = activation_to_block(q, h, "swiglu", LIMIT, ALPHA, True, (0, 7, 48))
    assert a.rowwise_data.shape == (0, 48) and a.columnwise_data.shape == (48, 0)
    assert a.dequantize().shape == (0, 7, 48)
    dh, dbias = activation_grad_to_block(q, da, h, "swiglu", LIMIT, ALPHA, (True, True), h.shape)
    assert dh.rowwise_data.shape == (0, 96) and dh.columnwise_scale_inv.shape == (0, 96)
    assert dbias.dtype == torch.bfloat16 and torch.equal(dbias, torch.zeros(96, dtype=dbias.dtype))
    dy, db = quantize_with_dbias(q, da, (True, True), da.shape)
    assert dy.shape == (0, 7, 48) and torch.equal(db, torch.zeros(48, dtype=db.dtype))


# ----------------------------------------------------------------------------------------------
# The fp64 model (test_kernels_block_cast's), on exactly representable inputs
# ----------------------------------------------------------------------------------------------


def _assert_model(storage: Float8BlockwiseQTensorStorage, values: torch.Tensor, fp8, power_2):
    """storage's both copies equal rows_model of values (M, C) and of values^T."""
    inf_scale = torch.finfo(torch.bfloat16).max
    for data, scale, x in (
        (storage.rowwise_data, storage.rowwise_scale_inv, values),
        (storage.columnwise_data, storage.columnwise_scale_inv, values.t()),
    ):
        codes, scale_inv = rows_model(x, fp8, 0.0, power_2, inf_scale)
        assert torch.equal(data.view(torch.uint8), codes)
        assert torch.equal(scale.double(), scale_inv)


@pytest.mark.parametrize("name", RELU_LIKE)
def test_relu_like_match_the_fp64_model(name):
    gated, power_2 = act.is_gated(name), name in ("relu", "sreglu")
    m, n = 131, 135
    gen = torch.Generator().manual_seed(3)
    h = representable((m, 2 * n if gated else n), torch.bfloat16, generator=gen, device="cpu")
    da = representable((m, n), torch.bfloat16, generator=gen, device="cpu")
    h64, da64 = h.double(), da.double()
    x1 = h64[:, :n]
    r = torch.where(x1 > 0, x1, 0.0)
    act64, dact64 = (r, (x1 > 0).double()) if name in ("relu", "reglu") else (r * r, 2 * r)
    g = h64[:, n:] if gated else torch.ones_like(x1)
    a64 = act64 * g  # exact in fp64; bf16 keeps 8 significant bits: round as the kernel does
    dh64 = torch.cat([da64 * dact64 * g, da64 * act64], 1) if gated else da64 * dact64
    a64, dh64 = a64.to(torch.bfloat16).double(), dh64.to(torch.bfloat16).double()
    q = quantizer(E4M3, power_2)
    h16, da16 = h.to(torch.bfloat16), da.to(torch.bfloat16)
    a = activation_to_block(q, h16, name, LIMIT, ALPHA, True, (m, n))
    _assert_model(a, a64, E4M3, power_2)
    dh, dbias = activation_grad_to_block(q, da16, h16, name, LIMIT, ALPHA, (True, True), dh64.shape)
    _assert_model(dh, dh64, E4M3, power_2)
    if name == "sreglu":  # terms of up to 29 significant bits: fp32 sums round
        close_sums(dbias, dh64.sum(0).to(torch.bfloat16), torch.bfloat16, name)
    else:  # terms of at most 14 fraction bits below 2: fp32 sums of 131 are exact
        assert torch.equal(dbias, dh64.sum(0).to(torch.bfloat16))


def test_quantize_with_dbias_matches_the_fp64_model():
    gen = torch.Generator().manual_seed(5)
    dy = representable((133, 257), torch.bfloat16, generator=gen, device="cpu")
    q = quantizer(E4M3, False)
    got, dbias = quantize_with_dbias(q, dy.to(torch.bfloat16), (True, True), dy.shape)
    _assert_model(got, dy.double(), E4M3, False)
    assert torch.equal(dbias, dy.double().sum(0).to(torch.bfloat16))  # exact fp32 sums


def test_dequantized_output_is_the_activation_within_fp8_tolerance():
    h, _ = special("geglu", (64,), 256, torch.float32, seed=9)
    h = h.clamp(-20, 20).nan_to_num(0.0)
    a = activation_to_block(quantizer(), h, "geglu", LIMIT, ALPHA, True, (64, 256))
    x1, x2 = h.double()[:, :256], h.double()[:, 256:]
    want = 0.5 * x1 * (1 + torch.tanh(act.GELU_C * (x1 + act.GELU_B * x1**3))) * x2
    assert_close(a.dequantize(), want, E4M3)
    cols = a.columnwise_data.float() * a.columnwise_scale_inv.repeat_interleave(128, 0)[:64].t()
    assert_close(cols.t(), want, E4M3)


# ----------------------------------------------------------------------------------------------
# Argument checks: before any kernel runs
# ----------------------------------------------------------------------------------------------


def test_bad_arguments_raise():
    h, da = special("swiglu", (8,), 64, torch.bfloat16)
    q = quantizer()
    with pytest.raises(TypeError, match="block_scaling_dim=1"):
        activation_to_block(
            Float8BlockQuantizer(E4M3, block_scaling_dim=2), h, "swiglu", LIMIT, ALPHA, True,
            (8, 64),
        )  # fmt: skip
    with pytest.raises(TypeError, match="Float8BlockQuantizer"):
        quantize_with_dbias(Float8CurrentScalingQuantizer(E4M3), da, (True, True), da.shape)
    with pytest.raises(ValueError, match="shape"):
        activation_to_block(q, h, "swiglu", LIMIT, ALPHA, True, (8, 128))
    with pytest.raises(ValueError, match="shape"):
        activation_grad_to_block(q, da, h, "swiglu", LIMIT, ALPHA, (True, True), (4, 128))
    with pytest.raises(ValueError, match="unknown activation"):
        activation_to_block(q, h, "swish", LIMIT, ALPHA, True, (8, 64))
    with pytest.raises(ValueError, match="even"):
        activation_to_block(q, h[:, :63], "swiglu", LIMIT, ALPHA, True, (8, 31))
    with pytest.raises(ValueError, match="dy must have shape"):
        activation_grad_to_block(q, da[:, :32], h, "swiglu", LIMIT, ALPHA, (True, True), h.shape)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_with_dbias(q, da.double(), (True, True), da.shape)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        activation_to_block(q, h.int(), "swiglu", LIMIT, ALPHA, True, (8, 64))
    spec = CastSpec(E4M3, True, True, scale=torch.ones(1), amax=torch.zeros(1))
    with pytest.raises(ValueError, match=r"spec\.scale"):
        ab.activation_forward_block(h, "swiglu", LIMIT, ALPHA, spec)
    with pytest.raises(ValueError, match="at least one"):
        ab.activation_forward_block(h, "swiglu", LIMIT, ALPHA, CastSpec(E4M3, False, False))
    with pytest.raises(TypeError, match="fp8_dtype"):
        ab.block_quantize_dbias(da, CastSpec(torch.bfloat16))
    with pytest.raises(ValueError, match="amax_epsilon"):
        ab.block_quantize_dbias(da, CastSpec(E4M3, amax_epsilon=-1.0))
    assert fusable_1x128(q) and not fusable_1x128(Float8BlockQuantizer(E4M3))


# ----------------------------------------------------------------------------------------------
# The Triton kernels under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

# Runs in a fresh process: TRITON_INTERPRET must be set before the kernels are defined. Outputs
# start filled with a pattern, so a byte, scale or sum a kernel fails to write shows. The
# unfused composition runs activation.py's Triton kernels on fp32 copies of h and da (exact),
# rounded to h's dtype by torch (the interpreter's own bf16 store truncates), then the 1x128
# reference cast (equal to block_cast's kernel: test_kernels_block_cast).
INTERPRETER_SCRIPT = """
import torch
from test_kernels_activation_block import close_sums as sums, special
from tolerances import assert_close, representable
from torchte.kernels import activation as act
from torchte.kernels import activation_block as ab
from torchte.kernels import block_cast as bc
from torchte.kernels.cast_spec import CastSpec

LIMIT, ALPHA = 7.0, 1.702
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RELU_LIKE = {"relu", "reglu", "srelu", "sreglu"}

alloc = ab._alloc
def filled(*args):
    out = alloc(*args)
    for t in out:
        if t is not None:
            (t.fill_(7.0) if t.dtype == torch.float32 else t.view(torch.uint8).fill_(0x55))
    return out
ab._alloc = filled

def same(got, want, where):
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None), where
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, where
            bits = torch.int32 if a.dtype == torch.float32 else torch.uint8
            assert torch.equal(a.view(bits), b.view(bits)), where

def near(got, want, exact, where):
    # The torch references use torch.sigmoid, not the kernels' exp: bytes equal only without
    # a transcendental, else the dequantized values within one FP8 step.
    if exact or (got[0] is None and got[2] is None):
        return same(got, want, where)
    fp8 = (got[0] if got[0] is not None else got[2]).dtype
    for data, scale, ref_data, ref_scale in ((got[0], got[1], want[0], want[1]),
                                             (got[2], got[3], want[2], want[3])):
        if data is not None:
            shape = data.shape
            value = bc.block_dequantize(data, scale, 1, shape)
            ref = bc.block_dequantize(ref_data, ref_scale, 1, shape)
            nan = torch.isnan(ref)
            assert torch.equal(torch.isnan(value), nan), where
            assert_close(value[~nan], ref[~nan], fp8, msg=str(where))


def check(name, h, da, spec, configs=(ab.FORWARD_CONFIG, ab.BACKWARD_CONFIG)):
    kind, gated = act._SPECS[name]
    n = da.shape[1]
    where = (name, tuple(h.shape), h.dtype, spec, configs)
    cast = lambda x: bc.block_quantize_reference(
        x, spec.fp8_dtype, 1, spec.rowwise, spec.columnwise, spec.power_2_scale,
        spec.amax_epsilon)
    if spec.rowwise or spec.columnwise:
        out = ab._forward_triton(h, n, kind, gated, LIMIT, ALPHA, spec, configs[0])
        a = act._forward_triton(h.float(), name, LIMIT, ALPHA).to(h.dtype)
        same(out, cast(a), where)
        ref = ab.activation_forward_block_reference(h, name, LIMIT, ALPHA, spec)
        near(out, ref, name in RELU_LIKE, where)
    *out, dbias = ab._backward_triton(da, h, n, kind, gated, LIMIT, ALPHA, spec, configs[1])
    dh = act._backward_triton(da.float(), h.float(), name, LIMIT, ALPHA).to(h.dtype)
    same(out, cast(dh), where)
    sums(dbias, dh.sum(0).to(da.dtype), h.dtype, where)
    *ref, dbias_ref = ab.activation_backward_block_reference(da, h, name, LIMIT, ALPHA, spec)
    near(out, ref, name in RELU_LIKE, where)
    sums(dbias, dbias_ref, h.dtype, where)
    return dbias, dh

def spec_of(fp8, usage=(True, True), power_2=True, eps=0.0):
    return CastSpec(fp8, *usage, amax_epsilon=eps, power_2_scale=power_2)

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
# Gated with N not a multiple of 128 (a dh tile straddles the halves), words and bytes
# (M % 4), several row blocks under GROUP_M 2 (a partial band), usage combinations.
h, da = special("swiglu", (131,), 130, bf16, seed=1)
check("swiglu", h, da, spec_of(E4M3))
check("swiglu", h, da, spec_of(E5M2, (False, True), False), ((4, 2), (4, 2)))
h, da = special("clamped_swiglu", (260,), 64, fp32, seed=2)
check("clamped_swiglu", h, da, spec_of(E4M3, (True, False), False, 1e-3), ((4, 2), (4, 2)))
h, da = special("gelu", (67,), 200, fp16, seed=3)
check("gelu", h, da, spec_of(E5M2, (True, True), False))
h, da = special("geglu", (12,), 128, bf16, seed=4)
check("geglu", h, da, spec_of(E4M3, (False, False)))
for i, name in enumerate(["glu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu"]):
    h, da = special(name, (5 + i,), 36 + 7 * i, (bf16, fp32, fp16)[i % 3], seed=10 + i)
    check(name, h, da, spec_of((E4M3, E5M2)[i % 2], (True, i % 3 != 1), i % 2 == 0))
# Exact sums: relu of representable values (bf16: multiples of 2**-7 below 1).
gen = torch.Generator().manual_seed(7)
h = representable((133, 96), bf16, generator=gen, device="cpu").to(bf16)
da = representable((133, 96), bf16, generator=gen, device="cpu").to(bf16)
dbias, dh = check("relu", h, da, spec_of(E4M3))
assert torch.equal(dbias, dh.double().sum(0).to(bf16))
# The identity: a GEMM's output gradient with its bias gradient.
for dy, spec in ((special("gelu", (131,), 259, bf16, seed=20)[0], spec_of(E4M3)),
                 (special("gelu", (132,), 130, fp32, seed=21)[0], spec_of(E5M2, (False, True))),
                 (special("gelu", (9,), 40, fp16, seed=22)[0], spec_of(E4M3, (True, False)))):
    *out, dbias = ab._dbias_triton(dy, spec, (4, 2))
    same(out, bc.block_quantize_reference(dy, spec.fp8_dtype, 1, spec.rowwise, spec.columnwise,
                                          spec.power_2_scale, spec.amax_epsilon), dy.shape)
    *_, dbias_ref = ab.block_quantize_dbias_reference(dy, spec)
    sums(dbias, dbias_ref, dy.dtype, dy.shape)
print("ok")
"""


@requires_interpreter
def test_triton_kernels_match_unfused_under_interpreter():
    run_under_interpreter(INTERPRETER_SCRIPT)
