"""apply_fused_qkv_rotary_pos_emb (Transformer Engine's name and signature): a fused QKV tensor
split into q, k and v, q and k turned by their own angles, against an fp64 model written from
the definition; the same as Megatron-Core's unfused path (torch.split, then
apply_rotary_pos_emb on q and k); the Triton kernel against the torch reference under Triton's
CPU interpreter and on the GPU.

Legend: s sequence, b batch, g key/value groups, per query heads per group, d head size,
d2 channels turned. qkv is (s, b, g, (per + 2) d) sbhd or (b, s, g, (per + 2) d) bshd: per
group its per query heads, its key head, its value head (Megatron-Core's layout).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from launches import count_device_ops
from tolerances import assert_close, representable

from torchte import _alias as alias_api
from torchte.attention import rope
from torchte.attention.rope import apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb
from torchte.kernels._triton import triton_available

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FREQS_SCALE = 4.0  # angles in [-4, 4]

requires_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton")


# ----------------------------------------------------------------------------------------------
# The fp64 model
# ----------------------------------------------------------------------------------------------


def model_positions(n_seq: int, n_batch: int, start=None, cp=(1, 0)) -> torch.Tensor:
    """(n_seq, n_batch) positions: i (+ start[j]); with context parallelism, rank cp[1] of cp[0]
    holds chunk cp[1] then chunk 2 cp[0] - 1 - cp[1] of a sequence cut into 2 cp[0] chunks."""
    size, rank = cp
    if size == 1:
        seq = list(range(n_seq))
    else:
        c = n_seq // 2
        seq = list(range(rank * c, (rank + 1) * c))
        seq += list(range((2 * size - 1 - rank) * c, (2 * size - rank) * c))
    table = [[p + (start[j] if start is not None else 0) for j in range(n_batch)] for p in seq]
    return torch.tensor(table, dtype=torch.long)


def model_turn(x, freqs, pos, interleaved):
    """x (n_seq, n_batch, heads, d) fp64, each token turned by freqs' row at its position."""
    d2 = freqs.shape[-1]
    angles = freqs.double().reshape(-1, d2)[pos].unsqueeze(-2)
    head, rest = x[..., :d2], x[..., d2:]
    if interleaved:
        turned = torch.stack([-head[..., 1::2], head[..., 0::2]], -1).flatten(-2)
    else:
        first, second = head.chunk(2, -1)
        turned = torch.cat([-second, first], -1)
    return torch.cat([head * torch.cos(angles) + turned * torch.sin(angles), rest], -1)


