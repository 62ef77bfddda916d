"""Transformer Engine's helpers that Megatron-Core's CUDA-graph code and tensor-parallel layers
reach, on torchte's state: the graph flags and the delayed-scaling snapshot (graphs/state.py),
FP8GlobalStateManager's buffer, skip flag and quantization_state (fp8.py, fp8_state.py), the
recompute flags (recompute.py), the collectives' Transformer Engine arguments and the RNG states
(distributed/), and the utils (utils.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from ranks import on_ranks

import torchte as te
from torchte import recipe
from torchte import utils as te_utils
from torchte.autocast import autocast_state
from torchte.fp8 import FP8GlobalStateManager as Manager
from torchte.fp8_state import owed_backward
from torchte.graphs import (
    is_graph_capturing,
    make_graphed_callables,
    restore_fp8_tensors,
    save_fp8_tensors,
    set_capture_end,
    set_capture_start,
)
from torchte.quantization import Float8CurrentScalingQuantizer, Float8Storage
from torchte.quantization.delayed import DelayedScalingState

DELAYED = recipe.DelayedScaling(amax_history_len=4)


@pytest.fixture
def clean_manager():
    """FP8GlobalStateManager and the capture flag as a new process has them, before and after."""
    Manager.reset()
    set_capture_end()
    yield
    Manager.reset()
    set_capture_end()


def _linear(seed: int = 0) -> te.Linear:
    torch.manual_seed(seed)
    return te.Linear(32, 16, device="cpu")


def _step(model, x: torch.Tensor, rec=DELAYED) -> torch.Tensor:
    """One training step's forward and backward under `rec`; the output."""
    with te.autocast(recipe=rec):
        y = model(x)
    y.sum().backward()
    return y.detach()


def _forward(model, x: torch.Tensor, rec=DELAYED) -> torch.Tensor:
    with torch.no_grad(), te.autocast(recipe=rec):
        return model(x)


def _state_tensors(model, history_len: int = 4) -> list[torch.Tensor]:
    out = []
    for module in model.modules():
        pair = getattr(module, "_delayed_states", {}).get(history_len)
        for state in pair or ():
            out += [state.scale.clone(), state.amax_history.clone(), state.nonfinite.clone()]
    return out


# -- graph: capture flags and the delayed-scaling snapshot ----------------------------------------


def test_capture_flags(clean_manager):
    assert not is_graph_capturing()
    set_capture_start()
    assert is_graph_capturing()
    set_capture_end()
    assert not is_graph_capturing()
    model = _linear()
    make_graphed_callables(model, (torch.randn(4, 32),))  # CPU: eager, under the flag
    assert not is_graph_capturing()  # put back as it was
    set_capture_start()
    make_graphed_callables(_linear(), (torch.randn(4, 32),))
    assert is_graph_capturing()  # a client's capture around it is not ended by it


def test_save_restore_round_trip_gives_back_the_forward_bit_for_bit(clean_manager):
    model = torch.nn.Sequential(_linear(), torch.nn.ReLU(), te.Linear(16, 16, device="cpu"))
    for k in range(2):
        _step(model, torch.randn(8, 32) * (k + 1))
    x = torch.randn(8, 32)
    saved = save_fp8_tensors([model], DELAYED)
    assert [entry is None for entry in saved] == [True, False, True, False]
    assert saved[1]["amax_history_len"] == 4 and len(saved[1]["scaling_fwd"]) == 2
    state_at_save = _state_tensors(model)
    y_at_save = _forward(model, x)
    for k in range(3):  # larger inputs: larger amaxes, smaller scales
        _step(model, torch.randn(8, 32) * 8 * (k + 2))
    assert not torch.equal(_forward(model, x), y_at_save)
    kept = copy.copy(saved)
    restore_fp8_tensors([model], saved)
    assert saved == kept  # the snapshot is not consumed
    for now, then in zip(_state_tensors(model), state_at_save, strict=True):
        assert torch.equal(now, then)
    assert torch.equal(_forward(model, x), y_at_save)  # FP8 weights requantized: bit for bit


