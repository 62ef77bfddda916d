"""kernels/attention_merge.py: the merge of two partial attention outputs through their
log-sum-exps. The torch reference against an fp64 softmax over the union of the two key sets;
the Triton kernel against the reference (the interpreter on the CPU, the hardware on a GPU), in
place into rows of a strided accumulator, rows that see no key staying 0 with lse -inf."""

from __future__ import annotations

import pytest
import torch
from interpreter import requires_interpreter, run_under_interpreter
from tolerances import assert_close, representable

from torchte.kernels.attention_merge import merge_into, merge_reference

B, H, D = 2, 3, 8


def _attention(q, k, v):
    """(out [b, s, h, d], lse [b, h, s]) in fp64; a row whose keys are all masked (-inf
    scores) gives 0 and -inf."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)))
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def test_reference_equals_one_softmax_over_both_key_sets():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (representable((B, n, H, D), torch.bfloat16, generator=gen) for n in (5, 9, 9))
    q, k, v = q.double(), k.double(), v.double()
    whole, whole_lse = _attention(q, k, v)
    a, a_lse = _attention(q, k[:, :4], v[:, :4])
    b, b_lse = _attention(q, k[:, 4:], v[:, 4:])
    merged, lse = merge_reference(a.float(), a_lse.float(), b.float(), b_lse.float())
    assert_close(merged, whole, torch.float32)
    assert_close(lse, whole_lse, torch.float32)


def test_reference_keeps_rows_without_keys_at_zero():
    acc = torch.ones(1, 2, 1, 4)
    blk = torch.full((1, 2, 1, 4), 2.0)
    acc_lse = torch.tensor([[[float("-inf"), 0.0]]])
    blk_lse = torch.tensor([[[float("-inf"), float("-inf")]]])
    merged, lse = merge_reference(acc, acc_lse, blk, blk_lse)
    assert torch.equal(merged[0, 0], torch.zeros(1, 4)), "a row that sees no key must stay 0"
    assert torch.equal(merged[0, 1], acc[0, 1]), "a block that sees no key must not count"
    assert lse[0, 0, 0] == float("-inf") and lse[0, 0, 1] == 0


def _case(device: str, dtype: torch.dtype):
    """An accumulator [b, s, h, dv] stored as [b, h, s, dv] (a kernel's output layout), its lse,
    and a block for rows [3, 3 + r), one row of each side without keys."""
    gen = torch.Generator().manual_seed(1)
    s, r, dv = 70, 40, 24  # dv not a power of two, rows past one tile
    acc = representable((B, H, s, dv), torch.bfloat16, generator=gen).to(device, dtype)
    acc = acc.transpose(1, 2)
    block = representable((B, r, H, dv), torch.bfloat16, generator=gen).to(device, dtype)
    acc_lse = representable((B, H, s), torch.bfloat16, scale=8.0, generator=gen).to(device)
    block_lse = representable((B, H, r), torch.bfloat16, scale=8.0, generator=gen).to(device)
    acc_lse[0, 0, 5] = float("-inf")
    block_lse[0, 0, 2] = float("-inf")  # row 5 of the accumulator: no key on either side
    block_lse[1, 2, 7] = float("-inf")
    return acc, acc_lse, 3, block, block_lse


def _check_kernel(device: str, dtype: torch.dtype) -> None:
    acc, acc_lse, first, block, block_lse = _case(device, dtype)
    rows = slice(first, first + block.shape[1])
    want, want_lse = merge_reference(acc[:, rows], acc_lse[:, :, rows], block, block_lse)
    untouched, untouched_lse = acc.clone(), acc_lse.clone()
    merge_into(acc, acc_lse, first, block, block_lse)
    assert_close(acc[:, rows], want, dtype)
    torch.testing.assert_close(acc_lse[:, :, rows], want_lse, rtol=1.3e-6, atol=1e-5)
    assert torch.equal(acc[:, : rows.start], untouched[:, : rows.start])
    assert torch.equal(acc[:, rows.stop :], untouched[:, rows.stop :])
    assert torch.equal(acc_lse[:, :, rows.stop :], untouched_lse[:, :, rows.stop :])
    assert torch.equal(acc[0, 5, 0], torch.zeros_like(acc[0, 5, 0]))
    assert acc_lse[0, 0, 5] == float("-inf")


@requires_interpreter
def test_kernel_under_the_interpreter_equals_the_reference():
    run_under_interpreter(
        """
        import torch
        from test_kernels_attention_merge import _check_kernel
        for dtype in (torch.float32, torch.bfloat16):
            _check_kernel("cpu", dtype)
        print("ok")
        """
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_the_gpu_equals_the_reference(dtype):
    _check_kernel("cuda", dtype)


def test_merge_into_refuses_a_block_that_does_not_fit():
    acc, acc_lse, _, block, block_lse = _case("cpu", torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        merge_into(acc, acc_lse, 50, block, block_lse)
    with pytest.raises(ValueError, match="fp32"):
        merge_into(acc, acc_lse.double(), 0, block, block_lse)