def model(qkv, q_freqs, k_freqs, per, fmt, interleaved, start=None, cp=(1, 0)):
    """(q, k, v) of the definition, fp64, differentiable in qkv (fp64)."""
    x = qkv if fmt == "sbhd" else qkv.transpose(0, 1)
    n_seq, n_batch, groups, width = x.shape
    d = width // (per + 2)
    pos = model_positions(n_seq, n_batch, start, cp)
    q = model_turn(x[..., : per * d].reshape(n_seq, n_batch, groups * per, d), q_freqs, pos,
                   interleaved)  # fmt: skip
    k = model_turn(x[..., per * d : (per + 1) * d], k_freqs, pos, interleaved)
    v = x[..., (per + 1) * d :]
    out = (q, k, v)
    return out if fmt == "sbhd" else tuple(t.transpose(0, 1) for t in out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b (one dtype of 2 or 4 bytes) hold the same bit patterns."""
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def draw(shape, dtype, s2, d2, device=None, s2_k=None):
    """(qkv, q_freqs, k_freqs): qkv exact in dtype, freqs (s2, 1, 1, d2) fp32, distinct."""
    qkv = representable(shape, dtype, device=device).to(dtype)
    q_freqs = representable((s2, 1, 1, d2), torch.float32, scale=FREQS_SCALE, device=device)
    k_freqs = representable((s2_k or s2, 1, 1, d2), torch.float32, scale=FREQS_SCALE,
                            device=device)  # fmt: skip
    return qkv, q_freqs, k_freqs


def check_against_model(qkv, q_freqs, k_freqs, per, fmt, interleaved, **kw) -> None:
    """Outputs and the gradient of qkv against the model's, in qkv's dtype's tolerance."""
    d = qkv.shape[-1] // (per + 2)
    x = qkv.clone().requires_grad_()
    out = apply_fused_qkv_rotary_pos_emb(x, q_freqs, k_freqs, [per * d, d, d], fmt,
                                         interleaved=interleaved, **kw)  # fmt: skip
    grads = [representable(t.shape, qkv.dtype, scale=2.0, device=qkv.device).to(qkv.dtype)
             for t in out]  # fmt: skip
    torch.autograd.backward(out, grads)
    x64 = qkv.detach().cpu().double().requires_grad_()
    start = kw.get("start_positions")
    cp = (kw.get("cp_size", 1), kw.get("cp_rank", 0))
    start = start.tolist() if start is not None else None
    want = model(x64, q_freqs.cpu(), k_freqs.cpu(), per, fmt, interleaved, start, cp)
    torch.autograd.backward(want, [g.cpu().double() for g in grads])
    where = f"{fmt} {tuple(qkv.shape)} {qkv.dtype} per={per} interleaved={interleaved} {kw}"
    for name, got, ref in zip("qkv", out, want, strict=True):
        assert got.shape == ref.shape and got.dtype == qkv.dtype and got.is_contiguous(), where
        assert_close(got, ref, qkv.dtype, msg=f"{name} {where}")
    assert_close(x.grad, x64.grad, qkv.dtype, msg=f"grad {where}")


# ----------------------------------------------------------------------------------------------
# The torch reference path (CPU)
# ----------------------------------------------------------------------------------------------

CASES = [  # (shape of qkv in sbhd, per, d2)
    ((5, 3, 3, 4 * 8), 2, 8),  # GQA, every channel turned
    ((7, 2, 2, 5 * 10), 3, 6),  # rotary_percent < 1: channels 6..9 pass through
    ((3, 1, 4, 3 * 6), 1, 4),  # MHA (one query head per group)
    ((1, 1, 1, 3 * 2), 1, 2),  # one token, one group, two channels
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("shape,per,d2", CASES)
def test_matches_model(shape, per, d2, fmt, interleaved, dtype):
    if fmt == "bshd":
        shape = (shape[1], shape[0], *shape[2:])
    qkv, q_freqs, k_freqs = draw(shape, dtype, 11, d2, s2_k=9)
    check_against_model(qkv, q_freqs, k_freqs, per, fmt, interleaved)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_start_positions(fmt):
    shape = (4, 3, 2, 4 * 8) if fmt == "sbhd" else (3, 4, 2, 4 * 8)
    qkv, q_freqs, k_freqs = draw(shape, torch.bfloat16, 12, 8)
    start = torch.tensor([3, 0, 8], dtype=torch.int32)
    check_against_model(qkv, q_freqs, k_freqs, 2, fmt, False, start_positions=start)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("cp_size,cp_rank", [(2, 0), (2, 1), (3, 2)])
def test_context_parallel_positions(fmt, cp_size, cp_rank):
    shape = (6, 2, 2, 3 * 8) if fmt == "sbhd" else (2, 6, 2, 3 * 8)
    qkv, q_freqs, k_freqs = draw(shape, torch.float32, 6 * cp_size, 8)
    check_against_model(qkv, q_freqs, k_freqs, 1, fmt, True, cp_size=cp_size, cp_rank=cp_rank)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("cp_size,cp_rank", [(2, 1), (3, 0)])
def test_context_parallel_with_start_positions(fmt, cp_size, cp_rank):
    """start_positions add to the rank's chunk positions, as Transformer Engine adds them."""
    shape = (6, 2, 2, 3 * 8) if fmt == "sbhd" else (2, 6, 2, 3 * 8)
    qkv, q_freqs, k_freqs = draw(shape, torch.float32, 6 * cp_size + 4, 8)
    start = torch.tensor([4, 1], dtype=torch.int32)
    check_against_model(
        qkv, q_freqs, k_freqs, 1, fmt, False, cp_size=cp_size, cp_rank=cp_rank,
        start_positions=start,
    )  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True])
