"""te.parallel_cross_entropy and its kernels (torchte/cross_entropy.py,
torchte/kernels/cross_entropy.py).

- The torch reference (what the CPU runs) against torch.nn.functional.cross_entropy in float64:
  loss and input gradient under an upstream gradient, with label smoothing, ignored tokens,
  reduce_loss True and False; fp32 and bf16 logits exactly representable in their dtype, so
  the float64 model sees the very values the reference does.
- The Triton kernels against the reference under Triton's CPU interpreter (odd vocabulary
  1021 walked in blocks of 256 and in one block, one-class shards, several shards' stats).
- Transformer Engine's contract: fp32 loss of shape inp.shape[:-1], or (1,) when reduced (0
  when every token is ignored); the bf16 gradient rounded once after the upstream scaling;
  non-contiguous logits; the deprecated `_input`; bad arguments refused before any kernel.
- 2 gloo ranks, the vocabulary split between them: the loss of each equals the loss of the
  whole logits on one rank, and the two gradient shards side by side its gradient.
- GPU: the Triton path against the CPU reference, and a CUDA graph capture.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from interpreter import requires_interpreter, run_under_interpreter
from ranks import on_ranks
from tolerances import assert_close, representable

from torchte.cross_entropy import parallel_cross_entropy
from torchte.kernels import cross_entropy as ce

SQ, B, V = 5, 3, 1021  # logits (SQ, B, V), as Megatron-Core passes them
X_SCALE = 8.0
IGNORE = -100
# (label_smoothing, reduce_loss)
SETTINGS = [(0.0, False), (0.0, True), (0.1, False), (0.25, True)]


def draw(dtype: torch.dtype, shape=(SQ, B, V), ignored: int = 2, n_vocab: int | None = None):
    """(logits of `shape` exactly representable in dtype, targets shape[:-1] int64 with
    `ignored` tokens set to IGNORE, upstream gradient of the unreduced loss, fp32)."""
    x = representable(shape, dtype, scale=X_SCALE).to(dtype)
    n_vocab = shape[-1] if n_vocab is None else n_vocab
    target = torch.randint(0, n_vocab, shape[:-1])
    target.view(-1)[:ignored] = IGNORE
    dy = representable(shape[:-1], torch.float32, scale=2.0)
    return x, target, dy


def model(x: torch.Tensor, target: torch.Tensor, dy: torch.Tensor, ls: float, reduce: bool):
    """(loss, dx) of torch's cross_entropy in float64 (the upstream gradient dy for the
    unreduced loss, its mean for the reduced one)."""
    x64 = x.detach().double().requires_grad_()
    loss = F.cross_entropy(
        x64.reshape(-1, x.shape[-1]),
        target.reshape(-1),
        ignore_index=IGNORE,
        label_smoothing=ls,
        reduction="mean" if reduce else "none",
    )
    upstream = dy.double().mean() if reduce else dy.double().reshape(-1)
    (dx,) = torch.autograd.grad(loss, x64, upstream)
    return loss.reshape(1) if reduce else loss.reshape(target.shape), dx


def run(x, target, dy, ls, reduce, **kwargs):
    """(loss, dx) of parallel_cross_entropy, dx under the same upstream gradient as model."""
    x = x.detach().requires_grad_()
    loss = parallel_cross_entropy(x, target, ls, reduce, **kwargs)
    (dx,) = torch.autograd.grad(loss, x, dy.mean().reshape(1) if reduce else dy)
    return loss, dx


# ----------------------------------------------------------------------------------------------
# The reference against torch's cross entropy in float64
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ls,reduce", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_torch_in_float64(dtype, ls, reduce):
    x, target, dy = draw(dtype)
    loss, dx = run(x, target, dy, ls, reduce)
    want_loss, want_dx = model(x, target, dy, ls, reduce)
    assert loss.dtype == torch.float32 and loss.shape == want_loss.shape
    assert dx.dtype == dtype
    assert_close(loss, want_loss, torch.float32)
    assert_close(dx, want_dx, dtype)
    assert torch.all(dx[0, :2] == 0)  # the two ignored tokens (flat rows 0 and 1)


@pytest.mark.parametrize("ls,reduce", SETTINGS)
def test_float64_logits_compute_in_float64(ls, reduce):
    x, target, dy = draw(torch.float64)
    x = x + torch.rand_like(x) * 1e-3  # not representable in fp32: fp32 math would show
    loss, dx = run(x, target, dy, ls, reduce)
    want_loss, want_dx = model(x, target, dy, ls, reduce)
    assert loss.dtype == torch.float64 and dx.dtype == torch.float64
    # float64's own rounding (no entry in the fp32-and-below table)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-14)


def test_label_smoothing_with_a_minus_inf_logit():
    # A class masked to -inf: torch gives a loss of inf for label smoothing (the mean of
    # -log p includes it), and inf, not NaN (inf - inf), for the masked class as target.
    x = representable((4, 9), torch.float32, scale=4.0)
    x[:, 3] = float("-inf")
    target = torch.tensor([3, 0, 1, 2])
    loss = parallel_cross_entropy(x, target, 0.0)
    want = F.cross_entropy(x.double(), target, reduction="none")
    assert loss[0] == float("inf")
    assert_close(loss[1:], want[1:], torch.float32)


def test_reduced_loss_is_one_element_and_zero_when_all_ignored():
    x, target, _ = draw(torch.float32, shape=(2, 3, 11), ignored=6)
    x.requires_grad_()
    loss = parallel_cross_entropy(x, target, 0.1, True)
    assert loss.shape == (1,) and loss.dtype == torch.float32
    assert loss.item() == 0.0  # torch's mean gives NaN here; Transformer Engine 0
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_zero_tokens():
    x = torch.zeros(0, 4, 7, requires_grad=True)
    target = torch.zeros(0, 4, dtype=torch.int64)
    loss = parallel_cross_entropy(x, target)
    assert loss.shape == (0, 4)
    loss.sum().backward()
    assert x.grad.shape == x.shape
    reduced = parallel_cross_entropy(x, target, reduce_loss=True)
    assert reduced.shape == (1,) and reduced.item() == 0.0


def test_bf16_gradient_is_rounded_once_after_the_upstream_scaling():
    # Transformer Engine's regression: per-token scaling in fp32, then one rounding to bf16.
    logits = torch.zeros(2, 2, 3, dtype=torch.bfloat16, requires_grad=True)
    target = torch.tensor([[0, 1], [2, IGNORE]])
    dy = torch.tensor([[0.01, 0.03], [0.1, 0.7]])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = parallel_cross_entropy(logits, target)
    assert [t.dtype for t in saved if t is not None] == [torch.float32]
    loss.backward(dy)
    ref = logits.detach().float().requires_grad_()
    F.cross_entropy(ref.reshape(-1, 3), target.reshape(-1), reduction="none").backward(
        dy.reshape(-1)
    )
    assert torch.equal(logits.grad, ref.grad.to(torch.bfloat16))


def test_non_contiguous_logits_and_flat_targets():
    x, target, dy = draw(torch.float32, shape=(4, 2, 37))
    x_t = x.transpose(0, 1)  # (2, 4, 37): rows not evenly strided
    loss_t, dx_t = run(x_t, target.t(), dy.t(), 0.1, False)
    loss_c, dx_c = run(x_t.contiguous(), target.t().contiguous(), dy.t().contiguous(), 0.1, False)
    assert torch.equal(loss_t, loss_c) and torch.equal(dx_t, dx_c)
    flat = parallel_cross_entropy(x_t, target.t().reshape(-1), 0.1)
    assert torch.equal(flat, loss_c)


def test_loss_only_without_grad_and_deprecated_input_name():
    x, target, _ = draw(torch.float32, shape=(3, 29))
    with torch.no_grad():
        loss = parallel_cross_entropy(x, target)
    want, _ = model(x, target, torch.zeros(3), 0.0, False)
    assert_close(loss, want, torch.float32)
    with pytest.warns(FutureWarning, match="_input"):
        old = parallel_cross_entropy(None, target, _input=x)
    assert torch.equal(old, loss)


def test_second_backward_of_fp32_logits_is_refused_bf16_repeats():
    x, target, dy = draw(torch.float32, shape=(3, 13))
    x.requires_grad_()
    loss = parallel_cross_entropy(x, target)
    loss.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward(dy)
    xb = x.detach().bfloat16().requires_grad_()
    loss = parallel_cross_entropy(xb, target)
    (g1,) = torch.autograd.grad(loss, xb, dy, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, xb, dy)
    assert torch.equal(g1, g2)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def test_target_out_of_range_is_refused():
    x = torch.zeros(2, 3, 5)
    for bad in (5, -1, -101):
        target = torch.zeros(2, 3, dtype=torch.int64)
        target[1, 2] = bad
        with pytest.raises(ValueError, match=rf"target must be in \[0, 5\).*got {bad}"):
            parallel_cross_entropy(x, target)
    # ignore_idx itself passes, and may be any int
    target[1, 2] = 7
    assert parallel_cross_entropy(x, target, ignore_idx=7)[1, 2] == 0


def test_is_cg_capturable_skips_the_target_check_and_gives_nan():
    x = torch.zeros(1, 2, 5, requires_grad=True)
    target = torch.tensor([[1, 9]])
    loss = parallel_cross_entropy(x, target, is_cg_capturable=True)
    assert not torch.isnan(loss[0, 0]) and torch.isnan(loss[0, 1])
    loss.sum().backward()
    assert not x.grad[0, 0].isnan().any() and x.grad[0, 1].isnan().all()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"inp": torch.zeros(5, dtype=torch.float32)}, ValueError, "inp must be"),
        ({"inp": torch.zeros(2, 0)}, ValueError, "vocabulary dim"),
        ({"inp": torch.zeros(2, 5, dtype=torch.int64)}, TypeError, "logits must be float32"),
        ({"target": torch.zeros(2, dtype=torch.float32)}, TypeError, "target must be int64"),
        ({"target": torch.zeros(3, dtype=torch.int64)}, ValueError, "target must have"),
        ({"target": torch.zeros(1, 2, dtype=torch.int64)}, ValueError, "target must have"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ({"label_smoothing": "0.1"}, TypeError, "label_smoothing must be a float"),
        ({"reduce_loss": 1}, TypeError, "reduce_loss must be a bool"),
        ({"ignore_idx": -100.0}, TypeError, "ignore_idx must be an int"),
        ({"dist_process_group": "tp"}, TypeError, "dist_process_group must be"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    args = {"inp": torch.zeros(2, 5), "target": torch.zeros(2, dtype=torch.int64)} | kwargs
    with pytest.raises(error, match=match):
        parallel_cross_entropy(**args)


def test_launchers_refuse_bad_input():
    x, target = torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="unit stride along V"):
        ce.cross_entropy_stats(torch.zeros(8, 3).t(), target, 0)
    with pytest.raises(ValueError, match=r"stats_all must be \(W, 4, N\)"):
        ce.cross_entropy_loss_and_grad(x, target, torch.zeros(1, 3, 3), 0, IGNORE, 0.0)
    with pytest.raises(ValueError, match=r"stats_all must be torch\.float32"):
        ce.cross_entropy_loss_and_grad(x, target, torch.zeros(1, 4, 3).double(), 0, IGNORE, 0.0)
    with pytest.raises(ValueError, match="scale must be"):
        ce.cross_entropy_backward(x, torch.ones(2), torch.float32)
    with pytest.raises(ValueError, match=r"in_place needs dtype torch\.float32"):
        ce.cross_entropy_backward(x, torch.ones(1), torch.bfloat16, in_place=True)


# ----------------------------------------------------------------------------------------------
# Triton kernels against the reference, under Triton's CPU interpreter
# ----------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = """
import math
from tolerances import assert_close
from torchte.kernels import cross_entropy as ce

