"""kernels/adam_states.py: FusedAdam's one-launch Adam over states of mixed dtypes. Its torch
reference against FusedAdam's own update (optimizers/_adam.py through fp32 working copies),
the kernel against the reference (the interpreter on the CPU, the hardware on a GPU), and on a
GPU FusedAdam's capturable step replayed in a CUDA graph against eager steps."""

from __future__ import annotations

import itertools

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close, representable

from torchte.kernels.adam_states import AdamStates, adam_step_, adam_step_reference_
from torchte.optimizers import FusedAdam
from torchte.optimizers._adam import AdamHyper, adam_update_

SHAPES = [(3, 5), (1,), (2, 9000)]  # odd sizes, one element, past one chunk of 8192
BF16, FP32 = torch.bfloat16, torch.float32
# (target, grad, exp_avg, exp_avg_sq, param copy or None)
COMBOS = [
    (FP32, FP32, FP32, FP32, None),
    (BF16, BF16, BF16, BF16, None),
    (FP32, BF16, BF16, FP32, BF16),
    (FP32, FP32, BF16, BF16, torch.float16),
]
LR, STEP = 2.0**-6, 3


def _case(combo, seed: int, device: str = "cpu"):
    """Lists (targets, grads, exp_avgs, exp_avg_sqs, copies) of values exact in bf16, moments
    of the right signs."""
    gen = torch.Generator().manual_seed(seed)
    lists = []
    for k, dtype in enumerate(combo):
        if dtype is None:
            lists.append(None)
            continue
        values = [representable(s, BF16, generator=gen) for s in SHAPES]
        if k == 3:
            values = [v.abs() / 64 for v in values]  # exp_avg_sq >= 0
        lists.append([v.to(device, dtype) for v in values])
    return lists


def _hyper(adamw: bool, wd: float, device: str = "cpu"):
    h = AdamHyper.of(LR, 0.875, 0.9375, 2.0**-10, STEP, int(adamw), True, wd, "test")
    bc1, bc2 = 1 - h.beta1**STEP, 1 - h.beta2**STEP
    return h, torch.tensor([h.lr, bc1, bc2], dtype=FP32, device=device)


def _states(h: AdamHyper) -> AdamStates:
    return AdamStates(h.beta1, h.beta2, h.eps, h.weight_decay, h.adamw)


@pytest.mark.parametrize("combo", COMBOS, ids=str)
@pytest.mark.parametrize("adamw", [True, False])
def test_reference_is_fused_adams_update(combo, adamw):
    h, hyper = _hyper(adamw, wd=2.0**-4)
    ours = _case(combo, 0)
    theirs = _case(combo, 0)
    inv_scale = torch.tensor([0.5])
    adam_step_reference_(*ours, hyper, _states(h), torch.zeros(1), inv_scale)
    adam_update_(*theirs[:4], h, torch.zeros(1), inv_scale.clone())
    if theirs[4] is not None:
        for c, t in zip(theirs[4], theirs[0], strict=True):
            c.copy_(t)
    for mine, want, dtype in zip(ours, theirs, combo, strict=True):
        if dtype is not None:
            for a, b in zip(mine, want, strict=True):
                assert_close(a, b, dtype)


def test_reference_skips_a_step_with_found_inf():
    h, hyper = _hyper(True, wd=0.0)
    lists = _case(COMBOS[2], 1)
    before = [[t.clone() for t in lst] for lst in lists]
    adam_step_reference_(*lists, hyper, _states(h), torch.ones(1), torch.tensor([0.25]))
    for lst, old in zip(lists, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(lst, old, strict=True))


def _check_kernel_against_reference(device: str) -> None:
    for combo, adamw, skip in itertools.product(COMBOS, (True, False), (False, True)):
        h, hyper = _hyper(adamw, wd=2.0**-4, device=device)
        kernel, reference = _case(combo, 2, device), _case(combo, 2, "cpu")
        flag = torch.tensor([float(skip)])
        scale = torch.tensor([0.5])
        adam_step_(*kernel, hyper, _states(h), flag.to(device), scale.to(device))
        adam_step_reference_(*reference, hyper.cpu(), _states(h), flag, scale)
        for mine, want, dtype in zip(kernel, reference, combo, strict=True):
            if dtype is not None:
                for a, b in zip(mine, want, strict=True):
                    assert a.dtype == dtype
                    assert_close(a, b, dtype)


@requires_interpreter
def test_kernel_under_the_interpreter_equals_the_reference():
    run_under_interpreter(
        """
        from test_kernels_adam_states import _check_kernel_against_reference
        _check_kernel_against_reference("cpu")
        print("ok")
        """
    )


@pytest.mark.gpu
def test_kernel_on_the_gpu_equals_the_reference():
    _check_kernel_against_reference("cuda")


@pytest.mark.gpu
def test_capturable_fused_adam_replays_in_a_cuda_graph():
    """master weights, bf16 params and moments: a graph of the step, replayed with new
    gradients, gives the eager optimizer's params and states."""
    gen = torch.Generator().manual_seed(3)
    values = [representable(s, BF16, generator=gen) for s in SHAPES]
    kw = dict(lr=LR, weight_decay=2.0**-4, master_weights=True, capturable=True,
              exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)  # fmt: skip
    eager = [torch.nn.Parameter(v.to("cuda", BF16)) for v in values]
    graphed = [torch.nn.Parameter(v.to("cuda", BF16)) for v in values]
    opt_eager, opt_graphed = FusedAdam(eager, **kw), FusedAdam(graphed, **kw)
    grads = [[representable(s, BF16, generator=gen).cuda() for s in SHAPES] for _ in range(4)]
    for p, g in zip(graphed, grads[0], strict=True):
        p.grad = g.to(BF16).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt_graphed.step()  # warm-up: states made, kernels compiled
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_graphed.step()
    for p, g in zip(eager, grads[0], strict=True):
        p.grad = g.to(BF16).clone()
    opt_eager.step()  # the warm-up step
    for step_grads in grads[1:]:
        for pe, pg, g in zip(eager, graphed, step_grads, strict=True):
            pe.grad = g.to(BF16).clone()
            pg.grad.copy_(g)
        opt_eager.step()
        graph.replay()
    torch.cuda.synchronize()
    assert int(opt_graphed.param_groups[0]["step"]) == int(opt_eager.param_groups[0]["step"])
    for pe, pg in zip(eager, graphed, strict=True):
        assert torch.equal(pe, pg)
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(opt_eager.state[pe][name], opt_graphed.state[pg][name])