def test_same_as_megatron_split_then_apply_rotary_pos_emb(interleaved):
    """Megatron-Core's unfused path: split [sq, b, ng, (np/ng + 2) hn] along the last dim,
    query reshaped to [sq, b, np, hn], each turned by apply_rotary_pos_emb: the same bits."""
    sq, b, ng, per, hn = 9, 2, 3, 4, 16
    base = representable((sq, b, ng, 2 * (per + 2) * hn), torch.bfloat16).to(torch.bfloat16)
    q_freqs = rope.RotaryPositionEmbedding(hn, interleaved=interleaved)(sq)
    k_freqs = rope.RotaryPositionEmbedding(hn, interleaved=interleaved, rotary_base=500.0)(sq)
    split = [per * hn, hn, hn]
    # A column slice, as Megatron takes when num_query_groups < tp size: not contiguous.
    x_base, y_base = base.clone().requires_grad_(), base.clone().requires_grad_()
    q, k, v = apply_fused_qkv_rotary_pos_emb(x_base[..., : (per + 2) * hn], q_freqs, k_freqs,
                                             split, interleaved=interleaved)  # fmt: skip
    query, key, value = torch.split(y_base[..., : (per + 2) * hn], split, dim=3)
    query = query.reshape(sq, b, -1, hn)
    q_ref = apply_rotary_pos_emb(query, q_freqs, "sbhd", interleaved=interleaved, fused=True)
    k_ref = apply_rotary_pos_emb(key, k_freqs, "sbhd", interleaved=interleaved, fused=True)
    for got, ref in ((q, q_ref), (k, k_ref), (v, value)):
        assert same_bits(got, ref)
    grads = [representable(t.shape, torch.bfloat16).to(torch.bfloat16) for t in (q, k, v)]
    torch.autograd.backward((q, k, v), grads)
    torch.autograd.backward((q_ref, k_ref, value), grads)
    assert same_bits(x_base.grad, y_base.grad)


def test_value_passes_bit_for_bit_and_gradient_only_to_qkv():
    qkv, q_freqs, k_freqs = draw((4, 2, 2, 4 * 8), torch.float16, 8, 8)
    qkv[0, 0, 0, -1] = float("inf")  # a non-finite value in v stays as it is
    qkv[0, 0, 1, -2] = -0.0
    q_freqs.requires_grad_()
    q, _, v = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [16, 8, 8])
    assert same_bits(v, qkv[..., 24:])
    assert v.data_ptr() != qkv.data_ptr() and v.is_contiguous()
    q.float().sum().backward()
    assert q_freqs.grad is None  # freqs get no gradient (as in Transformer Engine)


def test_zero_tokens():
    qkv = torch.zeros(0, 3, 2, 4 * 8, requires_grad=True)
    freqs = rope.RotaryPositionEmbedding(8)(4)
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [16, 8, 8])
    assert q.shape == (0, 3, 4, 8) and k.shape == v.shape == (0, 3, 2, 8)
    (q.sum() + k.sum() + v.sum()).backward()
    assert qkv.grad.shape == qkv.shape


def test_compiles_fullgraph_with_eager_numbers():
    """Under torch.compile the kernel entry points run as torchte:: custom ops."""
    torch._dynamo.reset()
    freqs = rope.RotaryPositionEmbedding(8)(6)

    def step(qkv):
        q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [16, 8, 8], "bshd")
        return (q.sum(-1) * 2).sum() + (k * k).sum() + (v * v * v).sum()

    x = representable((2, 6, 3, 32), torch.float32).requires_grad_()
    y = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    y.backward()
    grad, x.grad = x.grad, None
    step(x).backward()
    assert torch.equal(y, step(x)) and torch.equal(grad, x.grad)
    torch._dynamo.reset()


