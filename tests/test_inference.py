"""te.InferenceParams (the non-paged KV cache): generation step by step (a prefill of several
tokens, then one token at a time, sequences of different lengths finishing and joining, the
batch reordered) equals the whole sequence run without the cache, for te.DotProductAttention
(against an fp64 reference), te.MultiheadAttention with RoPE and te.TransformerLayer (against
the same module run on whole sequences), in sbhd, bshd and thd; bad input raises naming it.

Legend: L a sequence's full length, h query heads, hg key/value heads, d head size.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from attention_reference import set_representable
from dpa_reference import reference
from tolerances import assert_close, representable

import torchte as te

pytestmark = pytest.mark.usefixtures("cpu_default_device")

F32 = torch.float32
H, HG, D = 4, 2, 8
HIDDEN, FFN = 32, 48
MAX_B, MAX_S = 4, 12
FORMATS = ("sbhd", "bshd", "thd")

# seq id -> (full length, prefill length, step it joins at)
SEQUENCES = {0: (6, 3, 0), 1: (4, 1, 0), 2: (7, 4, 0), 3: (5, 2, 2)}


def schedule() -> list[OrderedDict]:
    """The step_dicts of a generation: each sequence joins with its prefill, then grows one
    token a step until its full length; odd steps list the batch in reverse id order (the
    cache reorders its rows)."""
    done = dict.fromkeys(SEQUENCES, 0)
    steps = []
    for t in range(20):
        active = [s for s, (full, _, join) in SEQUENCES.items() if join <= t and done[s] < full]
        if not active:
            break
        order = active if t % 2 == 0 else active[::-1]
        step = OrderedDict((s, SEQUENCES[s][1] if done[s] == 0 else 1) for s in order)
        for s, n in step.items():
            done[s] += n
        steps.append(step)
    return steps


def step_input(full: dict, step: OrderedDict, pre: dict, fmt: str) -> torch.Tensor:
    """The step's new tokens of per-sequence tensors full[s] (L, ...): thd packs them, bshd
    pads each row at its end to the longest (sbhd: transposed)."""
    parts = [full[s][pre[s] : pre[s] + n] for s, n in step.items()]
    if fmt == "thd":
        return torch.cat(parts)
    longest = max(step.values())
    out = parts[0].new_zeros(len(parts), longest, *parts[0].shape[1:])
    for i, part in enumerate(parts):
        out[i, : part.shape[0]] = part
    return out.transpose(0, 1).contiguous() if fmt == "sbhd" else out


def step_rows(out: torch.Tensor, step: OrderedDict, fmt: str) -> list[torch.Tensor]:
    """Each sequence's rows (n, features) of the step's output."""
    rows, start = [], 0
    for i, n in enumerate(step.values()):
        if fmt == "thd":
            rows.append(out[start : start + n])
        else:
            rows.append(out[:n, i] if fmt == "sbhd" else out[i, :n])
        start += n
    return rows


def generate(run, full: dict, fmt: str, params: te.InferenceParams, n_inputs: int = 1):
    """{seq: [(position, output rows)]} of a generation with the cache; run(*inputs) is one
    step's forward. full[s] is a tuple of n_inputs tensors (L, ...)."""
    pre, got = dict.fromkeys(full, 0), {s: [] for s in full}
    for step in schedule():
        params.pre_step(step)
        inputs = [
            step_input({s: full[s][i] for s in full}, step, pre, fmt) for i in range(n_inputs)
        ]
        out = run(*inputs)
        for (s, n), rows in zip(step.items(), step_rows(out, step, fmt), strict=True):
            got[s].append((pre[s], rows))
            pre[s] += n
    assert all(pre[s] == SEQUENCES[s][0] for s in SEQUENCES)
    return got


def compare(got: dict, expected: dict, dtype) -> None:
    """Each step's rows against the rows of the whole-sequence output at their positions."""
    for s, pieces in got.items():
        for position, rows in pieces:
            assert_close(rows, expected[s][position : position + rows.shape[0]], dtype)


def cache(fmt: str = "bshd", hg: int = HG, **kw) -> te.InferenceParams:
    return te.InferenceParams(
        MAX_B, MAX_S, num_heads_kv=hg, head_dim_k=D, dtype=F32, qkv_format=fmt, **kw
    )


# -- te.DotProductAttention ---------------------------------------------------------------------


