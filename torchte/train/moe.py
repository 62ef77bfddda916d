"""A mixture-of-experts MLP: te.LayerNorm (or te.RMSNorm), a router, and te.ops' fused grouped
MLP (grouped FC1 -> activation (GELU by default) times the router's probabilities -> grouped FC2
whose bias is scaled the same way).

Legend: T tokens (batch x sequence), H hidden, F the experts' hidden width, E experts, k experts
per token, A = T k assignments (assignment a = t k + j is token t's j-th choice), P rows of
the permuted buffer (each expert's assignments, padded to a multiple of EXPERT_ALIGN).

Each token goes to the k experts with the largest router logits, weighted by the softmax over
those k logits. The assignments are gathered expert by expert into one (P, H) buffer, each
expert's rows padded with zero rows to a multiple of 16, and the padding rows are dropped
afterwards, so they reach neither the output nor any gradient. With DEVICE_SPLITS the sizes stay
on the device: the buffer has the rows any routing could need, the unused ones given
to the last expert (zero rows, gate 0), and no step waits for the router's result. The
grouped FP8 GEMMs want aligned splits; in bf16 the padding keeps the set of GEMM shapes small,
which matters on the CPU, where the GEMM library keeps code and buffers per shape (memory grows
with every new token count otherwise).

Each assignment's gate (its router probability) multiplies the activation inside the fused
kernel and FC2's bias (scale_bias), so FC2's output row is already gate * expert(x): the
assignments of a token are then only summed. Under FP8 the activation, the gate and the
quantization of FC2's input are one kernel, and so is their backward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

import torchte as te
from torchte.kernels.activation import is_gated

EXPERT_ALIGN = 16
# Whether the group sizes stay on the device, so that nothing in a step waits for the router
# (None: on a GPU). Off by default: on an H100 the large MoE example trained 5-6% faster with the
# sizes read back (cuBLAS per expert for the FP8 backward GEMMs, faster than the Triton grouped
# GEMMs that device sizes need; docs/benchmarks.md). Device sizes are what CUDA graphs need.
DEVICE_SPLITS: bool | None = False
# The activations an expert MLP can use: te.ops' activations times a per-row scale (the gate).
SCALED_ACTIVATIONS = {
    "gelu": "ScaledGELU",
    "geglu": "ScaledGEGLU",
    "glu": "ScaledGLU",
    "qgelu": "ScaledQGELU",
    "qgeglu": "ScaledQGEGLU",
    "relu": "ScaledReLU",
    "reglu": "ScaledReGLU",
    "srelu": "ScaledSReLU",
    "sreglu": "ScaledSReGLU",
    "silu": "ScaledSiLU",
    "swiglu": "ScaledSwiGLU",
}


def route(
    experts_Tk: torch.Tensor, num_experts: int, align: int, on_device: bool = False
) -> tuple[torch.Tensor, list | torch.Tensor, int]:
    """Where each assignment goes in the permuted buffer: (dest (A,) int64 row of assignment
    a, m_splits: the E padded group sizes, P: the buffer's rows). On the host (a list) each
    size is a multiple of `align` and P their sum, read back from the device (one
    synchronization); with on_device the sizes stay a device tensor and P is the most any
    routing needs, A + E (align - 1), the rows no expert fills going to the last expert."""
    flat_A = experts_Tk.reshape(-1)
    order_A = torch.argsort(flat_A, stable=True)  # assignments grouped by expert, in token order
    counts_E = torch.bincount(flat_A, minlength=num_experts)
    padded_E = (counts_E + align - 1) // align * align
    start_E = torch.cumsum(counts_E, 0) - counts_E
    padded_start_E = torch.cumsum(padded_E, 0) - padded_E
    expert_sorted = flat_A[order_A]
    rank = torch.arange(flat_A.numel(), device=flat_A.device) - start_E[expert_sorted]
    dest_A = torch.empty_like(flat_A)
    dest_A[order_A] = padded_start_E[expert_sorted] + rank
    if not on_device:
        m_splits = padded_E.tolist()
        return dest_A, m_splits, sum(m_splits)
    rows = flat_A.numel() + num_experts * (align - 1)
    padded_E[-1] += rows - padded_E.sum()
    return dest_A, padded_E, rows


class MoEMLP(nn.Module):
    """x (..., H) -> y (..., H): norm, top-k routing, per-expert MLPs, weighted sum.
    Gated activations (swiglu, geglu, ...) make FC1 2F wide."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
        init: Callable[[torch.Tensor], None],
        out_init: Callable[[torch.Tensor], None],
        normalization: str = "LayerNorm",
        activation: str = "gelu",
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        kw = {"params_dtype": dtype, "device": device}
        self.norm = (te.RMSNorm if normalization == "RMSNorm" else te.LayerNorm)(hidden, **kw)
        # The router stays in fp32: its logits decide discrete choices.
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device)
        init(self.router.weight)
        ops = {"dtype": dtype, "device": device}
        fc1_width = 2 * ffn if is_gated(activation) else ffn
        self.experts = te.ops.Sequential(
            OrderedDict(
                fc1=te.ops.GroupedLinear(num_experts, hidden, fc1_width, init_method=init, **ops),
                act=getattr(te.ops, SCALED_ACTIVATIONS[activation])(),
                fc2=te.ops.GroupedLinear(
                    num_experts, ffn, hidden, init_method=out_init, scale_bias=True, **ops
                ),
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH = x.reshape(-1, x.shape[-1])
        z_TH = self.norm(x_TH)
        with torch.autocast(x.device.type, enabled=False):
            logits_TE = self.router(z_TH.float())
        top_logits_Tk, experts_Tk = logits_TE.topk(self.top_k, dim=-1)
        gates_Tk = top_logits_Tk.softmax(dim=-1)
        on_device = x.is_cuda if DEVICE_SPLITS is None else DEVICE_SPLITS
        dest_A, m_splits, rows = route(experts_Tk, self.num_experts, EXPERT_ALIGN, on_device)
        z_AH = z_TH.repeat_interleave(self.top_k, dim=0)
        z_PH = z_TH.new_zeros(rows, z_TH.shape[1]).index_copy(0, dest_A, z_AH)
        # the padding rows get gate 0: their output is 0 (and dropped anyway)
        gates_P = gates_Tk.new_zeros(rows).index_copy(0, dest_A, gates_Tk.reshape(-1))
        y_PH = self.experts(z_PH, m_splits, gates_P, m_splits, gates_P)
        y_TkH = y_PH[dest_A].view(*experts_Tk.shape, -1)  # padding rows dropped here
        y_TH = y_TkH.float().sum(dim=1)
        return y_TH.to(x.dtype).view(x.shape)