def test_signatures_are_transformer_engines():
    """Parameter names, order and defaults of Transformer Engine 2.x (rope.py)."""
    fused = inspect.signature(apply_fused_qkv_rotary_pos_emb).parameters
    assert [(n, p.default) for n, p in fused.items()] == [
        ("qkv", inspect.Parameter.empty),
        ("q_freqs", inspect.Parameter.empty),
        ("k_freqs", inspect.Parameter.empty),
        ("qkv_split_arg_list", inspect.Parameter.empty),
        ("tensor_format", "sbhd"),
        ("start_positions", None),
        ("interleaved", False),
        ("cu_seqlens", None),
        ("cp_size", 1),
        ("cp_rank", 0),
    ]
    single = inspect.signature(apply_rotary_pos_emb).parameters
    assert list(single) == ["t", "freqs", "tensor_format", "start_positions", "interleaved",
                            "fused", "cu_seqlens", "cp_size", "cp_rank"]  # fmt: skip


def test_megatron_calls(monkeypatch):
    """The calls Megatron-Core 0.19 makes: the fused QKV one (positional, defaults) and the
    fused single-tensor ones (sbhd with interleaved; thd with cu_seqlens and cp)."""
    sq, b, ng, per, hn = 4, 2, 2, 2, 8
    mixed = representable((sq, b, ng, (per + 2) * hn), torch.float32)
    freqs = rope.RotaryPositionEmbedding(hn)(2 * sq)
    q, *_ = apply_fused_qkv_rotary_pos_emb(mixed, freqs, freqs, [per * hn, hn, hn])
    assert q.shape == (sq, b, ng * per, hn)
    t = representable((2 * sq, ng, hn), torch.float32)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)  # whole sequences, padded, with cp
    y = apply_rotary_pos_emb(t, freqs, tensor_format="thd", fused=True, cu_seqlens=cu,
                             cp_size=2, cp_rank=1, interleaved=False)  # fmt: skip
    assert y.shape == t.shape
    y = apply_rotary_pos_emb(q, freqs, tensor_format="sbhd", interleaved=True, fused=True)
    assert y.shape == q.shape


def test_alias_path_hands_it_out():
    """Megatron-Core imports it from transformer_engine.pytorch.attention.rope."""
    assert not alias_api.is_installed()
    alias_api.install()
    try:
        from transformer_engine.pytorch.attention.rope import (
            apply_fused_qkv_rotary_pos_emb as aliased,
        )
    finally:
        alias_api.uninstall()
    assert aliased is apply_fused_qkv_rotary_pos_emb


def test_bad_arguments():
    qkv = torch.zeros(4, 2, 2, 32)
    freqs = rope.RotaryPositionEmbedding(8)(8)
    split = [16, 8, 8]
    with pytest.raises(NotImplementedError, match="thd"):
        apply_fused_qkv_rotary_pos_emb(qkv[0], freqs, freqs, split, "thd")
    with pytest.raises(ValueError, match="tensor_format"):
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, "hbsd")
    with pytest.raises(ValueError, match="qkv must be 4-D"):
        apply_fused_qkv_rotary_pos_emb(qkv[0], freqs, freqs, split)
    for bad in ([8, 8, 16], [12, 10, 10], [8, 8, 8], [16, 8], (16, 8.0, 8), [0, 16, 16]):
        with pytest.raises(ValueError, match="qkv_split_arg_list"):
            apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, bad)
    with pytest.raises(ValueError, match="k_freqs' last dim"):
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, rope.RotaryPositionEmbedding(10)(8), split)
    with pytest.raises(ValueError, match="same d2"):
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, rope.RotaryPositionEmbedding(4)(8), split)
    with pytest.raises(ValueError, match=r"q_freqs must be \(s2, 1, 1, d2\)"):
        apply_fused_qkv_rotary_pos_emb(qkv, freqs[:, 0], freqs, split)
    with pytest.raises(ValueError, match="fewer than"):
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs[:3], split)
    start = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="leave room for 8 positions"):  # 2 x 4 from 1
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, start_positions=start + 1,
                                       cp_size=2)  # fmt: skip
    with pytest.raises(ValueError, match="cp_size"):
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="start_positions must be >= 0"):
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, start_positions=start + 5)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        apply_fused_qkv_rotary_pos_emb(qkv.double(), freqs, freqs, split)


# ----------------------------------------------------------------------------------------------
# The Triton kernel on the GPU
# ----------------------------------------------------------------------------------------------

