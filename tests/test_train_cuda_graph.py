"""`python -m torchte.train --cuda-graph` on the CPU: the option and its checks, what each run
captures (whole blocks, MoE layers with device split sizes; only the attention where the
experts' GEMMs need host sizes), and the capture path itself, which on the CPU runs the blocks
eagerly under the same autocast regions (make_graphed_callables' CPU behaviour): losses,
evaluation and resume equal the eager run's bit for bit. Replays on a GPU:
test_train_cuda_graph_gpu.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_train import losses, tiny, write_corpus
from tolerances import assert_close

from torchte.train import arguments, cli, cuda_graph, data, loop, model, moe
from torchte.train.config import RunConfig


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return write_corpus(tmp_path)


def _trainer(corpus_dir: Path, out: Path, recipe: str, graphs: bool, *extra: str) -> loop.Trainer:
    """A Trainer of the tiny test run, with config.cuda_graph as `graphs` (set directly: the
    command line refuses it on the CPU)."""
    model_config, config = cli.parse_args(tiny(corpus_dir, out, "--recipe", recipe, *extra))
    config = dataclasses.replace(config, cuda_graph=graphs)
    corpus = data.load_corpus(config.data, config.max_bytes, model_config.seq_len)
    return loop.Trainer(recipe, model_config, config, corpus)


def _cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """parse_args as on a machine with a GPU (nothing runs there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# -- the option ----------------------------------------------------------------------------------


def test_auto_is_off_on_the_cpu_and_says_why() -> None:
    _, config = cli.parse_args(["--device", "cpu"])
    assert not config.cuda_graph
    assert config.cuda_graph_reason == "auto: not with --device cpu, CUDA graphs need a GPU"
    _, config = cli.parse_args(["--device", "cpu", "--cuda-graph", "off"])
    assert (config.cuda_graph, config.cuda_graph_reason) == (False, "--cuda-graph off")


def test_on_is_refused_on_the_cpu_naming_the_conflict(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--device", "cpu", "--cuda-graph", "on"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--cuda-graph on is not supported with --device cpu (CUDA graphs need a GPU)" in err
    assert "use --cuda-graph off" in err


def test_bad_mode_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--device", "cpu", "--cuda-graph", "yes"])
    assert info.value.code == 2
    assert "invalid choice: 'yes'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--cuda-graph must be one of auto, on, off, got yes"):
        cuda_graph.resolve_cuda_graph("yes", "cuda")


def test_on_a_gpu_auto_is_on_with_experts_and_packed_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _cuda(monkeypatch)
    dense = ["--device", "cuda", "--recipe", "bf16", "--compute-dtype", "bf16"]
    _, config = cli.parse_args(dense)
    assert (config.cuda_graph, config.cuda_graph_reason) == (
        False,
        "auto: dense blocks run eagerly (--cuda-graph on captures them)",
    )
    base = [*dense, "--experts", "4"]
    _, config = cli.parse_args(base)
    assert (config.cuda_graph, config.cuda_graph_reason) == (
        True,
        "auto: experts, one process on a GPU",
    )
    _, config = cli.parse_args([*base, "--cuda-graph", "on"])
    assert (config.cuda_graph, config.cuda_graph_reason) == (True, "--cuda-graph on")
    _, config = cli.parse_args([*base, "--packed"])
    assert not config.cuda_graph and config.cuda_graph_reason.startswith("auto: not with --packed")
    with pytest.raises(SystemExit) as info:
        cli.parse_args([*base, "--packed", "--cuda-graph", "on"])
    assert info.value.code == 2
    assert "--cuda-graph on is not supported with --packed (the packed attention" in (
        capsys.readouterr().err
    )


def test_every_conflict_is_named() -> None:
    with pytest.raises(ValueError) as info:
        cuda_graph.resolve_cuda_graph("on", "cpu", tp=2, fsdp=True, packed=True)
    message = str(info.value)
    for option in ("--device cpu", "--tp 2", "--fsdp", "--packed"):
        assert option in message
    assert cuda_graph.resolve_cuda_graph("auto", "cuda", tp=2) == (
        False,
        "auto: not with --tp 2, its collectives run inside the blocks",
    )
    assert cuda_graph.resolve_cuda_graph("off", "cuda") == (False, "--cuda-graph off")


def test_run_config_refuses_graphs_over_several_processes() -> None:
    _, config = cli.parse_args(["--device", "cpu"])
    for extra in ({"tp": 2}, {"fsdp": True}, {"ep": 2}, {"cp": 2}):
        with pytest.raises(ValueError, match="does not go with --tp, --ep, --cp or --fsdp"):
            dataclasses.replace(config, cuda_graph=True, **extra)
    assert dataclasses.replace(config, cuda_graph=True).cuda_graph  # one process: allowed


# -- what is captured ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "experts", "whole", "splits"),
    [
        ("bf16", 0, True, None),
        ("mxfp8", 0, True, None),
        ("delayed", 4, True, True),
        ("current", 4, True, True),
        ("block", 4, True, True),
        ("mxfp8", 4, False, None),
        ("nvfp4", 4, False, None),
        ("bf16", 4, False, None),  # no torch._grouped_mm on the CPU
    ],
)
def test_plan_captures_whole_blocks_where_the_experts_allow(
    recipe: str, experts: int, whole: bool, splits: bool | None
) -> None:
    model_config, config = cli.parse_args(["--device", "cpu", "--experts", str(experts or 2)])
    model_config = dataclasses.replace(model_config, experts=experts)
    on = dataclasses.replace(config, cuda_graph=True)
    plan = cuda_graph.plan_graphs(recipe, model_config, on)
    assert (plan.whole_blocks, plan.moe_device_splits) == (whole, splits)
    assert ("attention of each" in plan.note) == (not whole)
    assert cuda_graph.plan_graphs(recipe, model_config, config) is None  # off


