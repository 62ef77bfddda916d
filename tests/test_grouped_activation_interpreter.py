"""The fused scaled activation + grouped FP8 cast kernels (kernels/grouped_activation_fp8.py)
under Triton's CPU interpreter (its integer FP8 encoding gives the GPU's bytes): forward and
backward bytes, scale_invs and amaxes equal the composition (the activation, then
quantize_grouped), ds and the bias sums within fp32 tolerance, for host split sizes and split
sizes on the device, delayed and current scaling, gated and plain activations, and two tiles."""

from __future__ import annotations

from interpreter import requires_interpreter, run_under_interpreter

SCRIPT = """
import torch
from tolerances import assert_close, assert_same_tensors as same
from torchte.kernels import activation as act_mod, grouped_activation_fp8 as gaf
from torchte.kernels.cast_spec import CastSpec
from torchte.kernels.grouped_cast import device_grouped_offsets, grouped_offsets, quantize_grouped
from torchte.kernels.scaled_activation import scaled_activation_backward, scaled_activation_forward

SPLITS = [21, 0, 16, 7]  # an odd group, an empty one
T, N, G = sum(SPLITS), 40, len(SPLITS)


def spec(delayed):
    amax = torch.zeros(G)
    if delayed:
        return CastSpec(torch.float8_e4m3fn, True, True, torch.tensor([0.5, 1.0, 2.0, 4.0]), amax)
    return CastSpec(torch.float8_e4m3fn, True, True, None, amax)


gen = torch.Generator().manual_seed(0)
for name in ("swiglu", "gelu"):
    k = 2 * N if name == "swiglu" else N
    act, gated = act_mod._spec(name)
    h = (torch.randn(T, k, generator=gen) * 2).bfloat16()
    dy = torch.randn(T, N, generator=gen).bfloat16()
    s = torch.rand(T, generator=gen)
    a = scaled_activation_forward(h, s, name)
    dh, ds_want = scaled_activation_backward(dy, h, s, name, 0.0, 0.0, True)
    for on_device in (False, True):
        if on_device:
            rows, cols = device_grouped_offsets(torch.tensor(SPLITS))
            m_splits = None
        else:
            rows, cols = grouped_offsets(SPLITS, "cpu")
            m_splits = SPLITS
        for delayed in (True, False):
            for config in ((32, 128, 4), (64, 128, 4)):
                where = (name, on_device, delayed, config)
                gaf.SCALED_ACT_CONFIG = config
                gaf.SCALED_ACT_GRAD_CONFIG = {"delayed": config, "current": config}
                want_spec, got_spec = spec(delayed), spec(delayed)
                want = quantize_grouped(a, m_splits, rows, cols, want_spec)
                got = gaf._forward_triton(h, s, act, gated, N, 0.0, 0.0, m_splits, rows, cols,
                                         got_spec)
                # the columnwise blocks end at element N * c_G (device splits: room past it
                # for the worst case, never written)
                end = N * int(cols[-1])
                same((got[0], got[1][:end], got[2], got_spec.amax),
                     (want[0], want[1][:end], want[2], want_spec.amax), where)
                want_spec, got_spec = spec(delayed), spec(delayed)
                want_b = quantize_grouped(dh, m_splits, rows, cols, want_spec)
                *got_b, ds, dbias = gaf._backward_triton(
                    dy, h, s, act, gated, N, 0.0, 0.0, m_splits, rows, cols, got_spec,
                    (True, True)
                )
                end = k * int(cols[-1])
                same((got_b[0], got_b[1][:end], got_b[2], got_spec.amax),
                     (want_b[0], want_b[1][:end], want_b[2], want_spec.amax), where)
                assert_close(ds, ds_want, torch.bfloat16, msg=str(where))
                sums = torch.stack([part.float().sum(0) for part in dh.split(SPLITS)])
                assert_close(dbias.float(), sums, torch.bfloat16, msg=str(where))
print("ok")
"""


@requires_interpreter
def test_grouped_activation_kernels_equal_the_composition_under_the_interpreter():
    run_under_interpreter(SCRIPT)
