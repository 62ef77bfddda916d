"""The training features of the linear modules through te.MultiheadAttention and
te.TransformerLayer: make_graphed_callables (eager on the CPU), CPU activation offloading (with
SynchronousCopies), fused weight-gradient accumulation into main_grad, activation recompute
(checkpoint_core_attention, te.checkpoint, te.distributed.checkpoint) and tensor parallelism
over 2 gloo ranks against the one-rank layer with the same weights. The CUDA-only halves are in
test_transformer_layer_features_gpu.py.

Legend: H hidden, FFN the MLP's hidden size, HEADS query heads, GROUPS key/value groups (GQA),
S sequence, B batch; hidden states (S, B, H) ("sbhd").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from attention_reference import set_representable
from ranks import on_ranks
from test_offload import offloaded_tensors
from tolerances import assert_close, representable, tolerance

import torchte as te
import torchte.attention.dot_product_attention as dpa_module
from torchte import recipe
from torchte.offload import SynchronousCopies

H, FFN, HEADS, GROUPS, S, B = 64, 96, 4, 2, 8, 2
RECIPES = {
    "bf16": lambda: None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def make(kind: str, dtype=torch.bfloat16, seed: int = 0, **kwargs) -> torch.nn.Module:
    """A TransformerLayer ("layer") or self-attention MultiheadAttention ("mha", with its
    input norm) of params_dtype dtype, without dropout unless kwargs ask for it, its
    parameters exact in bf16 and the same for a seed."""
    common = {"num_gqa_groups": GROUPS, "attention_dropout": 0.0, "params_dtype": dtype}
    common.update(kwargs)
    if kind == "layer":
        common.setdefault("hidden_dropout", 0.0)
        module = te.TransformerLayer(H, FFN, HEADS, **common)
    else:
        module = te.MultiheadAttention(H, HEADS, input_layernorm=True, **common)
    torch.manual_seed(seed)
    set_representable(module, torch.bfloat16, scale=0.125)
    return module


def twin_of(module: torch.nn.Module, kind: str, dtype=torch.bfloat16, **kwargs):
    """A second module of the same kind with the same state."""
    twin = make(kind, dtype, seed=99, **kwargs)
    twin.load_state_dict(module.state_dict())
    return twin


def sample(step: int, dtype=torch.bfloat16, rows: int = S) -> torch.Tensor:
    """Hidden states (rows, B, H) exact in bf16, the same for a step."""
    gen = torch.Generator().manual_seed(100 + step)
    return representable((rows, B, H), torch.bfloat16, generator=gen).to(dtype)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _plain(module, h):
    return module(h)


def train_step(modules, x, fp8_recipe, wrap=_plain):
    """One forward (each module through wrap(module, h)) and backward of a squared loss;
    (the output, [input grad, every parameter's grad]), the grads then cleared."""
    x = x.clone().requires_grad_(True)
    h = x
    with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
        for module in modules:
            h = _first(wrap(module, h))
    h.float().square().mean().backward()
    grads = [x.grad] + [p.grad for module in modules for p in module.parameters()]
    for module in modules:
        module.zero_grad(set_to_none=True)
    return h.detach(), grads


def assert_same(got, want, label) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), f"{label}: {i}"
        assert a is None or torch.equal(a, b), f"{label}: {i}"


# ---- CUDA graphs: on the CPU, eager under the given autocast arguments ----


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["layer", "mha"])
def test_graphed_modules_run_eagerly_on_the_cpu(kind, recipe_name):
    fp8 = RECIPES[recipe_name]()
    graphed = make(kind)
    eager = twin_of(graphed, kind)
    sample_x = sample(0).requires_grad_(True)
    result = te.make_graphed_callables(graphed, (sample_x,), enabled=fp8 is not None, recipe=fp8)
    assert result is graphed
    for step in range(2):  # delayed scaling: the second step runs on moved scales
        x = sample(step + 1)
        want_y, want = train_step([eager], x, fp8)
        got_y, got = train_step([graphed], x, None)  # the graphed module brings its autocast
        assert torch.equal(got_y, want_y), step
        assert_same(got, want, f"{kind} {recipe_name} step {step}")
    if fp8 is not None:  # FP8 really ran
        with te.autocast(enabled=False):
            assert not torch.equal(_first(eager(sample(1))), want_y)


# ---- CPU offloading ----