def test_state_made_after_the_save_is_reset_and_other_recipes_save_nothing(clean_manager):
    model = _linear()
    saved = save_fp8_tensors([model], DELAYED)
    assert saved == [{"amax_history_len": 4}]  # no state of this history length yet
    _step(model, torch.randn(8, 32))
    assert not torch.equal(_state_tensors(model)[1], torch.zeros(4, 3))
    restore_fp8_tensors([model], saved)
    fwd_scale, fwd_history, fwd_count, bwd_scale, bwd_history, _ = _state_tensors(model)
    assert torch.equal(fwd_scale, torch.ones(3)) and torch.equal(bwd_scale, torch.ones(2))
    assert not fwd_history.any() and not bwd_history.any() and not fwd_count.any()
    assert save_fp8_tensors([model], recipe.Float8CurrentScaling()) is None
    assert save_fp8_tensors([model], None) is None
    restore_fp8_tensors([model], None)  # nothing to do


def test_restore_refuses_a_snapshot_of_other_modules(clean_manager):
    model = _linear()
    _step(model, torch.randn(8, 32))
    saved = save_fp8_tensors([model], DELAYED)
    with pytest.raises(RuntimeError, match="1 entries but the modules have 2 submodules"):
        restore_fp8_tensors([model, torch.nn.ReLU()], saved)
    with pytest.raises(RuntimeError, match="submodule 0 is a ReLU"):
        restore_fp8_tensors([torch.nn.ReLU()], saved)
    wide = te.Linear(32, 16, device="cpu")
    wide_saved = [dict(saved[0], scaling_fwd=[torch.ones(6), torch.zeros(4, 6)])]
    with pytest.raises(RuntimeError, match=r"entry 0 \(scaling_fwd\).*shape \(4, 6\)"):
        restore_fp8_tensors([wide], wide_saved)
    with pytest.raises(TypeError, match=r"modules must hold nn\.Modules"):
        save_fp8_tensors(["not a module"], DELAYED)
    with pytest.raises(TypeError, match=r"iterable of nn\.Modules"):
        save_fp8_tensors(model, DELAYED)


# -- FP8GlobalStateManager ------------------------------------------------------------------------


def test_add_to_global_buffer_owes_the_forward_update_a_replay_did_not_register(clean_manager):
    eager, replayed, forgotten = _linear(), _linear(), _linear()
    x = torch.randn(8, 32)
    for model in (eager, replayed, forgotten):  # triplets: the same state
        _step(model, x)
    with te.autocast(recipe=DELAYED):
        eager(x)
    for model in (replayed, forgotten):
        with te.autocast(recipe=DELAYED):
            model(x)  # records the amaxes eager's forward recorded, but as a graph replay
            autocast_state().pending_forward.clear()  # would, registers no update
            if model is replayed:
                Manager.add_fp8_tensors_to_global_buffer(model)  # owed now: made at the exit
    for a, b in zip(_state_tensors(eager), _state_tensors(replayed), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(_state_tensors(forgotten)[1], _state_tensors(eager)[1])


def test_reduce_and_update_updates_the_owed_states_once(clean_manager):
    bwd = DelayedScalingState(False, 4, torch.device("cpu"))
    twin = DelayedScalingState(False, 4, torch.device("cpu"))
    for state in (bwd, twin):
        state.amax_history[0].copy_(torch.tensor([3.0, 0.5]))
    meta = {"recipe": DELAYED, "fp8_group": None, "scaling_fwd": None, "scaling_bwd": bwd}
    Manager.add_fp8_tensors_to_global_buffer(meta)
    Manager.add_fp8_tensors_to_global_buffer(meta)  # once per state however often added
    Manager.reduce_and_update_fp8_tensors(forward=True)  # another direction: not touched
    assert torch.equal(bwd.scale, torch.ones(2))
    Manager.reduce_and_update_fp8_tensors(forward=False)
    twin.update(DELAYED)
    assert torch.equal(bwd.scale, twin.scale) and not torch.equal(bwd.scale, torch.ones(2))
    assert torch.equal(bwd.amax_history, twin.amax_history)
    Manager.reduce_and_update_fp8_tensors(forward=False)  # nothing owed any more
    assert torch.equal(bwd.amax_history, twin.amax_history)
    Manager.add_fp8_tensors_to_global_buffer({"recipe": recipe.Float8CurrentScaling()})
    with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=7)):
        Manager.add_fp8_tensors_to_global_buffer(_linear())  # no state of that length: nothing
        assert not autocast_state().pending_forward
    assert not owed_backward()
    with pytest.raises(TypeError, match="must be a te module or a dict"):
        Manager.add_fp8_tensors_to_global_buffer(["scaling_fwd"])
    with pytest.raises(TypeError, match=r"fp8_meta\['scaling_bwd'\] must be a torchte"):
        Manager.add_fp8_tensors_to_global_buffer({"recipe": DELAYED, "scaling_bwd": 1.0})
    with pytest.raises(TypeError, match="forward must be a bool"):
        Manager.reduce_and_update_fp8_tensors(forward="yes")