def test_bf16_experts_are_captured_where_grouped_mm_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    model_config, config = cli.parse_args(["--device", "cpu", "--experts", "2"])
    config = dataclasses.replace(config, cuda_graph=True, compute_dtype="bf16")
    monkeypatch.setattr(cuda_graph, "grouped_mm_supported", lambda *args: True)
    assert cuda_graph.plan_graphs("bf16", model_config, config).moe_device_splits is True
    fp32 = dataclasses.replace(config, compute_dtype="fp32")  # the per-group path: host sizes
    assert cuda_graph.plan_graphs("bf16", model_config, fp32).whole_blocks is False


@pytest.mark.parametrize(("recipe", "graphs", "splits"), [
    ("delayed", True, True), ("delayed", False, False), ("mxfp8", True, False),
])  # fmt: skip
def test_moe_layers_get_device_splits_when_captured(
    recipe: str, graphs: bool, splits: bool, corpus_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(corpus_dir, tmp_path, recipe, graphs, "--experts", "2")
    layers = [m for m in trainer.model.modules() if isinstance(m, moe.MoEMLP)]
    assert len(layers) == 2 and all(layer.device_splits is splits for layer in layers)
    assert moe.DEVICE_SPLITS is False  # the module's default is left alone


# -- the capture path (eager on the CPU) ---------------------------------------------------------


def _steps_and_evals(trainer: loop.Trainer, steps: int, eval_every: int = 1) -> list[float]:
    """The train losses of `steps` steps, with the validation loss every `eval_every`."""
    out = []
    for step in range(1, steps + 1):
        out.append(trainer.train_step().item())
        if step % eval_every == 0:
            out.append(trainer.evaluate())
    return out


@pytest.mark.parametrize("recipe", ["bf16", "delayed", "current"])
def test_graphed_dense_run_equals_eager_bit_for_bit(
    recipe: str, corpus_dir: Path, tmp_path: Path
) -> None:
    """Per-block autocast regions (the capture's) give what one region over the model gives,
    delayed scaling's updates included; evaluation runs the blocks eagerly."""
    eager = _trainer(corpus_dir, tmp_path, recipe, False)
    graphed = _trainer(corpus_dir, tmp_path, recipe, True)
    assert graphed.graphed is None  # captured at the first step
    expected = _steps_and_evals(eager, 3)
    got = _steps_and_evals(graphed, 3)
    assert graphed.graphed == tuple(graphed.model.blocks)
    assert all("forward" in block.__dict__ for block in graphed.model.blocks)
    assert got == expected
    for before, after in zip(
        model.scaling_snapshot(eager.model), model.scaling_snapshot(graphed.model), strict=True
    ):
        assert before.keys() == after.keys()
        for key, value in before.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[key])), key
    graphed.release_graphs()
    assert graphed.graphed is None
    assert not any("forward" in block.__dict__ for block in graphed.model.blocks)


@pytest.mark.parametrize(("recipe", "captured"), [("delayed", "blocks"), ("mxfp8", "attention")])
def test_graphed_moe_run_matches_eager(
    recipe: str, captured: str, corpus_dir: Path, tmp_path: Path
) -> None:
    """With experts: device split sizes (whole blocks) or only the attention captured; the
    losses are the eager run's within bf16's tolerance (the compute dtype; the device-split
    buffer has spare rows, so GEMMs may round differently)."""
    eager = _trainer(corpus_dir, tmp_path, recipe, False, "--experts", "2")
    graphed = _trainer(corpus_dir, tmp_path, recipe, True, "--experts", "2")
    expected = _steps_and_evals(eager, 2, eval_every=2)
    got = _steps_and_evals(graphed, 2, eval_every=2)
    blocks = graphed.model.blocks
    want = tuple(blocks) if captured == "blocks" else tuple(b.self_attention for b in blocks)
    assert graphed.graphed == want
    assert_close(torch.tensor(got), torch.tensor(expected), torch.bfloat16)


def test_graphed_run_prints_saves_and_resumes_bit_for_bit(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    """The whole program with graphs on (forced past the CPU check): the header and the plan
    are printed, the graphs are freed after the run, and a run stopped, saved and resumed
    (captured again after the resume) logs the uninterrupted run's losses, which are the
    eager run's."""
    args = tiny(corpus_dir, tmp_path / "out", "--recipe", "delayed", "--eval-every", "3")
    eager = cli.train(args)
    monkeypatch.setattr(arguments, "resolve_cuda_graph", lambda *a: (True, "forced by the test"))
    seen = []
    monkeypatch.setattr(loop.Trainer, "release_graphs", _recording(seen))
    whole = cli.train(args)
    out = capsys.readouterr().out
    assert "CUDA graphs on (forced by the test)" in out
    assert "[delayed] CUDA graphs: each of the 2 blocks captured" in out
    assert seen == [True]  # the run freed its graphs
    assert losses(whole) == losses(eager)
    ckpt = tmp_path / "ckpt" / "run.pt"
    first = cli.train([*args, "--stop-at", "3", "--save", str(ckpt)])
    assert [r.steps for r in first] == [3]
    resumed = cli.train([*args, "--resume", str(ckpt)])
    assert losses(resumed) == losses(whole)


def _recording(seen: list):
    original = loop.Trainer.release_graphs

    def release(self: loop.Trainer) -> None:
        seen.append(self.graphed is not None)
        original(self)

    return release


def test_run_config_default_is_off() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert fields["cuda_graph"] is False and fields["cuda_graph_reason"] == ""
