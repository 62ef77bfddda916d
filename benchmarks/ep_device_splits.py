"""Expert-parallel token exchange with split sizes on the device (torch's NVSHMEM all-to-all-v)
against NCCL's all-to-all with split sizes on the host, as MoELayer(ep_group=...) runs it.

    torchrun --standalone --nproc-per-node 2 benchmarks/ep_device_splits.py [--json out.json]

Each rank routes T tokens' k copies (T k rows of `hidden` bf16) uniformly over E experts, E / P
on each of the P ranks, rows sorted by expert. Rows:
- "nccl": dist.all_to_all_single of the rows with host split sizes already known;
- "nccl + counts": the same after the per-expert counts' all-to-all and their read on the host
  (what MoELayer does: the step's one host synchronization);
- "device dispatch": torch.ops.symm_mem.all_to_all_vdev_2d, split sizes on the device, rows
  arriving grouped by local expert with each expert's rows aligned (the grouped GEMM's
  layout, which MoELayer makes with a second copy);
- "device combine": all_to_all_vdev_2d_offset, the way back;
- "device both, CUDA graph": dispatch then combine captured in one CUDA graph and replayed.
The device rows are checked against NCCL's (every received row and the way back bit-equal);
each time is the slowest rank's mean over --reps calls (CUDA events) after warm-up.
Needs NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available()); rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def mean_ms(fn, reps: int, warmup: int = 5) -> float:
    """The slowest rank's mean milliseconds of fn() over reps calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / reps], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


class Buffers:
    """Symmetric-memory buffers for up to `rows` rows a rank: the rows sent, received (every
    rank's rows plus each expert's alignment) and combined back, and the split tables."""

    def __init__(self, rows: int, hidden: int, experts: int, align: int, group_name: str):
        from torch.distributed import _symmetric_memory as symm_mem

        p = dist.get_world_size()
        dev = torch.device("cuda", torch.cuda.current_device())
        bf16, i64 = torch.bfloat16, torch.int64
        self.send = symm_mem.empty(rows, hidden, dtype=bf16, device=dev)
        self.recv = symm_mem.empty(p * rows + experts * align, hidden, dtype=bf16, device=dev)
        self.back = symm_mem.empty(rows, hidden, dtype=bf16, device=dev)
        self.send_splits = symm_mem.empty(experts, dtype=i64, device=dev)
        self.recv_table = symm_mem.empty(2, experts, dtype=i64, device=dev)
        self.back_table = symm_mem.empty(2, experts, dtype=i64, device=dev)
        for t in vars(self).values():
            symm_mem.rendezvous(t, group=group_name)
        self.group_name, self.align = group_name, align

    def dispatch(self) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d(
            self.send, self.recv, self.send_splits, self.recv_table, self.group_name,
            major_align=self.align,
        )  # fmt: skip

    def combine(self) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(
            self.recv, self.back, self.recv_table, self.back_table, self.group_name
        )


def exchange(buf: Buffers, tokens: int, args) -> dict:
    """One token count's rows: times, and whether the device exchange equals NCCL's."""
    p, rank = dist.get_world_size(), dist.get_rank()
    rows, el = tokens * args.top_k, args.experts // p
    gen = torch.Generator(device="cuda").manual_seed(rank + tokens)
    expert = torch.randint(args.experts, (rows,), device="cuda", generator=gen).sort().values
    counts = torch.bincount(expert, minlength=args.experts)
    values = torch.arange(rows, device="cuda") % 64 + 64 * rank  # which rank, which row
    send = buf.send[:rows]
    send.copy_(values[:, None].to(torch.bfloat16).expand(rows, args.hidden))
    buf.send_splits.copy_(counts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_split = counts.view(p, el).sum(1).tolist()
    recv_split = recv_counts.view(p, el).sum(1).tolist()
    nccl_out = torch.empty(sum(recv_split), args.hidden, dtype=torch.bfloat16, device="cuda")

    def nccl() -> None:
        dist.all_to_all_single(nccl_out, send, recv_split, send_split)

    def nccl_with_counts() -> None:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        split = received.view(p, el).sum(1).tolist()  # the host read
        out = torch.empty(sum(split), args.hidden, dtype=torch.bfloat16, device="cuda")
        dist.all_to_all_single(out, send, split, send_split)

    result = {"tokens": tokens, "rows": rows, "MB_sent": rows * args.hidden * 2 / 2**20}
    result["nccl_ms"] = mean_ms(nccl, args.reps)
    result["nccl_counts_ms"] = mean_ms(nccl_with_counts, args.reps)
    result["dispatch_ms"] = mean_ms(buf.dispatch, args.reps)
    result["combine_ms"] = mean_ms(buf.combine, args.reps)
    nccl()
    result["exact"] = bool(_matches(buf, nccl_out, recv_counts, p, el) and _round_trip(buf, send))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        buf.dispatch()
        buf.combine()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        buf.dispatch()
        buf.combine()
    result["graph_ms"] = mean_ms(graph.replay, args.reps)
    buf.back[:rows].zero_()
    graph.replay()
    result["graph_exact"] = bool(_round_trip(buf, send, run=False))
    return result


def _matches(buf: Buffers, nccl_out, recv_counts, p: int, el: int) -> bool:
    """Every (expert, source rank) chunk of the device dispatch equals NCCL's rows."""
    buf.dispatch()
    torch.cuda.synchronize()
    sizes, starts = buf.recv_table.tolist()
    counts = recv_counts.tolist()  # [source rank][local expert]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    ok = True
    for j in range(el):
        for r in range(p):
            chunk, n = j * p + r, counts[r * el + j]
            got = buf.recv[starts[chunk] : starts[chunk] + sizes[chunk]]
            want = nccl_out[offsets[r * el + j] : offsets[r * el + j] + n]
            ok = ok and sizes[chunk] == n and torch.equal(got, want)
    return ok


def _round_trip(buf: Buffers, send, run: bool = True) -> bool:
    """The combine returns every row to its place."""
    if run:
        buf.dispatch()
        buf.combine()
    torch.cuda.synchronize()
    return torch.equal(buf.back[: send.shape[0]], send)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--align", type=int, default=16)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)  # NVSHMEM's teams are bound to one indexed device
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            raise SystemExit("NVSHMEM is not available to this torch: nothing to measure")
        symm_mem.set_backend("NVSHMEM")
        buf = Buffers(
            max(args.tokens) * args.top_k, args.hidden, args.experts, args.align,
            dist.group.WORLD.group_name,
        )  # fmt: skip
        results = [exchange(buf, tokens, args) for tokens in args.tokens]
        if dist.get_rank() == 0:
            _report(results, args)
    finally:
        dist.destroy_process_group()


def _report(results: list[dict], args) -> None:
    p = dist.get_world_size()
    print(
        f"{p} ranks, {args.experts} experts top-{args.top_k}, hidden {args.hidden} bf16, "
        f"{torch.cuda.get_device_name()}; ms a call, slowest rank"
    )
    head = ("tokens/rank", "MB/rank", "nccl", "nccl+counts", "dispatch", "combine", "graph both")
    print("".join(f"{h:>12s}" for h in head), "  exact")
    for r in results:
        keys = ("nccl_ms", "nccl_counts_ms", "dispatch_ms", "combine_ms", "graph_ms")
        times = [r[key] for key in keys]
        line = f"{r['tokens']:12d}{r['MB_sent']:12.1f}" + "".join(f"{t:12.3f}" for t in times)
        print(line, "  yes" if r["exact"] and r["graph_exact"] else "  NO")
    if args.json:
        args.json.write_text(json.dumps({"ranks": p, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
