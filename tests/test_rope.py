"""Rotary position embeddings: RotaryPositionEmbedding's angles and apply_rotary_pos_emb (the
torch reference path) against an fp64 model, in every format; the Triton kernel against the
reference under Triton's CPU interpreter and on the GPU.

The model is written from the definition alone: positions listed token by token in Python,
y = x cos(theta) + rotate_half(x) sin(theta) on the turned channels in float64 (the reference
works pair by pair instead), gradients from torch.autograd. Inputs are exactly representable in
the tested dtype; freqs are drawn freely (the two angles of a pair differ), so the backward is
checked as the forward's transpose, not only as a rotation by -theta.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops
from tolerances import assert_close, representable, same_bits

from torchte.attention import RotaryPositionEmbedding, apply_rotary_pos_emb
from torchte.kernels import rope as kernels
from torchte.kernels._triton import triton_available

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FREQS_SCALE = 4.0  # angles in [-4, 4]: past pi, both signs of sine and cosine

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


# ----------------------------------------------------------------------------------------------
# The fp64 model
# ----------------------------------------------------------------------------------------------


def model_cp_positions(n: int, cp_size: int, cp_rank: int) -> list[int]:
    """Positions of the n tokens rank cp_rank holds of a sequence cut into 2 cp_size chunks:
    chunk cp_rank, then chunk 2 cp_size - 1 - cp_rank."""
    if cp_size == 1:
        return list(range(n))
    c = n // 2
    chunks = [list(range(i * c, (i + 1) * c)) for i in range(2 * cp_size)]
    return chunks[cp_rank] + chunks[2 * cp_size - 1 - cp_rank]


def model_positions(shape, fmt, start=None, cu=None, cp=(1, 0)) -> torch.Tensor:
    """Each token's position, shaped like t's token dims ((s, b), (b, s) or (t,))."""
    if fmt == "thd":
        out = []
        for k in range(len(cu) - 1):
            n = (cu[k + 1] - cu[k]) // cp[0]
            out += [p + (start[k] if start is not None else 0) for p in model_cp_positions(n, *cp)]
        return torch.tensor(out, dtype=torch.long)
    n_seq, n_batch = (shape[0], shape[1]) if fmt == "sbhd" else (shape[1], shape[0])
    seq = model_cp_positions(n_seq, *cp)
    table = [[seq[i] + (start[j] if start is not None else 0) for j in range(n_batch)]
             for i in range(n_seq)]  # fmt: skip
    pos = torch.tensor(table, dtype=torch.long).reshape(n_seq, n_batch)
    return pos if fmt == "sbhd" else pos.T


def model_apply(t, freqs, fmt, interleaved, start=None, cu=None, cp=(1, 0)) -> torch.Tensor:
    """y of the model, float64, differentiable in t (float64)."""
    s2, d2 = freqs.shape[0], freqs.shape[-1]
    angles = freqs.double().reshape(s2, d2)[model_positions(t.shape, fmt, start, cu, cp)]
    angles = angles.unsqueeze(-2)  # one angle per token and channel, the same for every head
    x, rest = t[..., :d2], t[..., d2:]
    if interleaved:
        turned = torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, -1)
        turned = torch.cat([-x2, x1], -1)
    return torch.cat([x * torch.cos(angles) + turned * torch.sin(angles), rest], -1)


def draw(shape, dtype, s2, d2, device=None):
    """(t, dy, freqs): t and dy exact in dtype, freqs (s2, 1, 1, d2) float32 exact."""
    t = representable(shape, dtype, device=device).to(dtype)
    dy = representable(shape, dtype, scale=2.0, device=device).to(dtype)
    freqs = representable((s2, 1, 1, d2), torch.float32, scale=FREQS_SCALE, device=device)
    return t, dy, freqs


def check_against_model(t, dy, freqs, fmt, interleaved, fused=False, **kw) -> None:
    """apply_rotary_pos_emb's y and dt against the model's, in t's dtype's tolerance."""
    t = t.clone().requires_grad_()
    y = apply_rotary_pos_emb(t, freqs, fmt, interleaved=interleaved, fused=fused, **kw)
    assert y.shape == t.shape and y.dtype == t.dtype
    y.backward(dy)
    t64 = t.detach().cpu().double().requires_grad_()
    model_kw = {
        "start": kw["start_positions"].tolist() if kw.get("start_positions") is not None else None,
        "cu": kw["cu_seqlens"].tolist() if kw.get("cu_seqlens") is not None else None,
        "cp": (kw.get("cp_size", 1), kw.get("cp_rank", 0)),
    }
    y64 = model_apply(t64, freqs.cpu(), fmt, interleaved, **model_kw)
    y64.backward(dy.cpu().double())
    where = f"{fmt} {tuple(t.shape)} {t.dtype} interleaved={interleaved} {kw}"
    assert_close(y, y64, t.dtype, msg=f"forward {where}")
    assert_close(t.grad, t64.grad, t.dtype, msg=f"backward {where}")


# ----------------------------------------------------------------------------------------------
# RotaryPositionEmbedding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim,percent,base", [(16, 1.0, 10000.0), (64, 0.5, 500.0), (10, 0.6, 1e6)])
def test_module_angles_match_the_definition(dim, percent, base, interleaved):
    rope = RotaryPositionEmbedding(dim, percent, rotary_base=base, interleaved=interleaved)
    freqs = rope(37, offset=5)
    d2 = int(dim * percent)
    assert freqs.shape == (37, 1, 1, d2) and freqs.dtype == torch.float32
    p = torch.arange(5, 42, dtype=torch.float64)[:, None]
    angle = p * base ** (-torch.arange(0, d2, 2, dtype=torch.float64) / d2)  # (s, d2 / 2)
    want = angle.repeat_interleave(2, 1) if interleaved else torch.cat([angle, angle], 1)
    assert_close(freqs.reshape(37, d2), want, torch.float32)
    assert rope.inv_freq.device == freqs.device


def test_module_offset_shifts_the_rows_bit_for_bit():
    rope = RotaryPositionEmbedding(32)
    assert same_bits(rope(20, offset=7), rope(27)[7:])
    assert rope(0).shape == (0, 1, 1, 32)


@pytest.mark.parametrize("max_seq_len,scale", [(64, 1 / 4), (100, 1 / 4), (300, 25 / 300)])
def test_module_interpolation_fixed_and_dynamic(max_seq_len, scale):
    plain = RotaryPositionEmbedding(16)(max_seq_len).double()
    scaled = RotaryPositionEmbedding(
        16, seq_len_interpolation_factor=4, pretrained_max_position_embeddings=25
    )(max_seq_len)  # up to 25 * 4 = 100 positions a fixed 1 / 4, past it 25 / max_seq_len
    assert_close(scaled, plain * scale, torch.float32)


def test_module_state_dict_holds_inv_freq():
    rope = RotaryPositionEmbedding(8)
    assert list(rope.state_dict()) == ["inv_freq"]
    assert_close(rope.inv_freq, 10000.0 ** (-torch.arange(0, 8, 2).double() / 8), torch.float32)


def test_module_freqs_turn_pairs_by_equal_angles_into_a_rotation():
    """With the module's freqs the backward is the rotation by -theta: it undoes the forward."""
    freqs = RotaryPositionEmbedding(12, interleaved=True)(9)
    t = representable((9, 2, 3, 12), torch.float32)
    y = apply_rotary_pos_emb(t, freqs, interleaved=True)
    back = kernels.rope_backward_reference(y, freqs.reshape(9, 12), None, None, True, True)
    assert_close(back, t, torch.float32)
    assert_close(y.square().sum(-1), t.square().sum(-1), torch.float32)  # lengths kept


