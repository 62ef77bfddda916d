"""Context parallelism in te.DotProductAttention (torchte/distributed/context_parallel.py):
each rank holds the load-balanced split of every sequence (chunks r and 2 cp - 1 - r of 2 cp)
and the output and q / k / v gradients equal the one-rank module's on the whole sequences, cut
the same way: every cp_comm_type ("p2p", "all_gather", "a2a") x mask (causal, no_mask; thd's
padding_causal and padding with unequal, padded sequences) x format (bshd, sbhd, thd) x GQA on
and off, in fp32 within fp32's tolerance; bf16 on one config per comm type. Two gloo ranks run
every config in one spawn, four ranks a few; a gpu-marked NCCL variant runs bf16 with the flash
kernels. Bad calls raise before any collective.

Legend: S whole sequence, B batch, H heads, G key/value heads, D head size; thd sequences of
REAL tokens padded to PADDED (multiples of 2 cp).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import each_config, on_ranks
from tolerances import assert_close, tolerance

import torchte as te
from torchte import _collectives as collectives
from torchte.distributed import context_parallel as cpar
from torchte.distributed.context_parallel_ring import flash_ok

S, B, H, D = 16, 2, 4, 8
COMMS = ("p2p", "all_gather", "a2a")
FORMATS = ("bshd", "sbhd", "thd")


def _thd_lengths(cp: int) -> tuple[list[int], list[int]]:
    """(real, padded) lengths of three packed sequences, padded to multiples of 2 cp."""
    real = [2 * cp, 3, 4 * cp - 3]
    padded = [-(-n // (2 * cp)) * 2 * cp for n in real]
    return real, padded


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


def _inputs(fmt, groups, dtype, device, cp, heads=H):
    """Whole q, k, v, dout and the call's keyword arguments (thd: cu_seqlens)."""
    gen = torch.Generator().manual_seed(7)
    kwargs, seq_dim = {}, {"bshd": 1, "sbhd": 0, "thd": 0}[fmt]
    if fmt == "thd":
        real, padded = _thd_lengths(cp)
        rows = (sum(padded),)
        kwargs = {
            "cu_seqlens_q": _cu(real, device),
            "cu_seqlens_kv": _cu(real, device),
            "cu_seqlens_q_padded": _cu(padded, device),
            "cu_seqlens_kv_padded": _cu(padded, device),
        }
    else:
        rows = (B, S * cp // 2) if fmt == "bshd" else (S * cp // 2, B)

    def make(heads):
        return torch.randn(*rows, heads, D, generator=gen).to(device, dtype)

    q, k, v = make(heads), make(groups), make(groups)
    dout = torch.randn(*rows, heads * D, generator=gen).to(device, dtype)
    return (q, k, v, dout), kwargs, seq_dim


def _run(module, q, k, v, dout, kwargs):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, **kwargs)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _check(comm, fmt, causal, gqa, dtype=torch.float32, device="cpu") -> None:
    """The cp module's output and gradients == the one-rank module's, cut for this rank."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    groups = H // 2 if gqa else H
    mask = ("padding_causal" if causal else "padding") if fmt == "thd" else None
    mask = mask or ("causal" if causal else "no_mask")
    options = dict(num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask)
    (q, k, v, dout), kwargs, seq_dim = _inputs(fmt, groups, dtype, device, cp)
    ref = te.DotProductAttention(H, D, **options).to(device)
    want = _run(ref, q, k, v, dout, kwargs)
    module = te.DotProductAttention(H, D, cp_group=dist.group.WORLD, cp_comm_type=comm, **options)
    pad = kwargs.get("cu_seqlens_q_padded")

    def cut(x):
        return cpar.split_for_cp_rank(x, cp, rank, seq_dim, pad)

    got = _run(module.to(device), *(cut(x) for x in (q, k, v, dout)), kwargs)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        label = f"{name} ({comm}, {fmt}, causal={causal}, gqa={gqa}, {dtype})"
        assert g.dtype == dtype, f"{label}: dtype {g.dtype}"
        if dtype == torch.float32:
            assert_close(g, cut(w), dtype, label)
        else:
            _assert_norm_close(g, cut(w), dtype, label)


def _assert_norm_close(got, want, dtype, label) -> None:
    """||got - want|| <= rtol ||want|| + atol sqrt(n) with dtype's (rtol, atol): the ranks
    round partial results (blocks, prefixes) that one rank rounds at other points."""
    rtol, atol = tolerance(dtype)
    error = (got.double() - want.double()).norm()
    bound = rtol * want.double().norm() + atol * want.numel() ** 0.5
    assert error <= bound, f"{label}: error {error:.3g} > {bound:.3g}"


def _all_configs() -> list[tuple]:
    configs = [
        (comm, fmt, causal, gqa)
        for comm in COMMS
        for fmt in FORMATS
        for causal in (True, False)
        for gqa in (False, True)
    ]
    configs += [(comm, "bshd", True, True, torch.bfloat16) for comm in COMMS]
    return configs


def _check_mha(comm: str, fmt: str) -> None:
    """te.MultiheadAttention with RoPE after set_context_parallel_group == the one-rank layer
    on the whole sequences (output, input and weight gradients, the latter summed over the
    ranks)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    hidden, seq_dim, s = H * D, fmt.index("s"), S * cp // 2
    options = dict(attention_dropout=0.0, num_gqa_groups=H // 2, qkv_format=fmt)
    options["input_layernorm"] = True
    torch.manual_seed(3)  # the same weights on every rank
    ref = te.MultiheadAttention(hidden, H, **options)
    module = te.MultiheadAttention(hidden, H, **options)
    module.load_state_dict(ref.state_dict())
    module.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, comm)
    freqs = te.attention.RotaryPositionEmbedding(D)(s)
    gen = torch.Generator().manual_seed(11)
    shape = (s, B, hidden) if fmt == "sbhd" else (B, s, hidden)
    x, dy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)

    def run(layer, x, dy):
        x = x.clone().requires_grad_()
        y = layer(x, rotary_pos_emb=freqs)
        y.backward(dy)
        return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}

    y_ref, dx_ref, grads_ref = run(ref, x, dy)
    y, dx, grads = run(module, *(cpar.split_for_cp_rank(t, cp, rank, seq_dim) for t in (x, dy)))
    for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref)):
        assert_close(got, cpar.split_for_cp_rank(want, cp, rank, seq_dim), torch.float32, name)
    for name, grad in grads.items():
        dist.all_reduce(grad)
        _assert_norm_close(grad, grads_ref[name], torch.float32, f"d{name}")


