"""Transformer Engine's module options that torchte does not implement: accepted while off (as
clients pass them on every construction), refused by name when on."""

from __future__ import annotations

import pytest
import torch

import torchte as te

OFF = {
    "ub_overlap_ag": False,
    "ub_overlap_rs": False,
    "ub_overlap_rs_dgrad": False,
    "ub_bulk_dgrad": False,
    "ub_bulk_wgrad": False,
    "ub_name": "qkv",
    "symmetric_ar_type": None,
    "delay_wgrad_compute": False,
    "save_original_input": False,
}
MODULES = {
    "Linear": lambda **kw: te.Linear(16, 16, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(16, 16, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(16, 32, **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(2, 16, 16, **kw),
}
ON = [
    ("ub_overlap_ag", True),
    ("ub_bulk_wgrad", True),
    ("symmetric_ar_type", "multimem_all_reduce"),
    ("delay_wgrad_compute", True),
    ("save_original_input", True),
]


@pytest.mark.parametrize("name", list(MODULES))
def test_options_off_are_accepted(name):
    module = MODULES[name](**OFF)
    assert sum(p.numel() for p in module.parameters()) > 0


# Options a module implements (tested in their own files), not refused.
IMPLEMENTED = {
    "Linear": {"delay_wgrad_compute", "save_original_input"},
    "LayerNormLinear": {"delay_wgrad_compute"},
    "LayerNormMLP": {"delay_wgrad_compute"},
    "GroupedLinear": {"delay_wgrad_compute", "save_original_input"},
}
REFUSED = [
    (name, option, value)
    for name in MODULES
    for option, value in ON
    if option not in IMPLEMENTED.get(name, ())
]


@pytest.mark.parametrize("name,option,value", REFUSED)
def test_options_on_are_refused_by_name(name, option, value):
    with pytest.raises(NotImplementedError, match=f"{option}={value!r}"):
        MODULES[name](**{option: value})


@pytest.mark.parametrize("name", list(MODULES))
def test_unknown_arguments_stay_type_errors(name):
    with pytest.raises(TypeError, match="ub_overlap_everything"):
        MODULES[name](ub_overlap_everything=False)


@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
def test_norms_take_transformer_engines_forms(cls):
    """normalized_shape (an int or a 1-sequence) and dtype, as Transformer Engine's norms do."""
    make = getattr(te, cls)
    norm = make(normalized_shape=(24,), dtype=torch.bfloat16, device="cpu")
    assert norm.weight.shape == (24,) and norm.weight.dtype == torch.bfloat16
    assert make(24, params_dtype=torch.float16, dtype=torch.float16).weight.dtype == torch.float16
    with pytest.raises(ValueError, match="disagree"):
        make(24, params_dtype=torch.float32, dtype=torch.bfloat16)