def test_forward_update_asked_inside_a_region_is_not_made_again_at_its_exit(clean_manager):
    by_hand, at_exit = _linear(), _linear()
    x = torch.randn(8, 32)
    with te.autocast(recipe=DELAYED):
        by_hand(x)
        Manager.reduce_and_update_fp8_tensors(forward=True)
    with te.autocast(recipe=DELAYED):
        at_exit(x)
    for a, b in zip(_state_tensors(by_hand), _state_tensors(at_exit), strict=True):
        assert torch.equal(a, b)


def test_quantization_state_and_skip_flag(clean_manager):
    state = Manager.quantization_state
    assert state.skip_fp8_weight_update_tensor is None
    assert Manager.get_skip_fp8_weight_update_tensor() is None
    Manager.set_skip_fp8_weight_update_tensor(True)
    flag = Manager.get_skip_fp8_weight_update_tensor()
    assert flag.shape == (1,) and flag.dtype == torch.float32 and flag.item() == 1.0
    Manager.set_skip_fp8_weight_update_tensor(False)
    assert Manager.get_skip_fp8_weight_update_tensor() is flag and flag.item() == 0.0
    assert state.fp8_recipe is None and not state.fp8_enabled and state.autocast_depth == 0
    current = recipe.Float8CurrentScaling()
    with te.autocast(recipe=current):
        assert state.fp8_enabled and state.fp8_recipe == current and state.autocast_depth == 1
        assert state.is_first_fp8_module
        assert Manager.is_first_fp8_module() and not state.is_first_fp8_module
        state.is_first_fp8_module = True  # written through to te.autocast's state
        assert Manager.is_first_fp8_module()
        assert Manager.get_autocast_state() == Manager.get_fp8_autocast_state()
    assert not state.fp8_parameters and not state.high_precision_init_val
    with te.quantized_model_init(preserve_high_precision_init_val=True):
        assert state.fp8_parameters and Manager.with_high_precision_init_val()
    assert not Manager.fp8_graph_capturing() and not state.fp8_graph_capturing
    with pytest.raises(TypeError, match="must be a Recipe"):
        state.fp8_recipe = "delayed"
    Manager.reset()
    assert Manager.get_skip_fp8_weight_update_tensor() is None
    assert Manager.get_meta_tensor_key(False) == "scaling_bwd"


# -- recompute flags and te.checkpoint's keyword arguments ----------------------------------------


