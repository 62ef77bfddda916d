"""Packed (thd) attention against each sequence run alone through an fp64 softmax(QK^T)V.

Shape legend: t query tokens, s key/value tokens, h query heads, hg key/value heads,
d query/key head size, dv value head size.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, assert_close_to_scale, representable

from torchte.attention import packed
from torchte.attention.packed import check_cu_seqlens, packed_attention
from torchte.attention.packed_math import MaskSpec

D, DV = 16, 8
SCALE = 0.25  # 1/sqrt(D), a power of two: the scaled scores stay exact


def _offsets(lens, device="cpu"):
    """int32 (b+1,) cumulative offsets of `lens`."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


class Pack:
    """q (t, h, D), k (s, hg, D), v (s, hg, DV) in `dtype`, exact; the offsets tensors."""

    def __init__(
        self, lens_q, lens_kv, gaps_q=None, gaps_kv=None, h=4, hg=2, dtype=None, d=D, dv=DV
    ):
        dtype = dtype or torch.float32
        self.lens_q, self.lens_kv = lens_q, lens_kv
        self.slots_q = [n + g for n, g in zip(lens_q, gaps_q or [0] * len(lens_q), strict=True)]
        self.slots_kv = [n + g for n, g in zip(lens_kv, gaps_kv or [0] * len(lens_kv), strict=True)]
        t, s = sum(self.slots_q), sum(self.slots_kv)
        self.q = representable((t, h, d), dtype).to(dtype)
        self.k = representable((s, hg, d), dtype).to(dtype)
        self.v = representable((s, hg, dv), dtype).to(dtype)
        self.grad = representable((t, h, dv), dtype).to(dtype)
        self.cu_q, self.cu_kv = _offsets(lens_q), _offsets(lens_kv)
        self.pad_q = _offsets(self.slots_q) if gaps_q else None
        self.pad_kv = _offsets(self.slots_kv) if gaps_kv else None
        if lens_q == lens_kv and gaps_q == gaps_kv:  # self-attention: one tensor, as TE users pass
            self.cu_kv, self.pad_kv = self.cu_q, self.pad_q

    def cuda(self):
        """Move every tensor to CUDA, keeping shared offsets tensors shared."""
        moved = {}
        for name in ("q", "k", "v", "grad", "cu_q", "cu_kv", "pad_q", "pad_kv"):
            x = getattr(self, name)
            if x is not None and id(x) not in moved:
                moved[id(x)] = x.cuda()
            setattr(self, name, None if x is None else moved[id(x)])
        return self

    def run(self, backend, **mask):
        """Output and (dq, dk, dv) of packed_attention on leaf copies; no grads (None) for
        flex off CUDA, which has no backward there."""
        grad = backend != "flex" or self.q.is_cuda
        q, k, v = (x.detach().clone().requires_grad_(grad) for x in (self.q, self.k, self.v))
        out = packed_attention(
            q,
            k,
            v,
            self.cu_q,
            self.cu_kv,
            max(self.lens_q, default=0),
            max(self.lens_kv, default=0),
            scale=SCALE,
            cu_seqlens_q_padded=self.pad_q,
            cu_seqlens_kv_padded=self.pad_kv,
            backend=backend,
            **mask,
        )
        if grad:
            out.backward(self.grad)
        return out, (q.grad, k.grad, v.grad)

    def reference(self, causal, bottom_right, window):
        """fp64 output and grads: each sequence alone, 0 in padding rows."""
        q, k, v = (x.detach().double().requires_grad_() for x in (self.q, self.k, self.v))
        groups = q.shape[1] // k.shape[1]
        pieces, q0, k0 = [], 0, 0
        for lq, lk, sq, sk in zip(
            self.lens_q, self.lens_kv, self.slots_q, self.slots_kv, strict=True
        ):
            qi = q[q0 : q0 + lq]
            ki = k[k0 : k0 + lk].repeat_interleave(groups, dim=1)
            vi = v[k0 : k0 + lk].repeat_interleave(groups, dim=1)
            keep = _reference_mask(lq, lk, causal, bottom_right, window)
            scores = torch.einsum("thd,shd->hts", qi, ki) * SCALE
            scores = scores.masked_fill(~keep, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see nothing: 0
            pieces += [torch.einsum("hts,shd->thd", probs, vi), q.new_zeros(sq - lq, *vi.shape[1:])]
            q0, k0 = q0 + sq, k0 + sk
        out = torch.cat(pieces) if pieces else q.new_zeros(0, q.shape[1], v.shape[2])
        out.backward(self.grad.double())
        return out, (q.grad, k.grad, v.grad)


def _reference_mask(lq, lk, causal, bottom_right, window):
    """(lq, lk) keep-mask from tril/triu: key j kept iff off-left <= j-i <= off+right."""
    keep = torch.ones(lq, lk, dtype=torch.bool)
    off = lk - lq if bottom_right else 0
    left, right = window[0], 0 if causal else window[1]
    if right >= 0:
        keep = keep.tril(diagonal=off + right)
    if left >= 0:
        keep = keep.triu(diagonal=off - left)
    return keep


def _compare(pack, backend, dtype, close=assert_close, **mask):
    out, grads = pack.run(backend, **mask)
    ref_out, ref_grads = pack.reference(mask["causal"], mask["bottom_right"], mask["window"])
    assert out.dtype == pack.q.dtype and out.shape == ref_out.shape
    close(out, ref_out, dtype, msg="output")
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        if backend != "flex" or pack.q.is_cuda:
            close(g, ref, dtype, msg=name)


MASKS = {
    "none": dict(causal=False, bottom_right=False, window=(-1, -1)),
    "causal": dict(causal=True, bottom_right=False, window=(-1, -1)),
    "causal_br": dict(causal=True, bottom_right=True, window=(-1, -1)),
    "window_br": dict(causal=False, bottom_right=True, window=(2, 1)),
    "window_tl": dict(causal=False, bottom_right=False, window=(1, 3)),
    "causal_window": dict(causal=True, bottom_right=False, window=(2, 5)),
    "causal_br_window": dict(causal=True, bottom_right=True, window=(1, -1)),
    "left_open": dict(causal=False, bottom_right=True, window=(-1, 1)),
}
# Cross-attention lengths with empty sequences, q longer and shorter than kv.
LENS_Q, LENS_KV = [3, 0, 5, 2, 4, 1], [5, 2, 2, 0, 4, 7]
CPU_BACKENDS = ["math", "math_loop", "flex"]


@pytest.fixture
def use_backend(monkeypatch):
    """Backend name -> the name to pass; "math_loop" forces the per-sequence loop."""

    def pick(name):
        if name == "math_loop":
            monkeypatch.setattr(packed, "_DENSE_LIMIT", 0)
            return "math"
        return name

    return pick


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask", list(MASKS))
def test_masks_cross_lengths(backend, mask, use_backend):
    _compare(Pack(LENS_Q, LENS_KV), use_backend(backend), torch.float32, **MASKS[mask])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_br", "window_br"])
def test_padding_between_sequences(backend, mask, use_backend):
    pack = Pack(LENS_Q, LENS_KV, gaps_q=[1, 2, 0, 3, 0, 1], gaps_kv=[0, 1, 2, 2, 1, 0])
    out, grads = pack.run(use_backend(backend), **MASKS[mask])
    _compare(pack, use_backend(backend), torch.float32, **MASKS[mask])
    pad_rows = torch.ones(out.shape[0], dtype=torch.bool)
    for start, n in zip(pack.pad_q[:-1].tolist(), LENS_Q, strict=True):
        pad_rows[start : start + n] = False
    assert pad_rows.any() and (out[pad_rows] == 0).all()
    if grads[0] is not None:
        assert (grads[0][pad_rows] == 0).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_gqa_self_attention(backend, heads, use_backend):
    lens = [7, 1, 0, 4]
    pack = Pack(lens, lens, h=heads[0], hg=heads[1])
    _compare(pack, use_backend(backend), torch.float32, **MASKS["causal"])


@pytest.mark.parametrize("backend", ["math", "math_loop"])
def test_bfloat16_math(backend, use_backend):
    pack = Pack(LENS_Q, LENS_KV, dtype=torch.bfloat16)
    _compare(pack, use_backend(backend), torch.bfloat16, **MASKS["causal_br"])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_zero_tokens(backend, use_backend):
    pack = Pack([0, 0], [0, 3])
    out, grads = pack.run(use_backend(backend), **MASKS["none"])
    assert out.shape == (0, 4, DV)
    if grads[1] is not None:
        assert (grads[1] == 0).all() and (grads[2] == 0).all()


def test_cross_sequence_isolation():
    """Changing one sequence's keys leaves every other sequence's output unchanged."""
    pack = Pack([4, 5], [4, 5])
    before, _ = pack.run("math", **MASKS["none"])
    pack.k[4:] = -pack.k[4:]
    after, _ = pack.run("math", **MASKS["none"])
    assert torch.equal(before[:4], after[:4]) and not torch.equal(before[4:], after[4:])


def test_dropout_math():
    pack = Pack([6, 3], [6, 3], gaps_q=[2, 0], gaps_kv=[0, 0])
    torch.manual_seed(0)
    a, _ = pack.run("math", dropout_p=0.5, **MASKS["none"])
    torch.manual_seed(0)
    b, _ = pack.run("math", dropout_p=0.5, **MASKS["none"])
    plain, _ = pack.run("math", **MASKS["none"])
    assert torch.equal(a, b) and not torch.equal(a, plain)
    assert (a[6:8] == 0).all()


def _call(pack, **kw):
    args = dict(causal=False, bottom_right=False, window=(-1, -1), scale=SCALE)
    args.update(kw)
    cu_q, cu_kv = args.pop("cu_q", pack.cu_q), args.pop("cu_kv", pack.cu_kv)
    return packed_attention(pack.q, pack.k, pack.v, cu_q, cu_kv, None, None, **args)


I32 = torch.int32
BAD_CU = [
    (torch.tensor([1, 3, 9], dtype=I32), "start at 0"),
    (torch.tensor([0, 5, 4, 9], dtype=I32), "non-decreasing"),
    (torch.tensor([0, 3, 8], dtype=I32), "end at the token count 9"),
    (torch.tensor([0, 3, 9], dtype=torch.int64), "torch.int32"),
    (torch.tensor([[0, 3, 9]], dtype=I32), "shape"),
    (torch.tensor([], dtype=I32), "shape"),
]


@pytest.mark.parametrize(("cu", "rule"), BAD_CU)
def test_bad_cu_seqlens(cu, rule):
    with pytest.raises(ValueError, match=rule) as err:
        check_cu_seqlens(cu, 9, "cu_seqlens_q")
    assert "cu_seqlens_q" in str(err.value)
    pack = Pack([3, 6], [3, 6])
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        _call(pack, cu_kv=cu)


def test_good_cu_seqlens_passes():
    check_cu_seqlens(torch.tensor([0, 0, 4, 9], dtype=I32), 9, "cu_seqlens_q")


def test_bad_padded_offsets():
    pack = Pack([3, 2], [3, 2], gaps_q=[1, 1], gaps_kv=[1, 1])
    cases = [
        (dict(cu_seqlens_q_padded=torch.tensor([0, 2, 7], dtype=I32)), "only 2 rows"),
        (dict(cu_seqlens_kv_padded=torch.tensor([0, 4, 6], dtype=I32)), "end at the token"),
        (dict(cu_seqlens_q_padded=torch.tensor([0, 7], dtype=I32)), "entries"),
    ]
    for kw, rule in cases:
        full = dict(cu_seqlens_q_padded=pack.pad_q, cu_seqlens_kv_padded=pack.pad_kv)
        full.update(kw)
        with pytest.raises(ValueError, match=rule):
            _call(pack, **full)


def test_in_place_change_is_rechecked():
    """The host copy is reused only while the tensor is unmodified."""
    pack = Pack([3, 6], [4, 5])
    _call(pack)
    pack.cu_kv[1] = 10
    with pytest.raises(ValueError, match="cu_seqlens_kv must be non-decreasing"):
        _call(pack)


def test_bad_inputs_name_the_argument():
    pack = Pack([3, 6], [3, 6], h=4, hg=3)
    with pytest.raises(ValueError, match="k heads"):
        _call(pack)
    pack = Pack([3, 6], [3, 6])
    for kw, rule in [
        (dict(window=(-2, 0)), "window"),
        (dict(window=(1,)), "window"),
        (dict(dropout_p=1.0), "dropout_p"),
        (dict(backend="fast"), "backend must be one of"),
    ]:
        with pytest.raises(ValueError, match=rule):
            _call(pack, **kw)


def test_forced_backend_that_cannot_run(monkeypatch):
    pack = Pack([3, 6], [3, 6])
    with pytest.raises(NotImplementedError, match="'varlen'"):
        _call(pack, backend="varlen")
    with pytest.raises(NotImplementedError, match="dropout_p"):
        _call(pack, backend="flex", dropout_p=0.1)
    pack.q.requires_grad_()
    with pytest.raises(NotImplementedError, match="no CPU backward"):
        _call(pack, backend="flex")
    pack.q.requires_grad_(False)
    monkeypatch.setenv(packed.ENV_BACKEND, "varlen")
    with pytest.raises(NotImplementedError, match=packed.ENV_BACKEND):
        _call(pack)
    monkeypatch.setenv(packed.ENV_BACKEND, "flex")
    out = _call(pack)
    assert_close(out, _call(pack, backend="math"), torch.float32)
    monkeypatch.setenv(packed.ENV_BACKEND, "sdpa")  # a padded-format backend: choice stays here
    assert_close(_call(pack), out, torch.float32)
    monkeypatch.setenv(packed.ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match=packed.ENV_BACKEND):
        _call(pack)


# GPU: flex (compiled) and varlen in bf16. Flash and flex round the probabilities to bf16
# before multiplying by V, so errors follow the size of the terms: assert_close_to_scale.
GPU_CASES = [
    ("varlen", [5, 0, 130, 64, 1], [5, 0, 130, 64, 1], None, "causal", 64),
    ("varlen", [3, 40, 7], [9, 40, 2], None, "causal_br", 64),
    ("varlen", [33, 17], [33, 17], None, "window_br", 64),
    ("flex", LENS_Q, LENS_KV, None, "causal", 32),
    ("flex", [130, 2, 0, 61], [7, 90, 3, 61], None, "causal_br_window", 32),
    ("flex", [65, 9], [65, 20], [3, 5], "window_tl", 32),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "lens_q", "lens_kv", "gaps", "mask", "dv"), GPU_CASES)
