"""te.DotProductAttention's options: dropout and the RNG tracker, recompute, the packed (thd)
format against the padded one, backend choice, context / tensor parallel groups, the window
rule, and bad input (each a clear error naming the argument)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from dpa_reference import cu_seqlens, output_to_bshd, padding, qkv, reference
from ranks import on_ranks
from setattr_writes import set_as_torchte
from tolerances import assert_close

import torchte as te
from torchte.attention import backends
from torchte.attention import dot_product_attention as dpa_module
from torchte.distributed import CudaRNGStatesTracker

D = 16
SCALE = 0.25


def _tracker_factory(seed: int = 1234):
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed)
    return lambda: tracker


def _dropout_module(seed=1234, **kwargs):
    return te.DotProductAttention(
        4,
        D,
        2,
        attention_dropout=0.5,
        qkv_format="bshd",
        attn_mask_type="causal",
        get_rng_state_tracker=_tracker_factory(seed),
        **kwargs,
    )


def _inputs(b=2, sq=6, skv=6, h=4, hg=2, dv=D):
    return qkv(b, sq, skv, h, hg, D, dv, torch.float32)[:3]


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_follows_the_tracker(backend):
    q, k, v = _inputs()
    first, second = _dropout_module(), _dropout_module()
    tracker = first.rng_states_tracker
    before = tracker.get_states()["model-parallel-rng"]
    cpu_state = torch.get_rng_state()
    out1 = first(q, k, v, attention_backend=backend)
    out2 = second(q, k, v, attention_backend=backend)  # its own tracker, same seed
    assert torch.equal(out1, out2)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # drawn from the tracker's state
    assert not torch.equal(tracker.get_states()["model-parallel-rng"], before)  # it advanced
    again = first(q, k, v, attention_backend=backend)
    assert not torch.equal(again, out1)  # the next call draws new masks
    plain = reference(q, k, v, scale=SCALE, mask_type="causal")
    assert not torch.allclose(output_to_bshd(out1, "bshd", 4).double(), plain)
    first.eval()
    assert_close(
        output_to_bshd(first(q, k, v, attention_backend=backend), "bshd", 4), plain, torch.float32
    )


def test_dropout_without_tracker_uses_torch_rng():
    q, k, v = _inputs()
    module = te.DotProductAttention(4, D, 2, attention_dropout=0.25, qkv_format="bshd")
    torch.manual_seed(3)
    out1 = module(q, k, v, attention_backend="math")
    torch.manual_seed(3)
    assert torch.equal(module(q, k, v, attention_backend="math"), out1)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_checkpoint_core_attention_matches(backend, dropout, monkeypatch):
    """Recomputed in backward: the same output and gradients (dropout masks replayed)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return backends.run_backend(*args, **kwargs)

    monkeypatch.setattr(dpa_module, "run_backend", counted)
    results, inputs = [], _inputs()
    for recompute in (False, True):
        module = (
            _dropout_module() if dropout else te.DotProductAttention(4, D, 2, qkv_format="bshd")
        )
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        out = module(*leaves, checkpoint_core_attention=recompute, attention_backend=backend)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), [x.grad for x in leaves]))
    assert len(calls) == 3  # once plain, twice (forward and backward) recomputed
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(grad_a, grad_b)


THD_CASES = [
    ("padding", (-1, -1), False),
    ("padding_causal", (-1, 0), False),
    ("padding_causal_bottom_right", (-1, 0), False),
    ("padding", (1, 2), False),
    ("padding_causal", (2, 0), True),
]


@pytest.mark.parametrize("mask_type,window,padded", THD_CASES)
def test_thd_matches_padded_bshd(mask_type, window, padded):
    """Packed sequences (thd) give the padded (bshd) result on their tokens."""
    lens_q, lens_kv, s_q, s_kv, h, hg = [3, 5], [4, 2], 5, 4, 4, 2
    q, k, v = _inputs(b=2, sq=s_q, skv=s_kv, h=h, hg=hg)
    gap = 1 if padded else 0
    rows_q = [list(range(n)) for n in lens_q]
    rows_kv = [list(range(n)) for n in lens_kv]
    q_t = torch.cat([torch.cat([q[i, r], q.new_zeros(gap, h, D)]) for i, r in enumerate(rows_q)])
    k_t = torch.cat([torch.cat([k[i, r], k.new_zeros(gap, hg, D)]) for i, r in enumerate(rows_kv)])
    v_t = torch.cat([torch.cat([v[i, r], v.new_zeros(gap, hg, D)]) for i, r in enumerate(rows_kv)])
    kwargs = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    if padded:
        kwargs["cu_seqlens_q_padded"] = cu_seqlens([n + gap for n in lens_q])
        kwargs["cu_seqlens_kv_padded"] = cu_seqlens([n + gap for n in lens_kv])
    module = te.DotProductAttention(
        h, D, hg, qkv_format="thd", attn_mask_type=mask_type, window_size=window
    )
    out = module(q_t, k_t, v_t, **kwargs)
    assert out.shape == (q_t.shape[0], h * D)
    ref = reference(
        q,
        k,
        v,
        scale=SCALE,
        mask_type=mask_type,
        window=window,
        pad_q=padding(lens_q, s_q),
        pad_kv=padding(lens_kv, s_kv),
    )
    start = 0
    for i, n in enumerate(lens_q):
        got = out[start : start + n].view(n, h, D)
        assert_close(got, ref[i, :n], torch.float32, msg=f"sequence {i}")
        start += n + gap