def test_recompute_flags():
    arf = te.distributed.activation_recompute_forward
    assert not te.distributed.is_fp8_activation_recompute_enabled()
    with te.autocast(recipe=DELAYED):
        with arf(activation_recompute=True, recompute_phase=False):
            assert te.distributed.is_fp8_activation_recompute_enabled()
            assert not te.distributed.in_fp8_activation_recompute_phase()
            with arf():  # activation_recompute=False: flags off inside, back after
                assert not te.distributed.is_fp8_activation_recompute_enabled()
            assert te.distributed.is_fp8_activation_recompute_enabled()
        with arf(activation_recompute=True, recompute_phase=True):
            assert te.distributed.in_fp8_activation_recompute_phase()
    with te.autocast(enabled=False), arf(activation_recompute=True):
        assert not te.distributed.is_fp8_activation_recompute_enabled()  # FP8 off
    assert not te.distributed.in_fp8_activation_recompute_phase()
    seen = []

    def block(x):
        seen.append(
            (
                te.distributed.is_fp8_activation_recompute_enabled(),
                te.distributed.in_fp8_activation_recompute_phase(),
            )
        )
        return torch.exp(x)  # saves its output: backward recomputes it

    with te.autocast(recipe=DELAYED):
        y = te.checkpoint(block, torch.ones(3, requires_grad=True))
    y.sum().backward()
    assert seen == [(True, False), (True, True)]


def _checkpoint_without_output(model, x, first_forward: bool, kept):
    """Megatron-Core's CheckpointWithoutOutput with fp8: a forward without grad, and later its
    recompute with grad under the same recipe."""
    arf = te.distributed.activation_recompute_forward
    if first_forward:
        with torch.no_grad(), arf(activation_recompute=True, recompute_phase=False):
            return model(x)
    recompute = arf(activation_recompute=True, recompute_phase=True)
    with torch.enable_grad(), te.fp8_autocast(fp8_recipe=DELAYED), recompute:
        return model(kept)


def test_activation_recompute_forward_recomputes_bit_for_bit_in_reverse_order():
    a, b = _linear(), _linear(1)
    a_ref, b_ref = copy.deepcopy(a), copy.deepcopy(b)
    xa, xb = torch.randn(8, 32), torch.randn(8, 32)
    warm = torch.randn(8, 32) * 4
    for model in (a, b, a_ref, b_ref):  # the scales move at each step
        _step(model, warm)
    with te.autocast(recipe=DELAYED):
        ya = _checkpoint_without_output(a, xa, True, None)
        yb = _checkpoint_without_output(b, xb, True, None)
        ya_ref, yb_ref = a_ref(xa), b_ref(xb)
    assert torch.equal(ya, ya_ref) and torch.equal(yb, yb_ref)
    # Backward: b's recompute before a's, each with the scales its first forward used.
    yb2 = _checkpoint_without_output(b, None, False, xb)
    ya2 = _checkpoint_without_output(a, None, False, xa)
    assert torch.equal(yb2, yb) and torch.equal(ya2, ya)
    ya2.sum().backward()
    yb2.sum().backward()
    ya_ref.sum().backward()
    yb_ref.sum().backward()
    for model, ref in ((a, a_ref), (b, b_ref)):
        assert torch.equal(model.weight.grad, ref.weight.grad)
        for mine, theirs in zip(_state_tensors(model), _state_tensors(ref), strict=True):
            assert torch.equal(mine, theirs)  # the recompute left no trace


def test_checkpoint_takes_transformer_engines_arguments():
    tracker = te.distributed.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)

    def block(x, scale=1.0):
        with tracker.fork():
            return torch.nn.functional.dropout(x, 0.5) * scale

    x = torch.ones(64, requires_grad=True)
    y = te.distributed.checkpoint(
        block, x, scale=3.0, use_reentrant=True, distribute_saved_activations=False,
        get_rng_state_tracker=lambda: tracker, tp_group=None, determinism_check="none",
    )  # fmt: skip
    y.sum().backward()
    assert torch.equal(x.grad, (y.detach() != 0).float() * 3.0 * 2)  # replayed mask
    x.grad = None
    y = te.distributed.checkpoint(block, False, lambda: tracker, None, x)  # TE 1.x's form
    y.sum().backward()
    assert torch.equal(x.grad, (y.detach() != 0).float() * 2)


