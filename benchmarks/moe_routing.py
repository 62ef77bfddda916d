"""MoE routing and token permutation on a GPU: te.router's top-k beside its torch reference, and
the permutation's achieved bandwidth as a fraction of a device copy, with issue 32's targets.

    PYTHONPATH=. python benchmarks/moe_routing.py [--json out.json] [--quick]

Router: fused_topk_with_score_function on fp32 logits (32768 tokens x 64 experts; topk 8 and
2; softmax, and sigmoid with expert_bias; group-limited with num_groups 8, group_topk 4 where
topk allows it), forward and forward+backward, beside the torch ops of the reference
(kernels/router_reference.py: topk_forward_reference, topk_backward_reference) on the same
tensors. "us" is CUDA-event time per call of calls queued back to back (what a training step
sees, host included); "kern us" the GPU time of the call's kernels (torch profiler).

Permutation (mask maps, hidden 4096 bf16, random top-k routing): moe_permute,
moe_permute_with_probs, moe_unpermute (without and with merging probs), forward and backward,
and moe_permute_and_pad_with_probs (align 16), for 32768 and 4096 tokens with 64 experts top-8
and 8 experts top-2. Bytes counted: the hidden rows an ideal kernel reads and writes once each
(N tokens, R = N k routed rows, P padded rows, 2 H bytes a row): permute and unpermute move
N + R rows each way; unpermute's backward with merging probs N + 2R (it reads the forward's
input again for the probs' gradient); the padded permute N + P. Maps and probs are not counted
(under 1% of the bytes). The fraction compares GB/s with dst.copy_(src) moving the same bytes
(reading and writing half of them), timed in the same run. Medians of CUDA-event timings after
warm-up (benchmarks/timing.py). Never asserts; the targets' table (PASS / MISS) is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from timing import gpu_ms, print_bandwidth
from torch.profiler import ProfilerActivity, profile

from torchte.kernels.router_reference import (
    RouterSpec,
    topk_backward_reference,
    topk_forward_reference,
)
from torchte.moe import (
    fused_topk_with_score_function,
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_unpermute,
)

ROUTER_TOKENS, ROUTER_EXPERTS, GROUPS, GROUP_TOPK = 32768, 64, 8, 4
HIDDEN, ALIGN = 4096, 16
ROUTER_TARGET_US, BANDWIDTH_TARGET = 50.0, 0.8


# ----------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------


def router_cases() -> list[tuple[str, str, int, bool]]:
    """(name, score function, topk, grouped); group_topk 4 needs topk divisible by 4."""
    cases = []
    for score in ("softmax", "sigmoid"):
        for topk in (8, 2):
            for grouped in (False, True) if topk % GROUP_TOPK == 0 else (False,):
                name = f"{score}{'+bias' if score == 'sigmoid' else ''} k{topk}"
                cases.append((name + (" grouped" if grouped else ""), score, topk, grouped))
    return cases


def kernel_time_us(fn, calls: int = 10) -> float:
    """GPU microseconds per call of the kernels, fills and copies fn launches (torch profiler
    over `calls` calls, after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.device_time for e in prof.events() if e.device_type == cuda) / calls