def test_thd_errors():
    module = te.DotProductAttention(4, D, qkv_format="thd", attn_mask_type="padding")
    q = torch.randn(7, 4, D)
    cu = cu_seqlens([3, 4])
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_kv"):
        module(q, q, q)
    with pytest.raises(ValueError, match="padding attn_mask_type"):
        module(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="causal")
    with pytest.raises(NotImplementedError, match="core_attention_bias_type='alibi'"):
        module(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu, core_attention_bias_type="alibi")


def test_backend_forced_by_env_and_logged_once(monkeypatch, caplog):
    monkeypatch.setenv(backends.ENV_BACKEND, "math")
    monkeypatch.setattr(backends, "_CHOICES", {})
    module = te.DotProductAttention(4, D, 2, qkv_format="bshd")
    assert module.attention_backend == "math"
    q, k, v = _inputs()
    with caplog.at_level(logging.DEBUG, logger="torchte.attention"):
        module(q, k, v)
        module(q, k, v)
    chosen = [r for r in caplog.records if "backend" in r.getMessage()]
    assert len(chosen) == 1 and "'math'" in chosen[0].getMessage()
    assert list(backends._CHOICES.values()) == ["math"]
    monkeypatch.setenv(backends.ENV_BACKEND, "cudnn")
    with pytest.raises(ValueError, match="TORCHTE_ATTN_BACKEND"):
        te.DotProductAttention(4, D)


def test_auto_backend_on_cpu_is_sdpa(monkeypatch):
    monkeypatch.setattr(backends, "_CHOICES", {})
    module = te.DotProductAttention(4, D, 2, qkv_format="bshd", attention_backend="auto")
    module(*_inputs(), window_size=(2, 0))
    assert set(backends._CHOICES.values()) == {"sdpa"}


def test_forced_flex_refusals():
    q, k, v = (x.requires_grad_(True) for x in _inputs())
    module = te.DotProductAttention(4, D, 2, qkv_format="bshd", attention_backend="flex")
    with pytest.raises(NotImplementedError, match="no backward on the CPU"):
        module(q, k, v)
    dropout = te.DotProductAttention(4, D, 2, attention_dropout=0.1, qkv_format="bshd")
    with pytest.raises(NotImplementedError, match="no dropout"):
        dropout(q, k, v, attention_backend="flex")
    with pytest.raises(ValueError, match="attention_backend"):
        module(q, k, v, attention_backend="fast")


def test_autocast_computes_in_input_dtype():
    module = te.DotProductAttention(4, D, 2, qkv_format="bshd")
    q, k, v = (x.bfloat16() for x in _inputs())
    plain = module(q, k, v)
    with te.autocast(enabled=True, recipe=te.recipe.DelayedScaling()):
        inside = module(q, k, v)
    assert inside.dtype == torch.bfloat16 and torch.equal(inside, plain)


def test_tensor_parallel_heads():
    module = te.DotProductAttention(8, D, num_gqa_groups=4, tp_size=2, qkv_format="bshd")
    assert module.num_attention_heads_per_partition == 4
    assert module.num_gqa_groups_per_partition == 2
    q, k, v = _inputs(h=4, hg=2)
    assert module(q, k, v).shape == (2, 6, 4 * D)
    with pytest.raises(ValueError, match="num_gqa_groups / tp_size = 2"):
        module(*_inputs(h=4, hg=4))
    with pytest.raises(ValueError, match="tp_size"):
        te.DotProductAttention(8, D, num_gqa_groups=2, tp_size=4)


def test_context_parallel_group_of_one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        module = te.DotProductAttention(4, D, cp_group=group, cp_global_ranks=[0])
        module.set_context_parallel_group(group, [0], None, "a2a")
        assert module.cp_comm_type == "a2a"
        with pytest.raises(ValueError, match="cp_comm_type"):
            module.set_context_parallel_group(group, [0], None, "ring")
    finally:
        dist.destroy_process_group()