def test_all_rng_states_are_the_last_trackers():
    tracker = te.distributed.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 11)
    states = te.distributed.get_all_rng_states()
    assert states is tracker.states_ and set(states) == {"model-parallel-rng"}
    with tracker.fork():
        torch.rand(3)
    assert torch.equal(te.distributed.get_all_rng_states()["model-parallel-rng"],
                       tracker.states_["model-parallel-rng"])  # fmt: skip
    other = te.distributed.CudaRNGStatesTracker()
    other.set_states({"data-parallel-rng": torch.get_rng_state()})
    assert set(te.distributed.get_all_rng_states()) == {"data-parallel-rng"}
    assert isinstance(te.distributed.graph_safe_rng_available(), bool)


# -- collectives on 2 gloo ranks ------------------------------------------------------------------

WORLD = 2


def _rank_collectives(rank: int) -> dict:
    dist = te.distributed
    x = torch.arange(12.0).view(3, 4) * (rank + 1) - 5
    out = torch.empty(6, 4)
    gathered, handle = dist.gather_along_first_dim(x, None, async_op=True, output_tensor=out)
    handle.wait()
    full = torch.arange(16.0).view(4, 4) + rank
    part_out = torch.full((2, 4), -1.0)
    part, _ = dist.reduce_scatter_along_first_dim(full, tp_group=None, output=part_out)
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    fp8, _ = dist.gather_along_first_dim(x, None, quantizer=quantizer)
    storage = quantizer.quantize(torch.ones(2, 16) * (rank + 1))
    storage_gathered, _ = dist.gather_along_first_dim(storage, None)
    errors = []
    for call in (
        lambda: dist.gather_along_first_dim(x, None, output_tensor=torch.empty(5, 4)),
        lambda: dist.reduce_scatter_along_first_dim(full, None, output=torch.empty(2, 3)),
    ):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    return {
        "gathered_is_out": gathered is out,
        "gathered": gathered,
        "part_is_out": part is part_out,
        "part": part,
        "fp8": fp8.dequantize(),
        "fp8_type": type(fp8).__name__,
        "storage": storage_gathered.dequantize(),
        "errors": errors,
    }


def test_collectives_with_transformer_engines_arguments_on_two_gloo_ranks(tmp_path):
    results = on_ranks(_rank_collectives, WORLD, tmp_path)
    inputs = torch.cat([torch.arange(12.0).view(3, 4) * (r + 1) - 5 for r in range(WORLD)])
    total = sum(torch.arange(16.0).view(4, 4) + r for r in range(WORLD))
    whole_fp8 = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(inputs).dequantize()
    for rank, got in enumerate(results):
        assert got["gathered_is_out"] and torch.equal(got["gathered"], inputs)
        assert got["part_is_out"] and torch.equal(got["part"], total[2 * rank : 2 * rank + 2])
        assert got["fp8_type"] == "Float8Storage"
        assert torch.equal(got["fp8"], whole_fp8)  # the bytes of the whole tensor's cast
        # Both ranks' bytes (the same), with this rank's scale_inv.
        assert torch.equal(got["storage"], torch.full((4, 16), rank + 1.0))
        assert len(got["errors"]) == 2 and all("must have shape" in e for e in got["errors"])


def test_one_rank_collectives_quantize_or_pass_through():
    x = torch.randn(4, 16)
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    out, handle = te.distributed.gather_along_first_dim(x, None, quantizer=quantizer)
    assert isinstance(out, Float8Storage) and handle is None
    assert torch.equal(out.dequantize(), quantizer.quantize(x).dequantize())
    same, _ = te.distributed.reduce_scatter_along_first_dim(x, tp_group=None, output=None)
    assert same is x


# -- utils ----------------------------------------------------------------------------------------


