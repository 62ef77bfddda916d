"""kernels/adamw.py (the multi-tensor AdamW step with scaled gradients, and the gradients'
global norm) and train/optimizer.py's ClippedAdamW, which runs them.

The kernels run under Triton's interpreter against their torch references and an fp64
computation of the same update; on a GPU, ClippedAdamW's fused step against
torch.nn.utils.clip_grad_norm_ followed by torch's fused AdamW."""

from __future__ import annotations

import math

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close

from torchte.kernels import adamw
from torchte.train.optimizer import ClippedAdamW, clip_factor

# One element, odd sizes, one past a chunk, several chunks and a partial one, an empty tensor.
SHAPES = [(1,), (3, 5), (1023,), (adamw.ADAMW_CHUNK + 1,), (2, adamw.ADAMW_CHUNK + 77), (0, 4)]
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def hyper(step: int) -> adamw.AdamWStep:
    return adamw.AdamWStep(**HYPER, step=step)


def adamw_fp64(p, g, m, v, step: int, scale: float, lr, beta1, beta2, eps, weight_decay):
    """The update in float64, from the same inputs: (p, m, v) after one step."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = g * scale
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    p = p - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v


def lists(shapes, grad_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(shape, dtype=torch.float32):
        return torch.randn(shape, generator=gen).to(dtype)

    params = [randn(s) for s in shapes]
    grads = [randn(s, grad_dtype) for s in shapes]
    exp_avgs = [randn(s) * 0.1 for s in shapes]
    exp_avg_sqs = [randn(s).abs() * 0.01 for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_reference_step_matches_fp64(grad_dtype):
    params, grads, exp_avgs, exp_avg_sqs = lists(SHAPES, grad_dtype)
    expected = [
        adamw_fp64(*t, step=4, scale=0.25, **HYPER)
        for t in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    ]
    adamw.adamw_step_reference_(
        params, grads, exp_avgs, exp_avg_sqs, hyper(4), torch.tensor([0.25])
    )
    for got, want in zip(zip(params, exp_avgs, exp_avg_sqs, strict=True), expected, strict=True):
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, torch.float32)


def test_reference_norm_matches_fp64():
    _, grads, _, _ = lists(SHAPES, torch.bfloat16)
    want = math.sqrt(sum(g.double().square().sum().item() for g in grads))
    assert_close(adamw.grad_norm_reference(grads), torch.tensor(want), torch.float32)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, g, m, v: adamw.adamw_step_(p, g[:-1], m, v, hyper(1), torch.ones(1)),
         "lengths differ"),
        (lambda p, g, m, v: adamw.adamw_step_(p, [t.t() for t in g], m, v, hyper(1),
                                              torch.ones(1)), "shapes differ"),
        (lambda p, g, m, v: adamw.adamw_step_(p, [t.half() for t in g], m, v, hyper(1),
                                              torch.ones(1)), "fp32 or bf16"),
        (lambda p, g, m, v: adamw.grad_norm([g[0], g[1].bfloat16()]), "one dtype"),
        (lambda p, g, m, v: adamw.grad_norm([]), "no gradients"),
    ],
    ids=["lengths", "shapes", "dtype", "mixed", "empty"],
)  # fmt: skip
def test_bad_lists_are_refused(call, message):
    params, grads, exp_avgs, exp_avg_sqs = lists([(3, 4), (5, 6)], torch.float32)
    before = [t.clone() for t in params]
    with pytest.raises(ValueError, match=message):
        call(params, grads, exp_avgs, exp_avg_sqs)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


INTERPRETER_SCRIPT = """
import torch
from test_kernels_adamw import SHAPES, hyper, lists
from tolerances import assert_close
from torchte.kernels import adamw

for grad_dtype in (torch.float32, torch.bfloat16):
    params, grads, exp_avgs, exp_avg_sqs = lists(SHAPES, grad_dtype, seed=1)
    ref = [[t.clone() for t in lst] for lst in (params, exp_avgs, exp_avg_sqs)]
    scale = torch.tensor([0.5])
    adamw.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, hyper(3), scale)
    adamw.adamw_step_reference_(*ref[:1], grads, *ref[1:], hyper(3), scale)
    for got, want in zip((params, exp_avgs, exp_avg_sqs), ref):
        for a, b in zip(got, want):
            assert_close(a, b, torch.float32)
    assert_close(adamw.grad_norm(grads), adamw.grad_norm_reference(grads), torch.float32)
print("ok")
"""


@requires_interpreter
def test_kernels_in_interpreter_equal_the_references():
    run_under_interpreter(INTERPRETER_SCRIPT)


def model_and_grads(device, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 130), torch.nn.LayerNorm(130), torch.nn.Linear(130, 7)
    ).to(device)
    return model


def backward(model, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(33, 64, generator=gen).to(next(model.parameters()).device)
    model(x).square().mean().mul(50.0).backward()  # large enough that clipping acts


def optimizers(model, cls):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    fused = next(model.parameters()).is_cuda
    return cls(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused)


def test_clip_factor_is_clip_grad_norms():
    for norm in (0.3, 1.0, 7.5):
        grads = [torch.full((4,), norm / 2.0)]
        params = [torch.zeros(4, requires_grad=True)]
        params[0].grad = grads[0].clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        factor = clip_factor(torch.tensor(norm), 1.0)
        assert torch.equal(params[0].grad, grads[0] * factor)


def test_clipped_adamw_on_the_cpu_is_clip_then_adamw():
    """Off a GPU clip_and_step runs the given clip and torch's step: the same bits."""
    ours_model, torch_model = model_and_grads("cpu"), model_and_grads("cpu")
    ours = optimizers(ours_model, ClippedAdamW)
    theirs = optimizers(torch_model, torch.optim.AdamW)
    for step in range(3):
        for model in (ours_model, torch_model):
            model.zero_grad(set_to_none=True)
            backward(model, step)
        ours.clip_and_step(1.0, torch.nn.utils.clip_grad_norm_)
        # in ClippedAdamW's order (its groups'): the norm's sum is then the same
        in_groups = [p for group in theirs.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(in_groups, 1.0)
        theirs.step()
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert str(ours.state_dict()) == str(theirs.state_dict())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_clipped_adamw_fused_on_the_gpu_matches_torch_and_resumes():
    ours_model, torch_model = model_and_grads("cuda"), model_and_grads("cuda")
    ours = optimizers(ours_model, ClippedAdamW)
    theirs = optimizers(torch_model, torch.optim.AdamW)

    def steps(seeds):
        for seed in seeds:
            for model in (ours_model, torch_model):
                model.zero_grad(set_to_none=True)
                backward(model, seed)
            ours.clip_and_step(1.0, lambda *_: pytest.fail("the fused path was not taken"))
            torch.nn.utils.clip_grad_norm_(list(torch_model.parameters()), 1.0)
            theirs.step()

    steps(range(3))
    # A state_dict round trip (the host's step count read back from the state) keeps going.
    ours.load_state_dict(ours.state_dict())
    steps(range(3, 6))
    assert ours.fused_steps == 6
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert_close(a, b, torch.float32)
    for p_ours, p_theirs in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        s_ours, s_theirs = ours.state[p_ours], theirs.state[p_theirs]
        assert torch.equal(s_ours["step"], s_theirs["step"]) and s_ours["step"].item() == 6
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(s_ours[key], s_theirs[key], torch.float32)