def _cp_rank(rank: int) -> str:
    module = te.DotProductAttention(4, D, cp_group=dist.group.WORLD)
    assert module._cp.size == 2 and module._cp.rank == rank
    try:
        te.DotProductAttention(4, D, cp_group=dist.group.WORLD, cp_comm_type="a2a+p2p")
    except NotImplementedError as error:
        return str(error)
    return "no error"


def test_context_parallel_group_of_two_ranks(tmp_path):
    """Two ranks work (tests/test_context_parallel.py); the hierarchical a2a+p2p is refused."""
    for message in on_ranks(_cp_rank, 2, tmp_path):
        assert "a2a+p2p" in message


def test_window_rule_of_transformer_engine():
    with pytest.warns(UserWarning, match="window_size should be"):
        module = te.DotProductAttention(4, D, attn_mask_type="causal", window_size=(-1, -1))
    assert module.window_size == (-1, 0)
    with pytest.warns(UserWarning, match="window_size should be"):
        module = te.DotProductAttention(4, D, attn_mask_type="no_mask", window_size=(-1, 0))
    assert module.window_size == (-1, -1)
    with pytest.raises(ValueError, match="window_size"):
        te.DotProductAttention(4, D, attn_mask_type="causal", window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size"):
        te.DotProductAttention(4, D, attn_mask_type="padding", window_size=(2, -3))
    spelled = te.DotProductAttention(4, D, attn_mask_type="causal,padding")
    assert spelled.attn_mask_type == "padding_causal"


def test_setattr_after_construction_warns_and_groups_do_not():
    module = te.DotProductAttention(4, D)
    module.set_context_parallel_group(None, None, None)
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="_fast_setattr"):
            set_as_torchte(module, "attention_dropout", 0.1)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_return_max_logit_is_the_largest_masked_logit_per_head(mask_type, fmt):
    q, k, v = _inputs(b=2, sq=5, skv=6, h=4, hg=2)
    options = dict(num_gqa_groups=2, qkv_format=fmt, attn_mask_type=mask_type)
    module = te.DotProductAttention(4, D, return_max_logit=True, **options)
    lengths = [3, 6]
    kwargs = {}
    if mask_type == "padding":
        kwargs["attention_mask"] = (padding([5, 5], 5).view(2, 1, 1, 5),
                                    padding(lengths, 6).view(2, 1, 1, 6))  # fmt: skip
    args = [x.transpose(0, 1).contiguous() if fmt == "sbhd" else x for x in (q, k, v)]
    out, max_logit = module(*args, **kwargs)
    plain = te.DotProductAttention(4, D, **options)
    assert torch.equal(out, plain(*args, **kwargs))
    # fp64 reference: [b, h, sq, skv] logits, masked, max over all but the head.
    q64, k64 = q.double().transpose(1, 2), k.double().repeat_interleave(2, dim=2).transpose(1, 2)
    logits = q64 @ k64.transpose(-1, -2) * D**-0.5
    if mask_type == "causal":
        logits = logits.masked_fill(torch.ones(5, 6, dtype=torch.bool).triu(1), float("-inf"))
    if mask_type == "padding":
        for b, n in enumerate(lengths):
            logits[b, :, :, n:] = float("-inf")
    assert max_logit.dtype == torch.float32 and max_logit.shape == (4,)
    assert_close(max_logit, logits.amax(dim=(0, 2, 3)), torch.float32)
    with pytest.raises(NotImplementedError, match="return_max_logit=True with qkv_format='thd'"):
        te.DotProductAttention(4, D, 2, qkv_format="thd", return_max_logit=True)(
            q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor([0, 6], dtype=torch.int32))  # fmt: skip


def test_not_implemented_options_are_named():
    module = te.DotProductAttention(4, D, qkv_format="bshd")
    q, k, v = _inputs(hg=4)
    with pytest.raises(NotImplementedError, match="fp8_output"):
        module(q, k, v, fp8_output=True)
    with pytest.raises(TypeError, match=r"inference_params must be a te\.InferenceParams"):
        module(q, k, v, inference_params=object())