def _two_ranks(rank: int) -> dict:
    outcome = each_config(_check, _all_configs())
    mha = [(comm, fmt) for comm in COMMS for fmt in ("sbhd", "bshd")]
    return {**outcome, **each_config(_check_mha, mha, named=True)}


def _four_ranks(rank: int) -> dict:
    configs = [(comm, fmt, True, False) for comm in COMMS for fmt in ("sbhd", "thd")]
    configs += [("p2p", "bshd", False, True), ("all_gather", "thd", False, True)]
    return each_config(_check, configs)


def _assert_ok(outcomes: list[dict]) -> None:
    failed = [f"{c}: {t}" for outcome in outcomes for c, t in outcome.items() if t != "ok"]
    assert not failed, "\n".join(failed)


def test_context_parallel_two_ranks(tmp_path):
    _assert_ok(on_ranks(_two_ranks, 2, tmp_path))


def test_context_parallel_four_ranks(tmp_path):
    _assert_ok(on_ranks(_four_ranks, 4, tmp_path))


def _nccl_ranks(rank: int) -> dict:
    """bf16 on the rank's GPU, the ring on the flash kernels (asserted), vs one rank."""
    device = torch.device("cuda", rank)
    q = torch.zeros(1, 2, H, D, dtype=torch.bfloat16, device=device)
    assert flash_ok(q, D, packed=False), "the ring would not run the flash kernels"
    configs = [
        (comm, fmt, causal, gqa, torch.bfloat16, device)
        for comm in COMMS
        for fmt in FORMATS
        for causal in (True, False)
        for gqa in (False, True)
    ]
    return each_config(_check, configs)


