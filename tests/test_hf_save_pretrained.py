"""HF transformers' save_pretrained / from_pretrained of a model holding te modules (safetensors
files): every state_dict value is a tensor (the modules' _extra_state included), and a model
that ran a delayed-scaling FP8 step comes back with its parameters and scaling state."""

from __future__ import annotations

import pytest
import torch
from transformers.configuration_utils import PretrainedConfig
from transformers.modeling_utils import PreTrainedModel

import torchte as te
from torchte.recipe import DelayedScaling

pytestmark = pytest.mark.usefixtures("cpu_default_device")

RECIPE = DelayedScaling(amax_history_len=4)


class TinyTEModel(PreTrainedModel):
    config_class = PretrainedConfig

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.proj = te.Linear(32, 48, params_dtype=torch.float32)
        self.mlp = te.LayerNormMLP(48, 64, params_dtype=torch.float32)
        self.block = te.TransformerLayer(48, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
        self.post_init()  # transformers' bookkeeping of a model's weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.mlp(self.proj(x)))


def fp8_step(model: TinyTEModel, seed: int) -> torch.Tensor:
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(seed))
    with te.autocast(recipe=RECIPE):
        y = model(x)
    y.float().sum().backward()
    return y.detach()


def test_save_pretrained_then_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = TinyTEModel(PretrainedConfig())
    for seed in range(2):
        fp8_step(model, seed)
    assert all(isinstance(v, torch.Tensor) for v in model.state_dict().values())
    model.save_pretrained(tmp_path / "tiny")
    loaded = TinyTEModel.from_pretrained(tmp_path / "tiny")
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert any(name.endswith("_extra_state") and v.numel() for name, v in got.items())
    assert torch.equal(fp8_step(loaded, 5), fp8_step(model, 5)), "the next FP8 step differs"