def _dpa_generation(fmt: str, hg: int, device: str) -> None:
    """te.DotProductAttention's generation on `device` against the fp64 reference (CPU)."""
    full = {
        s: tuple(representable((n, heads, D), F32) for heads in (H, hg, hg))
        for s, (n, _, _) in SEQUENCES.items()
    }
    dpa = te.DotProductAttention(
        H, D, num_gqa_groups=hg, attention_dropout=0.0, qkv_format=fmt,
        attn_mask_type="padding_causal", layer_number=3,
    )  # fmt: skip
    params = cache(fmt, hg, device=device)
    params.allocate_memory(3)
    on_device = {s: tuple(x.to(device) for x in xs) for s, xs in full.items()}
    got = generate(lambda *qkv: dpa(*qkv, inference_params=params), on_device, fmt, params, 3)
    expected = {
        s: reference(*(x.unsqueeze(0) for x in full[s]), scale=D**-0.5, mask_type="causal").reshape(
            SEQUENCES[s][0], -1
        )
        for s in full
    }
    compare(got, expected, F32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hg", [HG, H], ids=["gqa", "mha"])
def test_dpa_generation_equals_fp64_reference(fmt, hg):
    _dpa_generation(fmt, hg, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_dpa_generation_on_cuda_equals_fp64_reference(fmt):
    _dpa_generation(fmt, HG, "cuda")


def test_prefill_of_whole_sequences_same_bits_as_uncached_padding_causal():
    lengths = [5, 3, 4]
    q, k, v = (representable((3, 5, heads, D), F32) for heads in (H, HG, HG))
    dpa = te.DotProductAttention(
        H, D, num_gqa_groups=HG, attention_dropout=0.0, qkv_format="bshd",
        attn_mask_type="padding_causal", layer_number=1,
    )  # fmt: skip
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    uncached = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    params = cache()
    params.allocate_memory(1)
    params.pre_step(OrderedDict(enumerate(lengths)))
    cached = dpa(q, k, v, inference_params=params)
    assert torch.equal(cached, uncached)


def test_padded_batch_rows_give_zeros_and_leave_the_cache():
    """A batch padded to max_batch_size (as for CUDA graphs): the extra rows are zeros."""
    q, k, v = (representable((MAX_B, 2, heads, D), F32) for heads in (H, HG, HG))
    dpa = te.DotProductAttention(
        H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="padding_causal",
        layer_number=1, attention_dropout=0.0,
    )  # fmt: skip
    params = cache()
    params.allocate_memory(1)
    params.pre_step(OrderedDict([(10, 2), (11, 1)]))
    out = dpa(q, k, v, inference_params=params)
    assert out.shape == (MAX_B, 2, H * D)
    assert torch.equal(out[2:], torch.zeros_like(out[2:])) and out[:2].abs().sum() > 0
    assert torch.equal(out[1, 1:], torch.zeros_like(out[1, 1:]))
    k_cache, _ = params.cache_manager.cache[1]
    assert torch.equal(k_cache[0, :2], k[0]) and torch.equal(k_cache[1, :1], k[1, :1])
    assert torch.equal(k_cache[1, 1:], torch.zeros_like(k_cache[1, 1:]))


def test_step_bookkeeping_as_transformer_engine():
    params = cache("thd", max_ctx_len=4)
    params.allocate_memory(1)
    params.pre_step(OrderedDict([(5, 3), (6, 2)]))
    params.pre_step(OrderedDict([(6, 1), (5, 1), (7, 4)]))
    assert params.sequences == OrderedDict([(6, 3), (5, 4), (7, 4)])
    assert params.sequences_pre_step == OrderedDict([(6, 2), (5, 3), (7, 0)])
    assert params.batch_size == 3
    assert params.get_seqlens_pre_step().tolist() == [2, 3, 0, 0]
    assert params.cu_seqlens_q.tolist() == [0, 1, 2, 6, 6]
    assert params.cu_seqlens_kv.tolist() == [0, 3, 7, 11, 11]
    new_k = representable((6, HG, D), F32)
    k_cache, v_cache, cu_q, cu_kv, max_kv, fmt = params.step(1, new_k, new_k.clone(), "thd")
    assert k_cache.shape == (3, MAX_S, HG, D) and max_kv == MAX_S and fmt == "thd_2bshd"
    assert cu_q is params.cu_seqlens_q and cu_kv is params.cu_seqlens_kv
    assert torch.equal(k_cache[0, 2], new_k[0]) and torch.equal(k_cache[2, :4], new_k[2:6])
    assert torch.equal(v_cache[1, 3], new_k[1])
    params.reset()
    assert params.sequences == OrderedDict() and params.batch_size == 0
    assert "max_batch_size=4" in repr(params)


def test_cache_rows_follow_the_batch_order():
    params = cache()
    params.allocate_memory(1)
    k0 = representable((3, 2, HG, D), F32)
    params.pre_step(OrderedDict([(0, 2), (1, 2), (2, 2)]))
    params.step(1, k0, k0, "bshd")
    params.pre_step(OrderedDict([(2, 1), (0, 1)]))  # 1 finished; 2 and 0 swap rows
    k_cache, _ = params.cache_manager.cache[1]
    assert torch.equal(k_cache[0, :2], k0[2]) and torch.equal(k_cache[1, :2], k0[0])


# -- te.MultiheadAttention and te.TransformerLayer ----------------------------------------------


def _freqs():
    return te.RotaryPositionEmbedding(D)(MAX_S)


def _whole(module, x: torch.Tensor, fmt: str, **kwargs) -> torch.Tensor:
    """module on one whole sequence x (L, HIDDEN) without the cache -> (L, HIDDEN)."""
    n = x.shape[0]
    if fmt == "thd":
        cu = torch.tensor([0, n], dtype=torch.int32)
        return module(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, **kwargs)
    batch = x.unsqueeze(1) if fmt == "sbhd" else x.unsqueeze(0)
    out = module(batch, **kwargs)
    return out[:, 0] if fmt == "sbhd" else out[0]


def _step_kwargs(params, fmt: str) -> dict:
    if fmt != "thd":
        return {}
    cu = params.cu_seqlens_q[: params.batch_size + 1]
    return {"cu_seqlens_q": cu, "cu_seqlens_kv": cu}


@pytest.mark.parametrize("fmt", FORMATS)
def test_mha_with_rope_generation_equals_whole_sequences(fmt):
    mha = te.MultiheadAttention(
        HIDDEN, H, kv_channels=D, num_gqa_groups=HG, attention_dropout=0.0, layer_number=1,
        attn_mask_type="padding_causal", qkv_format=fmt, input_layernorm=True,
        params_dtype=F32,
    )  # fmt: skip
    set_representable(mha, F32, scale=0.125)
    freqs = _freqs()
    full = {s: (representable((n, HIDDEN), F32),) for s, (n, _, _) in SEQUENCES.items()}
    mask = "padding_causal" if fmt == "thd" else "causal"
    with torch.no_grad():
        expected = {
            s: _whole(mha, x, fmt, rotary_pos_emb=freqs, attn_mask_type=mask)
            for s, (x,) in full.items()
        }
        params = cache(fmt)

        def run(x):
            return mha(
                x, rotary_pos_emb=freqs, inference_params=params, **_step_kwargs(params, fmt)
            )

        got = generate(run, full, fmt, params)
    assert list(params.cache_manager.cache) == [1]  # allocated by the module
    compare(got, expected, F32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformer_layers_generation_equals_whole_sequences(fmt):
    kw = dict(num_gqa_groups=HG, kv_channels=D, hidden_dropout=0.0, attention_dropout=0.0)
    kw.update(self_attn_mask_type="padding_causal", attn_input_format=fmt, params_dtype=F32)
    layers = [te.TransformerLayer(HIDDEN, FFN, H, layer_number=n, **kw) for n in (1, 2)]
    for layer in layers:
        set_representable(layer, F32, scale=0.125)
    freqs = _freqs()
    full = {s: (representable((n, HIDDEN), F32),) for s, (n, _, _) in SEQUENCES.items()}
    mask = "padding_causal" if fmt == "thd" else "causal"

    def whole(x):
        for layer in layers:
            x = _whole(layer, x, fmt, rotary_pos_emb=freqs, self_attn_mask_type=mask)
        return x

    with torch.no_grad():
        expected = {s: whole(x) for s, (x,) in full.items()}
        params = cache(fmt)

        def run(x):
            for layer in layers:
                kwargs = _step_kwargs(params, fmt)
                x = layer(x, rotary_pos_emb=freqs, inference_params=params, **kwargs)
            return x

        got = generate(run, full, fmt, params)
    assert sorted(params.cache_manager.cache) == [1, 2]
    compare(got, expected, F32)


# -- bad input --------------------------------------------------------------------------------


def _dpa(**kw):
    kw.setdefault("layer_number", 1)
    return te.DotProductAttention(
        H, D, num_gqa_groups=HG, qkv_format="bshd", attn_mask_type="padding_causal", **kw
    )


def _qkv(b=2, s=3, hg=HG):
    return [representable((b, s, heads, D), F32) for heads in (H, hg, hg)]


def test_constructor_errors_name_the_argument():
    with pytest.raises(NotImplementedError, match="is_paged"):
        te.InferenceParams(2, 8, 2, 8, F32, is_paged=True, page_size=4, total_num_pages=4)
    with pytest.raises(NotImplementedError, match="custom_cache_manager"):
        te.InferenceParams(2, 8, 2, 8, F32, custom_cache_manager=object)
    with pytest.raises(ValueError, match="num_heads_kv"):
        te.InferenceParams(2, 8, head_dim_k=8, dtype=F32)
    with pytest.raises(ValueError, match="dtype"):
        te.InferenceParams(2, 8, 2, 8, torch.int32)
    with pytest.raises(ValueError, match="qkv_format"):
        te.InferenceParams(2, 8, 2, 8, F32, qkv_format="bhsd")
    with pytest.raises(ValueError, match="max_ctx_len"):
        te.InferenceParams(2, 8, 2, 8, F32, max_ctx_len=9)


def test_pre_step_beyond_limits_raises_and_changes_nothing():
    params = cache()
    params.pre_step(OrderedDict([(0, 10)]))
    with pytest.raises(ValueError, match="max_sequence_length=12"):
        params.pre_step(OrderedDict([(0, 3)]))
    with pytest.raises(ValueError, match="max_batch_size=4"):
        params.pre_step(OrderedDict((i, 1) for i in range(5)))
    with pytest.raises(ValueError, match=r"step_dict\[0\]"):
        params.pre_step(OrderedDict([(0, 0)]))
    assert params.sequences == OrderedDict([(0, 10)])
    params.pre_step(OrderedDict([(0, 2)]))
    assert params.sequences == OrderedDict([(0, 12)])


def test_forward_errors_name_the_argument():
    params = cache()
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="InferenceParams"):
        _dpa()(q, k, v, inference_params=object())
    with pytest.raises(ValueError, match="layer_number"):
        te.DotProductAttention(H, D, num_gqa_groups=HG, qkv_format="bshd")(
            q, k, v, inference_params=params
        )
    with pytest.raises(ValueError, match="allocate_memory"):
        _dpa()(q, k, v, inference_params=params)
    params.allocate_memory(1)
    with pytest.raises(ValueError, match="pre_step"):
        _dpa()(q, k, v, inference_params=params)
    params.pre_step(OrderedDict([(0, 3), (1, 2), (2, 1)]))
    with pytest.raises(ValueError, match="3 sequences"):
        _dpa()(q, k, v, inference_params=params)
    with pytest.raises(ValueError, match="max_batch_size=4"):
        _dpa()(*_qkv(b=5), inference_params=params)
    with pytest.raises(ValueError, match="longest, 3"):
        _dpa()(*_qkv(b=3, s=2), inference_params=params)
    with pytest.raises(ValueError, match="num_heads_kv=2"):
        te.DotProductAttention(H, D, qkv_format="bshd", layer_number=1)(
            *_qkv(b=3, hg=H), inference_params=params
        )
    with pytest.raises(ValueError, match="arbitrary"):
        _dpa()(*_qkv(b=3), attn_mask_type="arbitrary", inference_params=params)
    with pytest.raises(NotImplementedError, match="core_attention_bias_type='alibi'"):
        _dpa()(*_qkv(b=3), core_attention_bias_type="alibi", inference_params=params)


def test_mha_errors_name_the_argument():
    params = cache()
    params.pre_step(OrderedDict([(0, 2)]))
    x = representable((1, 2, HIDDEN), F32)
    kw = dict(kv_channels=D, num_gqa_groups=HG, qkv_format="bshd", params_dtype=F32)
    with pytest.raises(ValueError, match="layer_number"):
        te.MultiheadAttention(HIDDEN, H, **kw)(x, inference_params=params)
    with pytest.raises(TypeError, match="InferenceParams"):
        te.MultiheadAttention(HIDDEN, H, layer_number=1, **kw)(x, inference_params=object())