@pytest.mark.gpu
def test_context_parallel_nccl_bf16(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (torch.cuda.device_count() is {torch.cuda.device_count()})")
    _assert_ok(on_ranks(_nccl_ranks, 2, tmp_path, backend="nccl"))


# ---- bad calls raise before any collective ---------------------------------------------------


def _refused(fmt, build, forward, match, heads=H, odd=False, bad_pad=False) -> None:
    """A call of the cp module with these options raises an error containing `match`, and no
    collective of torchte was reached."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    reached = []
    saved = {name: getattr(collectives, name) for name in ("send_recv", "all_to_all_rows")}
    saved["gather_rows"] = collectives.gather_rows

    def refuse(*args, **kwargs):
        reached.append(args)
        raise AssertionError("a collective was reached")

    for name in saved:
        setattr(collectives, name, refuse)
    try:
        groups = build.pop("num_gqa_groups", heads)
        (q, k, v, _), kwargs, seq_dim = _inputs(fmt, groups, torch.float32, "cpu", cp, heads)
        pad = kwargs.get("cu_seqlens_q_padded")
        if bad_pad:  # a sequence of 6 tokens: not a multiple of 2 cp
            kwargs = {key: _cu([6, 2 * cp], "cpu") for key in kwargs}
        q, k, v = (cpar.split_for_cp_rank(x, cp, rank, seq_dim, pad) for x in (q, k, v))
        if odd:
            q, k, v = (x.narrow(seq_dim, 0, x.shape[seq_dim] - 1) for x in (q, k, v))
        with pytest.raises((NotImplementedError, ValueError), match=match):
            module = te.DotProductAttention(
                heads, D, num_gqa_groups=groups, qkv_format=fmt, cp_group=dist.group.WORLD,
                **build,
            )  # fmt: skip
            module(q, k, v, **{**kwargs, **forward})
    finally:
        for name, fn in saved.items():
            setattr(collectives, name, fn)
    assert reached == []


REFUSED = [
    ("bshd", {"cp_comm_type": "a2a"}, {}, "divisible by cp_size", 3),
    ("bshd", {"cp_comm_type": "a2a", "num_gqa_groups": 1}, {}, "num_gqa_groups 1", 4),
    ("bshd", {"cp_comm_type": "p2p"}, {}, "divisible by 2 \\* cp_size", H, True),
    ("sbhd", {"cp_comm_type": "all_gather"}, {}, "divisible by 2 \\* cp_size", H, True),
    ("thd", {"attn_mask_type": "padding_causal"}, {}, "multiple of 2 \\* cp_size", H, False, True),
    ("bshd", {"attention_dropout": 0.5}, {}, "dropout with cp_comm_type='p2p'"),
    ("bshd", {"cp_comm_type": "all_gather", "window_size": (2, 0)}, {}, "sliding window"),
    ("bshd", {}, {"core_attention_bias_type": "alibi"}, "alibi"),
    ("bshd", {"return_max_logit": True}, {}, "return_max_logit"),
    ("bshd", {"softmax_type": "off-by-one"}, {}, "softmax_type"),
    ("bshd", {"attn_mask_type": "padding_causal"}, {}, "attn_mask_type"),
    ("thd", {"attn_mask_type": "padding_causal"}, {"cu_seqlens_kv": None}, "cu_seqlens"),
    ("bshd", {"cp_comm_type": "a2a+p2p"}, {}, "a2a\\+p2p"),
]


def _refused_case(index: int) -> None:
    fmt, build, forward, match, *rest = REFUSED[index]
    _refused(fmt, dict(build), forward, match, *rest)


def _refusals(rank: int) -> dict:
    return each_config(_refused_case, [(i,) for i in range(len(REFUSED))])


def test_context_parallel_refusals_reach_no_collective(tmp_path):
    _assert_ok(on_ranks(_refusals, 2, tmp_path))