class Counting(SynchronousCopies):
    """SynchronousCopies that records the dtype of every tensor it moved out."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: list[torch.dtype] = []

    def to_host(self, tensor, host):
        self.moved.append(tensor.dtype)
        return super().to_host(tensor, host)


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["layer", "mha"])
def test_offloaded_gradients_are_bit_identical(kind, recipe_name):
    fp8 = RECIPES[recipe_name]()
    modules = [make(kind, seed=i) for i in range(3)]
    twins = [twin_of(m, kind) for m in modules]
    copies = Counting()
    context, sync = te.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, copies=copies
    )
    offloaded_saves = offloaded_tensors(context.handler)

    def offloaded(module, h):
        with context:
            out = _first(module(h))
        return sync(out)

    for step in range(2):
        x = sample(step)
        want_y, want = train_step(twins, x, fp8)
        got_y, got = train_step(modules, x, fp8, offloaded)
        assert torch.equal(got_y, want_y), step
        assert_same(got, want, f"{kind} {recipe_name} step {step}")
    assert copies.moved, "nothing was offloaded"
    if fp8 is not None:
        assert any(dtype in FP8_DTYPES for dtype, _ in offloaded_saves), offloaded_saves
    assert not any(context.handler.saved.values())  # every offloaded tensor came back


# ---- fused weight-gradient accumulation ----


def _gemm_weights(module) -> dict[str, torch.nn.Parameter]:
    """The GEMM weights (2-D parameters): those whose gradient goes to main_grad."""
    return {n: p for n, p in module.named_parameters() if p.dim() == 2}


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["layer", "mha"])
def test_main_grad_gets_every_weight_gradient(kind, recipe_name):
    """Each GEMM weight's main_grad (fp32) accumulates the gradients an unfused twin gets in
    .grad over two microbatches (the first overwriting what main_grad held); the weights
    whose grad_added_to_main_grad is False get it set and a dummy .grad; the other
    parameters' .grad equals the twin's."""
    fp8 = RECIPES[recipe_name]()
    kw = {"fuse_qkv_params": True} if kind == "layer" else {}
    fused = make(kind, torch.float32, fuse_wgrad_accumulation=True, **kw)
    plain = twin_of(fused, kind, torch.float32, **kw)
    # The twin runs the same Functions: without FP8 its plain norm modules would take torch's
    # own ops (their `_plain` shortcut), which round elsewhere.
    for module in plain.modules():
        if isinstance(module, te.LayerNormLinear | te.LayerNormMLP):
            module._fast_setattr("_plain", False)
    weights = _gemm_weights(fused)
    assert len(weights) == 4  # qkv and proj, fc1 and fc2; or query, key, value and proj
    for param in weights.values():
        param.main_grad = torch.full(param.shape, 1000.0)
        param.grad_added_to_main_grad = False
    sums: dict[str, torch.Tensor] = {}
    for micro in range(2):
        first = micro == 0
        x = sample(micro, torch.float32)
        dx = _microbatch(fused, x, fp8, first)
        assert torch.equal(dx, _microbatch(plain, x, fp8, first)), micro
        plain_params = dict(plain.named_parameters())
        for name, param in fused.named_parameters():
            grad = plain_params[name].grad
            if name in weights:
                sums[name] = grad.clone() if first else sums[name] + grad
                assert param.grad_added_to_main_grad is True, name
                assert param.grad is not None and param.grad.shape == param.shape, name
                param.grad_added_to_main_grad = False
                assert_close(param.main_grad, sums[name], torch.float32, msg=name)
            else:
                assert torch.equal(param.grad, grad), name
                param.grad = None
        plain.zero_grad(set_to_none=True)
    assert all(p.main_grad.abs().sum() > 0 for p in weights.values())


def _microbatch(module, x, fp8, first: bool) -> torch.Tensor:
    """Forward (is_first_microbatch=first) and backward of one microbatch; the input grad."""
    x = x.clone().requires_grad_(True)
    with te.autocast(enabled=fp8 is not None, recipe=fp8):
        y = _first(module(x, is_first_microbatch=first))
    y.float().square().mean().backward()
    return x.grad


# ---- activation recompute ----


class AttentionRuns:
    """Counts the attention kernel calls (te.DotProductAttention's backend runs)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = dpa_module.run_backend

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(dpa_module, "run_backend", counted)


def _checkpoint_wrap(how: str, tracker):
    if how == "checkpoint_core_attention":
        return lambda module, h: module(h, checkpoint_core_attention=True)
    if how == "te.checkpoint":
        return te.checkpoint
    return lambda module, h: te.distributed.checkpoint(
        module, h, get_rng_state_tracker=lambda: tracker
    )


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("how", ["checkpoint_core_attention", "te.checkpoint", "distributed"])
@pytest.mark.parametrize("kind", ["layer", "mha"])
def test_recompute_equals_kept_and_runs_attention_twice(kind, how, recipe_name, monkeypatch):
    """With attention dropout and hidden dropout drawn from the generators the recompute
    replays (torch's; the tracker's for attention dropout where the module has one):
    bit-identical outputs and gradients, two steps (delayed scaling's scales move between
    them)."""
    fp8 = RECIPES[recipe_name]()
    tracker = te.distributed.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    twin_tracker = te.distributed.CudaRNGStatesTracker()
    twin_tracker.add("model-parallel-rng", 7)
    dropout = {"attention_dropout": 0.25}
    if kind == "layer":
        dropout["hidden_dropout"] = 0.25
    if how != "te.checkpoint":  # there attention dropout draws from torch's generator
        dropout["get_rng_state_tracker"] = lambda: tracker
    module = make(kind, **dropout)
    if how != "te.checkpoint":
        dropout["get_rng_state_tracker"] = lambda: twin_tracker
    twin = make(kind, **dropout)
    twin.load_state_dict(module.state_dict())
    runs = AttentionRuns(monkeypatch)
    for step in range(2):
        x = sample(step)
        torch.manual_seed(step)
        want_y, want = train_step([twin], x, fp8)
        kept_runs = runs.count
        torch.manual_seed(step)
        got_y, got = train_step([module], x, fp8, _checkpoint_wrap(how, tracker))
        assert runs.count - kept_runs == 2 and kept_runs == 3 * step + 1, runs.count
        assert torch.equal(got_y, want_y), step
        assert_same(got, want, f"{kind} {how} {recipe_name} step {step}")
    with torch.no_grad():  # the dropout really drew
        module.eval()
        assert not torch.equal(_first(module(sample(1))), want_y)


# ---- tensor parallelism over 2 gloo ranks ----

WORLD = 2
TP_CONFIGS = [
    (kind, variant, sp, precision)
    for kind, variant in (("layer", "unfused"), ("layer", "fused"), ("mha", "unfused"))
    for sp in (False, True)
    for precision in ("fp32", "delayed", "current")
] + [
    ("decoder", "unfused", sp, precision)
    for sp in (False, True)
    for precision in ("fp32", "current")
]


def test_gqa_groups_must_split_over_the_ranks():
    with pytest.raises(ValueError, match="tp_size=2 must divide num_gqa_groups=1"):
        te.MultiheadAttention(H, HEADS, num_gqa_groups=1, tp_size=2, set_parallel_mode=True)
    with pytest.raises(ValueError, match="needs set_parallel_mode=True"):
        te.TransformerLayer(H, FFN, HEADS, tp_size=2)


def _shard(whole: torch.Tensor, local_shape, rank: int) -> tuple[int | None, torch.Tensor]:
    """(the split dim or None, this rank's contiguous piece of whole of local_shape)."""
    if tuple(whole.shape) == tuple(local_shape):
        return None, whole
    (dim,) = [d for d, (a, b) in enumerate(zip(whole.shape, local_shape, strict=True)) if a != b]
    return dim, whole.narrow(dim, rank * local_shape[dim], local_shape[dim])


def _assert_norm_close(got, want, label) -> None:
    """||got - want|| <= rtol ||want|| + atol sqrt(n) with fp32's (rtol, atol): the
    row-parallel GEMMs add the ranks' partial sums in another order than one GEMM does (an
    elementwise check flags where a sum cancels). Under FP8 both sides quantize the same
    values with the same scales (the amaxes are reduced over the group), so fp32's tolerance
    holds there too. The atol term is for gradients that are zero but for rounding (the key
    bias's: softmax does not change when every score of a query moves alike)."""
    rtol, atol = tolerance(torch.float32)
    error = (got.double() - want.double()).norm()
    bound = rtol * want.double().norm() + atol * want.numel() ** 0.5
    assert error <= bound, f"{label}: error {error:.3g} > {bound:.3g}"


def _tp_run(module, inputs, dy, precision, steps):
    """(output, input grads) of the last of `steps` steps: inputs (x, encoder_output or None),
    attention recomputed (checkpoint_core_attention) in the second step."""
    for step in range(steps):
        for p in module.parameters():
            p.grad = None
        x, enc = (None if t is None else t.detach().clone().requires_grad_(True) for t in inputs)
        kwargs = {} if enc is None else {"encoder_output": enc}
        fp8 = precision in ("delayed", "current")
        with te.autocast(enabled=fp8, recipe=RECIPES[precision]() if fp8 else None):
            y = _first(module(x, checkpoint_core_attention=step == 1, **kwargs))
        y.backward(dy)
    return y.detach(), x.grad, None if enc is None else enc.grad


def _check_tp(kind, variant, sp, precision, rank) -> None:
    """One config: the tensor-parallel module on this rank against the one-rank module built
    from the same whole weights (each rank's piece of the column-parallel rows and
    row-parallel columns; the rest whole); two steps (delayed scaling's reduced scales in the
    second), the second recomputing attention."""
    kw = {"fuse_qkv_params": True} if variant == "fused" else {}
    if kind == "decoder":
        kind, kw["layer_type"] = "layer", "decoder"
    ref = make(kind, torch.float32, seed=3, **kw)
    tp = {"set_parallel_mode": True, "tp_group": dist.group.WORLD, "sequence_parallel": sp}
    module = make(kind, torch.float32, seed=4, **kw, **tp)
    with torch.no_grad():
        whole = dict(ref.named_parameters())
        for name, param in module.named_parameters():
            param.copy_(_shard(whole[name], param.shape, rank)[1])
    x, dy = sample(5, torch.float32), sample(6, torch.float32)
    enc = sample(7, torch.float32) if "layer_type" in kw else None
    want = _tp_run(ref, (x, enc), dy, precision, 2)
    seq = slice(rank * S // WORLD, (rank + 1) * S // WORLD) if sp else slice(None)
    shard = None if enc is None else enc[seq]  # key_value gathers it under sp
    got = _tp_run(module, (x[seq], shard), dy[seq], precision, 2)
    label = f"{kind} {kw} sp={sp} {precision}"
    for name, a, e in zip(("y", "dx", "d encoder_output"), got, want, strict=True):
        if e is not None:
            _assert_norm_close(a, e[seq], f"{label}: {name}")
    for name, param in module.named_parameters():
        grad = param.grad
        if getattr(param, "sequence_parallel", False):  # partial sums (Megatron all-reduces)
            grad = grad.clone()
            dist.all_reduce(grad)
        _assert_norm_close(
            grad, _shard(whole[name].grad, param.shape, rank)[1], f"{label}: d {name}"
        )
    assert module.sequence_parallel == sp
    if precision != "fp32":  # FP8 really ran
        with torch.no_grad(), te.autocast(enabled=False):
            assert not torch.equal(_first(ref(x, encoder_output=enc)), want[0]), label


def _check_late_group(rank) -> None:
    """A layer built with tp_size only gets its group later and equals one built with it."""
    tp = {"set_parallel_mode": True, "sequence_parallel": True}
    late = make("layer", torch.float32, tp_size=WORLD, **tp)
    early = make("layer", torch.float32, seed=1, tp_group=dist.group.WORLD, **tp)
    early.load_state_dict(late.state_dict())
    late.set_tensor_parallel_group(dist.group.WORLD)
    x = sample(rank, torch.float32, rows=S // WORLD)
    assert torch.equal(late(x), early(x))


def _rank_main(rank: int) -> dict:
    torch.set_num_threads(1)  # one core per rank: no oversubscription
    outcome = {}
    for check, config in [(_check_tp, c) for c in TP_CONFIGS] + [(_check_late_group, ())]:
        try:
            with torch.device("cpu"):
                check(*config, rank)
            outcome[config] = "ok"
        except Exception as err:  # reported per config, in the main process
            outcome[config] = f"{type(err).__name__}: {str(err)[:600]}"
    return outcome


def test_tensor_parallel_equals_one_rank(tmp_path):
    for outcome in on_ranks(_rank_main, WORLD, tmp_path):
        failed = {config: text for config, text in outcome.items() if text != "ok"}
        assert not failed, failed