GPU_CASES = [  # (sbhd shape, per, d2, extra)
    ((257, 3, 4, 10 * 128), 8, 128, {}),
    ((61, 2, 3, 4 * 80), 2, 40, {}),
    ((33, 2, 1, 34 * 64), 32, 64, {"start": [5, 0]}),
    ((16, 2, 2, 3 * 128), 1, 128, {"cp": (4, 3)}),
]


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,per,d2,extra", GPU_CASES)
def test_triton_matches_reference_and_model(shape, per, d2, extra, dtype, interleaved, fmt):
    if fmt == "bshd":
        shape = (shape[1], shape[0], *shape[2:])
    kw = {}
    if "start" in extra:
        kw["start_positions"] = torch.tensor(extra["start"], device="cuda", dtype=torch.int32)
    if "cp" in extra:
        kw["cp_size"], kw["cp_rank"] = extra["cp"]
    qkv, q_freqs, k_freqs = draw(shape, dtype, 4 * max(shape[:2]) + 8, d2, device="cuda")
    d = shape[-1] // (per + 2)
    runs = []
    for x_in in (qkv, qkv.cpu()):
        x = x_in.clone().requires_grad_()
        out = apply_fused_qkv_rotary_pos_emb(x, q_freqs.to(x.device), k_freqs.to(x.device),
                                             [per * d, d, d], fmt, interleaved=interleaved,
                                             **{n: t.to(x.device) if isinstance(t, torch.Tensor)
                                                else t for n, t in kw.items()})  # fmt: skip
        # The same upstream gradients for both devices: one seeded draw each time.
        generator = torch.Generator().manual_seed(7)
        grads = [
            representable(t.shape, dtype, scale=2.0, generator=generator).to(dtype).to(x.device)
            for t in out
        ]
        torch.autograd.backward(out, grads)
        runs.append((out, x.grad))
    for got, ref in zip(runs[0][0], runs[1][0], strict=True):
        assert_close(got, ref, dtype)
        assert got.is_contiguous() and got.shape == ref.shape
    assert same_bits(runs[0][0][2].cpu(), runs[1][0][2])  # v copied bit for bit
    assert_close(runs[0][1], runs[1][1], dtype)
    if shape[0] * shape[1] <= 128:
        check_against_model(qkv, q_freqs, k_freqs, per, fmt, interleaved, **kw)


@pytest.mark.gpu
@requires_triton
def test_triton_strided_qkv_and_grads():
    """A column slice of a wider projection output, and non-contiguous output gradients."""
    wide = representable((64, 2, 4, 2 * 6 * 64), torch.bfloat16, device="cuda").to(torch.bfloat16)
    qkv = wide[..., 6 * 64 :]
    freqs = rope.RotaryPositionEmbedding(64)(64).cuda()
    check_against_model(qkv, freqs, freqs, 4, "sbhd", False)
    x = qkv.clone().requires_grad_()
    q, k, v = apply_fused_qkv_rotary_pos_emb(x, freqs, freqs, [256, 64, 64])
    dq = torch.randn((*q.shape[:-1], 128), device="cuda", dtype=q.dtype)[..., ::2]
    torch.autograd.backward((q, k, v), (dq, torch.ones_like(k), torch.zeros_like(v)))
    y = qkv.cpu().clone().requires_grad_()
    q2, k2, v2 = apply_fused_qkv_rotary_pos_emb(y, freqs.cpu(), freqs.cpu(), [256, 64, 64])
    torch.autograd.backward((q2, k2, v2), (dq.cpu(), torch.ones_like(k2), torch.zeros_like(v2)))
    assert_close(x.grad, y.grad, torch.bfloat16)


@pytest.mark.gpu
@requires_triton
def test_triton_one_launch_per_call():
    freqs = rope.RotaryPositionEmbedding(128)(512).cuda()
    qkv = torch.randn(512, 2, 4, 6 * 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    split = [4 * 128, 128, 128]

    def forward():
        apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split)

    out = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split)
    grads = [torch.randn_like(t) for t in out]
    torch.autograd.backward(out, grads, retain_graph=True)

    def backward():
        torch.autograd.backward(out, grads, retain_graph=True)

    counts = [count_device_ops(forward), count_device_ops(backward)]
    if counts == [0, 0]:
        pytest.skip("the profiler records no GPU activity here")
    assert counts[0] == 1
    assert counts[1] <= 2  # the kernel, and the accumulation into qkv.grad


