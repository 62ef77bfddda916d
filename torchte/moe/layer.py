"""te.moe.MoELayer: a whole mixture-of-experts layer (router, dropless token permutation, the
experts' fused grouped MLP, an optional shared expert, the load-balancing loss). Transformer
Engine has no such class: it is torchte's own, built from Transformer Engine's pieces (the
router fusions, moe_permute / moe_unpermute, te.ops' grouped MLP).

Legend: T tokens (the flattened leading dims of x), H hidden, F the experts' hidden width, E
experts, k experts per token, P rows of the permuted buffer (each expert's rows padded to a
multiple of EXPERT_ALIGN, plus, with device splits, the spare rows no routing fills).

Where the router probabilities are applied: inside the grouped MLP. Each permuted row's
probability is the per-row scale of the Scaled* activation and, with bias=True, of FC2's bias
(scale_bias), so FC2's output row is already p * expert(x); moe_unpermute is then called without
merging_probs, a plain (fp32-accumulated) sum of each token's k rows. The probabilities'
gradient reaches the router through the MLP's row scales and the permutation.

Split sizes: on the host (a list; one host synchronization per call, which also checks the
router logits for NaN) or on the device (an integer tensor; nothing in a call waits for the
device, so a CUDA graph can capture a step). With device splits the buffer has the most rows
any routing can need, T k + E (EXPERT_ALIGN - 1), the spare ones (zero rows, probability 0)
given to the last expert.

Expert parallelism (ep_group of P ranks): this rank holds experts [r E / P, (r + 1) E / P) of
the E (its grouped MLP has E / P groups); its T tokens are routed over all E experts, their k
copies sent with their probabilities to the ranks holding their experts by an all-to-all (the
counts exchanged first, read on the host once a call), grouped by local expert and padded
there, run through the local experts and sent back by the inverse all-to-all, where each
token's k rows are summed (torchte/distributed/expert_parallel.py). With a shared expert on
NCCL, its MLP runs while the dispatch all-to-all is in flight (ep_overlap).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._device import default_device
from .._group_splits import group_splits
from ..distributed.expert_parallel import (
    DispatchPlan,
    ExpertParallel,
    combine,
    dispatch,
    exchange_counts,
    overlaps,
    pad_rows,
    unpad_rows,
)
from ..kernels.activation import is_gated
from ..kernels.permutation import mask_row_id_map
from ..module.norm import LayerNorm, RMSNorm
from ..ops import basic as ops_basic
from ..ops.sequential import Sequential
from ._fused_permute import GatherQuantize, fp8_input_quantizer
from ._permutation_functions import MaskPermute, Plan
from .permutation import moe_permute_and_pad_with_probs, moe_unpermute
from .router import (
    _check_groups,
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

__all__ = ["EXPERT_ALIGN", "MoELayer"]

# Rows of each expert padded to a multiple of this: FP8 grouped GEMMs need it, and it keeps the
# set of GEMM shapes small.
EXPERT_ALIGN = 16
# activation name -> te.ops class name (the expert MLP's is "Scaled" + this: times the prob)
_ACTIVATIONS = {
    "gelu": "GELU",
    "geglu": "GEGLU",
    "glu": "GLU",
    "qgelu": "QGELU",
    "qgeglu": "QGEGLU",
    "relu": "ReLU",
    "reglu": "ReGLU",
    "srelu": "SReLU",
    "sreglu": "SReGLU",
    "silu": "SiLU",
    "swiglu": "SwiGLU",
}
_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
_ROUTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MoELayer(nn.Module):
    """x (..., H) -> y (..., H): top-k routing, the experts' MLPs (each token's k outputs times
    their router probabilities, summed), plus a shared expert on every token when asked for.

    Arguments (Megatron-Core's router names where it has them):
    hidden_size H, ffn_hidden_size F (FC1 is 2F wide for a gated activation), num_experts E,
    top_k k (1 <= k <= E); score_function "softmax" (top-k of the logits, softmax over the k
    chosen), "sigmoid" or "sqrtsoftplus" (normalized over the k chosen when k > 1);
    activation: one of gelu, geglu, glu, qgelu, qgeglu, relu, reglu, srelu, sreglu, silu,
    swiglu; num_groups / group_topk: group-limited routing (top group_topk of num_groups
    expert groups); expert_bias: a float32 (E,) buffer `expert_bias` (zeros) added to the
    scores for the choice only (sigmoid / sqrtsoftplus), with a buffer
    `local_tokens_per_expert` (E,) float32 that each forward adds its routed counts to, for the
    caller's bias update (it zeroes it itself); scaling_factor multiplies the probabilities;
    shared_expert_ffn_hidden_size: width of a shared expert MLP (same activation) run on every
    token and added; aux_loss_coeff > 0: the load-balancing loss (Switch
    Transformer's, as Megatron-Core's "aux_loss": E * coeff / (k T^2) * sum_e f_e P_e, from
    the scores without expert bias) is computed every forward and kept as `self.aux_loss`, a
    0-dim fp32 tensor in the autograd graph that the caller adds to its loss (None when
    aux_loss_coeff is 0); router_dtype: the router weight's and logits' dtype (float32 by
    default: the logits make discrete choices); params_dtype: the experts' weights' dtype
    (None: torch's default); init_method / output_layer_init_method: init of the router and
    FC1 weights / of FC2 weights (None: te.ops.GroupedLinear's default, nn.Linear's for the
    router); device_splits: whether the experts' row counts stay on the device (None: on a
    GPU yes, on the CPU no (a host list)); normalization: None, "LayerNorm" or "RMSNorm", a
    te norm (`norm`) applied to x before everything else (the router, the experts and the
    shared expert all see its output); bias: FC1 / FC2 biases for every expert (FC2's
    scaled by the probability) and the shared expert (default False, as Megatron-Core's
    experts); single_grouped_weight: each expert GEMM's weights as one (E, N, K) parameter
    `weight` (and biases as one (E, N) `bias`) instead of E parameters weight0..weight{E-1}
    (te.ops.GroupedLinear's layouts): the same values and outputs, one gradient per GEMM
    instead of one per expert (less host time a step where the host is the slower side);
    fuse_permute_cast: with device splits under FP8 delayed or current scaling (and x in the
    experts' compute dtype), the experts' FP8 input is cast straight from the tokens by the
    permutation's gather (_fused_permute.py), the permuted rows never written in high
    precision; the same bits as without (default False: on an H200 at the large training
    example's shape a layer step took 1.5% longer fused, docs/benchmarks.md); ep_group: a
    process group over which the experts are split (expert parallelism, above; P must divide
    E; host split sizes only: device_splits=True with more than one rank raises); ep_overlap:
    under expert parallelism on NCCL, the shared expert runs while the dispatch all-to-all is
    in flight (default True). Expert parameters carry Megatron-Core's `allreduce` attribute
    (False under expert parallelism: their gradients are not reduced over the data-parallel
    ranks of the dense parameters) and `tensor_model_parallel` = False.

    Router logits with NaN raise a ValueError naming the layer wherever the split sizes are
    read on the host (every CPU call, GPU calls with host splits). With device splits on a GPU
    nothing can be checked without a synchronization: the tokens whose logits hold NaN get NaN
    outputs instead (never another token's, never silently finite).

    Submodules: `router` (nn.Linear H -> E, no bias), `experts` (te.ops.Sequential fc1 /
    act / fc2 of te.ops.GroupedLinear), `shared_experts` (te.ops.Sequential of
    te.ops.Linear, or None). Under te.autocast the experts (and the shared expert) run in FP8;
    the router stays in router_dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_function: str = "softmax",
        activation: str = "swiglu",
        num_groups: int | None = None,
        group_topk: int | None = None,
        expert_bias: bool = False,
        scaling_factor: float | None = None,
        shared_expert_ffn_hidden_size: int | None = None,
        aux_loss_coeff: float = 0.0,
        router_dtype: torch.dtype = torch.float32,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
        output_layer_init_method: Callable[[torch.Tensor], None] | None = None,
        device_splits: bool | None = None,
        bias: bool = False,
        normalization: str | None = None,
        single_grouped_weight: bool = False,
        fuse_permute_cast: bool = False,
        ep_group=None,
        ep_overlap: bool = True,
    ) -> None:
        super().__init__()
        _check_args(
            hidden_size, ffn_hidden_size, num_experts, top_k, score_function, activation,
            expert_bias, shared_expert_ffn_hidden_size, aux_loss_coeff, router_dtype,
        )  # fmt: skip
        _check_groups(num_groups, group_topk, top_k, num_experts)
        device = default_device(device)
        dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function, self.activation = score_function, activation
        self.num_groups, self.group_topk = num_groups, group_topk
        self.scaling_factor = scaling_factor
        self.aux_loss_coeff, self.router_dtype = float(aux_loss_coeff), router_dtype
        self.device_splits, self.bias = device_splits, bool(bias)
        self.fuse_permute_cast = bool(fuse_permute_cast)
        self._ep = _expert_parallel(ep_group, num_experts, device_splits)
        self.ep_group, self.ep_overlap = ep_group, bool(ep_overlap)
        local_experts = num_experts if self._ep is None else self._ep.num_local
        self.norm = None
        if normalization is not None:
            if normalization not in ("LayerNorm", "RMSNorm"):
                raise ValueError(
                    f"MoELayer: normalization must be None, 'LayerNorm' or 'RMSNorm', got "
                    f"{normalization!r}"
                )
            norm = RMSNorm if normalization == "RMSNorm" else LayerNorm
            self.norm = norm(hidden_size, params_dtype=dtype, device=device)
        self.router = nn.Linear(
            hidden_size, num_experts, bias=False, device=device, dtype=router_dtype
        )
        if init_method is not None:
            with torch.no_grad():
                init_method(self.router.weight)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(num_experts, device=device))
        else:
            self.expert_bias = None
        if not isinstance(single_grouped_weight, bool):
            raise TypeError(
                f"MoELayer: single_grouped_weight must be a bool, got {single_grouped_weight!r}"
            )
        self.experts = _expert_mlp(
            local_experts, hidden_size, ffn_hidden_size, activation, dtype, device,
            init_method, output_layer_init_method, self.bias, single_grouped_weight,
        )  # fmt: skip
        for param in self.experts.parameters():  # what Megatron-Core's DDP and optimizer read
            param.allreduce = self._ep is None
            param.tensor_model_parallel = False
        self.shared_experts = None
        if shared_expert_ffn_hidden_size is not None:
            self.shared_experts = _shared_mlp(
                hidden_size, shared_expert_ffn_hidden_size, activation, dtype, device,
                init_method, output_layer_init_method, self.bias,
            )  # fmt: skip
        self.aux_loss: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_function={self.score_function!r}, activation={self.activation!r}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) in the experts' dtype (or any float dtype) -> y (..., H) in x's dtype."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"MoELayer: x must be (..., hidden_size={self.hidden_size}), got {got}"
            )
        x_TH = x.reshape(-1, self.hidden_size)
        if self.norm is not None:
            x_TH = self.norm(x_TH)
        logits_TE = self._logits(x_TH)
        probs_TE, map_TE = fused_topk_with_score_function(
            logits_TE, self.top_k, False, self.num_groups, self.group_topk,
            self.scaling_factor, self.score_function, self.expert_bias,
        )  # fmt: skip
        counts_E = map_TE.sum(0)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.local_tokens_per_expert.add_(counts_E)
        on_device = x.is_cuda if self.device_splits is None else bool(self.device_splits)
        on_device = on_device and self._ep is None  # expert parallelism: host splits
        checked = not on_device or not x.is_cuda
        shared_TH = None
        if self._ep is not None:
            y_TH, shared_TH = self._experts_parallel(x_TH, probs_TE, map_TE, counts_E, logits_TE)
        elif on_device:
            x_PH, probs_P, row_id_map, pad_offsets, m_splits = self._permute_on_device(
                x_TH, probs_TE, map_TE, counts_E, logits_TE if checked else None
            )
        else:
            x_PH, probs_P, row_id_map, pad_offsets, m_splits = self._permute_on_host(
                x_TH, probs_TE, map_TE, counts_E, logits_TE
            )
        if self._ep is None:
            y_PH = self._run_experts(x_PH, probs_P, m_splits)
            # the probabilities were applied inside the MLP: a plain sum of each token's rows
            y_TH = moe_unpermute(y_PH, row_id_map, None, None, "mask", None, pad_offsets)
        if not checked:
            bad_T1 = torch.isnan(logits_TE).any(dim=-1, keepdim=True)
            y_TH = torch.where(bad_T1, torch.full_like(y_TH, float("nan")), y_TH)
        if self.shared_experts is not None:
            y_TH = y_TH + (self.shared_experts(x_TH) if shared_TH is None else shared_TH)
        self._set_aux_loss(logits_TE)
        return y_TH.to(x.dtype).view(x.shape)

    # ------------------------------------------------------------------------------------------

    def _logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """(T, E) router logits in router_dtype, outside torch.autocast (they choose)."""
        with torch.autocast(x_TH.device.type, enabled=False):
            return F.linear(x_TH.to(self.router_dtype), self.router.weight)

    def _run_experts(self, x_PH, probs_P, m_splits) -> torch.Tensor:
        """y (P, H): the grouped MLP on the padded rows; fc2's bias (with bias=True) is scaled
        by the probability too (scale_bias)."""
        extra = (probs_P,) if self.bias else ()
        return self.experts(x_PH, m_splits, probs_P, m_splits, *extra)

    def _experts_parallel(self, x_TH, probs_TE, map_TE, counts_E, logits_TE):
        """(y_TH, the shared expert's output or None): the routed experts' sum with the experts
        split over ep_group (the module's docstring); the shared expert runs under the
        dispatch all-to-all where that overlaps (NCCL), else the caller runs it."""
        ep = self._ep
        nan_flag = torch.isnan(logits_TE).any()
        counts, received, bad = exchange_counts(counts_E, ep, nan_flag)
        if bad:  # on every rank alike: the flags travel with the counts
            raise self._nan_error()
        plan = DispatchPlan.make(counts, received, ep, EXPERT_ALIGN, x_TH.device)
        routes = x_TH.shape[0] * self.top_k
        x_NH, row_id_map, probs_N = MaskPermute.apply(
            x_TH, map_TE, probs_TE, None, Plan(num_out_tokens=routes)
        )
        overlap = self.ep_overlap and self.shared_experts is not None and overlaps(ep.group)
        x_RH, probs_R, pending = dispatch(x_NH, probs_N, plan, async_op=overlap)
        shared_TH = self.shared_experts(x_TH) if overlap else None
        pending.wait()
        y_PH = self._run_experts(pad_rows(x_RH, plan), pad_rows(probs_R, plan), plan.m_splits)
        y_NH = combine(unpad_rows(y_PH, plan), plan)
        y_TH = moe_unpermute(y_NH, row_id_map, None, None, "mask", None, None)
        return y_TH, shared_TH

    def _nan_error(self) -> ValueError:
        return ValueError(
            f"MoELayer({self.extra_repr()}): the router logits hold NaN (check the layer's "
            "input and router weight)"
        )

    def _permute_on_host(self, x_TH, probs_TE, map_TE, counts_E, logits_TE):
        """The permutation with host split sizes: one read of (counts, NaN flag) from the
        device, then moe_permute_and_pad_with_probs with the counts on the host."""
        nan_flag = torch.isnan(logits_TE).any().reshape(1).to(counts_E.dtype)
        read = torch.cat([counts_E, nan_flag]).tolist()  # the one host synchronization
        if read[-1]:
            raise self._nan_error()
        counts_host = torch.tensor(read[:-1], dtype=torch.int64)
        x_PH, probs_P, row_id_map, pad_offsets, _ = moe_permute_and_pad_with_probs(
            x_TH, probs_TE, map_TE, counts_host, EXPERT_ALIGN
        )
        m_splits = [-(-c // EXPERT_ALIGN) * EXPERT_ALIGN for c in read[:-1]]
        return x_PH, probs_P, row_id_map, pad_offsets, m_splits

    def _permute_on_device(self, x_TH, probs_TE, map_TE, counts_E, logits_TE):
        """The permutation with device split sizes: a buffer of the most rows any routing
        needs, nothing read back. logits_TE (given where a check costs nothing: the CPU) is
        checked for NaN."""
        if logits_TE is not None and bool(torch.isnan(logits_TE).any()):
            raise self._nan_error()
        tokens = x_TH.shape[0]
        rows = tokens * self.top_k + self.num_experts * (EXPERT_ALIGN - 1) if tokens else 0
        counts_E = counts_E.long()
        target_E = (counts_E + EXPERT_ALIGN - 1) // EXPERT_ALIGN * EXPERT_ALIGN
        pads_E = target_E - counts_E
        pad_offsets = torch.cumsum(pads_E, 0) - pads_E
        m_splits = target_E.clone()
        m_splits[-1] += rows - target_E.sum()  # the spare rows (zero, prob 0) to the last expert
        fused = self._fused_cast(x_TH, probs_TE) if tokens else None
        if fused is not None:  # the FP8 cast of the permuted rows reads the tokens themselves
            return self._permute_and_cast(
                x_TH, probs_TE, map_TE, pad_offsets, m_splits, rows, *fused
            )
        x_PH, row_id_map, probs_P = MaskPermute.apply(
            x_TH, map_TE, probs_TE, pad_offsets, Plan(num_out_tokens=rows)
        )
        return x_PH, probs_P, row_id_map, pad_offsets, m_splits

    def _fused_cast(self, x_TH: torch.Tensor, probs_TE: torch.Tensor):
        """(quantizer, columnwise) of the experts' first GEMM's input where the permutation and
        its FP8 cast run as one (_fused_permute.py), else None."""
        if not self.fuse_permute_cast:
            return None
        requires_grad = torch.is_grad_enabled() and (
            x_TH.requires_grad
            or probs_TE.requires_grad
            or any(p.requires_grad for p in self.experts.parameters())
        )
        return fp8_input_quantizer(self.experts, x_TH, requires_grad)

    def _permute_and_cast(self, x_TH, probs_TE, map_TE, pad_offsets, m_splits, rows, quantizer,
                          columnwise):  # fmt: skip
        """_permute_on_device's outputs (a buffer of `rows` rows) with the permuted rows as the
        FP8 GroupedTensor the first GEMM reads (never written in high precision)."""
        row_id_map, counts = mask_row_id_map(map_TE)
        splits = group_splits(m_splits, self.num_experts, rows, x_TH.device)
        x_PH, probs_P = GatherQuantize.apply(
            x_TH, probs_TE, row_id_map, counts, pad_offsets, quantizer, splits, columnwise
        )
        return x_PH, probs_P, row_id_map, pad_offsets, m_splits

    def _set_aux_loss(self, logits_TE: torch.Tensor) -> None:
        """self.aux_loss: the load-balancing loss of this call (None when the coefficient is
        0; zero for zero tokens). Written into __dict__: no nn.Module.__setattr__ per call."""
        if self.aux_loss_coeff <= 0:
            return
        tokens = logits_TE.shape[0]
        if tokens == 0:
            loss = logits_TE.new_zeros((), dtype=torch.float32) + 0.0 * logits_TE.sum()
        else:
            aux_map_TE, scores_TE = fused_compute_score_for_moe_aux_loss(
                logits_TE, self.top_k, self.score_function
            )
            loss = fused_moe_aux_loss(
                scores_TE, aux_map_TE.sum(0), tokens, self.num_experts, self.top_k,
                self.aux_loss_coeff,
            )  # fmt: skip
        self.__dict__["aux_loss"] = loss


# ----------------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------------


def _expert_mlp(
    experts, hidden, ffn, activation, dtype, device, init, out_init, bias, single
) -> Sequential:
    """te.ops' grouped MLP: fc1 (E groups, H -> F or 2F), Scaled<act>, fc2 (F -> H); with
    bias, fc2's bias scaled by the row's probability like the activation (scale_bias);
    single: one (E, N, K) weight (and (E, N) bias) parameter per GEMM."""
    fc1_width = 2 * ffn if is_gated(activation) else ffn
    kw = {"bias": bias, "dtype": dtype, "device": device, "single_grouped_weight": single,
          "single_grouped_bias": single}  # fmt: skip
    return Sequential(
        OrderedDict(
            fc1=ops_basic.GroupedLinear(experts, hidden, fc1_width, init_method=init, **kw),
            act=getattr(ops_basic, "Scaled" + _ACTIVATIONS[activation])(),
            fc2=ops_basic.GroupedLinear(
                experts, ffn, hidden, init_method=out_init, scale_bias=bias, **kw
            ),
        )
    )


def _shared_mlp(hidden, ffn, activation, dtype, device, init, out_init, bias) -> Sequential:
    """The shared expert: te.ops.Linear H -> F (2F gated), the activation, te.ops.Linear F -> H
    (biases with bias)."""
    fc1_width = 2 * ffn if is_gated(activation) else ffn
    kw = {"bias": bias, "dtype": dtype, "device": device}
    mlp = Sequential(
        OrderedDict(
            fc1=ops_basic.Linear(hidden, fc1_width, **kw),
            act=getattr(ops_basic, _ACTIVATIONS[activation])(),
            fc2=ops_basic.Linear(ffn, hidden, **kw),
        )
    )
    with torch.no_grad():
        for name, fn in (("fc1", init), ("fc2", out_init)):
            if fn is not None:
                fn(getattr(mlp, name).weight)
    return mlp


def _expert_parallel(group, num_experts: int, device_splits) -> ExpertParallel | None:
    """The experts' split over `group` (None without one, or with one rank); ValueError
    unless its ranks divide num_experts, or with device_splits=True over several ranks."""
    if group is None:
        return None
    ep = ExpertParallel.of(group, num_experts)
    if ep.size == 1:
        return None
    if device_splits:
        raise ValueError(
            "MoELayer: expert parallelism exchanges the experts' row counts on the host (one "
            "synchronization a call): device_splits=True with an ep_group of "
            f"{ep.size} ranks is not supported (an all-to-all with device split sizes needs "
            "torch's NVSHMEM all_to_all_vdev); pass device_splits=False or None"
        )
    return ep


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MoELayer: {name} must be a positive int, got {value!r}")


def _check_args(
    hidden, ffn, experts, top_k, score_function, activation, expert_bias, shared_ffn, coeff,
    router_dtype,
) -> None:  # fmt: skip
    """ValueError naming the argument and the rule, at construction."""
    for name, value in (
        ("hidden_size", hidden),
        ("ffn_hidden_size", ffn),
        ("num_experts", experts),
        ("top_k", top_k),
    ):
        _check_positive(name, value)
    if top_k > experts:
        raise ValueError(f"MoELayer: top_k ({top_k}) must be <= num_experts ({experts})")
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(
            f"MoELayer: score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"MoELayer: activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
        )
    if expert_bias and score_function == "softmax":
        raise ValueError("MoELayer: expert_bias needs score_function sigmoid or sqrtsoftplus")
    if shared_ffn is not None:
        _check_positive("shared_expert_ffn_hidden_size", shared_ffn)
    if isinstance(coeff, bool) or not isinstance(coeff, int | float) or not coeff >= 0:
        raise ValueError(f"MoELayer: aux_loss_coeff must be a float >= 0, got {coeff!r}")
    if router_dtype not in _ROUTER_DTYPES:
        raise ValueError(
            f"MoELayer: router_dtype must be float32, bfloat16 or float16, got {router_dtype}"
        )