def router_row(score: str, topk: int, grouped: bool) -> dict:
    """te and reference timings of one case: us per call (events) and kernel us (profiler)."""
    t, e = ROUTER_TOKENS, ROUTER_EXPERTS
    logits = torch.randn(t, e, device="cuda")
    logits_g = logits.clone().requires_grad_()
    grad = torch.randn(t, e, device="cuda")
    bias = torch.randn(e, device="cuda") * 0.1 if score == "sigmoid" else None
    groups, group_topk = (GROUPS, GROUP_TOPK) if grouped else (None, None)
    args = (topk, False, groups, group_topk, None, score, bias)
    spec = RouterSpec(
        topk=topk, score_function=score, num_groups=groups or 0, group_topk=group_topk or 0
    )

    def te_fwd():
        fused_topk_with_score_function(logits, *args)

    def te_fwd_bwd():
        probs, _ = fused_topk_with_score_function(logits_g, *args)
        torch.autograd.grad(probs, logits_g, grad)

    def ref_fwd():
        topk_forward_reference(logits, bias, None, spec)

    def ref_fwd_bwd():
        _, routing, inter, _ = topk_forward_reference(logits, bias, None, spec)
        topk_backward_reference(routing, inter, grad, spec, logits.dtype)

    row = {}
    for name, fn in (
        ("te fwd", te_fwd), ("ref fwd", ref_fwd), ("te fwd+bwd", te_fwd_bwd),
        ("ref fwd+bwd", ref_fwd_bwd),
    ):  # fmt: skip
        row[f"{name} us"] = gpu_ms(fn, reps=30, inner=20, warmup=5) * 1e3
        row[f"{name} kern us"] = kernel_time_us(fn)
    return row


def print_router(rows: dict[str, dict]) -> None:
    print(f"\nrouter top-k, {ROUTER_TOKENS} tokens x {ROUTER_EXPERTS} experts, fp32 logits "
          "(us per call: events / kernels)")  # fmt: skip
    cols = ("te fwd", "ref fwd", "te fwd+bwd", "ref fwd+bwd")
    print(f"  {'case':24s}" + "".join(f" {c:>17s}" for c in cols) + f" {'fwd speedup':>12s}")
    for case, row in rows.items():
        cells = "".join(f" {row[c + ' us']:8.1f}/{row[c + ' kern us']:8.1f}" for c in cols)
        print(f"  {case:24s}{cells} {row['ref fwd us'] / row['te fwd us']:11.1f}x")


# ----------------------------------------------------------------------------------------------
# Permutation
# ----------------------------------------------------------------------------------------------