# ----------------------------------------------------------------------------------------------
# The Triton kernel under Triton's CPU interpreter (where triton is installed)
# ----------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = """
import torch
from tolerances import assert_close, representable
from torchte.kernels import rope_qkv

def table(values):
    return torch.tensor(values, dtype=torch.int32)

def check(qkv, q_freqs, k_freqs, seq_pos, start, seq_first, interleaved, per, tile):
    where = (tuple(qkv.shape), qkv.stride(), qkv.dtype, per, seq_first, interleaved, tile,
             seq_pos is not None, start is not None)
    n0, n1, g, width = qkv.shape
    d = width // (per + 2)
    args = (q_freqs, k_freqs, seq_pos, start, seq_first, interleaved)
    split = (torch.full((n0, n1, g * per, d), 7.0, dtype=qkv.dtype),
             torch.full((n0, n1, g, d), 7.0, dtype=qkv.dtype),
             torch.full((n0, n1, g, d), 7.0, dtype=qkv.dtype))
    rope_qkv._qkv_rope_triton(qkv, split, *args, False, tile)
    want = rope_qkv.qkv_rope_forward_reference(qkv, *args, per)
    for got, ref in zip(split, want):
        nan = ref.isnan()
        assert torch.equal(got.isnan(), nan), where
        assert_close(got[~nan], ref[~nan], qkv.dtype, msg=str(where))
    assert torch.equal(split[2].view(torch.int16 if qkv.dtype != torch.float32 else torch.int32),
                       want[2].view(torch.int16 if qkv.dtype != torch.float32 else torch.int32))
    grads = [representable(t.shape, qkv.dtype).to(qkv.dtype) for t in split]
    grads[0] = torch.cat([grads[0], grads[0]], 2)[:, :, : g * per]  # a strided dq
    dqkv = torch.full(qkv.shape, 7.0, dtype=qkv.dtype)
    rope_qkv._qkv_rope_triton(dqkv, tuple(grads), *args, True, tile)
    ref = rope_qkv.qkv_rope_backward_reference(*grads, *args, per)
    nan = ref.isnan()
    assert torch.equal(dqkv.isnan(), nan), where
    assert_close(dqkv[~nan], ref[~nan], qkv.dtype, msg=str(("backward",) + where))

torch.manual_seed(0)
# (n0, n1, groups, per, d, d2, tile): several programs per token; pass-through channels; one
# token with one group.
for dtype, interleaved, (n0, n1, g, per, d, d2, tile) in [
    (torch.float32, False, (3, 2, 3, 2, 8, 8, 16)),
    (torch.bfloat16, True, (2, 3, 2, 3, 10, 6, 2048)),
    (torch.float16, False, (1, 1, 1, 1, 2, 2, 2048)),
]:
    qkv = representable((n0, n1, g, (per + 2) * d), dtype).to(dtype)
    q_freqs = representable((12, d2), torch.float32, scale=4.0)
    k_freqs = representable((9, d2), torch.float32, scale=4.0)
    check(qkv, q_freqs, k_freqs, None, None, True, interleaved, per, tile)
    check(qkv, q_freqs, k_freqs, table(list(range(n1))[::-1]), table([5] * n0), False,
          interleaved, per, tile)
wide = representable((4, 2, 2, 2 * 4 * 8), torch.float32)  # a strided qkv
q_freqs = representable((12, 8), torch.float32, scale=4.0)
k_freqs = representable((6, 8), torch.float32, scale=4.0)
check(wide[..., 32:], q_freqs, k_freqs, None, None, True, True, 2, 32)
# Positions past k_freqs (6) but not q_freqs (12): k turns by NaN there, q and v do not.
check(wide[..., :32], q_freqs, k_freqs, table([0, 1, 7, 11]), None, True, False, 2, 32)
check(wide[:0], q_freqs, k_freqs, None, None, True, False, 6, 32)  # no tokens: no launch
print("ok")
"""


@requires_interpreter
def test_triton_kernel_in_interpreter_matches_reference():
    run_under_interpreter(INTERPRETER_SCRIPT)