torch.manual_seed(0)
N, W = 5, 3
for dtype in (torch.float32, torch.bfloat16):
    for v, block in ((1021, 256), (1021, ce.MAX_BLOCK), (1, ce.MAX_BLOCK)):
        x = (torch.randn(N, v + 3) * 4).to(dtype)[:, :v]  # rows v + 3 apart
        t = torch.randint(0, W * v, (N,))
        t[1], t[2], t[3] = -100, W * v, v  # ignored, out of range (NaN), on shard 1
        others = [x.flip(1), x * 0.5]
        for rank in (0, 1):
            start = rank * v
            stats = ce._stats_triton(x, t, start, max_block=block)
            want = ce.cross_entropy_stats_reference(x, t, start)
            # the sum of v logits: its rounding error follows the sum of |x|
            atol = 2e-6 * x.float().abs().sum(1).max().item()
            torch.testing.assert_close(stats, want, rtol=2e-6, atol=atol)
            shards = [*others[:rank], x, *others[rank:]]
            stats_all = torch.stack(
                [ce.cross_entropy_stats_reference(s, t, i * v) for i, s in enumerate(shards)]
            )
            for ls in (0.0, 0.2):
                loss, grad = ce._loss_grad_triton(
                    x, t, stats_all, start, -100, ls, True, max_block=block
                )
                want_loss, want_grad = ce.cross_entropy_loss_and_grad_reference(
                    x, t, stats_all, start, -100, ls
                )
                assert loss.isnan().tolist() == [False, False, True, False, False]
                assert grad[2].isnan().all() and torch.equal(grad[1], torch.zeros(v))
                assert_close(loss.nan_to_num(), want_loss.nan_to_num(), torch.float32)
                assert_close(grad.nan_to_num(), want_grad.nan_to_num(), torch.float32)
                only, none = ce._loss_grad_triton(x, t, stats_all, start, -100, ls, False)
                assert none.shape == (0, v) and torch.equal(only.nan_to_num(), loss.nan_to_num())
        grad = want_grad.nan_to_num()
        for scale in (torch.randn(N), torch.randn(1)):
            for out in (torch.float32, dtype):
                dx = ce._backward_triton(grad, scale, out, False, block=128)
                want_dx = ce.cross_entropy_backward_reference(grad, scale, out)
                assert dx.dtype == out
                # the interpreter rounds to bf16 toward zero, the GPU (and torch) to nearest
                assert_close(dx, want_dx, out)
        inplace = grad.clone()
        assert ce._backward_triton(inplace, scale, torch.float32, True) is inplace
        assert torch.equal(inplace, grad * scale)
