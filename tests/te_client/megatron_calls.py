"""Megatron-Core 0.19's calls into Transformer Engine, made through torchte's alias without
Megatron (CI has no Python 3.12 for it): its import statements on the TE-spec, MoE, optimizer,
checkpoint and CUDA-graph paths, its wrappers' pattern (a subclass that sets attributes after
construction), set_save_original_input, and the fused paths it turns on (router, permutation,
cross entropy, fused QKV RoPE, FusedAdam with multi_tensor_* clipping). Run by
tests/test_megatron_client.py; prints "ok" when every call behaved as Megatron needs.

    python -m torchte.alias tests/te_client/megatron_calls.py
"""

from __future__ import annotations

import warnings

import torch

# Megatron-Core's import statements on the paths the alias serves (module, names).
IMPORTS = [
    ("transformer_engine.pytorch.distributed", ["activation_recompute_forward", "checkpoint"]),
    ("transformer_engine.pytorch.distributed", ["get_all_rng_states"]),
    ("transformer_engine.pytorch.distributed", ["is_fp8_activation_recompute_enabled"]),
    ("transformer_engine.pytorch.distributed", ["gather_along_first_dim"]),
    ("transformer_engine.pytorch.distributed", ["reduce_scatter_along_first_dim"]),
    ("transformer_engine.pytorch.fp8", ["FP8GlobalStateManager", "fp8_autocast", "fp8_model_init"]),
    ("transformer_engine.pytorch.router", ["fused_topk_with_score_function"]),
    ("transformer_engine.pytorch.router", ["fused_compute_score_for_moe_aux_loss"]),
    ("transformer_engine.pytorch.router", ["fused_moe_aux_loss"]),
    ("transformer_engine.pytorch.permutation", ["moe_permute", "moe_permute_with_probs"]),
    ("transformer_engine.pytorch.permutation", ["moe_sort_chunks_by_index", "moe_unpermute"]),
    ("transformer_engine.pytorch.permutation", ["moe_sort_chunks_by_index_with_probs"]),
    ("transformer_engine.pytorch.permutation", ["moe_permute_and_pad_with_probs"]),
    ("transformer_engine.pytorch.cross_entropy", ["parallel_cross_entropy"]),
    ("transformer_engine.pytorch.optimizers", ["FusedAdam", "FusedSGD", "multi_tensor_applier"]),
    ("transformer_engine.pytorch.optimizers", ["multi_tensor_scale", "multi_tensor_l2norm"]),
    ("transformer_engine.pytorch.optimizers", ["multi_tensor_scale_tensor"]),
    ("transformer_engine.pytorch.tensor", ["QuantizedTensor"]),
    ("transformer_engine.pytorch.quantized_tensor", ["QuantizedTensor"]),
    ("transformer_engine.pytorch.tensor.utils", ["cast_master_weights_to_fp8"]),
    ("transformer_engine.pytorch.tensor.utils", ["replace_raw_data", "quantize_master_weights"]),
    ("transformer_engine.pytorch.tensor.utils", ["post_all_gather_processing"]),
    ("transformer_engine.pytorch.graph", ["make_graphed_callables"]),
    ("transformer_engine.pytorch.graph", ["save_fp8_tensors", "restore_fp8_tensors"]),
    ("transformer_engine.pytorch.graph", ["set_capture_start", "set_capture_end"]),
    ("transformer_engine.pytorch.utils", ["make_weak_ref"]),
    ("transformer_engine.pytorch.module.base", ["TransformerEngineBaseModule", "get_dummy_wgrad"]),
    ("transformer_engine.pytorch.attention.rope", ["apply_rotary_pos_emb"]),
    ("transformer_engine.pytorch.attention.rope", ["apply_fused_qkv_rotary_pos_emb"]),
    ("transformer_engine.pytorch.cpu_offload", ["get_cpu_offload_context"]),
    ("transformer_engine.pytorch.ops", ["GroupedLinear", "ScaledSwiGLU"]),
    ("transformer_engine.pytorch", ["Fp8Padding", "Fp8Unpadding", "quantized_model_init"]),
    ("transformer_engine.common.recipe", ["DelayedScaling", "Format"]),
    ("transformer_engine.pytorch.tensor.mxfp8_tensor", ["MXFP8Tensor"]),
    ("transformer_engine.pytorch.tensor.float8_blockwise_tensor", ["Float8BlockwiseQTensor"]),
]