def routing(tokens: int, experts: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map (N, E) bool with topk random experts a token, probs (N, E) fp32)."""
    index = torch.rand(tokens, experts, device="cuda").topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
    routing_map.scatter_(1, index, True)
    return routing_map, torch.rand(tokens, experts, device="cuda") * routing_map


_COPY_MS: dict[int, float] = {}


def copy_gbps(nbytes: int) -> float:
    """GB/s of dst.copy_(src) moving nbytes (reading and writing nbytes / 2 each)."""
    elems = nbytes // 4  # bf16 elements of nbytes / 2 bytes
    if elems not in _COPY_MS:
        src = torch.empty(elems, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        _COPY_MS[elems] = gpu_ms(lambda: dst.copy_(src), reps=20, warmup=3)
        del src, dst
    return 4 * elems / _COPY_MS[elems] / 1e6


def permutation_ops(tokens: int, experts: int, topk: int) -> list[tuple[str, str, int, object]]:
    """(op, fwd/bwd, hidden rows moved, fn) of one shape; fns hold their tensors."""
    routing_map, probs = routing(tokens, experts, topk)
    routed = tokens * topk
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x_g, probs_g = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, row_id_map = moe_permute(x_g, routing_map, routed)
    out_p, perm_probs, _ = moe_permute_with_probs(x_g, probs_g, routing_map, routed)
    g_out, g_probs = torch.randn_like(out), torch.randn_like(perm_probs)
    y = out.detach()
    y_g = y.clone().requires_grad_()
    un, un_p = moe_unpermute(y_g, row_id_map), moe_unpermute(y_g, row_id_map, probs_g)
    g_un = torch.randn_like(un)
    counts = routing_map.sum(0).cpu()  # the host counts MoELayer's host path passes
    padded = int(((counts + ALIGN - 1) // ALIGN * ALIGN).sum())

    def grad(outputs, inputs, grads):
        return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)

    both = tokens + routed
    return [
        ("permute", "fwd", both, lambda: moe_permute(x, routing_map, routed)),
        ("permute", "bwd", both, grad(out, x_g, g_out)),
        ("permute_with_probs", "fwd", both,
         lambda: moe_permute_with_probs(x, probs, routing_map, routed)),
        ("permute_with_probs", "bwd", both,
         grad((out_p, perm_probs), (x_g, probs_g), (g_out, g_probs))),
        ("unpermute", "fwd", both, lambda: moe_unpermute(y, row_id_map)),
        ("unpermute", "bwd", both, grad(un, y_g, g_un)),
        ("unpermute+probs", "fwd", both, lambda: moe_unpermute(y, row_id_map, probs)),
        ("unpermute+probs", "bwd", tokens + 2 * routed, grad(un_p, (y_g, probs_g), g_un)),
        ("permute_and_pad", "fwd", tokens + padded,
         lambda: moe_permute_and_pad_with_probs(x, probs, routing_map, counts, ALIGN)),
    ]  # fmt: skip


def permutation_rows(tokens: int, experts: int, topk: int) -> list[dict]:
    """Bandwidth rows of one shape (an op that fails records its error)."""
    shape = f"N{tokens} E{experts} k{topk}"
    rows = []
    for op, phase, hidden_rows, fn in permutation_ops(tokens, experts, topk):
        row = {"op": f"{op} {shape}", "impl": phase, "name": op, "shape": shape}
        try:
            ms = gpu_ms(fn, reps=20, warmup=3)
            nbytes = hidden_rows * HIDDEN * 2
            gbps = nbytes / ms / 1e6
            row.update({"ms": ms, "GB/s": gbps, "frac": gbps / copy_gbps(nbytes)})
        except Exception as exc:  # one failing op must not hide the others' figures
            row["error"] = f"{type(exc).__name__}: {exc}"[:120]
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------


def targets(router: dict[str, dict], perm: list[dict]) -> list[tuple[str, str, str, bool]]:
    """(target, measured, goal, met) rows: the slowest router forward (kernel time), and per
    permutation op and phase the lowest fraction of copy bandwidth over the shapes."""
    out = []
    if router:
        case = max(router, key=lambda c: router[c]["te fwd kern us"])
        us = router[case]["te fwd kern us"]
        out.append((f"router top-k fwd, slowest: {case}", f"{us:.1f} us",
                    f"< {ROUTER_TARGET_US:.0f} us", us < ROUTER_TARGET_US))  # fmt: skip
    worst: dict[str, dict] = {}
    for row in perm:
        key = f"{row['name']} {row['impl']}"
        frac = row.get("frac", 0.0)
        if key not in worst or frac < worst[key].get("frac", 0.0):
            worst[key] = row
    for key, row in worst.items():
        frac = row.get("frac", 0.0)
        measured = f"{frac:.3f} of copy" if "frac" in row else "error"
        out.append((f"{key}, worst: {row['shape']}", measured,
                    f">= {BANDWIDTH_TARGET}", frac >= BANDWIDTH_TARGET))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="4096 tokens only, fewer cases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_routing.py needs a CUDA GPU; none is available (nothing run)")
    torch.manual_seed(0)
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__}", flush=True)
    router = {}
    for name, score, topk, grouped in router_cases()[: 2 if args.quick else None]:
        router[name] = router_row(score, topk, grouped)
    print_router(router)
    perm = []
    for tokens in (4096,) if args.quick else (32768, 4096):
        for experts, topk in ((64, 8), (8, 2)):
            perm += permutation_rows(tokens, experts, topk)
    print_bandwidth(f"\npermutation, hidden {HIDDEN} bf16 (bytes: hidden rows read + written)",
                    perm, 36, 4)  # fmt: skip
    rows = targets(router, perm)
    print("\ntargets (issue 32, H100)")
    for target, measured, goal, met in rows:
        print(f"  {target:50s} {measured:>16s} {goal:>10s}  {'PASS' if met else 'MISS'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "router": router,
                       "permutation": perm, "targets": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