empty = torch.zeros(0, 7)
none = torch.zeros(0, dtype=torch.int64)
assert ce._stats_triton(empty, none, 0).shape == (4, 0)
loss, grad = ce._loss_grad_triton(empty, none, torch.zeros(2, 4, 0), 0, -100, 0.0, True)
assert loss.shape == (0,) and grad.shape == (0, 7)
print("ok")
"""


@requires_interpreter
def test_kernels_match_reference_under_interpreter():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ----------------------------------------------------------------------------------------------
# The vocabulary split over 2 gloo ranks
# ----------------------------------------------------------------------------------------------

WORLD = 2
SPLIT_SHAPE = (4, 3, 2 * 37)  # 37 classes a rank


def _split_rank(rank: int, x: torch.Tensor, target: torch.Tensor, dy: torch.Tensor) -> list:
    """[(loss, dx of this rank's shard)] per SETTINGS and dtype, then the zero-token loss."""
    group = dist.group.WORLD
    width = x.shape[-1] // WORLD
    shard = x[..., rank * width : (rank + 1) * width]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for ls, reduce in SETTINGS:
            loss, dx = run(shard.to(dtype), target, dy, ls, reduce, dist_process_group=group)
            out.append((loss.detach(), dx))
    empty = torch.zeros(0, width)
    out.append(parallel_cross_entropy(empty, torch.zeros(0, dtype=torch.int64), 0.1, True, group))
    try:
        bad = target.clone()
        bad.view(-1)[0] = x.shape[-1]  # the size of the whole vocabulary: one past its end
        parallel_cross_entropy(shard, bad, dist_process_group=group)
        out.append("accepted")
    except ValueError as error:
        out.append(str(error))
    return out


def test_vocabulary_split_over_two_ranks_equals_whole(tmp_path):
    x, target, dy = draw(torch.float32, shape=SPLIT_SHAPE)
    results = on_ranks(_split_rank, WORLD, tmp_path, x, target, dy)
    assert not dist.is_initialized()
    width = x.shape[-1] // WORLD
    i = 0
    for dtype in (torch.float32, torch.bfloat16):
        for ls, reduce in SETTINGS:
            whole_loss, whole_dx = run(x.to(dtype), target, dy, ls, reduce)
            want_loss, want_dx = model(x.to(dtype), target, dy, ls, reduce)
            for rank, result in enumerate(results):
                loss, dx = result[i]
                assert_close(loss, whole_loss, torch.float32)
                assert_close(loss, want_loss, torch.float32)
                cols = slice(rank * width, (rank + 1) * width)
                assert_close(dx, whole_dx[..., cols], dtype)
                assert_close(dx, want_dx[..., cols], dtype)
            i += 1
    for result in results:
        assert result[i].shape == (1,) and result[i].item() == 0.0
        assert f"[0, {x.shape[-1]})" in result[i + 1]


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype, nccl_group):
    # 50257 classes: several blocks of the kernels' row loop, a partial last one; a group of
    # one rank (Megatron-Core's tensor-parallel group without tensor parallelism).
    for v, group in ((50257, None), (1021, nccl_group)):
        x, target, dy = draw(dtype, shape=(7, 3, v), n_vocab=v)
        for ls, reduce in SETTINGS:
            loss, dx = run(x, target, dy, ls, reduce)
            loss_gpu, dx_gpu = run(x.cuda(), target.cuda(), dy.cuda(), ls, reduce)
            loss_grp, dx_grp = run(
                x.cuda(), target.cuda(), dy.cuda(), ls, reduce, dist_process_group=group
            )
            assert loss_gpu.dtype == torch.float32 and dx_gpu.dtype == dtype
            assert torch.equal(loss_gpu, loss_grp) and torch.equal(dx_gpu, dx_grp)
            assert_close(loss_gpu, loss, torch.float32)
            assert_close(dx_gpu, dx, dtype)
    with pytest.raises(ValueError, match="target must be in"):
        parallel_cross_entropy(x.cuda(), torch.full_like(target, v).cuda())


@pytest.mark.gpu
def test_cuda_graph_capture():
    x, target, dy = draw(torch.bfloat16, shape=(4, 2, 1021))
    x, target, dy = x.cuda().requires_grad_(), target.cuda(), dy.cuda()

    def step():
        loss = parallel_cross_entropy(x, target, 0.1, False, None, IGNORE, True)
        (dx,) = torch.autograd.grad(loss, x, dy)
        return loss, dx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want_loss, want_dx = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, dx = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, want_loss) and torch.equal(dx, want_dx)