def test_gpu_backends_bf16(backend, lens_q, lens_kv, gaps, mask, dv):
    pack = Pack(lens_q, lens_kv, gaps, gaps, h=8, hg=2, dtype=torch.bfloat16, d=64, dv=dv)
    ref_out, ref_grads = pack.reference(**MASKS[mask])
    pack.cuda()
    m = MASKS[mask]
    spec = MaskSpec(
        m["causal"], m["bottom_right"], m["window"][0], 0 if m["causal"] else m["window"][1]
    )
    if backend == "varlen" and not packed.kernels.varlen_window_ok(spec):
        with pytest.raises(NotImplementedError, match="window"):  # older torch: is_causal only
            pack.run(backend, **m)
        return
    out, grads = pack.run(backend, **MASKS[mask])
    assert out.is_cuda and out.dtype == torch.bfloat16
    assert_close_to_scale(out, ref_out, torch.bfloat16)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert_close_to_scale(g, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_auto_picks_varlen_for_plain_packs():
    pack = Pack([5, 9], [5, 9], dtype=torch.bfloat16, d=64, dv=64).cuda()
    pack.run(None, **MASKS["causal"])
    chosen = [b for key, b in packed._CHOSEN.items() if key[0] is None and key[1] == "cuda"]
    expected = "varlen" if packed.kernels.varlen_features() is not None else "flex"
    assert expected in chosen
