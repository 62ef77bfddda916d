"""Rotary position embeddings: achieved bandwidth and host overhead, fused (Triton) vs reference.

GPU-bound: apply_rotary_pos_emb forward and backward on t (s, b, h, d) = (4096, 2, 32, 128)
bf16 in sbhd, and the same tokens packed as thd (8 sequences); bandwidth = bytes the op must
move (t read + y written; dy read + dx written) / time, as a fraction of the bandwidth of a
device-to-device copy of t (read + write counted). Compared in the same run with torchte's
torch reference (fused=False) and with the eager torch composition a user would write
(t cos + rotate_half(t) sin, autograd for the backward).
CPU-bound: host microseconds per forward at s = 16 (calls queued back to back, one synchronize
at the end). Never asserts.

    python benchmarks/rope.py [--json out.json] [--seq 4096 --batch 2 --heads 32 --dim 128]
"""

from __future__ import annotations

import argparse

import torch
from timing import fmt, gpu_ms, host_us, print_bandwidth, write_kernel_json

from torchte.attention import RotaryPositionEmbedding, apply_rotary_pos_emb


def eager(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The torch composition of the forward (sbhd, every channel turned), in t's dtype."""
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-t2, t1], dim=-1) * sin


def cases(args) -> dict[str, tuple]:
    """name -> (t, freqs, keyword arguments) on the GPU, bf16."""
    s, b, h, d = args.seq, args.batch, args.heads, args.dim
    freqs = RotaryPositionEmbedding(d)(s).cuda()
    t = torch.randn((s, b, h, d), device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((8,), s * b // 8, dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0)]).int().cuda()
    t_thd = t.reshape(s * b, h, d)
    thd = {"tensor_format": "thd", "cu_seqlens": cu}
    return {"sbhd": (t, freqs, {}), "thd": (t_thd, freqs, thd)}


def op_fns(t, freqs, kw, with_eager: bool) -> dict[str, dict[str, object]]:
    """direction -> impl -> fn (the backward reuses one forward graph)."""
    impls = {"torchte fused": True, "torchte ref": False}
    out = {"fwd": {}, "bwd": {}}
    dy = torch.randn_like(t)
    for impl, fused in impls.items():
        x = t.detach().requires_grad_()
        out["fwd"][impl] = lambda fused=fused: apply_rotary_pos_emb(t, freqs, fused=fused, **kw)
        y = apply_rotary_pos_emb(x, freqs, fused=fused, **kw)
        out["bwd"][impl] = lambda y=y, x=x: torch.autograd.grad(y, x, dy, retain_graph=True)
    if with_eager:
        x = t.detach().requires_grad_()
        y = eager(x, freqs)
        out["fwd"]["torch eager"] = lambda: eager(t, freqs)
        out["bwd"]["torch eager"] = lambda: torch.autograd.grad(y, x, dy, retain_graph=True)
    return out


def copy_gbs(t: torch.Tensor) -> float:
    """GB/s of a device-to-device copy of t (read + write counted)."""
    dst = torch.empty_like(t)
    return 2 * t.numel() * t.element_size() / gpu_ms(lambda: dst.copy_(t)) / 1e6


def bandwidth(args) -> list[dict]:
    """Rows of the bandwidth table: copy, then each case, direction and impl."""
    rows, copy = [], None
    for name, (t, freqs, kw) in cases(args).items():
        copy = copy or copy_gbs(t)
        moved = 2 * t.numel() * t.element_size()
        for direction, impls in op_fns(t, freqs, kw, name == "sbhd").items():
            for impl, fn in impls.items():
                row = {"op": f"{name} {direction}", "impl": impl}
                try:
                    ms = gpu_ms(fn)
                except Exception as exc:  # a benchmark reports, never stops
                    rows.append({**row, "error": repr(exc)})
                    continue
                gbs = moved / ms / 1e6
                rows.append({**row, "ms": ms, "GB/s": gbs, "frac": gbs / copy})
    head = {"op": "copy_ (d2d)", "impl": "torch", "GB/s": copy, "frac": 1.0}
    head["ms"] = 2 * args.seq * args.batch * args.heads * args.dim * 2 / copy / 1e6
    return [head, *rows]


def host_overhead(args, seq: int = 16) -> list[dict]:
    """Host microseconds per forward call at `seq` tokens per sequence (sbhd)."""
    small = argparse.Namespace(**{**vars(args), "seq": seq})
    t, freqs, kw = cases(small)["sbhd"]
    fns = op_fns(t, freqs, kw, True)["fwd"]
    row = {"op": f"sbhd fwd s={seq}"}
    for impl, fn in fns.items():
        try:
            row[impl] = host_us(fn)
        except Exception as exc:
            row[impl], row[impl + " error"] = None, repr(exc)
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("rope benchmark: no CUDA device, nothing measured")
        return
    rows = bandwidth(args)
    host = host_overhead(args)
    print("\nhost us per forward call (bf16)")
    for row in host:
        impls = ("torchte fused", "torchte ref", "torch eager")
        cells = "  ".join(f"{impl} {fmt(row.get(impl), '.1f')}" for impl in impls)
        print(f"  {row['op']:16s} {cells}")
    shape = f"{args.seq}x{args.batch}x{args.heads}x{args.dim}"
    print_bandwidth(f"\nbandwidth at {shape} bf16 on {torch.cuda.get_device_name()}", rows, 10, 14)
    if args.json:
        write_kernel_json(
            args.json, args.seq * args.batch, args.heads * args.dim, bandwidth=rows, host_us=host
        )


if __name__ == "__main__":
    main()