def _bad_calls():
    q, k, v = _inputs(hg=2)
    pad = padding([4, 5], 6).view(2, 1, 1, 6)
    arbitrary = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    return [
        (dict(), dict(query_layer=q[0]), ValueError, "query_layer must be 4-D"),
        (dict(), dict(value_layer=v[..., :8]), ValueError, "value_layer must have 16"),
        (dict(), dict(key_layer=k[..., :8], value_layer=v[..., :8]), ValueError, "kv_channels"),
        (dict(), dict(key_layer=k.double()), TypeError, "key_layer must be fp32"),
        (dict(), dict(key_layer=k.bfloat16()), ValueError, "key_layer must have query_layer"),
        (dict(), dict(qkv_format="hbsd"), ValueError, "qkv_format must be one of"),
        (dict(), dict(attn_mask_type="sliding"), ValueError, "attn_mask_type must be one of"),
        (dict(num_gqa_groups=4), {}, ValueError, "num_gqa_groups / tp_size = 4"),
        (dict(attn_mask_type="padding"), {}, ValueError, "needs attention_mask"),
        (dict(attn_mask_type="padding"), dict(attention_mask=pad.int()), TypeError, "bool"),
        (
            dict(attn_mask_type="padding"),
            dict(attention_mask=pad[:, :, :, :5]),
            ValueError,
            r"\[b, 1, 1, s\]",
        ),
        (
            dict(attn_mask_type="padding"),
            dict(cu_seqlens_q=torch.tensor([0, 4, 9]), cu_seqlens_kv=cu_seqlens([4, 5])),
            ValueError,
            "cu_seqlens_q must be an int32",
        ),
        (dict(attn_mask_type="arbitrary"), {}, ValueError, "needs an attention_mask"),
        (
            dict(attn_mask_type="arbitrary"),
            dict(attention_mask=arbitrary[:, :, :5]),
            ValueError,
            r"\[b\|1, h\|1, sq, skv\]",
        ),
        (dict(), dict(max_seqlen_q=8), ValueError, "max_seqlen_q=8"),
        (
            dict(),
            dict(core_attention_bias_type="post_scale_bias"),
            ValueError,
            "core_attention_bias must be a tensor",
        ),
        (
            dict(),
            dict(
                core_attention_bias_type="post_scale_bias",
                core_attention_bias=torch.zeros(1, 3, 6, 6),
            ),
            ValueError,
            r"1\|h",
        ),
        (
            dict(),
            dict(core_attention_bias=torch.zeros(1, 4, 6, 6)),
            ValueError,
            "core_attention_bias must be None",
        ),
        (dict(), dict(alibi_slopes=torch.ones(4)), ValueError, "core_attention_bias_type='alibi'"),
        (
            dict(),
            dict(core_attention_bias_type="alibi", alibi_slopes=torch.ones(3)),
            ValueError,
            "alibi_slopes must have shape",
        ),
        (
            dict(),
            dict(core_attention_bias_type="gaussian"),
            ValueError,
            "core_attention_bias_type must be one of",
        ),
        (dict(), dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_names_the_argument(case):
    init, call, error, match = _bad_calls()[case]
    q, k, v = _inputs(hg=2)
    module_kwargs = dict(num_gqa_groups=2, qkv_format="bshd", attention_backend="math")
    module_kwargs.update(init)
    args = {"query_layer": q, "key_layer": k, "value_layer": v, **call}
    with pytest.raises(error, match=match):
        te.DotProductAttention(4, D, **module_kwargs)(**args)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_gqa_groups=3), "divisible by num_gqa_groups"),
        (dict(kv_channels=(16,)), "kv_channels"),
        (dict(attention_dropout=1.0), "attention_dropout"),
        (dict(attention_type="both"), "attention_type"),
        (dict(cp_comm_type="ring"), "cp_comm_type"),
        (dict(softmax_type="sparse"), "softmax_type"),
        (dict(attention_backend="cudnn"), "attention_backend"),
    ],
)
def test_bad_construction_names_the_argument(kwargs, match):
    kwargs = dict(dict(num_attention_heads=4, kv_channels=D), **kwargs)
    with pytest.raises(ValueError, match=match):
        te.DotProductAttention(**kwargs)


def test_flex_compile_failure_falls_back_per_signature(monkeypatch):
    """A compile failure (inductor finding no kernel) runs those shapes eagerly, said once."""
    import warnings

    from torch._inductor.exc import InductorError
    from torch.nn.attention.flex_attention import flex_attention

    from torchte.attention import _flex

    def failing(*args, **kwargs):
        raise InductorError(RuntimeError("no choices"), "traceback")

    real_compile = torch.compile  # eager flex_attention compiles helpers of its own

    def compile_failing(fn, **kw):
        return failing if fn is flex_attention else real_compile(fn, **kw)

    monkeypatch.setattr(torch, "compile", compile_failing)
    monkeypatch.setattr(_flex, "_EAGER_SIGNATURES", set())
    _flex.flex_function.cache_clear()
    try:
        run = _flex.flex_function("cuda")  # the compiled path, here on CPU tensors
        q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
        with pytest.warns(UserWarning, match="compiling flex_attention failed"):
            out = run(q, k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message="flex_attention called without")
            again = run(q, k, v)  # no second warning for the same shapes
        want = flex_attention(q, k, v)
        assert torch.equal(out, want) and torch.equal(again, want)
    finally:
        _flex.flex_function.cache_clear()
