"""A small training script written for Transformer Engine 2.x, with nothing else in it
(tests/test_alias_training.py runs it through the alias).

It uses what such scripts use: FP8 parameters (fp8_model_init), fp8_autocast with a
DelayedScaling recipe, make_graphed_callables with recipe=, deferred weight gradients
(delay_wgrad_compute with backward_dw) and the CPU offload context. It prints one line per step
and checks its own results.
"""

import torch
import torch.nn.functional as F
import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format

HIDDEN, FFN, TOKENS, STEPS = 64, 128, 32, 12


def build(device, recipe):
    with te.fp8_model_init(enabled=True, recipe=recipe):
        head = te.Linear(HIDDEN, HIDDEN, bias=True, params_dtype=torch.float32, device=device)
    norm_in = te.LayerNormLinear(
        HIDDEN, HIDDEN, params_dtype=torch.float32, device=device, delay_wgrad_compute=True
    )
    mlp = te.LayerNormMLP(
        HIDDEN,
        FFN,
        activation="swiglu",
        normalization="RMSNorm",
        params_dtype=torch.float32,
        device=device,
        delay_wgrad_compute=True,
    )
    return norm_in, mlp, head


def main():
    torch.manual_seed(1234)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    norm_in, mlp, head = build(device, recipe)
    sample = torch.randn(TOKENS, HIDDEN, device=device, requires_grad=True)
    head_graphed = te.make_graphed_callables(head, (sample,), enabled=True, recipe=recipe)
    offload, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    params = [*norm_in.parameters(), *mlp.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=2.0)
    x = torch.randn(TOKENS, HIDDEN, device=device)
    target = torch.randn(TOKENS, HIDDEN, device=device) * 0.1
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            with offload:
                h = norm_in(x)
            h = sync(h)
            with offload:
                h = h + mlp(h)
            h = sync(h)
        out = head_graphed(h)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        assert norm_in.weight.grad is None and mlp.fc1_weight.grad is None, "wgrad not deferred"
        for module in (mlp, norm_in):
            module.backward_dw()
        assert norm_in.weight.grad is not None and mlp.fc2_weight.grad is not None
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step} loss {losses[-1]:.6f}")
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.95 * losses[0], losses
    print(f"engine {transformer_engine.__version__} {te.Linear.__module__}")


if __name__ == "__main__":
    main()