def test_integer_helpers():
    assert [te_utils.round_up_to_nearest_multiple(v, 128) for v in (0, 1, 128, 129)] == [
        0,
        128,
        128,
        256,
    ]
    assert te_utils.ceil_div(7, 2) == 4 and te_utils.ceil_div(-3, 2) == -1
    with pytest.raises(ValueError, match="multiple cannot be zero"):
        te_utils.round_up_to_nearest_multiple(3, 0)
    with pytest.raises(ValueError, match="denominator cannot be zero"):
        te_utils.ceil_div(3, 0)


def test_nvtx_ranges_check_their_messages(monkeypatch):
    te_utils._nvtx_enabled.cache_clear()
    monkeypatch.setenv("NVTE_NVTX_ENABLED", "0")
    te_utils.nvtx_range_pop("never pushed")  # off: nothing checked
    te_utils._nvtx_enabled.cache_clear()
    monkeypatch.setenv("NVTE_NVTX_ENABLED", "1")
    try:
        te_utils.nvtx_range_push("outer")
        te_utils.nvtx_range_push("inner")
        with pytest.raises(ValueError, match="'outer' is not the innermost open range"):
            te_utils.nvtx_range_pop("outer")
        te_utils.nvtx_range_pop("inner")
        te_utils.nvtx_range_pop()
        with pytest.raises(RuntimeError, match="no NVTX range is open"):
            te_utils.nvtx_range_pop()
    finally:
        te_utils._NVTX_MESSAGES.clear()
        te_utils._nvtx_enabled.cache_clear()


def test_make_weak_ref_keeps_cpu_values_and_rebuilds_containers():
    t = torch.randn(3)
    nested = {"a": (t, [1, 2.5, None, True])}
    weak = te_utils.make_weak_ref(nested)
    assert weak == nested and weak is not nested and weak["a"][0] is t
    assert te_utils.make_weak_ref(t) is t
    with pytest.raises(TypeError, match="cannot make a weak reference to a str"):
        te_utils.make_weak_ref(("x",))


# -- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_make_weak_ref_aliases_cuda_memory_without_keeping_it():
    torch.cuda.synchronize()
    base = torch.arange(24.0, device="cuda").view(4, 6)
    view = base[:, 1:4]  # strided
    weak = te_utils.make_weak_ref(view)
    assert weak.data_ptr() == view.data_ptr() and weak.stride() == view.stride()
    assert torch.equal(weak, view)
    base.add_(1.0)
    assert torch.equal(weak, view)  # the same memory
    half = te_utils.make_weak_ref(torch.ones(5, dtype=torch.bfloat16, device="cuda"))
    assert half.dtype == torch.bfloat16
    before = torch.cuda.memory_allocated()
    big = torch.empty(1 << 20, device="cuda")
    weak_big = te_utils.make_weak_ref(big)
    del big
    assert torch.cuda.memory_allocated() == before  # the weak tensor kept nothing allocated
    del weak_big


@pytest.mark.gpu
def test_flags_while_make_graphed_callables_captures(clean_manager):
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = te.Linear(32, 16)

        def forward(self, x):
            seen.append((is_graph_capturing(), Manager.fp8_graph_capturing()))
            return self.linear(x)

    model = Probe().cuda()
    x = torch.randn(16, 32, device="cuda", requires_grad=True)
    with te.autocast(recipe=DELAYED):
        model(x).sum().backward()
    saved = save_fp8_tensors([model], DELAYED)
    state_before = _state_tensors(model)
    graphed = make_graphed_callables(model, (x,), enabled=True, recipe=DELAYED)
    assert seen[1:] and all(flags == (True, True) for flags in seen[1:])
    assert not is_graph_capturing() and not Manager.fp8_graph_capturing()
    restore_fp8_tensors([model], saved)
    for now, then in zip(_state_tensors(model), state_before, strict=True):
        assert torch.equal(now, then)
    with te.autocast(recipe=DELAYED):
        graphed(x).sum().backward()
    assert not torch.equal(_state_tensors(model)[1], state_before[1])  # the replay recorded