# ----------------------------------------------------------------------------------------------
# apply_rotary_pos_emb (the reference path) against the model
# ----------------------------------------------------------------------------------------------

# (t shape, d2): d2 = d turns every channel; d2 < d passes the rest (rotary_percent < 1).
PADDED_SHAPES = [((7, 2, 3, 10), 10), ((7, 2, 3, 10), 6), ((1, 1, 1, 2), 2), ((5, 3, 2, 16), 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,d2", PADDED_SHAPES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_padded_formats_match_model(fmt, shape, d2, interleaved, dtype):
    s = shape[0] if fmt == "sbhd" else shape[1]
    t, dy, freqs = draw(shape, dtype, s + 3, d2)
    check_against_model(t, dy, freqs, fmt, interleaved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_start_positions(fmt, interleaved, dtype):
    shape = (5, 3, 2, 12) if fmt == "sbhd" else (3, 5, 2, 12)
    t, dy, freqs = draw(shape, dtype, 11, 8)
    start = torch.tensor([0, 6, 2], dtype=torch.int32)  # 6 + 5 = 11 positions: all of freqs
    check_against_model(t, dy, freqs, fmt, interleaved, start_positions=start)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d2", [12, 4])
def test_thd_sequences_restart_at_zero(d2, interleaved, dtype):
    cu = torch.tensor([0, 5, 5, 6, 13], dtype=torch.int32)  # lengths 5, 0, 1, 7
    t, dy, freqs = draw((13, 3, 12), dtype, 7, d2)
    check_against_model(t, dy, freqs, "thd", interleaved, cu_seqlens=cu)
    # The same tokens as one sequence each, in sbhd: the packed result is their concatenation.
    y = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu, interleaved=interleaved)
    for a, b in [(0, 5), (5, 6), (6, 13)]:
        one = apply_rotary_pos_emb(t[a:b, None], freqs, interleaved=interleaved)
        assert torch.equal(y[a:b], one[:, 0])


@pytest.mark.parametrize("interleaved", [False, True])
def test_thd_start_positions(interleaved):
    cu = torch.tensor([0, 4, 9, 11], dtype=torch.int32)
    t, dy, freqs = draw((11, 2, 8), torch.bfloat16, 12, 8)
    start = torch.tensor([3, 0, 10], dtype=torch.int64)
    check_against_model(t, dy, freqs, "thd", interleaved, cu_seqlens=cu, start_positions=start)


@pytest.mark.parametrize("cp_size,cp_rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_context_parallel_positions(fmt, cp_size, cp_rank):
    if fmt == "thd":  # whole (padded) lengths 4 cp, 2 cp, 6 cp; each rank holds a cp-th
        cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32) * cp_size
        t, dy, freqs = draw((12, 2, 8), torch.float32, 6 * cp_size, 6)
        kw = {"cu_seqlens": cu}
    else:
        shape = (6, 2, 3, 8) if fmt == "sbhd" else (2, 6, 3, 8)
        t, dy, freqs = draw(shape, torch.float32, 6 * cp_size + 1, 8)
        kw = {}
    check_against_model(t, dy, freqs, fmt, False, cp_size=cp_size, cp_rank=cp_rank, **kw)


@pytest.mark.parametrize("cp_size,cp_rank", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_context_parallel_with_start_positions(fmt, cp_size, cp_rank):
    """start_positions add to the rank's chunk positions, as Transformer Engine adds them."""
    if fmt == "thd":
        cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32) * cp_size
        start = torch.tensor([5, 0, 2])
        t, dy, freqs = draw((12, 2, 8), torch.float32, 6 * cp_size + 2, 6)
        kw = {"cu_seqlens": cu}
    else:
        shape = (6, 2, 3, 8) if fmt == "sbhd" else (2, 6, 3, 8)
        start = torch.tensor([0, 7], dtype=torch.int32)
        t, dy, freqs = draw(shape, torch.float32, 6 * cp_size + 7, 8)
        kw = {}
    check_against_model(
        t, dy, freqs, fmt, True, cp_size=cp_size, cp_rank=cp_rank, start_positions=start, **kw
    )


def test_zero_tokens_and_fused_on_cpu_is_the_reference():
    freqs = representable((9, 1, 1, 8), torch.float32, scale=FREQS_SCALE)
    t = representable((9, 2, 3, 10), torch.float32)
    fused = apply_rotary_pos_emb(t, freqs, fused=True)
    assert same_bits(fused, apply_rotary_pos_emb(t, freqs))
    empty = t[:0].clone().requires_grad_()
    y = apply_rotary_pos_emb(empty, freqs, fused=True)
    y.sum().backward()
    assert y.shape == empty.shape and empty.grad.shape == empty.shape
    cu = torch.tensor([0], dtype=torch.int32).repeat(3)  # two empty sequences, no tokens
    assert apply_rotary_pos_emb(t[:0, 0], freqs, "thd", cu_seqlens=cu).shape == (0, 3, 10)


def test_non_contiguous_input_and_freqs_dtype():
    """q of a fused qkv projection (a strided view), and bf16 freqs (taken as float32)."""
    qkv = representable((7, 2, 3, 30), torch.float32)
    q = qkv[..., 10:20]
    freqs = representable((7, 1, 1, 10), torch.bfloat16, scale=FREQS_SCALE)
    y = apply_rotary_pos_emb(q, freqs.bfloat16())
    assert_close(y, apply_rotary_pos_emb(q.contiguous(), freqs), torch.float32)


def test_kernel_reference_marks_positions_outside_freqs_as_nan():
    x = representable((3, 2, 1, 4), torch.float32)
    freqs = representable((4, 4), torch.float32)
    start = torch.tensor([0, 2], dtype=torch.int32)  # batch 1 reaches positions 2, 3, 4
    y = kernels.rope_forward_reference(x, freqs, None, start, True, False)
    assert y[:2].isfinite().all() and y[2, 0].isfinite().all() and y[2, 1].isnan().all()


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="even"):
        RotaryPositionEmbedding(7)
    with pytest.raises(ValueError, match="even"):
        RotaryPositionEmbedding(10, rotary_percent=0.5)  # 5 channels
    with pytest.raises(ValueError, match="rotary_percent"):
        RotaryPositionEmbedding(8, rotary_percent=0.0)


def test_bad_apply_arguments():
    freqs = representable((6, 1, 1, 8), torch.float32)
    t = representable((6, 2, 3, 8), torch.float32)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    cases = [
        ({"tensor_format": "hsbd"}, "tensor_format"),
        ({"t": t[0]}, "4 dims"),
        ({"freqs": freqs[:5]}, "fewer than t's sequence length 6"),
        ({"freqs": freqs[..., :7]}, "even"),
        ({"freqs": representable((6, 1, 1, 10), torch.float32)}, "<= t's 8"),
        ({"freqs": freqs.reshape(6, 8)}, r"\(s2, 1, 1, d2\)"),
        ({"tensor_format": "thd", "t": t[:, 0]}, "cu_seqlens is required"),
        ({"tensor_format": "thd", "t": t[:, 0], "cu_seqlens": cu[:2]}, "rise from 0 to t's 6"),
        ({"tensor_format": "thd", "t": t[:, 0], "freqs": freqs[:3], "cu_seqlens": cu[[0, 2]]},
         "the longest sequence needs 6"),
        ({"start_positions": torch.tensor([0, 1, 2])}, "start_positions must be a 1-D integer"),
        ({"start_positions": torch.tensor([0.0, 1.0])}, "start_positions must be a 1-D integer"),
        ({"start_positions": torch.tensor([0, 1])}, "leave room for 6"),
        ({"start_positions": torch.tensor([-1, 0])}, ">= 0"),
        ({"cp_size": 2, "start_positions": torch.tensor([0, 1]),
          "freqs": torch.zeros(12, 1, 1, 8)}, "leave room for 12"),
        ({"cp_size": 2, "cp_rank": 2}, "cp_rank"),
        ({"cp_size": 2}, "cp_size \\* seq len needs 12"),
        ({"cp_size": 2, "t": t[:5], "freqs": torch.zeros(20, 1, 1, 8)}, "must be even"),
        ({"t": t.to(torch.int32)}, "float32, bfloat16 or float16"),
    ]  # fmt: skip
    for change, message in cases:
        args = {"t": t, "freqs": freqs, **change}
        with pytest.raises((ValueError, TypeError), match=message):
            apply_rotary_pos_emb(**args)


# ----------------------------------------------------------------------------------------------
# Triton vs the reference (GPU)
# ----------------------------------------------------------------------------------------------

GPU_CASES = [
    ("sbhd", (0, 2, 3, 64), 64, {}),
    ("sbhd", (1, 1, 1, 2), 2, {}),
    ("sbhd", (127, 3, 17, 128), 128, {}),
    ("sbhd", (61, 2, 5, 80), 40, {}),
    ("bshd", (3, 257, 8, 64), 32, {}),
    ("bshd", (2, 33, 4, 96), 96, {"start": [5, 0]}),
    ("thd", (1000, 7, 128), 64, {"cu": [0, 1, 400, 400, 999, 1000]}),
    ("thd", (64, 3, 64), 64, {"cu": [0, 32, 64], "cp": (2, 1)}),
    ("sbhd", (16, 2, 4, 128), 128, {"cp": (4, 3)}),
    ("bshd", (2, 34, 4, 64), 64, {"start": [3, 0], "cp": (2, 1)}),
    ("thd", (64, 3, 64), 64, {"cu": [0, 32, 64], "cp": (2, 0), "start": [7, 1]}),
]


def gpu_kwargs(extra: dict) -> dict:
    kw = {}
    if "start" in extra:
        kw["start_positions"] = torch.tensor(extra["start"], device="cuda", dtype=torch.int32)
    if "cu" in extra:
        cp = extra.get("cp", (1, 0))[0]
        kw["cu_seqlens"] = torch.tensor(extra["cu"], device="cuda", dtype=torch.int32) * cp
    if "cp" in extra:
        kw["cp_size"], kw["cp_rank"] = extra["cp"]
    return kw


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,shape,d2,extra", GPU_CASES)
def test_triton_matches_reference(fmt, shape, d2, extra, dtype, interleaved):
    kw = gpu_kwargs(extra)
    s2 = 4200 if fmt == "thd" else 4 * max(shape[:2]) + 8
    t, dy, freqs = draw(shape, dtype, s2, d2, device="cuda")
    out = {}
    for fused in (True, False):
        x = t.clone().requires_grad_()
        y = apply_rotary_pos_emb(x, freqs, fmt, interleaved=interleaved, fused=fused, **kw)
        y.backward(dy)
        out[fused] = (y, x.grad)
    assert_close(out[True][0], out[False][0], dtype, msg=f"forward {fmt} {shape}")
    assert_close(out[True][1], out[False][1], dtype, msg=f"backward {fmt} {shape}")
    if shape[0] <= 64:
        check_against_model(t, dy, freqs, fmt, interleaved, fused=True, **kw)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_large_angles_and_strided_input(dtype):
    """Positions up to 16k (angles past 1e4 rad) keep fp32 accuracy; a strided q of a fused qkv."""
    freqs = RotaryPositionEmbedding(128)(16384).cuda()
    qkv = representable((16384, 1, 2, 3 * 128), dtype, device="cuda").to(dtype)
    q = qkv[..., 128:256]
    dy = representable(q.shape, dtype, device="cuda").to(dtype)
    check_against_model(q, dy, freqs, "sbhd", False, fused=True)


@pytest.mark.gpu
@requires_triton
def test_triton_one_launch_per_call():
    freqs = RotaryPositionEmbedding(128)(512).cuda()
    t = torch.randn(512, 2, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(t)

    def forward():
        apply_rotary_pos_emb(t, freqs, fused=True)

    y = apply_rotary_pos_emb(t, freqs, fused=True)
    y.backward(dy, retain_graph=True)

    def backward():
        y.backward(dy, retain_graph=True)

    counts = [count_device_ops(forward), count_device_ops(backward)]
    if counts == [0, 0]:
        pytest.skip("the profiler records no GPU activity here")
    assert counts[0] == 1
    assert counts[1] <= 2  # the kernel, and the accumulation into t.grad


# ----------------------------------------------------------------------------------------------
# The Triton kernel under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close, representable
from torchte.kernels import rope

def check(x, freqs, seq_pos, start, seq_first, interleaved, tile):
    where = (tuple(x.shape), x.stride(), x.dtype, tuple(freqs.shape), seq_first, interleaved,
             seq_pos is not None, start is not None, tile)
    for inverse, reference in ((False, rope.rope_forward_reference),
                               (True, rope.rope_backward_reference)):
        y = rope._rope_triton(x, freqs, seq_pos, start, seq_first, interleaved, inverse, tile)
        y_ref = reference(x, freqs, seq_pos, start, seq_first, interleaved)
        assert y.dtype == y_ref.dtype and y.shape == y_ref.shape and y.is_contiguous(), where
        nan = y_ref.isnan()
        assert torch.equal(y.isnan(), nan), where
        assert_close(y[~nan], y_ref[~nan], x.dtype, msg=str((inverse, *where)))

def table(values):
    return torch.tensor(values, dtype=torch.int32)

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for interleaved in (False, True):
        # (x shape, d2, tile): several head blocks; pass-through channels; one token.
        for shape, d2, tile in [((5, 3, 7, 12), 8, 8), ((4, 2, 3, 16), 16, 2048),
                                ((1, 1, 1, 2), 2, 2048), ((3, 5, 17, 10), 6, 16)]:
            x = representable(shape, dtype).to(dtype)
            freqs = representable((12, d2), torch.float32, scale=4.0)
            n0, n1 = shape[0], shape[1]
            check(x, freqs, None, None, True, interleaved, tile)
            check(x, freqs, None, None, False, interleaved, tile)
            check(x, freqs, table(list(range(n0))[::-1]), table([2] * n1), True, interleaved,
                  tile)
            check(x, freqs, None, table(list(range(n0))), False, interleaved, tile)
x = representable((6, 2, 3, 24), torch.float32)  # strided: q of a fused qkv, also bshd-wise
freqs = representable((9, 8), torch.float32, scale=4.0)
check(x[..., 8:16], freqs, None, None, True, False, 16)
check(x[..., 8:16].transpose(0, 1), freqs, None, None, False, True, 16)
check(x[:0], freqs, None, None, True, False, 16)  # no tokens: no launch
check(x[:, :, :, :8], freqs, table([0, 1, 8, 9, 2, -1]), None, True, False, 16)  # NaN past freqs
print("ok")
"""


@requires_interpreter
def test_triton_kernel_in_interpreter_matches_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)


def test_model_is_a_rotation():
    """The model itself: a rotation by pi / 2 of pair (x0, x1) gives (-x1, x0)."""
    t = torch.tensor([[[[1.0, 2.0]]]], dtype=torch.float64)
    freqs = torch.full((1, 1, 1, 2), math.pi / 2)
    y = model_apply(t, freqs, "sbhd", False)
    assert torch.allclose(y, torch.tensor([[[[-2.0, 1.0]]]], dtype=torch.float64))
