"""Misplaced arguments refused with a message that says what to do instead.

- A recipe where a flag goes (te.autocast's `enabled`, a module's `bias` or `eps`, a forward's
  `is_first_microbatch`), and the keywords of te.fp8_autocast given to te.autocast (and the
  reverse): TypeError naming the keyword to use.
- An input of the wrong layout at the entry of te.TransformerLayer / te.MultiheadAttention:
  ValueError naming the layout their qkv format expects.
- make_graphed_callables without a GPU: a UserWarning, once per process, that nothing is
  captured.
- FP8 GEMM shapes: on the CPU the rule torch._scaled_mm applies on a GPU (K and N multiples of
  16, M free), checked here against torch's own GPU shape rule (its meta kernel, which applies
  the CUDA rule to meta tensors).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torchte as te
from torchte import graphs
from torchte.autocast import autocast_state
from torchte.gemm import fp8_gemm
from torchte.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

E4M3 = torch.float8_e4m3fn
RECIPES = [DelayedScaling(), Float8CurrentScaling()]


def assert_no_region_open() -> None:
    state = autocast_state()
    assert (state.enabled, state.depth) == (False, 0)


# -- te.autocast / te.fp8_autocast ----------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_autocast_refuses_a_recipe_given_positionally(recipe):
    message = "te.autocast got a recipe as `enabled`; pass it as recipe=..."
    with pytest.raises(TypeError, match=re.escape(message)):
        te.autocast(recipe)
    with pytest.raises(TypeError, match=re.escape("got a recipe as `calibrating`")):
        te.autocast(True, recipe)
    assert_no_region_open()


def test_autocast_names_the_keyword_for_fp8_autocasts_names():
    with pytest.raises(TypeError, match=re.escape("use recipe= (or te.fp8_autocast)")):
        te.autocast(fp8_recipe=Float8CurrentScaling())
    with pytest.raises(
        TypeError, match=re.escape("use amax_reduction_group= (or te.fp8_autocast)")
    ):
        te.autocast(fp8_group=None)
    with pytest.raises(
        TypeError, match=re.escape("te.autocast got an unexpected keyword argument 'recipes'")
    ):
        te.autocast(recipes=DelayedScaling())
    assert_no_region_open()


def test_fp8_autocast_refuses_autocasts_names_and_a_positional_recipe():
    with pytest.raises(TypeError, match=re.escape("use fp8_recipe= (or te.autocast)")):
        te.fp8_autocast(recipe=Float8CurrentScaling())
    with pytest.raises(TypeError, match=re.escape("use fp8_group= (or te.autocast)")):
        te.fp8_autocast(amax_reduction_group=None)
    message = "te.fp8_autocast got a recipe as `enabled`; pass it as fp8_recipe=..."
    with pytest.raises(TypeError, match=re.escape(message)):
        te.fp8_autocast(Float8CurrentScaling())
    assert_no_region_open()


def test_both_region_functions_still_take_their_own_arguments():
    recipe = Float8CurrentScaling()
    state = autocast_state()
    with te.fp8_autocast(True, False, recipe, None, False):
        assert state.enabled and state.recipe == recipe
    with te.fp8_autocast(fp8_recipe=recipe, fp8_group=None):
        assert state.recipe == recipe
    with te.autocast(True, False, recipe, None):
        assert state.recipe == recipe
    with te.autocast(enabled=False, calibrating=True, recipe=recipe, amax_reduction_group=None):
        assert (state.enabled, state.calibrating) == (False, True)
    assert_no_region_open()


# -- modules: constructors and forward ------------------------------------------------------------


@pytest.mark.parametrize(
    "build, name",
    [
        (lambda r: te.Linear(32, 16, r), "te.Linear got a recipe as `bias`"),
        (lambda r: te.Linear(32, 16, return_bias=r), "te.Linear got a recipe as `return_bias`"),
        (lambda r: te.LayerNormLinear(32, 16, r), "te.LayerNormLinear got a recipe as `eps`"),
        (lambda r: te.LayerNormLinear(32, 16, bias=r), "te.LayerNormLinear got a recipe as `bias`"),
        (lambda r: te.LayerNormMLP(32, 64, r), "te.LayerNormMLP got a recipe as `eps`"),
        (lambda r: te.LayerNormMLP(32, 64, checkpoint=r), "recipe as `checkpoint`"),
        (
            lambda r: te.GroupedLinear(2, 32, 16, r),
            "te.GroupedLinear got a recipe as `sequence_parallel`",
        ),
        (lambda r: te.GroupedLinear(2, 32, 16, bias=r), "te.GroupedLinear got a recipe as `bias`"),
    ],
)
def test_module_constructors_refuse_a_recipe_in_a_flag(build, name):
    with pytest.raises(TypeError, match=re.escape(f"{name}; a recipe goes to te.autocast(")):
        build(DelayedScaling())


def _call(module, x, flag):
    """module(x, ...) with `flag` where is_first_microbatch goes positionally."""
    if isinstance(module, te.GroupedLinear):
        return module(x, [3, 5], flag)
    return module(x, flag)


MODULES = {
    "Linear": lambda: te.Linear(32, 16),
    "LayerNormLinear": lambda: te.LayerNormLinear(32, 16),
    "LayerNormMLP": lambda: te.LayerNormMLP(32, 64),
    "GroupedLinear": lambda: te.GroupedLinear(2, 32, 16),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["outside-autocast", "fp8"])
@pytest.mark.parametrize("name", MODULES)
def test_forward_refuses_a_recipe_as_is_first_microbatch(name, fp8):
    module, x = MODULES[name](), torch.randn(8, 32)
    message = f"te.{name}.forward got a recipe as `is_first_microbatch`; a recipe goes to"
    with te.autocast(enabled=fp8), pytest.raises(TypeError, match=re.escape(message)):
        _call(module, x, Float8CurrentScaling())
    for flag in (None, True, False):  # what the flag takes still runs
        with te.autocast(enabled=fp8):
            out = _call(module, x, flag)
        assert out.shape == (8, 16 if name != "LayerNormMLP" else 32)


# -- input layout at the entry of the attention layers --------------------------------------------


@pytest.mark.parametrize(
    "fmt, bad, expected",
    [
        ("sbhd", (16, 64), "hidden_states must be 3-D [seq, batch, hidden]"),
        ("sbhd", (16, 2, 32), "hidden_states must be 3-D [seq, batch, hidden]"),
        ("bshd", (2, 16), "hidden_states must be 3-D [batch, seq, hidden]"),
        ("thd", (16, 2, 64), "hidden_states must be 2-D [tokens, hidden]"),
    ],
)
def test_transformer_layer_names_the_layout_its_input_needs(fmt, bad, expected):
    layer = te.TransformerLayer(64, 256, 4, attn_input_format=fmt)
    message = f"te.TransformerLayer: {expected} with hidden = hidden_size = 64 "
    message += f"(attn_input_format={fmt!r}; the other formats take"
    with pytest.raises(ValueError, match=re.escape(message)):
        layer(torch.randn(bad))


def test_the_reported_transformer_layer_call():
    with pytest.raises(ValueError, match=re.escape("got shape [16, 64]")) as info:
        te.TransformerLayer(64, 256, 4)(torch.randn(16, 64))
    assert "[seq, batch, hidden]" in str(info.value) and "[batch, seq, hidden]" in str(info.value)


def test_transformer_layer_still_takes_its_layouts():
    assert te.TransformerLayer(64, 256, 4)(torch.randn(5, 2, 64)).shape == (5, 2, 64)
    bshd = te.TransformerLayer(64, 256, 4, attn_input_format="bshd")
    assert bshd(torch.randn(2, 5, 64)).shape == (2, 5, 64)


def test_multihead_attention_checks_its_inputs_at_entry():
    mha = te.MultiheadAttention(64, 4)
    message = "te.MultiheadAttention: hidden_states must be 3-D [seq, batch, hidden] with hidden "
    message += "= hidden_size = 64 (qkv_format='sbhd'"
    with pytest.raises(ValueError, match=re.escape(message)):
        mha(torch.randn(16, 64))
    cross = te.MultiheadAttention(64, 4, attention_type="cross", qkv_format="bshd")
    x = torch.randn(2, 5, 64)
    message = "te.MultiheadAttention: encoder_output must be 3-D [batch, seq, hidden]"
    with pytest.raises(ValueError, match=re.escape(message)):
        cross(x, encoder_output=torch.randn(2, 7, 32))
    assert cross(x, encoder_output=torch.randn(2, 7, 64)).shape == (2, 5, 64)
    with pytest.raises(
        TypeError, match=re.escape("hidden_states must be a torch.Tensor, got list")
    ):
        mha([[1.0]])


def test_dot_product_attention_names_the_layout_of_its_tensors():
    dpa = te.DotProductAttention(4, 16)
    q = torch.randn(16, 2, 64)
    message = "query_layer must be 4-D [seq, batch, heads, head_dim] for qkv_format='sbhd'"
    with pytest.raises(ValueError, match=re.escape(message)):
        dpa(q, q, q)


# -- make_graphed_callables without a GPU ---------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_graphs_without_cuda_say_once_that_they_run_eagerly():
    graphs._warn_eager.cache_clear()  # as in a fresh process
    layer = te.Linear(16, 16)
    x = torch.randn(4, 16)
    message = "no CUDA: make_graphed_callables runs the callables eagerly"
    with pytest.warns(UserWarning, match=message) as record:
        graphed = te.make_graphed_callables(layer, (x,))
    assert record[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        other = te.make_graphed_callables(te.Linear(16, 16), (x,))
    assert torch.equal(graphed(x), layer(x)) and other(x).shape == (4, 16)


# -- FP8 GEMM shapes: the GPU's rule on the CPU too -----------------------------------------------


def _gpu_rule_accepts(m: int, n: int, k: int) -> bool:
    """Whether torch._scaled_mm takes a (M, K) x b (N, K)^T with per-tensor scales on a GPU:
    torch's meta kernel applies the CUDA rule to meta tensors, so no GPU is needed to ask."""
    a = torch.empty(m, k, dtype=E4M3, device="meta")
    b = torch.empty(n, k, dtype=E4M3, device="meta")
    scale = torch.empty(1, device="meta")
    try:
        torch._scaled_mm(a, b.t(), scale, scale, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _cpu_accepts(m: int, n: int, k: int) -> bool:
    a = torch.ones(m, k).to(E4M3)
    b = torch.ones(n, k).to(E4M3)
    one = torch.ones(1)
    try:
        out = fp8_gemm(a, one, b, one, torch.bfloat16)
    except ValueError as error:
        assert "divisible by 16 (torch._scaled_mm's rule on a GPU" in str(error)
        return False
    assert torch.equal(out, torch.full((m, n), float(k), dtype=torch.bfloat16))
    return True


SHAPES = [(m, n, k) for m in (1, 13, 16) for n in (3, 16, 17, 48) for k in (7, 16, 24, 32)]


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_fp8_gemm_on_the_cpu_takes_exactly_the_shapes_the_gpu_takes(m, n, k):
    assert _cpu_accepts(m, n, k) == _gpu_rule_accepts(m, n, k)


def test_fp8_gemm_message_names_the_shapes():
    a, b = torch.zeros(5, 16, dtype=E4M3), torch.zeros(3, 16, dtype=E4M3)
    with pytest.raises(ValueError, match=re.escape("got a (5, 16) and b (3, 16)")):
        fp8_gemm(a, torch.ones(1), b, torch.ones(1), torch.float32)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("tokens", [1, 13, 17])
@pytest.mark.parametrize("name", MODULES)
def test_fp8_modules_take_any_token_count_as_on_the_gpu(name, tokens, recipe):
    """Every GEMM of an FP8 forward and backward goes through fp8_gemm, which holds the GPU's
    rule on the CPU: the input's rows are a GEMM's free M, or its K once the columnwise copy
    pads them to 16, so no token count is refused (on either device)."""
    module = MODULES[name]()
    x = torch.randn(tokens, 32, requires_grad=True)
    splits = [tokens // 2, tokens - tokens // 2]
    with te.autocast(recipe=recipe):
        y = module(x, splits) if name == "GroupedLinear" else module(x)
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()


def test_fp8_features_not_multiple_of_16_are_refused_on_every_device():
    layer = te.Linear(24, 16)
    with te.autocast(), pytest.raises(ValueError, match="FP8 GEMMs need in_features divisible"):
        layer(torch.randn(4, 24))
