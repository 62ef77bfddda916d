"""Which block-scaled FP8 GEMM calls this torch runs on this GPU, with which scale layouts, and
how fast: torch._scaled_mm and torch.nn.functional.scaled_mm with 1x128 / 128x128 scales.

Usage: python benchmarks/block_gemm_probe.py   (CUDA only; prints a table)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def cdiv(a, b):
    return -(-a // b)


def quant_1d(x):
    """x (R, K) -> data (R, K) e4m3, scale_inv (ceil(K/128), R) contiguous (1x128 along K)."""
    r, k = x.shape
    kb = cdiv(k, 128)
    xp = F.pad(x.float(), (0, kb * 128 - k)).view(r, kb, 128)
    amax = xp.abs().amax(-1).clamp_min(1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    data = (xp * scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(r, -1)[:, :k]
    return data.contiguous(), (1.0 / scale).t().contiguous()


def quant_2d(x, pad4=True):
    """x (R, K) -> data e4m3, scale_inv (ceil(R/128), round_up(ceil(K/128), 4) or not)."""
    r, k = x.shape
    rb, kb = cdiv(r, 128), cdiv(k, 128)
    xp = F.pad(x.float(), (0, kb * 128 - k, 0, rb * 128 - r)).view(rb, 128, kb, 128)
    amax = xp.abs().amax((1, 3)).clamp_min(1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    data = (xp * scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    data = data.view(rb * 128, kb * 128)[:r, :k].contiguous()
    sinv = 1.0 / scale
    if pad4 and kb % 4:
        sinv = F.pad(sinv, (0, 4 - kb % 4))
    return data, sinv.contiguous()


def deq_1d(data, sinv):
    k = data.shape[1]
    s = sinv.t().repeat_interleave(128, 1)[:, :k]
    return data.float() * s


def deq_2d(data, sinv):
    r, k = data.shape
    s = sinv[:, : cdiv(k, 128)].repeat_interleave(128, 0).repeat_interleave(128, 1)[:r, :k]
    return data.float() * s


def _enum(st, suffix):
    """The ScalingType member named ...<suffix> (its spelling differs between releases)."""
    name = next(n for n in dir(st) if n.lower().endswith(suffix) and "block" in n.lower())
    return getattr(st, name)


def attempt(name, fn, want):
    try:
        got = fn()
        torch.cuda.synchronize()
        err = ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        return name, "ok" if err < 2e-2 else f"WRONG rel={err:.3g}"
    except Exception as exc:
        return name, f"fail: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"


def probe(m, n, k, rows):
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(m, k, device=dev)
    w = torch.randn(n, k, device=dev)
    xa, xs = quant_1d(x)
    wa, ws_pad = quant_2d(w, True)
    _, ws_nopad = quant_2d(w, False)
    w1, w1s = quant_1d(w)
    want12 = deq_1d(xa, xs) @ deq_2d(wa, ws_pad).t()
    want11 = deq_1d(xa, xs) @ deq_1d(w1, w1s).t()
    st = F.ScalingType if hasattr(F, "ScalingType") else None
    cases = {
        "v1 1x128*128x128 pad": lambda: torch._scaled_mm(
            xa, wa.t(), xs.t(), ws_pad[:, : cdiv(k, 128)].t(), out_dtype=torch.bfloat16
        ),
        "v1 1x128*128x128 nopad": lambda: torch._scaled_mm(
            xa, wa.t(), xs.t(), ws_nopad.t(), out_dtype=torch.bfloat16
        ),
        "v1 1x128*1x128": lambda: torch._scaled_mm(
            xa, w1.t(), xs.t(), w1s, out_dtype=torch.bfloat16
        ),
        "v1 1x128*1x128 fp32out": lambda: torch._scaled_mm(
            xa, w1.t(), xs.t(), w1s, out_dtype=torch.float32
        ),
    }
    if st is not None:
        b1, b2 = _enum(st, "1x128"), _enum(st, "128x128")
        cases.update({
            "v2 1x128*128x128 pad": lambda: F.scaled_mm(
                xa, wa.t(), xs.t(), b1, ws_pad.t(), b2, output_dtype=torch.bfloat16
            ),
            "v2 1x128*128x128 nopad": lambda: F.scaled_mm(
                xa, wa.t(), xs.t(), b1, ws_nopad.t(), b2, output_dtype=torch.bfloat16
            ),
            "v2 1x128*1x128": lambda: F.scaled_mm(
                xa, w1.t(), xs.t(), b1, w1s, b1, output_dtype=torch.bfloat16
            ),
            "v2 1x128*1x128 fp32out": lambda: F.scaled_mm(
                xa, w1.t(), xs.t(), b1, w1s, b1, output_dtype=torch.float32
            ),
        })  # fmt: skip
    for name, fn in cases.items():
        want = want11 if "1x128*1x128" in name else want12
        rows.append((f"{m}x{n}x{k}", *attempt(name, fn, want)))


def timing(rows):
    m = n = k = 8192
    dev = "cuda"
    x = torch.randn(m, k, device=dev)
    w = torch.randn(n, k, device=dev)
    xa, xs = quant_1d(x)
    wa, ws = quant_2d(w, True)
    w1, w1s = quant_1d(w)
    xb, wb = x.bfloat16(), w.bfloat16()
    flops = 2 * m * n * k

    def bench(fn):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        times = []
        for _ in range(10):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return flops / (times[len(times) // 2] * 1e-3) / 1e12

    fns = {
        "bf16 mm": lambda: torch.mm(xb, wb.t()),
        "v1 1x128*128x128": lambda: torch._scaled_mm(
            xa, wa.t(), xs.t(), ws[:, :64].t(), out_dtype=torch.bfloat16
        ),
        "v1 1x128*1x128": lambda: torch._scaled_mm(
            xa, w1.t(), xs.t(), w1s, out_dtype=torch.bfloat16
        ),
    }
    if hasattr(F, "ScalingType"):
        b1, b2 = _enum(F.ScalingType, "1x128"), _enum(F.ScalingType, "128x128")
        fns["v2 1x128*128x128"] = lambda: F.scaled_mm(
            xa, wa.t(), xs.t(), b1, ws.t(), b2, output_dtype=torch.bfloat16
        )
    for name, fn in fns.items():
        try:
            rows.append(("8192^3 TFLOP/s", name, f"{bench(fn):.0f}"))
        except Exception as exc:
            rows.append(("8192^3 TFLOP/s", name, f"fail {type(exc).__name__}"))


def main():
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    print("F.ScalingType:", [n for n in dir(getattr(F, "ScalingType", None)) if "Block" in n])
    rows = []
    for shape in ((256, 384, 512), (200, 384, 320), (130, 256, 1024), (256, 256, 640)):
        probe(*shape, rows)
    timing(rows)
    width = max(len(r[1]) for r in rows)
    for r in rows:
        print(f"{r[0]:<16} {r[1]:<{width}} {r[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