def check_imports() -> None:
    """Every import statement Megatron makes on these paths succeeds."""
    for module, names in IMPORTS:
        exec(f"from {module} import {', '.join(names)}", {})


def check_version_gates() -> None:
    """Megatron's is_te_min_version reads importlib.metadata: the gates up to 2.14 pass."""
    from importlib.metadata import version

    from packaging.version import Version

    assert Version(version("transformer-engine")) >= Version("2.14.0")


def check_wrapper_pattern() -> None:
    """TELinear's pattern: subclass, set attributes after super().__init__ and per forward,
    set_save_original_input; no warning (the suite makes RuntimeWarning an error)."""
    import transformer_engine as te

    class ClientLinear(te.pytorch.Linear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.te_quant_params = None
            self.is_first_microbatch = True

        def forward(self, x):
            out = super().forward(x, is_first_microbatch=self.is_first_microbatch)
            self.is_first_microbatch = False
            return out

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = ClientLinear(32, 16, bias=False, params_dtype=torch.float32, device="cpu")
        if not hasattr(layer, "save_original_input"):
            raise AssertionError("set_save_original_input needs the attribute (TE >= 2.6)")
        layer.save_original_input = True
        recipe = te.common.recipe.Float8CurrentScaling()
        with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
            layer(torch.randn(16, 32)).sum().backward()
    assert layer.fp8 and layer.fp8_meta["fp8_checkpoint"] is False


def check_block_recipes() -> None:
    """fp8_recipe="blockwise" / "mxfp8": Megatron builds the recipe from
    te.common.recipe with its fp8_format and trains TE layers and TEGroupedLinear under it."""
    import transformer_engine as te

    fmt = te.common.recipe.Format.E4M3
    for recipe in (
        te.common.recipe.Float8BlockScaling(fp8_format=fmt),
        te.common.recipe.MXFP8BlockScaling(fp8_format=fmt),
    ):
        linear = te.pytorch.Linear(64, 32, params_dtype=torch.float32, device="cpu")
        grouped = te.pytorch.GroupedLinear(2, 64, 32, params_dtype=torch.float32, device="cpu")
        x = torch.randn(64, 64, requires_grad=True)
        with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = linear(x) + grouped(x, [32, 32])
        y.sum().backward()
        assert torch.isfinite(x.grad).all() and linear.weight.grad is not None


def check_blockwise_fp8_params() -> None:
    """--fp8-param-gather under fp8_recipe="blockwise" (fp8_utils, TE >= 2.x branch): the
    parameters' bytes moved into the distributed optimizer's buffer (replace_raw_data), the
    fp32 master slices cast into them (cast_master_weights_to_fp8 with
    manual_post_all_gather_processing), the columnwise copies remade after the gather
    (post_all_gather_processing), then a training step reading them."""
    import transformer_engine as te
    from transformer_engine.pytorch.tensor import utils

    recipe = te.common.recipe.Float8BlockScaling(fp8_format=te.common.recipe.Format.E4M3)
    with te.pytorch.fp8_model_init(enabled=True, recipe=recipe):
        layer = te.pytorch.Linear(256, 128, params_dtype=torch.float32, device="cpu")
    weight = layer.weight
    buffer = torch.zeros(weight.numel(), dtype=torch.uint8)
    utils.replace_raw_data(weight, buffer)
    master = weight.dequantize().float().reshape(-1) * 0.5
    # Each call below stands for one rank and, with no group, scales a tile by the amax of its
    # own piece: the two halves of every 128x128 tile are given the same amax, as Megatron's
    # ranks agree on it through their all-reduce (otherwise the second call's scale would read
    # the first call's bytes wherever the halves' amaxes fall in different binades).
    grid = master.view(128, 256)
    for cols in (slice(0, 128), slice(128, 256)):
        peak = grid[:, cols].abs().max()
        grid[0, cols.start] = grid[64, cols.start] = peak
    half = master.numel() // 2
    for start in (0, half):  # two "ranks'" slices, each cut inside a 128x128 tile
        piece = master[start : start + half]
        utils.cast_master_weights_to_fp8(
            [weight], [piece], [start], None, manual_post_all_gather_processing=True
        )
    utils.post_all_gather_processing([weight])
    assert weight._rowwise_data.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(weight.dequantize().float().reshape(-1), master, rtol=0.07, atol=0)
    x = torch.randn(32, 256, requires_grad=True)
    with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
        layer(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def check_moe_fused_paths() -> None:
    """The router, permutation and aux loss calls of Megatron's moe_utils, in its order."""
    from transformer_engine.pytorch.permutation import moe_permute_with_probs, moe_unpermute
    from transformer_engine.pytorch.router import (
        fused_compute_score_for_moe_aux_loss,
        fused_moe_aux_loss,
        fused_topk_with_score_function,
    )

    tokens, experts, topk, hidden = 24, 4, 2, 16
    logits = torch.randn(tokens, experts, requires_grad=True)
    probs, routing_map = fused_topk_with_score_function(
        logits=logits,
        topk=topk,
        use_pre_softmax=False,
        num_groups=None,
        group_topk=None,
        scaling_factor=None,
        score_function="softmax",
        expert_bias=None,
    )
    routing_map_aux, scores = fused_compute_score_for_moe_aux_loss(
        logits=logits, topk=topk, score_function="softmax"
    )
    aux = fused_moe_aux_loss(
        probs=scores,
        tokens_per_expert=routing_map_aux.sum(dim=0),
        total_num_tokens=tokens,
        num_experts=experts,
        topk=topk,
        coeff=1e-2,
    )
    x = torch.randn(tokens, hidden, requires_grad=True)
    permuted, permuted_probs, row_id_map = moe_permute_with_probs(
        x, probs, routing_map, num_out_tokens=tokens * topk
    )
    out = moe_unpermute(
        permuted * permuted_probs.unsqueeze(-1),
        row_id_map,
        restore_shape=x.shape,
        map_type="mask",
    )
    (out.sum() + aux).backward()
    assert out.shape == x.shape and logits.grad is not None and x.grad is not None


def check_cross_entropy_and_rope() -> None:
    """te_parallel_cross_entropy's call (positional, as Megatron makes it) and the fused
    single-QKV RoPE."""
    from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    logits = torch.randn(8, 2, 50, requires_grad=True)
    labels = torch.randint(0, 50, (8, 2))
    loss = parallel_cross_entropy(logits, labels, 0.0, False, None, -100, False)
    loss.sum().backward()
    assert loss.shape == (8, 2)
    seq, batch, groups, per, dim = 6, 2, 2, 2, 8
    qkv = torch.randn(seq, batch, groups, (per + 2) * dim)
    freqs = torch.randn(seq, 1, 1, dim)
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [per * dim, dim, dim])
    assert q.shape == (seq, batch, groups * per, dim) and k.shape == v.shape


def check_optimizer_and_clipping() -> None:
    """Megatron's optimizer choice (TE's FusedAdam) and clip_grads' multi_tensor calls."""
    from transformer_engine.pytorch.optimizers import (
        FusedAdam,
        multi_tensor_applier,
        multi_tensor_l2norm,
        multi_tensor_scale,
    )

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    flag = torch.zeros(1, dtype=torch.int)
    grads = [p.grad for p in params]
    norm, _ = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], False)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    assert torch.allclose(norm.squeeze(), expected)
    multi_tensor_applier(multi_tensor_scale, flag, [grads, grads], 0.5)
    FusedAdam(params, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8).step()
    assert int(flag) == 0


def main() -> None:
    check_imports()
    check_version_gates()
    check_wrapper_pattern()
    check_block_recipes()
    check_blockwise_fp8_params()
    check_moe_fused_paths()
    check_cross_entropy_and_rope()
    check_optimizer_and_clipping()
    print("ok")


if __name__ == "__main__":
    main()
